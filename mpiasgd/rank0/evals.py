"""Rank 0's side of the evaluations during training (--eval-interval) that the workers make.

async, ssp, easgd (rank 0 decides): once the schedule (`optim.EvalSchedule`, on rank 0's training clock
and epochs) says an evaluation is due, every running worker is asked (`ask`); its next WEIGHTS reply
carries flag EVALUATE and the evaluation's number (`flag`), and the worker answers with an EVAL of that
number (flag EVALUATE) before its next push. An evaluation due while the previous one is still open
waits for it (the schedule then skips the multiples it passed).

sync (the workers decide alike, on the allreduced clock and their step count): the first EVAL of the
next number opens the evaluation for every worker (`answer`); all of them must report the same step.

An evaluation is logged (`Recorder.periodic_eval`) once every worker it waits for has answered. A worker
sent STOP before its flagged reply is not waited for (`withdraw`); an evaluation that then misses a
slice of the test set, or that a worker abandoned (flag PREEMPT: a signal reached it, or the run ended
meanwhile), is not logged: an event "evaluation" says why.

What they cost (`EvalShare`, every mode, the pipeline's evaluations on rank 0 too): a worker trains on while
it does not evaluate, so evaluations that take most of the wall time cut the images per second by as much
(25 evaluations of 10,000 images in a 400-push run: 3,385 -> 289 images/s). Once the evaluations logged in
this job have taken more than EVAL_SHARE_WARN of its training time (the slowest evaluator's seconds each;
judged from EVAL_SHARE_AFTER_S training seconds on), rank 0 warns once (stderr and an event "warning"), with
the share and what to change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpiasgd.comms import Flag, ProtocolError
from mpiasgd.config import Config
from mpiasgd.optim import EvalSchedule

EVAL_SHARE_WARN = 0.25  # evaluations during training taking more than this share of the training time: warned
EVAL_SHARE_AFTER_S = 2.0  # training seconds of this job before the share is judged (start-up makes it noise)


class EvalShare:
    """(rank 0) The share of this job's training time that its evaluations during training took, and the one
    warning when it passes EVAL_SHARE_WARN (module docstring). `interval` is --eval-interval as given."""

    def __init__(self, interval: str) -> None:
        self.interval = interval
        self.seconds = 0.0   # the evaluations' seconds so far (each: its slowest evaluator's)
        self.count = 0       # evaluations logged
        self.warned = False

    def add(self, seconds: float, elapsed: float) -> str:
        """One evaluation logged that took `seconds`, at `elapsed` training seconds of this job (a resumed run's
        from its resume): the warning's text the first time the share passes EVAL_SHARE_WARN, else ""."""
        self.seconds += max(0.0, seconds)
        self.count += 1
        if self.warned or elapsed < EVAL_SHARE_AFTER_S or self.seconds <= EVAL_SHARE_WARN * elapsed:
            return ""
        self.warned = True
        share = min(1.0, self.seconds / elapsed)
        return (f"evaluation during training took {100 * share:.0f} % of the training time so far ({self.count} "
                f"evaluation{'s' * (self.count != 1)}: {self.seconds:.1f} s of {elapsed:.1f} s; warned above "
                f"{100 * EVAL_SHARE_WARN:.0f} %): evaluate less often with a larger --eval-interval (now "
                f"{self.interval})")


@dataclass
class Round:
    """One evaluation during training: the workers it still waits for, those not yet told (their flagged
    reply is still to go out), the version and images trained on of the weights each one evaluates, and
    the answers: (loss sum, correct, top-5 correct, images, seconds, log time the weights were taken)."""

    number: int
    waiting: set[int]
    asked: set[int] = field(default_factory=set)
    versions: dict[int, int] = field(default_factory=dict)
    samples: dict[int, float] = field(default_factory=dict)
    answers: list[tuple] = field(default_factory=list)
    missing: str = ""  # why the evaluation misses a slice ("" while it does not)


