"""The argument checks of the ops (mpiasgd.ops.protocol), written once and used by both backends.

Every check raises ValueError naming the op and the argument (`conv2d_fprop: w must ...`), before any
work is done. Three groups:

  shared        shape arguments, the geometry of convolution and pooling, labels, the shape relations
                of the linear ops, scalar arguments (flags, real numbers, dropout's Philox key, local
                response normalisation's parameters): the same rule and the same message on both
                backends;
  host policy   the numpy backend (`numpy_ops`): numpy arrays of float32 or float64 (float64 for the
                finite-difference tests), any strides (numpy reads views), `out=` C-contiguous;
  device policy the CUDA backend (`cuda.backend`): arrays of the backend's own array type (a host
                array's pointer would be misread by a kernel), float32 (or the integer type of an
                index array), C-contiguous (the kernels index dense row-major memory); every scalar
                cast to its C type after checking it fits; extents the kernels index with a 32-bit
                int checked to fit one.
"""

from __future__ import annotations

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # the host policy's float dtypes

# ----------------------------------------------------------------------------------------------
# shared


def shape4(op: str, arg: str, shape, names: str) -> tuple[int, int, int, int]:
    """`shape` as four ints >= 0; ValueError naming op and argument for anything else (None, 3 values,
    8.5, True, -1), which would otherwise be misread or truncated. `names`: e.g. "(N, C, H, W)"."""
    try:
        values = tuple(shape)
    except TypeError:
        values = None
    if (values is None or len(values) != 4 or
            any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0 for v in values)):
        raise ValueError(f"{op}: {arg} must be 4 integers >= 0 {names}, got {shape!r}")
    return tuple(int(v) for v in values)


