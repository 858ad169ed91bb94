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
    ElasticRule       EASGD's center (Zhang, Choromanska and LeCun 2015, arXiv 1412.6651, eq. 5-6):
                      x~ <- x~ + alpha (x_i - x~)

Which replies a push gets, and when, is the server's (ssp holds them; `--lookahead` sends the weights K
momentum-only updates ahead: `mpiasgd.optim.delay.LookAhead`), not the rule's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mpiasgd.optim.delay import DelayCompensation
from mpiasgd.optim.sgd import SGD, apply_delta, finite_square, staleness_factor


@dataclass
class Push:
    """A decoded, checked push as a rule sees it. `values`: float32 (P,), finite: a gradient, an accumulated
    update (`delta`, nsync > 1, already scaled by the worker's step size `lr`), or (easgd) the worker's weights
    x_i; a rule may change them in place. `square`: the sum of squares of `values`. `staleness`: the server's
    version minus the version the push was computed from (>= 0). `pulled`: float32 (P,), the weights the
    worker computed it on (for DC-ASGD; None where the server does not keep them)."""

    values: np.ndarray
    square: float
    staleness: int
    delta: bool = False
    lr: float = 0.0
    pulled: np.ndarray | None = None


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