class PeriodicEvals:
    """(rank 0) The evaluations during training of one run: see the module docstring.

    `rec` is the recorder (clocks, figures, the log), `cfg` gives --eval-interval, `workers` the worker
    ranks. `decided_by_workers` (sync): evaluations open with their first answer, for every worker, and
    `samples_at(version)` gives the images trained on at a version. `snapshot_of(version)` is the index of
    a snapshot of the same weights (-1: none).
    """

    def __init__(self, rec: Any, cfg: Config, workers: Any, decided_by_workers: bool = False,
                 samples_at: Callable[[int], float] | None = None,
                 snapshot_of: Callable[[int], int] | None = None) -> None:
        self.rec, self.cfg, self.workers = rec, cfg, list(workers)
        self.decided_by_workers = decided_by_workers
        self.samples_at = samples_at or (lambda version: float(rec.samples))
        self.snapshot_of = snapshot_of or (lambda version: -1)
        self.on = bool(cfg.eval_every()[0])
        self.schedule: EvalSchedule | None = None  # made at the first check (a resume's checkpoint is known then)
        self.rounds: dict[int, Round] = {}
        self.number = 0  # the last evaluation opened

    # --- rank 0 decides (async, ssp, easgd) ---
    def due(self) -> bool:
        """An evaluation is due now: the schedule says so, the run has not stopped, and none is open."""
        if not self.on or self.rec.stop_reason or self.rounds:
            return False
        if self.schedule is None:  # from where training (re)started: the checkpoint a resumed run continues
            ck = self.rec.resumed
            self.schedule = (EvalSchedule.of(self.cfg) if ck is None else
                             EvalSchedule.of(self.cfg, ck.elapsed, ck.samples / self.rec.num_train))
        return self.schedule.due(self.rec.train_time(), self.rec.epoch)

    def ask(self, workers: list[int]) -> None:
        """Open the next evaluation for `workers` (those running; a lost one is left out): each is told with its
        next WEIGHTS."""
        workers = [w for w in workers if w in self.workers]
        if not workers:
            return
        self.number += 1
        self.rounds[self.number] = Round(self.number, set(workers), asked=set(workers))

    def flag(self, w: int, version: int) -> int:
        """The number of the evaluation worker `w`'s WEIGHTS reply, now going out with the weights of
        `version`, must ask for (0: none)."""
        for rnd in self.rounds.values():
            if w in rnd.asked:
                rnd.asked.discard(w)
                rnd.versions[w] = version
                rnd.samples[w] = float(self.rec.samples)
                return rnd.number
        return 0

    def withdraw(self, w: int) -> None:
        """Worker `w` is sent STOP: an evaluation it was asked for and not yet told of goes without it."""
        for rnd in list(self.rounds.values()):
            if w in rnd.asked:
                rnd.asked.discard(w)
                rnd.waiting.discard(w)
                rnd.missing = rnd.missing or f"worker rank {w} was stopped before it evaluated"
                if not rnd.waiting:
                    self.close(rnd)

    def lose(self, w: int) -> None:
        """Worker `w` died: it is asked for nothing more, and an open evaluation goes without its share."""
        self.workers = [v for v in self.workers if v != w]
        for rnd in list(self.rounds.values()):
            if w in rnd.waiting or w in rnd.asked:
                rnd.asked.discard(w)
                rnd.waiting.discard(w)
                rnd.missing = rnd.missing or f"worker rank {w} died before it answered"
                if not rnd.waiting:
                    self.close(rnd)

    def rejoin(self, w: int) -> None:
        """(--respawn) Worker rank `w`, lost, is back (a replacement): asked again from the next evaluation on."""
        self.workers = sorted({*self.workers, w})

    # --- answers ---
    def answer(self, w: int, h: np.void) -> None:
        """A periodic EVAL (flag EVALUATE) from worker `w`, header `h`: step = the evaluation's number,
        version, samples = images, correct, correct5, loss = summed loss, compute_s = seconds; flag PREEMPT:
        abandoned.
        ProtocolError for a number `w` was not asked for (or answered already), or (sync) for a step
        other than the other workers'."""
        number, version = int(h["step"]), int(h["version"])
        rnd = self.rounds.get(number)
        if rnd is None and self.decided_by_workers and number == self.number + 1:
            self.number = number
            rnd = self.rounds[number] = Round(number, set(self.workers))
        if rnd is None or w not in rnd.waiting or w in rnd.asked:
            if self.decided_by_workers:
                why = f"expected number {self.number + 1}, or an open one it has not answered"
            elif rnd is not None and w in rnd.versions:
                why = "it answered it already"
            else:
                why = "it was not asked for it"
            raise ProtocolError(f"rank 0: EVAL (evaluation during training) number {number} from worker rank {w}: "
                                f"{why}")
        if self.decided_by_workers:
            if rnd.versions and version != next(iter(rnd.versions.values())):
                first, seen = next(iter(rnd.versions.items()))
                raise ProtocolError(f"rank 0: worker rank {w} evaluated step {version} for evaluation {number}, "
                                    f"worker rank {first} step {seen}: the replicas must evaluate the same step")
            rnd.versions[w] = version
            rnd.samples[w] = self.samples_at(version)
        rnd.waiting.discard(w)
        count, seconds = int(h["samples"]), float(h["compute_s"])
        if int(h["flags"]) & Flag.PREEMPT:
            rnd.missing = rnd.missing or f"worker rank {w} abandoned it (a signal, or the run ended)"
        rnd.answers.append((float(h["loss"]), int(h["correct"]), int(h["correct5"]), count, seconds,
                            self.rec.now() - seconds))
        if not rnd.waiting:
            self.close(rnd)

    def close(self, rnd: Round) -> None:
        """Every worker of `rnd` answered (or was withdrawn): log it, or say why not."""
        del self.rounds[rnd.number]
        if not rnd.missing and not sum(answer[3] for answer in rnd.answers):
            rnd.missing = "no test images to evaluate"
        if rnd.missing or not rnd.answers:
            self.rec.event("evaluation", f"evaluation {rnd.number} during training not logged: "
                                         f"{rnd.missing or 'no worker evaluated'}")
            return
        loss_sum, correct, correct5, count, seconds, taken = (list(col) for col in zip(*rnd.answers, strict=True))
        answered = [rnd.samples[w] for w in rnd.samples]
        versions = list(rnd.versions.values())
        self.rec.periodic_eval(taken=min(taken), samples=sum(answered) / len(answered),
                               versions=(min(versions), max(versions)), loss_sum=sum(loss_sum), correct=sum(correct),
                               correct5=sum(correct5), count=sum(count), seconds=max(seconds),
                               snapshot=self.snapshot_of(max(versions)) if min(versions) == max(versions) else -1)
