"""The discrete-event engine of `mpiasgd simulate`: N virtual workers and the real rank-0 role of mode
async or ssp in one process, on a virtual clock (GPU A-SGD, Paine et al. 2013, arXiv 1312.6186).

What is real: every gradient (the mode's own worker objects, `WorkerLoop.gradient()`, on each worker's
shard and stream, with its own buffers, step count and dropout seed; nsync > 1: its own `LocalSGD`), the
evaluations, and all of rank 0 (the mode's role with its update rule, staleness rules, warm start, ssp
gate, periodic evaluations, recorder, snapshots and checkpoints; `Rank0.handle` checks every message).
What is modelled (`TimingModel`): how long each of those takes, and so the order in which pushes arrive.
`--wire fp16|bf16` is real too: the virtual workers' stagings decode each reply and encode each push
(with --wire-error-feedback, each worker's own residual) and rank 0 decodes and encodes as it does under
MPI, so the numerics are a real run's; a message's size, and so its bandwidth term, is its wire size.

Events, in a heap keyed by (virtual time, rank, sequence): at equal times the event of the lower worker
rank comes first (rank 0's timers before any worker's), then the one scheduled first.

    deliver   WEIGHTS or STOP reach worker w at t (sent at s: t = s + latency + bytes / bandwidth).
              WEIGHTS: the worker takes the weights, evaluates them first if the reply carries flag
              EVALUATE (its EVAL leaves at t + e, e = eval_s_per_image x its test images), computes its
              push now (nsync minibatches) and draws its compute time d (nsync draws x its --straggler
              factor); the PUSH, stamped as AsgdWorker stamps it (step, the version computed from,
              samples, loss, correct, epoch, cursor, compute_s = d, comm_s = 0, wait_s = t - when its
              previous push left (the first: t), data_s = 0), leaves at t (+ e) + d.
              STOP: it evaluates the final weights on its test slice and its EVAL leaves at t + e.
    arrive    a PUSH or EVAL reaches rank 0: it joins the server's queue (one at a time, first come first
              served). A PUSH is served for server_s seconds and handled when that ends (`served`); an
              EVAL is handled as soon as it is at the head. The handler runs with rank 0's clock at that
              time and every reply it posts leaves then.
    timer     the end of --warm-start: rank 0's tick runs at that time (the other workers start on time)

After each event, when the server is not busy, rank 0's tick runs at the event's time (the duties of
`Rank0.tick` that apply here: the role's clock duties, snapshots, checkpoints, log flush, progress). The
run ends when the role is done (every worker's final EVAL handled); then `Rank0.finish`.

One model object (the workers' backend, resolved as `train`'s: numpy or cpu) serves every worker: before
a worker computes, its own params, grads and buffers are bound and its dropout seed set, so N workers
cost N sets of message buffers, not N models. A virtual worker's work happens all at once at its event:
the weights it computes on are its own copy, taken on arrival, as a real worker's are.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpiasgd.comms import Flag, Message, ProtocolError, Tag, check, check_size, parse_tag
from mpiasgd.comms.protocol import HEADER_BYTES
from mpiasgd.config import Config, ConfigError
from mpiasgd.model import evaluate
from mpiasgd.modes.base import WorkerJob, WorkerLoop, dropout_seed
from mpiasgd.optim import LocalSGD
from mpiasgd.rank0.loop import Rank0
from mpiasgd.rank0.recorder import Recorder
from mpiasgd.sim.comm import Arrived, Envelope, VirtualComm
from mpiasgd.sim.timing import ComputeDraws, TimingModel

SIMULATED_MODES = ("async", "ssp")  # the parameter-server modes whose workers AsgdWorker is


def parse_failures(text: str | None, num_workers: int, flag: str = "--fail", what: str = "dies") -> dict[int, float]:
    """`--fail W@T[,W@T...]`: {worker rank W: the virtual second T it dies} (`flag` "--join", `what` "joins":
    the second it joins); ConfigError naming the entry and what was expected (W a worker rank 1..N, each once;
    T a finite number of seconds >= 0)."""
    out: dict[int, float] = {}
    if text is None:
        return out
    for entry in text.split(","):
        rank, at, when = entry.strip().partition("@")
        try:
            w, t = int(rank), float(when)
        except ValueError:
            w, t = 0, float("nan")
        if not at or not 1 <= w <= num_workers or w in out or not (t >= 0 and math.isfinite(t)):
            raise ConfigError(f"{flag} '{text}': entry '{entry.strip()}': expected W@T, W a worker rank "
                              f"1..{num_workers} named once and T the virtual seconds >= 0 at which it {what} "
                              "(e.g. 2@30.5)")
        out[w] = t
    return out


def parse_joins(text: str | None, num_workers: int) -> dict[int, float]:
    """`--join W@T[,W@T...]`: {worker rank W: the virtual second T it joins} (`parse_failures`'s checks)."""
    return parse_failures(text, num_workers, "--join", "joins")


def check_simulated(cfg: Config, num_workers: int, failures: dict[int, float] | None = None,
                    joins: dict[int, float] | None = None) -> None:
    """ConfigError naming what `mpiasgd simulate` does not do: a mode other than async/ssp, --overlap,
    --resume, --backend cupy, fewer than 1 worker; --fail (`failures`) leaving fewer workers than
    --min-workers; --join (`joins`) of every worker, of one that --fail names, or with --warm-start."""
    if num_workers < 1:
        raise ConfigError(f"--workers {num_workers}: expected an integer >= 1")
    if joins:
        late = [w for w, t in joins.items() if t > 0]
        if len(late) == num_workers:
            raise ConfigError(f"--join: all {num_workers} workers join after the start; at least one must be in "
                              "from virtual second 0")
        both = sorted(set(joins) & set(failures or {}))
        if both:
            raise ConfigError(f"--join and --fail both name worker rank(s) {both}: a worker joins or dies, not both")
        if cfg.warm_start > 0:
            raise ConfigError("--join with --warm-start: both hold workers back; use one")
    if failures and num_workers - len(failures) < cfg.min_workers:
        raise ConfigError(f"--fail: {len(failures)} of {num_workers} workers die, fewer than --min-workers "
                          f"{cfg.min_workers} would be left (a run that ends failed is not simulated)")
    if cfg.mode not in SIMULATED_MODES:
        raise ConfigError(f"--mode {cfg.mode} is not simulated; it simulates the parameter-server "
                          f"modes {' and '.join(SIMULATED_MODES)} (A-SGD and SSP)")
    if cfg.overlap:
        raise ConfigError("--overlap is not modelled (a worker computing while its pull is in "
                          "flight); simulate without it")
    if cfg.resume:
        raise ConfigError("--resume is not simulated; a simulation starts from the initial weights")
    if cfg.backend == "cupy":
        raise ConfigError("--backend cupy: the simulator computes on the host (the timing model stands for the "
                          "devices); leave --backend at auto (cpu), numpy or cpu")


class VirtualRecorder(Recorder):
    """The Recorder on the virtual clock: `now()` is `clock`, virtual seconds the engine sets before each
    event, so every row of the log (pushes, updates, snapshots, evaluations, events) is in virtual seconds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = 0.0

    def now(self) -> float:
        return self.clock

    def advise(self, text: str) -> None:
        """No advice on the flags (`mpiasgd.rank0.advice`): the timing model sets the workers' waits, and rank 0's
        busy time is real seconds, not virtual ones."""


class VirtualRank0(Rank0):
    """Rank 0's loop as the engine drives it: `handle` (the real dispatch and checks) and `finish` as they
    are; `tick` keeps the duties that apply on a virtual clock. Left out: the pause and stall watches
    (the virtual clock never pauses and a virtual worker never hangs) and signals (the simulator installs
    no handlers: Ctrl-C ends it with the log closed 'failed')."""

    def tick(self) -> None:
        self.role.tick()
        self.duties()

    def finished(self, w: int) -> bool:
        """(`--fail`) A virtual worker's messages come only through the engine: it has finished when its EVAL has."""
        return w in self.role.evals


@dataclass
class VirtualWorker:
    """One virtual worker: `loop` is the mode's worker object (stream, staging, buffers, step, version),
    `times` its compute times per minibatch, multiplied by `slowdown` (--straggler), `local` its LocalSGD
    (nsync > 1), `comm` the communicator it sends through."""

    rank: int
    loop: WorkerLoop
    comm: VirtualComm
    times: ComputeDraws
    slowdown: float
    local: LocalSGD | None = None
    posted: float = 0.0             # virtual time its receive was posted: when its last push left (0 at start)
    began: float | None = None      # when its first weights arrived (its local steps' --max-time clock)
    eval_s: float = 0.0             # virtual seconds of its evaluation in progress (the EVAL's compute_s)


@dataclass(order=True)
class Event:
    """A heap entry: ordered by (time, rank, seq); `kind` and `data` say what happens."""

    time: float
    rank: int
    seq: int
    kind: str = field(compare=False)                 # "deliver" | "arrive" | "served" | "timer" | "fail"
    tag: int = field(compare=False, default=0)
    data: bytes = field(compare=False, default=b"")


class Simulation:
    """The asynchronous protocol of `cfg.mode` (async or ssp) with `num_workers` virtual workers on a virtual
    clock; see the module docstring.

    `mode` is the Mode object, `model` rank 0's (numpy) model, `worker_model` the one every worker shares
    (the workers' backend, numpy or cpu; default: `model`), `dataset` the data, `layout`
    the mode's layout, `samplers` one ShardSampler per shard (`layout.shard[w]` is worker w's), `test_idx`
    {worker: int64 test indices}, `timing` the TimingModel (its eval_s_per_image resolved), `rec` a
    VirtualRecorder on the run log, `params` the initial weights (float32 (P,)). `run()` returns the
    summary dict (`Recorder.summary`). ConfigError as `check_simulated`; ProtocolError where rank 0 or a worker
    breaks the protocol (or nothing is left to happen before the role is done).

    `shards` (--servers S): the S parameter-server shards timed as S servers working in parallel on their
    slices: a push is served in server_s / S, and a push or reply crosses S links at once, each with 1/S of
    its payload (a header each). The numbers are one server's (`cfg` has servers 1): with equal links every
    shard takes the pushes in the same order, so the S slices of the weights are those one server computes.
    """

    def __init__(self, cfg: Config, mode: Any, model: Any, dataset: Any, layout: Any, samplers: list,
                 test_idx: dict[int, np.ndarray], timing: TimingModel, rec: VirtualRecorder,
                 params: np.ndarray, worker_model: Any = None, shards: int = 1,
                 failures: dict[int, float] | None = None, joins: dict[int, float] | None = None) -> None:
        self.cfg, self.mode, self.model, self.dataset, self.layout = cfg, mode, model, dataset, layout
        self.shards = shards
        self.worker_model = model if worker_model is None else worker_model
        self.samplers, self.test_idx, self.timing, self.rec, self.params = samplers, test_idx, timing, rec, params
        self.num_workers = len(rec.workers)
        self.heap: list[Event] = []
        self.seq = 0
        self.queue: deque[tuple[int, int, bytes]] = deque()  # the server's: (source, tag, message)
        self.busy = False                                    # the server is serving a push
        self.workers: dict[int, VirtualWorker] = {}
        self.r0: VirtualRank0 | None = None
        self.pulled: Any = None                              # nsync > 1: the weights at a round's start
        self.failures = failures or {}                       # --fail: worker -> the virtual time it dies
        self.joins = {w: t for w, t in (joins or {}).items() if t > 0}  # --join: worker -> the time it joins
        self.dead: set[int] = set()

    # --- set-up ---
    def check(self) -> None:
        """ConfigError for what the simulator does not model (`check_simulated`)."""
        check_simulated(self.cfg, self.num_workers, self.failures, self.joins)

    def build(self) -> VirtualRank0:
        """Rank 0 (the mode's role, through the real loop object) and the virtual workers."""
        cfg, model, computing = self.cfg, self.model, self.worker_model
        size = self.num_workers + 1
        r0 = VirtualRank0(VirtualComm(0, size, self.post), cfg, self.rec,
                          lambda r0: self.mode.rank0(r0, self.params, model.decay_mult(), model, self.dataset,
                                                     self.layout))
        worker_cfg = dataclasses.replace(cfg, prefetch=0)  # every minibatch is read when computed: no threads
        slow = cfg.stragglers()
        for w in range(1, size):
            comm = VirtualComm(w, size, self.post)
            job = WorkerJob(comm, worker_cfg, computing, self.dataset, self.samplers[self.layout.shard[w]], w,
                            self.test_idx[w], layout=self.layout)
            loop = self.mode.worker(job)
            local = LocalSGD(computing, cfg.momentum, cfg.weight_decay, nesterov=cfg.nesterov) if cfg.nsync > 1 \
                else None
            compute = self.timing.compute_for(w)
            rng = np.random.default_rng([cfg.seed, 7, w])
            # a replayed trace that is not this worker's own (the pooled one): from a place of its own in it
            offset = int(rng.integers(len(compute.samples))) if compute.replay and w not in self.timing.workers else 0
            self.workers[w] = VirtualWorker(w, loop, comm, ComputeDraws(compute, rng, offset), slow.get(w, 1.0), local)
        if cfg.nsync > 1:
            self.pulled = computing.ops.empty(computing.num_params)
        if self.joins:  # --join: not in the job yet; the others read their shards meanwhile
            r0.role.absent = set(self.joins)
            for w, vw in self.workers.items():
                if w not in self.joins:
                    vw.loop.note_absent(sorted(self.joins))
        self.r0 = r0
        return r0

    # --- the clock ---
    def schedule(self, time: float, rank: int, kind: str, tag: int = 0, data: bytes = b"") -> None:
        self.seq += 1
        heapq.heappush(self.heap, Event(time, rank, self.seq, kind, tag, data))

    def post(self, source: int, dest: int, tag: int, data: bytes, send_time: float) -> None:
        """A message posted by `source` at `send_time`: it arrives after latency + bytes / bandwidth. A worker's
        ALIVE (sent while it evaluates) is dropped: there is no stall watch to keep quiet."""
        if tag == Tag.ALIVE:
            return
        if source and tag == Tag.EVAL:  # an evaluation's seconds are virtual ones
            msg = Message(0)
            msg.buf[:] = np.frombuffer(data, np.uint8)
            if int(msg.header["flags"]) & Flag.EVALUATE:
                msg.header["compute_s"] = self.workers[source].eval_s
                data = msg.buf.tobytes()
        kind = "arrive" if dest == 0 else "deliver"
        nbytes = len(data)
        if self.shards > 1 and tag in (Tag.PUSH, Tag.WEIGHTS, Tag.STOP):  # S links at once, a slice on each
            nbytes = HEADER_BYTES + -(-(nbytes - HEADER_BYTES) // self.shards)
        self.schedule(send_time + self.timing.transfer_s(nbytes), dest or source, kind, tag, data)

    # --- the run ---
    def run(self) -> dict:
        """Simulate until the role is done; returns the summary dict."""
        self.check()
        r0 = self.build()
        rec, role = self.rec, r0.role
        rec.begin()
        rec.snapshot(role.params, role.current_buffers())
        role.begin()  # the initial weights leave at 0
        if self.cfg.warm_start > 0 and self.num_workers > 1:
            self.schedule(self.cfg.warm_start, 0, "timer")
        for w, t in self.failures.items():
            self.schedule(t, w, "fail")
        for w, t in self.joins.items():
            self.schedule(t, w, "join")
        r0.tick()
        while not role.done():
            if not self.heap:
                raise ProtocolError(f"simulate: nothing left to happen at {rec.now():.6g} virtual s, but rank 0 still "
                                    f"waits for workers {role.waiting_for()} (the protocol is stuck)")
            event = heapq.heappop(self.heap)
            if event.rank in self.dead and event.kind in ("deliver", "arrive"):
                pass  # (a dead worker takes nothing, and what it sent had not arrived when it died)
            elif event.kind == "fail":
                self.fail(event.time, event.rank)
            elif event.kind == "join":
                self.join(event.time, event.rank)
            elif event.kind == "deliver":
                self.on_reply(self.workers[event.rank], event.time, event.tag, event.data)
            elif event.kind == "arrive":
                self.queue.append((event.rank, event.tag, event.data))
                self.serve(event.time)
            elif event.kind == "served":
                self.busy = False
                self.handle(event.time, event.rank, event.tag, event.data)
                self.serve(event.time)
            if not self.busy or event.kind == "timer":  # rank 0's clock duties (the warm start's end: on time)
                self.tick(event.time)
        return r0.finish()

    def fail(self, t: float, w: int) -> None:
        """--fail: worker `w` dies at `t`: its messages queued at the server and in flight are lost, and rank 0
        drops it as it does when ULFM reports a death (`Rank0.lose`)."""
        if w in self.dead or self.r0.role.done():
            return
        self.dead.add(w)
        self.queue = deque(m for m in self.queue if m[0] != w)
        self.tick_clock(t)
        self.r0.lose([w], "--fail")

    def join(self, t: float, w: int) -> None:
        """--join: worker `w` joins at `t` (at the stop at the latest: it then gets STOP and evaluates its test
        slice): it pulls the weights of this version, and its data starts at the next epoch rank 0 counts (its
        shard, which the others read shares of until now; they stop from their next epoch: each sample is still
        seen about once an epoch). The others learn of it at once (a model of the join: no message for it)."""
        role = self.r0.role
        if w not in role.absent:
            return
        self.tick_clock(t)
        vw = self.workers[w]
        sampler = vw.loop.job.sampler
        epoch = math.floor(self.rec.epoch) + 1 if not self.rec.stop_reason else 0
        vw.loop.stream.seek(epoch * len(sampler) // self.cfg.batch_size)  # (the start of that epoch, a batch early)
        vw.posted = t
        for other, each in self.workers.items():
            if other != w:
                each.loop.note_joined(w)
        role.join_worker(w)
        text = (f"worker rank {w} joined at version {role.counter.version} (--join): it reads its shard from epoch "
                f"{epoch}, and the others read theirs alone from their next epoch") if not self.rec.stop_reason \
            else f"worker rank {w} joined after the stop (--join): it only evaluates its test slice"
        self.rec.event("worker_joined", text)
        print(f"mpiasgd: {text}", file=sys.stderr, flush=True)

    # --- rank 0 ---
    def serve(self, t: float) -> None:
        """Start on the queue's head at `t` unless the server is busy: a PUSH takes server_s (handled when it
        ends), an EVAL nothing (handled now)."""
        while self.queue and not self.busy:
            source, tag, data = self.queue.popleft()
            cost = self.timing.server_s / self.shards if tag == Tag.PUSH else 0.0  # (S shards: each its slice)
            if cost > 0:
                self.busy = True
                self.schedule(t + cost, source, "served", tag, data)
            else:
                self.handle(t, source, tag, data)

    def handle(self, t: float, source: int, tag: int, data: bytes) -> None:
        """Rank 0 takes message `data` from `source` at `t`: the loop's own checks and dispatch (its tick follows,
        in `run`, once the server is idle)."""
        r0 = self.r0
        self.tick_clock(t)
        r0.handle(Arrived(data), Envelope(source, tag, len(data)))

    def tick(self, t: float) -> None:
        self.tick_clock(t)
        self.r0.tick()
        if self.rec.stop_reason and self.r0.role.absent:  # --join after the stop: in now, to evaluate
            for w in sorted(self.r0.role.absent):
                self.join(t, w)

    def tick_clock(self, t: float) -> None:
        """Rank 0's clock to `t` (never backwards); what it sends now leaves at `t`."""
        self.rec.clock = max(self.rec.clock, t)
        self.r0.comm.send_time = self.rec.clock

    # --- a worker ---
    def on_reply(self, vw: VirtualWorker, t: float, tag: int, data: bytes) -> None:
        """Worker `vw` receives WEIGHTS or STOP at `t` (the checks of `WorkerLoop.receive_weights`), then
        computes and sends its push, or evaluates the final weights."""
        loop, staging = vw.loop, vw.loop.staging
        kind = parse_tag(tag, 0, vw.rank)
        if kind == Tag.LOST:  # --fail: a worker died; the reply follows
            loop.take_lost(data, len(data))
            return
        if kind not in (Tag.WEIGHTS, Tag.STOP):
            raise ProtocolError(f"rank {vw.rank}: expected WEIGHTS or STOP from rank 0, got {kind.name}")
        check_size(kind, 0, vw.rank, len(data), staging.weights.count, staging.weights.wire)
        staging.recv_buf[:] = np.frombuffer(data, np.uint8)  # the receive completes: the worker's own copy
        staging.after_receive()  # --wire fp16|bf16: decoded into the worker's float32 weights (fp32: nothing)
        check(staging.weights, kind, 0, vw.rank)
        header = staging.weights.header
        version, step = int(header["version"]), int(header["step"])
        if step != loop.step or version < loop.version:
            raise ProtocolError(f"rank {vw.rank}: {kind.name} answers step {step} at version {version}; "
                                f"expected step {loop.step} at version >= {loop.version}")
        loop.version = version
        wait_s = t - vw.posted
        if vw.began is None:  # the initial weights: rank 0's buffers to start from; this worker's own after
            vw.began = t
            loop.buffers_from(staging.params)
        if kind == Tag.STOP:
            self.final_evaluation(vw, t)
        else:
            self.push(vw, t, wait_s)

    def bind(self, vw: VirtualWorker) -> None:
        """The shared model computes as worker `vw`: its weights, gradient buffer, layer buffers, dropout seed."""
        vw.loop.bind(vw.loop.staging.params, vw.loop.staging.grads)
        self.worker_model.ctx.seed = dropout_seed(self.cfg.seed, vw.rank)

    def push(self, vw: VirtualWorker, t: float, wait_s: float) -> None:
        """Worker `vw` got WEIGHTS at `t`: (flag EVALUATE: evaluate them first), compute its gradient or nsync
        local steps, and send the PUSH when its drawn compute time has passed."""
        cfg, loop, staging = self.cfg, vw.loop, vw.loop.staging
        self.bind(vw)
        header = staging.weights.header
        start = t
        if int(header["flags"]) & Flag.EVALUATE:  # --eval-interval: these weights first (rank 0's buffers)
            vw.eval_s = self.timing.eval_seconds(len(loop.test_idx), cfg.batch_size)
            vw.comm.send_time = start = t + vw.eval_s
            loop.evaluate_during_training(int(header["epoch"]), loop.version, staging.params)
        lr = float(header["lr"])  # step size of local steps (nsync > 1)
        drawn = 0.0  # compute seconds of this round's minibatches, before the --straggler factor

        def after_minibatch() -> bool:  # its compute time drawn; --max-time: push what this round has
            nonlocal drawn
            drawn += vw.times.next()
            return bool(cfg.max_time and start + drawn - vw.began >= cfg.max_time)

        loss, correct, samples, epoch = loop.compute_round(vw.local, self.pulled, lr, after_minibatch)
        loop.buffers_into(staging.grads)  # the push carries this worker's buffers after the gradient
        loop.take_data_s()  # real seconds spent reading: not virtual ones
        compute_s = drawn * vw.slowdown
        loop.step += 1
        staging.push.stamp(Tag.PUSH, vw.rank, step=loop.step, version=loop.version, samples=samples, epoch=epoch,
                           correct=correct, loss=loss, compute_s=compute_s, comm_s=0.0, wait_s=wait_s,
                           lr=lr, cursor=loop.cursor, data_s=0.0, flags=Flag.DELTA if vw.local is not None else 0)
        staging.before_send()  # --wire fp16|bf16: encoded (with the worker's error feedback) as a real worker does
        vw.posted = vw.comm.send_time = start + compute_s
        vw.comm.Isend(staging.send_buf, dest=0, tag=int(Tag.PUSH))

    def final_evaluation(self, vw: VirtualWorker, t: float) -> None:
        """Worker `vw` got STOP at `t`: evaluate the final weights with rank 0's mean buffers on its test slice
        and send EVAL (as `WorkerLoop.run`), leaving when the evaluation's virtual seconds have passed."""
        loop, staging = vw.loop, vw.loop.staging
        loop.buffers_from(staging.params)  # the final weights, and rank 0's mean buffers: what the snapshot holds
        self.bind(vw)
        loop.stream.close()
        loss_sum, correct, count, correct5 = evaluate(self.worker_model, self.dataset, loop.test_idx,
                                                      self.cfg.eval_batch_size)
        result = Message(0).stamp(Tag.EVAL, vw.rank, samples=count, correct=correct, loss=loss_sum, correct5=correct5)
        vw.comm.send_time = t + self.timing.eval_seconds(count, self.cfg.batch_size)
        vw.comm.Isend(result.buf, dest=0, tag=int(Tag.EVAL))
