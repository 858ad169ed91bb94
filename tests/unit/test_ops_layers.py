"""NumPy ops backend, the layer ops beyond conv/linear: pooling with padding and ceil_mode, average and
global average pooling, batch normalisation, the residual add and option-A shortcut, dropout (Philox),
local response normalisation, and sgd_momentum's nesterov and lr_scale.

Each forward against a plain loop or the formula of `mpiasgd.ops.protocol`, each backward against
float64 central finite differences on small random shapes, and the argument checks. Output sizes and
divisors are written out by hand from PyTorch's rules.
"""

import numpy as np
import pytest
from kit.grads import assert_close, numeric_grad

from mpiasgd.ops import get_backend, numpy_ops

ops = get_backend("numpy")

# tolerances, stated once: |got - ref| <= atol + rtol * |ref| elementwise (kit.grads: float64 analytic vs
# float64 finite differences or a float64 loop)
ATOL32, RTOL32 = 1e-5, 1e-5  # float32 result vs float64 reference (values are O(1))




# ----------------------------------------------------------------------------------------------
# pooling: output size, max, average, global average


# (H, kernel, stride, pad, ceil_mode) -> P, each worked out from PyTorch's rule by hand
POOL_SIZES = [
    ((32, 3, 2, 0, False), 15),  # (32 - 3)//2 + 1 = 15
    ((32, 3, 2, 0, True), 16),  # ceil(29/2) + 1 = 16: cuda-convnet's outputsX for cifar's 3/2 pooling
    ((6, 3, 2, 0, True), 3),  # ceil(3/2) + 1 = 3; the last window starts at 4 < 6: kept, clipped to 4..5
    ((6, 3, 2, 1, False), 3),  # (6 + 2 - 3)//2 + 1 = 3
    ((6, 3, 2, 1, True), 4),  # ceil(5/2) + 1 = 4; starts at padded 6 < 6 + 1: kept (image row 5 only)
    ((5, 2, 3, 1, True), 2),  # ceil(5/3) + 1 = 3, but the third starts at padded 6 >= 5 + 1: dropped
    ((2, 3, 3, 1, True), 1),  # ceil(1/3) + 1 = 2, but the second starts at padded 3 >= 2 + 1: dropped
    ((4, 2, 2, 1, True), 3),  # ceil(4/2) + 1 = 3; the last starts at padded 4 < 5: kept (row 3 + padding)
    ((7, 3, 2, 1, False), 4),  # (7 + 2 - 3)//2 + 1 = 4
    ((7, 7, 1, 3, False), 7),  # "same" pooling: (7 + 6 - 7)//1 + 1 = 7
    ((3, 3, 1, 0, True), 1),  # a window covering the whole input, ceil or not
]


@pytest.mark.parametrize("geometry, P", POOL_SIZES)
def test_pool_output_size_follows_pytorch(geometry, P):
    H, k, s, pad, ceil_mode = geometry
    x = np.zeros((1, 2, H, H), dtype=np.float32)
    y, argmax = ops.maxpool_fprop(x, k, s, pad, ceil_mode)
    assert y.shape == argmax.shape == (1, 2, P, P)
    assert ops.avgpool_fprop(x, k, s, pad, ceil_mode).shape == (1, 2, P, P)
    # rows and columns are sized independently
    wide = np.zeros((1, 1, H, 2 * H + 5), dtype=np.float32)
    assert ops.maxpool_fprop(wide, k, s, pad, ceil_mode)[0].shape[2] == P


def window(n: int, p: int, k: int, s: int, pad: int) -> tuple[int, int]:
    """(first, end) image rows of window p: start p*s - pad clipped to [0, n)."""
    return max(p * s - pad, 0), min(p * s - pad + k, n)


def maxpool_loop(x, k, s, pad, P, Q):
    """y and argmax by a loop over windows: the image pixels only, strict '>' (the first maximum wins),
    argmax the offset inside the unclipped window whose origin is (p*s - pad, q*s - pad)."""
    N, C, H, W = x.shape
    y, argmax = np.zeros((N, C, P, Q)), np.zeros((N, C, P, Q), dtype=int)
    for n in range(N):
        for c in range(C):
            for p in range(P):
                for q in range(Q):
                    best, at = None, None
                    h0, h1 = window(H, p, k, s, pad)
                    w0, w1 = window(W, q, k, s, pad)
                    for h in range(h0, h1):
                        for w in range(w0, w1):
                            if best is None or x[n, c, h, w] > best:
                                best, at = x[n, c, h, w], (h - (p * s - pad)) * k + (w - (q * s - pad))
                    y[n, c, p, q], argmax[n, c, p, q] = best, at
    return y, argmax


def avgpool_loop(x, k, s, pad, P, Q, count_include_pad):
    """y by a loop over windows: the sum of the image pixels over the divisor of AvgPool2d."""
    N, C, H, W = x.shape
    y = np.zeros((N, C, P, Q))
    for p in range(P):
        for q in range(Q):
            h0, h1 = window(H, p, k, s, pad)
            w0, w1 = window(W, q, k, s, pad)
            if count_include_pad:  # the window inside the padded input [-pad, H + pad)
                rows = min(p * s - pad + k, H + pad) - (p * s - pad)
                cols = min(q * s - pad + k, W + pad) - (q * s - pad)
            else:
                rows, cols = h1 - h0, w1 - w0
            y[:, :, p, q] = x[:, :, h0:h1, w0:w1].sum(axis=(2, 3)) / (rows * cols)
    return y


