"""NumPy reference backend of `mpiasgd.ops`: CNN ops on the CPU, layout NCHW.

This is the ground truth the CUDA kernels are tested against and the compute path of CPU workers.
Production dtype is float32; every float op also accepts float64 (all float arguments of one call
share one dtype) so that tests can check gradients against float64 finite differences.

Convolution is im2col + one large GEMM (BLAS through `np.matmul`):

    cols (C*R*S, N*P*Q)   built from the zero-padded input with a strided view (no Python loops)
    fprop   y2 (K, N*P*Q)     = w (K, C*R*S) @ cols
    wgrad   dw (K, C*R*S)     = dy2 (K, N*P*Q) @ cols.T
    dgrad   stride 1: a convolution of dy with the flipped, transposed filters (im2col again);
            otherwise dcols = w.T @ dy2 followed by col2im (a loop over the R*S kernel offsets).

Column layout choice (measured, cifar10 batch 128, 2 cores): (C*R*S, N*P*Q) gives one GEMM per op
and the fastest wgrad; (N*P*Q, C*R*S) makes im2col ~2.5x slower (short inner copies); a batched
(N, C*R*S, P*Q) GEMM is ~2x slower once P*Q is small (7x7). GEMM + col2im over 5x5 offsets with
15-wide rows takes ~2x as long as running dgrad as a convolution, hence the stride-1 path.

Pooling reads strided views of the input, copied into a border (-inf for max, 0 for average) when a
window reaches outside it, in a loop over the kernel offsets; local response normalisation loops
over its channel window; batch normalisation reduces in float64 (two passes); dropout's mask is
Philox4x32-10 in uint64 arithmetic, recomputed from its key by the forward and the backward.

Every array here is fresh unless written into `out=`; a `Workspace` (one per layer) holds the large
temporaries between minibatches: fresh arrays over glibc's 32 MB mmap threshold are page-faulted
in on every call, which cost ~25% of a cifar10 step.

The ops' contract (shapes, dtypes, errors) is `mpiasgd.ops.protocol.Backend`, their checks
`mpiasgd.ops.contract` (the host policy: float32 or float64 numpy arrays); `NumpyBackend` is this
module as a backend object (`get_backend("numpy")`). The docstrings here add how each op computes.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from mpiasgd.ops.contract import (
    FLOAT_DTYPES,
    argmax_dtype,
    check_bool,
    check_float,
    check_int,
    check_labels,
    check_linear_dgrad,
    check_linear_wgrad,
    check_lrn,
    check_out,
    check_real,
    describe,
    dropout_key,
    host_conv_geometry,
    host_pool_geometry,
    label_outside,
    shape4,
)
from mpiasgd.ops.protocol import LossStats

# ----------------------------------------------------------------------------------------------
# array helpers (layers and the model allocate through these, never through numpy directly)


def zeros(shape: int | tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """Zero-filled C-contiguous array (default float32)."""
    return np.zeros(shape, dtype=dtype)


def empty(shape: int | tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """Uninitialized C-contiguous array (default float32)."""
    return np.empty(shape, dtype=dtype)


def asarray(x, dtype=np.float32) -> np.ndarray:
    """`x` as a C-contiguous array of `dtype` on this backend (no copy when it already is one)."""
    return np.ascontiguousarray(x, dtype=dtype)


def to_numpy(x) -> np.ndarray:
    """Host (NumPy) view of a backend array; identity here, a device->host copy under cupy."""
    return np.asarray(x)


def may_share_memory(a, b) -> bool:
    """Cheap (bounds-only) test whether two arrays may overlap in memory."""
    return bool(np.may_share_memory(a, b))


class Workspace:
    """Scratch arrays of one layer, kept between minibatches and reused while shapes match.

    Besides scratch, it remembers which input its im2col column matrix was built from, so that
    `conv2d_wgrad` can reuse the columns of the preceding `conv2d_fprop` of the same `x` object
    instead of rebuilding them. That is only valid if `x` was not modified in place in between;
    layers never do that. Memory: cifar10 holds ~2.8 MB per sample over its three convs (350 MB at
    batch 128).
    """

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self.cols_src: tuple | None = None  # (x, R, S, stride, pad) whose columns are in "cols"

    def get(self, key: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """The scratch array named `key`, reallocated (uninitialized) if shape or dtype changed."""
        a = self._arrays.get(key)
        if a is None or a.shape != shape or a.dtype != dtype:
            a = np.empty(shape, dtype=dtype)
            self._arrays[key] = a
        return a

    def zeroed(self, key: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """Like `get`, but zero-filled whenever (re)allocated: a caller that writes only part of it (an
        interior, leaving padding) finds the rest still zero on the next call."""
        a = self._arrays.get(key)
        if a is None or a.shape != shape or a.dtype != dtype:
            a = np.zeros(shape, dtype=dtype)
            self._arrays[key] = a
        return a

    @property
    def nbytes(self) -> int:
        """Bytes held by all scratch arrays."""
        return sum(a.nbytes for a in self._arrays.values())


def _scratch(ws: Workspace | None, key: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype) if ws is None else ws.get(key, shape, dtype)


# ----------------------------------------------------------------------------------------------
# convolution


def _im2col(x: np.ndarray, R: int, S: int, stride: int, ph: int, pw: int,
            ws: Workspace | None, key: str) -> np.ndarray:
    """Column matrix (C*R*S, N*P*Q) of x (N, C, H, W): cols[(c,r,s), (n,p,q)] = xpad[n,c,p*st+r,q*st+s]."""
    N, C, H, W = x.shape
    Hp, Wp = H + 2 * ph, W + 2 * pw
    P, Q = (Hp - R) // stride + 1, (Wp - S) // stride + 1
    if ph or pw:
        xp = _scratch(ws, key + ".pad", (N, C, Hp, Wp), x.dtype)  # (N, C, Hp, Wp)
        # zero only the border strips; the interior is overwritten below
        xp[:, :, :ph, :] = 0
        xp[:, :, Hp - ph:, :] = 0
        xp[:, :, :, :pw] = 0
        xp[:, :, :, Wp - pw:] = 0
        xp[:, :, ph:ph + H, pw:pw + W] = x
    else:
        xp = x
    sN, sC, sH, sW = xp.strides
    windows = as_strided(xp, shape=(C, R, S, N, P, Q),
                         strides=(sC, sH, sW, sN, sH * stride, sW * stride), writeable=False)
    cols = _scratch(ws, key, (C, R, S, N, P, Q), x.dtype)
    np.copyto(cols, windows)  # the im2col copy: (C, R, S, N, P, Q)
    return cols.reshape(C * R * S, N * P * Q)


def _conv_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: int, ph: int, pw: int,
                  ws: Workspace | None, key: str) -> np.ndarray:
    """Unchecked convolution with separate H/W padding; returns a fresh (N, K, P, Q) array."""
    N = x.shape[0]
    K, C, R, S = w.shape
    P = (x.shape[2] + 2 * ph - R) // stride + 1
    Q = (x.shape[3] + 2 * pw - S) // stride + 1
    cols = _im2col(x, R, S, stride, ph, pw, ws, key)  # (C*R*S, N*P*Q)
    y2 = _scratch(ws, key + ".y2", (K, N * P * Q), x.dtype)
    np.matmul(w.reshape(K, C * R * S), cols, out=y2)  # the GEMM: (K, N*P*Q)
    y = np.empty((N, K, P, Q), dtype=x.dtype)
    y2 = y2.reshape(K, N, P, Q).transpose(1, 0, 2, 3)  # view (N, K, P, Q)
    if b is None:
        np.copyto(y, y2)
    else:
        np.add(y2, b.reshape(1, K, 1, 1), out=y)  # bias add fused with the NCHW transpose
    return y


def check_conv_fprop(op: str, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: int, pad: int) -> None:
    """The argument checks of `conv2d_fprop` (shared with `mpiasgd.ops.cpu_ops`): ValueError naming `op`."""
    check_float(op, "x", x, 4, "(N, C, H, W)")
    check_float(op, "w", w, 4, "(K, C, R, S)", x.dtype)
    K = w.shape[0]
    if b is not None:
        check_float(op, "b", b, 1, f"({K},)", x.dtype)
        if b.shape != (K,):
            raise ValueError(f"{op}: b must have shape ({K},), got {b.shape}")
    host_conv_geometry(op, x.shape, w.shape, stride, pad)


def check_conv_wgrad(op: str, dy: np.ndarray, x: np.ndarray, w_shape: tuple[int, int, int, int], stride: int,
                     pad: int) -> None:
    """The argument checks of `conv2d_wgrad` (`out` aside): ValueError naming `op`."""
    check_float(op, "x", x, 4, "(N, C, H, W)")
    check_float(op, "dy", dy, 4, "(N, K, P, Q)", x.dtype)
    K, C, R, S = shape4(op, "w_shape", w_shape, "(K, C, R, S)")
    P, Q = host_conv_geometry(op, x.shape, (K, C, R, S), stride, pad)
    N = x.shape[0]
    if dy.shape != (N, K, P, Q):
        raise ValueError(f"{op}: dy must have shape {(N, K, P, Q)}, got {dy.shape}")


def check_conv_dgrad(op: str, dy: np.ndarray, w: np.ndarray, x_shape: tuple[int, int, int, int], stride: int,
                     pad: int) -> None:
    """The argument checks of `conv2d_dgrad`: ValueError naming `op`."""
    check_float(op, "dy", dy, 4, "(N, K, P, Q)")
    check_float(op, "w", w, 4, "(K, C, R, S)", dy.dtype)
    N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
    K = w.shape[0]
    P, Q = host_conv_geometry(op, (N, C, H, W), w.shape, stride, pad)
    if dy.shape != (N, K, P, Q):
        raise ValueError(f"{op}: dy must have shape {(N, K, P, Q)} for x_shape {(N, C, H, W)}, "
                         f"got {dy.shape}")


def conv2d_fprop(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: int, pad: int,
                 ws: Workspace | None = None) -> np.ndarray:
    """Forward convolution: x (N, C, H, W), w (K, C, R, S), b (K,) or None -> y (N, K, P, Q), fresh
    (`protocol.Backend.conv2d_fprop`: shapes, dtypes, errors). im2col + one GEMM; with `ws`, scratch is
    reused and the column matrix is kept for `conv2d_wgrad` of this `x`."""
    check_conv_fprop("conv2d_fprop", x, w, b, stride, pad)
    _, _, R, S = w.shape
    y = _conv_forward(x, w, b, stride, pad, pad, ws, "cols")
    if ws is not None:
        ws.cols_src = (x, R, S, stride, pad)
    return y


def conv2d_wgrad(dy: np.ndarray, x: np.ndarray, w_shape: tuple[int, int, int, int], stride: int,
                 pad: int, out: np.ndarray | None = None, ws: Workspace | None = None) -> np.ndarray:
    """Filter gradient: dy (N, K, P, Q), x (N, C, H, W), w_shape -> dw (K, C, R, S), into `out` when given
    (`protocol.Backend.conv2d_wgrad`). One GEMM with the columns of x; with `ws` that saw `conv2d_fprop`
    of this same `x`, its columns are reused."""
    op = "conv2d_wgrad"
    check_conv_wgrad(op, dy, x, w_shape, stride, pad)
    K, C, R, S = w_shape
    N, _, P, Q = dy.shape
    dw = check_out(op, out, (K, C, R, S), x.dtype)
    src = None if ws is None else ws.cols_src
    if src is not None and src[0] is x and src[1:] == (R, S, stride, pad):
        cols = ws.get("cols", (C, R, S, N, P, Q), x.dtype).reshape(C * R * S, N * P * Q)
    else:
        cols = _im2col(x, R, S, stride, pad, pad, ws, "cols")
        if ws is not None:
            ws.cols_src = (x, R, S, stride, pad)
    dy2 = _scratch(ws, "wgrad.dy2", (K, N, P, Q), x.dtype)
    np.copyto(dy2, dy.transpose(1, 0, 2, 3))  # (K, N, P, Q)
    # the GEMM: (K, N*P*Q) @ (N*P*Q, C*R*S); cols.T is a transposed view, BLAS reads it in place
    np.matmul(dy2.reshape(K, N * P * Q), cols.T, out=dw.reshape(K, C * R * S))
    return dw


def conv2d_dgrad(dy: np.ndarray, w: np.ndarray, x_shape: tuple[int, int, int, int], stride: int,
                 pad: int, ws: Workspace | None = None) -> np.ndarray:
    """Input gradient: dy (N, K, P, Q), w (K, C, R, S), x_shape (N, C, H, W) -> dx (N, C, H, W), fresh
    (`protocol.Backend.conv2d_dgrad`). Stride 1 with pad < R and pad < S runs as a convolution of dy with
    the flipped, transposed filters (pad R-1-pad); otherwise GEMM + col2im looping over the R*S offsets."""
    check_conv_dgrad("conv2d_dgrad", dy, w, x_shape, stride, pad)
    N, C, H, W = x_shape
    K, _, R, S = w.shape
    _, _, P, Q = dy.shape
    if stride == 1 and pad < R and pad < S:
        # full correlation of dy with w rotated by 180 degrees, channels swapped: (C, K, R, S)
        w_t = np.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
        return _conv_forward(dy, w_t, None, 1, R - 1 - pad, S - 1 - pad, ws, "dgrad")
    dy2 = _scratch(ws, "dgrad.dy2", (K, N, P, Q), dy.dtype)
    np.copyto(dy2, dy.transpose(1, 0, 2, 3))  # (K, N, P, Q)
    dcols = _scratch(ws, "dgrad.dcols", (C * R * S, N * P * Q), dy.dtype)
    np.matmul(w.reshape(K, C * R * S).T, dy2.reshape(K, N * P * Q), out=dcols)  # the GEMM
    dcols = dcols.reshape(C, R, S, N, P, Q)
    dxp = _scratch(ws, "dgrad.dxp", (N, C, H + 2 * pad, W + 2 * pad), dy.dtype)
    dxp.fill(0)
    for r in range(R):  # col2im: windows of different offsets overlap, so accumulate
        for s in range(S):
            dst = dxp[:, :, r:r + stride * (P - 1) + 1:stride, s:s + stride * (Q - 1) + 1:stride]
            np.add(dst, dcols[:, r, s].transpose(1, 0, 2, 3), out=dst)  # (N, C, P, Q)
    return np.ascontiguousarray(dxp[:, :, pad:pad + H, pad:pad + W])


def bias_grad(dy: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Bias gradient: db (K,) = dy summed over all axes but 1. dy (N, K, P, Q) or (N, K).

    Written into `out` ((K,), dy's dtype) when given, and returned. Raises ValueError on ndim/dtype.
    """
    op = "bias_grad"
    if not isinstance(dy, np.ndarray) or dy.ndim not in (2, 4):
        raise ValueError(f"{op}: dy must be an array of shape (N, K, P, Q) or (N, K), "
                         f"got {getattr(dy, 'shape', type(dy).__name__)}")
    check_float(op, "dy", dy, dy.ndim, "(N, K, P, Q) or (N, K)")
    N, K = dy.shape[:2]
    db = check_out(op, out, (K,), dy.dtype)
    if dy.ndim == 4:
        per_sample = dy.reshape(N, K, dy.shape[2] * dy.shape[3]).sum(axis=2)  # (N, K), contiguous inner sums
        np.sum(per_sample, axis=0, out=db)
    else:
        np.sum(dy, axis=0, out=db)
    return db


