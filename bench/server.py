#!/usr/bin/env python3
"""The parameter server's push-processing rate against the raw MPI bandwidth between two ranks.

    python bench/server.py                     # P = 4M float32; 1, 2, 3 workers; 3 rounds (about 40 s)
    python bench/server.py --workers 1,2 --rounds 5 --pushes 400
    python bench/server.py --sweep             # the optimizer alone, one process: block-size sweep

One mpiexec job (this script starts it) measures, alternating, in rounds:

  raw     rank 1 sends a gradient message to rank 0 and rank 0 answers with a weights message,
          Isend/Irecv of protocol.message_bytes(P) bytes each (16 MB), busy-waiting in MPI Wait:
          the most two ranks can move. Rate = bytes in + bytes out at rank 0 per second.
  server  the real parameter server (rank 0's loop, mpiasgd.rank0.loop.Rank0, with the async role,
          mpiasgd.modes.asgd.AsgdServer), with SGD momentum 0.9 and weight decay 5e-4 as in the default
          config, serving K fake workers that compute nothing: each pushes
          a gradient the moment the reply to its last push has arrived, under the full protocol
          (stamped headers, STOP, EVAL). Rate = (gradient bytes in + weights bytes out) per second,
          over the applied pushes after a warm-up of 10 per worker.

Every server run is bracketed by raw measurements (the machine may be shared: its load drifts), and
its ratio is its rate over the mean of the two. It prints the median of each rate, the median ratio
server / raw (goal >= 0.8), pushes/s, and the server's time per push, split by timers the bench
wraps around the server's own methods: receive (the MPI receive of a push and its checks), update
(the optimizer step), send (waiting for the previous send to that worker, filling the send buffer,
posting the Isend), other (finite check, bookkeeping, log rows) and idle (polling for the next push).
Labelled extra rows: momentum 0 / weight decay 0, and nsync 2 (pushes are weight differences, added
by the server) where the config has `nsync`.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np

from mpiasgd.config import Config

NUM_TRAIN = 50_000   # training-set size that defines an epoch (CIFAR-10); only the log uses it
BATCH = 64           # samples a fake worker claims per push
WARMUP = 10          # applied pushes per worker left out of the rate (first touch of fresh buffers)


def layer_mask(size: int) -> np.ndarray:
    """Decay mask of a 4-layer model of `size` parameters: per layer a weight block (1.0) then its bias (0.0)."""
    biases = (64, 128, 256, 10)
    shares = np.array([0.05, 0.25, 0.6, 0.1]) * size
    weights = [int(s) - b for s, b in zip(shares[:-1], biases, strict=False)]
    weights.append(size - sum(weights) - sum(biases))
    return np.concatenate([np.full(n, value, np.float32)
                           for w, b in zip(weights, biases, strict=True) for n, value in ((w, 1.0), (b, 0.0))])


def runs(args: argparse.Namespace) -> list[tuple[str, int, dict]]:
    """The server configurations of one round: (label, workers, Config overrides)."""
    out = [(f"server, {k} worker{'s' if k > 1 else ''}", k, {}) for k in args.workers]
    k = min(2, max(args.workers))
    out.append((f"  {k} workers, momentum 0, weight decay 0", k, {"momentum": 0.0, "weight_decay": 0.0}))
    if "nsync" in Config.__dataclass_fields__:
        out.append((f"  {k} workers, nsync 2 (pushes are deltas)", k, {"nsync": 2}))
    return out


# ---------------------------------------------------------------------------------------------------
# the optimizer alone (--sweep)

def sweep(args: argparse.Namespace) -> None:
    """Milliseconds per update of P values for each block size; block = P is the unblocked formula."""
    from mpiasgd.optim import SGD, apply_delta

    P = args.params
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(P, dtype=np.float32)
    bufs = [rng.standard_normal(P, dtype=np.float32) for _ in range(2)]
    mask = layer_mask(P)
    scattered = mask.copy()
    scattered[::1000] = 0.0  # too many runs: the decay vector is read as an array

    def ms(fn: Any) -> float:
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    print(f"optimizer alone, P = {P:,} float32, median of {args.repeats}, ms per update "
          f"(memory copy of P values: {ms(lambda: np.copyto(bufs[1], bufs[0])):.2f} ms)")
    print(f"{'block':>9} | m 0.9 wd runs: out  in | wd array: out  in | m 0 wd 0: out  in | delta: out  in")
    for chunk in [*args.chunks, P]:
        row = []
        for m, wd, mk in ((0.9, 5e-4, mask), (0.9, 5e-4, scattered), (0.0, 0.0, mask)):
            opt = SGD(bufs[0], mk, m, wd, chunk=chunk)
            out_of_place = ms(lambda opt=opt: opt.step(grad, 0.01, out=bufs[1] if opt.params is bufs[0] else bufs[0]))
            row.append((out_of_place, ms(lambda opt=opt: opt.step(grad, 0.01))))
        row.append((ms(lambda c=chunk: apply_delta(bufs[0], grad, 0.5, out=bufs[1], chunk=c)),
                    ms(lambda c=chunk: apply_delta(bufs[0], grad, 0.5, chunk=c))))
        name = "P (none)" if chunk == P else f"{chunk:,}"
        print(f"{name:>9} | " + " | ".join(f"{a:14.2f} {b:5.2f}" for a, b in row), flush=True)


# ---------------------------------------------------------------------------------------------------
# the MPI job (--child)

def idle_wait(request: Any, what: str, rank: int, timeout: float) -> None:
    """Complete `request` polling every 2 ms: a rank with nothing to do leaves the cores to the others."""
    from mpiasgd.comms import CommTimeout

    deadline = time.perf_counter() + timeout
    while not request.Test():
        if time.perf_counter() > deadline:
            raise CommTimeout(f"rank {rank}: no {what} after {timeout:.0f} s")
        time.sleep(0.002)


def raw_exchange(comm: Any, P: int, exchanges: int) -> float:
    """(ranks 0 and 1) `exchanges` round trips gradient 1 -> 0, weights 0 -> 1; bytes/s at rank 0."""
    from mpi4py import MPI

    from mpiasgd.comms.protocol import Message, Tag

    rank = comm.Get_rank()
    inbox, outbox = Message(P), Message(P)
    if rank == 1:
        for _ in range(exchanges + 1):
            MPI.Request.Waitall([comm.Irecv(inbox.buf, source=0, tag=int(Tag.WEIGHTS)),
                                 comm.Isend(outbox.buf, dest=0, tag=int(Tag.PUSH))])
        return 0.0
    start = 0.0
    for i in range(exchanges + 1):  # the first round trip touches fresh buffers: not timed
        comm.Irecv(inbox.buf, source=1, tag=int(Tag.PUSH)).Wait()
        comm.Isend(outbox.buf, dest=1, tag=int(Tag.WEIGHTS)).Wait()
        if i == 0:
            start = time.perf_counter()
    return 2 * exchanges * inbox.buf.nbytes / (time.perf_counter() - start)


def fake_worker(comm: Any, cfg: Config, P: int) -> None:
    """(workers) Push a fixed finite gradient the moment each reply arrives, until STOP; then EVAL."""
    from mpi4py import MPI

    from mpiasgd.comms import protocol, wait
    from mpiasgd.comms.protocol import HEADER, Message, ProtocolError, Tag

    rank = comm.Get_rank()
    weights, push = Message(P), Message(P)
    push.payload[:] = np.random.default_rng(rank).standard_normal(P, dtype=np.float32) * np.float32(1e-3)
    delta = getattr(cfg, "nsync", 1) > 1
    status = MPI.Status()
    request = comm.Irecv(weights.buf, source=0, tag=MPI.ANY_TAG)
    sending, step = None, 0
    while True:
        wait(request, f"reply to push step {step} from rank 0", rank, cfg.comm_timeout, status)
        tag = protocol.parse_tag(status.Get_tag(), 0, rank)
        protocol.check_size(tag, 0, rank, status.Get_count(MPI.BYTE), P)
        protocol.check(weights, tag, 0, rank)
        wait(sending, f"completion of push step {step}", rank, cfg.comm_timeout)
        if tag == Tag.STOP:
            break
        if tag != Tag.WEIGHTS or int(weights.header["step"]) != step:
            raise ProtocolError(f"rank {rank}: expected WEIGHTS for step {step}, got {tag.name} for step "
                                f"{int(weights.header['step'])}")
        step += 1
        fields = {"step": step, "version": int(weights.header["version"]), "samples": BATCH, "epoch": 0,
                  "loss": 1.0, "compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0}
        if "flags" in HEADER.names:  # the protocol as it is: a delta push carries the DELTA flag and its lr
            fields.update(flags=int(protocol.Flag.DELTA) if delta else 0, lr=float(weights.header["lr"]))
        push.stamp(Tag.PUSH, rank, **fields)
        request = comm.Irecv(weights.buf, source=0, tag=MPI.ANY_TAG)  # posted before the push is sent
        sending = comm.Isend(push.buf, dest=0, tag=int(Tag.PUSH))
    result = Message(0).stamp(Tag.EVAL, rank, samples=0, correct=0, loss=0.0)
    wait(comm.Isend(result.buf, dest=0, tag=int(Tag.EVAL)), "completion of the EVAL send", rank, cfg.comm_timeout)


class Timers:
    """Wraps the server's methods with timers (the server is not changed): records (kind, end, seconds)."""

    def __init__(self, r0: Any) -> None:
        import mpiasgd.modes.asgd

        role, rec = r0.role, r0.rec
        self.calls: list[tuple[str, float, float]] = []
        self.applied: list[float] = []  # end time of each on_push that applied the push
        r0.handle = self.wrap("handle", r0.handle)
        role.send = self.wrap("send", role.send)
        role.optimizer.step = self.wrap("update", role.optimizer.step)
        on_push = self.wrap("on_push", role.on_push)

        def counted(*args: Any, **kwargs: Any) -> Any:
            version = rec.version
            result = on_push(*args, **kwargs)
            if rec.version > version:
                self.applied.append(self.calls[-1][1])
            return result

        role.on_push = counted  # the role's handlers() looks it up at every message
        self.module = mpiasgd.modes.asgd
        self.module_delta = self.module.apply_delta  # the nsync > 1 update
        self.module.apply_delta = self.wrap("update", self.module_delta)

    def wrap(self, kind: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self.calls.append((kind, end, end - t))
        return timed

    def restore(self) -> None:
        self.module.apply_delta = self.module_delta

    def result(self, skip: int, message_bytes: int) -> dict:
        """Rate and per-push split over the applied pushes after the first `skip`."""
        if len(self.applied) < skip + 10:
            raise RuntimeError(f"only {len(self.applied)} pushes applied; raise --pushes above {skip + 10}")
        start, end = self.applied[skip - 1], self.applied[-1]
        n = len(self.applied) - skip
        total = dict.fromkeys(("handle", "on_push", "update", "send"), 0.0)
        for kind, t, seconds in self.calls:
            if start < t <= end:
                total[kind] += seconds
        split = {"receive": total["handle"] - total["on_push"], "update": total["update"], "send": total["send"],
                 "other": total["on_push"] - total["update"] - total["send"], "idle": end - start - total["handle"]}
        return {"rate": 2 * n * message_bytes / (end - start), "pushes_s": n / (end - start),
                "split_ms": {k: 1e3 * v / n for k, v in split.items()}}


def serve(comm: Any, cfg: Config, P: int, workers: int, path: str) -> dict:
    """(server only) One run of the real parameter server (rank 0's loop with the async role); its rate and
    per-push split."""
    from mpiasgd.comms import protocol
    from mpiasgd.modes.asgd import AsgdServer
    from mpiasgd.rank0.loop import Rank0
    from mpiasgd.rank0.recorder import Recorder
    from mpiasgd.runlog import RunLog

    log = RunLog.create(path, {"config": cfg.to_json()}, [], P, cfg.flush_interval)
    rec = Recorder(cfg, log, range(1, workers + 1), NUM_TRAIN)
    r0 = Rank0(comm, cfg, rec, lambda r0: AsgdServer(r0, np.zeros(P, np.float32), layer_mask(P)))
    timers = Timers(r0)
    try:
        summary = r0.run()
    finally:
        timers.restore()
        log.close("done")
    if summary["rejected"]:
        raise RuntimeError(f"the server rejected {summary['rejected']} pushes")
    return timers.result(WARMUP * workers, protocol.message_bytes(P))


def child(args: argparse.Namespace) -> None:
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), args.params
    is_server = rank == 0
    base = Config(lr=0.01, lr_schedule="constant", warmup_epochs=0.0, epochs=0, max_pushes=args.pushes,
                  max_time=120.0, batch_size=BATCH, snapshot_interval=0, flush_interval=600.0, progress=False,
                  comm_timeout=60.0)
    plan = [(label, k, dataclasses.replace(base, **overrides).validate()) for label, k, overrides in runs(args)]
    comms = {k: comm.Split(0 if rank <= k else MPI.UNDEFINED, rank) for k in sorted({k for _, k, _ in plan})}
    rates: dict[str, list[dict]] = {label: [] for label, _, _ in plan}
    raw: list[float] = []  # (rank 0) every raw measurement, in order: one before each server run, one at the end

    def measure_raw() -> None:
        idle_wait(comm.Ibarrier(), "start of a raw exchange", rank, 120.0)
        if rank <= 1:
            raw.append(raw_exchange(comm, P, args.exchanges))

    with threadpool_limits(1, user_api="blas"), tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for i, (label, k, cfg) in enumerate(plan):
                measure_raw()
                idle_wait(comm.Ibarrier(), f"start of run '{label}'", rank, 120.0)
                if is_server:
                    result = serve(comms[k], cfg, P, k, os.path.join(workdir, f"r{r}-{i}.h5"))
                    rates[label].append({**result, "raw_index": len(raw) - 1})
                elif rank <= k:
                    fake_worker(comms[k], cfg, P)
            if is_server:
                print(f"round {r + 1}: raw " + " ".join(f"{x / 1e9:.1f}" for x in raw[-len(plan):]) + " GB/s; server "
                      + ", ".join(f"{k}w {rates[label][-1]['rate'] / 1e9:.2f}" for label, k, _ in plan) + " GB/s",
                      flush=True)
        measure_raw()  # after the last run: every run has a raw measurement on each side
    if is_server:
        table(args, raw, plan, rates)


