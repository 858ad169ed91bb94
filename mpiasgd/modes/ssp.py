"""`--mode ssp`: stale synchronous parallel (Ho et al. 2013) on the parameter server of `--mode async`.

A worker's clock is the number of pushes it has made; the reply to a push that leaves its worker
more than `--staleness-bound` s clocks ahead of the slowest running worker is held until the
slowest catches up, so no worker computes step c + 1 before every other has pushed step c - s. A worker
that died under ULFM counts no more (`SspGate.lose`): the slowest clock is a survivor's.
s = 0 is lockstep (BSP). The time each reply was held is logged (pushes table, `held_s`, on the
worker's next push). The server and the workers are those of `--mode async`; the server's `gate` is an
`SspGate` instead of answering every push at once.
"""

from __future__ import annotations

from mpiasgd.config import Config
from mpiasgd.modes.asgd import AsgdMode, AsgdServer
from mpiasgd.modes.base import need


class SspGate:
    """(rank 0, or each parameter-server shard) When `server` answers a push: at once while the worker is at most
    `bound` clocks ahead of the slowest running worker, else once the slowest catches up (`release`). The
    methods are those of `mpiasgd.rank0.server.ReplyNow`, which the server calls."""

    def __init__(self, server: AsgdServer, bound: int) -> None:
        self.server, self.bound = server, bound
        self.held: dict[int, tuple[int, float]] = {}  # worker -> (step answered, time held since)
        self.clock_offset = dict.fromkeys(server.workers, 0)  # the slowest clock when a late starter began

    def clock(self, w: int) -> int:
        """The clock of worker `w`: the pushes it has made (plus the slowest clock when it started late)."""
        return self.server.last_step[w] + self.clock_offset[w]

    def slowest_clock(self, but: list[int] = ()) -> int:
        """The slowest clock of the workers that are running (started and not stopped), those in `but` aside."""
        s = self.server
        running = [self.clock(w) for w in s.workers
                   if w in s.started and w not in s.stopped and w not in s.lost and w not in but]
        return min(running, default=0)

    def on_start(self, workers: list[int]) -> None:
        slowest = self.slowest_clock(but=workers)  # a warm-started worker is not held back by late starters
        for w in workers:  # (--respawn: a replacement continues its rank's step count; its clock starts at slowest)
            self.clock_offset[w] = slowest - (self.server.last_step[w] if w in self.server.rejoined else 0)

    def holding(self, w: int) -> bool:
        return w in self.held

    def answer(self, w: int, step: int) -> None:
        s = self.server
        if not s.rec.stop_reason and self.clock(w) - self.slowest_clock() > self.bound:
            self.held[w] = (self.clock(w), s.rec.now())  # answered when the slowest worker catches up
        else:
            s.reply(w, step)
        self.release()

    def tick(self) -> None:
        self.release()  # a stop answers every held push

    def lose(self, w: int) -> None:
        self.held.pop(w, None)  # (its reply is not sent: it died)
        self.release()  # the slowest clock may now be a faster survivor's

    def release(self) -> None:
        """Answer every held push that the bound now allows (all of them once the run stops)."""
        if not self.held:
            return
        s = self.server
        slowest = self.slowest_clock()
        for w, (clock, since) in list(self.held.items()):
            if s.rec.stop_reason or clock - slowest <= self.bound:
                del self.held[w]
                s.held_s[w] = s.rec.now() - since
                s.rec.held_total[w] += s.held_s[w]
                s.reply(w, s.last_step[w])


class SspMode(AsgdMode):
    name = "ssp"

    def check_config(self, cfg: Config) -> None:
        super().check_config(cfg)
        need(cfg.staleness_bound >= 0, cfg, "staleness_bound", "an integer >= 0")

    def gate(self, server: AsgdServer) -> SspGate:
        return SspGate(server, server.cfg.staleness_bound)


MODE = SspMode()