# ----------------------------------------------------------------------------------------------
# elementwise and pooling


def relu_fprop(x: np.ndarray) -> np.ndarray:
    """y = max(x, 0), fresh array of x's shape and float dtype; NaN stays NaN (np.maximum propagates it).

    Raises ValueError on a non-float x.
    """
    if not isinstance(x, np.ndarray) or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"relu_fprop: x must be a float32/float64 array, got {describe(x)}")
    return np.maximum(x, 0)


def relu_bprop(dy: np.ndarray, y: np.ndarray) -> np.ndarray:
    """dx = dy * (y > 0): dy where y > 0, else 0, but NaN where dy is NaN or +-inf (0 * inf); y is the
    forward output (where it is NaN, dx is 0 unless dy is non-finite). Raises ValueError on shape/dtype
    mismatch."""
    if not isinstance(dy, np.ndarray) or not isinstance(y, np.ndarray) or dy.shape != y.shape \
            or dy.dtype != y.dtype or dy.dtype not in FLOAT_DTYPES:
        raise ValueError(f"relu_bprop: dy and y must be float arrays of one shape and dtype, got "
                         f"{describe(dy)} and {describe(y)}")
    return np.multiply(dy, y > 0)


def _pool_extent(H: int, W: int, P: int, Q: int, kernel: int, stride: int, pad: int) -> tuple[int, int]:
    """(Hb, Wb): the padded input every window lies in, H + 2*pad (W + 2*pad), or more where a ceil_mode
    window runs past the bottom (right) padding."""
    return max(H + 2 * pad, (P - 1) * stride + kernel), max(W + 2 * pad, (Q - 1) * stride + kernel)


