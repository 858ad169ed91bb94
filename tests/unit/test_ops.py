"""NumPy ops backend: every backward op against float64 central finite differences, conv2d_fprop
against a direct loop, and the input validation.

The ops are dtype-generic (float32 in production, float64 here), so the gradient checks run in
float64 where central differences are accurate to ~1e-10; float32 is checked against float64.
"""

import numpy as np
import pytest
from kit.convs import CONV_CASES, conv_case, naive_conv
from kit.grads import assert_close, numeric_grad

from mpiasgd.ops import get_backend

ops = get_backend("numpy")



# tolerances, stated once: |got - ref| <= atol + rtol * |ref| elementwise
ATOL32, RTOL32 = 1e-4, 1e-4  # float32 result vs float64 result (values are O(1))




@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d_fprop_matches_direct_loop(case):
    x, w, b, stride, pad = conv_case(case)
    ref = naive_conv(x, w, b, stride, pad)
    assert_close(ops.conv2d_fprop(x, w, b, stride, pad), ref, f"conv2d_fprop float64 {case}", 1e-12, 1e-12)
    assert_close(ops.conv2d_fprop(x, w, None, stride, pad), naive_conv(x, w, None, stride, pad),
                 f"conv2d_fprop no bias {case}", 1e-12, 1e-12)
    y32 = ops.conv2d_fprop(x.astype(np.float32), w.astype(np.float32), b.astype(np.float32), stride, pad)
    assert y32.dtype == np.float32 and y32.flags.c_contiguous
    assert_close(y32, ref, f"conv2d_fprop float32 {case}", ATOL32, RTOL32)


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d_backward_matches_finite_differences(case):
    x, w, b, stride, pad = conv_case(case)
    y = ops.conv2d_fprop(x, w, b, stride, pad)
    g = np.random.default_rng(1).standard_normal(y.shape)  # upstream gradient of sum(y * g)

    def loss():
        return float(np.sum(ops.conv2d_fprop(x, w, b, stride, pad) * g))

    assert_close(ops.conv2d_dgrad(g, w, x.shape, stride, pad), numeric_grad(loss, x), f"conv2d_dgrad {case}")
    assert_close(ops.conv2d_wgrad(g, x, w.shape, stride, pad), numeric_grad(loss, w), f"conv2d_wgrad {case}")
    assert_close(ops.bias_grad(g), numeric_grad(loss, b), f"bias_grad {case}")


@pytest.mark.parametrize("case", CONV_CASES[:4])
def test_conv2d_backward_float32_matches_float64(case):
    x, w, b, stride, pad = conv_case(case)
    g = np.random.default_rng(1).standard_normal(ops.conv2d_fprop(x, w, b, stride, pad).shape)
    x32, w32, g32 = (a.astype(np.float32) for a in (x, w, g))
    dx = ops.conv2d_dgrad(g32, w32, x.shape, stride, pad)
    dw = ops.conv2d_wgrad(g32, x32, w.shape, stride, pad)
    assert dx.dtype == dw.dtype == np.float32
    assert_close(dx, ops.conv2d_dgrad(g, w, x.shape, stride, pad), "dgrad float32", ATOL32, RTOL32)
    assert_close(dw, ops.conv2d_wgrad(g, x, w.shape, stride, pad), "wgrad float32", ATOL32, RTOL32)


def test_conv2d_workspace_reuse_is_exact_and_tracks_the_input():
    x, w, b, stride, pad = conv_case((3, 2, 6, 5, 3, 3, 3, 1, 1))
    x2 = x[::-1].copy()
    g = np.random.default_rng(2).standard_normal((3, 3, 6, 5))
    ws = ops.Workspace()
    for _ in range(2):  # second round runs on reused scratch
        assert_close(ops.conv2d_fprop(x, w, b, stride, pad, ws=ws), ops.conv2d_fprop(x, w, b, stride, pad),
                     "fprop with workspace", 0, 0)
        assert_close(ops.conv2d_wgrad(g, x, w.shape, stride, pad, ws=ws), ops.conv2d_wgrad(g, x, w.shape, stride, pad),
                     "wgrad reusing fprop columns", 0, 0)
        assert_close(ops.conv2d_dgrad(g, w, x.shape, stride, pad, ws=ws), ops.conv2d_dgrad(g, w, x.shape, stride, pad),
                     "dgrad with workspace", 0, 0)
    # columns in the workspace belong to x2 now; wgrad of x must not use them
    ops.conv2d_fprop(x2, w, b, stride, pad, ws=ws)
    assert_close(ops.conv2d_wgrad(g, x, w.shape, stride, pad, ws=ws), ops.conv2d_wgrad(g, x, w.shape, stride, pad),
                 "wgrad after fprop of another input", 0, 0)
    assert ws.nbytes > 0


