"""Rank 0 and the other parameter-server shards (`--servers S > 1`): the ShardHub on rank 0, a HubLink on each
shard of rank >= 1 (the messages: `mpiasgd.comms.protocol`; the cut: `mpiasgd.comms.shard_cut`).

Every shard runs rank 0's loop (`mpiasgd.rank0.loop.Rank0`) with its mode's server on its slice; the loop
hands the messages between the shards to its link and asks it what only rank 0 may do:

    rank 0 (ShardHub)                          a shard of rank >= 1 (HubLink)
    decides: the stop rule, signals,           decides nothing: a signal it gets goes to rank 0 (its
      divergence; tells the shards (SHARD_STOP)  next SHARD_ROWS, flag PREEMPT); it stops on SHARD_STOP
    logs every shard's push rows               sends its rows every --flush-interval (and at least every
      (/shard_pushes), their versions            --comm-timeout / 4: rank 0 watches its silence)
    sums every shard's bytes moved (the        reports the bytes of its exchange with the workers so far
      summary's wire_bytes_*)                    with its rows and its slices (`WIRE_FIELDS`)
    snapshots and checkpoints the whole        answers FETCH with SLICE: its params and velocity now
      vector: asks every shard (`assemble`)
    sends ALIVE every --comm-timeout / 4       times out after --comm-timeout x 2 without any message
    --resume: sends each shard its RESTORE     waits for its RESTORE before it starts
    after the final snapshot and checkpoint:   on END: sends its last rows (flag FINAL), ends
      END, then waits for the last rows

The stop: rank 0 decides between two of its pushes, but a push in flight can reach shard s before s hears
the decision and rank 0 after it (or the other way round). So every shard, rank 0 included, processes no
push after the decision until the shards agree which pushes each applies:

    rank 0: decides; SHARD_STOP to every shard     shard s: on SHARD_STOP, SHARD_STOPPED: the last step of
      (its own last steps: those it processed         each worker it processed (`last_step`); it defers
      before it decided; it defers any later push)    every later push (in its inbox: the worker waits)
    every SHARD_STOPPED in: final[w] = the largest
      of those steps; SHARD_FINAL to every shard    on SHARD_FINAL: `settle`
    role.agreement.settle(final)

`ShardAgreement.settle` (`mpiasgd.rank0.shard_agreement`, in the servers of async, ssp and easgd) processes the
deferred pushes: applies each worker's up to final[w] and drops later ones. A worker has one push in flight and
sends it to every shard at once, so every push of that set reaches every shard. Once a shard has applied all
of them (`settled`), it answers every push and FINISH with STOP and its final slice, and FETCH (a checkpoint
on a signal: rank 0 writes it once it has settled, `Rank0.tick`).
So every shard ends at the same version with the same pushes applied, every worker evaluates the same final
weights, and the final snapshot (rank 0 asks after every EVAL) is those weights.

An interval checkpoint is the same agreement as a pause, so that it is one consistent cut (every shard's slice
holds the same pushes, those the checkpoint's worker rows name), not S slices taken at S moments:

    rank 0: the checkpoint is due (`pause`);       shard s: on SHARD_PAUSE, SHARD_PAUSED: its last steps; it
      SHARD_PAUSE to every shard; it holds            holds every later push
      every later push
    every SHARD_PAUSED in: SHARD_FINAL (as at      on SHARD_FINAL: applies each worker's pushes up to final[w],
      the stop); applies its own up to final[w]       holds later ones
    once applied (`paused`): the checkpoint;       on FETCH flag RESUME, once applied: SLICE, then it processes
      FETCH flag RESUME to every shard; after         the pushes it held and goes on
      every SLICE it processes the pushes it held

A worker waits at most one round trip between the shards and rank 0 longer than it would have. Snapshots
wait while a pause is under way; a stop decided meanwhile is told the shards after it.

The bytes a shard has moved (its server's `count_wire`: PUSH received, WEIGHTS and STOP sent, in this job)
travel in two header fields SHARD_ROWS and SLICE do not otherwise use (`WIRE_FIELDS`: `correct` the bytes
pushed, `correct5` the bytes pulled); rank 0 adds them to its own for the summary and logs them with every
checkpoint (/wire_bytes), the SLICE that checkpoint asked for giving the counts at its state.

A signal that reaches rank 0 (a launcher's SIGTERM reaches every rank at once): rank 0 closes its log at once
(`Rank0.close_log_on_signal`), and Open MPI's mpiexec kills every rank 0.25 s later. A shard's rows since its last
SHARD_ROWS are then on the shard alone, while shard 0's are in rank 0's log. So rank 0 first takes the rows each
shard sends on its own signal (flag PREEMPT), for up to SIGNAL_ROWS_WAIT seconds (`signal_rows`), and the log
closes with every shard's rows up to the signal.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import checkpoint, signals
from mpiasgd.comms import (
    CommTimeout,
    Deadline,
    Flag,
    Interval,
    Message,
    ProtocolError,
    SendSlots,
    Tag,
    protocol,
    wait,
)
from mpiasgd.comms.protocol import HEADER_BYTES, STOP_STEP, rows_message, rows_of
from mpiasgd.comms.ulfm import failed_ranks, is_failure
from mpiasgd.comms.waits import Backoff, Spin, pauser
from mpiasgd.rank0.loop import WorkerFailed
from mpiasgd.rank0.recorder import ShardFigures
from mpiasgd.rank0.role import worker_rows
from mpiasgd.runlog import SHARD_PUSH_ROW

SIGNAL_ROWS_WAIT = 0.1  # s rank 0 waits for the shards' rows on a signal before it closes its log (of mpiexec's 0.25)
WIRE_FIELDS = ("correct", "correct5")  # the header fields of SHARD_ROWS and SLICE: the shard's bytes pushed, pulled


def wire_fields(rec: Any) -> dict:
    """The header fields (`WIRE_FIELDS`) of a shard's SHARD_ROWS or SLICE: its recorder's bytes pushed and pulled
    in this job (0 where its server counts none)."""
    counts = rec.wire_bytes or {}
    return {WIRE_FIELDS[0]: counts.get("pushed", 0), WIRE_FIELDS[1]: counts.get("pulled", 0)}


def steps_message(tag: Tag, sender: int, steps: dict[int, int]) -> Message:
    """SHARD_STOPPED or SHARD_FINAL: a STOP_STEP row (worker, step) for every worker in `steps`."""
    rows = np.array(sorted(steps.items()), dtype=np.int64).reshape(-1, 2)
    return rows_message(tag, sender, np.rec.fromarrays([rows[:, 0], rows[:, 1]], dtype=STOP_STEP))


def steps_of(message: Any, tag: Tag, source: int, rank: int, nbytes: int, workers: list[int]) -> dict[int, int]:
    """{worker: step} of a SHARD_STOPPED or SHARD_FINAL probed as `message` (received here); ProtocolError
    unless it holds one row for each of `workers` with a step >= 0."""
    if nbytes < HEADER_BYTES or (nbytes - HEADER_BYTES) % 4:
        raise ProtocolError(f"rank {rank}: {tag.name} message from rank {source} is {nbytes} bytes, expected the "
                            f"{HEADER_BYTES}-byte header and whole float32 values")
    msg = Message((nbytes - HEADER_BYTES) // 4)
    message.Recv(msg.buf)
    protocol.check(msg, tag, source, rank)
    rows = rows_of(msg, STOP_STEP, source, rank)
    steps = {int(w): int(step) for w, step in zip(rows["worker"], rows["step"], strict=True)}
    if sorted(steps) != sorted(workers) or len(rows) != len(workers) or min(steps.values(), default=0) < 0:
        raise ProtocolError(f"rank {rank}: {tag.name} from rank {source} holds steps {steps}, expected one step "
                            f">= 0 for each worker {sorted(workers)}")
    return steps


def restore_count(size: int, num_workers: int) -> int:
    """float32 values in the RESTORE of a shard of `size` parameters: its params, its velocity, then the
    `num_workers` WORKER_STATE rows as bytes (padded to whole values)."""
    return 2 * size + -(-num_workers * checkpoint.WORKER_STATE.itemsize // 4)


class ShardHub:
    """(rank 0, --servers S > 1) Rank 0's side of the other shards: see the module docstring. `r0` is rank 0's
    loop (its role holds shard 0's slice and the cut); the recorder gets a ShardFigures (`rec.shards`)."""

    decides = True
    preempted = False      # (a shard's HubLink learns it from rank 0; rank 0's loop knows it itself)
    tags = frozenset({Tag.SHARD_ROWS, Tag.SHARD_STOPPED, Tag.SHARD_PAUSED})

    def __init__(self, r0: Any) -> None:
        self.r0, self.comm, self.cfg, self.rec = r0, r0.comm, r0.cfg, r0.rec
        self.cut = r0.role.cut
        n = len(r0.workers)
        self.shards = {self.cut.rank(s, n): s for s in range(1, self.cut.shards)}  # rank -> shard
        self.stop_told = False
        self.stopped_steps: dict[int, dict[int, int]] = {}  # shard rank -> its SHARD_STOPPED (the stop's agreement)
        self.own_steps: dict[int, int] = {}                  # rank 0's last steps when it decided (or paused)
        self.paused_steps: dict[int, dict[int, int]] = {}    # shard rank -> its SHARD_PAUSED (the pause's agreement)
        self.sends: list[tuple[Any, Message]] = []  # (request, its buffer) until the send completed
        self.requests = 0                            # FETCHes sent (the number each SLICE answers)
        self.slices = {r: Message(2 * self.cut.size(s)) for r, s in self.shards.items()}
        self.alive = Interval(self.cfg.comm_timeout / 4)
        self.ended: set[int] = set()                 # shards whose last rows (flag FINAL) arrived
        self.warned: set[int] = set()                # shards warned about (--stall-warning) in their current silence
        self.offsets: dict[int, float] = {}          # rank 0's clock minus each shard's (`receive`)
        self.signalled: set[int] = set()             # shards whose rows flagged PREEMPT (their signal) arrived
        self.rows_deadline = 0.0                     # until when `signal_rows` waits for them (0: not yet asked)
        self.rows_in = threading.Event()             # set once the main thread stopped waiting for them
        self.rec.shards = ShardFigures(self.cut.shards)
        for r in self.shards:
            r0.last_seen[r] = 0.0

    def name(self, r: int) -> str:
        return f"parameter-server shard {self.shards[r]} (rank {r})"

    # --- what the loop asks ---
    def senders(self, tag: Tag) -> list[int]:
        """The ranks a `tag` message may come from on rank 0."""
        workers = list(self.r0.workers)
        if tag in (Tag.SHARD_ROWS, Tag.SHARD_STOPPED, Tag.SHARD_PAUSED):
            return list(self.shards)
        if tag == Tag.ERROR:
            return workers + list(self.shards)
        if tag in (Tag.PUSH, Tag.EVAL, Tag.ALIVE, Tag.FINISH):
            return workers
        return []  # SLICE: received only by `assemble`

    def done(self) -> bool:
        return self.r0.role.done()

    def receive(self, tag: Tag, source: int, message: Any, nbytes: int) -> None:
        """A SHARD_ROWS from shard rank `source`: its rows logged, its version and bytes moved kept, a signal it
        reports acted on. A SHARD_STOPPED or SHARD_PAUSED: kept (`agree`)."""
        if tag in (Tag.SHARD_STOPPED, Tag.SHARD_PAUSED):
            told, steps, asked = ((self.stop_told, self.stopped_steps, "SHARD_STOP") if tag == Tag.SHARD_STOPPED
                                  else (self.pausing, self.paused_steps, "SHARD_PAUSE"))
            if not told or source in steps:
                raise ProtocolError(f"rank 0: {tag.name} from rank {source} " + (
                    "a second time" if told else f"before {asked}"))
            steps[source] = steps_of(message, tag, source, 0, nbytes, list(self.r0.workers))
            self.agree(steps)
            return
        if nbytes < HEADER_BYTES or (nbytes - HEADER_BYTES) % 4:
            raise ProtocolError(f"rank 0: {tag.name} message from rank {source} is {nbytes} bytes, expected the "
                                f"{HEADER_BYTES}-byte header and whole float32 values")
        msg = Message((nbytes - HEADER_BYTES) // 4)
        message.Recv(msg.buf)
        protocol.check(msg, tag, source, 0)
        s, h = self.shards[source], msg.header
        rows = rows_of(msg, SHARD_PUSH_ROW, source, 0)
        if len(rows) and (rows["shard"] != s).any():
            raise ProtocolError(f"rank 0: SHARD_ROWS from rank {source} (shard {s}) holds rows of shards "
                                f"{sorted(set(rows['shard'].tolist()))}")
        # the shard's clock onto rank 0's: the offset seen with the quickest delivery so far (a batch that waited
        # for rank 0 would place its rows late by that wait)
        offset = self.offsets[source] = min(self.offsets.get(source, np.inf), self.rec.now() - float(h["elapsed"]))
        for row in rows:
            self.rec.shard_push(shard=s, time=max(0.0, float(row["time"]) + offset), worker=int(row["worker"]),
                                step=int(row["step"]), base_version=int(row["base_version"]),
                                version=int(row["version"]), staleness=int(row["staleness"]),
                                applied=bool(row["applied"]))
        self.rec.shards.versions[s] = int(h["version"])
        self.rec.shards.report_wire(s, int(h[WIRE_FIELDS[0]]), int(h[WIRE_FIELDS[1]]))
        flags = int(h["flags"])
        if flags & Flag.PREEMPT:
            self.signalled.add(source)
            self.r0.signal_from(f"a signal received by parameter-server shard rank {source}")
        if flags & Flag.FINAL:
            self.ended.add(source)

    def tick(self) -> None:
        """The stop decision told to the shards once (after a pause under way); ALIVE every --comm-timeout / 4;
        completed sends let go."""
        if self.rec.stop_reason and not self.stop_told and not self.pausing:
            self.tell_stop()
        if self.alive.due(self.rec.now()):
            for r in self.shards:
                self.post(r, Message(0).stamp(Tag.ALIVE, 0), Tag.ALIVE)
        self.sends = [(req, msg) for req, msg in self.sends if not req.Test()]

    def signal_rows(self) -> None:
        """(a signal reached rank 0, before its log closes) Every shard's rows up to its own signal, for at most
        SIGNAL_ROWS_WAIT seconds from the first call: the main thread receives SHARD_ROWS until each shard's flagged
        PREEMPT is in; another thread (the signal thread) waits until the main thread is done or the time is up (the
        main thread may be inside a long C call). A shard the signal did not reach sends none: the wait ends then."""
        now = time.monotonic()
        if not self.rows_deadline:
            self.rows_deadline = now + SIGNAL_ROWS_WAIT
        if threading.current_thread() is not threading.main_thread():
            self.rows_in.wait(max(0.0, self.rows_deadline - now))
            return
        status = MPI.Status()
        try:
            while set(self.shards) - self.signalled and time.monotonic() < self.rows_deadline:
                message = self.comm.Improbe(MPI.ANY_SOURCE, int(Tag.SHARD_ROWS), status)
                if message is None:
                    time.sleep(1e-4)
                    continue
                self.receive(Tag.SHARD_ROWS, status.Get_source(), message, status.Get_count(MPI.BYTE))
                self.r0.last_seen[status.Get_source()] = self.rec.now()
        finally:
            self.rows_in.set()

    def check_silence(self, now: float, limit: float) -> None:
        """CommTimeout naming a shard that has sent nothing for more than `limit` seconds (it sends its rows at
        least every limit / 4); before that, one --stall-warning per silence. The loop asks before it looks at
        the workers (`Rank0Loop.check_stalls`), so a stopped shard is named before the workers that wait for
        its replies and fall silent with it."""
        warn = self.cfg.stall_warning
        for r in self.shards:
            quiet = now - self.r0.last_seen[r]
            if r in self.ended:
                continue
            if warn and warn < limit and quiet > warn and r not in self.warned:
                self.warned.add(r)
                self.rec.warn(f"{self.name(r)} has sent nothing for {quiet:.1f} s (--stall-warning {warn:g} s): the "
                              "workers waiting for its replies fall silent with it; the run ends if it stays silent "
                              f"for {limit:g} s (--comm-timeout)")
            elif quiet <= (warn or 0):
                self.warned.discard(r)  # it spoke again: warn anew next time
            if quiet > limit:
                raise CommTimeout(f"rank 0: {self.name(r)} has sent nothing for {quiet:.1f} s (--comm-timeout "
                                  f"{limit:g} s; a shard sends its rows at least every {limit / 4:g} s): hung or "
                                  f"very slow")

    def pending_sends(self) -> list:
        return [req for req, _ in self.sends]

    # --- sends ---
    def post(self, r: int, msg: Message, tag: Tag) -> None:
        """Send `msg` to shard rank `r`; the message is kept until its send completed."""
        self.sends.append((self.comm.Isend(msg.buf, dest=r, tag=int(tag)), msg))

    def tell_stop(self) -> None:
        """SHARD_STOP to every shard (flag PREEMPT when a signal ends the run): they process no more pushes until
        SHARD_FINAL (`agree`). Rank 0's own last steps are those it processed before it decided (it defers
        every later push: `ShardedServer.on_push`)."""
        if self.stop_told:
            return
        if self.pausing:
            raise ProtocolError("rank 0: the stop told the shards while an interval checkpoint's pause is under way")
        self.stop_told = True
        self.own_steps = {w: int(self.r0.role.last_step[w]) for w in self.r0.workers}
        flags = Flag.PREEMPT if self.r0.preempted else 0
        for r in self.shards:
            self.post(r, Message(0).stamp(Tag.SHARD_STOP, 0, flags=flags), Tag.SHARD_STOP)

    def agree(self, told: dict[int, dict[int, int]]) -> None:
        """Once every shard's SHARD_STOPPED (or in a pause SHARD_PAUSED: `told`) is in: each worker's final
        step, the largest any shard (rank 0's included) had processed, to every shard (SHARD_FINAL) and to rank
        0's role (`ShardAgreement.settle`)."""
        if len(told) < len(self.shards):
            return
        final = {w: max([step, *(steps[w] for steps in told.values())]) for w, step in self.own_steps.items()}
        for r in self.shards:
            self.post(r, steps_message(Tag.SHARD_FINAL, 0, final), Tag.SHARD_FINAL)
        self.r0.role.agreement.settle(final)

    # --- an interval checkpoint: a pause ---
    def pause(self) -> None:
        """An interval checkpoint is due: SHARD_PAUSE to every shard, and rank 0's role holds every later push
        (`ShardAgreement.pause`); the checkpoint is written once `paused`. Nothing when a pause is under way or
        the stop was told."""
        if self.pausing or self.stop_told:
            return
        self.paused_steps = {}
        self.own_steps = {w: int(self.r0.role.last_step[w]) for w in self.r0.workers}
        self.r0.role.agreement.pause()
        for r in self.shards:
            self.post(r, Message(0).stamp(Tag.SHARD_PAUSE, 0), Tag.SHARD_PAUSE)

    @property
    def pausing(self) -> bool:
        """An interval checkpoint's pause is under way (`pause` to `resume`; rank 0's role holds the state)."""
        return self.r0.role.agreement.pausing

    def paused(self) -> bool:
        """The pause's checkpoint may be taken: the shards agreed and rank 0 applied every agreed push (the
        other shards answer its FETCH once they have)."""
        return self.pausing and self.r0.role.agreement.paused()

    def resume(self) -> None:
        """After the pause's checkpoint (every shard's SLICE in: each shard has resumed): rank 0's held pushes are
        processed."""
        self.r0.role.agreement.resume()

    # --- the whole vector ---
    def assemble(self, params0: np.ndarray, velocity0: np.ndarray | None = None) -> tuple:
        """(params (P,), velocity (P,) or None, versions [S]) float32: shard 0's slice `params0` (and `velocity0`)
        with every other shard's as it answers FETCH now (after SHARD_STOP when the run is stopping, so that
        a stopped shard's slice is its final one). CommTimeout naming a shard that does not answer within
        --comm-timeout; ProtocolError for an answer of the wrong size or request."""
        if self.rec.stop_reason and not self.pausing:
            self.tell_stop()
        if self.ended:
            raise CommTimeout(f"rank 0: parameter-server shard rank(s) {sorted(self.ended)} have ended: their "
                              "slices cannot be asked for")
        self.requests += 1
        number, P = self.requests, self.cut.num_params
        params = np.empty(P, np.float32)
        velocity = None if velocity0 is None else np.empty(P, np.float32)
        a, b = self.cut.slice(0)
        params[a:b] = params0
        if velocity is not None:
            velocity[a:b] = velocity0
        versions = [self.r0.role.counter.version] + [0] * len(self.shards)
        receives = {r: self.comm.Irecv(self.slices[r].buf, source=r, tag=int(Tag.SLICE)) for r in self.shards}
        flags = Flag.RESUME if self.pausing else 0  # the pause's slice: each shard resumes after sending it
        for r in self.shards:
            self.post(r, Message(0).stamp(Tag.FETCH, 0, step=number, flags=flags), Tag.FETCH)
        for r, s in self.shards.items():
            status = MPI.Status()
            msg = self.slices[r]
            self.await_shard(r, f"SLICE (its weights) from {self.name(r)}", partial(receives[r].Test, status))
            protocol.check_size(Tag.SLICE, r, 0, status.Get_count(MPI.BYTE), msg.count)
            protocol.check(msg, Tag.SLICE, r, 0)
            if int(msg.header["step"]) != number:
                raise ProtocolError(f"rank 0: SLICE from rank {r} answers request {int(msg.header['step'])}, "
                                    f"expected {number}")
            a, b = self.cut.slice(s)
            params[a:b] = msg.payload[:b - a]
            if velocity is not None:
                velocity[a:b] = msg.payload[b - a:]
            versions[s] = self.rec.shards.versions[s] = int(msg.header["version"])
            self.rec.shards.report_wire(s, int(msg.header[WIRE_FIELDS[0]]), int(msg.header[WIRE_FIELDS[1]]))
            self.r0.last_seen[r] = self.rec.now()
        return params, velocity, versions

    def await_shard(self, r: int, what: str, poll: Any) -> Any:
        """Call `poll()` until it returns something (not None or False), within --comm-timeout (CommTimeout
        "rank 0: no WHAT after T s"); returns that.
        Meanwhile: an ERROR from that shard is raised as the loop raises it (WorkerFailed); and (after a signal,
        and every second) whether a shard's or a worker's process has exited: a launcher ends the job when a
        rank dies, and rank 0 must close the log before it does (`Rank0.shard_died`, `Rank0.worker_died` give
        the Preempted raised, naming it)."""
        deadline, look = Deadline(self.cfg.comm_timeout), Interval(1.0, self.rec.now())
        backoff = pauser(self.r0.server_wait)  # (rank 0 waits for a shard's slice or answer as for any message)
        status, start = MPI.Status(), self.rec.now()
        try:
            return self._await(r, what, poll, deadline, backoff, look, status)
        finally:  # rank 0 was busy waiting for a shard: not the workers' silence, and not a pause of rank 0
            self.r0.excuse(self.rec.now() - start)

    def _await(self, r: int, what: str, poll: Any, deadline: Deadline, backoff: Backoff | Spin, look: Interval,
               status: Any) -> Any:
        """`await_shard`'s loop."""
        while True:
            told = None
            try:
                if got := poll():
                    return got
                for tag in (Tag.SHARD_STOPPED, Tag.SHARD_PAUSED):
                    told = self.comm.Improbe(MPI.ANY_SOURCE, int(tag), status)
                    if told is not None:  # (after the stop or in a pause a shard answers FETCH once they agreed)
                        self.receive(tag, status.Get_source(), told, status.Get_count(MPI.BYTE))
                        break
                failed = None if told is not None else self.comm.Improbe(r, int(Tag.ERROR), status)
            except MPI.Exception as e:  # ULFM: a rank died; dropped at rank 0's next tick, not inside this wait
                if not is_failure(e):  # (its checkpoint or a stop would nest in this one); the shards settle a
                    raise              # dead worker's last push themselves
                dead = failed_ranks(self.comm)
                if r in dead:  # the shard this waits for: its slice is gone
                    raise self.r0.shard_died([(r, *self.r0.pids.get(r, ("?", 0)))]) from None
                self.r0.deaths.extend(dead)
                continue
            if told is not None:
                continue
            if failed is not None:  # it failed instead of answering: its traceback, as the loop takes it
                msg = Message(max(0, status.Get_count(MPI.BYTE) - HEADER_BYTES) // 4)
                failed.Recv(msg.buf[:status.Get_count(MPI.BYTE)])
                raise WorkerFailed(r, protocol.error_text(msg), "parameter-server shard")
            if signals.received() or look.due(self.rec.now()):
                gone = self.r0.exited_workers()
                if any(g[0] in self.shards for g in gone):
                    raise self.r0.shard_died([g for g in gone if g[0] in self.shards])
                if gone and not self.r0.elastic:  # a worker died (its last push may never reach the shard this
                    raise self.r0.worker_died(gone)  # waits for): end now (under ULFM the shard counts it instead)
            if deadline.expired():
                raise CommTimeout(f"rank 0: no {what} after {self.cfg.comm_timeout:.0f} s")
            backoff.pause()

    def weights(self) -> tuple:
        """(params (P,), buffers (B,)) of a snapshot: every shard's slice now, and rank 0's mean buffers."""
        role = self.r0.role
        params, _, _ = self.assemble(role.params)
        return params, role.current_buffers()

    def restore(self, ckpt: checkpoint.Checkpoint) -> checkpoint.Checkpoint:
        """(--resume) Send every other shard its RESTORE from `ckpt` (the whole run's: its slice of params and
        velocity, its version, the workers' rows); returns shard 0's slice of `ckpt` for rank 0's role."""
        for r, s in self.shards.items():
            a, b = self.cut.slice(s)
            msg = Message(restore_count(b - a, len(self.r0.workers)))
            msg.payload[:b - a] = ckpt.params[a:b]
            msg.payload[b - a:2 * (b - a)] = ckpt.momentum[a:b]
            rows = np.ascontiguousarray(worker_rows(ckpt.workers, self.r0.workers).astype(checkpoint.WORKER_STATE))
            rows = rows.view(np.uint8).reshape(-1)  # (another number of workers: this job's rows, `worker_rows`)
            start = HEADER_BYTES + 8 * (b - a)
            msg.buf[start:start + rows.size] = rows
            msg.stamp(Tag.RESTORE, 0, version=int(ckpt.shard_versions[s]), samples=ckpt.samples,
                      elapsed=ckpt.elapsed)
            self.post(r, msg, Tag.RESTORE)
        a, b = self.cut.slice(0)
        return dataclasses.replace(ckpt, params=ckpt.params[a:b], momentum=ckpt.momentum[a:b])

    def finish(self) -> None:
        """After the final snapshot and checkpoint: END to every shard, then its last rows (flag FINAL), each
        within --comm-timeout (CommTimeout naming a shard that sends none)."""
        self.tell_stop()
        for r in self.shards:
            self.post(r, Message(0).stamp(Tag.END, 0), Tag.END)
        status = MPI.Status()
        for r in self.shards:
            while r not in self.ended:
                message = self.await_shard(r, f"last rows (SHARD_ROWS, flag FINAL) from {self.name(r)}",
                                           partial(self.comm.Improbe, r, int(Tag.SHARD_ROWS), status))
                self.receive(Tag.SHARD_ROWS, r, message, status.Get_count(MPI.BYTE))
        for req, _ in self.sends:
            wait(req, "completion of a send to a parameter-server shard", 0, self.cfg.comm_timeout)
        self.sends = []


class HubLink:
    """(a parameter-server shard of rank >= 1, --servers S > 1) The shard's side of rank 0: see the module
    docstring. `r0` is the shard's loop: its role (the server on this shard's slice) and its recorder (a
    ShardRecorder)."""

    decides = False
    tags = frozenset({Tag.SHARD_STOP, Tag.SHARD_PAUSE, Tag.SHARD_FINAL, Tag.FETCH, Tag.END})

    def __init__(self, r0: Any) -> None:
        self.r0, self.comm, self.cfg, self.rec, self.role = r0, r0.comm, r0.cfg, r0.rec, r0.role
        self.rank = r0.rank
        self.size = self.role.params.size
        self.preempted = False   # rank 0's SHARD_STOP said a signal ends the run
        self.ended = False       # rank 0 said END
        self.told = False        # a signal received here was reported to rank 0
        self.sends: list[tuple[Any, Message]] = []
        self.slice = SendSlots([Message(2 * self.size)], "SLICE to rank 0", self.rank, self.cfg.comm_timeout)
        self.rows_due = Interval(self.cfg.flush_interval)
        self.last_sent = 0.0
        self.fetch_due = 0       # a FETCH that came after the stop, answered once this shard has settled
        self.fetch_resumes = False  # ... or in a pause (flag RESUME), answered once paused, then resumes

    def name(self) -> str:
        return f"rank {self.rank} (parameter-server shard {self.role.shard})"

    # --- what the loop asks ---
    def senders(self, tag: Tag) -> list[int]:
        """The ranks a `tag` message may come from on this shard."""
        if tag in (Tag.SHARD_STOP, Tag.SHARD_PAUSE, Tag.SHARD_FINAL, Tag.FETCH, Tag.END, Tag.ALIVE):
            return [0]
        if tag in (Tag.PUSH, Tag.FINISH):
            return list(self.r0.workers)
        return []

    def done(self) -> bool:
        return self.ended

    def receive(self, tag: Tag, source: int, message: Any, nbytes: int) -> None:
        """SHARD_STOP, SHARD_PAUSE, FETCH or END from rank 0 (header only), or SHARD_FINAL."""
        if tag == Tag.SHARD_FINAL:
            agreeing = bool(self.rec.stop_reason) or self.role.agreement.pausing
            if not agreeing or self.role.agreement.final is not None:
                raise ProtocolError(f"{self.name()}: SHARD_FINAL from rank 0 " + (
                    "a second time" if agreeing else "before SHARD_STOP or SHARD_PAUSE"))
            self.role.agreement.settle(steps_of(message, tag, source, self.rank, nbytes, list(self.r0.workers)))
            return
        msg = self.r0.header_only
        protocol.check_size(tag, source, self.rank, nbytes, 0)
        message.Recv(msg.buf)
        protocol.check(msg, tag, source, self.rank)
        if tag == Tag.SHARD_PAUSE:
            if self.rec.stop_reason or self.role.agreement.pausing:
                raise ProtocolError(f"{self.name()}: SHARD_PAUSE from rank 0 " + (
                    "after SHARD_STOP" if self.rec.stop_reason else "while paused"))
            self.role.agreement.pause()  # every push is held from now on until SHARD_FINAL (and later ones until FETCH)
            steps = {w: int(self.role.last_step[w]) for w in self.r0.workers}
            paused = steps_message(Tag.SHARD_PAUSED, self.rank, steps)
            self.sends.append((self.comm.Isend(paused.buf, dest=0, tag=int(Tag.SHARD_PAUSED)), paused))
        elif tag == Tag.SHARD_STOP:
            if self.rec.stop_reason:
                raise ProtocolError(f"{self.name()}: a second SHARD_STOP from rank 0")
            if self.role.agreement.pausing:
                raise ProtocolError(f"{self.name()}: SHARD_STOP from rank 0 while paused (before the pause's FETCH)")
            self.preempted = bool(int(msg.header["flags"]) & Flag.PREEMPT)
            self.rec.stop("rank 0 stopped the run")  # the role defers every push from now on until SHARD_FINAL
            steps = {w: int(self.role.last_step[w]) for w in self.r0.workers}
            stopped = steps_message(Tag.SHARD_STOPPED, self.rank, steps)
            self.sends.append((self.comm.Isend(stopped.buf, dest=0, tag=int(Tag.SHARD_STOPPED)), stopped))
        elif tag == Tag.FETCH:
            resumes = bool(int(msg.header["flags"]) & Flag.RESUME)
            if resumes and not self.role.agreement.pausing:
                raise ProtocolError(f"{self.name()}: FETCH flag RESUME from rank 0 without SHARD_PAUSE")
            if resumes or (self.rec.stop_reason and not self.role.settled()):
                # the pause's or the final slice: once every agreed push is applied (`tick`)
                self.fetch_due, self.fetch_resumes = int(msg.header["step"]), resumes
                self.answer_fetch()
            else:
                self.send_slice(int(msg.header["step"]))
        else:  # END
            waiting = [w for w in self.r0.workers if w not in self.role.stopped and w not in self.role.lost]
            if not self.rec.stop_reason or waiting:
                raise ProtocolError(f"{self.name()}: END from rank 0 before " + (
                    f"workers {waiting} were sent STOP" if self.rec.stop_reason else "SHARD_STOP"))
            self.ended = True

    def tick(self) -> None:
        """Rows to rank 0 every --flush-interval when there are any, and at least every --comm-timeout / 4."""
        now = self.rec.now()
        if (self.rows_due.due(now) and self.rec.rows) or now - self.last_sent >= self.cfg.comm_timeout / 4:
            self.send_rows()
        self.answer_fetch()
        self.sends = [(req, msg) for req, msg in self.sends if not req.Test()]

    def answer_fetch(self) -> None:
        """A FETCH held until the shards' agreement is applied here: answered once it is (`settled` after the
        stop; in a pause `paused`, and the pause then ends: `ShardAgreement.resume`)."""
        if not self.fetch_due or not (self.role.agreement.paused() if self.fetch_resumes else self.role.settled()):
            return
        self.send_slice(self.fetch_due)
        self.fetch_due = 0
        if self.fetch_resumes:
            self.fetch_resumes = False
            self.role.agreement.resume()

    def signalled(self, name: str) -> None:
        """A signal reached this shard: rank 0 is told at once (its rows, flag PREEMPT); rank 0 decides."""
        if not self.told:
            self.told = True
            self.send_rows(Flag.PREEMPT)

    def check_silence(self, now: float, limit: float) -> None:
        """Nothing: a shard's wait for any message has its own timeout (the loop's)."""

    def pending_sends(self) -> list:
        return [req for req, _ in self.sends] + self.slice.pending()

    def weights(self) -> tuple:
        return self.role.params, self.role.current_buffers()

    # --- sends ---
    def send_rows(self, flags: int = 0) -> None:
        rows = self.rec.take_rows()
        counter = self.role.counter
        msg = rows_message(Tag.SHARD_ROWS, self.rank, rows, version=counter.version, samples=counter.samples,
                           elapsed=self.rec.now(), flags=flags, **wire_fields(self.rec))
        self.sends.append((self.comm.Isend(msg.buf, dest=0, tag=int(Tag.SHARD_ROWS)), msg))
        self.last_sent = self.rec.now()

    def send_slice(self, number: int) -> None:
        """SLICE: this shard's params and velocity now (zeros without momentum), answering FETCH `number`."""
        msg = self.slice.take(0)
        msg.payload[:self.size] = self.role.params
        velocity = self.role.velocity()  # (easgd: none; the workers hold theirs)
        msg.payload[self.size:] = 0.0 if velocity is None else velocity
        counter = self.role.counter
        msg.stamp(Tag.SLICE, self.rank, step=number, version=counter.version, samples=counter.samples,
                  **wire_fields(self.rec))
        self.slice.send(self.comm, 0, 0, int(Tag.SLICE))

    def finish(self) -> None:
        """The last rows (flag FINAL), and every send completed."""
        self.send_rows(Flag.FINAL)
        for req, _ in self.sends:
            wait(req, "completion of a send to rank 0", self.rank, self.cfg.comm_timeout)
        self.sends = []
        self.slice.drain()

    def restore(self) -> None:
        """(--resume, before the loop starts) Rank 0's RESTORE: this shard's slice of the checkpoint, its version
        and every worker's step, into the recorder and the role. CommTimeout after --comm-timeout x 2."""
        workers = len(self.r0.workers)
        msg = Message(restore_count(self.size, workers))
        status = MPI.Status()
        wait(self.comm.Irecv(msg.buf, source=0, tag=int(Tag.RESTORE)), "RESTORE (its slice of the checkpoint) from "
             "rank 0", self.rank, self.cfg.worker_timeout, status)
        protocol.check_size(Tag.RESTORE, 0, self.rank, status.Get_count(MPI.BYTE), msg.count)
        protocol.check(msg, Tag.RESTORE, 0, self.rank)
        h, n = msg.header, self.size
        start = HEADER_BYTES + 8 * n
        rows = msg.buf[start:start + workers * checkpoint.WORKER_STATE.itemsize].copy().view(checkpoint.WORKER_STATE)
        ckpt = checkpoint.Checkpoint(params=msg.payload[:n].copy(), momentum=msg.payload[n:2 * n].copy(),
                                     workers=rows, version=int(h["version"]), samples=int(h["samples"]),
                                     elapsed=float(h["elapsed"]), log_time=0.0, config="", log="",
                                     mode=self.cfg.mode, model=self.cfg.model, reason="resume")
        self.rec.restore(ckpt)
        self.role.restore(ckpt)
