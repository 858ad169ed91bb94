"""The server's optimizer and learning-rate schedule against hand computations; the updates (numpy's
cache-blocked `NumpySGD`, the compiled `SGD` and `apply_delta`) against the whole-vector float32
formula and against each other, bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpiasgd.config import Config
from mpiasgd.ops import numpy_ops
from mpiasgd.optim import (
    SGD,
    LocalSGD,
    NumpySGD,
    Schedule,
    apply_delta,
    finite_square,
    learning_rate,
    run_blocks,
    staleness_factor,
)


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
@pytest.mark.parametrize("cls", [NumpySGD, SGD])
def test_blocked_step_equals_whole_vector_formula(mask_kind, momentum, weight_decay, in_place, cls):
    mask = MASKS[mask_kind]
    P = mask.size  # not a multiple of the block size
    rng = np.random.default_rng(2)
    w = rng.standard_normal(P, dtype=np.float32)
    opt = cls(w.copy(), mask, momentum=momentum, weight_decay=weight_decay, chunk=4096)
    if mask_kind == "runs" and weight_decay:
        assert all(coef is not None for _, _, coef, _ in opt.blocks)  # the (P,) decay vector is never read
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


@pytest.mark.parametrize("cls", [NumpySGD, SGD])
def test_in_place_and_out_of_place_agree_over_many_steps(cls):
    P = 10_007
    mask = layer_mask([3000, 16, 6975, 16])
    rng = np.random.default_rng(3)
    w = rng.standard_normal(P, dtype=np.float32)
    a = cls(w.copy(), mask, 0.9, 5e-4, chunk=1000)
    b = cls(w.copy(), mask, 0.9, 5e-4, chunk=1000)
    buffers = [b.params, np.empty(P, np.float32), np.empty(P, np.float32)]
    for k in range(10):
        g = rng.standard_normal(P, dtype=np.float32)
        a.step(g, 0.05)
        b.step(g, 0.05, out=buffers[(k + 1) % 3])
    np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(a.velocity, b.velocity)


def test_blocks_follow_the_mask_runs():
    decay = (5e-4 * layer_mask([10, 3, 25])).astype(np.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mpiasgd.optim.sgd.MIN_RUN", 1)
        blocks = run_blocks([decay], chunk=8)
    assert [(a, b) for a, b, _ in blocks] == [(0, 8), (8, 10), (10, 13), (13, 21), (21, 29), (29, 37), (37, 38)]
    assert [float(c) for _, _, c in blocks] == [float(np.float32(5e-4))] * 2 + [0.0] + [float(np.float32(5e-4))] * 4
    # short runs: the decay vector is read as an array, in a plain grid of blocks
    assert [(a, b, c) for a, b, c in run_blocks([decay], chunk=16)] == [(0, 16, None), (16, 32, None), (32, 38, None)]


@pytest.mark.parametrize("cls", [NumpySGD, SGD])
def test_step_rejects_bad_buffers(cls):
    P = 100
    opt = cls(np.zeros(P, np.float32), np.ones(P, np.float32), 0.9, 5e-4)
    g = np.ones(P, np.float32)
    with pytest.raises(ValueError, match="grad"):
        opt.step(np.ones(P, np.float64), 0.1)
    with pytest.raises(ValueError, match="grad"):
        opt.step(np.ones(2 * P, np.float32)[::2], 0.1)  # not contiguous
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
    result = apply_delta(w, delta, 0.25, out=out)
    np.testing.assert_array_equal(result.view(np.uint32), expected.view(np.uint32))
    assert result is (w if out is None else out)
    if where == "separate":
        np.testing.assert_array_equal(w, w_before)
        np.testing.assert_array_equal(delta, delta_before)
    buf = np.zeros(P + 1, np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        apply_delta(buf[:P], delta, 0.5, out=buf[1:])
    with pytest.raises(ValueError, match="delta"):
        apply_delta(w, delta[:-1], 0.5)


def test_warmup_then_constant():
    cfg = Config(lr=0.2, warmup_epochs=2.0, lr_schedule="constant")
    assert learning_rate(cfg, 0.0, 0.0) == 0.0
    assert learning_rate(cfg, 1.0, 0.1) == pytest.approx(0.1)
    assert learning_rate(cfg, 2.0, 0.2) == pytest.approx(0.2)
    assert learning_rate(cfg, 50.0, 0.9) == pytest.approx(0.2)


def test_linear_scaling_rule():
    """--lr-scaling linear: the peak step size is --lr times the minibatches an update averages; warm-up ramps
    to it (Goyal et al. 2017); none, or one minibatch, keeps --lr."""
    cfg = Config(lr=0.1, warmup_epochs=1.0, lr_schedule="constant", lr_scaling="linear")
    assert Schedule.of(cfg, 4)(0.5, 0.1) == pytest.approx(0.2)
    assert Schedule.of(cfg, 4)(3.0, 0.5) == pytest.approx(0.4)
    assert Schedule.of(cfg, 1)(3.0, 0.5) == pytest.approx(0.1)
    assert Schedule.of(Config(lr=0.1, lr_schedule="constant"), 4)(3.0, 0.5) == pytest.approx(0.1)


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
@pytest.mark.parametrize("cls", [NumpySGD, SGD])
def test_grad_scale_scales_the_gradient_entering_the_velocity(mask_kind, in_place, cls):
    """step(grad_scale=s): v <- m v + (s g + wd mask w); w <- w - lr v, over steps with varying s (float64
    hand computation); the decay term is not scaled, and the gradient is left as it was."""
    mask = MASKS[mask_kind]
    P = mask.size
    rng = np.random.default_rng(4)
    w = rng.standard_normal(P, dtype=np.float32)
    opt = cls(w.copy(), mask, momentum=0.9, weight_decay=5e-3, chunk=4096)
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


# ----------------------------------------------------------------------------------------------
# Nesterov and per-parameter multipliers (Caffe's lr_mult/decay_mult, cuda-convnet's epsW/epsB/wc)


def reference_update(w, v, g, decay, momentum, lr, nesterov=False, lr_scale=None, grad_scale=1.0):
    """torch.optim.SGD's update (dampening 0) as plain whole-vector float32 numpy passes, with
    d = s_g g + decay w: v <- m v + d (v updated in place); returns w - (lr s) v, or w - (lr s)(d + m v)."""
    m, s_g = np.float32(momentum), np.float32(grad_scale)
    if s_g != 1:
        d = g * s_g
        d += decay * w
    else:
        d = decay * w
        d += g
    v *= m
    v += d
    u = v * m + d if nesterov else v
    step_size = np.float32(lr) if lr_scale is None else lr_scale * np.float32(lr)
    return w - u * step_size


def per_layer(sizes, values):
    """A vector of per-layer constants: `values[k]` on the `sizes[k]` parameters of block k."""
    return np.concatenate([np.full(n, x, np.float32) for n, x in zip(sizes, values, strict=True)])


SIZES = [5000, 32, 70000, 64, 2000, 10]  # the layout of MASKS["runs"]
DECAYS = {  # decay multipliers, each (77106,)
    "mask runs": MASKS["runs"],
    "multiplier runs": per_layer(SIZES, [1.0, 0.0, 2.0, 0.0, 0.5, 0.0]),
    "array": MASKS["scattered"],
}
LR_SCALES = {
    "none": None,
    # Caffe's usual lr_mult 1 / 2 on weights / biases, a frozen layer, cuts not those of the decay runs
    "runs": per_layer([3000, 2032, 70064, 2010], [1.0, 2.0, 0.0, 0.5]),
    "array": (2 * np.random.default_rng(5).random(77106)).astype(np.float32),
}
MOMENTA = {"momentum 0": (0.0, False), "heavy ball": (0.9, False), "nesterov": (0.9, True)}


@pytest.mark.parametrize("decay_kind", list(DECAYS))
@pytest.mark.parametrize("lr_kind", list(LR_SCALES))
@pytest.mark.parametrize("momentum_kind", list(MOMENTA))
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
@pytest.mark.parametrize("cls", [NumpySGD, SGD])
def test_every_variant_equals_the_whole_vector_formula_bit_for_bit(decay_kind, lr_kind, momentum_kind, in_place,
                                                                    grad_scale, cls):
    decay_mult, lr_scale = DECAYS[decay_kind], LR_SCALES[lr_kind]
    momentum, nesterov = MOMENTA[momentum_kind]
    P = decay_mult.size
    rng = np.random.default_rng(6)
    w = rng.standard_normal(P, dtype=np.float32)
    opt = cls(w.copy(), decay_mult, momentum, 5e-4, chunk=4096, nesterov=nesterov, lr_scale=lr_scale)
    if decay_kind != "array":
        assert all(block[2] is not None for block in opt.blocks)  # the decay vector is never read
    assert all((block[3] is None) == (lr_kind == "array") for block in opt.blocks)
    ref_w, ref_v = w.copy(), np.zeros(P, np.float32)
    decay = (5e-4 * decay_mult).astype(np.float32)
    spare = np.empty(P, np.float32)
    for k in range(3):
        g = rng.standard_normal(P, dtype=np.float32)
        g_before = g.copy()
        old = opt.params
        new = opt.step(g, lr=0.1 * (k + 1), out=None if in_place else spare, grad_scale=grad_scale)
        ref_w = reference_update(ref_w, ref_v, g, decay, momentum, 0.1 * (k + 1), nesterov, lr_scale, grad_scale)
        np.testing.assert_array_equal(new.view(np.uint32), ref_w.view(np.uint32))  # bit for bit
        np.testing.assert_array_equal(g, g_before)
        if not in_place:
            spare = old
        if momentum:
            np.testing.assert_array_equal(opt.velocity.view(np.uint32), ref_v.view(np.uint32))



# ----------------------------------------------------------------------------------------------
# the compiled update (SGD, apply_delta) against numpy's (NumpySGD, the formula), bit for bit


def awkward(rng, P, big):
    """float32 (P,) normal values and, every few hundred, the values a compiled loop could round
    differently from numpy: signed zeros, subnormals, huge values; `big` at 10, 20, .., 90."""
    x = rng.standard_normal(P, dtype=np.float32)
    special = np.array([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 1e19], np.float32)
    x[::331] = special[np.arange(x[::331].size) % special.size]
    x[10:100:10] = big
    return x


DECAYS_AND_NONE = {**DECAYS, "weight decay 0": None}


@pytest.mark.parametrize("decay_kind", list(DECAYS_AND_NONE))
@pytest.mark.parametrize("lr_kind", list(LR_SCALES))
@pytest.mark.parametrize("momentum_kind", list(MOMENTA))
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
@pytest.mark.parametrize("where", ["in place", "out of place", "into grad"])
def test_compiled_step_equals_numpy_sgd_bit_for_bit(decay_kind, lr_kind, momentum_kind, grad_scale, where):
    """SGD (one compiled loop) against NumpySGD (numpy, cache-blocked) over three steps, every bit of the
    weights and the velocity, on inputs with signed zeros, subnormals and weights that overflow to inf
    and then NaN (w = 3.4e38 pushed by g = -3.4e38); P (77,106) is not a multiple of the block (4,096)."""
    decay_mult = DECAYS_AND_NONE[decay_kind]
    weight_decay = 0.0 if decay_mult is None else 5e-4
    decay_mult = MASKS["runs"] if decay_mult is None else decay_mult
    lr_scale = LR_SCALES[lr_kind]
    momentum, nesterov = MOMENTA[momentum_kind]
    P = decay_mult.size
    rng = np.random.default_rng(12)
    w = awkward(rng, P, 3.4e38)
    ref = NumpySGD(w.copy(), decay_mult, momentum, weight_decay, chunk=4096, nesterov=nesterov, lr_scale=lr_scale)
    fast = SGD(w.copy(), decay_mult, momentum, weight_decay, chunk=4096, nesterov=nesterov, lr_scale=lr_scale)
    spares = [np.empty(P, np.float32), np.empty(P, np.float32)]
    for k in range(3):
        g = awkward(rng, P, -3.4e38)
        g_ref, g_fast = g.copy(), g.copy()
        prev = fast.params
        prev_before = prev.copy()
        outs = {"in place": (None, None), "out of place": tuple(spares), "into grad": (g_ref, g_fast)}[where]
        with np.errstate(over="ignore", invalid="ignore"):
            a = ref.step(g_ref, 0.1 * (k + 1), out=outs[0], grad_scale=grad_scale)
        b = fast.step(g_fast, 0.1 * (k + 1), out=outs[1], grad_scale=grad_scale)
        assert b is fast.params and b is (fast.params if where == "in place" else outs[1])
        assert not np.isfinite(a[:100]).all()  # the overflow happened
        np.testing.assert_array_equal(b.view(np.uint32), a.view(np.uint32))
        if momentum:
            np.testing.assert_array_equal(fast.velocity.view(np.uint32), ref.velocity.view(np.uint32))
        if where == "out of place":  # the old weights are left as they were; next step into fresh buffers
            np.testing.assert_array_equal(prev.view(np.uint32), prev_before.view(np.uint32))
            spares = [np.empty(P, np.float32), np.empty(P, np.float32)]
        if where != "into grad":
            np.testing.assert_array_equal(g_fast.view(np.uint32), g.view(np.uint32))  # the push is not modified


@pytest.mark.parametrize("decay_kind", ["runs", "array", "weight decay 0"])
@pytest.mark.parametrize("lr_kind", list(LR_SCALES))
@pytest.mark.parametrize("momentum_kind", list(MOMENTA))
def test_warm_up_loads_what_the_steps_run_and_changes_nothing(decay_kind, lr_kind, momentum_kind):
    """After `SGD.warm_up`, steps out of place and in place and `apply_delta` add no machine code to the
    compiled loops (numba compiles or loads one version per argument types: the warm-up loaded those the
    steps use), and the optimizer's weights and velocity are as before."""
    from mpiasgd.optim import apply_delta, compiled

    decay_mult = {"runs": MASKS["runs"], "array": DECAYS["array"], "weight decay 0": MASKS["runs"]}[decay_kind]
    momentum, nesterov = MOMENTA[momentum_kind]
    P = decay_mult.size
    rng = np.random.default_rng(3)
    sgd = SGD(rng.standard_normal(P, dtype=np.float32), decay_mult, momentum,
              0.0 if decay_kind == "weight decay 0" else 5e-4, chunk=4096, nesterov=nesterov,
              lr_scale=LR_SCALES[lr_kind])
    before = sgd.params.copy(), None if sgd.velocity is None else sgd.velocity.copy()
    sgd.warm_up()
    np.testing.assert_array_equal(sgd.params, before[0])
    if momentum:
        np.testing.assert_array_equal(sgd.velocity, before[1])
    loaded = len(compiled.sgd_blocks.signatures), len(compiled.add_scaled.signatures)
    sgd.step(rng.standard_normal(P, dtype=np.float32), 0.1, out=np.empty(P, np.float32))
    sgd.step(rng.standard_normal(P, dtype=np.float32), 0.1)
    apply_delta(sgd.params, rng.standard_normal(P, dtype=np.float32), 0.5)
    apply_delta(sgd.params, rng.standard_normal(P, dtype=np.float32), 0.5, out=np.empty(P, np.float32))
    assert (len(compiled.sgd_blocks.signatures), len(compiled.add_scaled.signatures)) == loaded