def test_wgrad_and_bias_grad_overwrite_out_views():
    x, w, b, stride, pad = conv_case((2, 2, 5, 5, 3, 3, 3, 1, 1))
    g = np.random.default_rng(3).standard_normal((2, 3, 5, 5))
    flat = np.full(w.size + b.size + 4, 7.0)  # stand-in for the model's gradient vector
    dw_view = flat[2:2 + w.size].reshape(w.shape)
    db_view = flat[2 + w.size:2 + w.size + b.size]
    assert ops.conv2d_wgrad(g, x, w.shape, stride, pad, out=dw_view) is dw_view
    assert ops.bias_grad(g, out=db_view) is db_view
    assert_close(dw_view, ops.conv2d_wgrad(g, x, w.shape, stride, pad), "wgrad out=", 0, 0)
    assert_close(db_view, g.sum(axis=(0, 2, 3)), "bias_grad out=", 1e-12, 1e-12)
    assert (flat[:2] == 7).all() and (flat[-2:] == 7).all()  # nothing written outside the views
    lw = np.full((3, 4), 7.0)
    xl, gl = np.ones((5, 4)), np.ones((5, 3))
    assert ops.linear_wgrad(gl, xl, out=lw) is lw
    assert (lw == 5).all()  # overwritten, not accumulated onto the 7s


def test_bias_grad_2d_and_4d():
    g = np.random.default_rng(4).standard_normal((3, 5, 2, 4))
    assert_close(ops.bias_grad(g), g.sum(axis=(0, 2, 3)), "bias_grad 4-D", 1e-12, 1e-12)
    assert_close(ops.bias_grad(g[:, :, 0, 0].copy()), g[:, :, 0, 0].sum(axis=0), "bias_grad 2-D", 1e-12, 1e-12)


def test_relu_backward_matches_finite_differences():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 4, 5))
    x[np.abs(x) < 1e-3] = 0.5  # keep away from the kink
    g = rng.standard_normal(x.shape)
    y = ops.relu_fprop(x)
    assert_close(y, np.maximum(x, 0), "relu_fprop", 0, 0)
    assert_close(ops.relu_bprop(g, y), numeric_grad(lambda: float(np.sum(ops.relu_fprop(x) * g)), x), "relu_bprop")


# (N, C, H, W, kernel, stride): overlapping 3/2 and 3/1, non-overlapping 2/2, gaps 3/3 and 1/1,
# odd and non-square sizes with floor output
POOL_CASES = [
    (2, 3, 7, 7, 3, 2),
    (1, 2, 8, 6, 2, 2),
    (2, 2, 6, 5, 3, 1),
    (1, 1, 5, 9, 3, 3),
    (2, 1, 4, 3, 1, 1),
    (1, 2, 9, 8, 3, 2),
]


@pytest.mark.parametrize("case", POOL_CASES)
def test_maxpool_matches_loop_and_finite_differences(case):
    N, C, H, W, k, s = case
    rng = np.random.default_rng(6)
    # distinct values 0.01 apart: no ties, and no window changes its max within the FD step
    x = (rng.permutation(N * C * H * W) * 0.01).reshape(N, C, H, W)
    y, argmax = ops.maxpool_fprop(x, k, s)
    P, Q = (H - k) // s + 1, (W - k) // s + 1
    assert y.shape == argmax.shape == (N, C, P, Q)
    ref = np.array([[[[x[n, c, p * s:p * s + k, q * s:q * s + k].max() for q in range(Q)] for p in range(P)]
                     for c in range(C)] for n in range(N)])
    assert_close(y, ref, f"maxpool_fprop {case}", 0, 0)
    g = rng.standard_normal(y.shape)
    numeric = numeric_grad(lambda: float(np.sum(ops.maxpool_fprop(x, k, s)[0] * g)), x)
    assert_close(ops.maxpool_bprop(g, argmax, x.shape, k, s), numeric, f"maxpool_bprop {case}")


