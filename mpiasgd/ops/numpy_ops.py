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
    check_float,
    check_labels,
    check_linear_dgrad,
    check_linear_wgrad,
    check_out,
    describe,
    host_conv_geometry,
    host_pool_geometry,
    label_outside,
    shape4,
)

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


def conv2d_fprop(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: int, pad: int,
                 ws: Workspace | None = None) -> np.ndarray:
    """Forward convolution: x (N, C, H, W), w (K, C, R, S), b (K,) or None -> y (N, K, P, Q), fresh
    (`protocol.Backend.conv2d_fprop`: shapes, dtypes, errors). im2col + one GEMM; with `ws`, scratch is
    reused and the column matrix is kept for `conv2d_wgrad` of this `x`."""
    op = "conv2d_fprop"
    check_float(op, "x", x, 4, "(N, C, H, W)")
    check_float(op, "w", w, 4, "(K, C, R, S)", x.dtype)
    K, _, R, S = w.shape
    if b is not None:
        check_float(op, "b", b, 1, f"({K},)", x.dtype)
        if b.shape != (K,):
            raise ValueError(f"{op}: b must have shape ({K},), got {b.shape}")
    host_conv_geometry(op, x.shape, w.shape, stride, pad)
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
    check_float(op, "x", x, 4, "(N, C, H, W)")
    check_float(op, "dy", dy, 4, "(N, K, P, Q)", x.dtype)
    K, C, R, S = shape4(op, "w_shape", w_shape, "(K, C, R, S)")
    P, Q = host_conv_geometry(op, x.shape, (K, C, R, S), stride, pad)
    N = x.shape[0]
    if dy.shape != (N, K, P, Q):
        raise ValueError(f"{op}: dy must have shape {(N, K, P, Q)}, got {dy.shape}")
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
    op = "conv2d_dgrad"
    check_float(op, "dy", dy, 4, "(N, K, P, Q)")
    check_float(op, "w", w, 4, "(K, C, R, S)", dy.dtype)
    N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
    K, _, R, S = w.shape
    P, Q = host_conv_geometry(op, (N, C, H, W), w.shape, stride, pad)
    if dy.shape != (N, K, P, Q):
        raise ValueError(f"{op}: dy must have shape {(N, K, P, Q)} for x_shape {(N, C, H, W)}, "
                         f"got {dy.shape}")
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


