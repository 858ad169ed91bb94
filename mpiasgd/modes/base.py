"""What a training mode is: a `Mode` (checks, layout of the ranks, communicators, its two halves)
and the machinery its worker loop shares with the others (`WorkerLoop`).

A mode module defines `MODE`, an instance of a `Mode` subclass; `mpiasgd.modes.registry` names
it. Start-up (`mpiasgd.launch`) and rank 0's loop (`mpiasgd.rank0`) call only these methods, so
neither knows any mode.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import signals
from mpiasgd.comms import Flag, Message, ProtocolError, Staging, Tag, check, check_size, parse_tag, wait
from mpiasgd.comms.protocol import HEADER
from mpiasgd.comms.wire import ErrorFeedback
from mpiasgd.config import Config, ConfigError
from mpiasgd.data import MinibatchStream, ShardSampler, lost_test_share
from mpiasgd.model import Evaluation, evaluate
from mpiasgd.ops.cuda.graphs import CupyGraphs, StepGraphs
from mpiasgd.ops.protocol import LossStats


@dataclass
class Layout:
    """How a mode lays the workers out: `shards` data shards, worker w reads shard `shard[w]`, computes
    layers `layers[w]` = (first, last) of the model (last None: to the end), and sits at `place[w]` =
    (module, replica) of a grid (-1, -1 where there is none; the log's /workers table shows it);
    `attrs` go into the run log's attributes (e.g. the pipeline's module bounds)."""

    shards: int
    shard: dict[int, int]
    layers: dict[int, tuple[int, int | None]]
    attrs: dict = field(default_factory=dict)
    place: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def data_parallel(cls, num_workers: int) -> Layout:
        """One shard per worker, each computing the whole model."""
        workers = range(1, num_workers + 1)
        return cls(num_workers, {w: w - 1 for w in workers}, dict.fromkeys(workers, (0, None)))


@dataclass
class WorkerJob:
    """Everything a worker loop gets at start-up. `comm` reaches rank 0; `sampler` is this worker's
    shard; `test_idx` (int64) the test images it evaluates at the end; `staging` how the model's
    params/grads meet the MPI buffers (default: the numpy backend's, no copies) and `make_staging()`
    one more like it; `comms` the mode's own communicators (`Mode.communicators`); `layout` the
    mode's layout; `graphs` what --cuda-graphs resolved to at start-up ("auto" | "on" | "off",
    `launch.startup.probe_cuda_graphs`)."""

    comm: Any
    cfg: Config
    model: Any
    dataset: Any
    sampler: ShardSampler
    rank: int
    test_idx: np.ndarray = field(default_factory=lambda: np.arange(0, dtype=np.int64))
    staging: Staging | None = None
    make_staging: Any = None
    comms: Any = None
    layout: Layout | None = None
    graphs: str = "off"


class Mode:
    """A training mode. Subclasses override what differs; the defaults are those of data parallelism
    with every worker computing the whole model on its own shard."""

    name = ""
    asynchronous = False  # the training rows come from different weights at once (the divergence watch)
    elastic = False       # under ULFM a worker that dies is dropped and the run goes on (its role's `survives`)
    advice = ""           # what the divergence watch advises ("": mpiasgd.health.likely_cause)

    def check_config(self, cfg: Config) -> None:
        """ConfigError naming a key this mode owns that is out of range. `config.validate` calls every mode's
        (the keys of other modes are at their defaults, which pass), before it checks that the keys of
        other modes than `cfg.mode` are at their defaults."""

    def layout(self, cfg: Config, model: Any, num_workers: int, num_train: int) -> Layout:
        """The workers' layout for `num_workers` workers; ConfigError when the job does not fit the mode."""
        return Layout.data_parallel(num_workers)

    def communicators(self, cfg: Config, comm: Any, rank: int, layout: Layout) -> Any:
        """Collective (every rank calls it): the mode's worker-only communicators; None on rank 0."""
        return None

    def describe(self, cfg: Config, model: Any, layout: Layout, num_workers: int) -> str:
        """Lines rank 0 prints at start-up about the layout ("" for nothing)."""
        return ""

    def rank0(self, r0: Any, params: np.ndarray, decay_mask: np.ndarray, model: Any, dataset: Any,
              layout: Layout) -> Any:
        """The mode's rank-0 role (`mpiasgd.rank0.role.Role`) for the loop `r0`; `params` are the initial
        weights (float32 (P,), host), `model` a numpy model and `dataset` the data, for roles that
        evaluate on rank 0."""
        raise NotImplementedError

    def worker(self, job: WorkerJob) -> WorkerLoop:
        """The mode's worker loop."""
        raise NotImplementedError