def test_compiled_step_on_tiny_and_odd_sizes():
    """P below one block, of one value, and one past a block: the loop's remainder paths."""
    rng = np.random.default_rng(13)
    for P in (1, 7, 31, 4097):
        mask = (rng.random(P) < 0.7).astype(np.float32)
        w = rng.standard_normal(P, dtype=np.float32)
        ref = NumpySGD(w.copy(), mask, 0.9, 5e-4, chunk=4096, nesterov=True)
        fast = SGD(w.copy(), mask, 0.9, 5e-4, chunk=4096, nesterov=True)
        for _ in range(2):
            g = rng.standard_normal(P, dtype=np.float32)
            out = np.empty(P, np.float32)
            ref.step(g, 0.05, out=out.copy(), grad_scale=0.5)
            fast.step(g, 0.05, out=out, grad_scale=0.5)
            np.testing.assert_array_equal(fast.params.view(np.uint32), ref.params.view(np.uint32))
            np.testing.assert_array_equal(fast.velocity.view(np.uint32), ref.velocity.view(np.uint32))


def test_compiled_step_leaves_the_old_weights_and_the_push_as_they_were():
    """Out of place (the server's double buffering) the old weight vector and the gradient are untouched."""
    P = 77106
    rng = np.random.default_rng(14)
    w = rng.standard_normal(P, dtype=np.float32)
    opt = SGD(w, DECAYS["multiplier runs"], 0.9, 5e-4, lr_scale=LR_SCALES["array"])
    w_before = w.copy()
    g = rng.standard_normal(P, dtype=np.float32)
    g_before = g.copy()
    new = opt.step(g, 0.1, out=np.empty(P, np.float32))
    assert opt.params is new and new is not w
    np.testing.assert_array_equal(w, w_before)
    np.testing.assert_array_equal(g, g_before)


