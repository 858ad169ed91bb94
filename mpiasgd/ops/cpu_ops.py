"""The CPU backend for speed ("cpu"): the numpy reference's ops, with the convolutions restructured
to run their GEMMs out of the cache and batch normalisation in compiled loops. Layout NCHW, float32
(float64 accepted, as the reference). `--backend auto` runs it on nodes without a GPU; `numpy` stays
the ground truth the CUDA kernels and the tests compare against.

Convolutions. The reference's column matrix holds the whole minibatch, (C*R*S, N*P*Q) float32 (52 MB
for cifar10's second conv at batch 64), so its im2col writes it to memory, the GEMM reads it back,
and the GEMM's shape (32 rows, 800 deep, 16,384 wide) runs at about half of OpenBLAS's peak on one
core. Here a convolution of stride 1 runs over groups of `nb` samples whose columns fit in L2
(`group_size`: about `GROUP_COLUMNS` columns a group) and builds those columns from long contiguous
runs instead of rows of Q values:

    padded width  the input is zero-padded to (C, Hp, Wp) and flattened, each sample followed by
                  S - 1 zeros; output pixel (p, q) is computed at column j = p * Wp + q of a "wide"
                  output (K, P, Wp) whose columns q >= Q read across a row end and are dropped
    columns       cols[(s, c, r), (n, j)] = xpad_n[c * Hp * Wp + r * Wp + s + j], j < P * Wp: for each
                  (s, c, r) one contiguous run of P * Wp values (a strided view copied by numpy)
    fprop         y_wide (K, nb * P * Wp) = w (K, S*C*R) @ cols, cropped to (nb, K, P, Q) (+ bias)
    wgrad         dw.T (S*C*R, K) += cols @ dy_wide.T (cols and dy_wide (K, nb * P * Wp) zero in the
                  columns q >= Q, so the dropped columns add nothing, not even a NaN from 0 * inf), summed
                  over the groups
    dgrad         a convolution of dy with the flipped, transposed filters (pad R-1-pad), as fprop

The wide columns cost Wp / Q more multiply-adds than the reference's (1.27 for cifar10's 15x15 maps
with a 5x5 kernel), paid back by GEMMs that run from L2: 1.3-2.8x the reference's speed on the
stride-1 convolutions of cifar10 and resnet20 (docs/benchmarks/cpu.md). Strides other than 1 run
the reference's im2col.

Batch normalisation: `mpiasgd.ops.cpu_kernels` (numba), the reference's float64 sums and float32
operations in one pass per sum instead of float64 copies of the activation, 2-7x faster. The float64
sums run in another order (eight lanes), so a float32 result equals the reference's bit for bit
whenever the two sums round to the same float32 value: on every activation of the tests and of real
training seen so far; sums that cancel (terms of 1e7-1e8 of both signs around a small total) can
differ in their last bits (relative 4e-4 of the small total seen).

Every other op is the reference's own function. The convolutions' results equal the reference's to
float32 rounding (the sums run in another order).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from mpiasgd.ops import numpy_ops
from mpiasgd.ops.contract import check_out, shape4
from mpiasgd.ops.numpy_ops import (
    NumpyBackend,
    Workspace,
    check_batchnorm_bprop,
    check_batchnorm_fprop,
    check_batchnorm_stats,
    check_conv_dgrad,
    check_conv_fprop,
    check_conv_wgrad,
)

GROUP_COLUMNS = 1024  # columns (output pixels of the wide output) a group's GEMM aims for: its columns matrix
# (S*C*R, nb * P * Wp) then is 0.2-1 MB for the networks here, in L2 (measured on cifar10's convs: 128-512
# columns within 10 % of each other, 1 sample of 7x7 (77 columns) 1.3x slower)


def group_size(N: int, P: int, Wp: int) -> int:
    """Samples per group: enough for `GROUP_COLUMNS` wide-output columns (P * Wp each), at most N."""
    return max(1, min(N, math.ceil(GROUP_COLUMNS / (P * Wp))))


def _zeroed(ws: Workspace | None, key: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A scratch array that was zero-filled when allocated; callers write only its interior, so what
    they never write (padding borders, tails) stays zero between calls."""
    if ws is None:
        return np.zeros(shape, dtype)
    return ws.zeroed(key, shape, dtype)