# (N, C, H, W, kernel, stride, pad, ceil_mode): padding, overlap, ceil windows past the edge
PAD_POOL_CASES = [
    (2, 2, 6, 6, 3, 2, 1, True),
    (1, 2, 5, 7, 2, 3, 1, True),
    (1, 1, 7, 5, 3, 2, 1, False),
    (2, 1, 4, 4, 2, 2, 1, True),
    (1, 2, 6, 5, 3, 2, 0, True),
    (1, 1, 5, 5, 5, 1, 2, False),
]


@pytest.mark.parametrize("case", PAD_POOL_CASES)
def test_maxpool_with_padding_and_ceil_mode_matches_loop_and_finite_differences(case):
    N, C, H, W, k, s, pad, ceil_mode = case
    rng = np.random.default_rng(1)
    # distinct negative values 0.01 apart: padding (which is never a candidate) would win if it were 0
    x = -1.0 - (rng.permutation(N * C * H * W) * 0.01).reshape(N, C, H, W)
    y, argmax = ops.maxpool_fprop(x, k, s, pad, ceil_mode)
    ref_y, ref_argmax = maxpool_loop(x, k, s, pad, *y.shape[2:])
    assert_close(y, ref_y, f"maxpool_fprop {case}", 0, 0)
    assert np.array_equal(argmax, ref_argmax), f"maxpool_fprop argmax {case}"
    g = rng.standard_normal(y.shape)
    numeric = numeric_grad(lambda: float(np.sum(ops.maxpool_fprop(x, k, s, pad, ceil_mode)[0] * g)), x)
    assert_close(ops.maxpool_bprop(g, argmax, x.shape, k, s, pad, ceil_mode), numeric, f"maxpool_bprop {case}")


