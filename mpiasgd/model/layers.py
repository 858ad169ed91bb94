"""CNN layers over an `ops` backend, and the layer contract every layer (built in or a user's) keeps.

The contract:

  * `params()` declares the layer's trainable parameters as `Param`s: name, shape, initialisation,
    and the learning-rate and weight-decay multipliers that apply to it (Caffe's lr_mult/decay_mult,
    cuda-convnet's per-layer epsW/epsB/wc relative to the run's --lr and --weight-decay);
    `buffers()` declares non-trainable state as `Buffer`s (BatchNorm's running mean and variance).
    The model lays both out in flat vectors; `bind` hands the layer views into them.
  * `forward` caches what `backward` needs, in the attributes its class lists in `cache`;
    `backward` overwrites (never accumulates) the bound gradient views and returns the input
    gradient, or None when `needs_dgrad` is False (the model sets that on its first layer: nothing
    consumes it). `save_cache()` / `load_cache(state)` take those attributes out and put them back
    (a pipeline module with --pipeline-activations store back-propagates a minibatch long after
    later forwards overwrote them): a layer that caches anything must name it in `cache`.
  * `training` (set by the model: True in `forward_backward`, False in `evaluate`) selects train or
    evaluation behaviour (BatchNorm's batch or running statistics, dropout on or off). `ctx`, the
    model's `Context`, says which minibatch this is (dropout's key) and whether a training forward
    may update buffers (a pipeline module's recomputed forward must not update them twice).
  * `config()` gives the constructor's keyword arguments as JSON values: with the class name it is the
    layer's stored definition (`mpiasgd.model.spec`), from which evaluate, report and --resume rebuild
    the network without running user code.

Layers call only `ops`; they never import numpy or cupy for math. Shapes: activations are NCHW
(N, C, H, W) for conv/pool/norm layers and (N, F) after Flatten or GlobalAvgPool; `out_shape` works
on per-sample shapes without N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpiasgd.model.errors import ModelSpecError
from mpiasgd.ops.contract import pool_output_size
from mpiasgd.ops.protocol import LossStats

Shape = tuple[int, ...]

INITS = ("he", "normal", "zeros", "ones")


@dataclass(frozen=True)
class Param:
    """One trainable parameter of a layer.

    init: "he" (N(0, 2/fan_in), He et al. 2015, arXiv 1502.01852, for ReLU networks; fan_in the
    layer's inputs per output), "normal" (N(0, std^2): cuda-convnet's initW), "zeros" or "ones".
    lr_mult scales --lr for this parameter, decay_mult scales --weight-decay (see `mpiasgd.optim.SGD`).
    """

    name: str
    shape: Shape
    init: str = "he"
    std: float = 0.0
    lr_mult: float = 1.0
    decay_mult: float = 1.0


@dataclass(frozen=True)
class Buffer:
    """One non-trainable state array of a layer (float32), initialised to `fill`."""

    name: str
    shape: Shape
    fill: float = 0.0


@dataclass
class Context:
    """What every layer of one model may read during a pass (the model owns one, shared by its layers).

    seed: the run's dropout seed (a worker's own); minibatch: the number of the minibatch being
    computed (dropout's key: a recomputed forward of the same minibatch draws the same mask);
    update_buffers: whether a training forward updates buffers (running statistics).
    """

    seed: int = 0
    minibatch: int = 0
    update_buffers: bool = True


class Layer:
    """Base class: a layer without parameters. Subclasses override what they need."""

    kind = "layer"  # short name prefix for logs and parameter names: conv, relu, pool, bn, res, ...
    cache: tuple[str, ...] = ()  # the attributes `forward` sets for `backward` (`save_cache`, `load_cache`)

    def __init__(self, *, ops: Any = None) -> None:
        self.ops = ops  # the model sets it (`set_ops`) when the layer was built without one
        self.needs_dgrad = True  # False on the first layer: its input gradient is never used
        self.training = True
        self.ctx = Context()
        self.index = 0  # position among all layers of the model (nested ones included): dropout's key

    # ------------------------------------------------------------------------------------------
    # declarations

    @property
    def fan_in(self) -> int:
        """Inputs feeding one output unit (for He initialisation); 0 without weights."""
        return 0

    def params(self) -> list[Param]:
        """This layer's trainable parameters, in the order `bind` expects them."""
        return []

    def buffers(self) -> list[Buffer]:
        """This layer's non-trainable state, in the order `bind` expects it."""
        return []

    def param_shapes(self) -> list[tuple[str, Shape]]:
        """[(name, shape)] of `params()`."""
        return [(p.name, p.shape) for p in self.params()]

    def param_fan_ins(self) -> list[int]:
        """The fan-in of the layer owning each of `params()` (He initialisation; a block's nested weights)."""
        return [self.fan_in] * len(self.params())

    def flops(self, in_shape: Shape) -> int:
        """2 x multiply-adds of the forward for one sample of shape `in_shape`: its weights (conv, linear) times
        the output positions; 0 for a layer without weights. A block sums its layers'."""
        out = self.out_shape(in_shape)
        weights = sum(_numel(p.shape) for p in self.params() if p.name == "weight")
        return 2 * weights * (_numel(out[1:]) if len(out) == 3 else 1)

    def config(self) -> dict[str, Any]:
        """The constructor's keyword arguments as JSON values (none for a layer without settings)."""
        return {}

    def children(self) -> list[Layer]:
        """Layers nested in this one (a residual block's), in execution order; [] for a plain layer."""
        return []

    # ------------------------------------------------------------------------------------------
    # binding and modes

    def set_ops(self, ops: Any) -> None:
        self.ops = ops
        for child in self.children():
            child.set_ops(ops)

    def bind(self, params: list[Any], grads: list[Any], buffers: list[Any] | tuple = ()) -> None:
        """Attach views into the model's flat vectors: one per `params()` entry in `params` and `grads`,
        one per `buffers()` entry in `buffers`. Raises ValueError on shapes that differ."""
        expected = [p.shape for p in self.params()]
        for what, arrays in (("params", params), ("grads", grads)):
            got = [tuple(a.shape) for a in arrays]
            if got != expected:
                raise ValueError(f"{type(self).__name__}.bind: {what} must have shapes {expected}, got {got}")
        expected = [b.shape for b in self.buffers()]
        got = [tuple(a.shape) for a in buffers]
        if got != expected:
            raise ValueError(f"{type(self).__name__}.bind: buffers must have shapes {expected}, got {got}")

    def out_shape(self, in_shape: Shape) -> Shape:
        """Per-sample output shape for per-sample input shape `in_shape`; ValueError when it does not fit."""
        return tuple(in_shape)

    def save_cache(self) -> dict[str, Any]:
        """What the last forward cached for `backward` (the attributes named in `cache`, and the children's
        under "children"), as references: forwards return fresh arrays and never write cached ones, so a
        later forward leaves them as they were. Memory: the saved state keeps those arrays alive."""
        state = {name: getattr(self, name) for name in self.cache}
        children = self.children()
        if children:
            state["children"] = [child.save_cache() for child in children]
        return state

    def load_cache(self, state: dict[str, Any]) -> None:
        """Put back a `save_cache()` state of this layer: `backward` then back-propagates that forward's
        minibatch (with the weights bound now). Raises ValueError on a state of another layer structure."""
        children = self.children()
        if set(state) != set(self.cache) | ({"children"} if children else set()):
            raise ValueError(f"{self.describe()}.load_cache: expected the keys {sorted(self.cache)}, got "
                             f"{sorted(state)}")
        for name in self.cache:
            setattr(self, name, state[name])
        if children:
            if len(state["children"]) != len(children):
                raise ValueError(f"{self.describe()}.load_cache: {len(children)} children, the state has "
                                 f"{len(state['children'])}")
            for child, child_state in zip(children, state["children"], strict=True):
                child.load_cache(child_state)

    def forward(self, x: Any) -> Any:
        raise NotImplementedError

    def backward(self, dy: Any) -> Any:
        raise NotImplementedError

    def describe(self) -> str:
        """Short constructor-like description, e.g. 'Conv2d(3->32, k5 s1 p2)'."""
        return f"{type(self).__name__}()"


def _numel(shape: Shape) -> int:
    size = 1
    for d in shape:
        size *= d
    return size


def _expect_planes(layer: Layer, in_shape: Shape, channels: int | None = None) -> tuple[int, int, int]:
    if len(in_shape) != 3 or (channels is not None and in_shape[0] != channels):
        want = f"({channels}, H, W)" if channels is not None else "(C, H, W)"
        raise ValueError(f"{layer.describe()}: expects inputs {want}, got {tuple(in_shape)}")
    return tuple(in_shape)


MAX_EXTENT = 2**31 - 1  # a layer's sizes: the kernels index within one image or filter with 32-bit ints


def _shown(value: Any) -> str:
    """repr(value) for an error message, cut to 40 characters (a 400-digit integer is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def _ints(layer: str, **values: tuple[Any, int]) -> list[int]:
    """Each value (value, minimum) as a Python int in [minimum, MAX_EXTENT]; ValueError naming `layer` and
    the argument otherwise (a bool, a float, None, a negative or zero size)."""
    out = []
    for name, (value, minimum) in values.items():
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
                or not minimum <= int(value) <= MAX_EXTENT:
            raise ValueError(f"{layer}: {name} must be an integer in [{minimum}, {MAX_EXTENT}], got {_shown(value)}")
        out.append(int(value))
    return out


def _reals(layer: str, **values: tuple[Any, float, bool]) -> list[float]:
    """Each value (value, minimum, strict) as a finite float >= minimum (> minimum when strict); ValueError
    naming `layer` and the argument otherwise (NaN and infinities included)."""
    out = []
    for name, (value, minimum, strict) in values.items():
        ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
        try:
            number = float(value) if ok else math.nan
        except OverflowError:  # an integer of 400 digits
            number = math.nan
        if not math.isfinite(number) or number < minimum or (strict and number == minimum):
            bound = "" if minimum == -math.inf else f" {'>' if strict else '>='} {minimum:g}"
            raise ValueError(f"{layer}: {name} must be a finite number{bound}, got {_shown(value)}")
        out.append(number)
    return out


def _weight(layer: str, init: str, std: float | None, lr_mult: float, decay_mult: float, shape: Shape) -> Param:
    if init not in INITS:
        raise ValueError(f"{layer}: init must be one of {', '.join(INITS)}, got {init!r}")
    if init == "normal" and std is None:
        raise ValueError(f"{layer}: init 'normal' needs std > 0, got None")
    if std is not None:
        (std,) = _reals(layer, std=(std, 0.0, True))
    lr_mult, decay_mult = _reals(layer, lr_mult=(lr_mult, 0.0, False), decay_mult=(decay_mult, 0.0, False))
    return Param("weight", shape, init, float(std or 0.0), lr_mult, decay_mult)


class Conv2d(Layer):
    """2-D convolution (cross-correlation), square kernel, zero padding. Input (N, C, H, W) -> (N, K, P, Q).

    Parameters: weight (K, C, k, k), bias (K,) unless bias=False (the convs before a BatchNorm).
    P = (H + 2*pad - k)//stride + 1. Weight init `init` ("he" default, or "normal" with `std`), bias 0;
    multipliers: weight lr_mult / decay_mult, bias bias_lr_mult / bias_decay_mult (default no decay).
    """

    kind = "conv"
    cache = ("x",)

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int = 1, pad: int = 0,
                 bias: bool = True, *, init: str = "he", std: float | None = None, lr_mult: float = 1.0,
                 decay_mult: float = 1.0, bias_lr_mult: float = 1.0, bias_decay_mult: float = 0.0,
                 ops: Any = None) -> None:
        super().__init__(ops=ops)
        in_channels, out_channels, kernel, stride, pad = _ints(
            "Conv2d", in_channels=(in_channels, 1), out_channels=(out_channels, 1), kernel=(kernel, 1),
            stride=(stride, 1), pad=(pad, 0))
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel, self.stride, self.pad, self.has_bias = kernel, stride, pad, bool(bias)
        self._weight = _weight("Conv2d", init, std, lr_mult, decay_mult, (out_channels, in_channels, kernel, kernel))
        self._bias = Param("bias", (out_channels,), "zeros", 0.0, *_reals(
            "Conv2d", bias_lr_mult=(bias_lr_mult, 0.0, False), bias_decay_mult=(bias_decay_mult, 0.0, False)))
        self.weight = self.bias = self.dweight = self.dbias = None
        self.x = None  # cached forward input
        self.ws = ops.Workspace() if ops is not None else None  # scratch kept between minibatches

    def set_ops(self, ops: Any) -> None:
        super().set_ops(ops)
        self.ws = ops.Workspace()

    @property
    def fan_in(self) -> int:
        return self.in_channels * self.kernel * self.kernel

    def params(self) -> list[Param]:
        return [self._weight, self._bias] if self.has_bias else [self._weight]

    def config(self) -> dict[str, Any]:
        w, b = self._weight, self._bias
        return dict(in_channels=self.in_channels, out_channels=self.out_channels, kernel=self.kernel,
                    stride=self.stride, pad=self.pad, bias=self.has_bias, init=w.init, std=w.std or None,
                    lr_mult=w.lr_mult, decay_mult=w.decay_mult, bias_lr_mult=b.lr_mult, bias_decay_mult=b.decay_mult)

    def bind(self, params: list[Any], grads: list[Any], buffers: list[Any] | tuple = ()) -> None:
        super().bind(params, grads, buffers)
        self.weight, self.dweight = params[0], grads[0]
        self.bias, self.dbias = (params[1], grads[1]) if self.has_bias else (None, None)

    def out_shape(self, in_shape: Shape) -> Shape:
        _, H, W = _expect_planes(self, in_shape, self.in_channels)
        k, s, p = self.kernel, self.stride, self.pad
        if H + 2 * p < k or W + 2 * p < k:
            raise ValueError(f"{self.describe()}: kernel larger than padded input {tuple(in_shape)}")
        return (self.out_channels, (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1)

    def forward(self, x: Any) -> Any:
        self.x = x
        return self.ops.conv2d_fprop(x, self.weight, self.bias, self.stride, self.pad, ws=self.ws)

    def backward(self, dy: Any) -> Any:
        ops = self.ops
        ops.conv2d_wgrad(dy, self.x, self.weight.shape, self.stride, self.pad, out=self.dweight, ws=self.ws)
        if self.has_bias:
            ops.bias_grad(dy, out=self.dbias)
        if not self.needs_dgrad:
            return None
        return ops.conv2d_dgrad(dy, self.weight, self.x.shape, self.stride, self.pad, ws=self.ws)

    def describe(self) -> str:
        nobias = "" if self.has_bias else ", no bias"
        return f"Conv2d({self.in_channels}->{self.out_channels}, k{self.kernel} s{self.stride} p{self.pad}{nobias})"


class ReLU(Layer):
    """Elementwise max(x, 0); any shape."""

    kind = "relu"
    cache = ("y",)

    def __init__(self, *, ops: Any = None) -> None:
        super().__init__(ops=ops)
        self.y = None  # cached forward output (its sign is the mask)

    def forward(self, x: Any) -> Any:
        self.y = self.ops.relu_fprop(x)
        return self.y

    def backward(self, dy: Any) -> Any:
        return self.ops.relu_bprop(dy, self.y) if self.needs_dgrad else None

    def describe(self) -> str:
        return "ReLU()"


class _Pool(Layer):
    def __init__(self, kernel: int, stride: int | None = None, pad: int = 0, ceil_mode: bool = False, *,
                 ops: Any = None) -> None:
        super().__init__(ops=ops)
        name = type(self).__name__
        stride = kernel if stride is None else stride
        self.kernel, self.stride, self.pad = _ints(name, kernel=(kernel, 1), stride=(stride, 1), pad=(pad, 0))
        self.ceil_mode = bool(ceil_mode)
        self.x_shape = None

    def out_shape(self, in_shape: Shape) -> Shape:
        C, H, W = _expect_planes(self, in_shape)
        P, Q = pool_output_size(self.describe(), (1, C, H, W), self.kernel, self.stride, self.pad, self.ceil_mode)
        return (C, P, Q)

    def _geometry(self) -> str:
        pad = f" p{self.pad}" if self.pad else ""
        return f"k{self.kernel} s{self.stride}{pad}{' ceil' if self.ceil_mode else ''}"


class MaxPool2d(_Pool):
    """Max pooling; kernel > stride gives overlapping pooling (Krizhevsky et al. 2012: kernel 3, stride 2).

    Input (N, C, H, W) -> (N, C, P, Q), P = `ops.contract.pool_output_size`: floor by default,
    cuda-convnet's ceil with ceil_mode=True. Padding never wins (it acts as -inf).
    """

    kind = "pool"
    cache = ("x_shape", "argmax")

    def __init__(self, kernel: int, stride: int | None = None, pad: int = 0, ceil_mode: bool = False, *,
                 ops: Any = None) -> None:
        super().__init__(kernel, stride, pad, ceil_mode, ops=ops)
        self.argmax = None  # cached by forward

    def config(self) -> dict[str, Any]:
        return dict(kernel=self.kernel, stride=self.stride, pad=self.pad, ceil_mode=self.ceil_mode)

    def forward(self, x: Any) -> Any:
        self.x_shape = x.shape
        if self.pad or self.ceil_mode:
            y, self.argmax = self.ops.maxpool_fprop(x, self.kernel, self.stride, self.pad, self.ceil_mode)
        else:
            y, self.argmax = self.ops.maxpool_fprop(x, self.kernel, self.stride)
        return y

    def backward(self, dy: Any) -> Any:
        if not self.needs_dgrad:
            return None
        if self.pad or self.ceil_mode:
            return self.ops.maxpool_bprop(dy, self.argmax, self.x_shape, self.kernel, self.stride, self.pad,
                                          self.ceil_mode)
        return self.ops.maxpool_bprop(dy, self.argmax, self.x_shape, self.kernel, self.stride)

    def describe(self) -> str:
        return f"MaxPool2d({self._geometry()})"


class AvgPool2d(_Pool):
    """Average pooling, torch.nn.AvgPool2d's semantics (see `ops.avgpool_fprop` for the divisor).

    Input (N, C, H, W) -> (N, C, P, Q), P as `MaxPool2d`. count_include_pad (default True, PyTorch's)
    counts padding in the divisor; cuda-convnet's `pool=avg` is ceil_mode=True, pad 0.
    """

    kind = "avgpool"
    cache = ("x_shape",)

    def __init__(self, kernel: int, stride: int | None = None, pad: int = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True, *, ops: Any = None) -> None:
        super().__init__(kernel, stride, pad, ceil_mode, ops=ops)
        self.count_include_pad = bool(count_include_pad)

    def config(self) -> dict[str, Any]:
        return dict(kernel=self.kernel, stride=self.stride, pad=self.pad, ceil_mode=self.ceil_mode,
                    count_include_pad=self.count_include_pad)

    def forward(self, x: Any) -> Any:
        self.x_shape = x.shape
        return self.ops.avgpool_fprop(x, self.kernel, self.stride, self.pad, self.ceil_mode, self.count_include_pad)

    def backward(self, dy: Any) -> Any:
        if not self.needs_dgrad:
            return None
        return self.ops.avgpool_bprop(dy, self.x_shape, self.kernel, self.stride, self.pad, self.ceil_mode,
                                      self.count_include_pad)

    def describe(self) -> str:
        return f"AvgPool2d({self._geometry()}{'' if self.count_include_pad else ' exclude-pad'})"


class GlobalAvgPool(Layer):
    """The mean over H and W: (N, C, H, W) -> (N, C) (the pooling before a ResNet's classifier)."""

    kind = "gap"
    cache = ("x_shape",)

    def __init__(self, *, ops: Any = None) -> None:
        super().__init__(ops=ops)
        self.x_shape = None

    def out_shape(self, in_shape: Shape) -> Shape:
        C, _, _ = _expect_planes(self, in_shape)
        return (C,)

    def forward(self, x: Any) -> Any:
        self.x_shape = x.shape
        return self.ops.global_avgpool_fprop(x)

    def backward(self, dy: Any) -> Any:
        return self.ops.global_avgpool_bprop(dy, self.x_shape) if self.needs_dgrad else None

    def describe(self) -> str:
        return "GlobalAvgPool()"


class Flatten(Layer):
    """(N, C, H, W) -> (N, C*H*W), a view; backward reshapes back."""

    kind = "flatten"
    cache = ("x_shape",)

    def __init__(self, *, ops: Any = None) -> None:
        super().__init__(ops=ops)
        self.x_shape = None

    def out_shape(self, in_shape: Shape) -> Shape:
        size = 1
        for d in in_shape:
            size *= d
        return (size,)

    def forward(self, x: Any) -> Any:
        self.x_shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy: Any) -> Any:
        return dy.reshape(self.x_shape) if self.needs_dgrad else None

    def describe(self) -> str:
        return "Flatten()"


class Linear(Layer):
    """Fully connected layer: (N, in_features) -> (N, out_features), y = x @ weight.T + bias.

    Parameters: weight (out_features, in_features), bias (out_features,) unless bias=False. Init and
    multipliers as `Conv2d` ("zeros" for a classifier that should start at ln(classes) loss).
    """

    kind = "fc"
    cache = ("x",)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, init: str = "he",
                 std: float | None = None, lr_mult: float = 1.0, decay_mult: float = 1.0, bias_lr_mult: float = 1.0,
                 bias_decay_mult: float = 0.0, ops: Any = None) -> None:
        super().__init__(ops=ops)
        in_features, out_features = _ints("Linear", in_features=(in_features, 1), out_features=(out_features, 1))
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bool(bias)
        self._weight = _weight("Linear", init, std, lr_mult, decay_mult, (out_features, in_features))
        self._bias = Param("bias", (out_features,), "zeros", 0.0, *_reals(
            "Linear", bias_lr_mult=(bias_lr_mult, 0.0, False), bias_decay_mult=(bias_decay_mult, 0.0, False)))
        self.weight = self.bias = self.dweight = self.dbias = None
        self.x = None  # cached forward input

    @property
    def fan_in(self) -> int:
        return self.in_features

    def params(self) -> list[Param]:
        return [self._weight, self._bias] if self.has_bias else [self._weight]

    def config(self) -> dict[str, Any]:
        w, b = self._weight, self._bias
        return dict(in_features=self.in_features, out_features=self.out_features, bias=self.has_bias, init=w.init,
                    std=w.std or None, lr_mult=w.lr_mult, decay_mult=w.decay_mult, bias_lr_mult=b.lr_mult,
                    bias_decay_mult=b.decay_mult)

    def bind(self, params: list[Any], grads: list[Any], buffers: list[Any] | tuple = ()) -> None:
        super().bind(params, grads, buffers)
        self.weight, self.dweight = params[0], grads[0]
        self.bias, self.dbias = (params[1], grads[1]) if self.has_bias else (None, None)

    def out_shape(self, in_shape: Shape) -> Shape:
        if tuple(in_shape) != (self.in_features,):
            raise ValueError(f"{self.describe()}: expects input ({self.in_features},), got {tuple(in_shape)}")
        return (self.out_features,)

    def forward(self, x: Any) -> Any:
        self.x = x
        if self.has_bias:
            return self.ops.linear_fprop(x, self.weight, self.bias)
        return self.ops.linear_fprop(x, self.weight, self._zero_bias())

    def _zero_bias(self) -> Any:
        if getattr(self, "_zeros", None) is None or self._zeros.dtype != self.weight.dtype:
            self._zeros = self.ops.zeros(self.out_features, self.weight.dtype)
        return self._zeros

    def backward(self, dy: Any) -> Any:
        ops = self.ops
        ops.linear_wgrad(dy, self.x, out=self.dweight)
        if self.has_bias:
            ops.bias_grad(dy, out=self.dbias)
        return ops.linear_dgrad(dy, self.weight) if self.needs_dgrad else None

    def describe(self) -> str:
        return f"Linear({self.in_features}->{self.out_features}{'' if self.has_bias else ', no bias'})"


class BatchNorm2d(Layer):
    """Batch normalisation over N, H, W per channel (Ioffe and Szegedy 2015, arXiv 1502.03167), as
    torch.nn.BatchNorm2d: eps 1e-5, momentum 0.1 in running <- (1 - momentum) * running + momentum * batch.

    Training: y = (x - mean) / sqrt(var + eps) * weight + bias with the minibatch's mean and biased
    variance; the running mean and unbiased variance (the buffers running_mean, init 0, and running_var,
    init 1) are updated unless `ctx.update_buffers` is False. Evaluation: the running statistics.
    Parameters weight (gamma, init 1) and bias (beta, init 0), both with `decay_mult` (default 0: no
    weight decay on normalisation parameters; FDG's ResNets decay them, see `resnet_cifar`).
    """

    kind = "bn"
    cache = ("x", "mean", "var")

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, *, decay_mult: float = 0.0,
                 lr_mult: float = 1.0, ops: Any = None) -> None:
        super().__init__(ops=ops)
        (num_features,) = _ints("BatchNorm2d", num_features=(num_features, 1))
        eps, momentum, decay_mult, lr_mult = _reals(
            "BatchNorm2d", eps=(eps, 0.0, True), momentum=(momentum, 0.0, False), decay_mult=(decay_mult, 0.0, False),
            lr_mult=(lr_mult, 0.0, False))
        if momentum > 1:
            raise ValueError(f"BatchNorm2d: momentum must be in [0, 1], got {momentum!r}")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.decay_mult, self.lr_mult = decay_mult, lr_mult
        self.weight = self.bias = self.dweight = self.dbias = self.running_mean = self.running_var = None
        self.x = self.mean = self.var = None  # cached by a training forward

    def params(self) -> list[Param]:
        C = (self.num_features,)
        return [Param("weight", C, "ones", 0.0, self.lr_mult, self.decay_mult),
                Param("bias", C, "zeros", 0.0, self.lr_mult, self.decay_mult)]

    def buffers(self) -> list[Buffer]:
        C = (self.num_features,)
        return [Buffer("running_mean", C, 0.0), Buffer("running_var", C, 1.0)]

    def config(self) -> dict[str, Any]:
        return dict(num_features=self.num_features, eps=self.eps, momentum=self.momentum, decay_mult=self.decay_mult,
                    lr_mult=self.lr_mult)

    def bind(self, params: list[Any], grads: list[Any], buffers: list[Any] | tuple = ()) -> None:
        super().bind(params, grads, buffers)
        self.weight, self.bias = params
        self.dweight, self.dbias = grads
        self.running_mean, self.running_var = buffers

    def out_shape(self, in_shape: Shape) -> Shape:
        shape = _expect_planes(self, in_shape, self.num_features)
        self.plane = shape[1] * shape[2]  # values per channel and image: N * plane per batch statistic
        return shape

    def forward(self, x: Any) -> Any:
        ops = self.ops
        if not self.training:
            return ops.batchnorm_fprop(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps)
        if x.shape[0] * x.shape[2] * x.shape[3] < 2:
            raise ValueError(f"{self.describe()}: training needs more than one value per channel, got input "
                             f"{tuple(x.shape)} (as torch.nn.BatchNorm2d); use a larger minibatch")
        if self.ctx.update_buffers:
            self.mean, self.var = ops.batchnorm_stats(x, self.running_mean, self.running_var, self.momentum)
        else:
            self.mean, self.var = ops.batchnorm_stats(x)
        self.x = x
        return ops.batchnorm_fprop(x, self.weight, self.bias, self.mean, self.var, self.eps)

    def backward(self, dy: Any) -> Any:
        return self.ops.batchnorm_bprop(dy, self.x, self.weight, self.mean, self.var, self.eps, self.dweight,
                                        self.dbias, self.needs_dgrad)

    def describe(self) -> str:
        return f"BatchNorm2d({self.num_features})"