def ratios(results: list[dict], raw: list[float]) -> list[float]:
    """Each run's rate over the mean of the raw rates measured just before and just after it."""
    return [x["rate"] / (0.5 * (raw[x["raw_index"]] + raw[x["raw_index"] + 1])) for x in results]


def table(args: argparse.Namespace, raw: list[float], plan: list, rates: dict[str, list[dict]]) -> None:
    from mpiasgd.comms import protocol

    ref = statistics.median(raw)
    size = protocol.message_bytes(args.params)
    print(f"\nP = {args.params:,} float32 (messages of {size / 1e6:.1f} MB), {os.cpu_count()} cores, median of "
          f"{args.rounds} rounds ({len(raw)} raw measurements); rate = bytes in + bytes out at rank 0 per second")
    print("ratio = median over rounds of server / (mean of the raw measurements just before and just after it)")
    print(f"{'':44} {'GB/s':>6} {'ratio':>6} {'push/s':>7} | ms per push: {'receive':>7} {'update':>6} {'send':>6} "
          f"{'other':>6} {'idle':>6}")
    print(f"{'raw Isend/Irecv, ranks 0 <-> 1':44} {ref / 1e9:6.2f} {1:6.2f} {ref / (2 * size):7.1f} |")
    for label, _, _ in plan:
        results = rates[label]
        rate = statistics.median(x["rate"] for x in results)
        ratio = statistics.median(ratios(results, raw))
        split = [statistics.median(x["split_ms"][k] for x in results)
                 for k in ("receive", "update", "send", "other", "idle")]
        print(f"{label:44} {rate / 1e9:6.2f} {ratio:6.2f} {statistics.median(x['pushes_s'] for x in results):7.1f} | "
              f"{'':13}" + " ".join(f"{ms:{w}.2f}" for ms, w in zip(split, (7, 6, 6, 6, 6), strict=True)))
    print("per-round ratios: " + "; ".join(
        f"{label.strip()}: " + " ".join(f"{q:.2f}" for q in ratios(rates[label], raw)) for label, _, _ in plan))
    print("goal: server / raw >= 0.80 with momentum 0.9 and weight decay 5e-4 (the 'server, K workers' rows)")


