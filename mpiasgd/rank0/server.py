"""What every parameter-server role shares (async and ssp: `AsgdServer`; easgd: `EasgdCenter`): a reply to
every PUSH on its slice of the parameters, and the parameter-server shards of `--servers S`.

A server holds the slice `cut.slice(shard)` of the flat parameter vector (with S = 1 the whole vector;
`server_shard` says which slice a rank holds: `mpiasgd.comms.shard_cut`) and answers each worker's PUSH
(`take_push`, the mode's update rule) with WEIGHTS, or STOP once the run has stopped (`reply`). With
S > 1 shards every shard runs this role on its own slice and takes part in the shards' agreement
(`agreement`, `mpiasgd.rank0.shard_agreement`): after the stop, and in an interval checkpoint's pause, every
shard applies the same pushes. With S = 1 the agreement is `OneServer`: a push is applied unless the run
has stopped.

A checkpoint (`state`) holds the whole vector and its velocity (`velocity`; zeros where the server has none):
rank 0 asks the other shards for their slices (`ShardHub.assemble`), which answer with theirs (`HubLink`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mpiasgd import checkpoint
from mpiasgd.comms import Flag, Message, Tag
from mpiasgd.comms.shard_cut import ShardCut
from mpiasgd.comms.wire import RANGE, beyond_range, decode, encode_peak
from mpiasgd.health import WIRE_ADVICE
from mpiasgd.optim import Schedule, finite_square
from mpiasgd.optim.rules import Push, Update, UpdateRule
from mpiasgd.rank0.advice import ExchangeWatch
from mpiasgd.rank0.recorder import TrainingDiverged
from mpiasgd.rank0.role import Role
from mpiasgd.rank0.shard_agreement import OneServer, ShardAgreement


class BeyondWireRange(TrainingDiverged):
    """(--wire fp16) The weights or layer buffers a reply would carry leave fp16's range: they would travel as inf
    and the worker compute NaN. The message names the server's rank, the reply, the value and the range."""


def server_shard(r0: Any, num_params: int, buffers: np.ndarray | None) -> tuple[ShardCut, int]:
    """(the cut, the shard) of rank `r0.rank`: the cut of `num_params` parameters and the layer `buffers` (float32
    (B,) or None; carried by shard 0) into `r0.cfg.servers` shards, balanced by bytes (`ShardCut.balanced`;
    S = 1: one slice, shard 0)."""
    cut = ShardCut.balanced(num_params, 0 if buffers is None else buffers.size, r0.cfg.servers)
    return cut, cut.shard_of(r0.rank, len(r0.workers))


class ReplyNow:
    """How a server answers each push: at once (async, easgd). A mode that holds some replies gives its server
    another gate with the same four methods (`mpiasgd.modes.ssp.SspGate`); the server calls them."""

    def __init__(self, server: ShardedServer) -> None:
        self.server = server
        self.held: dict[int, tuple[int, float]] = {}  # worker -> (its clock, held since): none held here

    def answer(self, w: int, step: int) -> None:
        """Answer push `step` of worker `w` (now: `ShardedServer.reply`)."""
        self.server.reply(w, step)

    def on_start(self, workers: list[int]) -> None:
        """`workers` get their first weights now."""

    def tick(self) -> None:
        """Clock-driven duties (a stop releases what a gate holds)."""

    def lose(self, w: int) -> None:
        """Worker `w` died (`Role.lose_worker`): a reply held for it is dropped, and what waited for it goes on."""

    def holding(self, w: int) -> bool:
        """Worker `w` waits for a reply the gate holds (its silence is no stall)."""
        return False


