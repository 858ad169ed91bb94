"""The learning-rate schedule, the stopping rule, and the cadences of the evaluations during training
and of the weight snapshots: one of each, used by every mode.

Both are plain values built from the run's config (`Schedule.of(cfg)`, `StopRule.of(cfg)` take
any object with the fields' names), so the optimizer side never sees the whole config. Rank 0
(async, ssp, easgd), the sync workers and the pipeline's module 0 judge the same rule on their
own counts:

    samples   images in applied updates (async: pushes applied; sync: steps x workers x batch;
              pipeline: minibatches per replica x replicas x batch)
    steps     updates: pushes applied (async, ssp), exchanges (easgd), steps (sync), minibatches per
              replica (pipeline); `--max-pushes` counts them
    seconds   training time (`--max-time`), on the judging rank's clock
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

AUTO_SNAPSHOTS = -1.0       # --snapshot-interval's default: the interval follows the model's size
SNAPSHOT_FLOOR_S = 5.0      # auto: never more often than this, seconds (a small model: as before the rule)
SNAPSHOT_BYTES_PER_S = 1e6  # auto: at most this many bytes of weights per second into the run log


def _pick(cls: type, source: Any) -> Any:
    return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class StopRule:
    """The run stops at the first limit reached: `epochs` passes over the training set by all workers
    together, `max_pushes` updates, `max_time` seconds of training (0 = no such limit)."""

    epochs: float = 0.0
    max_pushes: int = 0
    max_time: float = 0.0

    @classmethod
    def of(cls, source: Any) -> StopRule:
        return _pick(cls, source)

    def reason(self, samples: int, num_train: int, steps: int, seconds: float) -> str:
        """Why the run stops after `samples` images of a `num_train`-image training set, `steps`
        updates and `seconds` of training: "" while no limit is reached, else e.g.
        "epochs: 2.00 >= 2" (the first limit checked in the order epochs, max_pushes, max_time)."""
        if self.epochs and samples >= self.epochs * num_train:
            return f"epochs: {samples / num_train:.2f} >= {self.epochs:g}"
        if self.max_pushes and steps >= self.max_pushes:
            return f"max_pushes: {steps} >= {self.max_pushes}"
        if self.max_time and seconds >= self.max_time:
            return f"max_time: {seconds:.1f} s >= {self.max_time:g} s"
        return ""

    def fraction(self, epochs_done: float, steps: int, seconds: float) -> float:
        return fraction_done(self, epochs_done, steps, seconds)


def fraction_done(rule: Any, epochs_done: float, steps: int, elapsed: float) -> float:
    """Fraction of the run done, in [0, 1], by the stopping rule closest to its limit: `epochs_done`
    epochs, `steps` updates (pushes, sync steps or pipeline minibatches), `elapsed` seconds.
    `rule` is a StopRule (or anything with its fields)."""
    parts = [0.0]
    if rule.epochs:
        parts.append(epochs_done / rule.epochs)
    if rule.max_pushes:
        parts.append(steps / rule.max_pushes)
    if rule.max_time:
        parts.append(elapsed / rule.max_time)
    return min(1.0, max(parts))


@dataclass(frozen=True)
class Schedule:
    """Step size: linear warm-up from 0 to `lr` over `warmup_epochs` (Goyal et al. 2017), then
    `lr_schedule` constant, step (times `lr_gamma` at each epoch in `lr_milestones`) or cosine
    (Loshchilov and Hutter 2017: lr/2 * (1 + cos(pi * t)), t the fraction of the run done by the
    stopping rule closest to its limit)."""

    lr: float = 0.01
    warmup_epochs: float = 0.0
    lr_schedule: str = "constant"
    lr_milestones: tuple = ()
    lr_gamma: float = 0.1

    @classmethod
    def of(cls, source: Any, minibatches: int = 1) -> Schedule:
        """The schedule of config `source`; `minibatches` is how many workers' minibatches one update averages
        (sync: the workers; the pipeline: its replicas; the asynchronous modes and easgd: 1). With
        `source.lr_scaling` "linear" the peak step size is `source.lr * minibatches`: the linear scaling rule
        of Goyal et al. 2017 (arXiv 1706.02677, section 2.1: a k times larger minibatch, a k times larger
        step size, with warm-up), `--lr` being the step size of one worker's minibatch."""
        schedule = _pick(cls, source)
        if getattr(source, "lr_scaling", "none") == "linear" and minibatches != 1:
            schedule = dataclasses.replace(schedule, lr=source.lr * minibatches)
        return schedule

    def __call__(self, epoch: float, progress: float) -> float:
        return learning_rate(self, epoch, progress)


def learning_rate(schedule: Any, epoch: float, progress: float) -> float:
    """Step size after `epoch` epochs of training, `progress` in [0, 1] the fraction of the run done;
    `schedule` is a Schedule (or anything with its fields). See `Schedule`."""
    s = schedule
    if s.warmup_epochs > 0 and epoch < s.warmup_epochs:
        return s.lr * epoch / s.warmup_epochs
    if s.lr_schedule == "step":
        return s.lr * s.lr_gamma ** sum(epoch >= m for m in s.lr_milestones)
    if s.lr_schedule == "cosine":
        return 0.5 * s.lr * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return s.lr


def snapshot_seconds(interval: float, num_values: int) -> float:
    """Seconds between weight snapshots for `--snapshot-interval` = `interval` and a model of `num_values`
    float32 values (its parameters and buffers): `interval` itself when >= 0 (0: first and last only), or
    for AUTO_SNAPSHOTS (-1, the default) max(5 s, model bytes / 1 MB/s), so a large model is not
    written every 5 s: AlexNet's 61 M parameters (244 MB) every 244 s instead of 49 MB/s into the log,
    while a model under 5 MB keeps 5 s."""
    if interval >= 0:
        return interval
    return max(SNAPSHOT_FLOOR_S, 4 * num_values / SNAPSHOT_BYTES_PER_S)


@dataclass
class EvalSchedule:
    """When the evaluations during training are due (--eval-interval): every `every` seconds of training
    (`unit` "s") or epochs ("ep"); never when `every` is 0. The k-th is due once the clock reaches
    k * every (a clock that jumps past several multiples gives one evaluation, at the first check past
    them), so ranks that judge the same clock and epochs (the sync workers: the allreduced clock and the
    step count) decide alike. `start(seconds, epochs)` places a resumed run after its last multiple.
    """

    every: float = 0.0
    unit: str = ""
    next: float = field(default=0.0)

    @classmethod
    def of(cls, cfg: Any, seconds: float = 0.0, epochs: float = 0.0) -> EvalSchedule:
        """The schedule of `cfg.eval_every()`, started at `seconds` of training and `epochs` done."""
        every, unit = cfg.eval_every()
        schedule = cls(every, unit)
        schedule.start(seconds, epochs)
        return schedule

    def _clock(self, seconds: float, epochs: float) -> float:
        return seconds if self.unit == "s" else epochs

    def _after(self, value: float) -> float:
        """The first multiple of `every` past `value` (a value within 1e-9 relative of a multiple is on it)."""
        return (math.floor(value / self.every * (1 + 1e-9)) + 1) * self.every

    def start(self, seconds: float, epochs: float) -> None:
        if self.every:
            self.next = self._after(self._clock(seconds, epochs))

    def due(self, seconds: float, epochs: float) -> bool:
        """True once the clock (`seconds` of training, or `epochs` done) has reached the next multiple; the
        one after the clock becomes the next."""
        if not self.every:
            return False
        value = self._clock(seconds, epochs)
        if value * (1 + 1e-9) < self.next:
            return False
        self.next = self._after(value)
        return True