class Dropout(Layer):
    """Inverted dropout (Srivastava et al. 2014): in training y = x * keep / (1 - p), keep ~ Bernoulli(1 - p);
    in evaluation y = x. The mask is drawn by a counter-based generator keyed by (ctx.seed,
    ctx.minibatch, this layer's index) and never stored (`ops.dropout_fprop`): backward and a recomputed
    forward of the same minibatch draw the same mask. Any input shape."""

    kind = "drop"
    cache = ("key",)

    def __init__(self, p: float = 0.5, *, ops: Any = None) -> None:
        super().__init__(ops=ops)
        (p,) = _reals("Dropout", p=(p, 0.0, False))
        if not p < 1:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p!r}")
        self.p = p
        self.key: tuple[int, int, int] | None = None  # (seed, minibatch, layer) of the last training forward

    def config(self) -> dict[str, Any]:
        return dict(p=self.p)

    def forward(self, x: Any) -> Any:
        if not self.training or self.p == 0:
            self.key = None
            return x
        self.key = (self.ctx.seed, self.ctx.minibatch, self.index)
        return self.ops.dropout_fprop(x, self.p, *self.key)

    def backward(self, dy: Any) -> Any:
        if not self.needs_dgrad:
            return None
        return dy if self.key is None else self.ops.dropout_bprop(dy, self.p, *self.key)

    def describe(self) -> str:
        return f"Dropout(p={self.p:g})"


