"""The cpu backend (`mpiasgd.ops.cpu_ops`): its convolutions against the numpy reference and a direct loop,
its scratch reused across calls, its errors, and whole networks' gradients against the reference.

The cpu backend sums in another order than the reference (groups of samples, wide columns), so float64
results agree to ~1e-13 and float32 results to float32 rounding; every op it does not override is the
reference's own function.
"""

import numpy as np
import pytest
from kit.convs import CONV_CASES, conv_case, naive_conv
from kit.grads import assert_close

from mpiasgd.model import build_model
from mpiasgd.ops import cpu_ops, get_backend, numpy_ops

cpu = get_backend("cpu")
ref = get_backend("numpy")

# the convolutions of the built-in networks (N, C, H, W, K, R, S, stride, pad): cifar10's three, resnet20's
# stride-1 and stride-2 ones, alexnet_1gpu_64's first; the batch not a multiple of the group size
NETWORK_CASES = [
    (9, 3, 32, 32, 32, 5, 5, 1, 2),
    (9, 32, 15, 15, 32, 5, 5, 1, 2),
    (9, 32, 7, 7, 64, 5, 5, 1, 2),
    (7, 16, 32, 32, 16, 3, 3, 1, 1),
    (7, 16, 32, 32, 32, 3, 3, 2, 1),
    (7, 64, 8, 8, 64, 3, 3, 1, 1),
    (5, 3, 64, 64, 64, 5, 5, 2, 2),
]


def test_the_backend_object():
    assert type(cpu) is cpu_ops.CpuBackend and cpu.name == "cpu" and isinstance(cpu, numpy_ops.NumpyBackend)
    assert cpu.conv2d_fprop is cpu_ops.conv2d_fprop and cpu.conv2d_wgrad is cpu_ops.conv2d_wgrad
    assert cpu.relu_fprop is numpy_ops.relu_fprop  # everything else: the reference's own function
    assert repr(cpu) == "CpuBackend()"


def test_group_size_aims_at_the_group_columns(monkeypatch):
    monkeypatch.setattr(cpu_ops, "GROUP_COLUMNS", 256)
    assert cpu_ops.group_size(64, 15, 19) == 1  # 285 columns a sample: one sample a group
    assert cpu_ops.group_size(64, 7, 11) == 4   # 77 a sample: 4 samples make 308 >= 256
    assert cpu_ops.group_size(3, 7, 11) == 3    # never more than the batch
    assert cpu_ops.group_size(64, 1, 1) == 64
    monkeypatch.setattr(cpu_ops, "GROUP_COLUMNS", 1024)
    assert cpu_ops.group_size(64, 15, 19) == 4  # 1,140 columns


@pytest.fixture(params=[64, 1024], ids=["groups-64", "groups-1024"])
def group_columns(request, monkeypatch):
    """GROUP_COLUMNS small (several groups, a short last one) and as shipped."""
    monkeypatch.setattr(cpu_ops, "GROUP_COLUMNS", request.param)
    return request.param


@pytest.mark.parametrize("case", CONV_CASES + NETWORK_CASES)
def test_convolutions_equal_the_reference(case, group_columns):
    x, w, b, stride, pad = conv_case(case)
    y = cpu.conv2d_fprop(x, w, b, stride, pad)
    assert y.dtype == np.float64 and y.flags.c_contiguous
    assert_close(y, ref.conv2d_fprop(x, w, b, stride, pad), f"fprop {case}", 1e-12, 1e-12)
    assert_close(cpu.conv2d_fprop(x, w, None, stride, pad), ref.conv2d_fprop(x, w, None, stride, pad),
                 f"fprop no bias {case}", 1e-12, 1e-12)
    g = np.random.default_rng(1).standard_normal(y.shape)
    assert_close(cpu.conv2d_wgrad(g, x, w.shape, stride, pad), ref.conv2d_wgrad(g, x, w.shape, stride, pad),
                 f"wgrad {case}", 1e-12, 1e-12)
    assert_close(cpu.conv2d_dgrad(g, w, x.shape, stride, pad), ref.conv2d_dgrad(g, w, x.shape, stride, pad),
                 f"dgrad {case}", 1e-12, 1e-12)
    x32, w32, b32, g32 = (a.astype(np.float32) for a in (x, w, b, g))
    y32 = cpu.conv2d_fprop(x32, w32, b32, stride, pad)
    dw32 = cpu.conv2d_wgrad(g32, x32, w.shape, stride, pad)
    dx32 = cpu.conv2d_dgrad(g32, w32, x.shape, stride, pad)
    assert y32.dtype == dw32.dtype == dx32.dtype == np.float32
    assert_close(y32, y, f"fprop float32 {case}", 1e-4, 1e-4)
    assert_close(dw32, ref.conv2d_wgrad(g, x, w.shape, stride, pad), f"wgrad float32 {case}", 1e-3, 1e-4)
    assert_close(dx32, ref.conv2d_dgrad(g, w, x.shape, stride, pad), f"dgrad float32 {case}", 1e-4, 1e-4)