def need(ok: bool, cfg: Config, key: str, expected: str) -> None:
    """ConfigError "config key 'KEY' = VALUE: expected EXPECTED" unless `ok`."""
    if not ok:
        raise ConfigError(f"config key '{key}' = {getattr(cfg, key)!r}: expected {expected}")


def round_fits(cfg: Config, key: str, steps: int, num_workers: int, num_train: int) -> None:
    """ConfigError naming config key `key` when one round of `steps` local minibatches by every one of
    `num_workers` workers is longer than the whole run (`cfg.epochs` of `num_train` images): it would
    train with the step size the schedule has past the end (nsync, easgd's tau)."""
    if cfg.epochs and steps * cfg.batch_size * num_workers > cfg.epochs * num_train:
        raise ConfigError(f"config key '{key}' = {steps}: one round of local steps by every worker ({steps} x "
                          f"{cfg.batch_size} images x {num_workers} workers) is longer than the run "
                          f"({cfg.epochs:g} epochs of {num_train} images)")


def message_count(model: Any) -> int:
    """Values in a worker's weight and gradient messages: the P parameters, then the model's B buffers."""
    return model.num_params + model.num_buffers


def worker_feedback(cfg: Config, model: Any) -> ErrorFeedback | None:
    """A worker's error feedback for its pushes (--wire-error-feedback; on the model's P parameters, not its
    buffers), None without it."""
    return ErrorFeedback(cfg.wire, model.num_params) if cfg.wire_error_feedback else None


def lr_scale(model: Any) -> np.ndarray | None:
    """The model's per-parameter learning-rate multipliers (float32 (P,); `optim.SGD` takes all 1 as its default
    path), None without a model."""
    return None if model is None else model.lr_mult()


def initial_buffers(model: Any) -> np.ndarray | None:
    """The model's buffers at their initial values (float32 (B,)), rank 0's until workers push theirs."""
    return None if model is None else model.init_buffers()


def dropout_seed(seed: int, rank: int) -> int:
    """The dropout key's seed of worker `rank` in a run of `seed`: distinct per worker (its masks differ
    from the others'), the same on every start (a resumed run draws the masks the uninterrupted would)."""
    return (int(seed) << 20) + int(rank)


class Heartbeat:
    """A worker's ALIVE messages to rank 0 while it evaluates the final weights, or weights --eval-interval asks
    for (which may take longer than --comm-timeout on a large test slice): `beat()` sends one when `interval`
    seconds have passed since the
    last, after the previous send completed; `drain()` completes the last."""

    def __init__(self, comm: Any, rank: int, interval: float, timeout: float) -> None:
        self.comm, self.rank, self.interval, self.timeout = comm, rank, interval, timeout
        self.msg = Message(0)
        self.sending = None
        self.last = time.monotonic()

    def beat(self) -> None:
        if time.monotonic() - self.last < self.interval:
            return
        self.drain()
        self.msg.stamp(Tag.ALIVE, self.rank)
        self.sending = self.comm.Isend(self.msg.buf, dest=0, tag=int(Tag.ALIVE))
        self.last = time.monotonic()

    def drain(self) -> None:
        if self.sending is not None:
            wait(self.sending, "completion of an ALIVE send", self.rank, self.timeout)
            self.sending = None