class LocalResponseNorm(Layer):
    """Cross-map local response normalisation (Krizhevsky et al. 2012 section 3.3; cuda-convnet's `cmrnorm`):
    y = x / (k + alpha/size * sum of x^2 over `size` neighbouring channels)^beta, torch's formula (see
    `ops.lrn_fprop`; cuda-convnet's `scale` is alpha/size). AlexNet: size 5, alpha 1e-4, beta 0.75, k 2."""

    kind = "lrn"
    cache = ("x", "y", "scale")

    def __init__(self, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0, *, ops: Any = None) -> None:
        super().__init__(ops=ops)
        (size,) = _ints("LocalResponseNorm", size=(size, 1))
        alpha, beta, k = _reals("LocalResponseNorm", alpha=(alpha, 0.0, False), beta=(beta, -math.inf, False),
                                k=(k, 0.0, True))
        self.size, self.alpha, self.beta, self.k = size, alpha, beta, k
        self.x = self.y = self.scale = None

    def config(self) -> dict[str, Any]:
        return dict(size=self.size, alpha=self.alpha, beta=self.beta, k=self.k)

    def out_shape(self, in_shape: Shape) -> Shape:
        return _expect_planes(self, in_shape)

    def forward(self, x: Any) -> Any:
        self.x = x
        self.y, self.scale = self.ops.lrn_fprop(x, self.size, self.alpha, self.beta, self.k)
        return self.y

    def backward(self, dy: Any) -> Any:
        if not self.needs_dgrad:
            return None
        return self.ops.lrn_bprop(dy, self.x, self.y, self.scale, self.size, self.alpha, self.beta)

    def describe(self) -> str:
        return f"LocalResponseNorm({self.size}, alpha={self.alpha:g}, beta={self.beta:g}, k={self.k:g})"


