"""The parameter server's update rules: what a push does to the weights, with nothing of MPI, the wire or the log.

The server (`mpiasgd.rank0.server.ShardedServer.take_push`) decodes and checks a push, hands it to its mode's
rule as a `Push`, and logs the `Update` the rule returns. A rule is an object with one method (as ps-lite's
`KVServerDefaultHandle` is for a key-value server):

    rule.apply(push, step_size, out) -> Update

`push.values` is float32 (P,) and finite; `step_size` is the schedule's learning rate now (warm-up, decay);
`out` is a float32 (P,) buffer the new weights may be written into instead of in place (the worker's reply
buffer: a reply then costs no copy); `Update.params` is the vector that holds the new weights. The rules:

    AsyncRule         GPU A-SGD / Downpour (Paine et al. 2013, arXiv 1312.6186; Dean et al. 2012): the SGD
                      step with the gradient scaled by the staleness factor f(s) (`staleness_factor`; Zhang et
                      al. 2016), or with nsync > 1 the worker's accumulated update added, scaled by f(s)
    DelayCompensated  DC-ASGD (Zheng et al. 2017, arXiv 1609.08326): the gradient corrected for the weights'
                      move since the worker's pull, g + lambda g*g (w - w_pulled), then another rule
    GapPenalized      Gap-Aware (Barkai et al. 2020, arXiv 1909.10802): the gradient divided per weight by how far
                      the weight moved since the worker's pull, in typical steps, then another rule (`--gap-aware`)
    DanaZero          DANA-Zero (Hakimi et al. 2019, arXiv 1907.11612): one momentum per worker, and replies
                      that look ahead along their sum (`--update-rule dana-zero`)
    ElasticRule       EASGD's center (Zhang, Choromanska and LeCun 2015, arXiv 1412.6651, eq. 5-6):
                      x~ <- x~ + alpha (x_i - x~)

Which replies a push gets, and when, is the server's (ssp holds them; `--lookahead` sends the weights K
momentum-only updates ahead: `mpiasgd.optim.delay.LookAhead`), not the rule's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mpiasgd.optim.delay import DelayCompensation, GapAware
from mpiasgd.optim.sgd import SGD, apply_delta, finite_square, staleness_factor


@dataclass
class Push:
    """A decoded, checked push as a rule sees it. `values`: float32 (P,), finite: a gradient, an accumulated
    update (`delta`, nsync > 1, already scaled by the worker's step size `lr`), or (easgd) the worker's weights
    x_i; a rule may change them in place. `square`: the sum of squares of `values`. `staleness`: the server's
    version minus the version the push was computed from (>= 0). `pulled`: float32 (P,), the weights the
    worker computed it on (for DC-ASGD; None where the server does not keep them). `worker`: its rank."""

    values: np.ndarray
    square: float
    staleness: int
    delta: bool = False
    lr: float = 0.0
    pulled: np.ndarray | None = None
    worker: int = 0  # the rank of the worker that pushed it (DANA-Zero keeps a momentum per worker)


@dataclass
class Update:
    """What a rule did: `params` holds the new weights (None: refused, and `refused` says why and what to do);
    `lr` the step size the push entered with (logged); `norm` the norm of what was applied (logged)."""

    params: np.ndarray | None
    lr: float = 0.0
    norm: float = float("nan")
    refused: str = ""


class UpdateRule(Protocol):
    def apply(self, push: Push, step_size: float, out: np.ndarray) -> Update:
        """Apply `push` (module docstring); returns the `Update`."""
        ...


class AsyncRule:
    """Asynchronous SGD's update on the server's optimizer (`SGD`, which holds the weights and the momentum):
    a gradient enters the momentum scaled by f(staleness) (`staleness_lr`: "none", "inverse", "sqrt"); an
    accumulated update (nsync > 1) is added, scaled by f(staleness) only."""

    def __init__(self, optimizer: SGD, staleness_lr: str) -> None:
        self.optimizer, self.staleness_lr = optimizer, staleness_lr

    @property
    def params(self) -> np.ndarray:
        return self.optimizer.params

    def apply(self, push: Push, step_size: float, out: np.ndarray) -> Update:
        factor = staleness_factor(self.staleness_lr, push.staleness)
        norm = math.sqrt(push.square)
        if push.delta:
            self.optimizer.params = apply_delta(self.optimizer.params, push.values, factor, out=out,
                                                threads=getattr(self.optimizer, "threads", 1))
            return Update(self.optimizer.params, push.lr * factor, norm)
        # the staleness factor scales the gradient entering the momentum, not the velocity's step
        return Update(self.optimizer.step(push.values, step_size, out=out, grad_scale=factor), step_size * factor,
                      norm)


class DelayCompensated:
    """DC-ASGD in front of another rule (`AsyncRule`): the gradient is corrected in place for the weights' move
    since the worker's pull, then applied; a correction that makes it non-finite refuses the push."""

    def __init__(self, rule: AsyncRule, compensation: DelayCompensation) -> None:
        self.rule, self.compensation = rule, compensation

    def apply(self, push: Push, step_size: float, out: np.ndarray) -> Update:
        self.compensation.correct(push.values, self.rule.params, push.pulled)
        finite, push.square = finite_square(push.values)
        if not finite:
            return Update(None, refused="delay compensation made finite gradients non-finite: lower --dc-lambda "
                                        "(or --lr)")
        return self.rule.apply(push, step_size, out)


class GapPenalized:
    """Gap-Aware around another rule (`AsyncRule` or `DanaZero`; `mpiasgd.optim.delay.GapAware`): the pushed
    gradient divided by its gap, then applied by `rule`, whose step is then folded into the gap's unit C: the
    velocity it applied (`velocity(push)`: the server's momentum, or the pushing worker's for DANA-Zero; None
    without momentum: the penalized gradient) times the step size and `lr_scale` (float32 (P,) or None). With
    DANA-Zero it is DANA-GA, the combination Barkai et al. 2020 evaluate: the gap is measured from the look-ahead
    weights the worker computed on."""

    def __init__(self, rule: AsyncRule | DanaZero, gap: GapAware, velocity: Any,
                 lr_scale: np.ndarray | None = None) -> None:
        self.rule, self.gap, self.velocity, self.lr_scale = rule, gap, velocity, lr_scale

    def apply(self, push: Push, step_size: float, out: np.ndarray) -> Update:
        if isinstance(self.rule, DanaZero):  # DANA-GA: the three passes as one (the same bits)
            return self.rule.apply_gap_aware(push, step_size, out, self.gap)
        self.gap.penalize(push.values, self.rule.params, push.pulled)
        push.square = finite_square(push.values)[1]  # (dividing by G >= 1 keeps a finite gradient finite)
        update = self.rule.apply(push, step_size, out)
        if update.params is not None:
            v = self.velocity(push)
            self.gap.observe(push.values if v is None else v, step_size, self.lr_scale)
        return update


def elastic_difference(x, center, alpha: float):
    """delta = alpha (x - center) in float32 (numpy or cupy arrays; both sides of an EASGD exchange call it:
    the center adds it, the worker subtracts it)."""
    return np.float32(alpha) * (x - center)


class ElasticRule:
    """EASGD's center update on `center` (float32 (P,), updated in place): x~ <- x~ + alpha (x_i - x~), the push
    carrying x_i; `alpha` the moving rate. The logged step size is the worker's (`push.lr`)."""

    def __init__(self, center: np.ndarray, alpha: float) -> None:
        self.center, self.alpha = center, alpha

    def apply(self, push: Push, step_size: float, out: np.ndarray) -> Update:
        delta = elastic_difference(push.values, self.center, self.alpha)
        self.center += delta
        return Update(self.center, push.lr, math.sqrt(finite_square(delta)[1]))


class DanaZero:
    """DANA-Zero (Hakimi, Barkai, Gabel and Schuster 2019, "Taming Momentum in a Distributed Asynchronous
    Environment", arXiv 1907.11612, section 4, the master's part of DANA-Zero): the server keeps one momentum
    v_i per worker i, not one for all. A gradient g of worker i, with weight decay d = g + decay * w
    (`decay` = weight_decay x each parameter's decay multiplier):

        v_i <- m v_i + d,    w <- w - lr * lr_mult * v_i

    and the worker's next weights are the look-ahead w - lr * lr_mult * m * sum_j v_j (`total`, kept as the sum
    is updated: `AsgdServer` replies through `LookAhead` with one step along it): where the master weights will
    be once every worker's momentum has moved them once more, so a gradient is computed near where it is
    applied whatever N. One worker: momentum SGD whose gradient is taken at w - lr * m * v (Nesterov's point).

    `params` float32 (P,) (the master weights, updated in place or into `out`), `decay` float32 (P,) or None,
    `lr_scale` float32 (P,) or None (1), `workers` the ranks that push. Memory: N + 1 float32 (P,) vectors.
    Cost: one compiled pass (`mpiasgd.optim.compiled.dana_step`) reading the push, the weights, the worker's
    momentum and the sum, writing the last two and the new weights. Refuses nothing: a push's values are finite
    (the server checked)."""

    def __init__(self, params: np.ndarray, decay: np.ndarray | None, momentum: float, workers: list[int],
                 lr_scale: np.ndarray | None = None) -> None:
        if not 0 < momentum < 1:
            raise ValueError(f"DANA-Zero: momentum must be in (0, 1), got {momentum!r}")
        self.params, self.decay, self.momentum, self.lr_scale = params, decay, np.float32(momentum), lr_scale
        self.velocities = {w: np.zeros_like(params) for w in workers}
        self.total = np.zeros_like(params)  # sum over the workers of their momenta

    def apply(self, push: Push, step_size: float, out: np.ndarray) -> Update:
        from mpiasgd.optim.compiled import dana_step  # (one compiled pass: numba, loaded with the first push)

        w = self.params
        dana_step(w, push.values, None if out is w else out, self.velocities[push.worker], self.total, self.decay,
                  self.lr_scale, self.momentum, np.float32(step_size))
        self.params = out
        return Update(out, step_size, math.sqrt(push.square))

    def apply_gap_aware(self, push: Push, step_size: float, out: np.ndarray, gap: Any) -> Update:
        """`apply` with Gap-Aware's penalty first and its C updated after (`GapPenalized` around this rule, DANA-GA;
        `gap` a `mpiasgd.optim.delay.GapAware`): one compiled pass (`mpiasgd.optim.compiled.dana_ga_step`) whose
        weights, momenta and C are those of `gap.penalize`, `apply` and `gap.observe` bit for bit; `push.values`
        holds the penalized gradient after, `push.square` its sum of squares."""
        from mpiasgd.optim.compiled import dana_ga_step

        w = self.params
        gap.check(push.values, w, push.pulled)
        dana_ga_step(w, push.values, None if out is w else out, self.velocities[push.worker], self.total, self.decay,
                     self.lr_scale, self.momentum, np.float32(step_size), push.pulled, gap.mean_step, gap.unbias(),
                     gap.decay, np.float32(1) - gap.decay)
        gap.updates += 1
        push.square = finite_square(push.values)[1]  # (dividing by G >= 1 keeps a finite gradient finite)
        self.params = out
        return Update(out, step_size, math.sqrt(push.square))

    def warm_up(self, gap_aware: bool = False) -> None:
        """Load the compiled update (`dana_step`, or with `gap_aware` `dana_ga_step`, out of place and in place,
        with this rule's argument types) on 8-value scratch vectors now, so that the first push does not wait for
        numba (as `SGD.warm_up`). Changes nothing."""
        from mpiasgd.optim.compiled import dana_ga_step, dana_step

        def scratch() -> np.ndarray:
            return np.zeros(8, np.float32)

        decay = None if self.decay is None else scratch()
        lr_scale = None if self.lr_scale is None else scratch()
        zero = np.float32(0)
        for out in (scratch(), None):
            if gap_aware:
                dana_ga_step(scratch(), scratch(), out, scratch(), scratch(), decay, lr_scale, self.momentum, zero,
                             scratch(), scratch(), zero, zero, zero)
            else:
                dana_step(scratch(), scratch(), out, scratch(), scratch(), decay, lr_scale, self.momentum, zero)

    def drop(self, worker: int) -> None:
        """Worker `worker` is gone (it died): its momentum leaves the sum the replies look ahead along (its past
        updates stay in the weights); it pushes no more."""
        v = self.velocities.pop(worker)
        self.total -= v

    def add(self, worker: int) -> None:
        """(--respawn, work in progress) Worker `worker` is back (a replacement of a dead one): a momentum of its
        own, zero; the sum is unchanged."""
        if worker in self.velocities:
            raise ValueError(f"DANA-Zero: worker rank {worker} has a momentum already")
        self.velocities[worker] = np.zeros_like(self.total)

    def restore(self, total: np.ndarray) -> None:
        """From a checkpoint, which holds only the sum of the momenta: each worker's momentum the sum / N (the
        look-ahead stays where it was; a resumed DANA-Zero run is not bit-identical to an uninterrupted one)."""
        share = (total / np.float32(len(self.velocities))).astype(np.float32)
        for v in self.velocities.values():
            v[...] = share
        self.total[...] = share * np.float32(len(self.velocities))
