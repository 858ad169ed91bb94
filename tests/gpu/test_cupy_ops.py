"""Every op of the cupy backend (our CUDA C kernels, cuBLAS for linear) against the numpy backend on
the shapes of real training: the cifar10 model's layers at batch 128, one larger layer (64 -> 128
channels, 3x3, 32x32, batch 256), stride 2, and a whole cifar10 forward/backward at batch 128; the
batch-norm, residual-shortcut and global-pooling ops on resnet20's CIFAR activations at batch 128
(16x32x32, 32x16x16, 64x8x8), LRN and max/avg pooling 3/2 ceil_mode on AlexNet's 96x55x55 and
256x27x27 at batch 32, dropout bit for bit, and sgd_momentum's nesterov and lr_scale forms.

Tolerance, stated once: |got - ref| <= TOL * (|ref| + max|ref|) elementwise (float32 sums of up to
~10^5 terms in a different order); a failure names the worst element.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpiasgd.comms.protocol import HEADER_BYTES
from mpiasgd.model import build_model
from mpiasgd.ops import get_backend
from mpiasgd.ops.contract import conv_ints
from mpiasgd.ops.cuda.constants import CONV_STAGES
from mpiasgd.ops.cuda.planner import autotune_tiles
from mpiasgd.ops.cuda.tiles import CONV_TILES, CONV_TRIAL_TILES, tile_shape

pytestmark = pytest.mark.gpu
TOL = 1e-3

# (name, x shape (N, C, H, W), w shape (K, C, R, S), stride, pad)
CONVS = [
    ("cifar10.conv1", (128, 3, 32, 32), (32, 3, 5, 5), 1, 2),
    ("cifar10.conv2", (128, 32, 15, 15), (32, 32, 5, 5), 1, 2),
    ("cifar10.conv3", (128, 32, 7, 7), (64, 32, 5, 5), 1, 2),
    ("large 64->128 3x3", (256, 64, 32, 32), (128, 64, 3, 3), 1, 1),
    ("stride 2 3x3", (128, 32, 32, 32), (64, 32, 3, 3), 2, 1),
]
POOLS = [((128, 32, 32, 32), 3, 2), ((128, 32, 15, 15), 3, 2), ((128, 64, 7, 7), 3, 2), ((256, 64, 32, 32), 2, 2)]


@pytest.fixture(scope="module")
def cp():
    return get_backend("cupy")


@pytest.fixture(scope="module")
def npo():
    return get_backend("numpy")


def close(got, ref, what):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    bound = TOL * (np.abs(ref) + np.abs(ref).max())
    excess = np.abs(got - ref) - bound
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    assert excess[worst] <= 0, (f"{what}: worst element {tuple(int(i) for i in worst)}: got {got[worst]:.8g}, "
                                f"expected {ref[worst]:.8g}")


def close_nonfinite(got, ref, what):
    """NaN where ref is NaN and the same infinity where ref is infinite (exactly), `close` elsewhere."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    finite = np.isfinite(ref)
    wrong = [tuple(int(i) for i in at) for at in np.argwhere(~finite & (got != ref) & ~(np.isnan(got) & np.isnan(ref)))]
    assert not wrong, f"{what}: element {wrong[0]}: got {got[wrong[0]]}, expected {ref[wrong[0]]} (non-finite)"
    close(np.where(finite, got, 0), np.where(finite, ref, 0), what)


