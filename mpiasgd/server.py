"""The parameter server (rank 0): master weights, optimizer, stopping rule, snapshots, run log.

Asynchronous SGD as in GPU A-SGD (Paine et al. 2013, arXiv 1312.6186) and Downpour SGD (Dean et
al. 2012): every PUSH is applied the moment it arrives,

    staleness = version (server, before the update) - base version (the push was computed from)
    nsync = 1:  w <- SGD-momentum step of w with the pushed gradient scaled by f(staleness)
                (v <- momentum v + f g + wd w; w <- w - lr v: see optim.SGD)
    nsync = K:  w <- w + f(staleness) * u, u = the worker's accumulated update over K local steps
    version <- version + 1

and answered with the new weights (WEIGHTS, carrying the step size for the worker's local steps),
so no worker ever waits for another. f is 1, or with `--staleness-lr inverse` 1 / max(1,
staleness) (Zhang et al. 2016, arXiv 1511.05950; `sqrt`: 1 / sqrt(max(1, staleness))).

`--mode ssp` (stale synchronous parallel, Ho et al. 2013): a worker's clock is the number of
pushes it has made; the reply to a push that leaves its worker more than `--staleness-bound` s
clocks ahead of the slowest running worker is held until the slowest catches up, so no worker
computes step c + 1 before every other has pushed step c - s. s = 0 is lockstep (BSP). The time
each reply was held is logged (pushes table, `held_s`, on the worker's next push).

`--warm-start S`: only worker rank 1 gets its first weights at start-up; the others get theirs
once S seconds have passed (GPU A-SGD's warm start).

A push whose payload is not finite is rejected (not applied, counted per worker, answered with the
current weights); `--max-rejects` of them in a row from one worker stop the run with an error. Once a
stopping rule fires, each worker's next push is answered with STOP and the final weights instead;
the worker evaluates its slice of the test set and sends EVAL. The run ends when every worker has
sent EVAL, with no request pending. The server never computes gradients.

Checkpoints (`mpiasgd.checkpoint`): every `--checkpoint-interval` seconds, at the end, and at once
when a signal arrives (`preempt`: the stop reason, STOPs flagged PREEMPT, the job ends with status
75 within PREEMPT_GRACE seconds). `restore` continues from one (`--resume`).

`SyncMonitor` is rank 0 of `--mode sync`: the workers allreduce among themselves; it sends the
initial weights, logs their REPORTs and SNAPSHOTs, and collects the EVALs.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import checkpoint, protocol, signals
from mpiasgd.comms import PAUSE_GAP, Backoff, CommTimeout, probe, wait, wait_all
from mpiasgd.config import Config
from mpiasgd.health import Finding, LossWatch
from mpiasgd.optim import SGD, apply_delta, finite_square, fraction_done, learning_rate, staleness_factor
from mpiasgd.protocol import Flag, Message, ProtocolError, Tag
from mpiasgd.runlog import RunLog


class WorkerFailed(RuntimeError):
    """A worker reported an exception (ERROR message); `rank` and `text` (its traceback) are kept."""

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(f"worker rank {rank} failed:\n{text}")
        self.rank = rank
        self.text = text


PREEMPT_GRACE = 5.0  # seconds the workers have to answer after a preemption signal
class Preempted(RuntimeError):
    """The run was preempted and `waiting` workers did not answer within PREEMPT_GRACE seconds (hung),
    or (`dead`) their processes had exited when the signal came: the launcher is ending the job
    because a rank died. The checkpoint is written; the job must be aborted."""

    def __init__(self, why: str, waiting: list[int], dead: bool = False) -> None:
        super().__init__(f"{why}; workers {waiting} " + ("have exited" if dead else
                                                         f"did not answer within {PREEMPT_GRACE:g} s"))
        self.why = why
        self.waiting = waiting
        self.dead = dead


class TrainingDiverged(RuntimeError):
    """A worker pushed `max_rejects` non-finite gradients in a row; the message names it and the steps."""


class ParameterServer:
    """(server only) Serves pushes from workers 1..num_workers over `comm`; see the module docstring.

    `params` (float32 (P,)) are the initial master weights; `self.params` is always the current
    master weight vector (updates write it into a worker's send buffer, see `send`); `decay_mask` (float32
    (P,)) marks the weights that take weight decay; `num_train` is the size of the training set,
    which defines an epoch. `log` receives every row; `progress` (a tqdm bar or None) is updated
    about twice a second.
    """

    checkpoints_here = True  # rank 0 holds the state (async, ssp); sync and pipeline: the workers send it

    def __init__(self, comm: Any, cfg: Config, params: np.ndarray, decay_mask: np.ndarray,
                 num_workers: int, num_train: int, log: RunLog, progress: Any = None) -> None:
        self.comm = comm
        self.rank = 0
        self.cfg = cfg
        self.params = params
        self.optimizer = SGD(params, decay_mask, cfg.momentum, cfg.weight_decay)
        self.workers = range(1, num_workers + 1)
        self.num_train = num_train
        self.log = log
        self.progress = progress
        self.version = 0
        self.samples = 0                      # images in applied pushes
        self.last_step = dict.fromkeys(self.workers, 0)
        self.last_seen = dict.fromkeys(self.workers, 0.0)  # seconds since start of each worker's last message
        self.stopped: set[int] = set()        # workers sent STOP
        self.evals: dict[int, tuple] = {}     # worker -> (loss sum, correct, count)
        self.stop_reason = ""
        self.inbox = {w: Message(params.size) for w in self.workers}
        self.header_only = Message(0)         # EVAL and REPORT: received and handled one at a time
        self.checkpoint_inbox: Message | None = None
        self.state_msgs: list[Message] = []   # sync, pipeline, resuming: the velocity sent to each worker,
        self.state_sends: list[Any] = []      # kept until its send completed (at the end)
        self.stops: dict[int, Message] = {}   # sync, pipeline: the STOP sent to each worker
        self.outbox = {w: Message(params.size) for w in self.workers}
        self.sending: dict[int, Any] = dict.fromkeys(self.workers)
        self.start = 0.0
        self.last_snapshot = 0.0
        self.last_progress = 0.0
        self.last_stall_check = 0.0
        self.last_tick: float | None = None   # when rank 0's loop last ticked (a gap: rank 0 itself was paused)
        self.warned: set[int] = set()         # workers warned about (--stall-warning) in their current silence
        self.stop_time = 0.0
        self.staleness_sum = 0
        self.staleness_max = 0
        self.staleness_count = 0              # applied pushes (rows) the staleness figures cover
        self.loss_avg = float("nan")
        self.rejected = dict.fromkeys(self.workers, 0)       # non-finite pushes per worker
        self.rejects_in_row = dict.fromkeys(self.workers, 0)
        self.started: set[int] = set()        # workers sent their first weights (--warm-start holds back some)
        self.held: dict[int, tuple[int, float]] = {}  # ssp: worker -> (step answered, time held since)
        self.digests: dict[tuple[int, int], tuple] = {}  # sync/pipeline: (group, step) -> (first digest, ranks)
        self.clock_offset = dict.fromkeys(self.workers, 0)  # ssp: the slowest clock when a late starter began
        self.held_s = dict.fromkeys(self.workers, 0.0)  # ssp: how long the last reply to each worker was held
        self.held_total = dict.fromkeys(self.workers, 0.0)
        self.cursor = dict.fromkeys(self.workers, 0)  # minibatches each worker drew (its data position)
        self.checkpoint_path = checkpoint.checkpoint_path(log.path)
        self.last_checkpoint = 0.0
        self.lost = 0.0                       # log clock minus training clock: time lost to a resume
        self.resumed: checkpoint.Checkpoint | None = None
        self.preempted = ""                   # why the run ends on a signal ("" otherwise)
        self.preempt_reason = "preempt"
        self.late_signal = ""                 # a signal that came while the run was already ending
        self.checkpoint_error = ""            # why the last checkpoint could not be written
        self.last_written: float | None = None  # run time of the last checkpoint this process wrote
        self.preempt_time: float | None = None  # run time the preempting signal came
        self.preempt_deadline = 0.0
        self.pids: dict[int, tuple[str, int]] = {}  # worker -> (host, pid), to name dead ones (train sets it)
        self.health: LossWatch | None = None  # divergence and dead-network watch (train sets it: needs the classes)
        self.diverged = ""                    # --on-divergence stop: the symptom that ended the run
        self.host = socket.gethostname()

    # --- clocks and rules ---
    def now(self) -> float:
        """Seconds on the run log's clock: since the run's first start, including time lost to a resume."""
        return time.perf_counter() - self.start

    def train_time(self) -> float:
        """Seconds of training the current state holds (the schedule's and --max-time's clock): up to the
        stop once there is one, so the final evaluation after it counts as no training, in the summary
        and in the `end` checkpoint (a resume for a longer --max-time trains the rest)."""
        return (self.stop_time or self.now()) - self.lost

    @property
    def epoch(self) -> float:
        return self.samples / self.num_train

    def fraction_done(self) -> float:
        """Fraction of the run done, by the stopping rule closest to its limit."""
        return fraction_done(self.cfg, self.epoch, self.version, self.train_time())

    def local_lr(self) -> float:
        """The step size a worker's nsync local steps use: the schedule at the middle of its next round
        (K minibatches by each of the N workers ahead), so that warm-up does not start them at 0."""
        ahead = 0.5 * self.cfg.nsync * self.cfg.batch_size * len(self.workers) / self.num_train
        epoch = self.epoch + ahead
        return learning_rate(self.cfg, epoch, fraction_done(self.cfg, epoch, self.version, self.train_time()))

    def check_stop(self) -> None:
        cfg = self.cfg
        if self.stop_reason:
            return
        if cfg.epochs and self.samples >= cfg.epochs * self.num_train:
            self.stop_reason = f"epochs: {self.epoch:.2f} >= {cfg.epochs:g}"
        elif cfg.max_pushes and self.version >= cfg.max_pushes:
            self.stop_reason = f"max_pushes: {self.version} >= {cfg.max_pushes}"
        elif cfg.max_time and self.train_time() >= cfg.max_time:
            self.stop_reason = f"max_time: {self.train_time():.1f} s >= {cfg.max_time:g} s"
        if self.stop_reason:
            self.stop_time = self.now()
            self.log.add("events", (self.now(), b"stop", self.stop_reason))

    def watch_loss(self, loss: float, correct: int, samples: int) -> None:
        """Feed one training row (minibatch loss in nats, correct count, images) to the divergence watch."""
        if self.health is not None:
            for finding in self.health.observe(self.epoch, loss, correct, samples):
                self.on_health(finding)

    def on_health(self, finding: Finding) -> None:
        """Log and print a symptom of divergence (or a recovery); with --on-divergence stop, a dead network
        ends the run as a stopping rule would, the reason saying why (status 'diverged'). A spike alone
        only warns: runs often recover from one."""
        self.log.add("events", (self.now(), finding.kind.encode(), finding.text))
        print(f"mpiasgd: {'note' if finding.kind == 'recovered' else 'warning'}: {finding.text}", file=sys.stderr,
              flush=True)
        if finding.kind != "dead" or self.cfg.on_divergence != "stop" or self.stop_reason:
            if finding.kind == "dead" and self.cfg.on_divergence == "stop":  # seen at the end: stopped anyway
                self.diverged = self.diverged or finding.text
            return
        self.diverged = finding.text
        self.stop_reason = f"diverged ({finding.kind}; --on-divergence stop)"
        self.stop_time = self.now()
        self.log.add("events", (self.now(), b"stop", self.stop_reason))
        self.stop_workers()

    def stop_workers(self) -> None:
        """Tell the workers the run stops (before a stopping rule they judge themselves would): here nothing,
        each worker's next push is answered with STOP."""

    def snapshot(self) -> None:
        self.last_snapshot = self.now()
        self.log.add_snapshot((self.last_snapshot, self.version, self.samples, self.epoch), self.params)

    def tick(self) -> None:
        """Clock-driven duties between messages: signals, time limit, warm start, snapshots, checkpoints,
        log flush, progress bar."""
        self.skip_pause()
        if signals.received() and not self.preempted and not self.late_signal:
            self.preempt(f"{signals.received()} received by rank 0")
        self.check_stop()
        if len(self.started) < len(self.workers) and (self.now() >= self.cfg.warm_start or self.stop_reason):
            self.start_workers()
        self.release()  # ssp: a stop answers every held push
        if self.now() - self.last_stall_check >= 0.5:
            self.last_stall_check = self.now()
            self.check_stalls()
        if (self.cfg.snapshot_interval and self.cfg.mode in ("async", "ssp") and not self.stop_reason
                and self.now() - self.last_snapshot >= self.cfg.snapshot_interval):
            self.snapshot()
        if (self.checkpoints_here and self.cfg.checkpoint_interval and not self.stop_reason
                and self.now() - self.last_checkpoint >= self.cfg.checkpoint_interval):
            self.write_checkpoint("interval")
        self.log.maybe_flush()
        if self.progress is not None and self.now() - self.last_progress >= 0.5:
            self.show_progress()

    def show_progress(self) -> None:
        self.last_progress = self.now()
        self.progress.n = min(self.samples, self.progress.total or self.samples)
        mean_stale = self.staleness_sum / max(1, self.staleness_count)
        self.progress.set_postfix_str(
            f"epoch {self.epoch:.2f} loss {self.loss_avg:.3f} staleness {mean_stale:.2f}", refresh=True)

    # --- the loop ---
    def run(self) -> dict:
        """Serve until every worker has been stopped and has sent its EVAL; returns the summary dict."""
        self.start = time.perf_counter()
        if self.resumed is not None:  # the log's clock continues after its last row; training's from the checkpoint
            offset = max(self.resumed.log_time, self.log.last_time())
            self.start -= offset
            self.lost = offset - self.resumed.elapsed
            self.last_checkpoint = self.last_snapshot = self.now()
            ck = self.resumed
            self.log.add("events", (self.now(), b"resume", f"resumed from '{ck.path}' ({ck.reason} checkpoint at "
                                                           f"version {ck.version}, {ck.elapsed:.1f} s of training, "
                                                           f"epoch {self.epoch:.2f})"))
        else:
            self.log.add("events", (0.0, b"start", f"{len(self.workers)} workers"))
        self.snapshot()
        self.begin()
        self.serve()
        return self.finish()

    def begin(self) -> None:
        """Send the first weights: to every worker, or (--warm-start, not on a resume) to the first one only."""
        if self.cfg.warm_start > 0 and len(self.workers) > 1 and self.resumed is None:
            self.started.add(self.workers[0])
            self.send(self.workers[0], Tag.WEIGHTS, step=0, initial=True)
            self.log.add("events", (0.0, b"warm_start", f"worker rank {self.workers[0]} trains alone for "
                                                        f"{self.cfg.warm_start:g} s"))
        else:
            self.start_workers()

    def done(self) -> bool:
        """The loop's end: every worker has sent its EVAL."""
        return len(self.evals) == len(self.workers)

    def waiting_for(self) -> list[int]:
        """The workers `done()` still waits for (named when a wait times out)."""
        return [w for w in self.workers if w not in self.evals]

    def serve(self) -> None:
        """Handle messages until `done()`, then complete every send."""
        backoff = Backoff()
        while not self.done():
            if (self.preempted or self.late_signal) and time.perf_counter() > self.preempt_deadline:
                self.end_late()
                raise Preempted(self.preempted, self.waiting_for())
            try:
                timeout = PREEMPT_GRACE if self.preempted or self.late_signal else self.cfg.comm_timeout
                message, status = probe(self.comm, self.rank, timeout,
                                        "message from any worker", backoff, idle=self.tick)
            except CommTimeout as e:
                if self.preempted or self.late_signal:
                    self.end_late()
                    raise Preempted(self.preempted, self.waiting_for()) from None
                try:
                    self.check_stalls()  # names the silent workers, held ones (ssp) aside
                except CommTimeout as stall:
                    raise stall from None  # its own traceback, not the probe's timeout above it again
                waiting = self.waiting_for()
                silent = ", ".join(f"rank {w} ({self.now() - self.last_seen[w]:.0f} s)" for w in waiting)
                raise CommTimeout(f"{e}; still waiting for workers {waiting}; time since each last sent: "
                                  f"{silent} (hung or very slow; see --comm-timeout)") from None
            self.handle(message, status)
            self.last_seen[status.Get_source()] = self.now()
            self.tick()
        wait_all(list(self.sending.values()) + self.state_sends, "completion of the final sends", self.rank,
                 self.cfg.comm_timeout)

    def skip_pause(self) -> None:
        """Rank 0's own loop did not run for more than PAUSE_GAP seconds since its last tick (its process was
        stopped, SIGSTOP then SIGCONT, or starved, or busy writing): the workers' messages waited in the
        queue meanwhile, so that gap is not their silence. It is taken off every worker's silence
        (--stall-warning, --comm-timeout) and logged as one event "pause" instead of stall warnings; a
        hung worker is still named once it has been silent that long while rank 0 ran."""
        now = self.now()
        gap = 0.0 if self.last_tick is None else now - self.last_tick
        self.last_tick = now
        if gap <= PAUSE_GAP:
            return
        for w in self.workers:
            self.last_seen[w] = min(now, self.last_seen[w] + gap)
        text = (f"rank 0 was paused for {gap:.1f} s (its loop did not run: the process was stopped, starved or "
                f"busy); not counted as the workers' silence")
        self.log.add("events", (now, b"pause", text))
        print(f"mpiasgd: note: {text}", file=sys.stderr, flush=True)

    def check_stalls(self) -> None:
        """CommTimeout naming the workers silent for more than --comm-timeout, longest first.

        Only workers the loop still waits for count, and not those whose reply is held (ssp): they
        wait for the server. So a hung worker is named even while the others keep training. A pause of
        rank 0 itself is not counted (`skip_pause`).
        """
        self.skip_pause()
        limit = self.cfg.comm_timeout
        silent = sorted(((self.now() - self.last_seen[w], w) for w in self.waiting_for()
                         if w in self.started and w not in self.held), reverse=True)
        warn = self.cfg.stall_warning
        for quiet, w in silent:  # --stall-warning: one warning per silence, before the abort
            if warn and warn < limit and quiet > warn and w not in self.warned:
                self.warned.add(w)
                text = (f"worker rank {w} has sent nothing for {quiet:.1f} s (--stall-warning {warn:g} s); "
                        f"the run ends if it stays silent for {limit:g} s (--comm-timeout)")
                self.log.add("events", (self.now(), b"warning", text))
                print(f"mpiasgd: warning: {text}", file=sys.stderr, flush=True)
        self.warned -= {w for quiet, w in silent if quiet <= (warn or 0)}  # it spoke again: warn anew next time
        if silent and silent[0][0] > limit:
            names = ", ".join(f"rank {w} ({s:.1f} s)" for s, w in silent if s > limit)
            raise CommTimeout(f"rank 0: worker rank {silent[0][1]} has sent nothing for {silent[0][0]:.1f} s "
                              f"(--comm-timeout {limit:g} s): hung or very slow; silent longer than that: {names}")

    def start_workers(self) -> None:
        """Send the first weights to every worker not started yet (at start-up, or when the warm start ends)."""
        if self.started:
            late = [w for w in self.workers if w not in self.started]
            text = (f"the run stopped before the warm start ended: workers {late} never trained" if self.stop_reason
                    else f"the other workers start at version {self.version}")
            self.log.add("events", (self.now(), b"warm_start_end", text))
            if self.stop_reason:
                print(f"mpiasgd: warning: {text} (--warm-start {self.cfg.warm_start:g} s)", file=sys.stderr,
                      flush=True)
        slowest = self.slowest_clock()
        for w in self.workers:
            if w not in self.started:
                self.clock_offset[w] = slowest  # ssp: a warm-started worker is not held back by late starters
                self.started.add(w)
                self.last_seen[w] = self.now()
                self.send(w, Tag.STOP if self.stop_reason else Tag.WEIGHTS, step=self.last_step[w], initial=True)
                if self.stop_reason:
                    self.stopped.add(w)

    def handle(self, message: Any, status: Any) -> None:
        """Receive one probed message and act on it; ProtocolError on anything outside the protocol."""
        source = status.Get_source()
        tag = protocol.parse_tag(status.Get_tag(), source, self.rank)
        nbytes = status.Get_count(MPI.BYTE)
        if source not in self.workers:
            raise ProtocolError(f"rank 0: {tag.name} message from rank {source}, which is not a worker "
                                f"(workers are ranks 1..{len(self.workers)})")
        if tag == Tag.ERROR:
            msg = Message(max(0, nbytes - protocol.HEADER_BYTES) // 4)
            message.Recv(msg.buf[:nbytes])
            raise WorkerFailed(source, protocol.error_text(msg))
        handlers = self.handlers()
        if tag not in handlers:
            raise ProtocolError(f"rank 0: unexpected {tag.name} message from rank {source} (in mode "
                                f"'{self.cfg.mode}' rank 0 receives {', '.join(t.name for t in handlers)} and ERROR)")
        msg = self.buffer_for(tag, source)
        protocol.check_size(tag, source, self.rank, nbytes, msg.count)
        message.Recv(msg.buf)
        protocol.check(msg, tag, source, self.rank)
        handlers[tag](source, msg)

    def buffer_for(self, tag: Tag, source: int) -> Message:
        """The receive buffer of a `tag` message from worker `source` (its size is checked against it)."""
        if tag == Tag.CHECKPOINT:  # weights and velocity (sync)
            if self.checkpoint_inbox is None:
                self.checkpoint_inbox = Message(2 * self.params.size)
            return self.checkpoint_inbox
        return self.inbox[source] if tag in (Tag.PUSH, Tag.SNAPSHOT) else self.header_only

    def handlers(self) -> dict:
        """The message kinds rank 0 takes in this mode (besides ERROR) and their handlers."""
        return {Tag.PUSH: self.on_push, Tag.EVAL: self.on_eval}

    def on_push(self, w: int, msg: Message) -> None:
        h = msg.header
        step, base = int(h["step"]), int(h["version"])
        if w in self.stopped:
            raise ProtocolError(f"rank 0: PUSH step {step} from worker rank {w} after it was sent STOP")
        if step != self.last_step[w] + 1:
            raise ProtocolError(f"rank 0: PUSH from worker rank {w} has step {step}, expected "
                                f"{self.last_step[w] + 1} (duplicate or out-of-order push)")
        if not 0 <= base <= self.version:
            raise ProtocolError(f"rank 0: PUSH step {step} from worker rank {w} was computed from version "
                                f"{base}, but the server is at version {self.version}")
        delta = bool(int(h["flags"]) & Flag.DELTA)
        if delta != (self.cfg.nsync > 1):
            raise ProtocolError(f"rank 0: PUSH step {step} from worker rank {w} carries "
                                f"{'an accumulated update' if delta else 'a gradient'}, but nsync is "
                                f"{self.cfg.nsync} (expected {'an update' if self.cfg.nsync > 1 else 'a gradient'})")
        self.last_step[w] = step
        if int(h["flags"]) & Flag.PREEMPT and not self.preempted and not self.late_signal:
            self.preempt(f"a signal received by worker rank {w}")
        staleness = self.version - base
        grad = msg.payload
        finite, square = finite_square(grad)
        rejected = not finite
        applied = not rejected and not self.stop_reason  # after the stop decision pushes are drained
        lr = 0.0
        if applied:
            factor = staleness_factor(self.cfg.staleness_lr, staleness)
            # the new weights are written straight into w's send buffer (its previous send has completed:
            # w pushed after receiving it), which then holds the master weights until the next update
            self.wait_send(w)
            out = self.outbox[w].payload
            if delta:  # already scaled by the worker's own step size: added, scaled by the staleness rule only
                lr = float(h["lr"]) * factor
                self.params = self.optimizer.params = apply_delta(self.params, grad, factor, out=out)
            else:  # the staleness factor scales the gradient entering the momentum, not the velocity's step
                step_size = learning_rate(self.cfg, self.epoch, self.fraction_done())
                self.params = self.optimizer.step(grad, step_size, out=out, grad_scale=factor)
                lr = step_size * factor  # logged: the step this push's gradient enters with
            self.version += 1
            self.samples += int(h["samples"])
            self.cursor[w] = int(h["cursor"])
            self.count_staleness(staleness)
            loss = float(h["loss"])
            self.loss_avg = loss if self.loss_avg != self.loss_avg else 0.95 * self.loss_avg + 0.05 * loss
            self.log.add("updates", (self.now(), self.version, lr, math.sqrt(square), self.samples, self.epoch))
            self.watch_loss(loss, int(h["correct"]), int(h["samples"]))
            self.check_stop()
        self.log.add("pushes", (self.now(), w, step, base, self.version, staleness, h["loss"], h["correct"],
                                h["samples"], h["epoch"], h["compute_s"], h["comm_s"], h["wait_s"], applied, lr,
                                rejected, self.held_s[w], 0))
        if rejected:
            self.cursor[w] = int(h["cursor"])
            self.reject(w, step)  # after its row is logged: may stop the run
        else:
            self.rejects_in_row[w] = 0
        self.held_s[w] = 0.0
        if (self.cfg.mode == "ssp" and not self.stop_reason
                and self.clock(w) - self.slowest_clock() > self.cfg.staleness_bound):
            self.held[w] = (self.clock(w), self.now())  # answered when the slowest worker catches up
        else:
            self.reply(w, step)
        self.release()

    def clock(self, w: int) -> int:
        """ssp: the clock of worker `w`, the pushes it has made (plus the slowest clock when it started late)."""
        return self.last_step[w] + self.clock_offset[w]

    def slowest_clock(self) -> int:
        """ssp: the slowest clock of the workers that are running (started and not stopped)."""
        running = [self.clock(w) for w in self.workers if w in self.started and w not in self.stopped]
        return min(running, default=0)

    def release(self) -> None:
        """ssp: answer every held push that the bound now allows (all of them once the run stops)."""
        if not self.held:
            return
        slowest = self.slowest_clock()
        for w, (clock, since) in list(self.held.items()):
            if self.stop_reason or clock - slowest <= self.cfg.staleness_bound:
                del self.held[w]
                self.held_s[w] = self.now() - since
                self.held_total[w] += self.held_s[w]
                self.reply(w, self.last_step[w])

    def reply(self, w: int, step: int) -> None:
        """Answer push `step` of worker `w`: WEIGHTS, or STOP once a stopping rule fired."""
        if self.stop_reason:
            self.stopped.add(w)
            self.send(w, Tag.STOP, step)
        else:
            self.send(w, Tag.WEIGHTS, step)

    # --- checkpoints and preemption ---
    def preempt(self, why: str) -> None:
        """A signal reached a rank: stop, checkpoint now, and end within PREEMPT_GRACE seconds (the STOPs
        carry the flag PREEMPT: workers skip the final evaluation)."""
        gone = self.exited_workers()
        if gone:  # a launcher sends SIGTERM to the other ranks when one dies: say which
            why += "; " + ", ".join(f"worker rank {w} (pid {pid} on {host}) has exited" for w, host, pid in gone)
        elif self.stop_reason:  # the run is already ending (final evaluation): let it, within the grace
            self.late_signal = why
            self.preempt_deadline = time.perf_counter() + PREEMPT_GRACE
            text = (f"{why} while the run was ending ({self.stop_reason}): it completes if the workers finish "
                    f"within {PREEMPT_GRACE:g} s, else it ends as preempted")
            self.log.add("events", (self.now(), b"signal", text))
            print(f"mpiasgd: {text}", file=sys.stderr, flush=True)
            return
        self.preempted = why
        self.preempt_time = self.now()
        self.preempt_reason = "failure" if gone else "preempt"  # the checkpoint's reason
        self.preempt_deadline = time.perf_counter() + PREEMPT_GRACE
        self.log.add("events", (self.now(), b"preempt", why))
        doing = "ending the run" if gone and not self.checkpoints_here else "checkpointing and ending the run"
        print(f"mpiasgd: {why}: {doing}", file=sys.stderr, flush=True)
        if not self.stop_reason:
            self.stop_reason = f"{'failed' if gone else 'preempted'}: {why}"  # gone: a worker died
            self.stop_time = self.now()
            self.log.add("events", (self.now(), b"stop", self.stop_reason))
        self.on_preempt()
        self.log.flush()
        if gone:  # no use waiting for them: end now, before the launcher's SIGKILL, with the log closed
            raise Preempted(why, [w for w, _, _ in gone], dead=True)

    def on_preempt(self) -> None:
        """What a preemption does besides stopping: here, checkpoint the master weights at once."""
        self.write_checkpoint(self.preempt_reason)

    def end_late(self) -> None:
        """A signal came while the run was ending and the grace has passed: it ends as preempted, from a
        checkpoint of the final state (rank 0 holds it in async and ssp; sync and pipeline sent theirs)."""
        if self.late_signal and not self.preempted:
            self.preempted = self.late_signal
            self.log.add("events", (self.now(), b"preempt", self.late_signal))
            if self.checkpoints_here:
                self.write_checkpoint("preempt")

    def exited_workers(self) -> list[tuple[int, str, int]]:
        """(rank, host, pid) of the workers on this rank's host whose process has exited (or is a zombie)."""
        gone = []
        for w, (host, pid) in self.pids.items():
            if host != self.host or not pid:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    alive = f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
            except OSError:
                alive = False
            if not alive:
                gone.append((w, host, pid))
        return gone

    def state(self, reason: str) -> checkpoint.Checkpoint:
        """The training state now, as a Checkpoint (async and ssp: rank 0 holds all of it)."""
        velocity = self.optimizer.velocity
        return self.make_checkpoint(self.params, np.zeros_like(self.params) if velocity is None else velocity,
                                    reason, {w: (self.last_step[w], self.cursor[w]) for w in self.workers},
                                    self.train_time())

    def make_checkpoint(self, params: np.ndarray, momentum: np.ndarray, reason: str, steps: dict,
                        elapsed: float) -> checkpoint.Checkpoint:
        """A Checkpoint of `params`, `momentum` and `steps` ({worker: (step, cursor)}) with this rank's figures."""
        rows = np.array([(w, steps[w][0], steps[w][1], self.rejected[w]) for w in self.workers],
                        dtype=checkpoint.WORKER_STATE)
        return checkpoint.Checkpoint(
            params=params, momentum=momentum, workers=rows, version=self.version, samples=self.samples,
            elapsed=elapsed, log_time=self.now(), config=self.cfg.to_json(), log=self.log.path,
            mode=self.cfg.mode, model=self.cfg.model, reason=reason, run_id=self.log.run_id,
            staleness_sum=self.staleness_sum,
            staleness_max=self.staleness_max, staleness_count=self.staleness_count)

    def write_checkpoint(self, reason: str, ckpt: checkpoint.Checkpoint | None = None) -> bool:
        """Write `ckpt` (default: `state(reason)`) atomically and log it (the checkpoints table); a failed
        write is a warning, not the end of the run: the previous checkpoint stays. Returns whether it was
        written; `checkpoint_error` keeps the last failure's text ("" after a success)."""
        self.last_checkpoint = self.now()
        ckpt = ckpt or self.state(reason)
        t0 = self.now()
        try:
            seconds = checkpoint.write(self.checkpoint_path, ckpt)
        except OSError as e:
            kept = ("the previous one stays" if os.path.isfile(self.checkpoint_path) else
                    "there is no earlier one")
            text = f"checkpoint '{self.checkpoint_path}' not written ({e}); {kept}"
            self.log.add("events", (self.now(), b"warning", text))
            print(f"mpiasgd: warning: {text}", file=sys.stderr, flush=True)
            self.checkpoint_error = text
            return False
        self.checkpoint_error = ""
        self.last_written = t0
        self.log.add("checkpoints", (t0, seconds, ckpt.version, ckpt.samples, ckpt.elapsed, reason.encode()))
        self.log.flush()  # every row up to the checkpoint is on disk with it: a resume supersedes only later ones
        return True

    def resume_note(self) -> str:
        """What a run that stopped on a signal leaves to resume from, for its final message: the
        checkpoint written when the signal came (async, ssp: rank 0 holds the state), or an earlier one
        kept (sync, pipeline: the state is on the workers, which a dead rank cannot send), or none."""
        path = self.checkpoint_path
        if self.last_written is not None and self.preempt_time is not None and self.last_written >= self.preempt_time:
            return f"checkpoint '{path}' written, continue with --resume"
        if os.path.isfile(path):
            return (f"no checkpoint written now (the state is on the workers); the last one, '{path}', is kept: "
                    f"continue from it with --resume")
        return ("no checkpoint to resume from: the state is on the workers and none was written before "
                "(see --checkpoint-interval)")

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        """Continue from `ckpt` (before `run`): weights, optimizer state, version, counts, each worker's step
        and data position. The caller has checked that it fits this job (`train.check_fits`)."""
        self.params[:] = ckpt.params
        if self.optimizer.velocity is not None:
            self.optimizer.velocity[:] = ckpt.momentum
        self.version, self.samples = ckpt.version, ckpt.samples
        self.staleness_sum, self.staleness_max = ckpt.staleness_sum, ckpt.staleness_max
        self.staleness_count = ckpt.staleness_count
        for row in ckpt.workers:
            w = int(row["rank"])
            self.last_step[w], self.cursor[w], self.rejected[w] = int(row["step"]), int(row["cursor"]), int(
                row["rejected"])
        self.resumed = ckpt

    def check_replicas(self, group: int, step: int, w: int, digest: int, replicas: int) -> None:
        """Replicas (sync: all workers; pipeline: a module's replicas) must report the same weight digest
        for the same step; RuntimeError naming the step and the ranks at the first difference."""
        key = (group, step)
        first, seen = self.digests.get(key, (None, []))
        seen.append(w)
        if first is not None and digest != first[0]:
            raise RuntimeError(f"rank 0: the replicas' weights differ after step {step}: worker rank {w} has "
                               f"CRC-32 {digest:08x}, worker rank {first[1]} has {first[0]:08x}")
        if len(seen) == replicas:
            self.digests.pop(key, None)
        else:
            self.digests[key] = (first or (digest, w), seen)

    def count_staleness(self, staleness: int) -> None:
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_count += 1

    def reject(self, w: int, step: int) -> None:
        """Count a non-finite push of worker `w`; TrainingDiverged after `max_rejects` in a row."""
        self.rejected[w] += 1
        self.rejects_in_row[w] += 1
        if self.rejected[w] == 1:
            text = f"worker rank {w} pushed a non-finite gradient at step {step}: rejected (not applied)"
            self.log.add("events", (self.now(), b"warning", text))
            print(f"mpiasgd: warning: {text}", file=sys.stderr, flush=True)
        if self.rejects_in_row[w] >= self.cfg.max_rejects:
            raise TrainingDiverged(
                f"rank 0: worker rank {w} pushed {self.rejects_in_row[w]} non-finite gradients in a row "
                f"(steps {step - self.rejects_in_row[w] + 1}..{step}; --max-rejects {self.cfg.max_rejects}): "
                f"training has diverged; lower --lr")

    def on_eval(self, w: int, msg: Message) -> None:
        if w not in self.stopped:
            raise ProtocolError(f"rank 0: EVAL from worker rank {w} before it was sent STOP")
        if w in self.evals:
            raise ProtocolError(f"rank 0: second EVAL from worker rank {w}")
        h = msg.header
        self.evals[w] = (float(h["loss"]), int(h["correct"]), int(h["samples"]))

    def send_state(self, w: int, velocity: np.ndarray) -> None:
        """(sync, pipeline, resuming) Post the checkpoint's `velocity` (float32, the worker's share) to
        worker `w` as a CHECKPOINT message; it follows the initial WEIGHTS."""
        state = Message(velocity.size)
        state.payload[:] = velocity
        state.stamp(Tag.CHECKPOINT, self.rank, version=self.version)
        self.state_msgs.append(state)
        self.state_sends.append(self.comm.Isend(state.buf, dest=w, tag=int(Tag.CHECKPOINT)))

    def send_stop(self, w: int) -> None:
        """(sync, pipeline) The one header-only STOP worker `w` gets: after its last REPORT, or at once
        (flag PREEMPT) on a signal; it completes the receive the worker posted at its start."""
        if w in self.stops:
            return
        self.wait_send(w)
        self.stops[w] = Message(0).stamp(Tag.STOP, self.rank, flags=Flag.PREEMPT if self.preempted else 0)
        self.sending[w] = self.comm.Isend(self.stops[w].buf, dest=w, tag=int(Tag.STOP))

    def wait_send(self, w: int) -> None:
        """Complete the previous send to worker `w`, so that its send buffer may be written."""
        wait(self.sending[w], f"completion of the previous send to worker rank {w}", self.rank, self.cfg.comm_timeout)
        self.sending[w] = None

    def send(self, w: int, tag: Tag, step: int, initial: bool = False) -> None:
        """Post the current weights to worker `w` from its send buffer (copied there unless they live there).

        The master weights move between the send buffers: an update writes them into the buffer of
        the worker it answers, so a reply costs no copy. A buffer is written only after its previous
        send completed; the master weights are only read while a send from their buffer is in flight.
        """
        self.wait_send(w)
        out = self.outbox[w]
        if out.payload is not self.params:
            out.payload[:] = self.params
        flags = Flag.PREEMPT if tag == Tag.STOP and self.preempted else 0
        if initial and self.resumed is not None:  # the worker continues its step count and data position
            flags |= Flag.RESUME
        out.stamp(tag, self.rank, step=step, version=self.version, flags=flags, cursor=self.cursor[w],
                  elapsed=self.train_time(), lr=self.local_lr() if self.cfg.nsync > 1 else 0.0)
        self.sending[w] = self.comm.Isend(out.buf, dest=w, tag=int(tag))

    def finish(self) -> dict:
        """Final snapshot, checkpoint and evaluation rows; returns the summary (also stored as log attributes)."""
        if self.health is not None:
            for finding in self.health.finish():
                self.on_health(finding)
        self.snapshot()
        if self.checkpoints_here and not self.preempted:  # a preempted run checkpointed when the signal came
            self.write_checkpoint("end")
        if self.progress is not None:
            self.show_progress()  # the bar's last figures
        loss_sum = sum(e[0] for e in self.evals.values())
        correct = sum(e[1] for e in self.evals.values())
        count = sum(e[2] for e in self.evals.values())
        accuracy = correct / count if count else float("nan")
        test_loss = loss_sum / count if count else float("nan")
        if not self.preempted:  # no evaluation row for a run cut short: the resumed run will add one
            self.log.add("evals", (self.now(), self.version, self.epoch, -1, test_loss, accuracy, count))
        self.log.add("events", (self.now(), b"end", f"preempted ({self.preempted}): no final evaluation"
                                if self.preempted else f"test accuracy {accuracy:.4f} on {count} images"))
        train_time = self.train_time()  # time lost to a resume, or spent on the final evaluation, is not training
        return {
            "wall_time_s": self.now(),
            "train_time_s": train_time,
            "test_accuracy": accuracy,
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
            "preempted": self.preempted,
            "health": self.health.final_state() if self.health is not None else "",
            "diverged": self.diverged,
        }


class SyncMonitor(ParameterServer):
    """(server only, --mode sync) Rank 0 of synchronous data parallelism: logs, never updates.

    The workers allreduce their gradients among themselves and each applies the same step (see
    `mpiasgd.worker`); rank 0 sends the initial weights, turns every worker's REPORT into a row of
    the pushes table (one per worker per step) and an updates row per step, stores the SNAPSHOTs
    the first worker sends, and collects the EVALs. The stopping rule is judged by the workers (on
    a max-allreduced clock); their last REPORT carries the flag LAST. A step skipped by every worker
    (a non-finite gradient somewhere) is logged as an event naming the worker; `--max-rejects` such
    steps in a row from one worker end the run with TrainingDiverged.
    """

    checkpoints_here = False  # the first worker sends its weights and velocity (CHECKPOINT)

    def handlers(self) -> dict:
        return {Tag.REPORT: self.on_report, Tag.SNAPSHOT: self.on_snapshot, Tag.CHECKPOINT: self.on_checkpoint,
                Tag.EVAL: self.on_eval}

    def begin(self) -> None:
        """The initial weights, and on a resume the checkpoint's velocity (CHECKPOINT), to every worker."""
        super().begin()
        if self.resumed is not None:
            for w in self.workers:
                self.send_state(w, self.resumed.momentum)

    def on_preempt(self) -> None:
        """Tell every worker: they end together after the step where the control allreduce hears of it, and
        the first worker sends the CHECKPOINT of that step."""
        self.stop_workers()

    def stop_workers(self) -> None:
        """A STOP to every worker (flag PREEMPT on a signal; without it they end with the final evaluation)."""
        for w in self.workers:
            self.send_stop(w)

    def on_checkpoint(self, w: int, msg: Message) -> None:
        if w != self.workers[0]:
            raise ProtocolError(f"rank 0: CHECKPOINT from worker rank {w}; only rank {self.workers[0]} sends them")
        h, P = msg.header, self.params.size
        flags = int(h["flags"])
        reason = "preempt" if flags & Flag.PREEMPT else "end" if flags & Flag.FINAL else "interval"
        step, cursor = int(h["step"]), int(h["cursor"])  # the same on every worker
        ckpt = self.make_checkpoint(msg.payload[:P], msg.payload[P:], reason, dict.fromkeys(self.workers,
                                                                                            (step, cursor)),
                                    float(h["elapsed"]))
        ckpt.version = int(h["version"])
        ckpt.samples = ckpt.version * self.cfg.batch_size * len(self.workers)
        self.write_checkpoint(reason, ckpt)

    def check_stop(self) -> None:
        pass  # decided by the workers; see on_report

    def on_report(self, w: int, msg: Message) -> None:
        h = msg.header
        step, version, flags = int(h["step"]), int(h["version"]), int(h["flags"])
        if w in self.stopped:
            raise ProtocolError(f"rank 0: REPORT step {step} from worker rank {w} after its last step")
        if step != self.last_step[w] + 1:
            raise ProtocolError(f"rank 0: REPORT from worker rank {w} has step {step}, expected "
                                f"{self.last_step[w] + 1} (duplicate or out-of-order report)")
        self.last_step[w] = step
        applied, nonfinite = not flags & Flag.SKIPPED, bool(flags & Flag.NONFINITE)
        if version > self.version:  # the first report of a step that updated the weights
            self.version = version
            self.samples = version * self.cfg.batch_size * len(self.workers)
            self.log.add("updates", (self.now(), version, float(h["lr"]), float("nan"), self.samples, self.epoch))
        loss = float(h["loss"])
        self.loss_avg = loss if self.loss_avg != self.loss_avg else 0.95 * self.loss_avg + 0.05 * loss
        self.watch_loss(loss, int(h["correct"]), int(h["samples"]))
        self.log.add("pushes", (self.now(), w, step, version - applied, version, 0, loss, h["correct"], h["samples"],
                                h["epoch"], h["compute_s"], h["comm_s"], h["wait_s"], applied, h["lr"], nonfinite, 0.0,
                                h["digest"]))
        self.check_replicas(0, step, w, int(h["digest"]), len(self.workers))
        if nonfinite:
            text = f"step {step} skipped by every worker: worker rank {w} computed a non-finite gradient"
            self.log.add("events", (self.now(), b"skip", text))
            self.reject(w, step)
        else:
            self.rejects_in_row[w] = 0
        if flags & Flag.PREEMPT and not self.preempted and not self.late_signal:  # every worker's last REPORT
            self.preempt(f"a signal reached the workers (the control allreduce of step {step}; the worker it "
                         f"reached printed it)")
        if flags & Flag.LAST:
            self.stopped.add(w)
            self.send_stop(w)
            if not self.stop_reason:
                self.stop_reason = f"the workers' stopping rule at step {step} (epoch {self.epoch:.2f})"
                self.stop_time = self.now()
                self.log.add("events", (self.now(), b"stop", self.stop_reason))

    def on_snapshot(self, w: int, msg: Message) -> None:
        if w != self.workers[0]:
            raise ProtocolError(f"rank 0: SNAPSHOT from worker rank {w}; only rank {self.workers[0]} sends them")
        self.params[:] = msg.payload
        if not int(msg.header["flags"]) & Flag.FINAL:  # the final weights are logged by finish()
            self.snapshot()