def test_finite_square_flags_every_non_finite_push_and_sums_the_squares():
    """The server's check before the update (`AsgdServer.on_push`): a NaN or an infinity anywhere makes the push
    non-finite; a huge finite gradient whose float32 sum of squares overflows is still finite; the sum of squares
    is the gradient's own (its square root is the logged grad_norm)."""
    rng = np.random.default_rng(15)
    g = rng.standard_normal(100_003, dtype=np.float32)
    finite, square = finite_square(g)
    assert finite and square == pytest.approx(float(np.sum(g.astype(np.float64) ** 2)), rel=1e-5)
    for bad in (np.nan, np.inf, -np.inf):
        for where in (0, 50_000, 100_002):
            h = g.copy()
            h[where] = bad
            assert finite_square(h)[0] is False
    huge = np.full(1000, 1e30, np.float32)
    assert finite_square(huge) == (True, math.inf)

def test_the_reference_is_the_old_formula_on_the_default_path():
    """reference_update with nesterov off and no lr_scale takes the exact passes of reference_step."""
    rng = np.random.default_rng(7)
    w, g = rng.standard_normal(1000, dtype=np.float32), rng.standard_normal(1000, dtype=np.float32)
    decay = (5e-4 * MASKS["scattered"][:1000]).astype(np.float32)
    v1 = rng.standard_normal(1000, dtype=np.float32)
    v2 = v1.copy()
    a = reference_step(w, v1, g, decay, 0.9, 0.1)
    b = reference_update(w, v2, g, decay, 0.9, 0.1)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    np.testing.assert_array_equal(v1.view(np.uint32), v2.view(np.uint32))