@pytest.mark.parametrize("case", CONV_CASES[:3])
def test_fprop_matches_a_direct_loop(case):
    x, w, b, stride, pad = conv_case(case)
    assert_close(cpu.conv2d_fprop(x, w, b, stride, pad), naive_conv(x, w, b, stride, pad), f"fprop {case}",
                 1e-12, 1e-12)


def test_scratch_reused_across_batches_and_inputs_stays_exact(group_columns):
    """One workspace through batches of 9, 5 and 9 samples (a full group and a short one) and two inputs:
    every result equals a fresh call's, bit for bit (the zero padding kept between calls stays zero)."""
    ws = cpu.Workspace()
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 4, 5, 5)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    for N in (9, 5, 9, 9):
        x = rng.standard_normal((N, 4, 7, 7)).astype(np.float32)
        g = rng.standard_normal((N, 8, 7, 7)).astype(np.float32)
        assert np.array_equal(cpu.conv2d_fprop(x, w, b, 1, 2, ws=ws), cpu.conv2d_fprop(x, w, b, 1, 2))
        assert np.array_equal(cpu.conv2d_wgrad(g, x, w.shape, 1, 2, ws=ws), cpu.conv2d_wgrad(g, x, w.shape, 1, 2))
        assert np.array_equal(cpu.conv2d_dgrad(g, w, x.shape, 1, 2, ws=ws), cpu.conv2d_dgrad(g, w, x.shape, 1, 2))
    assert ws.nbytes > 0


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("pad", [0, 1])
def test_a_non_finite_input_spreads_as_in_the_reference(value, pad, group_columns):
    """An inf or NaN in x (or dy) makes the same outputs and gradient entries non-finite as in the reference
    (the wide columns the reference never reads must not turn 0 * inf into NaN), the rest agree."""
    rng = np.random.default_rng(11)
    for where in [(0, 0, 2, 5), (1, 3, 0, 0), (2, 7, 15, 15), (0, 5, 8, 0)]:
        x = rng.standard_normal((3, 8, 16, 16)).astype(np.float32)
        w = rng.standard_normal((4, 8, 3, 3)).astype(np.float32)
        x[where] = value
        y = [o.conv2d_fprop(x, w, None, 1, pad) for o in (ref, cpu)]
        dy = rng.standard_normal(y[0].shape).astype(np.float32)
        dx_in = dy.copy()
        dx_in[where[0], 1, min(where[2], y[0].shape[2] - 1), 0] = value
        for what, (theirs, ours) in {
            "fprop": y,
            "wgrad": [o.conv2d_wgrad(dy, x, w.shape, 1, pad) for o in (ref, cpu)],
            "dgrad": [o.conv2d_dgrad(dx_in, w, x.shape, 1, pad) for o in (ref, cpu)],
        }.items():
            assert np.array_equal(np.isfinite(ours), np.isfinite(theirs)), (what, where)
            assert np.array_equal(np.isnan(ours), np.isnan(theirs)), (what, where)
            finite = np.isfinite(theirs)
            assert_close(ours[finite], theirs[finite], f"{what} {where}", 1e-3, 1e-4)