def maxpool_fprop(x: np.ndarray, kernel: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Max pooling, no padding, floor output size; windows may overlap (kernel > stride).

    x (N, C, H, W) -> y (N, C, P, Q) with P = (H - kernel)//stride + 1 (same for Q), and
    argmax (N, C, P, Q) uint8 (int32 if kernel*kernel > 256): offset i*kernel + j of the maximum
    inside its window, the first one on ties. Only `maxpool_bprop` of this backend reads it.
    NaN propagates as in np.max / np.argmax: a window holding a NaN gives NaN, and its argmax is the
    first NaN in row-major order, so `maxpool_bprop` routes that window's gradient to it (PyTorch also
    propagates the NaN and routes to a NaN, though to the last one of the window); +-inf are ordinary.
    Raises ValueError on wrong ndim/dtype or a kernel larger than the input.
    """
    op = "maxpool_fprop"
    check_float(op, "x", x, 4, "(N, C, H, W)")
    P, Q = host_pool_geometry(op, x.shape, kernel, stride)
    hs, ws_ = stride * (P - 1) + 1, stride * (Q - 1) + 1  # extent of the window origins
    y = np.array(x[:, :, 0:hs:stride, 0:ws_:stride])  # offset (0, 0): (N, C, P, Q)
    argmax = np.zeros(y.shape, dtype=argmax_dtype(kernel))
    greater = np.empty(y.shape, dtype=bool)
    code = np.empty(y.shape, dtype=argmax.dtype)
    for i in range(kernel):
        for j in range(kernel):
            if i == 0 and j == 0:
                continue
            v = x[:, :, i:i + hs:stride, j:j + ws_:stride]  # strided view (N, C, P, Q)
            np.greater(v, y, out=greater)  # strict: on ties the earlier offset stays
            np.maximum(y, v, out=y)
            # offsets only grow, so "argmax = o where greater" is a max with greater*o;
            # np.copyto(where=) / np.where are ~10x slower here
            np.multiply(greater, code.dtype.type(i * kernel + j), out=code)
            np.maximum(argmax, code, out=argmax)
    # np.maximum made y NaN wherever a window holds a NaN, but `greater` never saw the NaN (v > y is
    # False for it), so point those windows' argmax at their first NaN; this costs one pass over y
    # when there is none (the training path), the rest scales with the NaN windows only
    nan_windows = np.flatnonzero(np.isnan(y))
    if nan_windows.size:
        n, c, p, q = np.unravel_index(nan_windows, y.shape)
        first = np.zeros(nan_windows.size, dtype=argmax.dtype)
        for o in reversed(range(kernel * kernel)):  # descending: the smallest NaN offset is written last
            i, j = divmod(o, kernel)
            first[np.isnan(x[n, c, p * stride + i, q * stride + j])] = o
        argmax.reshape(-1)[nan_windows] = first
    return y, argmax


def maxpool_bprop(dy: np.ndarray, argmax: np.ndarray, x_shape: tuple[int, int, int, int],
                  kernel: int, stride: int) -> np.ndarray:
    """Gradient of `maxpool_fprop`: dx (N, C, H, W), fresh; overlapping windows accumulate.

    dy (N, C, P, Q), argmax from `maxpool_fprop`, x_shape the forward input shape.
    Raises ValueError on shapes inconsistent with x_shape/kernel/stride.
    """
    op = "maxpool_bprop"
    check_float(op, "dy", dy, 4, "(N, C, P, Q)")
    N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
    P, Q = host_pool_geometry(op, (N, C, H, W), kernel, stride)
    if dy.shape != (N, C, P, Q) or not isinstance(argmax, np.ndarray) or argmax.shape != dy.shape:
        got = argmax.shape if isinstance(argmax, np.ndarray) else type(argmax).__name__
        raise ValueError(f"{op}: dy and argmax must have shape {(N, C, P, Q)} for x_shape "
                         f"{(N, C, H, W)}, got {dy.shape} and {got}")
    if not np.issubdtype(argmax.dtype, np.integer):
        raise ValueError(f"{op}: argmax must hold integers (maxpool_fprop's offsets i*kernel + j), got {argmax.dtype}")
    if argmax.size and (int(argmax.min()) < 0 or int(argmax.max()) >= kernel * kernel):
        raise ValueError(f"{op}: argmax must lie in 0..{kernel * kernel - 1} (offsets in a {kernel}x{kernel} window), "
                         f"got {int(argmax.min())}..{int(argmax.max())}")
    # flat index into dx of every window's maximum: window origin + in-window offset of argmax
    index_dtype = np.int32 if N * C * H * W < 2**31 else np.int64
    origin = (np.arange(N * C, dtype=index_dtype).reshape(N * C, 1, 1) * (H * W)
              + (np.arange(P, dtype=index_dtype) * (stride * W)).reshape(P, 1)
              + np.arange(Q, dtype=index_dtype) * stride)  # (N*C, P, Q)
    offsets = np.array([i * W + j for i in range(kernel) for j in range(kernel)], dtype=index_dtype)
    target = origin.reshape(N, C, P, Q) + offsets[argmax]  # (N, C, P, Q)
    dx = np.zeros(N * C * H * W, dtype=dy.dtype)
    # unbuffered scatter-add: overlapping windows (kernel > stride) may pick the same input
    # element, which must receive the sum (numpy >= 1.25 runs this in a fast C loop; 5x faster
    # than a strided add per kernel offset)
    np.add.at(dx, target.reshape(-1), dy.reshape(-1))
    return dx.reshape(N, C, H, W)


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
                 momentum: float, lr: float) -> None:
    """In place: velocity <- momentum*velocity + (grad + decay*params); params <- params - lr*velocity.

    All (P,) float32 C-contiguous; decay = weight_decay * mask (0 on biases). The arithmetic of
    `mpiasgd.optim.SGD` and of the CUDA kernel `sgd_momentum` (kernels/sgd.cu), in float32.
    Raises ValueError naming the argument whose shape or dtype differs from params'.
    """
    op = "sgd_momentum"
    check_float(op, "params", params, 1, "(P,)")
    for arg, a in (("velocity", velocity), ("grad", grad), ("decay", decay)):
        check_float(op, arg, a, 1, f"({params.shape[0]},)", params.dtype)
        if a.shape != params.shape or not a.flags.c_contiguous:
            raise ValueError(f"{op}: {arg} must be C-contiguous of shape {params.shape}, got {a.shape}")
    m, step = params.dtype.type(momentum), params.dtype.type(lr)
    velocity *= m
    velocity += grad + decay * params
    params -= step * velocity


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
    linear_fprop = staticmethod(linear_fprop)
    linear_dgrad = staticmethod(linear_dgrad)
    linear_wgrad = staticmethod(linear_wgrad)
    softmax_xent = staticmethod(softmax_xent)
    sgd_momentum = staticmethod(sgd_momentum)

    def __repr__(self) -> str:
        return "NumpyBackend()"


def make_backend() -> NumpyBackend:
    """The numpy backend object (`mpiasgd.ops.get_backend("numpy")` keeps one)."""
    return NumpyBackend()