def conv_output_size(op: str, x_shape, w_shape, stride: int, pad: int) -> tuple[int, int]:
    """(P, Q) = ((H + 2*pad - R)//stride + 1, (W + 2*pad - S)//stride + 1) for x (N, C, H, W) and
    w (K, C, R, S), stride and pad already checked to be ints >= 1 and >= 0. ValueError when w's
    channels differ from x's or the filter is larger than the padded input."""
    _, C, H, W = x_shape
    _, Cw, R, S = w_shape
    if Cw != C:
        raise ValueError(f"{op}: w must have shape (K, C={C}, R, S) to match x channels, "
                         f"got w {tuple(w_shape)} for x {tuple(x_shape)}")
    if H + 2 * pad < R or W + 2 * pad < S:
        raise ValueError(f"{op}: filter {R}x{S} larger than padded input {H + 2 * pad}x{W + 2 * pad}")
    return (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1


def pool_output_size(op: str, x_shape, kernel: int, stride: int, pad: int = 0,
                     ceil_mode: bool = False) -> tuple[int, int]:
    """(P, Q) of pooling x (N, C, H, W), PyTorch's rule (`torch.nn.MaxPool2d`, `AvgPool2d`):

        P = (H + 2*pad - kernel)//stride + 1                     (floor)
        P = ceil((H + 2*pad - kernel)/stride) + 1, less 1 when the last window would start at or past
            H + pad in padded coordinates, (P - 1)*stride >= H + pad, i.e. wholly in the bottom padding
                                                                 (ceil_mode)

    and Q likewise from W, so every window overlaps the image. kernel, stride (ints >= 1), pad (int >= 0)
    and ceil_mode (bool) already checked by the caller. ValueError when pad > kernel//2 (PyTorch's limit:
    a window of padding only) or the window is larger than the padded input."""
    if pad > kernel // 2:
        raise ValueError(f"{op}: pad must be <= kernel//2 = {kernel // 2} (a window must not be padding only), "
                         f"got pad {pad} for kernel {kernel}")
    H, W = x_shape[2:]
    if H + 2 * pad < kernel or W + 2 * pad < kernel:
        padded = f" (padded by {pad}: {H + 2 * pad}x{W + 2 * pad})" if pad else ""
        raise ValueError(f"{op}: kernel {kernel} larger than input {H}x{W}{padded}")

    def size(n: int) -> int:
        span = n + 2 * pad - kernel  # >= 0
        if not ceil_mode:
            return span // stride + 1
        out = -(-span // stride) + 1
        return out - 1 if (out - 1) * stride >= n + pad else out

    return size(H), size(W)


def argmax_dtype(kernel: int) -> type:
    """The dtype of max pooling's argmax (offsets i*kernel + j in a window): uint8 while kernel*kernel
    <= 256, else int32 (the same on both backends, so that either reads the other's)."""
    return np.uint8 if kernel * kernel <= 256 else np.int32


def check_labels(op: str, labels, N: int, array_type: type = object) -> None:
    """ValueError unless `labels` is an integer array (an instance of `array_type`) of shape (N,)."""
    if (not isinstance(labels, array_type) or getattr(labels, "shape", None) != (N,)
            or np.dtype(labels.dtype).kind not in "iu"):
        raise ValueError(f"{op}: labels must be an integer array of shape ({N},), got "
                         f"{getattr(labels, 'shape', type(labels).__name__)} {getattr(labels, 'dtype', '')}")


def label_outside(op: str, label: int, index: int, K: int) -> ValueError:
    """The error for label `label` at `index` outside [0, K) (raised by the caller, which found it)."""
    return ValueError(f"{op}: label {label} at index {index} is outside [0, {K})")


def check_linear_dgrad(op: str, dy_shape, w_shape) -> None:
    """ValueError unless w (O, I) has dy (N, O)'s O rows."""
    if w_shape[0] != dy_shape[1]:
        raise ValueError(f"{op}: w must have shape ({dy_shape[1]}, I), got {tuple(w_shape)}")


def check_linear_wgrad(op: str, dy_shape, x_shape) -> None:
    """ValueError unless dy (N, O) has x (N, I)'s N rows."""
    if dy_shape[0] != x_shape[0]:
        raise ValueError(f"{op}: dy must have shape ({x_shape[0]}, O), got {tuple(dy_shape)}")


def check_bool(op: str, arg: str, value) -> None:
    """ValueError unless `value` is a bool (or numpy.bool_); 0 and 1 are refused, so that a misplaced
    positional argument does not pass as a flag."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{op}: {arg} must be a bool, got {value!r}")


def check_real(op: str, arg: str, value, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a float after checking it is a finite real number (not a bool) within [low, high]
    (`low_open` / `high_open`: the bound itself excluded; None: no bound). ValueError otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{op}: {arg} must be a real number, got {value!r}")
    v = float(value)
    below = low is not None and (v <= low if low_open else v < low)
    above = high is not None and (v >= high if high_open else v > high)
    if not np.isfinite(v) or below or above:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        where = f" in {lo or '(-inf'}, {hi or 'inf)'}" if lo or hi else ""
        raise ValueError(f"{op}: {arg} must be a finite real number{where}, got {value!r}")
    return v


DROPOUT_MAX_ELEMENTS = 4 << 32  # Philox counter word 0 is i // 4, a 32-bit word


def dropout_key(op: str, p: float, seed: int, minibatch: int, layer: int, size: int
                ) -> tuple[int, tuple[int, int, int], tuple[int, int]]:
    """The mask parameters of dropout (`protocol.Backend.dropout_fprop`) after checking them:
    (threshold t = min(round(p * 2^32), 2^32 - 1), counter words 1..3 (layer, minibatch mod 2^32,
    minibatch // 2^32), key (seed mod 2^32, seed // 2^32)). ValueError for p outside [0, 1), seed or
    minibatch outside [0, 2^64), layer outside [0, 2^32) (all integers, not bools), or more than 2^34
    elements (`size`; the counter's word 0, i // 4, would wrap)."""
    p = check_real(op, "p", p, 0.0, 1.0, high_open=True)
    for arg, value, bits in (("seed", seed, 64), ("minibatch", minibatch, 64), ("layer", layer, 32)):
        if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
                or not 0 <= int(value) < 1 << bits):
            raise ValueError(f"{op}: {arg} must be an integer in [0, 2^{bits}), got {value!r}")
    if size > DROPOUT_MAX_ELEMENTS:
        raise ValueError(f"{op}: x has {size} elements, more than the 2^34 one Philox key stream numbers")
    threshold = min(round(p * 2.0**32), 2**32 - 1)
    minibatch = int(minibatch)
    return threshold, (int(layer), minibatch & 0xFFFFFFFF, minibatch >> 32), (int(seed) & 0xFFFFFFFF,
                                                                             int(seed) >> 32)


def check_lrn(op: str, size: int, alpha: float, beta: float, k: float | None = None) -> tuple[float, ...]:
    """(alpha, beta[, k]) as floats after checking local response normalisation's parameters: size an
    int >= 1, alpha >= 0, beta and k finite, k > 0 (when given: scale = k + ... must stay positive)."""
    check_int(op, "size", size, 1)
    values = (check_real(op, "alpha", alpha, 0.0), check_real(op, "beta", beta))
    return values if k is None else (*values, check_real(op, "k", k, 0.0, low_open=True))


# ----------------------------------------------------------------------------------------------
# host policy (numpy backend)


def describe(a) -> str:
    """An argument as an error message shows it: an array's shape and dtype, else its type (not its value)."""
    return f"{a.dtype} array of shape {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__


def check_float(op: str, arg: str, a, ndim: int, expected: str, dtype=None) -> None:
    """ValueError unless `a` is a numpy.ndarray of `ndim` dims and a float dtype (== `dtype` when given:
    the other inputs'). `expected`: the shape as the message shows it, e.g. "(N, C, H, W)"."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{op}: {arg} must be a numpy.ndarray {expected}, got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{op}: {arg} must have shape {expected}, got shape {a.shape}")
    if dtype is None:
        if a.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{op}: {arg} must be float32 (or float64), got {a.dtype}")
    elif a.dtype != dtype:
        raise ValueError(f"{op}: {arg} must have dtype {dtype} like the other inputs, got {a.dtype}")


def check_int(op: str, arg: str, value, minimum: int) -> None:
    """ValueError unless `value` is an int (not a bool) >= `minimum`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{op}: {arg} must be an int >= {minimum}, got {value!r}")


def check_out(op: str, out, shape: tuple[int, ...], dtype) -> np.ndarray:
    """`out` after checking it is a C-contiguous `dtype` numpy array of `shape` (it is written through a
    reshaped view), or a fresh uninitialized one when `out` is None. Raises ValueError otherwise."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype:
        got = (getattr(out, "shape", None), getattr(out, "dtype", type(out).__name__))
        raise ValueError(f"{op}: out must be a {dtype} array of shape {shape}, got {got}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{op}: out must be C-contiguous (it is written through a reshaped view)")
    return out


def host_conv_geometry(op: str, x_shape, w_shape, stride: int, pad: int) -> tuple[int, int]:
    """(P, Q) of a convolution on the host: stride an int >= 1, pad an int >= 0, then `conv_output_size`."""
    check_int(op, "stride", stride, 1)
    check_int(op, "pad", pad, 0)
    return conv_output_size(op, x_shape, w_shape, stride, pad)


def host_pool_geometry(op: str, x_shape, kernel: int, stride: int, pad: int = 0,
                       ceil_mode: bool = False) -> tuple[int, int]:
    """(P, Q) of pooling on the host: kernel and stride ints >= 1, pad an int >= 0, ceil_mode a bool, then
    `pool_output_size`."""
    check_int(op, "kernel", kernel, 1)
    check_int(op, "stride", stride, 1)
    check_int(op, "pad", pad, 0)
    check_bool(op, "ceil_mode", ceil_mode)
    return pool_output_size(op, x_shape, kernel, stride, pad, ceil_mode)


# ----------------------------------------------------------------------------------------------
# device policy (CUDA backend): arrays, C scalars, 32-bit extents


def check_array(op: str, arg: str, a, array_type: type | None, shape: tuple[int, ...] | None = None,
                ndim: int | None = None, dtype=np.float32):
    """Return `a` if it is a C-contiguous `array_type` (the backend's ndarray; None: no array module) of
    `dtype` with `shape` / `ndim`. Raises ValueError naming op and argument otherwise; a non-contiguous
    view (transpose, slice) is refused because the kernels index it as dense row-major memory."""
    if array_type is None or not isinstance(a, array_type):
        raise ValueError(f"{op}: {arg} must be a {getattr(array_type, '__module__', 'cupy')}.ndarray on this "
                         f"backend, got {type(a).__module__}.{type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise ValueError(f"{op}: {arg} must have dtype {np.dtype(dtype)}, got {a.dtype}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{op}: {arg} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{op}: {arg} must have {ndim} dimensions, got shape {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{op}: {arg} must be C-contiguous (a view or transpose would be misread by the "
                         f"kernel; pass an ascontiguousarray copy), got strides {a.strides} for shape "
                         f"{tuple(a.shape)}")
    return a


def _c_int(op: str, arg: str, value, ctype):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{op}: {arg} must be an integer, got {value!r}")
    info = np.iinfo(ctype)
    if not info.min <= int(value) <= info.max:
        raise ValueError(f"{op}: {arg} = {value} does not fit a {info.bits}-bit int")
    return ctype(value)


def c_int32(op: str, arg: str, value) -> np.int32:
    """`value` as np.int32 (a C int); ValueError if it is not an integer or does not fit."""
    return _c_int(op, arg, value, np.int32)


def c_int64(op: str, arg: str, value) -> np.int64:
    """`value` as np.int64 (a C long long); ValueError if it is not an integer or does not fit."""
    return _c_int(op, arg, value, np.int64)


def c_float32(op: str, arg: str, value) -> np.float32:
    """`value` as np.float32 (a C float); ValueError if it is not a finite real number."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{op}: {arg} must be a real number, got {value!r}")
    f = np.float32(value) if abs(float(value)) <= float(np.finfo(np.float32).max) else np.float32(np.inf)
    if not np.isfinite(f):
        raise ValueError(f"{op}: {arg} = {value} is not a finite float32")
    return f


def conv_geometry(op: str, x_shape, w_shape, stride: int, pad: int) -> tuple[int, int]:
    """Output size (P, Q) on the device; ValueError on a channel mismatch, stride < 1, pad < 0, a filter
    larger than the padded input, or an extent the kernels' 32-bit indices within one image or filter
    cannot hold (C*H*W, K*P*Q, K*C*R*S, the padded plane (H + 2*pad)*(W + 2*pad), ...: up to 2^31 - 1
    elements)."""
    c_int32(op, "stride", stride)
    c_int32(op, "pad", pad)
    if stride < 1 or pad < 0:
        raise ValueError(f"{op}: stride must be >= 1 and pad >= 0, got stride {stride}, pad {pad}")
    N, C, H, W = (int(v) for v in x_shape)
    K, _, R, S = (int(v) for v in w_shape)
    P, Q = conv_output_size(op, x_shape, w_shape, stride, pad)
    # per-image extents C*H*W and K*P*Q bound H*W and P*Q too (C, K >= 1 wherever a kernel is launched)
    for what, v in (("H + 2*pad", H + 2 * pad), ("W + 2*pad", W + 2 * pad), ("C*R*S", C * R * S),
                    ("K*R*S", K * R * S), ("N", N), ("K", K),
                    ("(P-1)*stride", (P - 1) * stride), ("(Q-1)*stride", (Q - 1) * stride),
                    ("C*H*W", C * H * W), ("K*P*Q", K * P * Q), ("K*C*R*S", K * C * R * S),
                    ("(H + 2*pad)*(W + 2*pad)", (H + 2 * pad) * (W + 2 * pad))):
        c_int32(op, what, v)
    return P, Q


def pool_geometry(op: str, x_shape, kernel: int, stride: int, pad: int = 0,
                  ceil_mode: bool = False) -> tuple[int, int]:
    """(P, Q) of pooling on the device: kernel and stride C ints >= 1, pad a C int >= 0, ceil_mode a bool,
    `pool_output_size`, and H*W and kernel*kernel within an int (pool.cu indexes within one (n, c) plane
    with an int)."""
    c_int32(op, "kernel", kernel)
    c_int32(op, "stride", stride)
    c_int32(op, "pad", pad)
    if kernel < 1 or stride < 1 or pad < 0:
        raise ValueError(f"{op}: kernel and stride must be >= 1 and pad >= 0, got {kernel}, {stride}, {pad}")
    check_bool(op, "ceil_mode", ceil_mode)
    P, Q = pool_output_size(op, x_shape, kernel, stride, pad, ceil_mode)
    H, W = x_shape[2:]
    c_int32(op, "H*W", H * W)  # the kernels index within one (n, c) plane with an int
    c_int32(op, "kernel*kernel", kernel * kernel)
    return P, Q


def conv_ints(op: str, *values: int) -> tuple[np.int32, ...]:
    """N, C, H, W, K, R, S, P, Q, stride, pad as the conv kernels' int arguments."""
    names = ("N", "C", "H", "W", "K", "R", "S", "P", "Q", "stride", "pad")
    return tuple(c_int32(op, name, v) for name, v in zip(names, values, strict=True))
