"""What a mode does on rank 0: the `Role` a mode's rank-0 part implements for the loop.

The loop (`mpiasgd.rank0.loop.Rank0`) asks the role which messages it takes (`handlers`, with a
receive buffer each: `buffer_for`), what it sends first (`begin`), its clock duties (`tick`),
whether the run is over (`done`) and whom it still waits for, and for the state to checkpoint
when rank 0 holds it (`checkpoints_here`). The role reports everything it learns to the recorder
(`self.rec`), never to the log itself. The role owns the server's version counter (`counter`, a
`VersionCounter`): it advances it; the recorder reads it.

This base class holds what every role shares: the workers' EVALs at the end (`on_eval`) and during
training (`periodic`, --eval-interval: `mpiasgd.rank0.evals`), the header-only STOP of the modes
whose workers decide their own steps (`send_stop`), and the optimizer state sent to resuming
workers (`send_state`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpiasgd import checkpoint
from mpiasgd.comms import Flag, Message, ProtocolError, SendSlots, Tag
from mpiasgd.rank0.counter import VersionCounter
from mpiasgd.rank0.evals import PeriodicEvals


def worker_rows(rows: np.ndarray, workers: Any) -> np.ndarray:
    """A checkpoint's WORKER_STATE `rows` for this job's `workers` (ranks): the rows themselves for the same number
    of workers; for another number (issue 40), the data is dealt over this job's shards, each 1/N of the set, so
    a worker's position in its new shard is the one it had in its old (its cursor scaled by N_old / N_new), a new
    worker's the workers' mean; a worker keeps its step count and rejects (a new one starts at 0)."""
    if len(rows) == len(workers):
        return rows
    old = {int(row["rank"]): row for row in rows}
    scale = len(rows) / len(workers)
    mean = float(np.mean(rows["cursor"])) if len(rows) else 0.0
    out = np.zeros(len(workers), checkpoint.WORKER_STATE)
    for i, w in enumerate(workers):
        row = old.get(w)
        out[i] = (w, 0, round(mean * scale), 0) if row is None else (
            w, int(row["step"]), round(int(row["cursor"]) * scale), int(row["rejected"]))
    return out


class Role:
    """Base of a mode's rank-0 part. `r0` is the loop (`Rank0`): its comm, cfg, recorder, workers.

    Attributes every role has: `params` (float32 (P,), the weights rank 0 snapshots), `buffers` (float32
    (B,), the layers' buffers it snapshots with them: `current_buffers`), `stopped`
    (workers sent STOP), `evals` ({worker: (loss sum, correct, images, top-5 correct)}: the final
    evaluation), `periodic` (the evaluations during training), `last_step` and `cursor` ({worker: int}:
    its last step and data position, for checkpoints), `counter` (the server's version and images, a
    `VersionCounter` the recorder reads).
    """

    checkpoints_here = False  # rank 0 holds the whole training state (it writes checkpoints itself)
    snapshots_here = False    # rank 0 holds current weights (it snapshots them on the interval itself)

    def __init__(self, r0: Any, params: np.ndarray, buffers: np.ndarray | None = None) -> None:
        self.r0, self.rec, self.comm, self.cfg = r0, r0.rec, r0.comm, r0.cfg
        self.rank = r0.rank  # 0, or a parameter-server shard's (--servers)
        self.workers = r0.workers
        self.counter = VersionCounter()
        self.rec.reads(self.counter)
        self.params = params
        self.buffers = np.zeros(0, np.float32) if buffers is None else buffers
        self.worker_buffers: dict[int, np.ndarray] = {}  # async modes: each worker's latest pushed buffers
        self.stopped: set[int] = set()
        self.lost: set[int] = set()  # workers that died under ULFM and were dropped (`lose_worker`)
        self.lost_order: list[int] = []  # the same, in the order they were dropped
        # (ULFM) what the workers are told (LOST messages), in order: (worker rank, 0) a death, (worker rank,
        # Flag.JOINED) a replacement that took the rank (--respawn)
        self.notice_order: list[tuple[int, int]] = []
        self.evals: dict[int, tuple] = {}
        self.stops_sent: set[int] = set()  # header-only STOPs posted (send_stop)
        self.last_step = dict.fromkeys(self.workers, 0)
        self.cursor = dict.fromkeys(self.workers, 0)
        # one send slot per worker: its replies (or STOP), each posted once the previous one completed
        self.out = {w: SendSlots([None], f"send to worker rank {w}", 0, self.cfg.comm_timeout) for w in self.workers}
        self.state_slots = SendSlots([], "CHECKPOINT (optimizer state)", 0, self.cfg.comm_timeout)
        self.periodic = PeriodicEvals(self.rec, self.cfg, self.workers)  # --eval-interval (rank 0 decides)

    # --- what the loop asks ---
    def current_buffers(self) -> np.ndarray:
        """The layers' buffers that go with `params` in a snapshot or checkpoint (float32 (B,)): the mean of the
        workers' latest pushed ones (`take_buffers`) when there are any, else `buffers` as they are."""
        if self.worker_buffers and self.buffers.size:
            self.buffers[:] = np.mean(list(self.worker_buffers.values()), axis=0, dtype=np.float64)
        return self.buffers

    def take_buffers(self, w: int, pushed: np.ndarray) -> None:
        """Keep worker `w`'s buffers (`pushed`, the (B,) tail of its push; copied) unless they are not finite."""
        if self.buffers.size and np.isfinite(pushed).all():
            self.worker_buffers[w] = pushed.copy()

    def handlers(self) -> dict:
        """{Tag: handler(worker, Message)} of the messages rank 0 takes in this mode (ERROR aside)."""
        raise NotImplementedError

    def buffer_for(self, tag: Tag, source: int) -> Message | None:
        """The receive buffer of a `tag` message from `source` (its size is checked against it); None: the
        loop's header-only buffer."""
        return None

    def whose(self, tag: Tag) -> str:
        """What a size error of a `tag` message adds about the receiver ("": nothing; a parameter-server shard
        names its slice)."""
        return ""

    def warm_up(self) -> None:
        """Load what the first messages would otherwise wait for (compiled code), before the clocks start."""

    def begin(self) -> None:
        """The first sends (initial weights)."""

    def tick(self) -> None:
        """Clock-driven duties between messages."""

    def done(self) -> bool:
        """The loop's end: every worker has sent its EVAL, or was lost."""
        return all(w in self.evals or w in self.lost for w in self.workers)

    def waiting_for(self) -> list[int]:
        """The workers `done()` still waits for (named when a wait times out)."""
        return [w for w in self.workers if w not in self.evals and w not in self.lost]

    def survives(self) -> str:
        """"" if this role can go on without a worker that died (`lose_worker`), else why not (the run then ends
        as when a launcher kills a job whose rank died)."""
        return f"mode '{self.cfg.mode}' does not drop a dead worker yet (it ends the run)"

    def lose_worker(self, w: int) -> None:
        """Worker `w` died (ULFM reported it): go on without it. Nothing more is sent to it or awaited from it (its
        pending sends are dropped: they may never complete); an evaluation it was asked for goes without it."""
        self.lost.add(w)
        self.lost_order.append(w)
        self.notice_order.append((w, 0))
        self.out[w] = SendSlots([None], f"send to worker rank {w}", 0, self.cfg.comm_timeout)
        self.periodic.lose(w)

    def rejoin(self, w: int) -> None:
        """(--respawn) Worker rank `w`, dropped (`lose_worker`), is back: a replacement took its rank. It is awaited
        again (its EVAL, its pushes from step `last_step[w] + 1`), the other workers are told (a LOST notice with
        flag JOINED); its first weights are the role's to send. ValueError unless `w` was lost."""
        if w not in self.lost:
            raise ValueError(f"rejoin: worker rank {w} was not dropped")
        self.lost.discard(w)
        self.lost_order.remove(w)
        self.notice_order.append((w, int(Flag.JOINED)))
        self.stopped.discard(w)
        self.stops_sent.discard(w)
        self.periodic.rejoin(w)
        self.out[w] = SendSlots([None], f"send to worker rank {w}", 0, self.cfg.comm_timeout)

    def waits_for_rank0(self, w: int) -> bool:
        """Worker `w` is silent because it waits for rank 0 (not a stall)."""
        return False

    def stop_workers(self) -> None:
        """Tell the workers the run stops before a rule they judge themselves would (--on-divergence stop)."""

    def settled(self) -> bool:
        """The state is final after the stop (a checkpoint of it may be written): at once, unless a role waits
        for something first (`ShardedServer.settled`: the shards' agreement)."""
        return True

    def on_preempt(self) -> None:
        """What a preemption does besides stopping and checkpointing (the loop did those)."""

    def state(self, reason: str) -> checkpoint.Checkpoint:
        """The training state now (roles with `checkpoints_here`)."""
        raise NotImplementedError

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        """Continue from `ckpt` (before `begin`): the weights, the layers' buffers (a checkpoint written before
        networks had buffers holds none: they stay at their initial values), the version and images, and each
        worker's step and data position (a checkpoint of another number of workers: see the comment below)."""
        self.counter.set(ckpt.version, ckpt.samples)
        self.params[:] = ckpt.params
        if ckpt.buffers.size == self.buffers.size:
            self.buffers[:] = ckpt.buffers
        for row in worker_rows(ckpt.workers, self.workers):
            self.last_step[int(row["rank"])], self.cursor[int(row["rank"])] = int(row["step"]), int(row["cursor"])

    def final_evals(self, preempted: str) -> dict:
        """{worker: (loss sum, correct, images, top-5 correct)} of the final evaluation."""
        return self.evals

    def pending_sends(self) -> list:
        return [r for slots in (*self.out.values(), self.state_slots) for r in slots.pending()]

    # --- shared handlers and sends ---
    def check_push(self, w: int, msg: Message) -> tuple[int, int]:
        """(step, base version) of a PUSH from worker `w`, after the protocol's checks: not after its STOP,
        the next step, a version rank 0 has had (ProtocolError naming what differs)."""
        h = msg.header
        step, base = int(h["step"]), int(h["version"])
        if w in self.stopped:
            raise ProtocolError(f"rank 0: PUSH step {step} from worker rank {w} after it was sent STOP")
        if step != self.last_step[w] + 1:
            raise ProtocolError(f"rank 0: PUSH from worker rank {w} has step {step}, expected "
                                f"{self.last_step[w] + 1} (duplicate or out-of-order push)")
        if not 0 <= base <= self.counter.version:
            raise ProtocolError(f"rank 0: PUSH step {step} from worker rank {w} was computed from version "
                                f"{base}, but the server is at version {self.counter.version}")
        return step, base

    def on_eval(self, w: int, msg: Message) -> None:
        """An EVAL: an evaluation during training (flag EVALUATE: `periodic`), or the final one (after STOP)."""
        h = msg.header
        if int(h["flags"]) & Flag.EVALUATE:
            self.periodic.answer(w, h)
            return
        if w not in self.stopped:
            raise ProtocolError(f"rank 0: EVAL from worker rank {w} before it was sent STOP")
        if w in self.evals:
            raise ProtocolError(f"rank 0: second EVAL from worker rank {w}")
        self.evals[w] = (float(h["loss"]), int(h["correct"]), int(h["samples"]), int(h["correct5"]))

    def send_state(self, w: int, velocity: np.ndarray) -> None:
        """(resuming) Post the checkpoint's `velocity` (float32, the worker's share) to worker `w` as a
        CHECKPOINT message; it follows the initial WEIGHTS."""
        state = Message(velocity.size)
        state.payload[:] = velocity
        state.stamp(Tag.CHECKPOINT, self.rank, version=self.counter.version)
        self.state_slots.send(self.comm, self.state_slots.add(state), w, int(Tag.CHECKPOINT))

    def post(self, w: int, msg: Message, tag: Tag) -> None:
        """Send `msg` to worker `w` from its send slot (take(w) came first: the previous send completed)."""
        self.out[w].buffers[0] = msg
        self.out[w].send(self.comm, 0, w, int(tag))

    def send_stop(self, w: int) -> None:
        """The one header-only STOP worker `w` gets (sync, pipeline, easgd): after its last message, or at
        once (flag PREEMPT) on a signal; it completes the receive the worker posted at its start."""
        if w in self.stops_sent:
            return
        self.stops_sent.add(w)
        self.out[w].take(0)
        self.post(w, Message(0).stamp(Tag.STOP, self.rank, flags=Flag.PREEMPT if self.r0.preempted else 0), Tag.STOP)