class _Wide:
    """The geometry of one stride-1 convolution over groups: x (N, C, H, W) padded by (ph, pw) with a
    (K, C, R, S) filter; the group buffers come from `ws` under `key`."""

    def __init__(self, x_shape: tuple[int, ...], R: int, S: int, ph: int, pw: int, dtype, ws: Workspace | None,
                 key: str) -> None:
        N, C, H, W = x_shape
        self.N, self.C, self.H, self.W, self.R, self.S, self.ph, self.pw = N, C, H, W, R, S, ph, pw
        self.Hp, self.Wp = H + 2 * ph, W + 2 * pw
        self.P, self.Q = self.Hp - R + 1, self.Wp - S + 1
        self.L = self.P * self.Wp  # wide-output columns per sample
        self.plane = C * self.Hp * self.Wp
        self.stride = self.plane + S - 1  # values per padded sample: its planes, then S - 1 zeros
        self.nb = group_size(N, self.P, self.Wp)
        self.dtype, self.ws, self.key = dtype, ws, key

    def groups(self):
        """(first sample, samples) of each group."""
        for n0 in range(0, self.N, self.nb):
            yield n0, min(self.nb, self.N - n0)

    def columns(self, x: np.ndarray, n0: int, m: int) -> np.ndarray:
        """The columns (S*C*R, m * P * Wp) of samples n0..n0+m-1 of x (rows in (s, c, r) order)."""
        C, H, W, R, S, Hp, Wp, L = self.C, self.H, self.W, self.R, self.S, self.Hp, self.Wp, self.L
        geometry = f"{self.key}.{C}x{H}x{W}p{self.ph},{self.pw}k{R}x{S}n{m}"
        xp = _zeroed(self.ws, geometry + ".xpad", (m, self.stride), self.dtype)
        inner = xp[:, :self.plane].reshape(m, C, Hp, Wp)[:, :, self.ph:self.ph + H, self.pw:self.pw + W]
        np.copyto(inner, x[n0:n0 + m])
        it = xp.itemsize
        windows = as_strided(xp, shape=(S, C, R, m, L), strides=(it, Hp * Wp * it, Wp * it, self.stride * it, it),
                             writeable=False)
        cols = numpy_ops._scratch(self.ws, geometry + ".cols", (S, C, R, m, L), self.dtype)
        np.copyto(cols, windows)
        return cols.reshape(S * C * R, m * L)

    def filters(self, w: np.ndarray) -> np.ndarray:
        """w (K, C, R, S) as (K, S*C*R), the columns' row order."""
        K = w.shape[0]
        return np.ascontiguousarray(w.transpose(0, 3, 1, 2)).reshape(K, self.S * self.C * self.R)


def _forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, ph: int, pw: int, ws: Workspace | None,
             key: str) -> np.ndarray:
    """Unchecked stride-1 convolution with H/W padding (ph, pw) over groups; a fresh (N, K, P, Q) array."""
    K, _, R, S = w.shape
    g = _Wide(x.shape, R, S, ph, pw, x.dtype, ws, key)
    w2 = g.filters(w)
    y = np.empty((g.N, K, g.P, g.Q), dtype=x.dtype)
    for n0, m in g.groups():
        cols = g.columns(x, n0, m)
        yw = numpy_ops._scratch(ws, f"{key}.ywide{m}", (K, m, g.P, g.Wp), x.dtype)
        np.matmul(w2, cols, out=yw.reshape(K, m * g.L))  # the GEMM, from L2
        crop = yw[:, :, :, :g.Q].transpose(1, 0, 2, 3)  # (m, K, P, Q) view
        if b is None:
            np.copyto(y[n0:n0 + m], crop)
        else:
            np.add(crop, b.reshape(1, K, 1, 1), out=y[n0:n0 + m])
    return y


def conv2d_fprop(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: int, pad: int,
                 ws: Workspace | None = None) -> np.ndarray:
    """Forward convolution (`protocol.Backend.conv2d_fprop`): x (N, C, H, W), w (K, C, R, S), b (K,) or
    None -> y (N, K, P, Q), fresh. Stride 1: the grouped wide-column GEMMs of this module's docstring;
    other strides: the reference's im2col."""
    check_conv_fprop("conv2d_fprop", x, w, b, stride, pad)
    if stride != 1 or 0 in w.shape[2:]:  # (an empty filter: the reference's bias-only result)
        return numpy_ops.conv2d_fprop(x, w, b, stride, pad, ws)
    return _forward(x, w, b, pad, pad, ws, "fprop")


