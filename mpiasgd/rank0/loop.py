"""Rank 0's loop: probe -> dispatch -> tick, the stall watch, and the preemption grace.

It knows no mode. A mode's `Role` (`mpiasgd.rank0.role`) says which messages rank 0 takes and
what each does, what it sends first, and when the run is over; the `Recorder` holds the log and
the figures. The loop itself:

    serve    until role.done(): probe any worker's message, check it against the protocol (tag,
             sender, size, header), hand it to the role's handler, then tick; every send the role
             posted is completed before it returns
    tick     between messages: a signal -> preempt; the role's clock duties (warm start, ssp);
             the stall watch; the recorder's snapshot and checkpoint intervals, log flush, progress
    stalls   a worker silent for --comm-timeout (not counting one the role holds, or pauses of
             rank 0's own process) ends the run naming it; --stall-warning warns first
    preempt  a signal (here, or flagged by a worker): say so in one line (`say_preempted`: where the checkpoint
             goes, the flag that resumes it), stop, close the log first (status preempted, lock released, with
             --servers after the other shards' rows up to the signal: the launcher may kill every rank any
             moment now; a checkpoint write under way does it between its steps), checkpoint where rank 0
             holds the state, end within PREEMPT_GRACE seconds (Preempted naming the workers that did not
             answer); the rows after the signal reach the log at the end, no earlier than
             signals.KILL_WINDOW seconds after it

With `--servers S > 1` every parameter-server shard runs this loop with its role (the mode's server on its
slice), and a `link` (`mpiasgd.rank0.shard_hub`) joins them: on rank 0 the ShardHub (the other shards' rows,
their slices for snapshots and checkpoints, the stop decision told to them, their silence watched), on a
shard of rank >= 1 the HubLink (rank 0's messages; its rows sent; a signal reported to rank 0, which alone
decides). The link names which ranks may send which message (`senders`). A shard keeps no log: its
recorder (`mpiasgd.rank0.shard_recorder`) writes nothing, and it ends when rank 0 says END.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import signals
from mpiasgd.comms import (
    PAUSE_GAP,
    CommTimeout,
    Interval,
    Message,
    ProtocolError,
    Tag,
    probe,
    protocol,
    wait_all,
)
from mpiasgd.comms.ulfm import RankFailed, failed_ranks, is_failure
from mpiasgd.comms.ulfm import enabled as ulfm_enabled
from mpiasgd.comms.waits import pauser
from mpiasgd.config import Config
from mpiasgd.rank0.recorder import Recorder
from mpiasgd.rank0.respawn import JOIN_TAG, JOINED_RANK
from mpiasgd.runlog import RunLogError

PREEMPT_GRACE = 5.0  # seconds the workers have to answer after a preemption signal


class WorkerFailed(RuntimeError):
    """A worker (or, `--servers`, a parameter-server shard: `who` = "parameter-server shard") reported an
    exception (ERROR message); `rank`, `who` and `text` (its traceback) are kept."""

    def __init__(self, rank: int, text: str, who: str = "worker") -> None:
        super().__init__(f"{who} rank {rank} failed:\n{text}")
        self.rank = rank
        self.text = text
        self.who = who


def kept_note(path: str) -> str:
    """What is left to resume from when no checkpoint is written now: the last one at `path`, or none."""
    return (f"the last one, '{path}', is kept: continue from it with --resume" if os.path.isfile(path)
            else "there is no earlier one to resume from (see --checkpoint-interval)")


class Preempted(RuntimeError):
    """The run was preempted and `waiting` workers did not answer within PREEMPT_GRACE seconds (hung),
    or (`dead`) their processes had exited when the signal came: the launcher is ending the job
    because a rank died. The checkpoint is written; the job must be aborted."""

    def __init__(self, why: str, waiting: list[int], dead: bool = False, evaluating: bool = False) -> None:
        super().__init__(f"{why}; workers {waiting} " + ("have exited" if dead else
                                                         f"did not answer within {PREEMPT_GRACE:g} s"))
        self.why = why
        self.waiting = waiting
        self.dead = dead
        self.evaluating = evaluating  # the signal came during the final evaluation, which `waiting` had not ended


class Rank0:
    """Rank 0 of a run: serves the workers 1..len(workers) over `comm` with `role` (built by
    `make_role(rank0)`, a mode's rank-0 part) and records into `rec` (a Recorder).

    `cfg` gives comm_timeout and stall_warning (seconds). `pids` ({rank: (host, pid)} of the workers and the
    other shards) names dead ones on this host when a signal comes. `make_link(rank0)` (--servers S > 1) makes
    the link to the other shards (module docstring); None: one server. `server_wait` is how this rank waits for
    its next message, "spin" or "backoff" (--server-wait resolved for its node: `mpiasgd.comms.waits.server_wait`);
    `notes` [(kind, text)]: start-up lines logged as events when the clocks start ("server_wait": what said so;
    "fault_tolerance": what a rank's death does under ULFM).
    """

    def __init__(self, comm: Any, cfg: Config, rec: Recorder, make_role: Any, pids: dict | None = None,
                 make_link: Any = None, server_wait: str = "backoff", notes: list | None = None) -> None:
        self.comm, self.cfg, self.rec = comm, cfg, rec
        self.server_wait, self.notes = server_wait, notes or []
        self.rank = comm.Get_rank() if comm is not None else 0  # 0, or a parameter-server shard's (--servers)
        self.workers = rec.workers
        self.pids: dict[int, tuple[str, int]] = pids or {}
        self.host = socket.gethostname()
        self.last_seen = dict.fromkeys(self.workers, 0.0)  # log-clock time of each worker's last message
        self.warned: set[int] = set()         # workers warned about (--stall-warning) in their current silence
        self.last_tick: float | None = None   # when the loop last ticked (a gap: rank 0 itself was paused)
        self.stall_check = Interval(0.5)
        self.preempted = ""                   # why the run ends on a signal ("" otherwise)
        self.preempt_reason = "preempt"       # the checkpoint's reason ("failure": a worker died)
        self.late_signal = ""                 # a signal that came while the run was already ending
        self.signal_logged = ""               # the "preempt" event logged in a checkpoint write (`close_log_on_signal`)
        self.said_preempted = False           # the preemption's line was printed (`say_preempted`)
        self.preempt_time: float | None = None
        self.preempt_deadline = 0.0
        self.lost_state: list[int] = []       # --servers: shards that died (their slices could not be saved)
        self.checkpoint_due = ""              # a signal's checkpoint (its reason), written once the role settled
        self.deaths: list[int] = []           # (ULFM) ranks found dead inside a wait for a shard: `lose` at the tick
        self.header_only = Message(0)         # EVAL, REPORT: received and handled one at a time
        self.respawner: Any = None            # (--respawn, --attach) starts replacements of lost workers (`serve`)
        self.attacher: Any = None             # (--attach) listens for `mpiasgd attach` (`serve` sets it)
        self.dropped: list[tuple[int, str, int]] = []  # (worker rank, host, pid) of each process dropped as dead
        self.role = make_role(self)
        self.link = make_link(self) if make_link is not None else None
        rec.stop_workers = self.role.stop_workers
        rec.meanwhile = self.close_log_on_signal

    # --- the loop ---
    @property
    def decides(self) -> bool:
        """This rank decides the run (rank 0: it stops it, preempts it, snapshots and checkpoints it); False
        on a parameter-server shard of rank >= 1."""
        return self.link is None or self.link.decides

    def run(self) -> dict:
        """Serve until the role is done; returns the summary dict. A signal closes the run log the moment it
        arrives (`close_log_on_signal`, from the signal thread), wherever the loop is."""
        with signals.watching(lambda name: self.close_log_on_signal()):
            self.role.warm_up()  # before the clocks: the run's time is the training's
            self.rec.begin()
            if self.decides:  # (on the log's clock, after a resume's rows)
                for kind, text in self.notes:
                    self.rec.event(kind, text)
            if self.decides:
                self.rec.snapshot(*self.weights())
            self.role.begin()
            self.serve()
            return self.finish()

    def done(self) -> bool:
        """The loop's end: the role's (every worker's EVAL); a shard of rank >= 1: rank 0's END."""
        return self.role.done() if self.link is None else self.link.done()

    def weights(self) -> tuple:
        """(params (P,), buffers (B,)) float32 of a snapshot: the role's, or (--servers) every shard's slice."""
        if self.link is None:
            return self.role.params, self.role.current_buffers()
        return self.link.weights()

    def serve(self) -> None:
        """Handle messages until `done()`, then complete every send."""
        backoff = pauser(self.server_wait)  # spin: this rank owns a core and answers a message the moment it comes
        while not self.done():
            self.check_grace()
            try:
                timeout = PREEMPT_GRACE if self.preempted or self.late_signal else self.cfg.comm_timeout
                if not self.decides:  # a shard waits as a worker does; rank 0 sends ALIVE meanwhile
                    timeout = self.cfg.worker_timeout
                message, status = probe(self.comm, self.rank, timeout, "message from any worker" if self.decides
                                        else "message from rank 0 or any worker", backoff, idle=self.tick)
            except RankFailed as dead:  # ULFM: a rank died and the job lives on
                self.lose(dead.ranks)
                continue
            except CommTimeout as e:
                if not self.decides:
                    raise CommTimeout(f"{e} (parameter-server shard rank {self.rank}: rank 0 sends one at least "
                                      f"every {self.cfg.comm_timeout / 4:g} s; it is hung or gone)") from None
                if self.preempted or self.late_signal:
                    self.end_late()
                    raise Preempted(self.preempted, self.role.waiting_for()) from None
                try:
                    self.check_stalls()  # names the silent workers, held ones (ssp) aside
                except CommTimeout as stall:
                    raise stall from None  # its own traceback, not the probe's timeout above it again
                waiting = self.role.waiting_for()
                silent = ", ".join(f"rank {w} ({self.rec.now() - self.last_seen[w]:.0f} s)" for w in waiting)
                raise CommTimeout(f"{e}; still waiting for workers {waiting}; time since each last sent: "
                                  f"{silent} (hung or very slow; see --comm-timeout)") from None
            try:
                self.handle(message, status)
            except MPI.Exception as e:  # ULFM: the message's sender died while it was received
                if not is_failure(e):
                    raise
                self.lose(failed_ranks(self.comm))
                continue
            self.last_seen[status.Get_source()] = self.rec.now()
            self.tick()
        pending = self.role.pending_sends() + (self.link.pending_sends() if self.link is not None else [])
        wait_all(pending, "completion of the final sends", self.rank, self.cfg.comm_timeout)

    def lose(self, ranks: list[int], how: str = "ULFM reported it") -> None:
        """(ULFM: `mpiasgd.comms.ulfm`; `mpiasgd simulate --fail`) `ranks` have died (every failed rank of the job
        so far; `how` it was found out): a worker not yet
        dropped is dropped (`Role.lose_worker`: its pending sends, the evaluations it owed), logged (event
        "worker_lost": rank, host, last step, the workers left) and said, and the run goes on; fewer than
        --min-workers left, a dead parameter-server shard, or a role that cannot go on without it end the run as
        a launcher's kill would (`preempt`: a checkpoint where rank 0 holds the state, status "failed")."""
        # (a worker that sent its final EVAL has finished: under ULFM its exit may be reported before rank 0's)
        new = [r for r in ranks if r not in self.role.lost and not self.finished(r) and r != self.rank]
        if not new:
            return
        why = self.role.survives()
        shards = [r for r in new if r not in self.workers]
        if not self.decides and not shards and not why:  # a shard of rank >= 1: drops them; rank 0 logs and decides
            for w in new:
                self.role.lose_worker(w)
            return
        alive = len(self.workers) - len(self.role.lost) - len([r for r in new if r in self.workers])
        # (--respawn) a dead worker whose replacement rank 0 starts now counts as one coming back (`short_of_workers`
        # ends the run if it does not start)
        coming = [r for r in new if self.respawner is not None and self.respawner.will_replace(r)]
        if shards or why or not self.decides or alive + len(coming) < self.cfg.min_workers:
            gone = [(r, *self.pids.get(r, ("?", 0))) for r in new]
            cause = ("a parameter-server shard died" if shards else why if why else
                     f"{alive} worker{'s' * (alive != 1)} left, fewer than --min-workers {self.cfg.min_workers}")
            if self.preempted:  # (already ending: the grace decides)
                return
            self.preempt(f"ULFM reported {', '.join(self.name_of(r) for r in new)} dead ({cause})", gone=gone)
            return
        for w in new:
            host = self.pids[w][0] if w in self.pids else ""
            self.dropped.append((w, *self.pids.get(w, ("", 0))))
            step = self.role.last_step[w]
            self.role.lose_worker(w)
            left = len(self.workers) - len(self.role.lost)
            text = (f"worker rank {w}{' on ' + host if host else ''} died after step {step} ({how}): dropped, "
                    f"{left} worker{'s go' if left != 1 else ' goes'} on")
            self.rec.event("worker_lost", text)
            print(f"mpiasgd: {text}", file=sys.stderr, flush=True)
            if self.respawner is not None and self.cfg.respawn:
                self.respawner.spawn(w)

    def short_of_workers(self, w: int, why: str) -> None:
        """(--respawn, `Respawner.failed`) The replacement for worker rank `w` did not start (`why`): with fewer than
        --min-workers workers alive or starting, the run ends as at a death below it (status failed)."""
        alive = len(self.workers) - len(self.role.lost) + len(self.respawner.pending)
        if alive >= self.cfg.min_workers or self.preempted or not self.decides or self.rec.stop_reason:
            return
        host, pid = self.pids.get(w, ("?", 0))
        self.preempt(f"{why}; {alive} worker{'s' * (alive != 1)} left, fewer than --min-workers "
                     f"{self.cfg.min_workers}", gone=[(w, host, pid)])

    def admit(self, w: int, comm: Any, info: Any, seconds: float, origin: str = "") -> None:
        """(--respawn, --attach: `Respawner.tick`) The replacement for worker rank `w`, started up on `comm` (its
        WorkerInfo `info`, `seconds` after the death was seen, or after `mpiasgd attach` asked: `origin`), takes the
        rank: rank 0 reaches it there (`RoutedComm.join`),
        tells it the workers dead now, logs it (event "worker_joined"), and sends it the current weights (flag
        RESUME: the dead worker's step count and data position); the other workers are told it is back."""
        role = self.role
        self.comm.join(w, comm)
        self.pids[w] = (info.host, info.pid)
        role.rejoin_worker(w)
        comm.send({"lost": list(role.lost_order), "notices": len(role.notice_order)}, dest=JOINED_RANK,
                  tag=JOIN_TAG)
        role.told[w] = len(role.notice_order)
        alive = len(self.workers) - len(role.lost)
        after = f"{origin} asked" if origin else "the death was seen"
        text = (f"worker rank {w} is back: a replacement on {info.host} (pid {info.pid}) started {seconds:.1f} s after "
                f"{after}; it continues from step {role.last_step[w]}, {alive} worker"
                f"{'s train' if alive != 1 else ' trains'}")
        self.rec.event("worker_joined", text)
        self.rec.log.replace_worker(info.row())  # the /workers row of rank w: the replacement's host, pid, device
        print(f"mpiasgd: {text}", file=sys.stderr, flush=True)
        self.last_seen[w] = self.rec.now()
        self.warned.discard(w)
        role.join_worker(w)

    @property
    def elastic(self) -> bool:
        """Under ULFM a worker that dies is dropped and the run goes on (`lose`): its role survives one."""
        return ulfm_enabled() and not self.role.survives()

    def finished(self, w: int) -> bool:
        """(`lose`) Worker `w` has ended its part: its final EVAL came, or is here to be received (ULFM may report
        the exit of a worker that ended before rank 0 took its EVAL: taken now)."""
        if w in self.role.evals or (not self.decides and w in self.role.stopped):  # (a shard: its STOP was its part)
            return True
        if w not in self.role.stopped or w not in self.workers:
            return False
        try:
            status = MPI.Status()
            message = self.comm.Improbe(source=w, tag=int(Tag.EVAL), status=status)
            if message is None:
                return False
            self.handle(message, status)
        except MPI.Exception:
            return False
        return w in self.role.evals

    def handle(self, message: Any, status: Any) -> None:
        """Receive one probed message and hand it to the role (or the link); ProtocolError on anything outside
        the protocol. A pause of rank 0 that ended just now is taken first (`skip_pause`): the message waited
        through it, and its push must not find the training clock past --max-time for it."""
        self.skip_pause()
        source = status.Get_source()
        tag = protocol.parse_tag(status.Get_tag(), source, self.rank)
        nbytes = status.Get_count(MPI.BYTE)
        if source in self.role.lost:  # (ULFM) sent before it died, or by a hung worker that woke up: not merged
            message.Recv(np.empty(max(nbytes, 1), np.uint8))
            self.rec.event("late_message", f"a {tag.name} message from worker rank {source} after it was dropped: "
                                           "discarded")
            return
        if self.link is None:  # one server: every message comes from a worker
            if source not in self.workers:
                raise ProtocolError(f"rank 0: {tag.name} message from rank {source}, which is not a worker "
                                    f"(workers are ranks 1..{len(self.workers)})")
        else:  # --servers: the link names who may send what (workers, rank 0, the other shards)
            senders = self.link.senders(tag)
            if source not in senders:
                raise ProtocolError(f"rank {self.rank}: {tag.name} message from rank {source}, which may not send it "
                                    f"here (from ranks {', '.join(map(str, senders)) or 'none'}; workers are "
                                    f"ranks 1..{len(self.workers)})")
            if tag in self.link.tags:
                self.link.receive(tag, source, message, nbytes)
                return
        if tag == Tag.ERROR:
            msg = Message(max(0, nbytes - protocol.HEADER_BYTES) // 4)
            message.Recv(msg.buf[:nbytes])
            raise WorkerFailed(source, protocol.error_text(msg),
                               "worker" if source in self.workers else "parameter-server shard")
        if tag == Tag.ALIVE:  # a worker busy evaluating: only its silence clock restarts (in `serve`)
            protocol.check_size(tag, source, self.rank, nbytes, 0)
            message.Recv(self.header_only.buf)
            protocol.check(self.header_only, tag, source, self.rank)
            return
        handlers = self.role.handlers()
        if tag not in handlers:
            raise ProtocolError(f"rank 0: unexpected {tag.name} message from rank {source} (in mode "
                                f"'{self.cfg.mode}' rank 0 receives {', '.join(t.name for t in handlers)} and ERROR)")
        msg = self.role.buffer_for(tag, source) or self.header_only
        protocol.check_size(tag, source, self.rank, nbytes, msg.count, msg.wire,
                            self.role.whose(tag) if msg is not self.header_only else "")
        message.Recv(msg.buf)
        protocol.check(msg, tag, source, self.rank)
        handlers[tag](source, msg)

    def tick(self) -> None:
        """Clock-driven duties between messages: signals, the role's, stalls, snapshots, checkpoints,
        log flush, progress bar."""
        rec, role = self.rec, self.role
        self.skip_pause()
        if self.deaths:  # (found while rank 0 assembled the shards' slices: dropped now, outside that wait)
            deaths, self.deaths = self.deaths, []
            self.lose(deaths)
        if self.respawner is not None and self.respawner.pending:
            self.respawner.tick()
        if self.attacher is not None:
            self.attacher.tick()
        if signals.received() and not self.preempted and not self.late_signal:
            if self.decides:
                self.preempt(f"{signals.received()} received by rank 0")
            else:  # a shard: rank 0 decides (once)
                self.link.signalled(signals.received())
        self.check_grace()  # also while the probe for the next message waits
        role.tick()
        if self.link is not None:
            self.link.tick()
        if self.decides and self.stall_check.due(rec.now()):
            self.check_stalls()
        self.duties()

    def duties(self) -> None:
        """The recorder's interval duties: snapshots and checkpoints where rank 0 holds the state, the log's
        flush, the progress bar."""
        rec, role = self.rec, self.role
        pausing = self.link is not None and self.link.decides and self.link.pausing  # --servers: `ShardHub.pause`
        if pausing and self.link.paused():  # the interval checkpoint, one consistent cut of every shard
            rec.write_checkpoint(role.state("interval"))
            self.link.resume()
            pausing = False
        self.write_due_checkpoint()
        if role.snapshots_here and not rec.stop_reason and not pausing and rec.snapshots.due(rec.now()):
            rec.snapshot(*self.weights())
        if role.checkpoints_here and not rec.stop_reason and rec.checkpoints.due(rec.now()):
            if self.link is None:
                rec.write_checkpoint(role.state("interval"))
            elif self.link.decides:  # --servers S > 1: once the shards agreed on the pushes each applies
                self.link.pause()
        rec.maybe_flush()  # and the TensorBoard point of the training figures (--tensorboard)
        rec.show_progress()

    def finish(self) -> dict:
        """Final snapshot, checkpoint and evaluation rows; returns the summary (also stored as log attributes).
        A shard of rank >= 1 sends its last rows instead (and returns {})."""
        if not self.decides:
            self.link.finish()
            return {}
        self.write_due_checkpoint()  # (written by the tick that settled the role, before any worker's STOP)
        evals = self.role.final_evals(self.preempted)
        self.rec.finish_watch()
        self.rec.snapshot(*self.weights())
        if self.role.checkpoints_here and not self.preempted:  # a preempted run checkpointed when the signal came
            self.rec.write_checkpoint(self.role.state("end"))
        if self.link is not None:  # the shards' last rows: their figures are complete for the summary
            self.link.finish()
        self.rec.show_progress(force=True)  # the bar's last figures
        return self.rec.summary(evals, self.preempted)

    # --- the stall watch ---
    def skip_pause(self) -> None:
        """Rank 0's own loop did not run for more than PAUSE_GAP seconds since its last tick (its process was
        stopped, SIGSTOP then SIGCONT, or starved, or busy writing): the workers' messages waited in the
        queue meanwhile, so that gap is not their silence. It is taken off every worker's silence
        (--stall-warning, --comm-timeout) and, while the run trains, off its training time (`Recorder.lost`:
        --max-time, the schedule, images/s), and logged as one event "pause" instead of stall warnings; a
        hung worker is still named once it has been silent that long while rank 0 ran."""
        now = self.rec.now()
        gap = 0.0 if self.last_tick is None else now - self.last_tick
        self.last_tick = now
        if gap <= PAUSE_GAP:
            return
        for w in self.last_seen:  # the workers (and, --servers, the other shards)
            self.last_seen[w] = min(now, self.last_seen[w] + gap)
        training = not self.rec.stop_reason
        if training:  # nothing was trained meanwhile: --max-time and the schedule count training time only
            self.rec.lost += gap
        who = "rank 0" if self.decides else f"parameter-server shard rank {self.rank}"
        text = (f"{who} was paused for {gap:.1f} s (its loop did not run: the process was stopped, starved or "
                f"busy); not counted as the workers' silence" + (" nor as training time" if training else ""))
        self.rec.event("pause", text, at=now)
        print(f"mpiasgd: note: {text}", file=sys.stderr, flush=True)

    def excuse(self, seconds: float) -> None:
        """Rank 0 was busy with work of its own for `seconds` (the pipeline's evaluation during training): the
        workers' messages waited meanwhile, so that time is not their silence, nor a pause of rank 0."""
        for w in self.last_seen:
            self.last_seen[w] = min(self.rec.now(), self.last_seen[w] + seconds)
        self.last_tick = self.rec.now()

    def check_stalls(self) -> None:
        """CommTimeout naming the workers silent for more than --comm-timeout, longest first.

        Only workers the role still waits for count, and not those waiting for rank 0 itself (held by
        ssp, or not yet started by a warm start). So a hung worker is named even while the others keep
        training. A pause of rank 0 itself is not counted (`skip_pause`).
        """
        self.skip_pause()
        limit, now = self.cfg.comm_timeout, self.rec.now()
        if self.link is not None:  # first: workers waiting for a hung shard's reply fall silent with it
            self.link.check_silence(now, limit)  # (the other shards send their rows at least every limit / 4)
        silent = sorted(((now - self.last_seen[w], w) for w in self.role.waiting_for()
                         if not self.role.waits_for_rank0(w)), reverse=True)
        warn = self.cfg.stall_warning
        for quiet, w in silent:  # --stall-warning: one warning per silence, before the abort
            if warn and warn < limit and quiet > warn and w not in self.warned:
                self.warned.add(w)
                self.rec.warn(f"worker rank {w} has sent nothing for {quiet:.1f} s (--stall-warning {warn:g} s); "
                              f"the run ends if it stays silent for {limit:g} s (--comm-timeout)")
        self.warned -= {w for quiet, w in silent if quiet <= (warn or 0)}  # it spoke again: warn anew next time
        if silent and silent[0][0] > limit:
            names = ", ".join(f"rank {w} ({s:.1f} s)" for s, w in silent if s > limit)
            raise CommTimeout(f"rank 0: worker rank {silent[0][1]} has sent nothing for {silent[0][0]:.1f} s "
                              f"(--comm-timeout {limit:g} s): hung or very slow; silent longer than that: {names}")

    # --- preemption ---
    def preempt(self, why: str, gone: list[tuple[int, str, int]] | None = None) -> None:
        """A signal reached a rank: stop, checkpoint now, and end within PREEMPT_GRACE seconds (the STOPs
        carry the flag PREEMPT: workers skip the final evaluation). `gone` ((rank, host, pid)): ranks known dead
        (ULFM), else those of this host whose process has exited (a launcher's SIGTERM after a rank died)."""
        rec = self.rec
        gone = self.exited_workers() if gone is None else gone
        if gone:  # a launcher sends SIGTERM to the other ranks when one dies: say which
            why += self.exited_text(gone)
        elif rec.stop_reason:  # the run is already ending (final evaluation): let it, within the grace
            self.late_signal = why
            self.preempt_deadline = time.perf_counter() + PREEMPT_GRACE
            text = (f"{why} while the run was ending ({rec.stop_reason}): it completes if the workers finish "
                    f"within {PREEMPT_GRACE:g} s, else it ends as preempted")
            rec.event("signal", text)
            self.end_log_early(False)  # (killed before it completes, it is a run to resume)
            print(f"mpiasgd: {text}", file=sys.stderr, flush=True)
            return
        self.preempted = why
        self.preempt_time = rec.now()
        self.preempt_reason = "failure" if gone else "preempt"
        self.preempt_deadline = time.perf_counter() + PREEMPT_GRACE
        if signals.received() and not gone and self.link is not None:  # --servers: the shards' rows to the signal
            self.link.signal_rows()
        with rec.log.guard:  # (the signal thread may be closing the log: one "preempt" event)
            if why != self.signal_logged:
                rec.event("preempt", why)
            self.lost_state = [w for w, _, _ in gone if w not in self.workers]  # --servers: a dead shard's slice
            checkpoints = self.role.checkpoints_here and not self.lost_state  # (a lost slice: the last one is kept)
            rec.stop(f"{'failed' if gone else 'preempted'}: {why}")  # gone: a worker died
            # first of all, the log closed with its status: the launcher may kill every rank any moment now (Open
            # MPI's mpiexec SIGKILLs them 0.25 s after the SIGTERM it sends on its own SIGTERM, or when a rank died)
            self.end_log_early(bool(gone))
        if not gone:
            self.say_preempted(why)
        elif checkpoints and self.link is None:
            print(f"mpiasgd: {why}: checkpointing and ending the run", file=sys.stderr, flush=True)
        else:  # a lost slice, or (--servers) a dead worker's last push: the shards cannot agree on one cut
            print(f"mpiasgd: {why}: ending the run without a checkpoint (the final line says what is left to resume "
                  f"from)", file=sys.stderr, flush=True)
        if checkpoints:  # now, or (--servers) once the shards agreed on the pushes each applies
            self.checkpoint_due = self.preempt_reason
            self.write_due_checkpoint()
        self.role.on_preempt()
        rec.log.flush()
        if gone:  # no use waiting for them: end now, before the launcher's SIGKILL, with the log closed
            raise Preempted(why, [w for w, _, _ in gone], dead=True)

    def close_log_on_signal(self) -> None:
        """(the signal thread, the moment a signal arrives, `signals.watching`; and between the steps of a
        checkpoint write, `Recorder.meanwhile`) Close the run log at once, with the event "preempt", as `preempt`
        does first (`RunLog.end_early`), wherever the main thread is (a long NumPy update, an MPI wait, an fsync:
        Open MPI's mpiexec kills every rank 0.25 s after the SIGTERM it passes on); the next tick preempts the
        run (the checkpoint, the workers' STOP)."""
        log = self.rec.log
        if not signals.received() or not self.decides or log.ended or self.preempted:
            return
        if self.link is not None and not self.rec.stop_reason:  # --servers: first the shards' rows up to the signal
            self.link.signal_rows()  # (`ShardHub.signal_rows`; the main thread's `preempt` may close the log meanwhile)
        with log.ending_now():  # (a snapshot write under way stops at its next chunk)
            if log.ended or self.preempted:  # (the main thread got there first)
                return
            gone = self.exited_workers()  # (a launcher's SIGTERM after a rank died: the event names it, as `preempt`)
            if not self.rec.stop_reason:  # (a run already ending, the final checkpoint's write: it may yet complete)
                self.signal_logged = f"{signals.received()} received by rank 0" + (self.exited_text(gone) if gone
                                                                                   else "")
                self.rec.event("preempt", self.signal_logged)
            try:
                self.end_log_early(bool(gone))
            except RunLogError:  # a full disk: not the checkpoint's failure; the log's close reports it
                pass  # (`log_unwritable`)
            if not gone and not self.rec.stop_reason:  # at once: under mpiexec sent SIGTERM, the SIGKILL is 0.25 s away
                self.say_preempted(self.signal_logged)

    def say_preempted(self, why: str) -> None:
        """(once; the signal thread or the main thread) The preemption's line, printed the moment it is known, on the
        launcher's own stderr where it can be (`signals.say`: Open MPI's mpiexec sent SIGTERM forwards no rank's
        output after it): that the run was preempted, where its checkpoint goes and the flag that resumes it."""
        if self.said_preempted:
            return
        self.said_preempted = True
        path = self.rec.checkpoint_path
        signals.say(f"mpiasgd: run preempted ({why}): writing its checkpoint '{path}' (killed before that ends, the "
                    f"previous one there is kept); continue with --resume {path}")

    def exited_text(self, gone: list[tuple[int, str, int]]) -> str:
        """"; worker rank R (pid P on HOST) has exited, ..." for the ranks of `gone` (`exited_workers`)."""
        return "; " + ", ".join(f"{self.name_of(w)} (pid {pid} on {host}) has exited" for w, host, pid in gone)

    def end_log_early(self, failed: bool) -> None:
        """Close the run log now (`RunLog.end_early`) with status "failed" (a rank died: the event naming it is
        written as soon as it can be, as the launcher's kill may come any moment) or "preempted" (the rows logged
        after the signal wait signals.KILL_WINDOW seconds: a launcher tearing the job down kills rank 0 while no
        file is open)."""
        self.rec.log.end_early("failed" if failed else "preempted", 0.0 if failed else signals.KILL_WINDOW)

    def write_due_checkpoint(self) -> None:
        """The signal's checkpoint, once the role's state is final (`Role.settled`; with --servers S > 1 the
        shards first agree on the pushes each applies, `mpiasgd.rank0.shard_hub`)."""
        if self.checkpoint_due and self.role.settled():
            reason, self.checkpoint_due = self.checkpoint_due, ""
            self.rec.write_checkpoint(self.role.state(reason))

    def shard_died(self, gone: list[tuple[int, str, int]]) -> Preempted:
        """(--servers) A parameter-server shard in `gone` ((rank, host, pid): its process exited) was found dead
        while rank 0 waited for it: the run ends as when a worker dies (`preempt`), without a checkpoint (that
        shard's slice is lost); returns the Preempted to raise."""
        if not self.preempted:
            try:
                self.preempt(f"{signals.received()} received by rank 0" if signals.received() else
                             "rank 0 waited for a parameter-server shard")
            except Preempted as dead:
                return dead
        self.lost_state = [w for w, _, _ in gone]
        why = f"{self.preempted}; " + ", ".join(f"{self.name_of(w)} (pid {pid} on {host}) has exited"
                                                  for w, host, pid in gone)
        return Preempted(why, self.lost_state, dead=True)

    def worker_died(self, gone: list[tuple[int, str, int]]) -> Preempted:
        """(--servers) A worker in `gone` ((rank, host, pid): its process exited) was found dead while rank 0 waited
        for a parameter-server shard (a snapshot's or checkpoint's slice; in a pause the shards may wait for that
        worker's last push for ever): the run ends as a failure now, without a checkpoint (`resume_note` says
        why); returns the Preempted to raise."""
        names = ", ".join(f"{self.name_of(w)} (pid {pid} on {host}) has exited" for w, host, pid in gone)
        if not self.preempted:
            self.preempted = f"rank 0 waited for a parameter-server shard; {names}"
            self.preempt_time, self.preempt_reason = self.rec.now(), "failure"
            self.checkpoint_due = "failure"  # not written: the shards have not agreed (`resume_note`)
            self.rec.event("preempt", self.preempted)
            self.rec.stop(f"failed: {self.preempted}")
            self.end_log_early(True)  # (the launcher is ending the job: `preempt`)
        return Preempted(self.preempted, [w for w, _, _ in gone], dead=True)

    def check_grace(self) -> None:
        """Preempted once PREEMPT_GRACE seconds have passed since a signal and the workers have not all
        answered (naming them); a signal that came while the run was ending first checkpoints (`end_late`)."""
        if (self.preempted or self.late_signal) and time.perf_counter() > self.preempt_deadline:
            evaluating = bool(self.late_signal) and not self.preempted
            self.end_late()
            raise Preempted(self.preempted, self.role.waiting_for(), evaluating=evaluating)

    def signal_from(self, why: str) -> None:
        """A worker's message flagged a signal (PREEMPT): preempt, unless the run already is (or this is a shard
        of rank >= 1: the worker's push to rank 0 carries the same flag)."""
        if not self.preempted and not self.late_signal and self.decides:
            self.preempt(why)

    @property
    def stops_on_signal(self) -> bool:
        """The run ends on a signal: rank 0 preempted it (on a shard of rank >= 1: rank 0's SHARD_STOP said so)."""
        return bool(self.preempted) or (self.link is not None and self.link.preempted)

    def end_late(self) -> None:
        """A signal came while the run was ending and the grace has passed: it ends as preempted, from a
        checkpoint of the final state (rank 0 holds it in the parameter-server modes; the others sent theirs)."""
        if self.late_signal and not self.preempted:
            self.preempted = self.late_signal
            self.preempt_time = self.rec.now()  # (the checkpoint below is this preemption's: `resume_note`)
            self.rec.event("preempt", self.late_signal)
            if self.role.checkpoints_here:
                self.rec.write_checkpoint(self.role.state("preempt"))

    def name_of(self, rank: int) -> str:
        """"worker rank R", or (--servers) "parameter-server shard rank R"."""
        return f"worker rank {rank}" if rank in self.workers else f"parameter-server shard rank {rank}"

    def exited_workers(self) -> list[tuple[int, str, int]]:
        """(rank, host, pid) of the workers (and the other parameter-server shards) on this rank's host whose
        process has exited (or is a zombie); not those dropped already under ULFM (the run went on without them)."""
        gone = []
        for w, (host, pid) in self.pids.items():
            if host != self.host or not pid or w in self.role.lost:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    alive = f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
            except OSError:
                alive = False
            if not alive:
                gone.append((w, host, pid))
        return gone

    def resume_note(self) -> str:
        """What a run that stopped on a signal leaves to resume from, for its final message: the
        checkpoint written when the signal came (rank 0 holds the state), or an earlier one kept (the
        state is on the workers, which a dead rank cannot send), or none."""
        path, rec = self.rec.checkpoint_path, self.rec
        if rec.last_written is not None and self.preempt_time is not None and rec.last_written >= self.preempt_time:
            return f"checkpoint '{path}' written, continue with --resume"
        if self.lost_state:
            lost = ", ".join(map(str, self.lost_state))
            return (f"no checkpoint written now (the slice of parameter-server shard rank {lost} is lost); "
                    f"{kept_note(path)}")
        if self.checkpoint_due:  # --servers S > 1: the shards had not agreed on the pushes in flight
            return ("no checkpoint written now (with --servers the shards' slices are a consistent state only once "
                    "they have applied every worker's last push, and a worker died first); " + kept_note(path))
        if os.path.isfile(path):
            return (f"no checkpoint written now (the state is on the workers); the last one, '{path}', is kept: "
                    f"continue from it with --resume")
        return ("no checkpoint to resume from: the state is on the workers and none was written before "
                "(see --checkpoint-interval)")
