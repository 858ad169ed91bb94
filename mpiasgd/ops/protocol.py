"""The compute backend protocol: every op the layers and the model call, with its shapes, dtypes and errors.

Two backends satisfy it, obtained with `mpiasgd.ops.get_backend(name)`:

    "numpy"   mpiasgd.ops.numpy_ops.NumpyBackend: im2col + BLAS on the CPU, the reference (ground truth)
    "cupy"    mpiasgd.ops.cuda.backend.CupyBackend: our CUDA C kernels (kernels/*.cu) on one GPU

Layout NCHW. Production dtype is float32; the numpy backend also takes float64 (all float arguments of
one call share one dtype) so that tests can check gradients against float64 finite differences; the
cupy backend takes float32, C-contiguous arrays of its own array type only. The argument checks are
`mpiasgd.ops.contract`; every op raises ValueError naming the op and the argument before it computes.

Shapes: N minibatch, C input channels, H x W input, K output channels (filters), R x S filter,
P x Q output, I / O linear inputs / outputs, P (1-D) parameters. `stride`, `pad`, `kernel` in pixels.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

Array = Any  # numpy.ndarray or cupy.ndarray (the backend's `ndarray`)


@runtime_checkable
class Workspace(Protocol):
    """Scratch arrays of one layer, kept between minibatches and reused while shapes match."""

    cols_src: tuple | None  # numpy: (x, R, S, stride, pad) whose im2col columns are kept; cupy: unused

    def get(self, key: str, shape: tuple[int, ...], dtype) -> Array:
        """The scratch array named `key`, reallocated (uninitialized) if shape or dtype changed."""

    @property
    def nbytes(self) -> int:
        """Bytes held by all scratch arrays."""


@runtime_checkable
class Backend(Protocol):
    """The ops of one backend. Every array argument and result is the backend's `ndarray`."""

    name: str  # "numpy" or "cupy"
    ndarray: type  # the array type of this backend (numpy.ndarray, cupy.ndarray)

    # ------------------------------------------------------------------------------------------
    # arrays (layers and the model allocate through these, never through numpy or cupy directly)

    def Workspace(self) -> Workspace:
        """A fresh, empty `Workspace` for one layer (the layers' name for it: a class on the numpy backend,
        a method binding the array module on cupy)."""

    def zeros(self, shape: int | tuple[int, ...], dtype=np.float32) -> Array:
        """Zero-filled C-contiguous array of `shape` (default float32)."""

    def empty(self, shape: int | tuple[int, ...], dtype=np.float32) -> Array:
        """Uninitialized C-contiguous array of `shape` (default float32)."""

    def asarray(self, x, dtype=np.float32) -> Array:
        """`x` (host or device data) as a C-contiguous array of `dtype` on this backend (no copy when it
        already is one)."""

    def to_numpy(self, x: Array) -> np.ndarray:
        """Host (NumPy) copy of a backend array: identity on numpy, a device->host copy (a sync) on cupy."""

    def may_share_memory(self, a: Array, b: Array) -> bool:
        """Cheap (bounds-only) test whether two arrays may overlap in memory."""

    # ------------------------------------------------------------------------------------------
    # convolution (cross-correlation, as in every CNN library), zero padding

    def conv2d_fprop(self, x: Array, w: Array, b: Array | None, stride: int, pad: int,
                     ws: Workspace | None = None) -> Array:
        """Forward convolution: x (N, C, H, W), w (K, C, R, S), b (K,) or None -> y (N, K, P, Q), fresh,
        x's float dtype; P = (H + 2*pad - R)//stride + 1, Q = (W + 2*pad - S)//stride + 1.

        `ws`: the layer's Workspace (scratch reused; numpy keeps the im2col columns for `conv2d_wgrad`
        of this same x, cupy its split-K buffer). Raises ValueError on a wrong ndim/dtype, a channel
        mismatch, b not (K,), stride < 1, pad < 0, or a filter larger than the padded input.
        """

    def conv2d_dgrad(self, dy: Array, w: Array, x_shape: tuple[int, int, int, int], stride: int, pad: int,
                     ws: Workspace | None = None) -> Array:
        """Input gradient of `conv2d_fprop`: dy (N, K, P, Q), w (K, C, R, S), x_shape (N, C, H, W) of the
        forward input (several H give the same P when stride > 1; rows/columns no window reached get zero)
        -> dx (N, C, H, W), fresh, dy's dtype. Raises ValueError on a wrong ndim/dtype, an x_shape that is
        not 4 integers >= 0, or shapes inconsistent with x_shape.
        """

    def conv2d_wgrad(self, dy: Array, x: Array, w_shape: tuple[int, int, int, int], stride: int, pad: int,
                     out: Array | None = None, ws: Workspace | None = None) -> Array:
        """Filter gradient of `conv2d_fprop`: dw (K, C, R, S) = the sum over n, p, q of dy * the x window.

        dy (N, K, P, Q), x (N, C, H, W) the forward input, w_shape (K, C, R, S). Written into `out`
        (overwritten, not accumulated; C-contiguous (K, C, R, S) of dy's dtype) when given, and returned.
        An empty batch gives zeros. Raises ValueError on a wrong ndim/dtype/shape or a bad `out`.
        """

    def bias_grad(self, dy: Array, out: Array | None = None) -> Array:
        """Bias gradient: db (K,) = dy summed over all axes but 1; dy (N, K, P, Q) or (N, K). Written into
        `out` ((K,), dy's dtype) when given, and returned. Raises ValueError on a wrong ndim/dtype."""

    # ------------------------------------------------------------------------------------------
    # elementwise and pooling

    def relu_fprop(self, x: Array) -> Array:
        """y = max(x, 0), fresh, x's shape and float dtype; NaN stays NaN (np.maximum's propagation).
        Raises ValueError on a non-float x."""

    def relu_bprop(self, dy: Array, y: Array) -> Array:
        """dx = dy * (y > 0): dy where y > 0, else 0, but NaN where dy is NaN or +-inf (0 * inf); y the
        forward output (where it is NaN, dx is 0 unless dy is non-finite). Raises ValueError on a
        shape/dtype mismatch."""

    def maxpool_fprop(self, x: Array, kernel: int, stride: int) -> tuple[Array, Array]:
        """Max pooling, no padding, floor output size; windows may overlap (kernel > stride).

        x (N, C, H, W) -> (y (N, C, P, Q), argmax (N, C, P, Q)), P = (H - kernel)//stride + 1 (Q
        likewise); argmax uint8 (int32 if kernel*kernel > 256: `contract.argmax_dtype`) holds the offset
        i*kernel + j of the maximum inside its window, the first one on ties. NaN propagates as in
        np.max / np.argmax: a window holding a NaN gives NaN, its argmax is its first NaN in row-major
        order; +-inf are ordinary values. Raises ValueError on a wrong ndim/dtype or a kernel larger than
        the input.
        """

    def maxpool_bprop(self, dy: Array, argmax: Array, x_shape: tuple[int, int, int, int], kernel: int,
                      stride: int) -> Array:
        """Gradient of `maxpool_fprop`: dy (N, C, P, Q), its argmax, x_shape (N, C, H, W) -> dx (N, C, H, W),
        fresh; overlapping windows add up. Raises ValueError on shapes inconsistent with x_shape, kernel
        and stride, or an argmax not of `maxpool_fprop`'s integers."""

    # ------------------------------------------------------------------------------------------
    # fully connected

    def linear_fprop(self, x: Array, w: Array, b: Array) -> Array:
        """y (N, O) = x (N, I) @ w.T + b; w (O, I), b (O,). Raises ValueError on a shape/dtype mismatch."""

    def linear_dgrad(self, dy: Array, w: Array) -> Array:
        """dx (N, I) = dy (N, O) @ w (O, I). Raises ValueError on a shape/dtype mismatch."""

    def linear_wgrad(self, dy: Array, x: Array, out: Array | None = None) -> Array:
        """dw (O, I) = dy.T (O, N) @ x (N, I), written into `out` when given (overwritten) and returned.
        Raises ValueError on a shape/dtype mismatch or a bad `out`."""

    # ------------------------------------------------------------------------------------------
    # loss and optimizer

    def softmax_xent(self, logits: Array, labels: Array) -> tuple[float, Array, int]:
        """Softmax cross-entropy, mean over the minibatch.

        logits (N, K) float, labels (N,) integer in [0, K) (cupy: on the device or the host) ->
        (loss: float = mean over n of -log softmax(logits_n)[labels_n],
         dlogits (N, K) = (softmax - onehot) / N, logits' dtype,
         correct: int = the number of n with argmax(logits_n) == labels_n).
        Numerically stable (the row max is subtracted before exp). A row holding a NaN or +inf logit has
        a NaN loss and dlogits, so the mean loss is NaN; its argmax is its first NaN, else its first
        maximum. Raises ValueError on a wrong shape/dtype or a label outside [0, K) (naming it and its
        index).
        """

    def sgd_momentum(self, params: Array, velocity: Array, grad: Array, decay: Array, momentum: float,
                     lr: float) -> None:
        """In place: velocity <- momentum*velocity + (grad + decay*params); params <- params - lr*velocity.

        All (P,) float32 C-contiguous; decay = weight_decay * mask (0 on biases): the arithmetic of
        `mpiasgd.optim.SGD` (heavy-ball momentum, torch.optim.SGD's form), in float32. Raises ValueError
        naming an argument whose shape or dtype differs from params' (cupy: or that overlaps another).
        """


def members() -> list[str]:
    """The names every backend provides (the attributes and methods of `Backend`), sorted."""
    names = set(Backend.__annotations__) | {n for n, v in vars(Backend).items() if callable(v) and not
                                            n.startswith("_")}
    return sorted(names)
