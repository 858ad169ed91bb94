"""The shards' agreement (`--servers S > 1`): every shard applies the same pushes before the stop or a pause.

A parameter server split into S shards (`mpiasgd.rank0.server.ShardedServer` on each slice) must end, and
take an interval checkpoint, at one consistent cut: every shard with the same pushes applied. The messages
that reach the agreement are the links' (`mpiasgd.rank0.shard_hub`: SHARD_STOP, SHARD_PAUSE, SHARD_FINAL);
this module is what a server does with the result:

- after the stop, or in a pause, a push waits in its inbox (`holds`, `defer`) until the shards agree which
  pushes each applies (`settle`: each worker's up to `final[w]`; `admits`);
- once a shard has applied all of them (`settled`) it answers every push, and every FINISH (`on_finish`:
  another shard answered that worker's last push with STOP), with STOP and its final slice
  (`answer_finishing`);
- a pause (`pause`) applies the pushes up to the agreed steps and holds later ones (`paused`: the slice is
  taken now) until `resume`.

A worker that dies (ULFM: `lose`) may have sent its last push to some shards only (its process ends in the
middle of the S sends). Each shard drops it when it learns of the death itself and processes nothing from it
after that (a push it held in its inbox beyond the agreed steps is dropped too); at the next agreement (the
stop, or a pause) a shard that lacks the dead worker's push up to the agreed step counts it (`count_lost`:
its version and the worker's step advance, nothing is applied: that push's slice died with the worker). So
every cut still holds the same pushes on every shard; between two agreements the shards' versions may differ
by the one push.

With one server (`OneServer`) none of this runs: a push is applied unless the run has stopped, and the
weights are final at the stop.
"""

from __future__ import annotations

from typing import Any

from mpiasgd.comms import ProtocolError, Tag