def test_lr_scale_of_ones_is_the_default_path():
    P = 10_000
    ones = SGD(np.zeros(P, np.float32), np.ones(P, np.float32), 0.9, 5e-4, lr_scale=np.ones(P, np.float32))
    assert ones.lr_scale is None and ones.lr_scratch is None
    assert [b[3] for b in ones.blocks] == [np.float32(1)] * len(ones.blocks)


def test_nesterov_needs_momentum_and_multipliers_are_checked():
    P = 100
    with pytest.raises(ValueError, match="Nesterov momentum needs momentum > 0"):
        SGD(np.zeros(P, np.float32), np.ones(P, np.float32), 0.0, 5e-4, nesterov=True)
    with pytest.raises(ValueError, match=r"lr_scale must be float32 \(100,\)"):
        SGD(np.zeros(P, np.float32), np.ones(P, np.float32), 0.9, 5e-4, lr_scale=np.ones(P + 1, np.float32))
    with pytest.raises(ValueError, match=r"lr_scale must be .* finite values >= 0"):
        SGD(np.zeros(P, np.float32), np.ones(P, np.float32), 0.9, 5e-4, lr_scale=-np.ones(P, np.float32))
    with pytest.raises(ValueError, match="decay_mult must be"):
        SGD(np.zeros(P, np.float32), np.full(P, np.nan, np.float32), 0.9, 5e-4)


