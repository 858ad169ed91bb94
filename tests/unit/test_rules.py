"""The parameter server's update rules (`mpiasgd.optim.rules`) against updates computed by hand in float64."""

from __future__ import annotations

import numpy as np
import pytest

from mpiasgd.optim import SGD, DelayCompensation
from mpiasgd.optim.rules import AsyncRule, DelayCompensated, ElasticRule, Push, elastic_difference

P = 1000


def vectors(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(P).astype(np.float32), rng.standard_normal(P).astype(np.float32)


def push(values: np.ndarray, staleness: int, **kw) -> Push:
    return Push(values.copy(), float(np.dot(values.astype(np.float64), values)), staleness, **kw)


@pytest.mark.parametrize("staleness_lr, staleness, factor", [("none", 4, 1.0), ("inverse", 4, 0.25),
                                                             ("sqrt", 4, 0.5), ("inverse", 0, 1.0)])
def test_async_rule_is_the_momentum_step_with_the_gradient_scaled_by_the_staleness_factor(staleness_lr, staleness,
                                                                                        factor):
    w, g = vectors()
    rule = AsyncRule(SGD(w.copy(), np.ones(P, np.float32), 0.9, 1e-3), staleness_lr)
    first, second = np.empty(P, np.float32), np.empty(P, np.float32)
    rule.apply(push(g, staleness), 0.1, first)  # the new weights go into the buffer given (a worker's reply)
    update = rule.apply(push(g, staleness), 0.1, second)  # the second step meets a velocity
    v, refs = np.zeros(P), [w.astype(np.float64)]
    for _ in range(2):
        v = 0.9 * v + factor * g + 1e-3 * refs[-1]
        refs.append(refs[-1] - 0.1 * v)
    assert update.params is second and rule.params is second
    np.testing.assert_allclose(first, refs[1], rtol=1e-5, atol=1e-6)  # (left as the first step wrote it)
    np.testing.assert_allclose(update.params, refs[2], rtol=1e-5, atol=1e-6)
    assert update.lr == pytest.approx(0.1 * factor) and update.norm == pytest.approx(np.linalg.norm(g), rel=1e-6)


def test_async_rule_adds_an_accumulated_update_scaled_by_the_staleness_factor_only():
    w, u = vectors(1)
    rule = AsyncRule(SGD(w.copy(), np.ones(P, np.float32), 0.9, 1e-3), "inverse")
    update = rule.apply(push(u, 3, delta=True, lr=0.05), 0.1, np.empty(P, np.float32))
    np.testing.assert_allclose(update.params, w + u / 3, rtol=1e-6, atol=1e-6)  # no momentum, decay or step size
    assert update.lr == pytest.approx(0.05 / 3)
    assert not rule.optimizer.velocity.any()  # the momentum is the worker's own


def test_delay_compensation_corrects_the_gradient_before_the_rule_applies_it():
    w, g = vectors(2)
    pulled = w + np.float32(0.01) * vectors(3)[0]
    rule = DelayCompensated(AsyncRule(SGD(w.copy(), np.ones(P, np.float32), 0.0, 0.0), "none"),
                            DelayCompensation(P, 2.0))
    update = rule.apply(push(g, 1, pulled=pulled), 0.1, np.empty(P, np.float32))
    corrected = g.astype(np.float64) + 2.0 * g.astype(np.float64) ** 2 * (w.astype(np.float64) - pulled)
    np.testing.assert_allclose(update.params, w - 0.1 * corrected, rtol=1e-5, atol=1e-6)
    assert update.norm == pytest.approx(np.linalg.norm(corrected), rel=1e-5)


def test_delay_compensation_that_makes_a_gradient_non_finite_refuses_the_push_and_leaves_the_weights():
    w, g = vectors(4)
    g[7] = 1e30  # finite; g * g overflows float32
    pulled = w - 1.0
    sgd = SGD(w.copy(), np.ones(P, np.float32), 0.9, 0.0)
    update = DelayCompensated(AsyncRule(sgd, "none"), DelayCompensation(P, 1.0)).apply(
        push(g, 1, pulled=pulled), 0.1, np.empty(P, np.float32))
    assert update.params is None and "lower --dc-lambda" in update.refused
    np.testing.assert_array_equal(sgd.params, w)
    assert not sgd.velocity.any()


def test_elastic_rule_moves_the_center_towards_the_pushed_weights_in_place():
    center, x = vectors(5)
    before = center.copy()
    rule = ElasticRule(center, 0.45)
    update = rule.apply(push(x, 2, lr=0.03), 0.1, np.empty(P, np.float32))
    assert update.params is center  # in place
    np.testing.assert_allclose(center, before + 0.45 * (x.astype(np.float64) - before), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(center, before + elastic_difference(x, before, 0.45))  # the worker's formula
    assert update.lr == 0.03 and update.norm == pytest.approx(0.45 * np.linalg.norm(x - before), rel=1e-5)
