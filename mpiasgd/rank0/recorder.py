"""The recorder: the sole owner of the run log on rank 0, and of what it says about the run.

It keeps the run's figures (staleness, rejected pushes, the training loss's running level; the
version and images trained it reads from the server's `VersionCounter`, which the role advances),
judges the stopping rule and the divergence watch on them, writes every row (by field name), the
weight snapshots and the checkpoints, and builds the summary. Every mode's rank-0 role reports to
it; none of them touches the log.

Clocks: `now()` is the run log's clock (seconds since the run's first start, a resume included);
`train_time()` the training the state holds (the schedule's and --max-time's clock), up to the
stop once there is one, so the final evaluation counts as no training. Evaluations during training
(--eval-interval) are part of it: the run spends that time.

With --tensorboard (`tensorboard`, set by `serve`) the same figures also go to TensorBoard event files
(`mpiasgd.runlog.tensorboard`): the training metrics once per --flush-interval, each evaluation as it
is logged.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mpiasgd import checkpoint
from mpiasgd.comms import Interval
from mpiasgd.config import Config
from mpiasgd.health import AT_START, Finding, LossWatch, rejected_text, rejects_text
from mpiasgd.optim import StopRule, snapshot_seconds
from mpiasgd.rank0.advice import ExchangeWatch
from mpiasgd.rank0.counter import VersionCounter
from mpiasgd.rank0.evals import EvalShare
from mpiasgd.runlog import (
    CheckpointRow,
    EvalRow,
    EventRow,
    PeriodicEvalRow,
    PushRow,
    RunLog,
    ShardPushRow,
    SnapshotRow,
    UpdateRow,
    WireBytesRow,
)
from mpiasgd.runlog.reader import not_superseded, superseded_spans
from mpiasgd.runlog.tensorboard import TensorBoard


class TrainingDiverged(RuntimeError):
    """A worker pushed `max_rejects` non-finite gradients in a row; the message names it and the steps."""


class Window:
    """The training figures since the last TensorBoard point: pushes (reports) with images, their loss and
    accuracy, the updates' staleness, the workers' compute and data-wait seconds."""

    def __init__(self, samples: int = 0, time: float = 0.0) -> None:
        self.pushes = 0
        self.loss = 0.0       # sum of the minibatch mean losses
        self.correct = self.images = 0
        self.staleness = self.updates = 0
        self.compute_s = self.data_s = 0.0
        self.samples, self.time = samples, time  # rank 0's count and clock at the window's start


class ShardFigures:
    """(rank 0, --servers S > 1) Each parameter-server shard's figures, from the push rows it logged (shard 0)
    or sent (the others): its version, and the staleness of the pushes it applied (a resumed run's from
    every segment of the log: `restore`, as the run's staleness continues from its checkpoint's); and the
    bytes of the exchange each shard of rank >= 1 reports (`report_wire`: its counts in this job, on every
    SHARD_ROWS and SLICE) on top of those it had moved before this job (`wire_base`: a resume's
    checkpoint's). Shard 0's bytes are the recorder's own (`Recorder.wire_bytes`)."""

    def __init__(self, shards: int) -> None:
        self.versions = [0] * shards
        self.staleness_sum = [0] * shards
        self.staleness_max = [0] * shards
        self.applied = [0] * shards
        self.wire = [[0, 0] for _ in range(shards)]       # [pushed, pulled] each shard reported in this job
        self.wire_base = [[0, 0] for _ in range(shards)]  # [pushed, pulled] before this job (a resume)

    def count(self, shard: int, staleness: int, applied: bool) -> None:
        if applied:
            self.staleness_sum[shard] += int(staleness)
            self.staleness_max[shard] = max(self.staleness_max[shard], int(staleness))
            self.applied[shard] += 1

    def restore(self, rows: np.ndarray) -> None:
        """(--resume) Count the shard push rows `rows` (SHARD_PUSH_ROW, or its columns time, shard, staleness and
        applied: the log's, less the spans a resume superseded) as if this job had logged them."""
        applied = rows[rows["applied"] == 1]
        for s in range(len(self.applied)):
            staleness = applied["staleness"][applied["shard"] == s]
            if len(staleness):
                self.staleness_sum[s] += int(staleness.sum())
                self.staleness_max[s] = max(self.staleness_max[s], int(staleness.max()))
                self.applied[s] += len(staleness)

    def report_wire(self, shard: int, pushed: int, pulled: int) -> None:
        """Shard `shard`'s bytes pushed and pulled in this job so far, as its SHARD_ROWS or SLICE says (a count
        that only grows: the later of two messages that crossed is kept)."""
        mine = self.wire[shard]
        mine[0], mine[1] = max(mine[0], int(pushed)), max(mine[1], int(pulled))

    def wire_bytes(self, shard: int) -> tuple[int, int]:
        """(pushed, pulled) of shard `shard` >= 1 since the run's start."""
        return (self.wire_base[shard][0] + self.wire[shard][0], self.wire_base[shard][1] + self.wire[shard][1])

    def summary(self) -> dict:
        """The summary's per-shard entries (lists, shard 0 first)."""
        return {"shard_versions": list(self.versions),
                "shard_staleness_mean": [t / max(1, n) for t, n in zip(self.staleness_sum, self.applied, strict=True)],
                "shard_staleness_max": list(self.staleness_max)}


class Recorder:
    """Rank 0's account of the run, written to `log` (a RunLog).

    `cfg` gives the intervals (snapshot_interval, checkpoint_interval), the stopping rule, max_rejects,
    on_divergence and the checkpoint's config; `workers` are the worker ranks; `num_train` the
    training images (one epoch); `progress` a tqdm bar or None; `health` the divergence watch.
    `stop_workers()` (set by the loop) tells the workers to stop when the watch ends the run.
    With --servers S > 1 (`shards`, a ShardFigures) it also logs every shard's push rows (/shard_pushes).
    """

    keeps_log = True   # it writes the run log, snapshots and checkpoints (a shard's recorder does not)
    who = "rank 0"     # how its errors name the process

    def __init__(self, cfg: Config, log: RunLog, workers: range, num_train: int, progress: Any = None,
                 health: LossWatch | None = None) -> None:
        self.cfg, self.log, self.workers, self.num_train = cfg, log, workers, num_train
        self.progress, self.health = progress, health
        self.rule = StopRule.of(cfg)
        self.start = 0.0
        self.lost = 0.0                       # log clock minus training clock: time lost to a resume
        self.stop_reason = ""
        self.stop_time = 0.0
        self.counter = VersionCounter()             # the server's version and images (`reads`: the role's)
        self.staleness_sum = self.staleness_max = self.staleness_count = 0
        self.loss_avg = float("nan")
        self.loss_seen = False  # (a minibatch loss arrived: the running level is loss_avg)
        self.rejected = dict.fromkeys(workers, 0)       # non-finite gradients per worker
        self.rejects_in_row = dict.fromkeys(workers, 0)
        self.beyond_in_row: dict[int, tuple[int, float]] = {}  # --wire fp16: (rejects in the run beyond its range, max)
        self.warned_rejects: set[tuple[int, bool]] = set()     # (worker, beyond fp16's range) warned about once
        self.eval_share = EvalShare(cfg.eval_interval)   # --eval-interval: the evaluations' share of the time
        self.held_total = dict.fromkeys(workers, 0.0)   # ssp: seconds each worker's replies were held
        self.diverged = ""                    # --on-divergence stop: the symptom that ended the run
        self.checkpoint_path = checkpoint.checkpoint_path(log.path) if log is not None else ""
        self.model_spec = ""                  # the network's definition (JSON), stored with each checkpoint
        self.checkpoint_error = ""            # why the last checkpoint could not be written
        self.last_written: float | None = None  # run time of the last checkpoint this process wrote
        self.resumed: checkpoint.Checkpoint | None = None
        # --snapshot-interval -1 (auto): by the size of the weights (`optim.snapshot_seconds`)
        self.snapshots = Interval(snapshot_seconds(cfg.snapshot_interval, log.snapshot_values()) if log is not None
                                  else 0.0)
        self.checkpoints = Interval(cfg.checkpoint_interval if log is not None else 0.0)
        self.bar_refresh = Interval(0.5)
        self.stop_workers: Callable[[], None] = lambda: None
        self.meanwhile: Callable[[], None] = lambda: None  # between a checkpoint write's steps (Rank0: a signal)
        self.tensorboard: TensorBoard | None = None   # --tensorboard (`serve` opens it)
        self.metrics = Interval(cfg.flush_interval)    # a TensorBoard point of the training figures
        self.window = Window()
        self.lr = float("nan")                         # the step size of the last update
        self.wire_bytes: dict[str, int] | None = None  # parameter-server modes: bytes pushed and pulled (count_wire)
        self.shards: ShardFigures | None = None        # --servers S > 1: every shard's figures (`shard_push`)
        self.exchange: ExchangeWatch | None = None     # parameter-server modes: the workers' wait (the one advice)

    def reads(self, counter: VersionCounter) -> None:
        """Read the version and images from `counter`, the server's (the role that advances it calls this)."""
        self.counter = counter

    @property
    def version(self) -> int:
        """Updates the server applied (`VersionCounter.version`; read only: the role advances it)."""
        return self.counter.version

    @property
    def samples(self) -> int:
        """Images in the updates the server applied (`VersionCounter.samples`)."""
        return self.counter.samples

    # --- clocks ---
    def now(self) -> float:
        """Seconds on the run log's clock: since the run's first start, including time lost to a resume."""
        return time.perf_counter() - self.start

    def train_time(self) -> float:
        return (self.stop_time or self.now()) - self.lost

    @property
    def epoch(self) -> float:
        return self.samples / self.num_train

    def fraction_done(self) -> float:
        """Fraction of the run done, by the stopping rule closest to its limit."""
        return self.rule.fraction(self.epoch, self.version, self.train_time())

    def begin(self) -> None:
        """Start the clocks (and, resuming, continue the log's): the `start` or `resume` event."""
        self.start = time.perf_counter()
        ck = self.resumed
        if ck is not None:  # the log's clock continues after its last row; training's from the checkpoint
            offset = max(ck.log_time, self.log.last_time())
            self.start -= offset
            self.lost = offset - ck.elapsed
            self.checkpoints.restart(self.now())
            self.event("resume", f"resumed from '{ck.path}' ({ck.reason} checkpoint at version {ck.version}, "
                                 f"{ck.elapsed:.1f} s of training, epoch {self.epoch:.2f})")
        else:
            self.event("start", f"{len(self.workers)} worker{'s' * (len(self.workers) != 1)}", at=0.0)

    # --- rows ---
    def event(self, kind: str, text: str, at: float | None = None) -> None:
        self.log.add(EventRow(time=self.now() if at is None else at, kind=kind.encode(), text=text))

    def advise(self, text: str) -> None:
        """Advice on the flags (`mpiasgd.rank0.advice`; "": none): an event "advice" and one line on stderr."""
        if text and self.keeps_log:
            self.event("advice", text)
            print(f"mpiasgd: advice: {text}", file=sys.stderr, flush=True)

    def warn(self, text: str) -> None:
        """A warning: an event of kind "warning" and one line on stderr."""
        self.event("warning", text)
        print(f"mpiasgd: warning: {text}", file=sys.stderr, flush=True)

    def push(self, *, worker: int, step: int, base_version: int, version: int, staleness: int, loss: float,
             correct: int, samples: int, epoch: int, compute_s: float, comm_s: float, wait_s: float,
             applied: bool, lr: float, rejected: bool, held_s: float = 0.0, digest: int = 0,
             data_s: float = 0.0) -> None:
        """One row of the pushes table (see `mpiasgd.runlog`); an applied one with images also counts in the
        TensorBoard window (its loss and accuracy; every row its compute and data-wait seconds)."""
        self.log.add(PushRow(time=self.now(), worker=worker, step=step, base_version=base_version, version=version,
                             staleness=staleness, loss=loss, correct=correct, samples=samples, epoch=epoch,
                             compute_s=compute_s, comm_s=comm_s, wait_s=wait_s, applied=applied, lr=lr,
                             rejected=rejected, held_s=held_s, digest=digest, data_s=data_s))
        if self.shards is not None:  # shard 0's own row of the push
            self.shard_push(shard=0, time=self.now(), worker=worker, step=step, base_version=base_version,
                            version=version, staleness=staleness, applied=applied)
        win = self.window
        win.compute_s += float(compute_s)
        win.data_s += float(data_s)
        if applied and samples > 0:
            win.pushes += 1
            win.loss += float(loss)
            win.correct += int(correct)
            win.images += int(samples)

    def push_taken(self, w: int, h: np.void, *, base_version: int, staleness: int, applied: bool, rejected: bool,
                   lr: float, norm: float, held_s: float = 0.0) -> None:
        """A push of worker `w` (header `h`) that a server took: applied (the server advanced its counter first;
        its staleness counts, an updates row, its training loss, the stopping rules), rejected (not finite:
        `reject` follows) or dropped after the stop; then its pushes row, and a finite push ends the worker's
        run of rejects. `lr`: the step size it entered with (logged), `norm` the norm of what was applied."""
        if applied:
            self.count_staleness(staleness)
            self.update(version=self.version, lr=lr, grad_norm=norm)
            self.training_loss(float(h["loss"]), int(h["correct"]), int(h["samples"]))
            self.check_stop()
        self.push(worker=w, step=int(h["step"]), base_version=base_version, version=self.version,
                  staleness=staleness, loss=h["loss"], correct=h["correct"],
                  samples=h["samples"], epoch=h["epoch"], compute_s=h["compute_s"], comm_s=h["comm_s"],
                  wait_s=h["wait_s"], applied=applied, lr=lr, rejected=rejected, held_s=held_s, data_s=h["data_s"])
        if not rejected:
            self.accept(w)
        if self.exchange is not None and not self.exchange.advised:  # (once given, nothing more to watch)
            self.exchange.push(w, h["compute_s"], h["wait_s"])
            self.advise(self.exchange.advice(self.train_time() - (self.resumed.elapsed if self.resumed else 0.0)))

    def lost_push(self, worker: int, step: int, version: int) -> None:
        """(--servers S > 1, ULFM) Push `step` of dead worker `worker` never reached shard 0 (rank 0) and is
        counted there, with nothing applied, at `version` (`ShardedServer.count_lost`): shard 0's row (applied,
        staleness 0) and an event "lost_push"."""
        self.shard_push(shard=0, time=self.now(), worker=worker, step=step, base_version=version, version=version,
                        staleness=0, applied=True)
        self.event("lost_push", f"push {step} of worker rank {worker}, which died while sending it, reached another "
                                f"parameter-server shard but not shard 0: counted at version {version} with nothing "
                                "applied (its slice died with the worker)")

    def shard_push(self, *, shard: int, time: float, worker: int, step: int, base_version: int, version: int,
                   staleness: int, applied: bool) -> None:
        """(--servers S > 1) One row of /shard_pushes: a push as shard `shard` saw it, at `time` (rank 0's
        clock); counted in that shard's figures (`shards`)."""
        self.log.add(ShardPushRow(time=time, shard=shard, worker=worker, step=step, base_version=base_version,
                                  version=version, staleness=staleness, applied=applied))
        self.shards.count(shard, staleness, bool(applied))

    def update(self, *, version: int, lr: float, grad_norm: float = float("nan")) -> None:
        """One row of the updates table at the current figures (`version` and `samples` set first)."""
        self.lr = float(lr)
        self.log.add(UpdateRow(time=self.now(), version=version, lr=lr, grad_norm=grad_norm, samples=self.samples,
                               epoch=self.epoch))

    def snapshot(self, params: np.ndarray, buffers: np.ndarray | None = None, version: int | None = None,
                 samples: int | None = None) -> int:
        """Store `params` (float32 (P,)) and the layers' `buffers` (float32 (B,), None or empty for a network
        without any) as a snapshot of the current version and images (or of `version` and `samples`, where
        the weights are not rank 0's latest: sync's first worker sends them); returns its index in
        /snapshots/meta."""
        self.snapshots.restart(self.now())
        index = self.log.rows("snapshots/meta")
        version = self.version if version is None else version
        samples = self.samples if samples is None else samples
        self.log.add_snapshot(SnapshotRow(time=self.now(), version=version, samples=samples,
                                          epoch=samples / self.num_train), params,
                              buffers if buffers is not None and buffers.size else None)
        return index

    def periodic_eval(self, *, taken: float, samples: float, versions: tuple[int, int], loss_sum: float,
                      correct: int, correct5: int, count: int, seconds: float, snapshot: int = -1) -> None:
        """One evaluation during training (--eval-interval), summed over the evaluators: a row of
        /periodic_evals, a TensorBoard point (eval/...) and a line on the console. `taken` is the log time
        of the weights evaluated, `samples` the images trained on at them, `versions` (oldest, newest)."""
        loss, top1, top5 = loss_sum / count, correct / count, correct5 / count
        self.log.add(PeriodicEvalRow(time=taken, samples=round(samples), epoch=samples / self.num_train,
                                     version_min=versions[0], version_max=versions[1], count=count, loss=loss,
                                     top1=top1, top5=top5, seconds=seconds, snapshot=snapshot))
        if self.tensorboard is not None:
            self.tensorboard.scalars({"eval/loss": loss, "eval/top1": top1, "eval/top5": top5}, round(samples))
        span = f"{versions[0]}" if versions[0] == versions[1] else f"{versions[0]}..{versions[1]}"
        self.say(f"mpiasgd: evaluation at epoch {samples / self.num_train:.2f} (version {span}): test top-1 "
                 f"{100 * top1:.2f} %, top-5 {100 * top5:.2f} %, loss {loss:.4f} on {count:,} images "
                 f"({seconds:.1f} s)")
        too_long = self.eval_share.add(seconds, self.train_time() - (self.resumed.elapsed if self.resumed else 0.0))
        if too_long:  # once: evaluations that take most of the run cut its images per second as much
            self.warn(too_long)
        target = self.cfg.stop_accuracy
        if target and top1 >= target and not self.stop_reason:  # --stop-accuracy: a stopping rule of its own
            self.stop(f"stop_accuracy: test top-1 {100 * top1:.2f} % >= {100 * target:g} % at epoch "
                      f"{samples / self.num_train:.2f}")
            self.stop_workers()  # the modes whose workers judge their own stop (sync, pipeline) are told

    def say(self, line: str) -> None:
        """A line on the console, above the progress bar when there is one."""
        if self.progress is not None:
            self.progress.write(line)
        else:
            print(line, flush=True)

    # --- figures and rules ---
    def count_staleness(self, staleness: int) -> None:
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_count += 1
        self.window.staleness += staleness
        self.window.updates += 1

    def count_wire(self, pushed: int = 0, pulled: int = 0) -> None:
        """(parameter-server modes) Count the bytes of the messages of the exchange, header included: `pushed`,
        of a PUSH this server (rank 0, or a shard's) received (applied, rejected or drained); `pulled`, of a
        WEIGHTS or STOP it sent (the initial weights too). Modes that never call this have no such entries.

        Rank 0's sum over every shard (`wire_by_shard`: with --servers S > 1 the other shards report their
        own counts, `ShardFigures.report_wire`) is the summary's `wire_bytes_pushed` and `wire_bytes_pulled`
        (and, S > 1, `shard_wire_bytes_pushed` and `shard_wire_bytes_pulled`, shard 0 first). A resumed run
        continues the counts of its checkpoint (the log's /wire_bytes rows, `restore`); without them (a log
        written before they were, or lost) they count from the resume."""
        if self.wire_bytes is None:
            self.wire_bytes = {"pushed": 0, "pulled": 0}
        self.wire_bytes["pushed"] += pushed
        self.wire_bytes["pulled"] += pulled

    def wire_by_shard(self) -> list[tuple[int, int]] | None:
        """(pushed, pulled) bytes of every parameter-server shard since the run's start, shard 0 (this
        recorder's own count) first; None where the mode counts none (`count_wire`)."""
        if self.wire_bytes is None:
            return None
        own = (self.wire_bytes["pushed"], self.wire_bytes["pulled"])
        if self.shards is None:
            return [own]
        return [own, *(self.shards.wire_bytes(s) for s in range(1, len(self.shards.versions)))]

    def training_loss(self, loss: float, correct: int, samples: int) -> None:
        """A minibatch's mean loss (nats), its correct count and images: the running level (progress bar)
        and the divergence watch."""
        self.loss_avg = loss if self.loss_avg != self.loss_avg else 0.95 * self.loss_avg + 0.05 * loss
        self.loss_seen = True
        if self.health is not None:
            for finding in self.health.observe(self.epoch, loss, correct, samples):
                self.on_health(finding)

    def stop(self, reason: str) -> None:
        """The run stops: `reason` is logged (event "stop") and kept; the first reason wins."""
        if self.stop_reason:
            return
        self.stop_reason = reason
        self.stop_time = self.now()
        self.event("stop", reason)

    def check_stop(self) -> None:
        """The stopping rule on rank 0's figures: images, updates (`version`), training seconds."""
        if not self.stop_reason:
            reason = self.rule.reason(self.samples, self.num_train, self.version, self.train_time())
            if reason:
                self.stop(reason)

    def on_health(self, finding: Finding) -> None:
        """Log and print a symptom of divergence (or a recovery); with --on-divergence stop, a dead network
        ends the run as a stopping rule would, the reason saying why (status 'diverged'). A spike alone
        only warns: runs often recover from one."""
        self.event(finding.kind, finding.text)
        print(f"mpiasgd: {'note' if finding.kind == 'recovered' else 'warning'}: {finding.text}", file=sys.stderr,
              flush=True)
        if finding.kind != "dead" or self.cfg.on_divergence != "stop" or self.stop_reason:
            if finding.kind == "dead" and self.cfg.on_divergence == "stop":  # seen at the end: stopped anyway
                self.diverged = self.diverged or finding.text
            return
        self.diverged = finding.text
        self.stop(f"diverged ({finding.kind}; --on-divergence stop)")
        self.stop_workers()

    def reject(self, w: int, step: int, what: str = "gradient", advice: str = "", beyond: float = 0.0) -> None:
        """Count a non-finite `what` (a gradient; easgd: weights) of worker `w` at `step`; TrainingDiverged
        after `max_rejects` in a row, ending with `advice` ("": "lower --lr", or the divergence watch's word when
        the loss was far too large from the first minibatches, `LossWatch.at_start`). `beyond` > 0: the values
        were finite but beyond fp16's range (--wire fp16), the largest magnitude `beyond`: named as such, not as
        divergence (`mpiasgd.health.rejects_text`). The first reject of each kind from a worker is warned about."""
        self.rejected[w] += 1
        self.rejects_in_row[w] += 1
        count, largest = self.beyond_in_row.get(w, (0, 0.0))
        if beyond:
            self.beyond_in_row[w] = count, largest = count + 1, max(largest, beyond)
        if (w, bool(beyond)) not in self.warned_rejects:
            self.warned_rejects.add((w, bool(beyond)))
            self.warn(rejected_text(w, step, what, beyond))
        if not advice:  # the network broken before any step size acted, or the step size
            advice = self.health.at_start if self.health is not None and self.health.at_start else "lower --lr"
        if self.rejects_in_row[w] >= self.cfg.max_rejects:
            raise TrainingDiverged(rejects_text(self.who, w, step, self.rejects_in_row[w], self.cfg.max_rejects, what,
                                                advice, count, largest, updated=self.version > 0))

    def accept(self, w: int) -> None:
        """Worker `w`'s gradient was finite: its run of rejects is over."""
        self.rejects_in_row[w] = 0
        self.beyond_in_row.pop(w, None)

    # --- checkpoints ---
    def checkpoint(self, params: np.ndarray, momentum: np.ndarray, reason: str, steps: dict,
                   elapsed: float, buffers: np.ndarray | None = None,
                   shard_versions: list[int] | None = None) -> checkpoint.Checkpoint:
        """A Checkpoint of `params`, `momentum` (float32 (P,)), the layers' `buffers` (float32 (B,)) and
        `steps` ({worker: (step, cursor)}) with the run's figures; `elapsed` training seconds;
        `shard_versions` (--servers S > 1) every shard's version, shard 0's (rank 0's) first."""
        rows = np.array([(w, steps[w][0], steps[w][1], self.rejected[w]) for w in self.workers],
                        dtype=checkpoint.WORKER_STATE)
        return checkpoint.Checkpoint(
            params=params, momentum=momentum, workers=rows, version=self.version, samples=self.samples,
            elapsed=elapsed, log_time=self.now(), config=self.cfg.to_json(), log=self.log.path,
            mode=self.cfg.mode, model=self.cfg.model, reason=reason, run_id=self.log.run_id,
            staleness_sum=self.staleness_sum, staleness_max=self.staleness_max,
            staleness_count=self.staleness_count,
            buffers=np.zeros(0, np.float32) if buffers is None else np.array(buffers, np.float32),
            model_spec=self.model_spec,
            shard_versions=np.array(shard_versions or [], np.int64))

    def write_checkpoint(self, ckpt: checkpoint.Checkpoint) -> bool:
        """Write `ckpt` atomically and log it (the checkpoints table); a failed write is a warning, not the
        end of the run: the previous checkpoint stays. Returns whether it was written; `checkpoint_error`
        keeps the last failure's text ("" after a success)."""
        self.checkpoints.restart(self.now())
        t0 = self.now()
        wire = self.wire_by_shard()  # kept in the checkpoint too: a resume continues them (`restore_from_log`)
        if wire is not None:
            ckpt.wire_bytes = np.array(wire, np.int64).reshape(-1, 2)
        try:
            seconds = checkpoint.write(self.checkpoint_path, ckpt, self.meanwhile)
        except OSError as e:
            kept = ("the previous one stays" if os.path.isfile(self.checkpoint_path) else
                    "there is no earlier one")
            text = f"checkpoint '{self.checkpoint_path}' not written ({e}); {kept}"
            self.event("warning", text)
            print(f"mpiasgd: warning: {text}", file=sys.stderr, flush=True)
            self.checkpoint_error = text
            return False
        self.checkpoint_error = ""
        self.last_written = t0
        self.log.add(CheckpointRow(time=t0, seconds=seconds, version=ckpt.version, samples=ckpt.samples,
                                   elapsed=ckpt.elapsed, reason=ckpt.reason.encode()))
        for shard, (pushed, pulled) in enumerate(wire or []):  # (the log's copy of the checkpoint's counts)
            self.log.add(WireBytesRow(time=ckpt.log_time, shard=shard, pushed=pushed, pulled=pulled))
        self.log.flush()  # every row up to the checkpoint is on disk with it: a resume supersedes only later ones
        return True

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        """The figures of checkpoint `ckpt` (before `begin`; the role restores the version and images): staleness,
        rejects; and from the reopened log (`restore_from_log`) the bytes moved and, --servers S > 1, each
        shard's staleness."""
        self.staleness_sum, self.staleness_max = ckpt.staleness_sum, ckpt.staleness_max
        self.staleness_count = ckpt.staleness_count
        for row in ckpt.workers:
            self.rejected[int(row["rank"])] = int(row["rejected"])
        self.resumed = ckpt
        self.restore_from_log(ckpt)

    def restore_from_log(self, ckpt: checkpoint.Checkpoint) -> None:
        """(--resume) The bytes each shard had moved at `ckpt`: the checkpoint's own counts (`wire_bytes`), or in
        a checkpoint written before it kept them, the /wire_bytes rows of the log it continues at its log time
        (none in a log written before them or a new one: the counts start at zero). And the figures the
        checkpoint does not hold, from that log: with --servers S > 1 every shard's staleness over the
        /shard_pushes rows logged so far, less the spans this resume superseded (rows of the segment's after
        its checkpoint)."""
        f = getattr(self.log, "file", None)
        counts = [(shard, int(pushed), int(pulled)) for shard, (pushed, pulled) in enumerate(ckpt.wire_bytes.tolist())]
        if not counts and f is not None and "wire_bytes" in f:
            rows = f["wire_bytes"][()]
            rows = rows[rows["time"] == ckpt.log_time]
            counts = list(zip(rows["shard"].tolist(), rows["pushed"].tolist(), rows["pulled"].tolist(), strict=True))
        for shard, pushed, pulled in counts:
            if shard == 0:
                self.wire_bytes = {"pushed": pushed, "pulled": pulled}
            elif self.shards is not None and shard < len(self.shards.wire_base):
                self.shards.wire_base[shard] = [pushed, pulled]
        if f is None:
            return
        if self.shards is not None and "shard_pushes" in f:  # (in pieces: a long run's table is large)
            table, spans = f["shard_pushes"], superseded_spans(f.attrs.get("superseded"))
            fields = table.fields(["time", "shard", "worker", "step", "staleness", "applied"])
            for start in range(0, table.shape[0], 1 << 20):
                rows = fields[start:start + (1 << 20)]
                self.shards.restore(not_superseded(rows, spans, by_step=True))

    # --- the log's flush and the TensorBoard points ---
    def maybe_flush(self) -> None:
        """Between messages: the log's flush (every --flush-interval) and, with --tensorboard, a point of the
        training figures at the same pace."""
        if self.tensorboard is not None and self.metrics.due(self.now()):
            self.training_point()
        self.log.maybe_flush()

    def training_point(self) -> None:
        """The TensorBoard point of the figures since the last one (train/...), then a new window."""
        win, now = self.window, self.now()
        nan = float("nan")
        seconds = now - win.time
        self.tensorboard.scalars({
            "train/loss": win.loss / win.pushes if win.pushes else nan,
            "train/accuracy": win.correct / win.images if win.images else nan,
            "train/lr": self.lr,
            "train/images_per_s": (self.samples - win.samples) / seconds if seconds > 0 else nan,
            "train/staleness": win.staleness / win.updates if win.updates else nan,
            "train/data_wait": win.data_s / win.compute_s if win.compute_s > 0 else nan,
        }, self.samples)
        self.tensorboard.flush()
        self.window = Window(self.samples, now)

    def close_tensorboard(self) -> None:
        """The last TensorBoard point and the event files closed (at the end, however the run ends)."""
        if self.tensorboard is not None:
            if self.window.pushes:
                self.training_point()
            self.tensorboard.close()

    # --- progress and the end ---
    def show_progress(self, force: bool = False) -> None:
        """The progress bar's figures, about twice a second (`force`: now)."""
        if self.progress is None or not (force or self.bar_refresh.due(self.now())):
            return
        self.progress.n = min(self.samples, self.progress.total or self.samples)
        mean_stale = self.staleness_sum / max(1, self.staleness_count)
        self.progress.set_postfix_str(
            f"epoch {self.epoch:.2f} loss {self._shown_loss()} staleness {mean_stale:.2f}", refresh=True)

    def _shown_loss(self) -> str:
        """The progress bar's loss: "-" before the first minibatch loss arrives (a NaN after it is shown)."""
        return f"{self.loss_avg:.3f}" if self.loss_seen else "-"

    def finish_watch(self) -> None:
        """The divergence watch's last judgement (a dead network seen only at the end)."""
        if self.health is not None:
            for finding in self.health.finish():
                self.on_health(finding)

    def summary(self, evals: dict, preempted: str) -> dict:
        """The evaluation row and end event, and the summary dict (also stored as log attributes).

        `evals` maps a worker to (summed loss, correct, images, top-5 correct) of its test slice (an
        `mpiasgd.model.Evaluation` or a tuple in that order); `preempted` is why a signal ended the run
        ("" otherwise: then no evaluation row is written)."""
        loss_sum = sum(e[0] for e in evals.values())
        correct = sum(e[1] for e in evals.values())
        count = sum(e[2] for e in evals.values())
        correct5 = sum(e[3] for e in evals.values())
        accuracy = correct / count if count else float("nan")
        top5 = correct5 / count if count else float("nan")
        test_loss = loss_sum / count if count else float("nan")
        if not preempted:  # no evaluation row for a run cut short: the resumed run will add one
            self.log.add(EvalRow(time=self.now(), version=self.version, epoch=self.epoch, snapshot=-1, loss=test_loss,
                                 accuracy=accuracy, count=count, top5=top5))
            if self.tensorboard is not None:
                self.tensorboard.scalars({"test/loss": test_loss, "test/top1": accuracy, "test/top5": top5},
                                         self.samples)
        self.event("end", f"preempted ({preempted}): no final evaluation" if preempted
                   else f"test accuracy {accuracy:.4f} (top-5 {top5:.4f}) on {count} images")
        train_time = self.train_time()  # time lost to a resume, or spent on the final evaluation, is not training
        if self.shards is not None:
            self.shards.versions[0] = self.version
        return {
            "wall_time_s": self.now(),
            "train_time_s": train_time,
            "test_accuracy": accuracy,
            "test_top5": top5,
            "test_loss": test_loss,
            "test_count": count,
            "version": self.version,
            "samples": self.samples,
            "epochs_done": self.epoch,
            "images_per_s": self.samples / train_time if train_time else 0.0,
            "staleness_mean": self.staleness_sum / max(1, self.staleness_count),
            "staleness_max": self.staleness_max,
            "stop_reason": self.stop_reason,
            "rejected": sum(self.rejected.values()),
            "held_s": sum(self.held_total.values()),
            "preempted": preempted,
            "health": self.final_health(test_loss, count),
            "diverged": self.diverged,
            **self.wire_summary(),
            **(self.shards.summary() if self.shards is not None else {}),
        }

    def final_health(self, test_loss: float, count: int) -> str:
        """The summary's `health`: the divergence watch's state at the end (`LossWatch.final_state`), or, for a
        network whose final weights compute a non-finite test loss (every push rejected, --max-rejects set high;
        the watch sees no finite loss), a line saying so; "" if healthy."""
        state = self.health.final_state() if self.health is not None else ""
        if state or not count or math.isfinite(test_loss):
            return state
        rejected = sum(self.rejected.values())
        return (f"non-finite: the final weights compute a non-finite test loss ({test_loss}); {rejected:,} pushes "
                f"were rejected as non-finite" + (f", {AT_START}" if self.version == 0 else ""))

    def wire_summary(self) -> dict:
        """The summary's byte counts (`count_wire`): wire_bytes_pushed and wire_bytes_pulled over every shard,
        and with --servers S > 1 each shard's (shard_wire_bytes_pushed, shard_wire_bytes_pulled); {} where
        the mode counts none."""
        shards = self.wire_by_shard()
        if shards is None:
            return {}
        out = {"wire_bytes_pushed": sum(p for p, _ in shards), "wire_bytes_pulled": sum(q for _, q in shards)}
        if self.shards is not None:
            out.update(shard_wire_bytes_pushed=[p for p, _ in shards], shard_wire_bytes_pulled=[q for _, q in shards])
        return out
