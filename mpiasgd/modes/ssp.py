"""`--mode ssp`: stale synchronous parallel (Ho et al. 2013) on the parameter server of `--mode async`.

A worker's clock is the number of pushes it has made; the reply to a push that leaves its worker
more than `--staleness-bound` s clocks ahead of the slowest running worker is held until the
slowest catches up, so no worker computes step c + 1 before every other has pushed step c - s.
s = 0 is lockstep (BSP). The time each reply was held is logged (pushes table, `held_s`, on the
worker's next push). The workers are those of `--mode async`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpiasgd.config import Config
from mpiasgd.modes.asgd import AsgdMode, AsgdServer
from mpiasgd.modes.base import need


class SspServer(AsgdServer):
    """(rank 0) The parameter server with the SSP gate on its replies."""

    def __init__(self, r0: Any, params: np.ndarray, decay_mask: np.ndarray, lr_scale: np.ndarray | None = None,
                 buffers: np.ndarray | None = None) -> None:
        super().__init__(r0, params, decay_mask, lr_scale, buffers)
        self.held: dict[int, tuple[int, float]] = {}  # worker -> (step answered, time held since)
        self.clock_offset = dict.fromkeys(self.workers, 0)  # the slowest clock when a late starter began

    def clock(self, w: int) -> int:
        """The clock of worker `w`: the pushes it has made (plus the slowest clock when it started late)."""
        return self.last_step[w] + self.clock_offset[w]

    def slowest_clock(self) -> int:
        """The slowest clock of the workers that are running (started and not stopped)."""
        running = [self.clock(w) for w in self.workers if w in self.started and w not in self.stopped]
        return min(running, default=0)

    def on_start(self, workers: list[int]) -> None:
        slowest = self.slowest_clock()  # a warm-started worker is not held back by late starters
        for w in workers:
            self.clock_offset[w] = slowest

    def waits_for_rank0(self, w: int) -> bool:
        return super().waits_for_rank0(w) or w in self.held

    def answer(self, w: int, step: int) -> None:
        if not self.rec.stop_reason and self.clock(w) - self.slowest_clock() > self.cfg.staleness_bound:
            self.held[w] = (self.clock(w), self.rec.now())  # answered when the slowest worker catches up
        else:
            self.reply(w, step)
        self.release()

    def tick(self) -> None:
        super().tick()
        self.release()  # a stop answers every held push

    def release(self) -> None:
        """Answer every held push that the bound now allows (all of them once the run stops)."""
        if not self.held:
            return
        slowest = self.slowest_clock()
        for w, (clock, since) in list(self.held.items()):
            if self.rec.stop_reason or clock - slowest <= self.cfg.staleness_bound:
                del self.held[w]
                self.held_s[w] = self.rec.now() - since
                self.rec.held_total[w] += self.held_s[w]
                self.reply(w, self.last_step[w])


class SspMode(AsgdMode):
    name = "ssp"

    def check_config(self, cfg: Config) -> None:
        super().check_config(cfg)
        need(cfg.staleness_bound >= 0, cfg, "staleness_bound", "an integer >= 0")

    server = SspServer


MODE = SspMode()