def test_run_blocks_of_two_vectors_cut_at_the_runs_of_both():
    decay = per_layer([10, 3, 25], [5e-4, 0.0, 5e-4])
    lr = per_layer([6, 20, 12], [1.0, 2.0, 0.5])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mpiasgd.optim.sgd.MIN_RUN", 1)
        blocks = run_blocks([decay, lr], chunk=8)
    assert [(a, b) for a, b, _, _ in blocks] == [(0, 6), (6, 10), (10, 13), (13, 21), (21, 26), (26, 34), (34, 38)]
    assert [(float(c), float(s)) for _, _, c, s in blocks] == [
        (np.float32(5e-4), 1.0), (np.float32(5e-4), 2.0), (0.0, 2.0), (np.float32(5e-4), 2.0),
        (np.float32(5e-4), 2.0), (np.float32(5e-4), 0.5), (np.float32(5e-4), 0.5)]
    scattered = np.arange(38, dtype=np.float32)  # one run per value: read as an array
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("mpiasgd.optim.sgd.MIN_RUN", 2)
        blocks = run_blocks([decay, scattered], chunk=8)
    assert [(a, b) for a, b, _, _ in blocks] == [(0, 8), (8, 10), (10, 13), (13, 21), (21, 29), (29, 37), (37, 38)]
    assert all(s is None for _, _, _, s in blocks)