class SubsamplePad(Layer):
    """The option-A shortcut (He et al. 2016, arXiv 1512.03385 section 4.2; FDG's ResNet_cifar.py `LambdaLayer`):
    x[:, :, ::stride, ::stride] with zero channels added, half before and half after (the extra one after):
    (N, in_channels, H, W) -> (N, out_channels, ceil(H/stride), ceil(W/stride)). No parameters."""

    kind = "pad"
    cache = ("x_shape",)

    def __init__(self, in_channels: int, out_channels: int, stride: int = 2, *, ops: Any = None) -> None:
        super().__init__(ops=ops)
        in_channels, out_channels, stride = _ints("SubsamplePad", in_channels=(in_channels, 1),
                                                  out_channels=(out_channels, 1), stride=(stride, 1))
        if out_channels < in_channels:
            raise ValueError(f"SubsamplePad: need out_channels >= in_channels, got {in_channels}->{out_channels}")
        self.in_channels, self.out_channels, self.stride = in_channels, out_channels, stride
        self.before = (out_channels - in_channels) // 2
        self.after = out_channels - in_channels - self.before
        self.x_shape = None

    def config(self) -> dict[str, Any]:
        return dict(in_channels=self.in_channels, out_channels=self.out_channels, stride=self.stride)

    def out_shape(self, in_shape: Shape) -> Shape:
        _, H, W = _expect_planes(self, in_shape, self.in_channels)
        s = self.stride
        return (self.out_channels, -(-H // s), -(-W // s))

    def forward(self, x: Any) -> Any:
        self.x_shape = x.shape
        return self.ops.subsample_pad_fprop(x, self.stride, self.before, self.after)

    def backward(self, dy: Any) -> Any:
        if not self.needs_dgrad:
            return None
        return self.ops.subsample_pad_bprop(dy, self.x_shape, self.stride, self.before, self.after)

    def describe(self) -> str:
        return f"SubsamplePad({self.in_channels}->{self.out_channels}, s{self.stride})"


@dataclass
class _Branch:
    """A chain of layers inside a block, with the names the block gives them."""

    layers: list[Layer]
    names: list[str] = field(default_factory=list)


class Residual(Layer):
    """A residual block, one layer of the model (pipeline cuts fall between blocks, never inside one):

        y = after(main(x) + shortcut(x))

    `main` and `after` are lists of layers; `shortcut` a list (e.g. [SubsamplePad] for option A, or
    [Conv2d 1x1 no bias, BatchNorm2d] for a projection) or empty for the identity. Parameter and buffer
    names are prefixed with the block's: "res3.conv1.weight", "res3.shortcut.bn1.running_mean" (the
    layers of `after` are numbered on with main's). Raises ValueError (at model construction) when the
    two branches' output shapes differ.
    """

    kind = "res"

    def __init__(self, main: list[Layer], shortcut: list[Layer] | None = None, after: list[Layer] | None = None,
                 *, ops: Any = None) -> None:
        super().__init__(ops=ops)
        if not main:
            raise ValueError("Residual: main must hold at least one layer")
        for what, group in (("main", main), ("shortcut", shortcut or []), ("after", after or [])):
            bad = [type(layer).__name__ for layer in group if not isinstance(layer, Layer)]
            if bad:
                raise ValueError(f"Residual: {what} must hold layers, got {', '.join(bad)}")
        self.main, self.shortcut, self.after = list(main), list(shortcut or []), list(after or [])
        counts: dict[str, int] = {}
        self.child_names: list[str] = []
        for layer in self.main:
            self.child_names.append(_count(counts, layer.kind))
        shortcut_counts: dict[str, int] = {}
        shortcut_names = [f"shortcut.{_count(shortcut_counts, layer.kind)}" for layer in self.shortcut]
        after_names = [_count(counts, layer.kind) for layer in self.after]
        self.child_names = self.child_names + shortcut_names + after_names
        self.needs_dgrad = True
        if ops is not None:
            self.set_ops(ops)

    @property
    def needs_dgrad(self) -> bool:
        return self._needs_dgrad

    @needs_dgrad.setter
    def needs_dgrad(self, value: bool) -> None:
        self._needs_dgrad = value
        for group in (getattr(self, "main", ()), getattr(self, "shortcut", ())):
            if group:
                group[0].needs_dgrad = value

    def children(self) -> list[Layer]:
        return [*self.main, *self.shortcut, *self.after]

    def named_children(self) -> list[tuple[str, Layer]]:
        return list(zip(self.child_names, self.children(), strict=True))

    @property
    def fan_in(self) -> int:
        return 0

    def params(self) -> list[Param]:
        return [Param(f"{name}.{p.name}", p.shape, p.init, p.std, p.lr_mult, p.decay_mult)
                for name, layer in self.named_children() for p in layer.params()]

    def buffers(self) -> list[Buffer]:
        return [Buffer(f"{name}.{b.name}", b.shape, b.fill) for name, layer in self.named_children()
                for b in layer.buffers()]

    def param_fan_ins(self) -> list[int]:
        return [fan_in for layer in self.children() for fan_in in layer.param_fan_ins()]

    def flops(self, in_shape: Shape) -> int:
        total = 0
        after_in = _chain(self.main, in_shape)
        for group, shape in ((self.main, in_shape), (self.shortcut, in_shape), (self.after, after_in)):
            for layer in group:
                total += layer.flops(shape)
                shape = layer.out_shape(shape)
        return total

    def config(self) -> dict[str, Any]:
        return dict(main=[layer_spec(x) for x in self.main], shortcut=[layer_spec(x) for x in self.shortcut],
                    after=[layer_spec(x) for x in self.after])

    def bind(self, params: list[Any], grads: list[Any], buffers: list[Any] | tuple = ()) -> None:
        super().bind(params, grads, buffers)
        p = b = 0
        for layer in self.children():
            n, m = len(layer.params()), len(layer.buffers())
            layer.bind(params[p:p + n], grads[p:p + n], list(buffers[b:b + m]))
            p, b = p + n, b + m

    def out_shape(self, in_shape: Shape) -> Shape:
        main = _chain(self.main, in_shape)
        short = _chain(self.shortcut, in_shape)
        if main != short:
            raise ValueError(f"{self.describe()}: the main branch gives {main}, the shortcut {short} for input "
                             f"{tuple(in_shape)}; they must match to be added")
        return _chain(self.after, main)

    def forward(self, x: Any) -> Any:
        h = x
        for layer in self.main:
            h = layer.forward(h)
        s = x
        for layer in self.shortcut:
            s = layer.forward(s)
        y = self.ops.add(h, s)
        for layer in self.after:
            y = layer.forward(y)
        return y

    def backward(self, dy: Any) -> Any:
        for layer in reversed(self.after):
            dy = layer.backward(dy)
        dmain = dy
        for layer in reversed(self.main):
            dmain = layer.backward(dmain)
        dshort = dy
        for layer in reversed(self.shortcut):
            dshort = layer.backward(dshort)
        if not self.needs_dgrad:
            return None
        return self.ops.add(dmain, dshort)

    def describe(self) -> str:
        first = self.main[0].describe()
        short = " ".join(layer.describe() for layer in self.shortcut) or "identity"
        return f"Residual({first}+{len(self.main) - 1 + len(self.after)} | {short})"


def _count(counts: dict[str, int], kind: str) -> str:
    counts[kind] = counts.get(kind, 0) + 1
    return f"{kind}{counts[kind]}"


def _chain(layers: list[Layer], shape: Shape) -> Shape:
    for layer in layers:
        shape = tuple(int(d) for d in layer.out_shape(shape))
    return shape


class SoftmaxCrossEntropy:
    """Softmax cross-entropy loss, mean over the minibatch (not a layer of the sequence).

    forward(logits (N, K), labels (N,) int) -> (loss: float, correct: int);
    forward_deferred(logits, labels) -> LossStats (the same values, read later: `ops.softmax_xent_deferred`);
    backward() -> dlogits (N, K) = (softmax - onehot) / N, computed during forward.
    """

    def __init__(self, *, ops: Any = None) -> None:
        self.ops = ops
        self.dlogits = None

    def forward(self, logits: Any, labels: Any) -> tuple[float, int]:
        loss, self.dlogits, correct = self.ops.softmax_xent(logits, labels)
        return loss, correct

    def forward_deferred(self, logits: Any, labels: Any) -> LossStats:
        stats, self.dlogits = self.ops.softmax_xent_deferred(logits, labels)
        return stats

    def backward(self) -> Any:
        return self.dlogits


def walk(layers: list[Layer]) -> list[Layer]:
    """Every layer of `layers` and, depth first, of their children, in execution order."""
    out: list[Layer] = []
    for layer in layers:
        out.append(layer)
        out.extend(walk(layer.children()))
    return out


LAYER_TYPES: dict[str, type[Layer]] = {cls.__name__: cls for cls in (
    Conv2d, ReLU, MaxPool2d, AvgPool2d, GlobalAvgPool, Flatten, Linear, BatchNorm2d, Dropout, LocalResponseNorm,
    SubsamplePad, Residual)}


def layer_spec(layer: Layer) -> dict[str, Any]:
    """{"type": class name, **layer.config()}; ModelSpecError for a layer class that is not built in (a user's
    own Layer subclass cannot be stored as data)."""
    name = type(layer).__name__
    if LAYER_TYPES.get(name) is not type(layer):
        raise ModelSpecError(f"layer {layer.describe()} is a {type(layer).__module__}.{name}, not one of mpiasgd's "
                             f"layer types ({', '.join(LAYER_TYPES)}): a network must be made of them to be "
                             "stored in the run log and rebuilt from it")
    return {"type": name, **{key: _plain(value) for key, value in layer.config().items()}}


def _plain(value: Any) -> Any:
    """A config value as plain JSON data: numpy scalars as Python numbers (a user's np.int64 channel count)."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value