def conv2d_wgrad(dy: np.ndarray, x: np.ndarray, w_shape: tuple[int, int, int, int], stride: int,
                 pad: int, out: np.ndarray | None = None, ws: Workspace | None = None) -> np.ndarray:
    """Filter gradient (`protocol.Backend.conv2d_wgrad`): dy (N, K, P, Q), x (N, C, H, W) -> dw
    (K, C, R, S), into `out` when given. Stride 1: dw = sum over groups of dy_wide @ cols.T (this
    module's docstring); other strides: the reference's."""
    op = "conv2d_wgrad"
    check_conv_wgrad(op, dy, x, w_shape, stride, pad)
    if stride != 1 or 0 in tuple(w_shape)[2:]:
        return numpy_ops.conv2d_wgrad(dy, x, w_shape, stride, pad, out, ws)
    K, C, R, S = shape4(op, "w_shape", w_shape, "(K, C, R, S)")
    dw = check_out(op, out, (K, C, R, S), x.dtype)
    g = _Wide(x.shape, R, S, pad, pad, x.dtype, ws, "wgrad")
    # dw transposed, (S*C*R, K) = cols @ dy_wide.T: OpenBLAS runs this orientation 1.3-1.8x faster than
    # (K, S*C*R) = dy_wide @ cols.T (its short side, K, then is the narrow output's width)
    acc = numpy_ops._scratch(ws, "wgrad.acc", (S * C * R, K), x.dtype)
    acc.fill(0)  # an empty batch (no group) has a zero gradient
    part = numpy_ops._scratch(ws, "wgrad.part", (S * C * R, K), x.dtype)
    for i, (n0, m) in enumerate(g.groups()):
        cols = g.columns(x, n0, m)
        # the dropped columns (q >= Q) read values across a row end that no output uses: zero them, so that an
        # inf or NaN there meets dy_wide's zeros as 0 * 0, not 0 * inf = NaN (the reference never reads them)
        cols.reshape(-1, m, g.P, g.Wp)[:, :, :, g.Q:] = 0
        dyw = _zeroed(ws, f"wgrad.dywide{g.P}x{g.Wp}q{g.Q}n{m}", (K, m, g.P, g.Wp), x.dtype)
        np.copyto(dyw[:, :, :, :g.Q], dy[n0:n0 + m].transpose(1, 0, 2, 3))  # columns q >= Q stay 0
        np.matmul(cols, dyw.reshape(K, m * g.L).T, out=acc if i == 0 else part)
        if i:
            acc += part
    np.copyto(dw, acc.reshape(S, C, R, K).transpose(3, 1, 2, 0))
    return dw


def conv2d_dgrad(dy: np.ndarray, w: np.ndarray, x_shape: tuple[int, int, int, int], stride: int,
                 pad: int, ws: Workspace | None = None) -> np.ndarray:
    """Input gradient (`protocol.Backend.conv2d_dgrad`): dy (N, K, P, Q), w (K, C, R, S) -> dx (N, C, H, W),
    fresh. Stride 1 with pad < R and pad < S: a convolution of dy with the flipped, transposed filters
    (C, K, R, S) and padding R-1-pad, S-1-pad over groups; otherwise the reference's."""
    check_conv_dgrad("conv2d_dgrad", dy, w, x_shape, stride, pad)
    _, _, R, S = w.shape
    if stride != 1 or pad >= R or pad >= S:
        return numpy_ops.conv2d_dgrad(dy, w, x_shape, stride, pad, ws)
    w_t = np.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
    return _forward(dy, w_t, None, R - 1 - pad, S - 1 - pad, ws, "dgrad")


