"""The server's optimizer and learning-rate schedule against hand computations; the cache-blocked
updates against the whole-vector float32 formula, value for value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpiasgd.config import Config
from mpiasgd.optim import SGD, apply_delta, decay_blocks, learning_rate, staleness_factor


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


def reference_step(w, v, g, decay, momentum, lr):
    """The update as six whole-vector float32 numpy passes (the optimizer before cache blocking)."""
    s = decay * w
    s += g
    v *= np.float32(momentum)
    v += s
    return w - v * np.float32(lr)


def layer_mask(sizes):
    """A model-like decay mask: per layer a weight block (1) then a bias block (0)."""
    return np.concatenate([np.full(n, k % 2 == 0, np.float32) for k, n in enumerate(sizes)])


MASKS = {
    "runs": layer_mask([5000, 32, 70000, 64, 2000, 10]),               # read as constant runs
    "scattered": (np.random.default_rng(1).random(77106) < 0.8).astype(np.float32),  # read as an array
}


@pytest.mark.parametrize("mask_kind", sorted(MASKS))
@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.9, 5e-4), (0.0, 5e-4), (0.9, 0.0), (0.0, 0.0)])
@pytest.mark.parametrize("in_place", [True, False])
def test_blocked_step_equals_whole_vector_formula(mask_kind, momentum, weight_decay, in_place):
    mask = MASKS[mask_kind]
    P = mask.size  # not a multiple of the block size
    rng = np.random.default_rng(2)
    w = rng.standard_normal(P, dtype=np.float32)
    opt = SGD(w.copy(), mask, momentum=momentum, weight_decay=weight_decay, chunk=4096)
    if mask_kind == "runs" and weight_decay:
        assert all(coef is not None for _, _, coef in opt.blocks)  # the (P,) decay vector is never read
    assert (opt.velocity is None) == (momentum == 0)
    ref_w, ref_v = w.copy(), np.zeros(P, np.float32)
    decay = (weight_decay * mask).astype(np.float32)
    spare = np.empty(P, np.float32)
    for k in range(3):
        g = rng.standard_normal(P, dtype=np.float32)
        g_before = g.copy()
        old = opt.params
        old_before = old.copy()
        new = opt.step(g, lr=0.1 * (k + 1), out=None if in_place else spare)
        ref_w = reference_step(ref_w, ref_v, g, decay, momentum, 0.1 * (k + 1))
        np.testing.assert_array_equal(new.view(np.uint32), ref_w.view(np.uint32))  # bit for bit
        assert opt.params is new
        np.testing.assert_array_equal(g, g_before)  # the pushed gradient is not modified
        if in_place:
            assert new is old
        else:
            assert new is spare
            np.testing.assert_array_equal(old, old_before)  # the old weights are left as they were
            spare = old  # rotate, as the server does with its send buffers
        if momentum:
            np.testing.assert_array_equal(opt.velocity.view(np.uint32), ref_v.view(np.uint32))


def test_in_place_and_out_of_place_agree_over_many_steps():
    P = 10_007
    mask = layer_mask([3000, 16, 6975, 16])
    rng = np.random.default_rng(3)
    w = rng.standard_normal(P, dtype=np.float32)
    a = SGD(w.copy(), mask, 0.9, 5e-4, chunk=1000)
    b = SGD(w.copy(), mask, 0.9, 5e-4, chunk=1000)
    buffers = [b.params, np.empty(P, np.float32), np.empty(P, np.float32)]
    for k in range(10):
        g = rng.standard_normal(P, dtype=np.float32)
        a.step(g, 0.05)
        b.step(g, 0.05, out=buffers[(k + 1) % 3])
    np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(a.velocity, b.velocity)


def test_decay_blocks_follow_the_mask_runs():
    decay = (5e-4 * layer_mask([10, 3, 25])).astype(np.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mpiasgd.optim.sgd.MIN_RUN", 1)
        blocks = decay_blocks(decay, chunk=8)
    assert [(a, b) for a, b, _ in blocks] == [(0, 8), (8, 10), (10, 13), (13, 21), (21, 29), (29, 37), (37, 38)]
    assert [float(c) for _, _, c in blocks] == [float(np.float32(5e-4))] * 2 + [0.0] + [float(np.float32(5e-4))] * 4
    # short runs: the decay vector is read as an array, in a plain grid of blocks
    assert [(a, b, c) for a, b, c in decay_blocks(decay, chunk=16)] == [(0, 16, None), (16, 32, None), (32, 38, None)]


def test_step_rejects_bad_buffers():
    P = 100
    opt = SGD(np.zeros(P, np.float32), np.ones(P, np.float32), 0.9, 5e-4)
    g = np.ones(P, np.float32)
    with pytest.raises(ValueError, match="grad"):
        opt.step(np.ones(P, np.float64), 0.1)
    with pytest.raises(ValueError, match="out"):
        opt.step(g, 0.1, out=np.empty(P + 1, np.float32))
    with pytest.raises(ValueError, match="overlaps"):
        buf = np.zeros(2 * P, np.float32)
        opt.params = buf[:P]
        opt.step(g, 0.1, out=buf[1 : P + 1])
    with pytest.raises(ValueError, match="velocity"):
        opt.params = np.zeros(P, np.float32)
        opt.step(g, 0.1, out=opt.velocity)


@pytest.mark.parametrize("where", ["in place", "separate", "into delta"])
def test_apply_delta(where):
    P = 10_001
    rng = np.random.default_rng(4)
    w = rng.standard_normal(P, dtype=np.float32)
    delta = rng.standard_normal(P, dtype=np.float32)
    expected = w + np.float32(0.25) * delta
    w_before, delta_before = w.copy(), delta.copy()
    out = {"in place": None, "separate": np.empty(P, np.float32), "into delta": delta}[where]
    result = apply_delta(w, delta, 0.25, out=out, chunk=1000)
    np.testing.assert_array_equal(result.view(np.uint32), expected.view(np.uint32))
    assert result is (w if out is None else out)
    if where == "separate":
        np.testing.assert_array_equal(w, w_before)
        np.testing.assert_array_equal(delta, delta_before)
    buf = np.zeros(P + 1, np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        apply_delta(buf[:P], delta, 0.5, out=buf[1:])


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


@pytest.mark.parametrize("mask_kind", sorted(MASKS))
@pytest.mark.parametrize("in_place", [True, False])
def test_grad_scale_scales_the_gradient_entering_the_velocity(mask_kind, in_place):
    """step(grad_scale=s): v <- m v + (s g + wd mask w); w <- w - lr v, over steps with varying s (float64
    hand computation); the decay term is not scaled, and the gradient is left as it was."""
    mask = MASKS[mask_kind]
    P = mask.size
    rng = np.random.default_rng(4)
    w = rng.standard_normal(P, dtype=np.float32)
    opt = SGD(w.copy(), mask, momentum=0.9, weight_decay=5e-3, chunk=4096)
    ref_w, ref_v = w.astype(np.float64), np.zeros(P)
    spare = np.empty(P, np.float32)
    for k, s in enumerate([1.0, 0.5, 1 / 8, 1.0, 1 / 3]):
        g = rng.standard_normal(P, dtype=np.float32)
        g_before = g.copy()
        old = opt.params
        opt.step(g, lr=0.05 * (k + 1), out=None if in_place else spare, grad_scale=s)
        if not in_place:
            spare = old
        ref_v = 0.9 * ref_v + s * g.astype(np.float64) + 5e-3 * mask * ref_w
        ref_w = ref_w - 0.05 * (k + 1) * ref_v
        np.testing.assert_array_equal(g, g_before)
        np.testing.assert_allclose(opt.velocity, ref_v, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(opt.params, ref_w, rtol=1e-5, atol=1e-6)


def test_a_stale_gradient_moves_the_weights_by_its_share_only():
    """The staleness rule's point (Zhang et al. 2016): at momentum 0.9 a gradient scaled by 1/8 moves the
    weights by lr/8 * 1/(1 - 0.9) = 1.25 lr in total (fresh: 10 lr); scaling that step's lr instead would
    move them by about 9.1 lr, since the velocity carries the unscaled gradient on."""
    lr = 0.01
    opt = SGD(np.zeros(1, np.float32), np.zeros(1, np.float32), momentum=0.9, weight_decay=0.0)
    opt.step(np.ones(1, np.float32), lr, grad_scale=1 / 8)
    for _ in range(400):
        opt.step(np.zeros(1, np.float32), lr)
    assert -opt.params[0] == pytest.approx(1.25 * lr, rel=1e-4)
    fresh = SGD(np.zeros(1, np.float32), np.zeros(1, np.float32), momentum=0.9, weight_decay=0.0)
    fresh.step(np.ones(1, np.float32), lr)
    for _ in range(400):
        fresh.step(np.zeros(1, np.float32), lr)
    assert -fresh.params[0] == pytest.approx(10 * lr, rel=1e-4)
