"""The compute backend protocol: every op the layers and the model call, with its shapes, dtypes and errors.

Three backends satisfy it, obtained with `mpiasgd.ops.get_backend(name)`:

    "numpy"   mpiasgd.ops.numpy_ops.NumpyBackend: im2col + BLAS on the CPU, the reference (ground truth)
    "cpu"     mpiasgd.ops.cpu_ops: the reference with faster convolutions and BatchNorm on the CPU
    "cupy"    mpiasgd.ops.cuda.backend.CupyBackend: our CUDA C kernels (kernels/*.cu) on one GPU

Layout NCHW. Production dtype is float32; the numpy backend also takes float64 (all float arguments of
one call share one dtype) so that tests can check gradients against float64 finite differences; the
cupy backend takes float32, C-contiguous arrays of its own array type only. The argument checks are
`mpiasgd.ops.contract`; every op raises ValueError naming the op and the argument before it computes.

Shapes: N minibatch, C input channels, H x W input, K output channels (filters), R x S filter,
P x Q output, I / O linear inputs / outputs, P (1-D) parameters. `stride`, `pad`, `kernel` in pixels.

Non-finite values, the same on every backend (each op's docstring has its rule; tests/kernels_cpu's
*_nonfinite cases and tests/unit check them): a NaN or infinity in an input propagates as NumPy's
float arithmetic propagates it (convolutions, linear layers, sums); max pooling and argmax pick the
first NaN of a window or row; a row with a NaN or +inf logit has a NaN loss and gradient. ReLU's
backward is dx = dy * (y > 0): where the forward output y is NaN, dx is 0 for a finite dy (NaN for a
non-finite one), where PyTorch's threshold_backward, where(y <= 0, 0, dy), passes dy through. Both
keep NaN in the forward output; ours does not send a gradient through a unit whose output is not a
number, which is why the two differ at y = NaN only.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

Array = Any  # numpy.ndarray or cupy.ndarray (the backend's `ndarray`)


class LossStats:
    """A minibatch's (mean loss, number correct) as `softmax_xent_deferred` returns it: on the host at once
    (numpy, cpu) or still on the device (cupy: its per-row losses and hits, copied to the host by `get()`,
    which waits for the kernels that compute them). Reading it late lets a worker queue a whole step's
    kernels (forward, backward, update) without waiting for the GPU in between.

    `get()` -> (loss: float, correct: int), the same values `softmax_xent` returns; computed once. It raises
    what `softmax_xent` raises for the minibatch (ValueError naming a label outside [0, K) and its index).

    `copied()` -> a LossStats of its own device rows, copied now (queued on the device, no wait): a CUDA graph's
    replay writes the same rows again, so the runner (`mpiasgd.ops.cuda.graphs.StepGraphs`) keeps each replay's
    copy. Values already on the host (`ready`) are returned as they are.
    """

    __slots__ = ("_copy", "_fetch", "_value")

    def __init__(self, fetch: Any = None, value: tuple[float, int] | None = None, copy: Any = None) -> None:
        self._fetch, self._value, self._copy = fetch, value, copy

    def copied(self) -> LossStats:
        return self if self._copy is None or self._value is not None else self._copy()

    @classmethod
    def ready(cls, loss: float, correct: int) -> LossStats:
        """Values already on the host."""
        return cls(value=(float(loss), int(correct)))

    def get(self) -> tuple[float, int]:
        if self._value is None:
            self._value, self._fetch = self._fetch(), None
        return self._value


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

    def maxpool_fprop(self, x: Array, kernel: int, stride: int, pad: int = 0,
                      ceil_mode: bool = False) -> tuple[Array, Array]:
        """Max pooling; windows may overlap (kernel > stride); padding never wins (it acts as -inf).

        x (N, C, H, W) -> (y (N, C, P, Q), argmax (N, C, P, Q)). Output size (`contract.pool_output_size`,
        PyTorch's rule): P = (H + 2*pad - kernel)//stride + 1 (floor), or with `ceil_mode` the ceiling
        of the division plus 1, less 1 when the last window would start at or past H + pad (so every
        window overlaps the padded input); cuda-convnet's output size (`outputsX = ceil((H - k)/s) + 1`
        for start 0) is ceil_mode with pad 0. Windows are clipped to the image. argmax uint8 (int32 if
        kernel*kernel > 256: `contract.argmax_dtype`) holds the offset i*kernel + j of the maximum inside
        its (unclipped, padded-origin) window, the first one on ties. NaN propagates as in np.max /
        np.argmax: a window holding a NaN gives NaN, its argmax is its first NaN in row-major order;
        +-inf are ordinary values. Raises ValueError on a wrong ndim/dtype, pad < 0 or pad > kernel//2
        (PyTorch's limit: a window of padding only), or a kernel larger than the padded input.
        """

    def maxpool_bprop(self, dy: Array, argmax: Array, x_shape: tuple[int, int, int, int], kernel: int,
                      stride: int, pad: int = 0, ceil_mode: bool = False) -> Array:
        """Gradient of `maxpool_fprop`: dy (N, C, P, Q), its argmax, x_shape (N, C, H, W) -> dx (N, C, H, W),
        fresh; overlapping windows add up. Raises ValueError on shapes inconsistent with x_shape, kernel,
        stride, pad and ceil_mode, or an argmax not of `maxpool_fprop`'s integers."""

    def avgpool_fprop(self, x: Array, kernel: int, stride: int, pad: int = 0, ceil_mode: bool = False,
                      count_include_pad: bool = True) -> Array:
        """Average pooling (torch.nn.AvgPool2d's semantics): x (N, C, H, W) -> y (N, C, P, Q), fresh; P, Q
        as `maxpool_fprop`. y = (sum of the window's pixels inside the image) / divisor, where the window
        is rows h0 = p*stride - pad .. h0 + kernel - 1 (columns likewise) and the divisor is the number
        of window positions inside [-pad, H + pad) x [-pad, W + pad) when `count_include_pad`, else
        inside [0, H) x [0, W). cuda-convnet's avg pooling (`pool=avg`, windows clipped at the border by
        its ceil output size) is pad 0, ceil_mode True: then both divisors count the clipped window.
        Raises ValueError as `maxpool_fprop`."""

    def avgpool_bprop(self, dy: Array, x_shape: tuple[int, int, int, int], kernel: int, stride: int,
                      pad: int = 0, ceil_mode: bool = False, count_include_pad: bool = True) -> Array:
        """Gradient of `avgpool_fprop`: dy (N, C, P, Q) -> dx (N, C, H, W), fresh: each window's dy / divisor
        added to each of its pixels inside the image. Raises ValueError on shapes inconsistent with
        x_shape and the pooling arguments."""

    def global_avgpool_fprop(self, x: Array) -> Array:
        """Global average pooling: x (N, C, H, W) -> y (N, C) = the mean over H and W, fresh. Raises
        ValueError on a wrong ndim/dtype or H*W = 0."""

    def global_avgpool_bprop(self, dy: Array, x_shape: tuple[int, int, int, int]) -> Array:
        """Gradient of `global_avgpool_fprop`: dy (N, C) -> dx (N, C, H, W) = dy / (H*W) at every pixel."""

    # ------------------------------------------------------------------------------------------
    # batch normalisation (Ioffe and Szegedy 2015, arXiv 1502.03167, Algorithm 1 and section 3)

    def batchnorm_stats(self, x: Array, running_mean: Array | None = None, running_var: Array | None = None,
                        momentum: float = 0.1) -> tuple[Array, Array]:
        """Batch statistics per channel over N, H, W: x (N, C, H, W) -> (mean (C,), var (C,)), fresh, x's
        dtype; var is the biased variance (divisor M = N*H*W), computed in two passes (the mean, then
        the mean squared deviation), accumulated in float64 on the numpy backend and by a fixed-order
        tree in float32 on the cupy backend (no atomics: the same input gives the same bits).

        When `running_mean` and `running_var` ((C,), x's dtype) are given they are updated in place as
        torch.nn.BatchNorm2d does: running_mean <- (1 - momentum)*running_mean + momentum*mean,
        running_var <- (1 - momentum)*running_var + momentum*var*M/(M - 1) (the unbiased variance; M = 1
        uses var). Raises ValueError on a wrong ndim/dtype, M = 0, momentum outside [0, 1], or only one
        of the running arrays.
        """

    def batchnorm_fprop(self, x: Array, gamma: Array, beta: Array, mean: Array, var: Array,
                        eps: float) -> Array:
        """y = (x - mean) / sqrt(var + eps) * gamma + beta per channel: x (N, C, H, W); gamma, beta, mean,
        var (C,) -> y (N, C, H, W), fresh. Training passes the batch statistics of `batchnorm_stats`,
        evaluation the running ones. Raises ValueError on a shape/dtype mismatch or eps <= 0."""

    def batchnorm_bprop(self, dy: Array, x: Array, gamma: Array, mean: Array, var: Array, eps: float,
                        dgamma: Array, dbeta: Array, need_dx: bool = True) -> Array | None:
        """Gradient of `batchnorm_fprop` with the batch statistics (training mode; mean and var depend on x).

        dy, x (N, C, H, W); gamma, mean, var (C,). Writes (overwrites) dbeta = sum over N, H, W of dy and
        dgamma = sum of dy * xhat, xhat = (x - mean) * invstd, invstd = 1/sqrt(var + eps), into the
        (C,) arrays `dgamma` and `dbeta`, and returns dx = gamma * invstd / M * (M*dy - dbeta - xhat *
        dgamma), fresh (None when not `need_dx`). Reductions as `batchnorm_stats` (deterministic).
        Raises ValueError on a shape/dtype mismatch or eps <= 0.
        """

    # ------------------------------------------------------------------------------------------
    # residual blocks, dropout, local response normalisation

    def add(self, a: Array, b: Array, out: Array | None = None) -> Array:
        """a + b elementwise (same shape and dtype), written into `out` when given (may be `a` or `b`) and
        returned; fresh otherwise. The residual add and the sum of a block's two input gradients."""

    def subsample_pad_fprop(self, x: Array, stride: int, pad_before: int, pad_after: int) -> Array:
        """The option-A shortcut of He et al. 2016 (arXiv 1512.03385 section 4.2) as FDG's ResNet_cifar.py
        writes it: y = zero-pad channels(x[:, :, ::stride, ::stride]), `pad_before` zero channels first
        and `pad_after` after. x (N, C, H, W) -> y (N, pad_before + C + pad_after, ceil(H/stride),
        ceil(W/stride)), fresh. Raises ValueError on a wrong ndim/dtype, stride < 1 or a pad < 0."""

    def subsample_pad_bprop(self, dy: Array, x_shape: tuple[int, int, int, int], stride: int, pad_before: int,
                            pad_after: int) -> Array:
        """Gradient of `subsample_pad_fprop`: dx (N, C, H, W), fresh: dy's channels pad_before..pad_before+C-1
        at the sampled pixels, 0 elsewhere."""

    def dropout_fprop(self, x: Array, p: float, seed: int, minibatch: int, layer: int) -> Array:
        """Inverted dropout: y = x * keep / (1 - p), fresh, any shape; keep is recomputed from its key, never
        stored, so a recomputed forward (and `dropout_bprop`) draws the same mask.

        keep[i] = (r_i >= t) with t = min(round(p * 2^32), 2^32 - 1) and r_i the (i mod 4)-th 32-bit word
        of Philox4x32-10 (Salmon et al. 2011, SC'11; the generator of cuRAND and of PyTorch's CUDA
        dropout) with counter (i // 4, layer, minibatch mod 2^32, minibatch // 2^32) and key (seed mod
        2^32, seed // 2^32), i the element's row-major index. p = 0 keeps every element (y = x); seed and
        minibatch are integers in [0, 2^64), layer in [0, 2^32). The scale 1/(1 - p) is rounded to x's
        dtype once. Raises ValueError for p outside [0, 1) or a key out of range.
        """

    def dropout_bprop(self, dy: Array, p: float, seed: int, minibatch: int, layer: int) -> Array:
        """Gradient of `dropout_fprop` with the same key: dx = dy * keep / (1 - p), fresh."""

    def lrn_fprop(self, x: Array, size: int, alpha: float, beta: float, k: float) -> tuple[Array, Array]:
        """Cross-map local response normalisation (Krizhevsky et al. 2012 section 3.3; cuda-convnet's
        `cmrnorm`; torch.nn.LocalResponseNorm's formula):

            scale[n, c] = k + alpha / size * sum over c' in [c - size//2, c + (size - 1)//2] of x[n, c']^2
            y = x * scale^-beta

        (channels outside [0, C) count as 0). x (N, C, H, W) -> (y, scale), both fresh (N, C, H, W); scale
        is kept for `lrn_bprop`. cuda-convnet's `scale` parameter is alpha / size here, its `pow` is beta
        and its constant 1 (cuda-convnet2's minDiv) is k. Raises ValueError on a wrong ndim/dtype, size < 1,
        k <= 0 or alpha < 0 (scale must stay positive), or a non-finite alpha, beta or k.
        """

    def lrn_bprop(self, dy: Array, x: Array, y: Array, scale: Array, size: int, alpha: float,
                  beta: float) -> Array:
        """Gradient of `lrn_fprop`: dx[c] = dy[c] * scale[c]^-beta - 2 * alpha * beta / size * x[c] * sum over
        c' whose window holds c (c' in [c - (size - 1)//2, c + size//2]) of dy[c'] * y[c'] / scale[c'];
        fresh (N, C, H, W). Raises ValueError on shapes that differ from x's."""

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

    def softmax_xent_deferred(self, logits: Array, labels: Array) -> tuple[LossStats, Array]:
        """`softmax_xent` without waiting for its loss and hits: (stats, dlogits), `stats.get()` giving the
        (loss, correct) `softmax_xent` gives, with the same bits. cupy: no device synchronisation here (the
        label check runs in `get()`); numpy and cpu: computed at once. Raises ValueError on a wrong
        shape/dtype here, on a label outside [0, K) here or (cupy) in `get()`."""

    def sgd_momentum(self, params: Array, velocity: Array, grad: Array, decay: Array, momentum: float,
                     lr: float, nesterov: bool = False, lr_scale: Array | None = None) -> None:
        """In place, with d = grad + decay*params and s = lr_scale (1 when None):

            velocity <- momentum*velocity + d
            params   <- params - lr * s * velocity                    (heavy ball)
            params   <- params - lr * s * (d + momentum*velocity)     (nesterov, with the new velocity)

        All (P,) float32 C-contiguous; decay = weight_decay * the decay multipliers (0 on biases by
        default), lr_scale the learning-rate multipliers (`Model.lr_scale`): the arithmetic of
        `mpiasgd.optim.SGD`, torch.optim.SGD's forms (dampening 0), in float32. Raises ValueError naming
        an argument whose shape or dtype differs from params' (cupy: or that overlaps another).
        """


def members() -> list[str]:
    """The names every backend provides (the attributes and methods of `Backend`), sorted."""
    names = set(Backend.__annotations__) | {n for n, v in vars(Backend).items() if callable(v) and not
                                            n.startswith("_")}
    return sorted(names)