def test_maxpool_ties_and_minus_inf_under_padding_pick_the_first_image_pixel():
    """Integer values with many ties: argmax is the first maximum among the image pixels; a window whose
    pixels are all -inf points at its first image pixel (never at padding), and its gradient lands there."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 3, size=(2, 2, 7, 6)).astype(np.float32)
    for k, s, pad, ceil_mode in ((3, 2, 1, True), (2, 1, 1, False), (3, 3, 1, True)):
        y, argmax = ops.maxpool_fprop(x, k, s, pad, ceil_mode)
        ref_y, ref_argmax = maxpool_loop(x, k, s, pad, *y.shape[2:])
        assert np.array_equal(y, ref_y) and np.array_equal(argmax, ref_argmax), (k, s, pad, ceil_mode)
    x = np.full((1, 1, 3, 3), -np.inf, dtype=np.float32)
    y, argmax = ops.maxpool_fprop(x, 3, 2, 1)  # windows at rows/cols -1 and 1
    # first image pixel of each window: (0, 0) is offset (1, 1) of window (0, 0); window (1, 1) starts at (1, 1)
    assert (y == -np.inf).all() and argmax[0, 0].tolist() == [[4, 3], [1, 0]]
    dx = ops.maxpool_bprop(np.ones((1, 1, 2, 2), np.float32), argmax, x.shape, 3, 2, 1)
    assert dx[0, 0].tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0]]


def test_maxpool_with_padding_propagates_nan_to_the_first_nan():
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    x[0, 0, 0, 1] = x[0, 0, 1, 0] = np.nan
    y, argmax = ops.maxpool_fprop(x, 3, 2, 1)  # window (0, 0): rows and columns -1..1
    assert np.isnan(y[0, 0, 0, 0]) and argmax[0, 0, 0, 0] == 1 * 3 + 2  # image (0, 1) before (1, 0)
    assert y[0, 0, 1, 1] == 15 and not np.isnan(y[0, 0, 1, 1])


def test_maxpool_defaults_are_the_unpadded_floor_pooling():
    x = np.random.default_rng(3).standard_normal((2, 3, 7, 7))
    y, argmax = ops.maxpool_fprop(x, 3, 2)
    y2, argmax2 = ops.maxpool_fprop(x, 3, 2, 0, False)
    assert y.shape == (2, 3, 3, 3) and np.array_equal(y, y2) and np.array_equal(argmax, argmax2)


def test_avgpool_divisors_by_hand():
    """x = 1..9 in a 3x3 image: the sums and divisors of AvgPool2d written out."""
    x = np.arange(1, 10, dtype=np.float64).reshape(1, 1, 3, 3)
    # kernel 3, stride 2, pad 1: windows at rows/cols -1..1 and 1..3; window (0, 0) holds 1, 2, 4, 5
    # (sum 12), (0, 1) 2, 3, 5, 6 (16), (1, 0) 4, 5, 7, 8 (24), (1, 1) 5, 6, 8, 9 (28); with the padding
    # every window counts 9 positions (row 3 is padding, inside [-1, 4)), without it 4
    assert_close(ops.avgpool_fprop(x, 3, 2, 1)[0, 0], [[12 / 9, 16 / 9], [24 / 9, 28 / 9]], "include pad")
    assert_close(ops.avgpool_fprop(x, 3, 2, 1, count_include_pad=False)[0, 0], [[3, 4], [6, 7]], "exclude pad")
    # cuda-convnet's avg pooling: kernel 2, stride 2, pad 0, ceil: windows (1 2 4 5) (3 6) (7 8) (9), each
    # divided by its clipped size under both divisors
    for include in (True, False):
        assert_close(ops.avgpool_fprop(x, 2, 2, 0, True, include)[0, 0], [[3, 4.5], [7.5, 9]], "ceil clip")
    # a ceil window running past the padding: H = 6, kernel 3, stride 2, pad 1, windows at rows -1, 1, 3, 5;
    # the last covers row 5, row 6 (padding) and row 7 (outside the padded input): 2 positions with the
    # padding, 1 without
    x = np.ones((1, 1, 6, 6))
    assert_close(ops.avgpool_fprop(x, 3, 2, 1, True, True)[0, 0, :, 3], [2 / 6, 3 / 6, 3 / 6, 1 / 4], "past pad")
    assert_close(ops.avgpool_fprop(x, 3, 2, 1, True, False)[0, 0, :, 3], [1, 1, 1, 1], "past pad, no count")


@pytest.mark.parametrize("case", PAD_POOL_CASES)
@pytest.mark.parametrize("count_include_pad", [True, False])
def test_avgpool_matches_loop_and_finite_differences(case, count_include_pad):
    N, C, H, W, k, s, pad, ceil_mode = case
    rng = np.random.default_rng(4)
    x = rng.standard_normal((N, C, H, W))
    y = ops.avgpool_fprop(x, k, s, pad, ceil_mode, count_include_pad)
    assert_close(y, avgpool_loop(x, k, s, pad, *y.shape[2:], count_include_pad), f"avgpool_fprop {case}")
    g = rng.standard_normal(y.shape)
    numeric = numeric_grad(lambda: float(np.sum(ops.avgpool_fprop(x, k, s, pad, ceil_mode, count_include_pad)
                                                 * g)), x)
    dx = ops.avgpool_bprop(g, x.shape, k, s, pad, ceil_mode, count_include_pad)
    assert_close(dx, numeric, f"avgpool_bprop {case}")
    y32 = ops.avgpool_fprop(x.astype(np.float32), k, s, pad, ceil_mode, count_include_pad)
    assert y32.dtype == np.float32
    assert_close(y32, y, "avgpool_fprop float32", ATOL32, RTOL32)


def test_global_avgpool_matches_mean_and_finite_differences():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 4, 5))
    y = ops.global_avgpool_fprop(x)
    assert_close(y, x.mean(axis=(2, 3)), "global_avgpool_fprop")
    g = rng.standard_normal((2, 3))
    numeric = numeric_grad(lambda: float(np.sum(ops.global_avgpool_fprop(x) * g)), x)
    dx = ops.global_avgpool_bprop(g, x.shape)
    assert_close(dx, numeric, "global_avgpool_bprop")
    assert dx.flags.c_contiguous and np.array_equal(dx[1, 2], np.full((4, 5), g[1, 2] / 20))
    assert ops.global_avgpool_fprop(x.astype(np.float32)).dtype == np.float32


@pytest.mark.parametrize("call, message", [
    (lambda x: ops.maxpool_fprop(x, 3, 2, 2), r"maxpool_fprop: pad must be <= kernel//2 = 1"),
    (lambda x: ops.maxpool_fprop(x, 3, 2, -1), r"maxpool_fprop: pad must be an int >= 0, got -1"),
    (lambda x: ops.maxpool_fprop(x, 3, 2, 1, 1), r"maxpool_fprop: ceil_mode must be a bool, got 1"),
    (lambda x: ops.maxpool_fprop(x[:, :, :1, :1], 3, 1, 0), r"maxpool_fprop: kernel 3 larger than input 1x1$"),
    (lambda x: ops.maxpool_fprop(x[:, :, :1], 5, 1, 1),
     r"maxpool_fprop: kernel 5 larger than input 1x6 \(padded by 1: 3x8\)"),
    (lambda x: ops.maxpool_bprop(np.zeros((2, 3, 3, 3), np.float32), np.zeros((2, 3, 3, 3), np.uint8),
                                 x.shape, 3, 2), r"maxpool_bprop: dy and argmax must have shape \(2, 3, 2, 2\) "
                                                 r"for x_shape \(2, 3, 6, 6\)"),
    (lambda x: ops.avgpool_fprop(x, 2, 2, 0, False, 1), r"avgpool_fprop: count_include_pad must be a bool"),
    (lambda x: ops.avgpool_fprop(x, 2, 0), r"avgpool_fprop: stride must be an int >= 1"),
    (lambda x: ops.avgpool_bprop(np.zeros((2, 3, 3, 3), np.float32), x.shape, 3, 2, 1, True),
     r"avgpool_bprop: dy must have shape \(2, 3, 4, 4\) for x_shape \(2, 3, 6, 6\)"),
    (lambda x: ops.avgpool_bprop(np.zeros((2, 3, 3, 3), np.float32), None, 3, 2),
     r"avgpool_bprop: x_shape must be 4 integers >= 0"),
    (lambda x: ops.global_avgpool_fprop(x[:, :, :0]), r"global_avgpool_fprop: x must have H\*W > 0"),
    (lambda x: ops.global_avgpool_fprop(x[0]), r"global_avgpool_fprop: x must have shape \(N, C, H, W\)"),
    (lambda x: ops.global_avgpool_bprop(np.zeros((2, 4), np.float32), x.shape),
     r"global_avgpool_bprop: dy must have shape \(2, 3\)"),
])
def test_pooling_arguments_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call(np.zeros((2, 3, 6, 6), np.float32))


def test_maxpool_bprop_refuses_a_shape_from_the_other_rounding():
    """ceil_mode changes P: the argmax of a ceil_mode forward does not fit a floor backward."""
    x = np.zeros((1, 1, 6, 6), np.float32)
    y, argmax = ops.maxpool_fprop(x, 3, 2, 0, True)  # P = 3; floor gives 2
    with pytest.raises(ValueError, match=r"maxpool_bprop: dy and argmax must have shape \(1, 1, 2, 2\)"):
        ops.maxpool_bprop(y, argmax, x.shape, 3, 2, 0, False)


# ----------------------------------------------------------------------------------------------
# batch normalisation


def test_batchnorm_stats_are_the_biased_moments_and_update_running_stats():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 4, 2, 5)) * [[[[1.0]], [[2.0]], [[0.5]], [[3.0]]]] + 7.0
    M = 3 * 2 * 5
    running_mean, running_var = rng.standard_normal(4), rng.random(4) + 0.5
    rm0, rv0 = running_mean.copy(), running_var.copy()
    mean, var = ops.batchnorm_stats(x, running_mean, running_var, momentum=0.25)
    ref_mean = np.array([x[:, c].mean() for c in range(4)])
    ref_var = np.array([((x[:, c] - x[:, c].mean()) ** 2).mean() for c in range(4)])
    assert_close(mean, ref_mean, "batch mean", 1e-12, 1e-12)
    assert_close(var, ref_var, "batch var (biased)", 1e-12, 1e-12)
    assert_close(running_mean, 0.75 * rm0 + 0.25 * ref_mean, "running_mean", 1e-12, 1e-12)
    assert_close(running_var, 0.75 * rv0 + 0.25 * ref_var * M / (M - 1), "running_var (unbiased)", 1e-12, 1e-12)
    # without running arrays nothing else changes; momentum 0 keeps them, 1 replaces them
    mean2, _ = ops.batchnorm_stats(x)
    assert np.array_equal(mean, mean2)
    rm, rv = rm0.copy(), rv0.copy()
    ops.batchnorm_stats(x, rm, rv, momentum=0.0)
    assert np.array_equal(rm, rm0) and np.array_equal(rv, rv0)
    ops.batchnorm_stats(x, rm, rv, momentum=1.0)
    assert_close(rm, ref_mean, "momentum 1", 1e-12, 1e-12)
    assert_close(rv, ref_var * M / (M - 1), "momentum 1", 1e-12, 1e-12)


def test_batchnorm_stats_with_one_value_per_channel_uses_the_biased_variance():
    x = np.array([[[[2.0]], [[-1.0]]]], dtype=np.float32)  # N = H = W = 1: M = 1
    running_mean, running_var = np.zeros(2, np.float32), np.ones(2, np.float32)
    mean, var = ops.batchnorm_stats(x, running_mean, running_var, 0.5)
    assert mean.tolist() == [2.0, -1.0] and var.tolist() == [0.0, 0.0]
    assert running_mean.tolist() == [1.0, -0.5] and running_var.tolist() == [0.5, 0.5]


def test_batchnorm_stats_in_float32_are_accurate_far_from_zero():
    """A float32 input with mean 1e4 and std 1e-2: E[x^2] - E[x]^2 in float32 would lose every digit;
    two passes in float64 give the variance of the float32 values to float32 precision."""
    x = (1e4 + 1e-2 * np.random.default_rng(7).standard_normal((8, 2, 16, 16))).astype(np.float32)
    mean, var = ops.batchnorm_stats(x)
    assert mean.dtype == var.dtype == np.float32
    x64 = x.astype(np.float64)
    assert_close(mean, x64.mean(axis=(0, 2, 3)), "mean", 0, 1e-7)
    assert_close(var, x64.var(axis=(0, 2, 3)), "var", 0, 1e-6)


def test_batchnorm_fprop_is_the_formula():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 4, 4))
    gamma, beta, mean, var = rng.standard_normal(3), rng.standard_normal(3), rng.standard_normal(3), rng.random(3)
    y = ops.batchnorm_fprop(x, gamma, beta, mean, var, 1e-5)
    c = (slice(None), None, None)
    assert_close(y, (x - mean[c]) / np.sqrt(var[c] + 1e-5) * gamma[c] + beta[c], "batchnorm_fprop")
    y32 = ops.batchnorm_fprop(*(a.astype(np.float32) for a in (x, gamma, beta, mean, var)), 1e-5)
    assert y32.dtype == np.float32
    assert_close(y32, y, "batchnorm_fprop float32", 1e-4, 1e-4)  # var down to ~0.01: values up to ~30


def test_batchnorm_backward_matches_finite_differences_through_the_batch_statistics():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 3, 2)) * 2 + 1
    gamma, beta = rng.standard_normal(3), rng.standard_normal(3)
    g = rng.standard_normal(x.shape)
    eps = 1e-3

    def loss() -> float:  # training mode: the statistics come from x
        return float(np.sum(ops.batchnorm_fprop(x, gamma, beta, *ops.batchnorm_stats(x), eps) * g))

    mean, var = ops.batchnorm_stats(x)
    dgamma, dbeta = np.full(3, np.nan), np.full(3, np.nan)  # overwritten, not accumulated
    dx = ops.batchnorm_bprop(g, x, gamma, mean, var, eps, dgamma, dbeta)
    assert_close(dx, numeric_grad(loss, x), "batchnorm dx")
    assert_close(dgamma, numeric_grad(loss, gamma), "batchnorm dgamma")
    assert_close(dbeta, numeric_grad(loss, beta), "batchnorm dbeta")
    dgamma2, dbeta2 = np.zeros(3), np.zeros(3)
    assert ops.batchnorm_bprop(g, x, gamma, mean, var, eps, dgamma2, dbeta2, need_dx=False) is None
    assert np.array_equal(dgamma2, dgamma) and np.array_equal(dbeta2, dbeta)
    args32 = [a.astype(np.float32) for a in (g, x, gamma, mean, var)]
    dg32, db32 = np.zeros(3, np.float32), np.zeros(3, np.float32)
    dx32 = ops.batchnorm_bprop(*args32, eps, dg32, db32)
    assert dx32.dtype == np.float32
    assert_close(dx32, dx, "batchnorm dx float32", 1e-4, 1e-4)
    assert_close(dg32, dgamma, "batchnorm dgamma float32", 1e-4, 1e-4)


@pytest.mark.parametrize("call, message", [
    (lambda x, v: ops.batchnorm_stats(x, v), "batchnorm_stats: running_mean and running_var must be given together"),
    (lambda x, v: ops.batchnorm_stats(x, v, v.astype(np.float64)), "batchnorm_stats: running_var must have dtype"),
    (lambda x, v: ops.batchnorm_stats(x, v[:2], v[:2]), r"batchnorm_stats: running_mean must have shape \(3,\)"),
    (lambda x, v: ops.batchnorm_stats(x, momentum=1.5), r"batchnorm_stats: momentum must be a finite real number in"
                                                          r" \[0, 1\], got 1.5"),
    (lambda x, v: ops.batchnorm_stats(x[:0]), "batchnorm_stats: x must have N\\*H\\*W > 0"),
    (lambda x, v: ops.batchnorm_fprop(x, v, v, v, v, 0.0), r"batchnorm_fprop: eps must be a finite real number in"
                                                           r" \(0, inf\), got 0.0"),
    (lambda x, v: ops.batchnorm_fprop(x, v, v, v[:2], v, 1e-5), r"batchnorm_fprop: mean must have shape \(3,\)"),
    (lambda x, v: ops.batchnorm_bprop(x, x, v, v, v, 1e-5, v.copy(), None), "batchnorm_bprop: dbeta must be a"),
    (lambda x, v: ops.batchnorm_bprop(x[:1], x, v, v, v, 1e-5, v.copy(), v.copy()), "batchnorm_bprop: dy must have"),
    (lambda x, v: ops.batchnorm_bprop(x, x, v, v, v, 1e-5, v.copy(), np.zeros(4, np.float32)),
     r"batchnorm_bprop: out must be a float32 array of shape \(3,\)"),
    (lambda x, v: ops.batchnorm_bprop(x, x, v, v, v, 1e-5, v.copy(), v.copy(), 1), "need_dx must be a bool"),
])
def test_batchnorm_arguments_are_checked(call, message):
    x, v = np.zeros((2, 3, 4, 4), np.float32), np.ones(3, np.float32)
    with pytest.raises(ValueError, match=message):
        call(x, v)


# ----------------------------------------------------------------------------------------------
# residual add and the option-A shortcut


def test_add_fresh_or_into_either_input():
    a, b = np.arange(6.0).reshape(2, 3), np.full((2, 3), 0.5)
    c = ops.add(a, b)
    assert np.array_equal(c, a + b) and c is not a and c is not b
    expected = a + b
    assert ops.add(a, b, out=a) is a and np.array_equal(a, expected)
    assert ops.add(a, b, out=b) is b and np.array_equal(b, expected + 0.5)
    with pytest.raises(ValueError, match="add: a and b must have one shape and dtype"):
        ops.add(a, b.astype(np.float32))
    with pytest.raises(ValueError, match="add: a and b must have one shape and dtype"):
        ops.add(a, b.T)
    with pytest.raises(ValueError, match=r"add: out must be a float64 array of shape \(2, 3\)"):
        ops.add(a, b, out=np.zeros(6))
    with pytest.raises(ValueError, match="add: b must be a float32"):
        ops.add(a, [1.0])


def test_subsample_pad_matches_loop_and_is_its_own_adjoint():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 3, 5, 4))
    y = ops.subsample_pad_fprop(x, 2, 1, 2)
    assert y.shape == (2, 6, 3, 2)  # 1 + 3 + 2 channels, ceil(5/2) x ceil(4/2)
    ref = np.zeros((2, 6, 3, 2))
    for p in range(3):
        for q in range(2):
            ref[:, 1:4, p, q] = x[:, :, 2 * p, 2 * q]
    assert np.array_equal(y, ref)
    g = rng.standard_normal(y.shape)
    dx = ops.subsample_pad_bprop(g, x.shape, 2, 1, 2)
    # the backward of a linear map is its adjoint: <fprop(x), g> == <x, bprop(g)>
    assert_close(np.sum(y * g), np.sum(x * dx), "adjoint", 1e-12, 1e-12)
    assert np.array_equal(dx[:, :, ::2, ::2], g[:, 1:4]) and not dx[:, :, 1::2].any() and not dx[:, :, :, 1::2].any()
    assert np.array_equal(ops.subsample_pad_fprop(x, 1, 0, 0), x)  # stride 1, no pad: a copy
    with pytest.raises(ValueError, match="subsample_pad_fprop: stride must be an int >= 1"):
        ops.subsample_pad_fprop(x, 0, 1, 1)
    with pytest.raises(ValueError, match="subsample_pad_fprop: pad_after must be an int >= 0"):
        ops.subsample_pad_fprop(x, 2, 1, -1)
    with pytest.raises(ValueError, match=r"subsample_pad_bprop: dy must have shape \(2, 6, 3, 2\)"):
        ops.subsample_pad_bprop(g[:, :5], x.shape, 2, 1, 2)


# ----------------------------------------------------------------------------------------------
# dropout: Philox4x32-10


M32 = 0xFFFFFFFF


def philox_scalar(counter, key, rounds=10):
    """Philox4x32 on Python ints, one counter, written from Salmon et al. 2011 (independent of the
    vectorised numpy_ops.philox4x32)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
    return [c0, c1, c2, c3]