@pytest.mark.parametrize("w_shape", [(4, 3, 0, 0), (4, 3, 0, 3), (4, 3, 3, 0)])
def test_an_empty_filter_gives_the_references_results(w_shape):
    """A filter of no rows or columns: y is the bias, dw is empty, dx is zero, as on the reference."""
    x, b = np.ones((2, 3, 5, 5), np.float32), np.arange(4, dtype=np.float32)
    w = np.zeros(w_shape, np.float32)
    y = [o.conv2d_fprop(x, w, b, 1, 1) for o in (ref, cpu)]
    assert np.array_equal(y[0], y[1]) and np.array_equal(y[1], np.broadcast_to(b.reshape(1, 4, 1, 1), y[1].shape))
    dy = np.ones_like(y[0])
    assert np.array_equal(cpu.conv2d_wgrad(dy, x, w_shape, 1, 1), ref.conv2d_wgrad(dy, x, w_shape, 1, 1))
    assert np.array_equal(cpu.conv2d_dgrad(dy, w, x.shape, 1, 1), np.zeros(x.shape, np.float32))


def test_an_empty_batch_gives_empty_outputs_and_a_zero_weight_gradient():
    x, w = np.zeros((0, 3, 5, 5), np.float32), np.ones((4, 3, 3, 3), np.float32)
    dy = np.zeros((0, 4, 5, 5), np.float32)
    ws = cpu.Workspace()
    cpu.conv2d_wgrad(np.ones((2, 4, 5, 5), np.float32), np.ones((2, 3, 5, 5), np.float32), w.shape, 1, 1, ws=ws)
    assert cpu.conv2d_fprop(x, w, None, 1, 1, ws=ws).shape == (0, 4, 5, 5)
    assert cpu.conv2d_dgrad(dy, w, x.shape, 1, 1, ws=ws).shape == (0, 3, 5, 5)
    assert np.array_equal(cpu.conv2d_wgrad(dy, x, w.shape, 1, 1, ws=ws), np.zeros(w.shape, np.float32))


def test_wgrad_writes_into_an_out_view_only():
    x, w, _, stride, pad = conv_case((3, 2, 6, 5, 3, 3, 3, 1, 1))
    g = np.random.default_rng(3).standard_normal((3, 3, 6, 5))
    flat = np.full(w.size + 4, 7.0)
    view = flat[2:2 + w.size].reshape(w.shape)
    assert cpu.conv2d_wgrad(g, x, w.shape, stride, pad, out=view) is view
    assert_close(view, ref.conv2d_wgrad(g, x, w.shape, stride, pad), "wgrad out=", 1e-12, 1e-12)
    assert (flat[:2] == 7).all() and (flat[-2:] == 7).all()