class OneServer:
    """The agreement of a single server (S = 1): nothing to agree on. `server` is the ShardedServer."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.final: dict[int, int] | None = None  # (S > 1 only) each worker's last step every shard applies
        self.pausing = False

    def holds(self, w: int, step: int) -> bool:
        """Push `step` of worker `w` waits in its inbox: never with one server."""
        return False

    def defer(self, w: int) -> None:
        raise ProtocolError(f"rank {self.server.rank}: a push of worker rank {w} deferred with one server")

    def admits(self, step: int, w: int) -> bool:
        """A finite push is applied until the run stops."""
        return not self.server.rec.stop_reason

    def settled(self) -> bool:
        """The weights are final: at the stop."""
        return bool(self.server.rec.stop_reason)

    def waiting(self, w: int) -> bool:
        """Worker `w` waits for this agreement (deferred, or owed STOP): never with one server."""
        return False

    def owe_stop(self, w: int) -> None:
        raise ProtocolError(f"rank {self.server.rank}: worker rank {w} owed STOP before one server settled")

    def answer_finishing(self) -> None:
        """The workers owed STOP once the shards settle: none with one server."""

    def lose(self, w: int) -> None:
        """Worker `w` died: nothing to agree on with one server."""


class ShardAgreement:
    """(--servers S > 1) The agreement of shard `server.shard` (a ShardedServer): see the module docstring.

    `final` ({worker: step} or None: not agreed yet), `deferred` (workers whose push waits in its inbox, in
    arrival order), `pausing` (an interval checkpoint's pause, `pause` to `resume`) and `finishing` (workers
    owed STOP once this shard has settled)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.final: dict[int, int] | None = None
        self.deferred: list[int] = []
        self.pausing = False
        self.finishing: set[int] = set()

    def where(self) -> str:
        return f"rank {self.server.rank} (parameter-server shard {self.server.shard})"

    # --- a push ---
    def holds(self, w: int, step: int) -> bool:
        """Push `step` of worker `w` waits in its inbox: the shards are agreeing on the pushes each applies (after
        the stop, or in a pause, until `settle`), or (a pause, after it) it is beyond the agreed step and waits
        for `resume`."""
        if self.final is None:
            return self.pausing or bool(self.server.rec.stop_reason)
        return self.pausing and step > self.final[w]

    def defer(self, w: int) -> None:
        """Worker `w`'s push (in its inbox) waits until `holds` is over (`take_deferred`)."""
        self.deferred.append(w)

    def admits(self, step: int, w: int) -> bool:
        """A finite push `step` of worker `w` is applied: before the stop; after it if the shards agreed to apply
        it (in a pause: every push that does not wait, `holds`)."""
        if self.final is None:
            return not self.server.rec.stop_reason
        return step <= self.final[w]

    def take_deferred(self) -> None:
        """Process each held push (in arrival order) that no longer waits (`holds`)."""
        s = self.server
        deferred, self.deferred = self.deferred, []
        for w in deferred:
            if self.holds(w, int(s.inbox[w].header["step"])):
                self.deferred.append(w)
            else:
                s.take_push(w, s.inbox[w])

    # --- the stop ---
    def settle(self, final: dict[int, int]) -> None:
        """(after the stop or in a pause) The shards agreed: every shard applies each worker `w`'s pushes up to
        step `final[w]` and (after the stop) no later one (`mpiasgd.rank0.shard_hub`: the largest step any shard
        had applied when it heard of the stop or pause; a worker has one push in flight, sent to every shard,
        so each of those reaches every shard). The pushes deferred until now are processed (in a pause, later
        ones wait for `resume`); ProtocolError if a final step is behind what this shard has already applied."""
        s = self.server
        behind = {w: (s.last_step[w], step) for w, step in final.items() if step < s.last_step[w]}
        if behind or set(final) != set(s.workers):
            raise ProtocolError(f"{self.where()}: the agreed final steps {final} name other workers than "
                                f"{s.workers} or are behind this shard's applied steps (worker: (applied, final)) "
                                f"{behind}")
        self.final = dict(final)
        self.take_deferred()
        self.count_lost()

    def lose(self, w: int) -> None:
        """(ULFM) Worker `w` died (`ShardedServer.lose_worker`): a push of it held here is dropped unless the shards
        agreed to apply it (its step is at most `final[w]`: every shard applies it or counts it), and a push
        up to the agreed step that will never come is counted (`count_lost`)."""
        s = self.server
        if w in self.deferred and (self.final is None or int(s.inbox[w].header["step"]) > self.final[w]):
            self.deferred.remove(w)
        self.finishing.discard(w)
        self.count_lost()

    def count_lost(self) -> None:
        """Each dead worker's pushes up to its agreed step that did not reach this shard are counted (the server's
        `count_lost`), once its deferred push (if any) was processed: the agreed cut holds them."""
        s = self.server
        if self.final is None:
            return
        for w in s.lost:
            if s.last_step[w] < self.final[w] and w not in self.deferred:
                s.count_lost(w, self.final[w])

    def applied_final(self) -> bool:
        """Every push up to each worker's agreed step was processed here."""
        return self.final is not None and all(self.server.last_step[w] >= step for w, step in self.final.items())

    def settled(self) -> bool:
        """The run has stopped and this shard's weights are final: the shards agreed (`settle`) and every push up
        to each worker's final step was processed here."""
        return (bool(self.server.rec.stop_reason) and not self.pausing and not self.deferred
                and self.applied_final())

    def waiting(self, w: int) -> bool:
        """Worker `w` waits for this agreement: its push is deferred, or it is owed STOP."""
        return w in self.deferred or w in self.finishing

    def owe_stop(self, w: int) -> None:
        """Worker `w`'s push came after the stop: STOP once this shard has settled (`answer_finishing`)."""
        self.finishing.add(w)

    def on_finish(self, w: int, msg: Any) -> None:
        """FINISH from worker `w`: another shard answered its last push with STOP, this one with WEIGHTS.
        Answered with STOP and this shard's final slice now if it has settled, else once it has (the server's
        `tick`, after rank 0's SHARD_STOP and SHARD_FINAL). ProtocolError for a FINISH out of turn."""
        s, step = self.server, int(msg.header["step"])
        if w in s.stopped or w in self.finishing or w not in s.started:
            why = "it was sent STOP" if w in s.stopped else "its FINISH" if w in self.finishing else \
                "before its first weights"
            raise ProtocolError(f"{self.where()}: FINISH step {step} from worker rank {w} after {why}")
        if step != s.last_step[w]:
            raise ProtocolError(f"{self.where()}: FINISH from worker rank {w} has step {step}, expected "
                                f"{s.last_step[w]} (its last push, answered with WEIGHTS)")
        self.finishing.add(w)
        self.answer_finishing()  # at once if this shard has stopped

    def answer_finishing(self) -> None:
        """Once this shard has settled: STOP, with its final slice, to each worker owed one (it sent FINISH, or its
        push was processed after the stop). Called by the server's `tick`."""
        s = self.server
        self.finishing -= s.lost
        if self.finishing and self.settled():
            for w in sorted(self.finishing):
                s.stopped.add(w)
                s.periodic.withdraw(w)
                s.send(w, Tag.STOP, s.last_step[w])
            self.finishing.clear()

    # --- an interval checkpoint: a pause ---
    def pause(self) -> None:
        """An interval checkpoint is due: hold every push until the shards agree on the pushes each applies
        (`settle`, as after the stop); then apply those and hold later ones until `resume`, so that every shard's
        slice (`paused`) holds the same pushes. ProtocolError when a pause or the stop's agreement is already
        under way."""
        if self.pausing or self.final is not None:
            raise ProtocolError(f"{self.where()}: a pause while "
                                + ("another is under way" if self.pausing else "the shards stop"))
        self.pausing = True

    def paused(self) -> bool:
        """The pause's slice is ready: the shards agreed and every push up to each worker's agreed step was
        processed here."""
        return self.pausing and self.applied_final()

    def resume(self) -> None:
        """After the pause's slice was taken: the held pushes are processed (after the stop, the server holds them
        again until the stop's agreement)."""
        if not self.paused():
            raise ProtocolError(f"{self.where()}: resumed before the pause's pushes were applied")
        self.pausing, self.final = False, None
        self.take_deferred()