def _pool_padded(x: np.ndarray, pad: int, Hb: int, Wb: int, fill: float) -> np.ndarray:
    """x (N, C, H, W) placed at rows and columns pad.. of a fresh (N, C, Hb, Wb) array that holds `fill`
    elsewhere; x itself when no window reaches outside it ((Hb, Wb) == (H, W) implies pad 0)."""
    N, C, H, W = x.shape
    if (Hb, Wb) == (H, W):
        return x
    xp = np.empty((N, C, Hb, Wb), dtype=x.dtype)  # (N, C, Hb, Wb)
    xp[:, :, :pad, :] = fill
    xp[:, :, pad + H:, :] = fill
    xp[:, :, pad:pad + H, :pad] = fill
    xp[:, :, pad:pad + H, pad + W:] = fill
    xp[:, :, pad:pad + H, pad:pad + W] = x
    return xp


def _pool_crop(dxp: np.ndarray, pad: int, H: int, W: int) -> np.ndarray:
    """The image part (N, C, H, W) of a padded gradient (N, C, Hb, Wb), fresh and C-contiguous."""
    if dxp.shape[2:] == (H, W):
        return dxp
    return np.ascontiguousarray(dxp[:, :, pad:pad + H, pad:pad + W])


def maxpool_fprop(x: np.ndarray, kernel: int, stride: int, pad: int = 0,
                  ceil_mode: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Max pooling; windows may overlap (kernel > stride); padding never wins.

    x (N, C, H, W) -> y (N, C, P, Q) with P, Q from `contract.pool_output_size` (PyTorch's rule, floor
    or `ceil_mode`), and argmax (N, C, P, Q) uint8 (int32 if kernel*kernel > 256): offset i*kernel + j
    of the maximum inside its unclipped window, whose origin is (p*stride - pad, q*stride - pad), the
    first one on ties. Only `maxpool_bprop` of this backend reads it.

    The input is copied into a -inf border when a window reaches outside it (pad > 0 or a ceil_mode
    window past the edge), so the strict comparison below never lets padding win over an image pixel;
    a window whose image pixels are all -inf points at its first image pixel (PyTorch's choice).
    NaN propagates as in np.max / np.argmax: a window holding a NaN gives NaN, and its argmax is the
    first NaN in row-major order, so `maxpool_bprop` routes that window's gradient to it (PyTorch also
    propagates the NaN and routes to a NaN, though to the last one of the window); +-inf are ordinary.
    Raises ValueError on wrong ndim/dtype, pad < 0 or > kernel//2, or a kernel larger than the padded
    input.
    """
    op = "maxpool_fprop"
    check_float(op, "x", x, 4, "(N, C, H, W)")
    _, _, H, W = x.shape
    P, Q = host_pool_geometry(op, x.shape, kernel, stride, pad, ceil_mode)
    xp = _pool_padded(x, pad, *_pool_extent(H, W, P, Q, kernel, stride, pad), -np.inf)  # (N, C, Hb, Wb)
    hs, ws_ = stride * (P - 1) + 1, stride * (Q - 1) + 1  # extent of the window origins
    y = np.array(xp[:, :, 0:hs:stride, 0:ws_:stride])  # offset (0, 0): (N, C, P, Q)
    argmax = np.zeros(y.shape, dtype=argmax_dtype(kernel))
    greater = np.empty(y.shape, dtype=bool)
    code = np.empty(y.shape, dtype=argmax.dtype)
    for i in range(kernel):
        for j in range(kernel):
            if i == 0 and j == 0:
                continue
            v = xp[:, :, i:i + hs:stride, j:j + ws_:stride]  # strided view (N, C, P, Q)
            np.greater(v, y, out=greater)  # strict: on ties the earlier offset stays
            np.maximum(y, v, out=y)
            # offsets only grow, so "argmax = o where greater" is a max with greater*o;
            # np.copyto(where=) / np.where are ~10x slower here
            np.multiply(greater, code.dtype.type(i * kernel + j), out=code)
            np.maximum(argmax, code, out=argmax)
    if pad:
        # a window clipped at the top or left whose image pixels are all -inf kept offset 0, a padding
        # position: point it at its first image pixel (i0, j0) instead
        all_neg_inf = y == -np.inf
        if all_neg_inf.any():
            i0 = np.maximum(pad - stride * np.arange(P), 0)  # (P,)
            j0 = np.maximum(pad - stride * np.arange(Q), 0)  # (Q,)
            first = (i0[:, None] * kernel + j0).astype(argmax.dtype)  # (P, Q)
            np.copyto(argmax, np.broadcast_to(first, y.shape), where=all_neg_inf)
    # np.maximum made y NaN wherever a window holds a NaN, but `greater` never saw the NaN (v > y is
    # False for it), so point those windows' argmax at their first NaN; this costs one pass over y
    # when there is none (the training path), the rest scales with the NaN windows only
    nan_windows = np.flatnonzero(np.isnan(y))
    if nan_windows.size:
        n, c, p, q = np.unravel_index(nan_windows, y.shape)
        first = np.zeros(nan_windows.size, dtype=argmax.dtype)
        for o in reversed(range(kernel * kernel)):  # descending: the smallest NaN offset is written last
            i, j = divmod(o, kernel)
            first[np.isnan(xp[n, c, p * stride + i, q * stride + j])] = o  # padding is never NaN
        argmax.reshape(-1)[nan_windows] = first
    return y, argmax


def maxpool_bprop(dy: np.ndarray, argmax: np.ndarray, x_shape: tuple[int, int, int, int],
                  kernel: int, stride: int, pad: int = 0, ceil_mode: bool = False) -> np.ndarray:
    """Gradient of `maxpool_fprop`: dx (N, C, H, W), fresh; overlapping windows accumulate.

    dy (N, C, P, Q), argmax from `maxpool_fprop` with the same kernel, stride, pad and ceil_mode,
    x_shape the forward input shape. A scatter-add into the padded input, then the image part.
    Raises ValueError on shapes inconsistent with x_shape and the pooling arguments, or an argmax that
    is not integers in 0..kernel*kernel - 1.
    """
    op = "maxpool_bprop"
    check_float(op, "dy", dy, 4, "(N, C, P, Q)")
    N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
    P, Q = host_pool_geometry(op, (N, C, H, W), kernel, stride, pad, ceil_mode)
    if dy.shape != (N, C, P, Q) or not isinstance(argmax, np.ndarray) or argmax.shape != dy.shape:
        got = argmax.shape if isinstance(argmax, np.ndarray) else type(argmax).__name__
        raise ValueError(f"{op}: dy and argmax must have shape {(N, C, P, Q)} for x_shape "
                         f"{(N, C, H, W)}, got {dy.shape} and {got}")
    if not np.issubdtype(argmax.dtype, np.integer):
        raise ValueError(f"{op}: argmax must hold integers (maxpool_fprop's offsets i*kernel + j), got {argmax.dtype}")
    if argmax.size and (int(argmax.min()) < 0 or int(argmax.max()) >= kernel * kernel):
        raise ValueError(f"{op}: argmax must lie in 0..{kernel * kernel - 1} (offsets in a {kernel}x{kernel} window), "
                         f"got {int(argmax.min())}..{int(argmax.max())}")
    Hb, Wb = _pool_extent(H, W, P, Q, kernel, stride, pad)
    # flat index into the padded dx of every window's maximum: window origin + in-window offset of argmax
    index_dtype = np.int32 if N * C * Hb * Wb < 2**31 else np.int64
    origin = (np.arange(N * C, dtype=index_dtype).reshape(N * C, 1, 1) * (Hb * Wb)
              + (np.arange(P, dtype=index_dtype) * (stride * Wb)).reshape(P, 1)
              + np.arange(Q, dtype=index_dtype) * stride)  # (N*C, P, Q)
    offsets = np.array([i * Wb + j for i in range(kernel) for j in range(kernel)], dtype=index_dtype)
    target = origin.reshape(N, C, P, Q) + offsets[argmax]  # (N, C, P, Q)
    dxp = np.zeros(N * C * Hb * Wb, dtype=dy.dtype)
    # unbuffered scatter-add: overlapping windows (kernel > stride) may pick the same input
    # element, which must receive the sum (numpy >= 1.25 runs this in a fast C loop; 5x faster
    # than a strided add per kernel offset)
    np.add.at(dxp, target.reshape(-1), dy.reshape(-1))
    return _pool_crop(dxp.reshape(N, C, Hb, Wb), pad, H, W)


def _avgpool_divisors(H: int, W: int, P: int, Q: int, kernel: int, stride: int, pad: int,
                      count_include_pad: bool, dtype) -> np.ndarray:
    """(P, Q) divisors of average pooling: the window's positions inside [-pad, H + pad) x [-pad, W + pad)
    (count_include_pad) or inside the image [0, H) x [0, W); separable, rows times columns."""
    def count(n: int, out: int) -> np.ndarray:
        start = np.arange(out) * stride - pad  # first row (column) of each window, image coordinates
        end = start + kernel
        if count_include_pad:
            return np.minimum(end, n + pad) - start  # start >= -pad always
        return np.minimum(end, n) - np.maximum(start, 0)

    return (count(H, P)[:, None] * count(W, Q)).astype(dtype)  # (P, Q)


def avgpool_fprop(x: np.ndarray, kernel: int, stride: int, pad: int = 0, ceil_mode: bool = False,
                  count_include_pad: bool = True) -> np.ndarray:
    """Average pooling (torch.nn.AvgPool2d): x (N, C, H, W) -> y (N, C, P, Q), fresh; P, Q as
    `maxpool_fprop`; y = the sum of the window's image pixels / its divisor (`protocol.Backend.avgpool_fprop`).

    The window sums are separable: rows first (a loop over the kernel's rows), then columns, on the
    input in a zero border. Raises ValueError as `maxpool_fprop`, or for a non-bool count_include_pad.
    """
    op = "avgpool_fprop"
    check_float(op, "x", x, 4, "(N, C, H, W)")
    _, _, H, W = x.shape
    P, Q = host_pool_geometry(op, x.shape, kernel, stride, pad, ceil_mode)
    check_bool(op, "count_include_pad", count_include_pad)
    Hb, Wb = _pool_extent(H, W, P, Q, kernel, stride, pad)
    xp = _pool_padded(x, pad, Hb, Wb, 0.0)  # (N, C, Hb, Wb)
    hs, ws_ = stride * (P - 1) + 1, stride * (Q - 1) + 1  # extent of the window origins
    rows = np.array(xp[:, :, 0:hs:stride, :])  # (N, C, P, Wb): sums over the window's rows
    for i in range(1, kernel):
        rows += xp[:, :, i:i + hs:stride, :]
    y = np.array(rows[:, :, :, 0:ws_:stride])  # (N, C, P, Q)
    for j in range(1, kernel):
        y += rows[:, :, :, j:j + ws_:stride]
    y /= _avgpool_divisors(H, W, P, Q, kernel, stride, pad, count_include_pad, x.dtype)
    return y


def avgpool_bprop(dy: np.ndarray, x_shape: tuple[int, int, int, int], kernel: int, stride: int,
                  pad: int = 0, ceil_mode: bool = False, count_include_pad: bool = True) -> np.ndarray:
    """Gradient of `avgpool_fprop`: dy (N, C, P, Q) -> dx (N, C, H, W), fresh: each window's dy / divisor
    added to each of its image pixels (columns first, then rows, into the padded input; then the
    image part). Raises ValueError on shapes inconsistent with x_shape and the pooling arguments."""
    op = "avgpool_bprop"
    check_float(op, "dy", dy, 4, "(N, C, P, Q)")
    N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
    P, Q = host_pool_geometry(op, (N, C, H, W), kernel, stride, pad, ceil_mode)
    check_bool(op, "count_include_pad", count_include_pad)
    if dy.shape != (N, C, P, Q):
        raise ValueError(f"{op}: dy must have shape {(N, C, P, Q)} for x_shape {(N, C, H, W)}, got {dy.shape}")
    Hb, Wb = _pool_extent(H, W, P, Q, kernel, stride, pad)
    hs, ws_ = stride * (P - 1) + 1, stride * (Q - 1) + 1
    g = dy / _avgpool_divisors(H, W, P, Q, kernel, stride, pad, count_include_pad, dy.dtype)  # (N, C, P, Q)
    rows = np.zeros((N, C, P, Wb), dtype=dy.dtype)
    for j in range(kernel):  # windows of neighbouring q overlap when kernel > stride: accumulate
        rows[:, :, :, j:j + ws_:stride] += g
    dxp = np.zeros((N, C, Hb, Wb), dtype=dy.dtype)
    for i in range(kernel):
        dxp[:, :, i:i + hs:stride, :] += rows
    return _pool_crop(dxp, pad, H, W)


def global_avgpool_fprop(x: np.ndarray) -> np.ndarray:
    """Global average pooling: x (N, C, H, W) -> y (N, C) = the mean over H and W, fresh, x's dtype (summed
    in float64). Raises ValueError on a wrong ndim/dtype or H*W = 0."""
    op = "global_avgpool_fprop"
    check_float(op, "x", x, 4, "(N, C, H, W)")
    N, C, H, W = x.shape
    if H * W == 0:
        raise ValueError(f"{op}: x must have H*W > 0, got shape {x.shape}")
    return (x.reshape(N, C, H * W).sum(axis=2, dtype=np.float64) / (H * W)).astype(x.dtype)


def global_avgpool_bprop(dy: np.ndarray, x_shape: tuple[int, int, int, int]) -> np.ndarray:
    """Gradient of `global_avgpool_fprop`: dy (N, C) -> dx (N, C, H, W) = dy / (H*W) at every pixel, fresh.
    Raises ValueError on a wrong ndim/dtype, a dy that is not x_shape's (N, C), or H*W = 0."""
    op = "global_avgpool_bprop"
    check_float(op, "dy", dy, 2, "(N, C)")
    N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
    if H * W == 0:
        raise ValueError(f"{op}: x_shape must have H*W > 0, got {(N, C, H, W)}")
    if dy.shape != (N, C):
        raise ValueError(f"{op}: dy must have shape {(N, C)} for x_shape {(N, C, H, W)}, got {dy.shape}")
    dx = np.empty((N, C, H, W), dtype=dy.dtype)
    dx[...] = (dy / dy.dtype.type(H * W))[:, :, None, None]
    return dx


# ----------------------------------------------------------------------------------------------
# batch normalisation (Ioffe and Szegedy 2015, arXiv 1502.03167, Algorithm 1)


def _check_channel_vectors(op: str, C: int, dtype, **vectors: np.ndarray) -> None:
    """ValueError unless every named argument is a (C,) numpy array of `dtype`."""
    for arg, a in vectors.items():
        check_float(op, arg, a, 1, f"({C},)", dtype)
        if a.shape != (C,):
            raise ValueError(f"{op}: {arg} must have shape ({C},) (x's channels), got {a.shape}")


def check_batchnorm_stats(op: str, x: np.ndarray, running_mean: np.ndarray | None, running_var: np.ndarray | None,
                          momentum: float) -> float:
    """The argument checks of `batchnorm_stats` (shared with `mpiasgd.ops.cpu_ops`); the momentum as a float."""
    check_float(op, "x", x, 4, "(N, C, H, W)")
    N, C, H, W = x.shape
    if N * H * W == 0:
        raise ValueError(f"{op}: x must have N*H*W > 0 values per channel, got shape {x.shape}")
    if (running_mean is None) != (running_var is None):
        raise ValueError(f"{op}: running_mean and running_var must be given together, got "
                         f"{describe(running_mean)} and {describe(running_var)}")
    if running_mean is not None:
        _check_channel_vectors(op, C, x.dtype, running_mean=running_mean, running_var=running_var)
        for arg, a in (("running_mean", running_mean), ("running_var", running_var)):
            if not a.flags.writeable:
                raise ValueError(f"{op}: {arg} must be writeable (it is updated in place)")
    return check_real(op, "momentum", momentum, 0.0, 1.0)


def check_batchnorm_fprop(op: str, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, mean: np.ndarray,
                          var: np.ndarray, eps: float) -> float:
    """The argument checks of `batchnorm_fprop`; eps as a float."""
    check_float(op, "x", x, 4, "(N, C, H, W)")
    _check_channel_vectors(op, x.shape[1], x.dtype, gamma=gamma, beta=beta, mean=mean, var=var)
    return check_real(op, "eps", eps, 0.0, low_open=True)


def check_batchnorm_bprop(op: str, dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, mean: np.ndarray,
                          var: np.ndarray, eps: float, dgamma: np.ndarray, dbeta: np.ndarray, need_dx: bool) -> float:
    """The argument checks of `batchnorm_bprop`; eps as a float."""
    check_float(op, "x", x, 4, "(N, C, H, W)")
    check_float(op, "dy", dy, 4, "(N, C, H, W)", x.dtype)
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy must have x's shape {x.shape}, got {dy.shape}")
    N, C, H, W = x.shape
    if N * H * W == 0:
        raise ValueError(f"{op}: x must have N*H*W > 0 values per channel, got shape {x.shape}")
    _check_channel_vectors(op, C, x.dtype, gamma=gamma, mean=mean, var=var)
    eps = check_real(op, "eps", eps, 0.0, low_open=True)
    for arg, out in (("dgamma", dgamma), ("dbeta", dbeta)):
        if out is None:
            raise ValueError(f"{op}: {arg} must be a {x.dtype} array of shape ({C},), got None")
        check_out(op, out, (C,), x.dtype)
    check_bool(op, "need_dx", need_dx)
    return eps


def batchnorm_stats(x: np.ndarray, running_mean: np.ndarray | None = None, running_var: np.ndarray | None = None,
                    momentum: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel batch statistics: x (N, C, H, W) -> (mean (C,), biased var (C,)), fresh, x's dtype
    (`protocol.Backend.batchnorm_stats`). Two passes in float64: the mean, then the mean squared
    deviation from it (no E[x^2] - E[x]^2 cancellation).

    With `running_mean` and `running_var` ((C,), x's dtype), updates them in place from the float64
    statistics, rounded once: running_mean <- (1 - momentum)*running_mean + momentum*mean,
    running_var <- (1 - momentum)*running_var + momentum*var*M/(M - 1), M = N*H*W (M = 1: var), the
    update of torch.nn.BatchNorm2d. Raises ValueError on a wrong ndim/dtype, M = 0, momentum outside
    [0, 1], or only one of the running arrays.
    """
    m = check_batchnorm_stats("batchnorm_stats", x, running_mean, running_var, momentum)
    N, C, H, W = x.shape
    M = N * H * W
    x3 = x.reshape(N, C, H * W)
    mean = x3.sum(axis=(0, 2), dtype=np.float64) / M  # (C,) float64
    dev = x3 - mean[:, None]  # (N, C, H*W) float64
    dev *= dev
    var = dev.sum(axis=(0, 2)) / M  # (C,) float64, biased
    if running_mean is not None:
        unbiased = var * (M / (M - 1)) if M > 1 else var
        running_mean[...] = (1 - m) * running_mean.astype(np.float64) + m * mean
        running_var[...] = (1 - m) * running_var.astype(np.float64) + m * unbiased
    return mean.astype(x.dtype), var.astype(x.dtype)


def batchnorm_fprop(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, mean: np.ndarray, var: np.ndarray,
                    eps: float) -> np.ndarray:
    """y = (x - mean) / sqrt(var + eps) * gamma + beta per channel: x (N, C, H, W); gamma, beta, mean, var
    (C,) -> y (N, C, H, W), fresh, x's dtype (`protocol.Backend.batchnorm_fprop`). The per-channel factor
    gamma / sqrt(var + eps) is formed in float64 and rounded once; x - mean is taken first (not
    x*a + (beta - mean*a), which cancels when |mean| >> std). Raises ValueError on a shape/dtype
    mismatch or eps <= 0."""
    eps = check_batchnorm_fprop("batchnorm_fprop", x, gamma, beta, mean, var, eps)
    C = x.shape[1]
    a = (gamma / np.sqrt(var.astype(np.float64) + eps)).astype(x.dtype)  # (C,)
    y = x - mean.reshape(1, C, 1, 1)  # (N, C, H, W)
    y *= a.reshape(1, C, 1, 1)
    y += beta.reshape(1, C, 1, 1)
    return y


def batchnorm_bprop(dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, mean: np.ndarray, var: np.ndarray,
                    eps: float, dgamma: np.ndarray, dbeta: np.ndarray, need_dx: bool = True) -> np.ndarray | None:
    """Gradient of `batchnorm_fprop` with the batch statistics (`protocol.Backend.batchnorm_bprop`).

    dy, x (N, C, H, W); gamma, mean, var (C,). Overwrites dbeta = sum dy and dgamma = sum dy * xhat
    ((C,), x's dtype, C-contiguous), xhat = (x - mean) * invstd, both summed in float64 (dgamma as
    invstd * sum dy*(x - mean)). Returns dx = gamma*invstd/M * (M*dy - dbeta - xhat*dgamma), M = N*H*W,
    fresh (None when not `need_dx`), computed in x's dtype as a*dy - b - (x - mean)*e with per-channel
    a = gamma*invstd, b = a*dbeta/M, e = a*invstd*dgamma/M formed in float64.
    Raises ValueError on a shape/dtype mismatch, eps <= 0, or M = 0.
    """
    eps = check_batchnorm_bprop("batchnorm_bprop", dy, x, gamma, mean, var, eps, dgamma, dbeta, need_dx)
    N, C, H, W = x.shape
    M = N * H * W
    dy3, x3 = dy.reshape(N, C, H * W), x.reshape(N, C, H * W)
    mean64 = mean.astype(np.float64)
    invstd = 1.0 / np.sqrt(var.astype(np.float64) + eps)  # (C,) float64
    sum_dy = dy3.sum(axis=(0, 2), dtype=np.float64)  # (C,)
    prod = x3 - mean64[:, None]  # (N, C, H*W) float64: x - mean
    prod *= dy3
    sum_dy_xhat = prod.sum(axis=(0, 2)) * invstd  # (C,)
    dbeta[...] = sum_dy
    dgamma[...] = sum_dy_xhat
    if not need_dx:
        return None
    a = gamma.astype(np.float64) * invstd
    b, e = a * sum_dy / M, a * invstd * sum_dy_xhat / M
    shape = (1, C, 1, 1)
    dx = x - mean.reshape(shape)  # (N, C, H, W), x's dtype
    dx *= -e.astype(x.dtype).reshape(shape)
    dx += dy * a.astype(x.dtype).reshape(shape)
    dx -= b.astype(x.dtype).reshape(shape)
    return dx


# ----------------------------------------------------------------------------------------------
# residual blocks, dropout, local response normalisation


def add(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """a + b elementwise (same shape and float dtype), into `out` when given (it may be `a` or `b`;
    C-contiguous, their shape and dtype) and returned, fresh otherwise. Raises ValueError on a
    shape/dtype mismatch or a bad `out`."""
    op = "add"
    for arg, v in (("a", a), ("b", b)):
        if not isinstance(v, np.ndarray) or v.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{op}: {arg} must be a float32 (or float64) numpy.ndarray, got {describe(v)}")
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"{op}: a and b must have one shape and dtype, got {describe(a)} and {describe(b)}")
    out = check_out(op, out, a.shape, a.dtype)
    return np.add(a, b, out=out)


def subsample_pad_fprop(x: np.ndarray, stride: int, pad_before: int, pad_after: int) -> np.ndarray:
    """Option-A shortcut (He et al. 2016 section 4.2): x (N, C, H, W) -> y (N, pad_before + C + pad_after,
    ceil(H/stride), ceil(W/stride)), fresh: x[:, :, ::stride, ::stride] between zero channels.
    Raises ValueError on a wrong ndim/dtype, stride < 1 or a pad < 0."""
    op = "subsample_pad_fprop"
    check_float(op, "x", x, 4, "(N, C, H, W)")
    check_int(op, "stride", stride, 1)
    check_int(op, "pad_before", pad_before, 0)
    check_int(op, "pad_after", pad_after, 0)
    N, C, H, W = x.shape
    y = np.zeros((N, pad_before + C + pad_after, -(-H // stride), -(-W // stride)), dtype=x.dtype)
    y[:, pad_before:pad_before + C] = x[:, :, ::stride, ::stride]
    return y


def subsample_pad_bprop(dy: np.ndarray, x_shape: tuple[int, int, int, int], stride: int, pad_before: int,
                        pad_after: int) -> np.ndarray:
    """Gradient of `subsample_pad_fprop`: dx (N, C, H, W), fresh: dy's channels pad_before..pad_before+C-1
    at the sampled pixels, 0 elsewhere. Raises ValueError on a dy inconsistent with x_shape and the
    arguments."""
    op = "subsample_pad_bprop"
    check_float(op, "dy", dy, 4, "(N, C', P, Q)")
    N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
    check_int(op, "stride", stride, 1)
    check_int(op, "pad_before", pad_before, 0)
    check_int(op, "pad_after", pad_after, 0)
    expected = (N, pad_before + C + pad_after, -(-H // stride), -(-W // stride))
    if dy.shape != expected:
        raise ValueError(f"{op}: dy must have shape {expected} for x_shape {(N, C, H, W)}, got {dy.shape}")
    dx = np.zeros((N, C, H, W), dtype=dy.dtype)
    dx[:, :, ::stride, ::stride] = dy[:, pad_before:pad_before + C]
    return dx


PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # Philox4x32 multipliers (Salmon et al. 2011, Random123 philox.h)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key schedule increments (golden ratio, sqrt(3) - 1)


PHILOX_BLOCK = 1 << 14  # counters per pass: 4 words + 2 products of uint64 stay in L2 (10x faster than all at once)


def philox4x32(counter: np.ndarray, key: tuple[int, int], rounds: int = 10) -> np.ndarray:
    """Philox4x32-`rounds` (Salmon, Moraes, Dror and Shaw 2011, "Parallel random numbers: as easy as 1, 2,
    3", SC'11; Random123's philox4x32_R): counter (n, 4) uint32, key two 32-bit ints -> (n, 4) uint32.

    Each round multiplies words 0 and 2 by M0 and M1 (the 32x32 -> 64-bit products in uint64, exact)
    and mixes their hi/lo halves with words 1, 3 and the key; the key is bumped by W0, W1 before every
    round but the first. Vectorised over the counters, `PHILOX_BLOCK` at a time.
    """
    counter = np.asarray(counter, dtype=np.uint32)
    if counter.ndim != 2 or counter.shape[1] != 4:
        raise ValueError(f"philox4x32: counter must have shape (n, 4), got {counter.shape}")
    lo32, s32 = np.uint64(0xFFFFFFFF), np.uint64(32)
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    out = np.empty(counter.shape, dtype=np.uint32)
    for a in range(0, counter.shape[0], PHILOX_BLOCK):
        b = min(a + PHILOX_BLOCK, counter.shape[0])
        c0, c1, c2, c3 = (counter[a:b, w].astype(np.uint64) for w in range(4))  # (n_block,) each
        p0, p1 = np.empty_like(c0), np.empty_like(c0)
        k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
        for r in range(rounds):
            if r:
                k0, k1 = (k0 + PHILOX_W[0]) & 0xFFFFFFFF, (k1 + PHILOX_W[1]) & 0xFFFFFFFF
            np.multiply(c0, m0, out=p0)  # < 2^64: exact
            np.multiply(c2, m1, out=p1)
            # (c0, c1, c2, c3) <- (hi(p1) ^ c1 ^ k0, lo(p1), hi(p0) ^ c3 ^ k1, lo(p0)), in place
            np.right_shift(p1, s32, out=c0)
            c0 ^= c1
            c0 ^= np.uint64(k0)
            np.bitwise_and(p1, lo32, out=c1)
            np.right_shift(p0, s32, out=c2)
            c2 ^= c3
            c2 ^= np.uint64(k1)
            np.bitwise_and(p0, lo32, out=c3)
        for w, c in enumerate((c0, c1, c2, c3)):
            out[a:b, w] = c
    return out


def _dropout_multiplier(op: str, a, p: float, seed: int, minibatch: int, layer: int) -> np.ndarray | None:
    """The flat (a.size,) multiplier keep / (1 - p) in a's dtype (0 or the rounded scale), None when p is 0
    (everything kept, scale 1). Element i keeps when word i mod 4 of Philox4x32-10 at counter
    (i // 4, layer, minibatch mod 2^32, minibatch // 2^32), key (seed mod 2^32, seed // 2^32) is >= t."""
    if not isinstance(a, np.ndarray) or a.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {'x' if op == 'dropout_fprop' else 'dy'} must be a float32 (or float64) "
                         f"numpy.ndarray, got {describe(a)}")
    threshold, words, key = dropout_key(op, p, seed, minibatch, layer, a.size)
    if threshold == 0:
        return None
    n_counters = -(-a.size // 4)
    counter = np.empty((n_counters, 4), dtype=np.uint32)
    counter[:, 0] = np.arange(n_counters, dtype=np.uint32)
    counter[:, 1:] = words
    r = philox4x32(counter, key).reshape(-1)[:a.size]  # (size,) uint32: r_i
    multiplier = (r >= np.uint32(threshold)).astype(a.dtype)
    multiplier *= a.dtype.type(1.0 / (1.0 - p))  # the scale, rounded to a's dtype once
    return multiplier


def dropout_fprop(x: np.ndarray, p: float, seed: int, minibatch: int, layer: int) -> np.ndarray:
    """Inverted dropout: y = x * keep / (1 - p), fresh, any shape (`protocol.Backend.dropout_fprop`);
    the mask is recomputed from (seed, minibatch, layer) with Philox4x32-10, never stored. A dropped
    element is multiplied by 0, so a dropped inf or NaN gives NaN (as PyTorch's x * mask * scale).
    Raises ValueError for a non-float x, p outside [0, 1) or a key out of range."""
    multiplier = _dropout_multiplier("dropout_fprop", x, p, seed, minibatch, layer)
    if multiplier is None:
        return x.copy()
    return (x.reshape(-1) * multiplier).reshape(x.shape)


def dropout_bprop(dy: np.ndarray, p: float, seed: int, minibatch: int, layer: int) -> np.ndarray:
    """Gradient of `dropout_fprop` with the same key: dx = dy * keep / (1 - p), fresh, the same mask."""
    multiplier = _dropout_multiplier("dropout_bprop", dy, p, seed, minibatch, layer)
    if multiplier is None:
        return dy.copy()
    return (dy.reshape(-1) * multiplier).reshape(dy.shape)


def _channel_window_sum(a: np.ndarray, before: int, after: int) -> np.ndarray:
    """s[:, c] = sum of a[:, c'] over c' in [c - before, c + after] (channels outside [0, C) count 0);
    a (N, C, H, W), fresh result. A loop over the before + after + 1 window offsets."""
    N, C, H, W = a.shape
    padded = np.zeros((N, C + before + after, H, W), dtype=a.dtype)  # zero channels around a
    padded[:, before:before + C] = a
    s = np.array(padded[:, 0:C])
    for o in range(1, before + after + 1):
        s += padded[:, o:o + C]
    return s


def lrn_fprop(x: np.ndarray, size: int, alpha: float, beta: float, k: float) -> tuple[np.ndarray, np.ndarray]:
    """Cross-map local response normalisation (Krizhevsky et al. 2012 section 3.3, `protocol.Backend.lrn_fprop`):
    scale = k + alpha/size * (sum of x^2 over channels c - size//2 .. c + (size - 1)//2), y = x * scale^-beta;
    x (N, C, H, W) -> (y, scale), fresh, x's dtype. Raises ValueError on a wrong ndim/dtype, size < 1,
    k <= 0, alpha < 0, or a non-finite alpha, beta or k."""
    op = "lrn_fprop"
    check_float(op, "x", x, 4, "(N, C, H, W)")
    alpha, beta, k = check_lrn(op, size, alpha, beta, k)
    dt = x.dtype.type
    scale = _channel_window_sum(x * x, size // 2, (size - 1) // 2)  # (N, C, H, W)
    scale *= dt(alpha / size)
    scale += dt(k)
    y = np.power(scale, dt(-beta))
    y *= x
    return y, scale


def lrn_bprop(dy: np.ndarray, x: np.ndarray, y: np.ndarray, scale: np.ndarray, size: int, alpha: float,
              beta: float) -> np.ndarray:
    """Gradient of `lrn_fprop`: dx = dy * scale^-beta - 2*alpha*beta/size * x * (sum of dy*y/scale over the
    channels c - (size - 1)//2 .. c + size//2, those whose window holds c), fresh (N, C, H, W).
    Raises ValueError on arrays whose shape or dtype differs from x's, or bad size, alpha, beta."""
    op = "lrn_bprop"
    check_float(op, "x", x, 4, "(N, C, H, W)")
    for arg, a in (("dy", dy), ("y", y), ("scale", scale)):
        check_float(op, arg, a, 4, "(N, C, H, W)", x.dtype)
        if a.shape != x.shape:
            raise ValueError(f"{op}: {arg} must have x's shape {x.shape}, got {a.shape}")
    alpha, beta = check_lrn(op, size, alpha, beta)
    dt = x.dtype.type
    ratio = dy * y
    ratio /= scale
    dx = _channel_window_sum(ratio, (size - 1) // 2, size // 2)  # (N, C, H, W)
    dx *= x
    dx *= dt(-2.0 * alpha * beta / size)
    dx += dy * np.power(scale, dt(-beta))
    return dx


# ----------------------------------------------------------------------------------------------
# fully connected


def linear_fprop(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """y (N, O) = x (N, I) @ w.T + b; w (O, I), b (O,). Raises ValueError on shape/dtype mismatch."""
    op = "linear_fprop"
    check_float(op, "x", x, 2, "(N, I)")
    check_float(op, "w", w, 2, f"(O, I={x.shape[1]})", x.dtype)
    check_float(op, "b", b, 1, f"({w.shape[0]},)", x.dtype)
    if w.shape[1] != x.shape[1] or b.shape != (w.shape[0],):
        raise ValueError(f"{op}: expected w (O, {x.shape[1]}) and b (O,) for x {x.shape}, "
                         f"got w {w.shape}, b {b.shape}")
    y = np.matmul(x, w.T)  # (N, O)
    y += b
    return y


def linear_dgrad(dy: np.ndarray, w: np.ndarray) -> np.ndarray:
    """dx (N, I) = dy (N, O) @ w (O, I). Raises ValueError on shape/dtype mismatch."""
    op = "linear_dgrad"
    check_float(op, "dy", dy, 2, "(N, O)")
    check_float(op, "w", w, 2, f"(O={dy.shape[1]}, I)", dy.dtype)
    check_linear_dgrad(op, dy.shape, w.shape)
    return np.matmul(dy, w)


def linear_wgrad(dy: np.ndarray, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """dw (O, I) = dy.T (O, N) @ x (N, I), written into `out` when given (overwritten) and returned.

    Raises ValueError on shape/dtype mismatch or a bad `out`.
    """
    op = "linear_wgrad"
    check_float(op, "x", x, 2, "(N, I)")
    check_float(op, "dy", dy, 2, f"(N={x.shape[0]}, O)", x.dtype)
    check_linear_wgrad(op, dy.shape, x.shape)
    dw = check_out(op, out, (dy.shape[1], x.shape[1]), x.dtype)
    np.matmul(dy.T, x, out=dw)
    return dw


# ----------------------------------------------------------------------------------------------
# loss


def softmax_xent(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray, int]:
    """Softmax cross-entropy, mean over the minibatch.

    logits (N, K) float, labels (N,) integer in [0, K) ->
    (loss: float = mean_n -log softmax(logits_n)[labels_n],
     dlogits (N, K) = (softmax - onehot) / N, logits' dtype,
     correct: int = number of n with argmax(logits_n) == labels_n).
    Numerically stable (the row max is subtracted before exp). A row holding a NaN or +inf logit has a
    NaN loss and dlogits (max, then inf - inf), so the mean loss is NaN; its argmax is the first NaN
    (np.argmax), else the first maximum.
    Raises ValueError on wrong shapes/dtypes or a label outside [0, K) (naming it and its index).
    """
    op = "softmax_xent"
    check_float(op, "logits", logits, 2, "(N, K)")
    N, K = logits.shape
    check_labels(op, labels, N, np.ndarray)
    if N and (labels.min() < 0 or labels.max() >= K):
        bad = int(np.flatnonzero((labels < 0) | (labels >= K))[0])
        raise label_outside(op, int(labels[bad]), bad, K)
    rows = np.arange(N)
    shifted = logits - logits.max(axis=1, keepdims=True)  # (N, K), <= 0
    exp = np.exp(shifted)
    sum_exp = exp.sum(axis=1, keepdims=True)  # (N, 1), >= 1
    log_prob = shifted[rows, labels] - np.log(sum_exp[:, 0])  # (N,)
    loss = -float(np.mean(log_prob, dtype=np.float64)) if N else 0.0
    dlogits = exp
    dlogits /= sum_exp  # softmax
    dlogits[rows, labels] -= 1
    dlogits *= 1.0 / max(N, 1)
    correct = int(np.count_nonzero(logits.argmax(axis=1) == labels))
    return loss, dlogits, correct


# ----------------------------------------------------------------------------------------------
# optimizer (workers taking local steps: sync mode, nsync > 1)


def sgd_momentum(params: np.ndarray, velocity: np.ndarray, grad: np.ndarray, decay: np.ndarray,
                 momentum: float, lr: float, nesterov: bool = False, lr_scale: np.ndarray | None = None) -> None:
    """In place, with d = grad + decay*params and s = lr_scale (1 when None):

        velocity <- momentum*velocity + d
        params   <- params - (lr * s) * velocity                    (heavy ball)
        params   <- params - (lr * s) * (d + momentum*velocity)     (nesterov, with the new velocity)

    All (P,) float32 C-contiguous; decay = weight_decay * mask (0 on biases), lr_scale the learning-rate
    multipliers. The arithmetic of `mpiasgd.optim.SGD` and of the CUDA kernel `sgd_momentum`
    (kernels/sgd.cu), torch.optim.SGD's forms (dampening 0), in float32; lr * s is one float32 product
    per element (exactly lr when s is None). Raises ValueError naming the argument whose shape or dtype
    differs from params', or a non-bool nesterov.
    """
    op = "sgd_momentum"
    check_float(op, "params", params, 1, "(P,)")
    arrays = [("velocity", velocity), ("grad", grad), ("decay", decay)]
    if lr_scale is not None:
        arrays.append(("lr_scale", lr_scale))
    for arg, a in arrays:
        check_float(op, arg, a, 1, f"({params.shape[0]},)", params.dtype)
        if a.shape != params.shape or not a.flags.c_contiguous:
            raise ValueError(f"{op}: {arg} must be C-contiguous of shape {params.shape}, got {a.shape}")
    check_bool(op, "nesterov", nesterov)
    m, step = params.dtype.type(momentum), params.dtype.type(lr)
    d = grad + decay * params  # (P,)
    velocity *= m
    velocity += d
    if nesterov:
        d += m * velocity  # the look-ahead direction d + momentum*velocity
        direction = d
    else:
        direction = velocity
    if lr_scale is None:
        params -= step * direction
    else:
        params -= (step * lr_scale) * direction


# ----------------------------------------------------------------------------------------------
# the backend object


class NumpyBackend:
    """This module's ops as an object satisfying `mpiasgd.ops.protocol.Backend` (`get_backend("numpy")`).

    Holds no state: every attribute is the module function (or class) of the same name.
    """

    name = "numpy"
    ndarray = np.ndarray
    Workspace = Workspace
    zeros = staticmethod(zeros)
    empty = staticmethod(empty)
    asarray = staticmethod(asarray)
    to_numpy = staticmethod(to_numpy)
    may_share_memory = staticmethod(may_share_memory)
    conv2d_fprop = staticmethod(conv2d_fprop)
    conv2d_dgrad = staticmethod(conv2d_dgrad)
    conv2d_wgrad = staticmethod(conv2d_wgrad)
    bias_grad = staticmethod(bias_grad)
    relu_fprop = staticmethod(relu_fprop)
    relu_bprop = staticmethod(relu_bprop)
    maxpool_fprop = staticmethod(maxpool_fprop)
    maxpool_bprop = staticmethod(maxpool_bprop)
    avgpool_fprop = staticmethod(avgpool_fprop)
    avgpool_bprop = staticmethod(avgpool_bprop)
    global_avgpool_fprop = staticmethod(global_avgpool_fprop)
    global_avgpool_bprop = staticmethod(global_avgpool_bprop)
    batchnorm_stats = staticmethod(batchnorm_stats)
    batchnorm_fprop = staticmethod(batchnorm_fprop)
    batchnorm_bprop = staticmethod(batchnorm_bprop)
    add = staticmethod(add)
    subsample_pad_fprop = staticmethod(subsample_pad_fprop)
    subsample_pad_bprop = staticmethod(subsample_pad_bprop)
    dropout_fprop = staticmethod(dropout_fprop)
    dropout_bprop = staticmethod(dropout_bprop)
    lrn_fprop = staticmethod(lrn_fprop)
    lrn_bprop = staticmethod(lrn_bprop)
    linear_fprop = staticmethod(linear_fprop)
    linear_dgrad = staticmethod(linear_dgrad)
    linear_wgrad = staticmethod(linear_wgrad)
    softmax_xent = staticmethod(softmax_xent)
    sgd_momentum = staticmethod(sgd_momentum)

    def softmax_xent_deferred(self, logits: np.ndarray, labels: np.ndarray) -> tuple[LossStats, np.ndarray]:
        """`softmax_xent`, its loss and hits ready at once (`LossStats.ready`)."""
        loss, dlogits, correct = self.softmax_xent(logits, labels)
        return LossStats.ready(loss, correct), dlogits

    def __repr__(self) -> str:
        return "NumpyBackend()"


def make_backend() -> NumpyBackend:
    """The numpy backend object (`mpiasgd.ops.get_backend("numpy")` keeps one)."""
    return NumpyBackend()