def quadratic(P, seed):
    """Curvatures a > 0 of f(w) = sum(a w^2) / 2 (gradient a * w), a start point, a 0/1 decay mask and
    per-layer lr multipliers."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.1, 2.0, P)
    sizes = [P // 4, P // 4, P - P // 2]
    return (a, rng.standard_normal(P).astype(np.float32), per_layer(sizes, [1.0, 0.0, 1.0]),
            per_layer(sizes, [1.0, 2.0, 0.5]))


def test_nesterov_is_sutskevers_look_ahead_form():
    """Sutskever et al. 2013 eq. 3-4 in float64: v_S <- m v_S - lr s grad(theta + m v_S), theta <- theta + v_S.
    SGD(nesterov=True) holds the look-ahead point theta + m v_S as its weights."""
    a, w0, mask, s = quadratic(600, 8)
    m, lr, wd = 0.9, 0.05, 0.01
    opt = SGD(w0.copy(), mask, m, wd, nesterov=True, lr_scale=s)
    theta, v_s = w0.astype(np.float64), np.zeros(600)
    for _ in range(60):
        opt.step((a * opt.params).astype(np.float32), lr)
        p = theta + m * v_s
        v_s = m * v_s - lr * s * (a * p + wd * mask * p)
        theta = theta + v_s
    np.testing.assert_allclose(opt.params, theta + m * v_s, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_caffe_solvers_with_lr_mult_and_decay_mult_agree_at_constant_lr(nesterov):
    """Caffe's SGD and Nesterov solvers in float64 (lr inside the history h, per-layer lr_mult and
    decay_mult): h <- m h + lr s (g + wd dm w); SGD: w <- w - h; Nesterov: w <- w - ((1 + m) h - m h_old)."""
    a, w0, _, s = quadratic(600, 9)
    dm = per_layer([150, 150, 300], [1.0, 0.0, 2.0])
    m, lr, wd = 0.9, 0.05, 0.01
    opt = SGD(w0.copy(), dm, m, wd, nesterov=nesterov, lr_scale=s)
    w, h = w0.astype(np.float64), np.zeros(600)
    for _ in range(60):
        opt.step((a * opt.params).astype(np.float32), lr)
        h_old = h
        h = m * h + lr * s * (a * w + wd * dm * w)
        w = w - ((1 + m) * h - m * h_old if nesterov else h)
    np.testing.assert_allclose(opt.params, w, rtol=1e-4, atol=1e-6)


def test_lr_mult_zero_freezes_a_layer():
    a, w0, mask, _ = quadratic(400, 10)
    frozen = per_layer([100, 300], [0.0, 1.0])
    opt = SGD(w0.copy(), mask, 0.9, 5e-4, nesterov=True, lr_scale=frozen)
    for _ in range(5):
        opt.step((a * opt.params).astype(np.float32), 0.1)
    np.testing.assert_array_equal(opt.params[:100], w0[:100])
    assert np.all(opt.params[100:] != w0[100:])


# LocalSGD: what it hands the backend's sgd_momentum op


class RecordingOps:
    """A backend stand-in: host arrays, and sgd_momentum records its arguments."""

    def __init__(self):
        self.calls = []

    asarray = staticmethod(lambda a: np.asarray(a, np.float32))
    zeros = staticmethod(lambda n: np.zeros(n, np.float32))

    def sgd_momentum(self, params, velocity, grad, decay, momentum, lr, nesterov=False, lr_scale=None):
        self.calls.append({"decay": decay, "momentum": momentum, "lr": lr, "nesterov": nesterov,
                           "lr_scale": lr_scale})


class MaskModel:
    """A model of the time before per-parameter multipliers: decay_mask() only."""

    def __init__(self, ops, mask):
        self.ops, self.mask = ops, mask
        self.params = np.zeros(mask.size, np.float32)
        self.grads = np.ones(mask.size, np.float32)

    def decay_mask(self):
        return self.mask


class MultModel(MaskModel):
    def __init__(self, ops, decay_mult, lr_mult):
        super().__init__(ops, decay_mult)
        self.lr = lr_mult

    def decay_mult(self):
        return self.mask

    def lr_mult(self):
        return self.lr


def test_local_sgd_of_a_model_with_a_decay_mask_only():
    ops, mask = RecordingOps(), layer_mask([6, 2, 4, 1])
    local = LocalSGD(MaskModel(ops, mask), 0.9, 5e-4, nesterov=True)
    local.step(0.1)
    (call,) = ops.calls
    np.testing.assert_array_equal(call["decay"], (5e-4 * mask).astype(np.float32))
    assert (call["momentum"], call["lr"], call["nesterov"], call["lr_scale"]) == (0.9, 0.1, True, None)


def test_local_sgd_takes_the_models_multipliers_on_its_slice():
    ops = RecordingOps()
    decay_mult = per_layer([6, 2, 4, 1], [1.0, 0.0, 2.0, 0.0])
    lr_mult = per_layer([6, 2, 4, 1], [1.0, 2.0, 0.5, 2.0])
    LocalSGD(MultModel(ops, decay_mult, lr_mult), 0.9, 1e-2, start=6, stop=12).step(0.05)
    (call,) = ops.calls
    np.testing.assert_array_equal(call["decay"], (1e-2 * decay_mult[6:12]).astype(np.float32))
    np.testing.assert_array_equal(call["lr_scale"], lr_mult[6:12])
    assert call["nesterov"] is False
    ops.calls.clear()
    LocalSGD(MultModel(ops, decay_mult, lr_mult), 0.9, 1e-2, start=0, stop=6).step(0.05)
    assert ops.calls[0]["lr_scale"] is None  # multipliers all 1 on this slice: the op's default path
    with pytest.raises(ValueError, match="Nesterov momentum needs momentum > 0"):
        LocalSGD(MultModel(ops, decay_mult, lr_mult), 0.0, 1e-2, nesterov=True)


@pytest.mark.parametrize("nesterov", [False, True])
def test_local_sgd_on_the_numpy_backend_matches_the_server(nesterov):
    P = 77106
    rng = np.random.default_rng(11)
    lr_mult = LR_SCALES["runs"]
    model = MultModel(numpy_ops.NumpyBackend(), DECAYS["multiplier runs"], lr_mult)
    model.params = rng.standard_normal(P, dtype=np.float32)
    server = SGD(model.params.copy(), DECAYS["multiplier runs"], 0.9, 5e-4, nesterov=nesterov, lr_scale=lr_mult)
    local = LocalSGD(model, 0.9, 5e-4, nesterov=nesterov)
    for k in range(3):
        model.grads = rng.standard_normal(P, dtype=np.float32)
        local.step(0.1 * (k + 1))
        server.step(model.grads, 0.1 * (k + 1))
        # the op's float32 operations are the server's (lr * lr_mult formed first): equal bit for bit
        np.testing.assert_array_equal(model.params.view(np.uint32), server.params.view(np.uint32))
        np.testing.assert_array_equal(local.velocity.view(np.uint32), server.velocity.view(np.uint32))


@pytest.mark.parametrize("decay_kind", ["runs", "array"])
@pytest.mark.parametrize("momentum_kind", list(MOMENTA))
@pytest.mark.parametrize("in_place", [True, False])
def test_threaded_update_equals_the_serial_one_bit_for_bit(decay_kind, momentum_kind, in_place):
    """SGD(threads=2) and apply_delta(threads=2) share the blocks among threads: every bit of the weights and the
    velocity as with one thread, over three steps on awkward inputs (overflow to inf and NaN included); P is
    not a multiple of the block."""
    from mpiasgd.optim import apply_delta

    decay_mult = {"runs": MASKS["runs"], "array": DECAYS["array"]}[decay_kind]
    momentum, nesterov = MOMENTA[momentum_kind]
    P = decay_mult.size
    rng = np.random.default_rng(21)
    w = awkward(rng, P, 3.4e38)
    serial = SGD(w.copy(), decay_mult, momentum, 5e-4, chunk=4096, nesterov=nesterov)
    threaded = SGD(w.copy(), decay_mult, momentum, 5e-4, chunk=4096, nesterov=nesterov, threads=2)
    threaded.warm_up()
    for k in range(3):
        g = awkward(rng, P, -3.4e38)
        outs = (None, None) if in_place else (np.empty(P, np.float32), np.empty(P, np.float32))
        a = serial.step(g, 0.1 * (k + 1), out=outs[0])
        b = threaded.step(g, 0.1 * (k + 1), out=outs[1])
        np.testing.assert_array_equal(b.view(np.uint32), a.view(np.uint32))
        if momentum:
            np.testing.assert_array_equal(threaded.velocity.view(np.uint32), serial.velocity.view(np.uint32))
    delta = rng.standard_normal(P, dtype=np.float32)
    a = apply_delta(serial.params.copy(), delta, 0.37, out=None if in_place else np.empty(P, np.float32))
    b = apply_delta(serial.params.copy(), delta, 0.37, out=None if in_place else np.empty(P, np.float32), threads=2)
    np.testing.assert_array_equal(b.view(np.uint32), a.view(np.uint32))
    with pytest.raises(ValueError, match=r"SGD: threads must be an integer >= 1, got 0"):
        SGD(w.copy(), decay_mult, momentum, 5e-4, threads=0)