# Random123's tests/kat_vectors (D. E. Shaw Research), philox4x32: rounds, counter, key -> output
PHILOX_KAT = [
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (M32, M32, M32, M32), (M32, M32), (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]


@pytest.mark.parametrize("rounds, counter, key, expected", PHILOX_KAT)
def test_philox_known_answers(rounds, counter, key, expected):
    got = numpy_ops.philox4x32(np.array([counter], dtype=np.uint32), key, rounds)
    assert got.dtype == np.uint32 and got[0].tolist() == list(expected)
    assert philox_scalar(counter, key, rounds) == list(expected)


def test_philox_vectorised_matches_scalar_across_blocks(monkeypatch):
    rng = np.random.default_rng(11)
    counter = rng.integers(0, 2**32, size=(13, 4), dtype=np.uint64).astype(np.uint32)
    key = (int(rng.integers(0, 2**32)), int(rng.integers(0, 2**32)))
    expected = [philox_scalar([int(v) for v in c], key) for c in counter]
    assert numpy_ops.philox4x32(counter, key).tolist() == expected
    monkeypatch.setattr(numpy_ops, "PHILOX_BLOCK", 4)  # several blocks and a short last one
    assert numpy_ops.philox4x32(counter, key).tolist() == expected


def dropout_keep_loop(size, p, seed, minibatch, layer):
    """keep[i] = word i mod 4 of Philox4x32-10 at counter (i // 4, layer, minibatch lo, hi), key (seed lo,
    hi) >= min(round(p 2^32), 2^32 - 1): the rule of the protocol, one element at a time."""
    t = min(round(p * 2**32), 2**32 - 1)
    keep = []
    for i in range(size):
        words = philox_scalar((i // 4, layer, minibatch & M32, minibatch >> 32), (seed & M32, seed >> 32))
        keep.append(words[i % 4] >= t)
    return np.array(keep)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_matches_the_philox_rule_element_by_element(dtype):
    x = np.random.default_rng(12).standard_normal((2, 3, 5)).astype(dtype)  # 30 elements: 8 counters, the last partial
    p, seed, minibatch, layer = 0.3, 2**40 + 17, 2**33 + 5, 4
    keep = dropout_keep_loop(x.size, p, seed, minibatch, layer).reshape(x.shape)
    y = ops.dropout_fprop(x, p, seed, minibatch, layer)
    scale = dtype(1 / (1 - p))  # rounded to x's dtype once
    assert y.dtype == dtype and y.shape == x.shape
    assert np.array_equal(y, np.where(keep, x * scale, 0))
    g = np.random.default_rng(13).standard_normal(x.shape).astype(dtype)
    assert np.array_equal(ops.dropout_bprop(g, p, seed, minibatch, layer), np.where(keep, g * scale, 0))
    # the index is the logical row-major one, whatever the memory layout
    xt = np.ascontiguousarray(x.reshape(6, 5).T)
    assert np.array_equal(ops.dropout_fprop(xt.T, p, seed, minibatch, layer), ops.dropout_fprop(
        np.ascontiguousarray(xt.T), p, seed, minibatch, layer))


def test_dropout_mask_depends_on_the_whole_key_only():
    ones = np.ones(20000, np.float32)
    p = 0.5

    def mask(seed, minibatch, layer):
        return ops.dropout_fprop(ones, p, seed, minibatch, layer) != 0

    base = mask(7, 100, 2)
    assert np.array_equal(base, mask(7, 100, 2))  # recomputed: the same mask
    assert np.array_equal(base, ops.dropout_bprop(ones, p, 7, 100, 2) != 0)  # backward draws it too
    for other in (mask(8, 100, 2), mask(7, 101, 2), mask(7, 100, 3), mask(7 + 2**32, 100, 2),
                  mask(7, 100 + 2**32, 2)):
        # independent masks agree on p^2 + (1 - p)^2 = 1/2 of the elements; sd 0.0035
        assert abs(np.mean(base == other) - 0.5) < 0.02


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_rate_and_scale(p):
    n = 200000
    y = ops.dropout_fprop(np.ones(n, np.float32), p, 3, 9, 1)
    kept = y != 0
    sd = np.sqrt(p * (1 - p) / n)
    assert abs(kept.mean() - (1 - p)) < 5 * sd  # 5 standard deviations
    assert np.all(y[kept] == np.float32(1 / (1 - p)))
    # the expectation is kept: mean(y) ~ 1
    assert abs(y.mean(dtype=np.float64) - 1) < 5 * sd / (1 - p)


def test_dropout_threshold_keeps_a_word_equal_to_it():
    """keep = (r >= t): choose p so that t is exactly element 1's word r_1 (p = r_1 / 2^32 is exact in a
    double), then once more with t = r_1 + 1; and p just below 1, where round(p 2^32) = 2^32 is clamped."""
    seed, minibatch, layer = 5, 6, 7
    r1 = int(numpy_ops.philox4x32(np.array([[0, layer, minibatch, 0]], np.uint32), (seed, 0))[0, 1])
    ones = np.ones(4, np.float64)
    assert ops.dropout_fprop(ones, r1 / 2**32, seed, minibatch, layer)[1] != 0
    assert ops.dropout_fprop(ones, (r1 + 1) / 2**32, seed, minibatch, layer)[1] == 0
    y = ops.dropout_fprop(np.ones(1000, np.float32), 1 - 2.0**-40, seed, minibatch, layer)  # t = 2^32 - 1
    assert not y.any()


def test_dropout_with_p_zero_is_the_identity():
    x = np.array([[1.5, -np.inf, np.nan, 0.0]], dtype=np.float32)
    y = ops.dropout_fprop(x, 0.0, 1, 2, 3)
    assert np.array_equal(y, x, equal_nan=True) and y is not x and not np.shares_memory(x, y)
    assert np.array_equal(ops.dropout_bprop(x, 0, 1, 2, 3), x, equal_nan=True)


@pytest.mark.parametrize("args, message", [
    ((1.0, 0, 0, 0), r"dropout_fprop: p must be a finite real number in \[0, 1\), got 1.0"),
    ((-0.1, 0, 0, 0), r"dropout_fprop: p must be a finite real number in \[0, 1\)"),
    ((float("nan"), 0, 0, 0), r"dropout_fprop: p must be a finite real number"),
    ((0.5, -1, 0, 0), r"dropout_fprop: seed must be an integer in \[0, 2\^64\), got -1"),
    ((0.5, 2**64, 0, 0), r"dropout_fprop: seed must be an integer in \[0, 2\^64\)"),
    ((0.5, 0, 2**64, 0), r"dropout_fprop: minibatch must be an integer in \[0, 2\^64\)"),
    ((0.5, 0, True, 0), r"dropout_fprop: minibatch must be an integer in \[0, 2\^64\), got True"),
    ((0.5, 0, 0, 2**32), r"dropout_fprop: layer must be an integer in \[0, 2\^32\)"),
    ((0.5, 0, 0, 1.0), r"dropout_fprop: layer must be an integer"),
])
def test_dropout_arguments_are_checked(args, message):
    with pytest.raises(ValueError, match=message):
        ops.dropout_fprop(np.ones(4, np.float32), *args)


def test_dropout_refuses_non_float_arrays():
    with pytest.raises(ValueError, match="dropout_fprop: x must be a float32"):
        ops.dropout_fprop(np.ones(4, np.int32), 0.5, 0, 0, 0)
    with pytest.raises(ValueError, match="dropout_bprop: dy must be a float32"):
        ops.dropout_bprop([1.0], 0.5, 0, 0, 0)


# ----------------------------------------------------------------------------------------------
# local response normalisation


def lrn_loop(x, size, alpha, beta, k):
    """scale and y by a loop over channels: the protocol's formula, channels outside [0, C) count 0."""
    C = x.shape[1]
    scale = np.empty_like(x)
    for c in range(C):
        lo, hi = max(c - size // 2, 0), min(c + (size - 1) // 2, C - 1)
        scale[:, c] = k + alpha / size * np.sum(x[:, lo:hi + 1] ** 2, axis=1)
    return x * scale ** -beta, scale


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_lrn_matches_formula_and_finite_differences(size):
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 6, 2, 3))
    alpha, beta, k = 0.7, 0.75, 2.0  # large alpha: the cross-channel terms matter
    y, scale = ops.lrn_fprop(x, size, alpha, beta, k)
    ref_y, ref_scale = lrn_loop(x, size, alpha, beta, k)
    assert_close(scale, ref_scale, f"lrn scale size {size}")
    assert_close(y, ref_y, f"lrn y size {size}")
    g = rng.standard_normal(x.shape)
    numeric = numeric_grad(lambda: float(np.sum(ops.lrn_fprop(x, size, alpha, beta, k)[0] * g)), x)
    assert_close(ops.lrn_bprop(g, x, y, scale, size, alpha, beta), numeric, f"lrn_bprop size {size}")
    y32, _ = ops.lrn_fprop(x.astype(np.float32), size, alpha, beta, k)
    assert y32.dtype == np.float32
    assert_close(y32, y, "lrn float32", ATOL32, RTOL32)


def test_lrn_cuda_convnet_parameters():
    """cifar10's layers-18pct: size 3, scale (alpha/size) 5e-5, pow 0.75, k 1: a channel alone is divided
    by (1 + 5e-5 x^2)^0.75."""
    x = np.zeros((1, 3, 1, 1))
    x[0, 1] = 10.0
    y, scale = ops.lrn_fprop(x, 3, 3 * 5e-5, 0.75, 1.0)
    assert_close(scale[0, :, 0, 0], [1.005, 1.005, 1.005], "scale", 1e-15, 1e-12)
    assert_close(y[0, :, 0, 0], [0, 10 / 1.005**0.75, 0], "y", 1e-15, 1e-12)


@pytest.mark.parametrize("call, message", [
    (lambda x: ops.lrn_fprop(x, 0, 1e-4, 0.75, 1.0), "lrn_fprop: size must be an int >= 1, got 0"),
    (lambda x: ops.lrn_fprop(x, 5, -1e-4, 0.75, 1.0), r"lrn_fprop: alpha must be a finite real number in \[0, inf\)"),
    (lambda x: ops.lrn_fprop(x, 5, 1e-4, 0.75, 0.0), r"lrn_fprop: k must be a finite real number in \(0, inf\)"),
    (lambda x: ops.lrn_fprop(x, 5, 1e-4, float("inf"), 1.0), "lrn_fprop: beta must be a finite real number, got inf"),
    (lambda x: ops.lrn_fprop(x[0], 5, 1e-4, 0.75, 1.0), r"lrn_fprop: x must have shape \(N, C, H, W\)"),
    (lambda x: ops.lrn_bprop(x[:1], x, x, x, 5, 1e-4, 0.75), r"lrn_bprop: dy must have x's shape \(2, 4, 3, 3\)"),
    (lambda x: ops.lrn_bprop(x, x, x, x.astype(np.float64), 5, 1e-4, 0.75), "lrn_bprop: scale must have dtype"),
    (lambda x: ops.lrn_bprop(x, x, x, x, 5, "a", 0.75), "lrn_bprop: alpha must be a real number"),
])
def test_lrn_arguments_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call(np.ones((2, 4, 3, 3), np.float32))


# ----------------------------------------------------------------------------------------------
# sgd_momentum: nesterov and lr_scale


def sgd_case(seed=15, P=50):
    rng = np.random.default_rng(seed)
    params, velocity, grad = (rng.standard_normal(P).astype(np.float32) for _ in range(3))
    decay = np.where(rng.random(P) < 0.5, np.float32(5e-4), np.float32(0))
    lr_scale = rng.choice(np.array([1.0, 2.0, 0.1], np.float32), P)
    return params, velocity, grad, decay, lr_scale


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("use_scale", [False, True])
def test_sgd_momentum_follows_the_protocol_formulas(nesterov, use_scale):
    params, velocity, grad, decay, lr_scale = sgd_case()
    m, lr = 0.9, 0.05
    s = lr_scale if use_scale else np.float32(1)
    # the formulas in float64 from the same float32 inputs
    d = grad.astype(np.float64) + decay.astype(np.float64) * params
    v_new = m * velocity.astype(np.float64) + d
    direction = d + m * v_new if nesterov else v_new
    p_new = params - lr * s.astype(np.float64) * direction
    # and in float32 in the documented order: bit for bit
    m32, lr32 = np.float32(m), np.float32(lr)
    d32 = grad + decay * params
    v32 = m32 * velocity + d32
    p32 = params - (lr32 * s) * ((d32 + m32 * v32) if nesterov else v32)
    ops.sgd_momentum(params, velocity, grad, decay, m, lr, nesterov=nesterov,
                     lr_scale=lr_scale if use_scale else None)
    assert_close(velocity, v_new, "velocity", 1e-6, 1e-6)
    assert_close(params, p_new, "params", 1e-6, 1e-6)
    assert np.array_equal(velocity, v32) and np.array_equal(params, p32)


def test_sgd_momentum_defaults_and_degenerate_cases():
    params, velocity, grad, decay, _ = sgd_case(16)
    runs = {}
    for name, kwargs in (("default", {}), ("explicit", {"nesterov": False, "lr_scale": None}),
                         ("ones", {"lr_scale": np.ones_like(params)})):
        p, v = params.copy(), velocity.copy()
        ops.sgd_momentum(p, v, grad, decay, 0.9, 0.1, **kwargs)
        runs[name] = (p, v)
    assert all(np.array_equal(runs["default"][i], runs[k][i]) for k in runs for i in (0, 1))
    # momentum 0: nesterov and heavy ball are the same step, params - lr * d
    p1, v1, p2, v2 = params.copy(), velocity.copy(), params.copy(), velocity.copy()
    ops.sgd_momentum(p1, v1, grad, decay, 0.0, 0.1, nesterov=True)
    ops.sgd_momentum(p2, v2, grad, decay, 0.0, 0.1, nesterov=False)
    assert np.array_equal(p1, p2)
    # lr_scale 0 freezes a parameter (its velocity still moves)
    zero = np.zeros_like(params)
    p = params.copy()
    ops.sgd_momentum(p, velocity.copy(), grad, decay, 0.9, 0.1, lr_scale=zero)
    assert np.array_equal(p, params)


def test_sgd_momentum_new_arguments_are_checked():
    params, velocity, grad, decay, lr_scale = sgd_case()
    with pytest.raises(ValueError, match=r"sgd_momentum: lr_scale must be C-contiguous of shape \(50,\)"):
        ops.sgd_momentum(params, velocity, grad, decay, 0.9, 0.1, lr_scale=lr_scale[:10])
    with pytest.raises(ValueError, match="sgd_momentum: lr_scale must have dtype float32"):
        ops.sgd_momentum(params, velocity, grad, decay, 0.9, 0.1, lr_scale=lr_scale.astype(np.float64))
    with pytest.raises(ValueError, match="sgd_momentum: nesterov must be a bool, got 1"):
        ops.sgd_momentum(params, velocity, grad, decay, 0.9, 0.1, nesterov=1)