def batchnorm_stats(x: np.ndarray, running_mean: np.ndarray | None = None, running_var: np.ndarray | None = None,
                    momentum: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel batch statistics (`protocol.Backend.batchnorm_stats`; the reference's formulas and running
    update): x (N, C, H, W) -> (mean (C,), biased var (C,)), x's dtype; two compiled float64 passes over each
    channel (`cpu_kernels.batchnorm_stats`) instead of a float64 copy of x."""
    from mpiasgd.ops import cpu_kernels

    m = check_batchnorm_stats("batchnorm_stats", x, running_mean, running_var, momentum)
    N, C, H, W = x.shape
    M = N * H * W
    mean, var = np.empty(C), np.empty(C)
    cpu_kernels.batchnorm_stats(np.ascontiguousarray(x).reshape(N, C, H * W), mean, var)
    if running_mean is not None:
        unbiased = var * (M / (M - 1)) if M > 1 else var
        running_mean[...] = (1 - m) * running_mean.astype(np.float64) + m * mean
        running_var[...] = (1 - m) * running_var.astype(np.float64) + m * unbiased
    return mean.astype(x.dtype), var.astype(x.dtype)


def batchnorm_fprop(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, mean: np.ndarray, var: np.ndarray,
                    eps: float) -> np.ndarray:
    """y = (x - mean) * (gamma / sqrt(var + eps)) + beta per channel (`protocol.Backend.batchnorm_fprop`), the
    reference's float32 operations in its order, in one compiled pass; fresh (N, C, H, W)."""
    from mpiasgd.ops import cpu_kernels

    eps = check_batchnorm_fprop("batchnorm_fprop", x, gamma, beta, mean, var, eps)
    N, C, H, W = x.shape
    a = (gamma / np.sqrt(var.astype(np.float64) + eps)).astype(x.dtype)
    y = np.empty_like(x, order="C")
    cpu_kernels.batchnorm_fprop(np.ascontiguousarray(x).reshape(N, C, H * W), np.ascontiguousarray(mean), a,
                                np.ascontiguousarray(beta), y.reshape(N, C, H * W))
    return y


def batchnorm_bprop(dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, mean: np.ndarray, var: np.ndarray,
                    eps: float, dgamma: np.ndarray, dbeta: np.ndarray, need_dx: bool = True) -> np.ndarray | None:
    """Gradient of `batchnorm_fprop` with the batch statistics (`protocol.Backend.batchnorm_bprop`; the
    reference's formulas): the two float64 sums in one compiled pass per channel, dx in another."""
    from mpiasgd.ops import cpu_kernels

    eps = check_batchnorm_bprop("batchnorm_bprop", dy, x, gamma, mean, var, eps, dgamma, dbeta, need_dx)
    N, C, H, W = x.shape
    M = N * H * W
    x3, dy3 = np.ascontiguousarray(x).reshape(N, C, H * W), np.ascontiguousarray(dy).reshape(N, C, H * W)
    invstd = 1.0 / np.sqrt(var.astype(np.float64) + eps)
    sum_dy, sum_dy_dev = np.empty(C), np.empty(C)
    cpu_kernels.batchnorm_sums(dy3, x3, mean.astype(np.float64), sum_dy, sum_dy_dev)
    sum_dy_xhat = sum_dy_dev * invstd
    dbeta[...] = sum_dy
    dgamma[...] = sum_dy_xhat
    if not need_dx:
        return None
    a = gamma.astype(np.float64) * invstd
    b, e = a * sum_dy / M, a * invstd * sum_dy_xhat / M
    dx = np.empty_like(x, order="C")
    cpu_kernels.batchnorm_dx(dy3, x3, np.ascontiguousarray(mean), (-e).astype(x.dtype), a.astype(x.dtype),
                             b.astype(x.dtype), dx.reshape(N, C, H * W))
    return dx


class CpuBackend(NumpyBackend):
    """The numpy backend with this module's convolutions (`get_backend("cpu")`); every other op is the
    reference's own function."""

    name = "cpu"
    conv2d_fprop = staticmethod(conv2d_fprop)
    conv2d_dgrad = staticmethod(conv2d_dgrad)
    conv2d_wgrad = staticmethod(conv2d_wgrad)
    batchnorm_stats = staticmethod(batchnorm_stats)
    batchnorm_fprop = staticmethod(batchnorm_fprop)
    batchnorm_bprop = staticmethod(batchnorm_bprop)

    def __repr__(self) -> str:
        return "CpuBackend()"


def make_backend() -> CpuBackend:
    """The cpu backend object (`mpiasgd.ops.get_backend("cpu")` keeps one)."""
    return CpuBackend()