@pytest.mark.parametrize("call", [
    lambda o, x, w: o.conv2d_fprop(x[:, :2], w, None, 1, 1),                     # channel mismatch
    lambda o, x, w: o.conv2d_fprop(x, w.astype(np.float64), None, 1, 1),          # dtype mismatch
    lambda o, x, w: o.conv2d_fprop(x, w, np.zeros(2, np.float32), 1, 1),           # bias shape
    lambda o, x, w: o.conv2d_wgrad(np.zeros((2, 4, 9, 9), np.float32), x, w.shape, 1, 1),  # dy shape
    lambda o, x, w: o.conv2d_dgrad(np.zeros((2, 4, 5, 5), np.float32), w, x.shape, 1, 1),  # dy shape
    lambda o, x, w: o.conv2d_fprop(x, w, None, 0, 1),                              # stride 0
    lambda o, x, w: o.conv2d_fprop(x[0], w, None, 1, 1),                           # 3-D input
])
def test_bad_arguments_raise_the_references_error(call):
    x = np.zeros((2, 3, 6, 6), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(ValueError) as theirs:
        call(ref, x, w)
    with pytest.raises(ValueError) as ours:
        call(cpu, x, w)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("shape", [(6, 16, 32, 32), (5, 3, 7, 3), (2, 4, 1, 1), (1, 2, 3, 9)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batchnorm_equals_the_reference(shape, dtype):
    """Statistics (and the running update), forward and backward on channels with a large mean (the
    cancellation case), odd sizes (the lanes' tail) and one value a sample: float32 results equal the
    reference's bit for bit (its float64 sums, summed in another order, round to the same float32 values);
    float64 results agree to float64 rounding."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(shape) * 3 + 50).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    C = shape[1]
    gamma, beta = rng.standard_normal(C).astype(dtype), rng.standard_normal(C).astype(dtype)
    runs = [(np.full(C, 0.5, dtype), np.full(C, 2.0, dtype)) for _ in range(2)]
    (m0, v0), (m1, v1) = (o.batchnorm_stats(x, rm, rv, 0.1) for o, (rm, rv) in zip((ref, cpu), runs, strict=True))
    y = [o.batchnorm_fprop(x, gamma, beta, m0, v0, 1e-5) for o in (ref, cpu)]
    grads = [(np.empty(C, dtype), np.empty(C, dtype)) for _ in range(2)]
    dx = [o.batchnorm_bprop(dy, x, gamma, m0, v0, 1e-5, dg, db) for o, (dg, db) in zip((ref, cpu), grads, strict=True)]
    pairs = [("mean", m0, m1), ("var", v0, v1), ("running mean", runs[0][0], runs[1][0]),
             ("running var", runs[0][1], runs[1][1]), ("y", *y), ("dx", *dx), ("dgamma", grads[0][0], grads[1][0]),
             ("dbeta", grads[0][1], grads[1][1])]
    for what, theirs, ours in pairs:
        assert ours.dtype == dtype, what
        if dtype == np.float32:
            assert np.array_equal(ours, theirs), what
        else:
            assert_close(ours, theirs, what, 1e-12, 1e-12)
    dg, db = np.zeros(C, dtype), np.zeros(C, dtype)
    assert cpu.batchnorm_bprop(dy, x, gamma, m0, v0, 1e-5, dg, db, need_dx=False) is None
    assert np.array_equal(dg, grads[1][0]) and np.array_equal(db, grads[1][1])


@pytest.mark.parametrize("call", [
    lambda o, x, c: o.batchnorm_stats(x[0]),
    lambda o, x, c: o.batchnorm_stats(x, c, None),
    lambda o, x, c: o.batchnorm_stats(x, c, c, 1.5),
    lambda o, x, c: o.batchnorm_fprop(x, c[:2], c, c, c, 1e-5),
    lambda o, x, c: o.batchnorm_fprop(x, c, c, c, c, 0.0),
    lambda o, x, c: o.batchnorm_bprop(x[:1], x, c, c, c, 1e-5, c.copy(), c.copy()),
    lambda o, x, c: o.batchnorm_bprop(x, x, c, c, c, 1e-5, None, c.copy()),
])
def test_batchnorm_bad_arguments_raise_the_references_error(call):
    x, c = np.ones((2, 3, 4, 4), np.float32), np.ones(3, np.float32)
    with pytest.raises(ValueError) as theirs:
        call(ref, x, c)
    with pytest.raises(ValueError) as ours:
        call(cpu, x, c)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("name", ["cifar10", "resnet20"])
def test_a_networks_gradient_equals_the_reference(name):
    """forward_backward of a built-in network on both backends from the same weights: the same loss and
    gradient to float32 rounding (resnet20: BatchNorm, residual blocks, stride-2 convs)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, 6)
    results = []
    for backend in ("numpy", "cpu"):
        model = build_model(name, backend)
        params = model.init_params(0)
        grads = np.zeros_like(params)
        model.bind(params, grads, model.init_buffers())
        loss, correct = model.forward_backward(x, y)
        results.append((loss, correct, grads))
    (loss0, correct0, g0), (loss1, correct1, g1) = results
    assert correct0 == correct1
    assert abs(loss0 - loss1) <= 1e-5 * abs(loss0)
    assert np.abs(g0).max() > 0
    assert_close(g1, g0, f"{name} gradient", 1e-5 * np.abs(g0).max(), 1e-3)
