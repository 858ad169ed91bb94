"""The server's optimizer and learning-rate schedule against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpiasgd.config import Config
from mpiasgd.optim import SGD, learning_rate, staleness_factor


def test_sgd_momentum_weight_decay_matches_formula():
    rng = np.random.default_rng(0)
    w = rng.standard_normal(7).astype(np.float32)
    mask = np.array([1, 1, 0, 1, 0, 1, 1], np.float32)
    opt = SGD(w, mask, momentum=0.9, weight_decay=0.01)
    ref_w, ref_v = w.astype(np.float64), np.zeros(7)
    for k in range(4):
        g = rng.standard_normal(7).astype(np.float32)
        g_before = g.copy()
        opt.step(g, lr=0.1 * (k + 1))
        ref_v = 0.9 * ref_v + g + 0.01 * mask * ref_w
        ref_w = ref_w - 0.1 * (k + 1) * ref_v
        np.testing.assert_array_equal(g, g_before)  # the pushed gradient is not modified
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    assert opt.params is w  # updated in place


def test_warmup_then_constant():
    cfg = Config(lr=0.2, warmup_epochs=2.0, lr_schedule="constant")
    assert learning_rate(cfg, 0.0, 0.0) == 0.0
    assert learning_rate(cfg, 1.0, 0.1) == pytest.approx(0.1)
    assert learning_rate(cfg, 2.0, 0.2) == pytest.approx(0.2)
    assert learning_rate(cfg, 50.0, 0.9) == pytest.approx(0.2)


def test_step_schedule():
    cfg = Config(lr=1.0, warmup_epochs=0.0, lr_schedule="step", lr_milestones=(3.0, 6.0), lr_gamma=0.1)
    assert [learning_rate(cfg, e, 0.0) for e in (0.0, 2.9, 3.0, 5.9, 6.0, 9.0)] == pytest.approx(
        [1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


def test_cosine_schedule_follows_fraction_done():
    cfg = Config(lr=0.4, warmup_epochs=0.0, lr_schedule="cosine")
    for t in (0.0, 0.25, 0.5, 1.0):
        assert learning_rate(cfg, 1.0, t) == pytest.approx(0.2 * (1 + math.cos(math.pi * t)))
    assert learning_rate(cfg, 1.0, 1.0) == pytest.approx(0.0, abs=1e-12)


def test_staleness_factor_rules():
    assert [staleness_factor("inverse", s) for s in (0, 1, 2, 4)] == [1.0, 1.0, 0.5, 0.25]
    assert staleness_factor("sqrt", 4) == pytest.approx(0.5)
    assert staleness_factor("none", 9) == 1.0