def test_maxpool_overlapping_windows_accumulate_and_ties_pick_first():
    x = np.zeros((1, 1, 3, 5), dtype=np.float32)
    x[0, 0, 1, 2] = 5.0  # the max of both 3x3 windows (columns 0-2 and 2-4 share column 2)
    y, argmax = ops.maxpool_fprop(x, 3, 2)
    assert y.shape == (1, 1, 1, 2) and (y == 5).all()
    dx = ops.maxpool_bprop(np.array([[[[1.0, 2.0]]]], dtype=np.float32), argmax, x.shape, 3, 2)
    assert dx[0, 0, 1, 2] == 3.0 and dx.sum() == 3.0
    # all equal: the first element of each window wins
    _, argmax = ops.maxpool_fprop(np.ones((1, 1, 3, 5), dtype=np.float32), 3, 2)
    assert (argmax == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_maxpool_propagates_nan_and_routes_its_gradient_to_the_first_nan(dtype):
    """A NaN in a window makes the output NaN (as np.max) and its gradient goes to the NaN, the first one
    in row-major scan order when there are several (np.argmax's rule), not to the largest number;
    +inf and -inf are ordinary values."""
    x = np.arange(16, dtype=dtype).reshape(1, 1, 4, 4)  # ascending: without NaN the last of a window wins
    x[0, 0, 1, 0] = np.nan  # window (0, 0) = [0, 1, nan, 5]
    x[0, 0, 0, 3] = x[0, 0, 1, 2] = np.nan  # window (0, 1) = [2, nan, nan, 7]
    x[0, 0, 2, 1], x[0, 0, 3, 1] = np.inf, np.nan  # window (1, 0) = [8, inf, 12, nan]
    x[0, 0, 3, 2], x[0, 0, 3, 3] = -np.inf, np.inf  # window (1, 1) = [10, 11, -inf, inf]
    y, argmax = ops.maxpool_fprop(x, 2, 2)
    assert y.dtype == dtype
    assert np.array_equal(y[0, 0], [[np.nan, np.nan], [np.nan, np.inf]], equal_nan=True)
    assert argmax[0, 0].tolist() == [[2, 1], [3, 3]]
    dx = ops.maxpool_bprop(np.array([[[[1.0, 2.0], [3.0, 4.0]]]], dtype=dtype), argmax, x.shape, 2, 2)
    expected = np.zeros((4, 4))
    expected[1, 0], expected[0, 3], expected[3, 1], expected[3, 3] = 1.0, 2.0, 3.0, 4.0
    assert np.array_equal(dx[0, 0], expected)


def test_maxpool_nan_shared_by_overlapping_windows_gets_both_gradients():
    x = np.full((1, 1, 3, 5), -1.0, dtype=np.float32)
    x[0, 0, 0, 0] = x[0, 0, 2, 4] = 9.0  # the largest numbers, one in each 3x3 window
    x[0, 0, 1, 2] = np.nan  # in both windows (columns 0-2 and 2-4)
    y, argmax = ops.maxpool_fprop(x, 3, 2)
    assert np.isnan(y).all() and argmax[0, 0].tolist() == [[5, 3]]
    dx = ops.maxpool_bprop(np.array([[[[1.0, 2.0]]]], dtype=np.float32), argmax, x.shape, 3, 2)
    assert dx[0, 0, 1, 2] == 3.0 and dx.sum() == 3.0
    # a window of NaNs only: offset 0; a 17x17 window (int32 offsets) with a NaN in its last element
    _, argmax = ops.maxpool_fprop(np.full((1, 1, 3, 5), np.nan, dtype=np.float32), 3, 2)
    assert (argmax == 0).all()
    x = np.arange(17 * 17, dtype=np.float32).reshape(1, 1, 17, 17)
    x[0, 0, 16, 16], x[0, 0, 16, 15] = np.nan, np.inf
    y, argmax = ops.maxpool_fprop(x, 17, 1)
    assert argmax.dtype == np.int32 and np.isnan(y).all() and argmax.item() == 288


def test_linear_matches_finite_differences():
    rng = np.random.default_rng(7)
    x, w, b = rng.standard_normal((4, 5)), rng.standard_normal((3, 5)), rng.standard_normal(3)
    g = rng.standard_normal((4, 3))
    assert_close(ops.linear_fprop(x, w, b), x @ w.T + b, "linear_fprop", 1e-12, 1e-12)

    def loss():
        return float(np.sum(ops.linear_fprop(x, w, b) * g))

    assert_close(ops.linear_dgrad(g, w), numeric_grad(loss, x), "linear_dgrad")
    assert_close(ops.linear_wgrad(g, x), numeric_grad(loss, w), "linear_wgrad")
    assert_close(ops.bias_grad(g), numeric_grad(loss, b), "linear bias_grad")


def test_softmax_xent_matches_finite_differences_and_definition():
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((5, 4)) * 3
    labels = np.array([0, 3, 1, 1, 2], dtype=np.int64)
    loss, dlogits, correct = ops.softmax_xent(logits, labels)
    prob = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert isinstance(loss, float) and isinstance(correct, int)
    assert loss == pytest.approx(-np.mean(np.log(prob[np.arange(5), labels])), rel=1e-12)
    assert correct == int(np.sum(logits.argmax(axis=1) == labels))
    assert_close(dlogits, numeric_grad(lambda: ops.softmax_xent(logits, labels)[0], logits), "softmax_xent dlogits")


def test_softmax_xent_is_stable_for_large_logits():
    logits = np.array([[1e4, 0.0, -1e4], [50.0, 50.0, 50.0]], dtype=np.float32)
    loss, dlogits, correct = ops.softmax_xent(logits, np.array([1, 2]))
    assert np.isfinite(loss) and np.isfinite(dlogits).all() and dlogits.dtype == np.float32
    assert loss == pytest.approx((1e4 + np.log(3)) / 2, rel=1e-6)
    assert correct == 0  # row 1 ties: argmax picks class 0


@pytest.mark.parametrize("bad", [-1, 4])
def test_softmax_xent_rejects_out_of_range_labels(bad):
    labels = np.array([0, bad, 1], dtype=np.int64)
    with pytest.raises(ValueError, match=rf"softmax_xent: label {bad} at index 1 is outside \[0, 4\)"):
        ops.softmax_xent(np.zeros((3, 4), dtype=np.float32), labels)
    with pytest.raises(ValueError, match="labels must be an integer array"):
        ops.softmax_xent(np.zeros((3, 4), dtype=np.float32), np.zeros(3, dtype=np.float32))


def test_inputs_are_validated_with_op_argument_and_expected_shape():
    x = np.zeros((2, 3, 8, 8), dtype=np.float32)
    w = np.zeros((4, 3, 3, 3), dtype=np.float32)
    with pytest.raises(ValueError, match=r"conv2d_fprop: x must have shape \(N, C, H, W\)"):
        ops.conv2d_fprop(x[0], w, None, 1, 1)
    with pytest.raises(ValueError, match=r"conv2d_fprop: w must have shape \(K, C=3, R, S\)"):
        ops.conv2d_fprop(x, np.zeros((4, 2, 3, 3), dtype=np.float32), None, 1, 1)
    with pytest.raises(ValueError, match="conv2d_fprop: w must have dtype float32"):
        ops.conv2d_fprop(x, w.astype(np.float64), None, 1, 1)
    with pytest.raises(ValueError, match="conv2d_fprop: x must be float32"):
        ops.conv2d_fprop(x.astype(np.int32), w, None, 1, 1)
    with pytest.raises(ValueError, match=r"conv2d_fprop: b must have shape \(4,\)"):
        ops.conv2d_fprop(x, w, np.zeros(3, dtype=np.float32), 1, 1)
    with pytest.raises(ValueError, match="conv2d_fprop: stride must be an int >= 1"):
        ops.conv2d_fprop(x, w, None, 0, 1)
    with pytest.raises(ValueError, match=r"conv2d_dgrad: dy must have shape \(2, 4, 8, 8\)"):
        ops.conv2d_dgrad(np.zeros((2, 4, 7, 8), dtype=np.float32), w, x.shape, 1, 1)
    dy = np.zeros((2, 4, 8, 8), dtype=np.float32)
    with pytest.raises(ValueError, match=r"conv2d_wgrad: out must be a float32 array of shape \(4, 3, 3, 3\)"):
        ops.conv2d_wgrad(dy, x, w.shape, 1, 1, out=np.zeros((4, 3, 3, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="conv2d_wgrad: out must be C-contiguous"):
        ops.conv2d_wgrad(dy, x, w.shape, 1, 1, out=np.zeros((4, 3, 3, 6), dtype=np.float32)[..., ::2])
    with pytest.raises(ValueError, match=r"maxpool_fprop: kernel 3 larger than input"):
        ops.maxpool_fprop(np.zeros((1, 1, 2, 5), dtype=np.float32), 3, 2)
    with pytest.raises(ValueError, match=r"linear_fprop: expected w \(O, 5\)"):
        ops.linear_fprop(np.zeros((2, 5), np.float32), np.zeros((3, 4), np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="relu_bprop: dy and y must be float arrays of one shape"):
        ops.relu_bprop(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))


@pytest.mark.parametrize("call, message", [
    (lambda x, w, dy: ops.conv2d_wgrad(dy, x, None, 1, 1),
     r"conv2d_wgrad: w_shape must be 4 integers >= 0 \(K, C, R, S\), got None"),
    (lambda x, w, dy: ops.conv2d_wgrad(dy, x, 4, 1, 1), "w_shape must be 4 integers >= 0"),
    (lambda x, w, dy: ops.conv2d_wgrad(dy, x, (4, 3, -3, 3), 1, 1), r"got \(4, 3, -3, 3\)"),
    (lambda x, w, dy: ops.conv2d_dgrad(dy, w, None, 1, 1), "conv2d_dgrad: x_shape must be 4 integers >= 0"),
    (lambda x, w, dy: ops.conv2d_dgrad(dy, w, "abcd", 1, 1), "conv2d_dgrad: x_shape must be 4 integers >= 0"),
    (lambda x, w, dy: ops.maxpool_bprop(dy, np.zeros((2, 4, 8, 8), np.float32), (2, 4, 16, 16), 2, 2),
     "maxpool_bprop: argmax must hold integers"),
    (lambda x, w, dy: ops.maxpool_bprop(dy, np.full((2, 4, 8, 8), 200, np.uint8), (2, 4, 16, 16), 2, 2),
     r"maxpool_bprop: argmax must lie in 0..3 \(offsets in a 2x2 window\), got 200..200"),
    (lambda x, w, dy: ops.maxpool_bprop(dy, [0] * 1000, (2, 4, 16, 16), 2, 2), r"got \(2, 4, 8, 8\) and list$"),
    (lambda x, w, dy: ops.relu_fprop([1.0] * 1000), "relu_fprop: x must be a float32/float64 array, got list$"),
    (lambda x, w, dy: ops.conv2d_fprop(x, w, None, True, 1), "conv2d_fprop: stride must be an int >= 1, got True"),
])
def test_malformed_shapes_and_argmax_get_one_clear_error(call, message):
    """The numpy backend refuses what the cupy backend refuses, naming the op and what it expected, and
    shows a bad argument's type, not its value (helper-23: raw TypeErrors and IndexErrors before)."""
    x, w = np.zeros((2, 3, 8, 8), np.float32), np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(ValueError, match=message):
        call(x, w, np.zeros((2, 4, 8, 8), np.float32))


def test_array_helpers():
    assert ops.zeros(3).dtype == np.float32 and (ops.zeros(3) == 0).all()
    assert ops.empty((2, 3)).shape == (2, 3)
    a = ops.asarray([[1, 2], [3, 4]])
    assert a.dtype == np.float32 and a.flags.c_contiguous
    assert ops.to_numpy(a) is a
    assert ops.may_share_memory(a, a[0]) and not ops.may_share_memory(a, ops.zeros(2))


def test_get_backend():
    assert get_backend("numpy") is ops
    with pytest.raises(ValueError, match="unknown ops backend 'cuda'; valid backends: numpy"):
        get_backend("cuda")


def test_bias_grad_of_an_empty_batch_is_zero():
    """N = 0: every backend returns zeros (numpy_ops used to fail to reshape an empty array)."""
    from mpiasgd.ops import numpy_ops

    np.testing.assert_array_equal(numpy_ops.bias_grad(np.zeros((0, 4, 3, 3), np.float32)), np.zeros(4))
    np.testing.assert_array_equal(numpy_ops.bias_grad(np.zeros((0, 4), np.float32)), np.zeros(4))