class LossTally:
    """The loss and hits of a round's minibatches (`WorkerLoop.gradient`), read from the device once, when the
    round's totals are asked for (`totals`): a worker's push then carries them without a device
    synchronisation per minibatch."""

    def __init__(self) -> None:
        self.parts: list[tuple[LossStats, int]] = []

    def add(self, stats: LossStats, samples: int) -> None:
        """One minibatch of `samples` images and its (deferred) loss and hits."""
        self.parts.append((stats, samples))

    def totals(self) -> tuple[float, int, int]:
        """(loss summed over the images, hits, images) of the minibatches added: the mean loss of each times
        its images, summed in the order they were added."""
        loss = 0.0
        correct = samples = 0
        for stats, n in self.parts:
            batch_loss, batch_correct = stats.get()
            loss += batch_loss * n
            correct += batch_correct
            samples += n
        return loss, correct, samples


class EvaluationAbandoned(Exception):
    """An evaluation during training gives way to a signal, or to the end of the run (raised between batches)."""


class WorkerLoop:
    """A worker's loop (ranks 1..N): what every mode's worker shares.

    `gradient()` forward and backward on the next minibatch of the worker's stream; `straggle()`
    (--straggler) emulates a slower device; `receive_weights()` takes WEIGHTS or STOP from rank 0
    with every check; `run()` trains (`train`, the mode's) then evaluates the final weights on the
    worker's test slice and sends EVAL (0 images when a signal ended the run);
    `evaluate_during_training()` is the same for an evaluation --eval-interval asks for.
    """

    def __init__(self, job: WorkerJob) -> None:
        self.job = job
        self.comm, self.cfg, self.model, self.dataset = job.comm, job.cfg, job.model, job.dataset
        self.rank = job.rank
        self.num_train = job.dataset.train_y.size
        self.P, self.B = job.model.num_params, job.model.num_buffers
        count, wire = message_count(job.model), self.cfg.wire
        feedback = worker_feedback(self.cfg, job.model)  # shared by both stagings with --overlap
        self.staging = job.staging or Staging(count, wire, feedback)
        self.make_staging = job.make_staging or (lambda: Staging(count, wire, feedback))
        # the layers' buffers (running statistics): this worker's own, updated by every training forward
        self.buffers = job.model.ops.asarray(job.model.init_buffers())
        job.model.ctx.seed = dropout_seed(self.cfg.seed, self.rank)
        self.stream = MinibatchStream(job.dataset, job.sampler, self.cfg.batch_size, self.cfg.seed, self.rank,
                                      prefetch=self.cfg.prefetch)
        self.data_s = 0.0                # seconds waited for minibatches since the last push or report
        self.step = 0
        self.version = -1
        self.slowdown = self.cfg.stragglers().get(self.rank, 1.0)  # compute time multiplier of this worker
        self.elapsed = 0.0               # seconds of training before this job (a resumed run)
        self.preempted = False           # rank 0's STOP said: a signal ended the run
        self.lost: list[int] = []        # (ULFM) the workers rank 0 said died (LOST), in that order
        self.notices = 0                 # (ULFM) LOST notices taken (deaths, and --respawn's JOINED)
        self.absent: list[int] = []      # (simulate --join) workers not in the job yet: their data dealt out
        self.test_idx = job.test_idx     # the test images it evaluates: its slice, and a share of the lost ones'
        self.graphs = self.step_graphs(job.graphs)  # --cuda-graphs (None: eager launches)

    def step_graphs(self, mode: str) -> StepGraphs | None:
        """The worker's steps as CUDA graphs (`mpiasgd.ops.cuda.graphs`) under --cuda-graphs as resolved at
        start-up (`mode` "auto" | "on"); None for "off". A fall-back to eager launches mid-run is said on stderr."""
        if mode == "off":
            return None

        def fell_back(reason: str) -> None:
            print(f"mpiasgd: warning (rank {self.rank}): --cuda-graphs {mode}: eager launches from step "
                  f"{self.step + 1} on: {reason}", file=sys.stderr, flush=True)

        try:
            return StepGraphs(self.model, CupyGraphs(self.model.ops.xp), mode, on_fallback=fell_back)
        except Exception as e:  # (on: the start-up probe made the same objects; auto: eager launches)
            if mode == "on":
                raise
            fell_back(f"{type(e).__name__}: {e}")
            return None

    @property
    def cursor(self) -> int:
        """Minibatches drawn from the shard: the data position."""
        return self.stream.cursor

    def resume(self, header: np.void) -> None:
        """Continue from the initial WEIGHTS of a resumed run (flag RESUME): step count, data position, clock."""
        self.step, self.elapsed = int(header["step"]), float(header["elapsed"])
        self.stream.seek(int(header["cursor"]))

    def on_lost(self, header: np.void) -> None:
        """A LOST message from rank 0 (its `header`: step = the dead worker's rank, version = the notice's number):
        from the next epoch this worker has not drawn yet on, it reads a share of the dead workers' data as well
        (`ShardSampler.redeal`), and evaluates a share of their test slices (`lost_test_share`), so that each
        sample is still seen once per epoch and the final evaluation covers the test split. With flag JOINED
        (--respawn) the rank named is back (a replacement took it): the share is given back (`note_rejoined`).
        ProtocolError for a notice out of order, naming this worker or a rank that is no worker, a death of a
        worker told dead already, or a return of one not told dead."""
        rank, number = int(header["step"]), int(header["version"])
        joined = bool(int(header["flags"]) & Flag.JOINED)
        layout = self.job.layout or Layout.data_parallel(self.job.sampler.num_shards)
        if (number != self.notices + 1 or rank == self.rank or rank not in layout.shard
                or (rank in self.lost) != joined):
            what = "the return of" if joined else "the death of"
            raise ProtocolError(f"rank {self.rank}: LOST notice {number} from rank 0 tells {what} worker rank {rank}; "
                                f"expected notice {self.notices + 1}, a worker rank of 1..{len(layout.shard)} other "
                                f"than this one, dead before a return and alive before a death (dead now: "
                                f"{self.lost or 'none'})")
        self.notices += 1
        if joined:
            self.note_rejoined(rank)
        else:
            self.note_lost(rank)

    def take_lost(self, header: bytes, nbytes: int, source: int = 0) -> None:
        """A LOST message of `nbytes` bytes from `source` (rank 0), received into a buffer whose header bytes are
        `header` (all it carries): checked (ProtocolError naming what differs), then taken (`on_lost`)."""
        check_size(Tag.LOST, source, self.rank, nbytes, 0)
        notice = Message(0)
        notice.buf[:HEADER.itemsize] = np.frombuffer(header, np.uint8)[:HEADER.itemsize]
        check(notice, Tag.LOST, source, self.rank)
        self.on_lost(notice.header)

    def note_lost(self, dead: int) -> None:
        """Worker rank `dead` died (a LOST message, or sync's shrunk allreduce group): this worker takes a share
        of its data from the next epoch it has not drawn yet on, and of its test slice (`on_lost`)."""
        self.lost.append(dead)
        self.deal()

    def note_rejoined(self, rank: int) -> None:
        """(--respawn) Worker `rank`, told dead, is back (a replacement took its rank): from the next epoch this
        worker has not drawn yet on, it no longer reads a share of that worker's shard, and its test slice
        loses the share of that worker's."""
        self.lost = [w for w in self.lost if w != rank]
        self.deal()

    def note_absent(self, ranks: list[int]) -> None:
        """(`mpiasgd simulate --join`) Workers `ranks` join later: until each does (`note_joined`), this worker
        reads a share of their training shards as it does of a dead worker's (their test slices stay theirs:
        they evaluate them once in)."""
        self.absent = sorted(set(self.absent) | set(ranks))
        self.deal()

    def note_joined(self, rank: int) -> None:
        """(`mpiasgd simulate --join`) Worker `rank` joined: from the next epoch this worker has not drawn yet on,
        it no longer reads a share of that worker's shard."""
        self.absent = [w for w in self.absent if w != rank]
        self.deal()

    def deal(self) -> None:
        """Its training shard and test slice, with shares of the lost workers' (and of the absent workers'
        training shards) from the next epoch it has not drawn yet on (`ShardSampler.redeal`)."""
        layout = self.job.layout or Layout.data_parallel(self.job.sampler.num_shards)
        self.job.sampler.redeal([layout.shard[w] for w in [*self.lost, *self.absent]])
        self.test_idx = np.concatenate([self.job.test_idx, lost_test_share(
            self.dataset.num_test, len(layout.shard), self.rank, self.lost)])

    def gradient(self) -> tuple[LossStats, int, int]:
        """Forward and backward on the next minibatch into the bound grads; (its loss and hits, read later:
        a LossStats, `LossTally`; samples; epoch). The minibatch's number in the worker's stream (`cursor`)
        keys its dropout masks."""
        ops = self.model.ops
        x, y, epoch = self.stream.next()                   # (B, C, H, W) float32, (B,) int64, host
        self.data_s += self.stream.data_s
        if self.graphs is not None:  # --cuda-graphs: copied into the graph's input buffers, the step replayed
            return self.graphs.step(x, y, self.cursor), y.shape[0], epoch
        x, y = ops.asarray(x), ops.asarray(y, y.dtype)     # cupy: host -> device; numpy: the same arrays
        return self.model.forward_backward_deferred(x, y, minibatch=self.cursor), y.shape[0], epoch

    def take_data_s(self) -> float:
        """Seconds this worker waited for its minibatches since the last call (a push's or report's `data_s`)."""
        waited, self.data_s = self.data_s, 0.0
        return waited

    def bind(self, params: Any, grads: Any) -> None:
        """Compute with weights `params` and gradients into `grads`, message payloads of P + B values (or
        arrays of P): the model binds their first P and this worker's own buffers."""
        self.model.bind(params[:self.P], grads[:self.P], self.buffers)

    def buffers_into(self, payload: Any) -> None:
        """Write this worker's buffers after the P values of a message payload (a push carries them)."""
        if self.B:
            payload[self.P:] = self.buffers

    def buffers_from(self, payload: Any) -> None:
        """Take the buffers after the P values of a message payload (rank 0's, in the initial weights)."""
        if self.B:
            self.buffers[...] = payload[self.P:]

    def straggle(self, t0: float) -> None:
        """--straggler: emulate a device `slowdown` times slower than this one (sleep for the difference)."""
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - t0))

    def receive_weights(self, request: Any, staging: Staging, what: str, timeout: float = 0.0,
                        initial: bool = False) -> tuple[Tag, float]:
        """Wait for WEIGHTS or STOP from rank 0 into `staging.recv_buf`; returns (tag, seconds waited).

        After it returns, `staging.weights.header` and `staging.params` hold what arrived. The `initial`
        weights of a resumed run (flag RESUME) set the step, data position and clock (`resume`).
        """
        status = MPI.Status()
        waited = wait(request, what, self.rank, timeout or self.cfg.worker_timeout, status)
        staging.after_receive()  # cupy: weights host->device (pinned) or the header device->host (CUDA-aware)
        weights = staging.weights
        tag = parse_tag(status.Get_tag(), status.Get_source(), self.rank)
        while tag == Tag.LOST:  # (ULFM) a worker died: noted, then the reply itself, which follows
            self.take_lost(weights.header.tobytes(), status.Get_count(MPI.BYTE))
            staging.before_receive()
            request = self.comm.Irecv(staging.recv_buf, source=0, tag=MPI.ANY_TAG)
            waited += wait(request, what, self.rank, timeout or self.cfg.worker_timeout, status)
            staging.after_receive()
            tag = parse_tag(status.Get_tag(), status.Get_source(), self.rank)
        if tag not in (Tag.WEIGHTS, Tag.STOP):
            raise ProtocolError(f"rank {self.rank}: expected WEIGHTS or STOP from rank 0, got {tag.name}")
        check_size(tag, 0, self.rank, status.Get_count(MPI.BYTE), weights.count, weights.wire)
        check(weights, tag, 0, self.rank)
        version, step = int(weights.header["version"]), int(weights.header["step"])
        flags = int(weights.header["flags"])
        if initial and flags & Flag.RESUME:
            self.resume(weights.header)
        if tag == Tag.STOP and flags & Flag.PREEMPT:
            self.preempted = True
        if step != self.step or version < self.version:
            raise ProtocolError(f"rank {self.rank}: {tag.name} answers step {step} at version {version}; "
                                f"expected step {self.step} at version >= {self.version}")
        self.version = version
        return tag, waited

    def receive_state(self, count: int) -> Message:
        """(resuming) The CHECKPOINT rank 0 sends after the initial weights: this worker's optimizer state."""
        state = Message(count)
        status = MPI.Status()
        wait(self.comm.Irecv(state.buf, source=0, tag=int(Tag.CHECKPOINT)),
             "the optimizer state of the checkpoint from rank 0", self.rank, self.cfg.worker_timeout, status)
        check_size(Tag.CHECKPOINT, 0, self.rank, status.Get_count(MPI.BYTE), state.count)
        check(state, Tag.CHECKPOINT, 0, self.rank)
        return state

    def stop_arrived(self, request: Any, msg: Message) -> bool:
        """Rank 0's header-only STOP, whose receive `request` into `msg` was posted at the start, has arrived
        (checked: ProtocolError if it is not a STOP from rank 0)."""
        if request is None or not request.Test():
            return False
        check(msg, Tag.STOP, 0, self.rank)
        return True

    def signalled(self) -> bool:
        """A signal reached this process (SIGTERM, SIGUSR1, SIGINT)."""
        return bool(signals.received())

    def train(self) -> None:
        """The mode's loop; on return the model is bound to the final weights."""
        raise NotImplementedError

    def evaluate_during_training(self, number: int, version: int, payload: Any = None,
                                 stop: Callable[[], bool] | None = None) -> None:
        """--eval-interval: evaluate the bound weights (of `version`) on this worker's test slice and send rank 0
        EVAL number `number` (flag EVALUATE; header step = number, version, samples = images, correct,
        correct5, loss = summed loss, compute_s = seconds it took).

        `payload`: a message payload whose values after the first P are rank 0's layer buffers, evaluated
        with instead of this worker's own (async, easgd: the mean its snapshots hold), which are put back
        after. ALIVE messages keep rank 0's stall watch quiet meanwhile (`Heartbeat`). A signal, or `stop()`
        turning true, abandons it between two batches: the EVAL then carries flag PREEMPT.
        """
        t0 = time.perf_counter()
        kept = None
        if payload is not None and self.B:
            kept = self.buffers.copy()
            self.buffers_from(payload)
        alive = Heartbeat(self.comm, self.rank, self.cfg.comm_timeout / 4, self.cfg.worker_timeout)

        def beat() -> None:
            alive.beat()
            if self.signalled() or (stop is not None and stop()):
                raise EvaluationAbandoned

        abandoned = False
        try:
            result = evaluate(self.model, self.dataset, self.test_idx, self.cfg.eval_batch_size, beat)
        except EvaluationAbandoned:
            result, abandoned = Evaluation(0.0, 0, 0, 0), True
        finally:
            alive.drain()
            if kept is not None:
                self.buffers[...] = kept
        msg = Message(0).stamp(Tag.EVAL, self.rank, step=number, version=version, samples=result.count,
                               correct=result.correct, correct5=result.correct5, loss=result.loss_sum,
                               compute_s=time.perf_counter() - t0,
                               flags=Flag.EVALUATE | (Flag.PREEMPT if abandoned else 0))
        wait(self.comm.Isend(msg.buf, dest=0, tag=int(Tag.EVAL)), f"completion of the EVAL send (evaluation {number})",
             self.rank, self.cfg.worker_timeout)

    def run(self) -> bool:
        """Train until the run stops, then evaluate the final weights on this worker's test slice.

        Returns True if a signal ended the run (preempted: no evaluation, an EVAL of 0 images is sent).
        """
        self.train()
        self.stream.close()  # the prefetch thread: nothing more to read
        loss_sum = correct = count = correct5 = 0
        if not self.preempted:
            alive = Heartbeat(self.comm, self.rank, self.cfg.comm_timeout / 4, self.cfg.worker_timeout)
            loss_sum, correct, count, correct5 = evaluate(self.model, self.dataset, self.test_idx,
                                                          self.cfg.eval_batch_size, alive.beat)
            alive.drain()
        result = Message(0).stamp(Tag.EVAL, self.rank, samples=count, correct=correct, loss=loss_sum,
                                  correct5=correct5)
        sending = self.comm.Isend(result.buf, dest=0, tag=int(Tag.EVAL))
        wait(sending, "completion of the EVAL send", self.rank, self.cfg.worker_timeout)
        return self.preempted