# ---------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=4_000_000, help="model size P, float32 values")
    parser.add_argument("--workers", type=lambda s: [int(k) for k in s.split(",")], default=[1, 2, 3],
                        help="worker counts to serve, comma-separated (default 1,2,3)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every measurement")
    parser.add_argument("--pushes", type=int, default=250, help="pushes applied per server run")
    parser.add_argument("--exchanges", type=int, default=60, help="round trips per raw measurement")
    parser.add_argument("--sweep", action="store_true", help="time the optimizer alone (no MPI) and exit")
    parser.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")],
                        default=[8192, 16384, 32768, 65536, 131072, 262144], help="--sweep: block sizes")
    parser.add_argument("--repeats", type=int, default=15, help="--sweep: timings per figure (median)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # set on the ranks of the job
    args = parser.parse_args()
    if args.sweep:
        return sweep(args)
    if args.child:
        try:
            return child(args)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)  # the other ranks would wait for their timeouts
    if min(args.workers) < 1 or args.pushes < WARMUP * max(args.workers) + 10:
        parser.error(f"--workers must be >= 1 and --pushes >= {WARMUP * max(args.workers) + 10}")
    from launch import launcher, run  # bench/launch.py, beside this file

    nranks = 1 + max(args.workers)
    cmd = [*launcher(), "-n", str(nranks), sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]]
    print(f"one mpiexec job of {nranks} ranks, {args.rounds} rounds ...", flush=True)
    limit = 120.0 + 20.0 * args.rounds * len(runs(args)) * args.pushes / 250
    done = run(cmd, limit)
    if not done.ok:
        sys.exit(done.explain(limit))
    print(done.stdout, end="")

if __name__ == "__main__":
    main()