def rand(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def sprinkle_nonfinite(rng, a, fraction=0.01):
    """`a` with NaN, +inf and -inf each at `fraction` of its elements (random places), in place."""
    flat = a.reshape(-1)
    pick = rng.permutation(flat.size)
    n = max(1, int(flat.size * fraction))
    flat[pick[:n]], flat[pick[n:2 * n]], flat[pick[2 * n:3 * n]] = np.nan, np.inf, -np.inf
    return a


@pytest.mark.parametrize("name,xs,ws,stride,pad", CONVS, ids=[c[0] for c in CONVS])
def test_conv_passes(cp, npo, name, xs, ws, stride, pad):
    rng = np.random.default_rng(0)
    x, w, b = rand(rng, xs), rand(rng, ws) * 0.1, rand(rng, ws[:1])
    y = npo.conv2d_fprop(x, w, b, stride, pad)
    dy = rand(rng, y.shape)
    d = cp.asarray
    close(cp.to_numpy(cp.conv2d_fprop(d(x), d(w), d(b), stride, pad)), y, f"{name} fprop")
    close(cp.to_numpy(cp.conv2d_dgrad(d(dy), d(w), xs, stride, pad)), npo.conv2d_dgrad(dy, w, xs, stride, pad),
          f"{name} dgrad")
    close(cp.to_numpy(cp.conv2d_wgrad(d(dy), d(x), ws, stride, pad)), npo.conv2d_wgrad(dy, x, ws, stride, pad),
          f"{name} wgrad")
    close(cp.to_numpy(cp.bias_grad(d(dy))), npo.bias_grad(dy), f"{name} bias_grad")
    # reproducible: no atomics, fixed reduction order
    a = cp.to_numpy(cp.conv2d_wgrad(d(dy), d(x), ws, stride, pad))
    assert np.array_equal(a, cp.to_numpy(cp.conv2d_wgrad(d(dy), d(x), ws, stride, pad)))


@pytest.mark.parametrize("name,xs,ws,stride,pad", CONVS, ids=[c[0] for c in CONVS])
def test_conv_passes_exact_on_integers(cp, npo, name, xs, ws, stride, pad):
    """Inputs in -3..3: every product and partial sum is an integer below 2^24, so float32 is exact in
    any order and the GPU must equal the float64 reference bit for bit; a tap dropped or counted twice
    (split boundary, digit carry, padding test) cannot hide in a tolerance. Each pass runs with each
    tile forced and split-K as chosen, with one range and with three (ranges that cut through (c, r, s)),
    with the tap table and testing bounds, so that every kernel instantiation runs on the GPU (the
    trial tiles too, which bench/kernels.py --tiles times):
    fprop/dgrad whole and partial, dgrad's stride-1 and strided paths, in both tiles (helper-18: some
    ran in neither tile otherwise). Each run is a backend of its own (`cp.configured`: the same kernels)."""
    rng = np.random.default_rng(2)
    xs = (min(xs[0], 128), *xs[1:])  # the float64 reference of the batch-256 layer would dominate the run
    N, _, H, W = xs
    K, _, R, S = ws
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    x, w, b, dy = (rng.integers(-3, 4, size=sz).astype(np.float32) for sz in (xs, ws, (K,), (N, K, P, Q)))
    x64, w64, b64, dy64 = (a.astype(np.float64) for a in (x, w, b, dy))
    refs = {"fprop": npo.conv2d_fprop(x64, w64, b64, stride, pad),
            "fprop without bias": npo.conv2d_fprop(x64, w64, None, stride, pad),  # NULL bias: runtime.NULL
            "dgrad": npo.conv2d_dgrad(dy64, w64, xs, stride, pad),
            "wgrad": npo.conv2d_wgrad(dy64, x64, ws, stride, pad)}
    x, w, b, dy = (cp.asarray(a) for a in (x, w, b, dy))
    runs = [*itertools.product(CONV_TILES, (None, 1, 3), (32, 0)),
            *itertools.product(CONV_TRIAL_TILES, (None, 3), (32,)),  # (trial: their tables and splits;
            *itertools.product([t for t in CONV_TRIAL_TILES if tile_shape(t)[5] == 1],
                               (None,), (0,))]  # the one-stage loop testing bounds too)
    for tile, splits, taps in runs:
        # tab_max_taps 0: no tap table, bounds tested per load
        forced = cp.configured(tile_override=tile, split_override=splits, tab_max_taps=taps)
        got = {"fprop": forced.conv2d_fprop(x, w, b, stride, pad),
               "fprop without bias": forced.conv2d_fprop(x, w, None, stride, pad),
               "dgrad": forced.conv2d_dgrad(dy, w, xs, stride, pad),
               "wgrad": forced.conv2d_wgrad(dy, x, ws, stride, pad)}
        for what, ref in refs.items():
            g = cp.to_numpy(got[what])
            assert np.array_equal(g, ref), (f"{name} {what} (tile {tile}, split override {splits}, taps {taps}): "
                                            f"{int(np.sum(g != ref))} elements differ from the exact result, "
                                            f"worst by {float(np.max(np.abs(g - ref)))}")


@pytest.mark.parametrize("name,xs,ws,stride,pad", CONVS, ids=[c[0] for c in CONVS])
def test_pipelined_and_one_stage_loops_agree_bit_for_bit(cp, name, xs, ws, stride, pad):
    """The cp.async pipeline (CONV_STAGES 3, sm_80+) changes when a K-slab reaches shared memory, not the
    order of the sums: on float inputs each pass equals the one-stage loop's (the CONV_STAGES=1 trial
    tiles) bit for bit, on the device as in the CPU harness. (On sm_75 both are the one-stage loop.)"""
    rng = np.random.default_rng(3)
    xs = (min(xs[0], 64), *xs[1:])
    N, _, H, W = xs
    K, _, R, S = ws
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    x, w, b, dy = (cp.asarray(rand(rng, sz)) for sz in (xs, ws, (K,), (N, K, P, Q)))
    for tile in CONV_TILES:
        got = {}
        for stages in (CONV_STAGES, 1):
            forced = cp.configured(tile_override=(*tile_shape(tile)[:5], stages))
            got[stages] = [cp.to_numpy(a) for a in (forced.conv2d_fprop(x, w, b, stride, pad),
                                                     forced.conv2d_dgrad(dy, w, xs, stride, pad),
                                                     forced.conv2d_wgrad(dy, x, ws, stride, pad))]
        for what, many, one in zip(("fprop", "dgrad", "wgrad"), got[CONV_STAGES], got[1], strict=True):
            assert np.isfinite(one).all() and np.array_equal(many, one), (
                f"{name} {what} (tile {tile}): {int(np.sum(many != one))} elements differ between "
                f"{CONV_STAGES} stages and 1, worst by {float(np.nanmax(np.abs(many - one)))}")


def test_autotune_times_each_tile_and_keeps_the_plan(cp, npo):
    """conv_algo "autotune" on the device, cifar10's conv2 at batch 128: the first call of each pass times
    every tile that runs on this device (each > 0 ms), keeps the fastest unless the heuristic's tile is within
    the planner's margin of it (then the heuristic's), and gives the numpy result; a second call makes no new
    plan and gives the same result bit for bit."""
    tuned = cp.configured(conv_algo="autotune")  # the same kernels, a planner with no plans yet
    rng = np.random.default_rng(4)
    _, xs, ws, stride, pad = CONVS[1]
    N, _, H, W = xs
    K = ws[0]
    x, w, b, dy = (rand(rng, sz) for sz in (xs, ws, (K,), (N, K, H, W)))
    refs = {"fprop": npo.conv2d_fprop(x, w, b, stride, pad), "dgrad": npo.conv2d_dgrad(dy, w, xs, stride, pad),
            "wgrad": npo.conv2d_wgrad(dy, x, ws, stride, pad)}
    xd, wd, bd, dyd = (cp.asarray(a) for a in (x, w, b, dy))
    calls = {"fprop": lambda: tuned.conv2d_fprop(xd, wd, bd, stride, pad),
             "dgrad": lambda: tuned.conv2d_dgrad(dyd, wd, xs, stride, pad),
             "wgrad": lambda: tuned.conv2d_wgrad(dyd, xd, ws, stride, pad)}
    tiles = autotune_tiles(tuned.device.compute_capability())
    for i, (what, call) in enumerate(calls.items()):
        first = cp.to_numpy(call())
        plan = tuned.conv_plans()[i]
        assert plan.op == f"conv2d_{what}" and [t for t, _ in plan.times] == tiles, plan.describe()
        times = dict(plan.times)
        fastest = min(plan.times, key=lambda t: t[1])[0]
        rule = tuned.planner.conv_tile({"fprop": K, "dgrad": xs[1], "wgrad": K}[what])  # the GEMM's M rows
        keep_rule = rule in times and times[rule] * (1 - tuned.planner.margin) <= times[fastest]
        assert all(ms > 0 for _, ms in plan.times) and plan.tile == (rule if keep_rule else fastest), plan.describe()
        close(first, refs[what], f"autotuned {what} ({plan.describe()})")
        assert np.array_equal(cp.to_numpy(call()), first) and len(tuned.conv_plans()) == i + 1


@pytest.mark.parametrize("xs,k,s", POOLS)
def test_pool_relu(cp, npo, xs, k, s):
    rng = np.random.default_rng(1)
    x = rand(rng, xs)
    y, arg = npo.maxpool_fprop(x, k, s)
    yc, argc = cp.maxpool_fprop(cp.asarray(x), k, s)
    close(cp.to_numpy(yc), y, "maxpool_fprop")
    dy = rand(rng, y.shape)
    close(cp.to_numpy(cp.maxpool_bprop(cp.asarray(dy), argc, xs, k, s)), npo.maxpool_bprop(dy, arg, xs, k, s),
          "maxpool_bprop")
    r = npo.relu_fprop(x)
    close(cp.to_numpy(cp.relu_fprop(cp.asarray(x))), r, "relu_fprop")
    close(cp.to_numpy(cp.relu_bprop(cp.asarray(x), cp.asarray(r))), npo.relu_bprop(x, r), "relu_bprop")


@pytest.mark.parametrize("xs,k,s", POOLS[:2])
def test_pool_relu_nonfinite(cp, npo, xs, k, s):
    """NaN and +-inf (on tied values) propagate as in numpy: a window holding a NaN pools to NaN and routes
    its gradient to its first NaN (same argmax), relu(NaN) = NaN, relu_bprop = dy * (y > 0)."""
    rng = np.random.default_rng(5)
    x = sprinkle_nonfinite(rng, np.round(rand(rng, xs) * 2) / 2)
    y, arg = npo.maxpool_fprop(x, k, s)
    yc, argc = cp.maxpool_fprop(cp.asarray(x), k, s)
    assert np.isnan(y).any() and np.array_equal(cp.to_numpy(yc), y, equal_nan=True), "maxpool_fprop"
    assert np.array_equal(cp.to_numpy(argc), arg), "maxpool_fprop argmax"
    dy = rand(rng, y.shape)
    close(cp.to_numpy(cp.maxpool_bprop(cp.asarray(dy), argc, xs, k, s)), npo.maxpool_bprop(dy, arg, xs, k, s),
          "maxpool_bprop")
    r = npo.relu_fprop(x)
    assert np.array_equal(cp.to_numpy(cp.relu_fprop(cp.asarray(x))), r, equal_nan=True), "relu_fprop"
    g = sprinkle_nonfinite(rng, rand(rng, xs))
    with np.errstate(invalid="ignore"):
        ref = npo.relu_bprop(g, r)
    assert np.array_equal(cp.to_numpy(cp.relu_bprop(cp.asarray(g), cp.asarray(r))), ref, equal_nan=True), "relu_bprop"


def test_conv_fused_relu_nonfinite(cp, npo):
    """NaN and +-inf in x through the fused bias + ReLU epilogues (relu=1, which the wrappers do not use
    yet): conv2d_fprop with and without the tap table, and split-K (conv2d_fprop_partial, then
    conv2d_split_reduce), against numpy relu_fprop(conv2d_fprop): NaN stays NaN, -inf becomes 0."""
    import cupy

    _, xs, ws, stride, pad = CONVS[1]
    xs = (16, *xs[1:])
    N, C, H, W = xs
    K, _, R, S = ws
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    rng = np.random.default_rng(6)
    x, w, b = sprinkle_nonfinite(rng, rand(rng, xs), 0.001), rand(rng, ws) * 0.1, rand(rng, (K,))
    with np.errstate(invalid="ignore"):
        pre = npo.conv2d_fprop(x, w, b, stride, pad)
    assert np.isnan(pre).any() and np.isneginf(pre).any()
    ref = npo.relu_fprop(pre)
    op = "conv2d_fprop"
    geometry = conv_ints(op, N, C, H, W, K, R, S, P, Q, stride, pad)
    tile = cp.planner.conv_tile(K)
    forced = cp.configured(split_override=3)
    splits, chunk = forced.planner.gemm_split(K, N * P * Q, C * R * S, tile)
    xd, wd, bd = cp.asarray(x), cp.asarray(w), cp.asarray(b)
    for table in (forced.planner.conv_tap_table(op, N, C, H, W, K, R, S, P, Q, stride, pad), None):
        y = cupy.full((N, K, P, Q), -1.0, dtype=np.float32)
        grid, block = forced.planner.conv_launch(M=K, NG=N * P * Q, tile=tile)
        forced.launch(op, grid, block, (xd, wd, bd, y, *geometry, np.int32(1), table), tile=tile)
        close_nonfinite(cp.to_numpy(y), ref, f"fused relu (tap table {table is not None})")
        part = cupy.full((splits, K, N * P * Q), np.nan, dtype=np.float32)
        grid, block = forced.planner.conv_launch(M=K, NG=N * P * Q, splits=splits, tile=tile)
        forced.launch("conv2d_fprop_partial", grid, block, (xd, wd, part, *geometry, np.int64(chunk), table),
                      tile=tile)
        y = cupy.full((N, K, P, Q), -1.0, dtype=np.float32)
        forced.split_reduce(op, part, bd, y, splits, N, K, P * Q, tile, relu=1)
        close_nonfinite(cp.to_numpy(y), ref, f"split-K {splits} + split_reduce relu (tap table {table is not None})")


def test_softmax_nonfinite(cp, npo):
    """Rows with NaN, +inf or only -inf: loss NaN, dlogits NaN on those rows, and the correct count of
    numpy's argmax (first NaN, else first maximum; two NaNs in different threads' subsets)."""
    rng = np.random.default_rng(7)
    logits, labels = rand(rng, (64, 300)) * 3, rng.integers(0, 300, 64)
    logits[0, [290, 43]], labels[0] = np.nan, 43
    logits[1, 3], labels[1] = np.inf, 3
    logits[2, :], labels[2] = -np.inf, 0
    with np.errstate(invalid="ignore"):
        loss, dl, correct = npo.softmax_xent(logits, labels)
    loss_c, dl_c, correct_c = cp.softmax_xent(cp.asarray(logits), cp.asarray(labels, labels.dtype))
    assert np.isnan(loss) and np.isnan(loss_c) and correct_c == correct >= 3, (
        f"loss {loss_c} (numpy {loss}), correct {correct_c} (numpy {correct})")
    close_nonfinite(cp.to_numpy(dl_c), dl, "softmax_xent dlogits")


@pytest.mark.parametrize("n", [128, 1024])
def test_linear_softmax(cp, npo, n):
    rng = np.random.default_rng(2)
    x, w, b = rand(rng, (n, 576)), rand(rng, (10, 576)) * 0.05, rand(rng, (10,))
    labels = rng.integers(0, 10, n)
    y = npo.linear_fprop(x, w, b)
    d = cp.asarray
    close(cp.to_numpy(cp.linear_fprop(d(x), d(w), d(b))), y, "linear_fprop")
    dy = rand(rng, y.shape)
    close(cp.to_numpy(cp.linear_dgrad(d(dy), d(w))), npo.linear_dgrad(dy, w), "linear_dgrad")
    close(cp.to_numpy(cp.linear_wgrad(d(dy), d(x))), npo.linear_wgrad(dy, x), "linear_wgrad")
    loss, dl, correct = npo.softmax_xent(y, labels)
    loss_c, dl_c, correct_c = cp.softmax_xent(d(y), cp.asarray(labels, labels.dtype))
    assert loss_c == pytest.approx(loss, rel=1e-5) and correct_c == correct
    close(cp.to_numpy(dl_c), dl, "softmax_xent dlogits")


def test_sgd_momentum(cp):
    rng = np.random.default_rng(3)
    p, v, g, decay = (rand(rng, 85_098) for _ in range(4))
    ref_v = 0.9 * v + (g + decay * p)
    ref_p = p - 0.01 * ref_v
    pc, vc = cp.asarray(p), cp.asarray(v)
    cp.sgd_momentum(pc, vc, cp.asarray(g), cp.asarray(decay), 0.9, 0.01)
    close(cp.to_numpy(vc), ref_v, "sgd velocity")
    close(cp.to_numpy(pc), ref_p, "sgd params")


@pytest.mark.parametrize("batch", [128, 256])
def test_cifar10_model_gradient(cp, batch):
    """The whole model: the flat gradient of one minibatch on the device matches the numpy backend's."""
    rng = np.random.default_rng(4)
    ref, dev = build_model("cifar10", "numpy"), build_model("cifar10", "cupy")
    p = ref.init_params(0)
    p[-10 * 577:] = rand(rng, 10 * 577) * 0.01  # a non-zero classifier, so every layer gets a gradient
    g = np.zeros_like(p)
    ref.bind(p, g)
    pc, gc = cp.asarray(p), cp.zeros(p.size)
    dev.bind(pc, gc)
    x, y = rand(rng, (batch, 3, 32, 32)), rng.integers(0, 10, batch)
    loss, correct = ref.forward_backward(x, y)
    loss_c, correct_c = dev.forward_backward(cp.asarray(x), cp.asarray(y, y.dtype))
    assert loss_c == pytest.approx(loss, rel=1e-4) and correct_c == correct
    for name, offset, shape in ref.layout():
        size = int(np.prod(shape))
        close(cp.to_numpy(gc[offset:offset + size]), g[offset:offset + size], f"gradient of {name}")


RESNET20 = [(128, 16, 32, 32), (128, 32, 16, 16), (128, 64, 8, 8)]  # its activations on CIFAR, batch 128
ALEXNET_LRN = [(32, 96, 55, 55), (32, 256, 27, 27)]  # conv1 and conv2 outputs at batch 32


@pytest.mark.parametrize("xs", RESNET20, ids=[f"{c}x{h}x{w}" for _, c, h, w in RESNET20])
def test_batchnorm(cp, npo, xs):
    """batchnorm_stats (with the running update), _fprop and _bprop against numpy (which sums in float64),
    and bit-identical when run again (one block per channel, fixed-order trees: no atomics)."""
    rng = np.random.default_rng(8)
    C = xs[1]
    x = rand(rng, xs) * 2 + rand(rng, (1, C, 1, 1)) * 3  # (N, C, H, W), per-channel offsets
    gamma, beta, dy = rand(rng, (C,)), rand(rng, (C,)), rand(rng, xs)
    rm, rv = rand(rng, (C,)), np.abs(rand(rng, (C,))) + 0.5
    d = cp.asarray
    rm_c, rv_c = d(rm), d(rv)
    mean, var = npo.batchnorm_stats(x, rm, rv, 0.1)
    mean_c, var_c = cp.batchnorm_stats(d(x), rm_c, rv_c, 0.1)
    for got, ref, what in ((mean_c, mean, "mean"), (var_c, var, "var"), (rm_c, rm, "running_mean"),
                           (rv_c, rv, "running_var")):
        close(cp.to_numpy(got), ref, f"batchnorm_stats {what}")
    again = cp.batchnorm_stats(d(x))
    assert all(np.array_equal(cp.to_numpy(a), cp.to_numpy(b)) for a, b in zip(again, (mean_c, var_c), strict=True))
    y = cp.batchnorm_fprop(d(x), d(gamma), d(beta), mean_c, var_c, 1e-5)
    close(cp.to_numpy(y), npo.batchnorm_fprop(x, gamma, beta, mean, var, 1e-5), "batchnorm_fprop")
    dgamma, dbeta = np.empty(C, np.float32), np.empty(C, np.float32)
    dx = npo.batchnorm_bprop(dy, x, gamma, mean, var, 1e-5, dgamma, dbeta)
    dgamma_c, dbeta_c = cp.zeros(C), cp.zeros(C)
    dx_c = cp.batchnorm_bprop(d(dy), d(x), d(gamma), mean_c, var_c, 1e-5, dgamma_c, dbeta_c)
    close(cp.to_numpy(dgamma_c), dgamma, "batchnorm_bprop dgamma")
    close(cp.to_numpy(dbeta_c), dbeta, "batchnorm_bprop dbeta")
    close(cp.to_numpy(dx_c), dx, "batchnorm_bprop dx")
    dgamma2, dbeta2 = cp.zeros(C), cp.zeros(C)
    assert cp.batchnorm_bprop(d(dy), d(x), d(gamma), mean_c, var_c, 1e-5, dgamma2, dbeta2, need_dx=False) is None
    assert np.array_equal(cp.to_numpy(dgamma2), cp.to_numpy(dgamma_c))
    assert np.array_equal(cp.to_numpy(dbeta2), cp.to_numpy(dbeta_c))


@pytest.mark.parametrize("xs", RESNET20[:2], ids=[f"{c}x{h}x{w}" for _, c, h, w in RESNET20[:2]])
def test_residual_shortcut(cp, npo, xs):
    """resnet20's option-A shortcut to the next stage (stride 2, half the new channels as zero padding on
    either side) and the residual add (fresh and in place): copies and one add, equal to numpy exactly."""
    rng = np.random.default_rng(9)
    C = xs[1]
    x = rand(rng, xs)
    y = npo.subsample_pad_fprop(x, 2, C // 2, C // 2)
    y_c = cp.subsample_pad_fprop(cp.asarray(x), 2, C // 2, C // 2)
    assert y.shape == (xs[0], 2 * C, xs[2] // 2, xs[3] // 2) and np.array_equal(cp.to_numpy(y_c), y)
    dy = rand(rng, y.shape)
    dx_c = cp.subsample_pad_bprop(cp.asarray(dy), xs, 2, C // 2, C // 2)
    assert np.array_equal(cp.to_numpy(dx_c), npo.subsample_pad_bprop(dy, xs, 2, C // 2, C // 2))
    b = rand(rng, y.shape)
    total = npo.add(y, b)
    assert np.array_equal(cp.to_numpy(cp.add(y_c, cp.asarray(b))), total)
    assert np.array_equal(cp.to_numpy(cp.add(y_c, cp.asarray(b), out=y_c)), total)


def test_global_avgpool(cp, npo):
    """resnet20's last activations (128, 64, 8, 8) -> (128, 64), and the backward."""
    rng = np.random.default_rng(10)
    x, dy = rand(rng, RESNET20[2]), rand(rng, RESNET20[2][:2])
    close(cp.to_numpy(cp.global_avgpool_fprop(cp.asarray(x))), npo.global_avgpool_fprop(x), "global_avgpool_fprop")
    assert np.array_equal(cp.to_numpy(cp.global_avgpool_bprop(cp.asarray(dy), x.shape)),
                          npo.global_avgpool_bprop(dy, x.shape))


@pytest.mark.parametrize("xs", ALEXNET_LRN, ids=[f"{c}x{h}x{w}" for _, c, h, w in ALEXNET_LRN])
def test_alexnet_lrn_and_pooling(cp, npo, xs):
    """AlexNet's response normalisation (size 5, alpha 1e-4, beta 0.75, k 2) and its overlapping max
    pooling 3/2 with cuda-convnet's output size (ceil_mode: 55 -> 27, 27 -> 13), plus average pooling 3/2
    ceil_mode and 3/2 pad 1 (count_include_pad both ways)."""
    rng = np.random.default_rng(11)
    x = np.maximum(rand(rng, xs) * 3, 0)  # ReLU outputs, as AlexNet normalises
    d = cp.asarray
    y, scale = npo.lrn_fprop(x, 5, 1e-4, 0.75, 2.0)
    y_c, scale_c = cp.lrn_fprop(d(x), 5, 1e-4, 0.75, 2.0)
    close(cp.to_numpy(scale_c), scale, "lrn_fprop scale")
    close(cp.to_numpy(y_c), y, "lrn_fprop y")
    dy = rand(rng, xs)
    close(cp.to_numpy(cp.lrn_bprop(d(dy), d(x), y_c, scale_c, 5, 1e-4, 0.75)),
          npo.lrn_bprop(dy, x, y, scale, 5, 1e-4, 0.75), "lrn_bprop")
    x = rand(rng, xs)
    m, arg = npo.maxpool_fprop(x, 3, 2, 0, True)
    m_c, arg_c = cp.maxpool_fprop(d(x), 3, 2, 0, True)
    assert m.shape[2] == (xs[2] - 3 + 1) // 2 + 1  # ceil((H - 3)/2) + 1: 27 and 13
    assert np.array_equal(cp.to_numpy(m_c), m) and np.array_equal(cp.to_numpy(arg_c), arg), "maxpool 3/2 ceil"
    g = rand(rng, m.shape)
    close(cp.to_numpy(cp.maxpool_bprop(d(g), arg_c, xs, 3, 2, 0, True)), npo.maxpool_bprop(g, arg, xs, 3, 2, 0, True),
          "maxpool_bprop 3/2 ceil")
    for pad, ceil, include in ((0, True, True), (1, False, False), (1, True, True)):
        a = npo.avgpool_fprop(x, 3, 2, pad, ceil, include)
        close(cp.to_numpy(cp.avgpool_fprop(d(x), 3, 2, pad, ceil, include)), a, f"avgpool 3/2 pad {pad} ceil {ceil}")
        g = rand(rng, a.shape)
        close(cp.to_numpy(cp.avgpool_bprop(d(g), xs, 3, 2, pad, ceil, include)),
              npo.avgpool_bprop(g, xs, 3, 2, pad, ceil, include), f"avgpool_bprop 3/2 pad {pad} ceil {ceil}")
    m, arg = npo.maxpool_fprop(x, 3, 2, 1)
    m_c, arg_c = cp.maxpool_fprop(d(x), 3, 2, 1)
    assert np.array_equal(cp.to_numpy(m_c), m) and np.array_equal(cp.to_numpy(arg_c), arg), "maxpool 3/2 pad 1"


@pytest.mark.parametrize("shape, p", [((32, 4096), 0.5), ((128, 64, 8, 8), 0.1), ((7, 1001), 0.9)])
def test_dropout_bit_for_bit(cp, npo, shape, p):
    """The Philox mask on the device is numpy's, bit for bit, for keys past 2^32 (AlexNet's fc layers at
    batch 32; an odd size: a partial last counter); the backward draws the same mask."""
    rng = np.random.default_rng(12)
    x, dy = rand(rng, shape), rand(rng, shape)
    key = (2**63 + 12345, 2**33 + 7, 5)  # seed, minibatch, layer
    y_c = cp.to_numpy(cp.dropout_fprop(cp.asarray(x), p, *key))
    assert np.array_equal(y_c, npo.dropout_fprop(x, p, *key)), "dropout_fprop"
    dx_c = cp.to_numpy(cp.dropout_bprop(cp.asarray(dy), p, *key))
    assert np.array_equal(dx_c, npo.dropout_bprop(dy, p, *key)), "dropout_bprop"
    assert np.array_equal(y_c == 0, dx_c == 0)
    assert abs(np.mean(y_c == 0) - p) < 0.02, f"dropped fraction {np.mean(y_c == 0)} for p {p}"


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_nesterov_lr_scale(cp, npo, nesterov):
    """sgd_momentum's nesterov form and lr_scale multipliers (resnet20-sized: 272,474 parameters), three
    steps against numpy's float32 arithmetic (FMA contraction on the device: close, not equal)."""
    rng = np.random.default_rng(13)
    n = 272_474
    p, decay = rand(rng, n), np.where(rng.random(n) < 0.9, 5e-4, 0).astype(np.float32)
    lr_scale = rng.choice([0.5, 1.0, 2.0], n).astype(np.float32)
    v = np.zeros(n, np.float32)
    pc, vc = cp.asarray(p), cp.asarray(v)
    for _ in range(3):
        g = rand(rng, n)
        npo.sgd_momentum(p, v, g, decay, 0.9, 0.1, nesterov=nesterov, lr_scale=lr_scale)
        cp.sgd_momentum(pc, vc, cp.asarray(g), cp.asarray(decay), 0.9, 0.1, nesterov=nesterov,
                        lr_scale=cp.asarray(lr_scale))
    close(cp.to_numpy(vc), v, f"sgd velocity (nesterov {nesterov})")
    close(cp.to_numpy(pc), p, f"sgd params (nesterov {nesterov})")


def test_staging_on_the_device():
    """Pinned and CUDA-aware staging with real CuPy transfers (the latter without MPI: views and copies)."""
    import cupy

    from mpiasgd.comms.protocol import Tag
    from mpiasgd.comms.staging import make_staging

    for cuda_aware in (False, True):
        s = make_staging("cupy", cuda_aware, 1000)
        assert isinstance(s.params, cupy.ndarray) and s.params.shape == (1000,) and s.params.flags.c_contiguous
        host = np.arange(1000, dtype=np.float32)
        if cuda_aware:
            s.params[...] = cupy.asarray(host)
        else:
            s.weights.payload[:] = host
        s.after_receive()
        assert np.array_equal(cupy.asnumpy(s.params), host)
        s.grads[...] = -s.params
        s.finish_compute()
        s.push.stamp(Tag.PUSH, 1, step=1)
        s.before_send()
        sent = cupy.asnumpy(s.send_buf) if cuda_aware else s.send_buf
        assert np.array_equal(sent[HEADER_BYTES:].view(np.float32), -host)
        assert np.array_equal(sent[:HEADER_BYTES], s.push.buf[:HEADER_BYTES])


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_wire_codec_on_the_device_matches_numpy_bit_for_bit(wire):
    """mpiasgd.comms.wire on cupy arrays (the same array operations; fp16 through CUDA's round-to-nearest-even
    cast) gives the numpy path's bits, specials and error feedback included; the pinned and CUDA-aware
    stagings decode and encode on the device."""
    import cupy

    from mpiasgd.comms.protocol import Tag
    from mpiasgd.comms.staging import make_staging
    from mpiasgd.comms.wire import ErrorFeedback, decode, encode, wire_dtype

    rng = np.random.default_rng(0)
    x = (np.exp2(rng.uniform(-149, 128, 1 << 20)) * rng.choice([-1.0, 1.0], 1 << 20)).astype(np.float32)
    x[:6] = [np.nan, -np.inf, np.inf, 0.0, -0.0, 65520.0]
    x[6:8] = np.array([0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32)  # NaNs the rounding would break
    dt = wire_dtype(wire)
    ref = encode(wire, x, np.empty(x.size, dt))
    got = encode(wire, cupy.asarray(x), cupy.empty(x.size, dt))
    assert np.array_equal(cupy.asnumpy(got).view(np.uint16), ref.view(np.uint16))
    back = decode(wire, got, cupy.empty(x.size, cupy.float32))
    assert np.array_equal(cupy.asnumpy(back).view(np.uint32), decode(wire, ref, np.empty(x.size, np.float32))
                          .view(np.uint32))
    g = (rng.standard_normal(1000) * 1e-3).astype(np.float32)
    host, device = ErrorFeedback(wire, 900), ErrorFeedback(wire, 900)
    for _ in range(3):
        a = host.encode(g, np.empty(1000, dt))
        b = device.encode(cupy.asarray(g), cupy.empty(1000, dt))
        assert np.array_equal(cupy.asnumpy(b).view(np.uint16), a.view(np.uint16))
    assert np.array_equal(cupy.asnumpy(device.residual), host.residual)
    for cuda_aware in (False, True):
        s = make_staging("cupy", cuda_aware, 1000, wire=wire)
        coded = encode(wire, g, np.empty(1000, dt))
        if cuda_aware:
            s.recv_buf[HEADER_BYTES:].view(dt)[...] = cupy.asarray(coded)
        else:
            s.weights.payload[:] = coded
        s.after_receive()
        assert np.array_equal(cupy.asnumpy(s.params), decode(wire, coded, np.empty(1000, np.float32)))
        s.grads[...] = cupy.asarray(g)
        s.finish_compute()
        s.push.stamp(Tag.PUSH, 1, step=1)
        s.before_send()
        sent = cupy.asnumpy(s.send_buf) if cuda_aware else s.send_buf
        assert np.array_equal(sent[HEADER_BYTES:].view(np.uint16), coded.view(np.uint16))


def test_the_replica_digest_on_the_device_is_the_hosts():
    """sync and pipeline REPORTs: the digest reduced where the weights are gives the host's, chunks included."""
    import cupy

    from mpiasgd.comms.protocol import DIGEST_CHUNK, weights_digest

    rng = np.random.default_rng(5)
    params = rng.standard_normal(DIGEST_CHUNK + 1234).astype(np.float32)
    buffers = rng.standard_normal(100).astype(np.float32)
    assert weights_digest(cupy.asarray(params), cupy.asarray(buffers)) == weights_digest(params, buffers)