class ShardedServer(Role):
    """(rank 0, and with --servers S > 1 every parameter-server shard) A server on its slice `params` (float32
    (P,), P the slice's size) with the layer `buffers` (float32 (B,); shard 0 only); see the module docstring.

    A subclass gives the update rule (`rule`, a `mpiasgd.optim.rules.UpdateRule`, and where the new weights go:
    `update_target`) and the replies (`send`: WEIGHTS or STOP from the worker's send buffer `outbox[w]`);
    `take_push` is the path of a push, the same for every rule, and `gate` says when a push is answered
    (`ReplyNow`; ssp's `SspGate` holds a worker that runs ahead). Pushes arrive
    in `inbox[w]` (P + B values in wire format `cfg.wire`). `started` holds the workers sent their first
    weights; `cut` and `shard` (S = 1: the whole vector, shard 0) are set by the mode's `rank0` after
    `server_shard`."""

    checkpoints_here = True
    snapshots_here = True

    def __init__(self, r0: Any, params: np.ndarray, buffers: np.ndarray | None = None) -> None:
        super().__init__(r0, params, buffers)
        P, B = params.size, self.buffers.size
        self.P = P
        self.cut, self.shard = ShardCut((0, P), B), 0  # the whole vector; the mode's `rank0` sets a shard's
        self.wire = self.cfg.wire  # (--wire is async's and ssp's: fp32 in easgd)
        self.inbox = {w: Message(P + B, self.wire) for w in self.workers}
        self.outbox = {w: Message(P + B, self.wire) for w in self.workers}
        self.started: set[int] = set()        # workers sent their first weights (--warm-start holds back some)
        self.absent: set[int] = set()         # (simulate --join) workers not in the job yet: started on joining
        self.rejoined: set[int] = set()       # (--respawn) worker ranks a replacement took
        # --servers S > 1: the shards' agreement on the pushes each applies (`place` sets it); S = 1: none
        self.agreement: OneServer | ShardAgreement = OneServer(self)
        self.rule: UpdateRule | None = None   # the mode's update rule (its subclass sets it)
        self.gate: ReplyNow = ReplyNow(self)  # when a push is answered: at once (ssp: `SspGate`, the mode sets it)
        self.decoded: np.ndarray | None = None  # a 16-bit push decoded (float32 (P + B,)); None: fp32, not decoded
        self.pushed_what = "gradient"         # what a push carries, in a reject's message
        self.held_s = dict.fromkeys(self.workers, 0.0)  # ssp: how long the last reply to each worker was held
        self.schedule = Schedule.of(self.cfg)  # the step size now, from the recorder's clock
        # whether the workers wait for this server (the advice)
        self.rec.exchange = ExchangeWatch(self.cfg, spinning=getattr(r0, "server_wait", "backoff") == "spin")
        self.told: dict[int, int] = {}  # (ULFM) deaths each worker was told of (LOST messages: `tell_losses`)
        self.notices: list[tuple[Message, Any, int]] = []  # the LOST sends: (message, request, worker)

    def place(self, cut: ShardCut, shard: int, gate: ReplyNow | None = None) -> None:
        """The mode's `rank0`: this server holds slice `shard` of `cut` (`server_shard`), and with S > 1 takes part
        in the shards' agreement (`mpiasgd.rank0.shard_agreement`); `gate` answers its pushes (None: at once)."""
        self.cut, self.shard = cut, shard
        self.agreement = ShardAgreement(self) if cut.shards > 1 else OneServer(self)
        self.gate = gate or ReplyNow(self)

    # --- workers that die (ULFM) ---
    def survives(self) -> str:
        """The server goes on without a worker that died (async, ssp, easgd; with --servers S > 1 every shard
        drops it, and the shards' next agreement settles its last push: `ShardAgreement.lose`)."""
        return ""

    def lose_worker(self, w: int) -> None:
        """`Role.lose_worker`, the gate lets go of it (ssp: the slowest clock is a survivor's), and (S > 1) the
        shards' agreement settles its last push (`ShardAgreement.lose`)."""
        super().lose_worker(w)
        self.gate.lose(w)
        self.agreement.lose(w)

    def count_lost(self, w: int, step: int) -> None:
        """(S > 1) Push `step` of dead worker `w` reached another shard but not this one (the worker died while
        sending it): counted as that agreement says, with nothing applied (its slice of the push died with the
        worker), so that every shard holds the same pushes: the worker's step and this shard's version
        advance (no samples), and the shard's row says so (applied, staleness 0)."""
        self.last_step[w] = step
        self.counter.advance(0)
        self.rec.lost_push(w, step, self.counter.version)

    def tell_losses(self, w: int) -> None:
        """(the subclass's `send`, before a reply to worker `w`) A LOST message for each worker dropped since `w`'s
        last reply (step = the dead worker's rank, version = its number among the notices), so that `w` deals
        itself a share of their data and test slices (`WorkerLoop.on_lost`), and one with flag JOINED for each
        replacement that took a dropped rank (--respawn: `w` gives that share back). The header-only sends are not
        waited for."""
        told = self.told.get(w, 0)
        if told == len(self.notice_order) or self.shard:  # (S > 1: rank 0 tells them; the other shards do not)
            return
        self.notices = [(m, r, d) for m, r, d in self.notices if d not in self.lost and not r.Test()]
        for k in range(told, len(self.notice_order)):
            rank, flags = self.notice_order[k]
            msg = Message(0).stamp(Tag.LOST, self.rank, step=rank, version=k + 1, flags=flags)
            self.notices.append((msg, self.comm.Isend(msg.buf, dest=w, tag=int(Tag.LOST)), w))
        self.told[w] = len(self.notice_order)

    # --- what the subclass gives ---
    def send(self, w: int, tag: Tag, step: int, initial: bool = False) -> None:
        """Post WEIGHTS or STOP (this slice, and shard 0's buffers) answering step `step` to worker `w`."""
        raise NotImplementedError

    def update_target(self, w: int) -> np.ndarray:
        """(before an update) The float32 (P,) vector the new weights are written into for worker `w`'s push
        (its send buffer, once its previous send completed, or `params` itself: in place)."""
        raise NotImplementedError

    def velocity(self) -> np.ndarray | None:
        """The optimizer's velocity on this slice (float32 (P,)) that checkpoints hold; None: none (zeros)."""
        return None

    # --- the loop's questions ---
    def handlers(self) -> dict:
        if self.cut.shards == 1:
            return {Tag.PUSH: self.on_push, Tag.EVAL: self.on_eval}
        if self.shard == 0:  # --servers: rank 0 also takes the EVALs
            return {Tag.PUSH: self.on_push, Tag.FINISH: self.agreement.on_finish, Tag.EVAL: self.on_eval}
        return {Tag.PUSH: self.on_push, Tag.FINISH: self.agreement.on_finish}

    def buffer_for(self, tag: Tag, source: int) -> Message | None:
        return self.inbox[source] if tag == Tag.PUSH else None

    def whose(self, tag: Tag) -> str:
        if self.cut.shards == 1 or tag != Tag.PUSH:
            return ""
        a, b = self.cut.slice(self.shard)
        tail = f" and the {self.buffers.size} layer buffers" if self.buffers.size else ""
        return f" for parameter-server shard {self.shard} of {self.cut.shards} (parameters [{a:,}, {b:,}){tail})"

    def waits_for_rank0(self, w: int) -> bool:
        return w not in self.started or self.agreement.waiting(w) or self.gate.holding(w)

    def state(self, reason: str) -> checkpoint.Checkpoint:
        """The training state now: rank 0 holds all of it (--servers S > 1: it asks the other shards for their
        slices, `mpiasgd.rank0.shard_hub.ShardHub.assemble`)."""
        velocity = self.velocity()
        params, momentum = self.params, np.zeros_like(self.params) if velocity is None else velocity
        versions = None
        if self.cut.shards > 1:
            params, momentum, versions = self.r0.link.assemble(params, momentum)
        return self.rec.checkpoint(params, momentum, reason,
                                   {w: (self.last_step[w], self.cursor[w]) for w in self.workers},
                                   self.rec.train_time(), self.current_buffers(), versions)

    def encode_reply(self, values: np.ndarray, out: np.ndarray, w: int, tag: Tag, step: int, what: str,
                     initial: bool = False) -> None:
        """Encode float32 `values` (the weights or buffers of a reply to worker `w`, answering `step`) into `out`,
        the reply's payload, in wire format `cfg.wire`. fp16: measured in the same pass (`wire.encode_peak`);
        BeyondWireRange before the reply goes out when a value's magnitude reaches 65520 (it would arrive as
        inf, and every worker compute NaN on it): the run stops, naming the `what` (e.g. "weight"), the value,
        fp16's range and --wire bf16."""
        largest = encode_peak(self.wire, values, out)
        if beyond_range(self.wire, largest):
            reply = f"initial {tag.name}" if initial else f"{tag.name} reply"
            raise BeyondWireRange(
                f"{self.rec.who}: {reply} to worker rank {w} (step {step}, version {self.counter.version}): a {what} "
                f"of magnitude {largest:.6g} is beyond fp16's range {RANGE} (--wire fp16): it would travel as inf and "
                f"the worker compute NaN; {WIRE_ADVICE}" + ("" if initial else " or lower --lr"))

    # --- a push and its answer ---
    def on_push(self, w: int, msg: Message) -> None:
        """A PUSH from worker `w`, checked (`check_push`), then processed (`take_push`); with S > 1 shards, one
        that arrives after the stop but before the shards agreed which pushes every shard applies waits in its
        inbox (`agreement`: the worker sends nothing else before this push is answered)."""
        self.check_push(w, msg)
        if self.agreement.holds(w, int(msg.header["step"])):
            self.agreement.defer(w)
            return
        t = time.perf_counter()
        self.take_push(w, msg)
        self.rec.exchange.served(time.perf_counter() - t)

    def take_push(self, w: int, msg: Message) -> None:
        """A checked push of worker `w`: decoded (`--wire`), checked to be finite, applied by the rule unless it
        comes after the stop (S > 1: unless the shards agreed to apply it, `admits`), logged in one row, and
        answered (`answer`); a push that is not finite is rejected (`Recorder.reject`: --max-rejects)."""
        rec, h = self.rec, msg.header
        step, base, flags = int(h["step"]), int(h["version"]), int(h["flags"])
        self.last_step[w], staleness = step, self.counter.version - base
        rec.count_wire(pushed=msg.buf.nbytes)
        push, beyond = self.decode_push(w, msg, staleness)
        update = None if push is None or not self.agreement.admits(step, w) else self.rule.apply(
            push, self.schedule(rec.epoch, rec.fraction_done()), self.update_target(w))
        applied = update is not None and update.params is not None
        rejected = push is None or (not applied and update is not None)  # (not finite, or the rule refused it)
        if applied:
            self.adopt(w, update, msg)
        if applied or rejected:
            self.cursor[w] = int(h["cursor"])
        rec.push_taken(w, h, base_version=base, staleness=staleness, applied=applied, rejected=rejected,
                       lr=update.lr if applied else self.unapplied_lr(h), norm=update.norm if applied else 0.0,
                       held_s=self.held_s[w])
        if flags & Flag.PREEMPT:  # a signal on the worker: stop after this push (S > 1: as rank 0 did)
            self.r0.signal_from(f"a signal received by worker rank {w}")
        if rejected:  # may stop the run (--max-rejects)
            rec.reject(w, step, "accumulated update" if flags & Flag.DELTA else self.pushed_what,
                       update.refused if update is not None else "", beyond)
        self.held_s[w] = 0.0
        self.answer(w, step)

    def adopt(self, w: int, update: Update, msg: Message) -> None:
        """An applied push of worker `w`: its update's weights (the mean the STOPs carry, after every applied push,
        is the final snapshot's), the next version (`clock`) and the layers' buffers it carried."""
        self.params = update.params
        self.counter.advance(int(msg.header["samples"]))
        self.take_buffers(w, (msg.payload if self.decoded is None else self.decoded)[self.P:])

    def decode_push(self, w: int, msg: Message, staleness: int) -> tuple[Push | None, float]:
        """(the push as the rule takes it, or None when a value is not finite; the largest magnitude of a
        --wire fp16 push whose values left its range, 0 otherwise)."""
        h = msg.header
        values = msg.payload if self.decoded is None else decode(self.wire, msg.payload, self.decoded)  # (P + B,)
        grad = values[:self.P]
        # S > 1: flag NONFINITE, the worker found a value that is not finite in its whole push, maybe in another
        # shard's slice: rejected alike on every shard. --wire fp16: a value beyond its range arrived as inf; the
        # worker's largest magnitude (header peak) names it
        flagged = bool(int(h["flags"]) & Flag.NONFINITE)
        finite, square = (False, 0.0) if flagged else finite_square(grad)
        if not finite:
            return None, float(h["peak"]) if beyond_range(self.wire, float(h["peak"])) else 0.0
        delta = bool(int(h["flags"]) & Flag.DELTA)
        return Push(grad, square, staleness, delta=delta, lr=float(h["lr"]), pulled=self.pulled(w), worker=w), 0.0

    def pulled(self, w: int) -> np.ndarray | None:
        """The weights worker `w` computed its push on (float32 (P,)) where the rule needs them (DC-ASGD), else
        None."""
        return None

    def unapplied_lr(self, h: np.void) -> float:
        """The step size a push row logs when the push was not applied: 0 (easgd: the worker's)."""
        return 0.0

    def answer(self, w: int, step: int) -> None:
        """Answer a push as the gate says: at once, or (ssp) once the bound allows."""
        self.gate.answer(w, step)

    @property
    def held(self) -> dict[int, tuple[int, float]]:
        """The workers whose reply the gate holds: {worker: (its clock, held since)}."""
        return self.gate.held

    def reply(self, w: int, step: int) -> None:
        """Answer push `step` of worker `w`: WEIGHTS, or STOP once a stopping rule fired (S > 1: once this shard
        has settled, `ShardAgreement.answer_finishing`); nothing to a worker that died (S > 1: a push of it the
        shards agreed to apply)."""
        if w in self.lost:
            return
        if self.rec.stop_reason and not self.settled():
            self.agreement.owe_stop(w)
        elif self.rec.stop_reason:
            self.stopped.add(w)
            self.periodic.withdraw(w)  # an evaluation it was still to be asked for goes without it
            self.send(w, Tag.STOP, step)
        else:
            self.send(w, Tag.WEIGHTS, step)

    def settled(self) -> bool:
        """The run has stopped and this shard's weights are final: with S = 1 at once; with S > 1 once the
        shards agreed and every push up to each worker's final step was processed here (`agreement`)."""
        return self.agreement.settled()
