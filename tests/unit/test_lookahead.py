"""The look-ahead reply (`--lookahead`, DANA): `mpiasgd.optim.delay.LookAhead` against the formula."""

from __future__ import annotations

import numpy as np
import pytest

from mpiasgd.optim.delay import LookAhead, lookahead_steps


@pytest.mark.parametrize("momentum,steps,factor", [(0.9, 1, 0.9), (0.9, 2, 0.9 + 0.81), (0.5, 3, 0.5 + 0.25 + 0.125),
                                                   (0.9, 0, 0.0), (0.0, 4, 0.0), (1.0, 3, 3.0), (0.9, 1.5, None)])
def test_reply_is_the_weights_after_k_momentum_only_updates(momentum, steps, factor):
    """reply = w - lr * lr_mult * c * v with c = m (1 - m^K) / (1 - m): K updates of SGD with momentum m and no new
    gradient from (w, v), stepped by hand, land on the reply (whole K); a fractional K interpolates the sum."""
    size = 70_001  # more than one block of 65,536 values, and not a multiple of it
    rng = np.random.default_rng(1)
    w = rng.standard_normal(size).astype(np.float32)
    v = rng.standard_normal(size).astype(np.float32)
    lr = 0.05
    look = LookAhead(size, momentum, steps, chunk=65_536)
    out = look.reply(w, v, lr, np.empty_like(w))
    if factor is None:
        factor = momentum * (1 - momentum ** steps) / (1 - momentum)
    else:  # the walk: v <- m v, w <- w - lr v, K times
        ww, vv = w.astype(np.float64), v.astype(np.float64)
        for _ in range(int(steps)):
            vv = momentum * vv
            ww = ww - lr * vv
        np.testing.assert_allclose(out, ww, rtol=1e-5, atol=1e-6)
    assert look.factor == pytest.approx(factor)
    np.testing.assert_allclose(out, w - lr * factor * v.astype(np.float64), rtol=1e-6, atol=1e-7)


def test_learning_rate_multipliers_scale_each_parameter():
    size = 10
    w, v = np.ones(size, np.float32), np.full(size, 2.0, np.float32)
    mult = np.array([0, 1, 2, 0.5, 1, 1, 1, 1, 1, 3], np.float32)
    out = LookAhead(size, 0.9, 1, lr_scale=mult).reply(w, v, 0.1, np.empty_like(w))
    np.testing.assert_allclose(out, 1 - 0.1 * mult * 0.9 * 2, rtol=1e-6)


def test_auto_steps_is_the_other_workers():
    assert lookahead_steps(-1, 1) == 0.0
    assert lookahead_steps(-1, 2) == 1.0
    assert lookahead_steps(-1, 8) == 7.0
    assert lookahead_steps(2.5, 8) == 2.5
    assert lookahead_steps(0, 8) == 0.0


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="steps must be >= 0"):
        LookAhead(4, 0.9, -1)
    look = LookAhead(4, 0.9, 1)
    w = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="out must be a buffer of its own"):
        look.reply(w, np.zeros(4, np.float32), 0.1, w)
    with pytest.raises(ValueError, match="weights must be a C-contiguous float32 array of shape"):
        look.reply(np.zeros(5, np.float32), np.zeros(4, np.float32), 0.1, np.zeros(4, np.float32))


@pytest.mark.parametrize("nesterov", [False, True])
def test_reply_lands_where_k_updates_of_the_real_optimizer_without_gradient_do(nesterov):
    """The reply equals K steps of the server's own optimizer (heavy ball, or Nesterov with its extra factor
    momentum) fed zero gradients without weight decay, from the same weights and velocity."""
    from mpiasgd.optim import NumpySGD

    size, lr, m, k = 1000, 0.05, 0.9, 3
    rng = np.random.default_rng(4)
    w = rng.standard_normal(size).astype(np.float32)
    v = rng.standard_normal(size).astype(np.float32)
    opt = NumpySGD(w.copy(), np.zeros(size, np.float32), m, 0.0, nesterov=nesterov)
    opt.velocity[:] = v
    for _ in range(k):
        opt.step(np.zeros(size, np.float32), lr)
    out = LookAhead(size, m, k, nesterov=nesterov).reply(w, v, lr, np.empty_like(w))
    np.testing.assert_allclose(out, opt.params, rtol=1e-5, atol=1e-6)


def test_overlap_adds_one_round_of_staleness():
    """--overlap: a push is computed on the reply before the last, so N more pushes land before it: 2N - 1."""
    assert lookahead_steps(-1, 2, overlap=True) == 3.0
    assert lookahead_steps(-1, 4, overlap=True) == 7.0
    assert lookahead_steps(-1, 1, overlap=True) == 1.0
    assert lookahead_steps(1.5, 4, overlap=True) == 1.5
    assert lookahead_steps(-1, 4, overlap=False) == 3.0
