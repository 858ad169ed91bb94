"""CNN layers over an `ops` backend: Conv2d, ReLU, MaxPool2d, Flatten, Linear, SoftmaxCrossEntropy.

A layer owns no parameter memory: `bind` hands it views into the model's flat parameter and
gradient vectors (see `mpiasgd.model.Model`). `forward` caches what `backward` needs; `backward`
overwrites (never accumulates) the bound gradient views and returns the input gradient, or None
when `needs_dgrad` is False (the model sets that on its first layer: nothing consumes it).
Layers call only `ops`; they never import numpy or cupy for math.

Shapes: activations are NCHW (N, C, H, W) for conv/pool/relu and (N, F) after Flatten;
`out_shape` works on per-sample shapes without N.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

Shape = tuple[int, ...]


class Layer:
    """Base class: a layer without parameters. Subclasses override what they need."""

    kind = "layer"  # short name prefix for logs: conv, relu, pool, flatten, fc

    def __init__(self, *, ops: ModuleType) -> None:
        self.ops = ops
        self.needs_dgrad = True  # False on the first layer: its input gradient is never used

    @property
    def fan_in(self) -> int:
        """Inputs feeding one output unit (for He initialisation); 0 without weights."""
        return 0

    def param_shapes(self) -> list[tuple[str, Shape]]:
        """[(name, shape)] of this layer's parameters, in the order `bind` expects them."""
        return []

    def bind(self, params: list[Any], grads: list[Any]) -> None:
        """Attach views into the model's flat vectors, one per `param_shapes()` entry."""
        expected = [shape for _, shape in self.param_shapes()]
        for what, arrays in (("params", params), ("grads", grads)):
            got = [tuple(a.shape) for a in arrays]
            if got != expected:
                raise ValueError(f"{type(self).__name__}.bind: {what} must have shapes {expected}, got {got}")

    def out_shape(self, in_shape: Shape) -> Shape:
        """Per-sample output shape for per-sample input shape `in_shape`."""
        return tuple(in_shape)

    def forward(self, x: Any) -> Any:
        raise NotImplementedError

    def backward(self, dy: Any) -> Any:
        raise NotImplementedError

    def describe(self) -> str:
        """Short constructor-like description, e.g. 'Conv2d(3->32, k5 s1 p2)'."""
        return f"{type(self).__name__}()"


class Conv2d(Layer):
    """2-D convolution with bias, square kernel. Input (N, C, H, W) -> (N, K, P, Q).

    Parameters: weight (K, C, k, k), bias (K,). P = (H + 2*pad - k)//stride + 1.
    """

    kind = "conv"

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int = 1, pad: int = 0,
                 *, ops: ModuleType) -> None:
        super().__init__(ops=ops)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel, self.stride, self.pad = kernel, stride, pad
        self.weight = self.bias = self.dweight = self.dbias = None
        self.x = None  # cached forward input
        self.ws = ops.Workspace()  # scratch kept between minibatches (and the im2col columns)

    @property
    def fan_in(self) -> int:
        return self.in_channels * self.kernel * self.kernel

    def param_shapes(self) -> list[tuple[str, Shape]]:
        k = self.kernel
        return [("weight", (self.out_channels, self.in_channels, k, k)), ("bias", (self.out_channels,))]

    def bind(self, params: list[Any], grads: list[Any]) -> None:
        super().bind(params, grads)
        self.weight, self.bias = params
        self.dweight, self.dbias = grads

    def out_shape(self, in_shape: Shape) -> Shape:
        C, H, W = in_shape
        if C != self.in_channels:
            raise ValueError(f"{self.describe()}: expects {self.in_channels} input channels, got {in_shape}")
        k, s, p = self.kernel, self.stride, self.pad
        if H + 2 * p < k or W + 2 * p < k:
            raise ValueError(f"{self.describe()}: kernel larger than padded input {in_shape}")
        return (self.out_channels, (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1)

    def forward(self, x: Any) -> Any:
        self.x = x
        return self.ops.conv2d_fprop(x, self.weight, self.bias, self.stride, self.pad, ws=self.ws)

    def backward(self, dy: Any) -> Any:
        ops = self.ops
        ops.conv2d_wgrad(dy, self.x, self.weight.shape, self.stride, self.pad, out=self.dweight, ws=self.ws)
        ops.bias_grad(dy, out=self.dbias)
        if not self.needs_dgrad:
            return None
        return ops.conv2d_dgrad(dy, self.weight, self.x.shape, self.stride, self.pad, ws=self.ws)

    def describe(self) -> str:
        return f"Conv2d({self.in_channels}->{self.out_channels}, k{self.kernel} s{self.stride} p{self.pad})"


class ReLU(Layer):
    """Elementwise max(x, 0); any shape."""

    kind = "relu"

    def __init__(self, *, ops: ModuleType) -> None:
        super().__init__(ops=ops)
        self.y = None  # cached forward output (its sign is the mask)

    def forward(self, x: Any) -> Any:
        self.y = self.ops.relu_fprop(x)
        return self.y

    def backward(self, dy: Any) -> Any:
        return self.ops.relu_bprop(dy, self.y) if self.needs_dgrad else None

    def describe(self) -> str:
        return "ReLU()"


class MaxPool2d(Layer):
    """Max pooling without padding, floor output size; kernel > stride gives overlapping pooling.

    Input (N, C, H, W) -> (N, C, (H - kernel)//stride + 1, (W - kernel)//stride + 1).
    """

    kind = "pool"

    def __init__(self, kernel: int, stride: int, *, ops: ModuleType) -> None:
        super().__init__(ops=ops)
        self.kernel, self.stride = kernel, stride
        self.argmax = self.x_shape = None  # cached by forward

    def out_shape(self, in_shape: Shape) -> Shape:
        C, H, W = in_shape
        if H < self.kernel or W < self.kernel:
            raise ValueError(f"{self.describe()}: kernel larger than input {in_shape}")
        return (C, (H - self.kernel) // self.stride + 1, (W - self.kernel) // self.stride + 1)

    def forward(self, x: Any) -> Any:
        self.x_shape = x.shape
        y, self.argmax = self.ops.maxpool_fprop(x, self.kernel, self.stride)
        return y

    def backward(self, dy: Any) -> Any:
        if not self.needs_dgrad:
            return None
        return self.ops.maxpool_bprop(dy, self.argmax, self.x_shape, self.kernel, self.stride)

    def describe(self) -> str:
        return f"MaxPool2d(k{self.kernel} s{self.stride})"


class Flatten(Layer):
    """(N, C, H, W) -> (N, C*H*W), a view; backward reshapes back."""

    kind = "flatten"

    def __init__(self, *, ops: ModuleType) -> None:
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

    Parameters: weight (out_features, in_features), bias (out_features,).
    """

    kind = "fc"

    def __init__(self, in_features: int, out_features: int, *, ops: ModuleType) -> None:
        super().__init__(ops=ops)
        self.in_features, self.out_features = in_features, out_features
        self.weight = self.bias = self.dweight = self.dbias = None
        self.x = None  # cached forward input

    @property
    def fan_in(self) -> int:
        return self.in_features

    def param_shapes(self) -> list[tuple[str, Shape]]:
        return [("weight", (self.out_features, self.in_features)), ("bias", (self.out_features,))]

    def bind(self, params: list[Any], grads: list[Any]) -> None:
        super().bind(params, grads)
        self.weight, self.bias = params
        self.dweight, self.dbias = grads

    def out_shape(self, in_shape: Shape) -> Shape:
        if tuple(in_shape) != (self.in_features,):
            raise ValueError(f"{self.describe()}: expects input ({self.in_features},), got {in_shape}")
        return (self.out_features,)

    def forward(self, x: Any) -> Any:
        self.x = x
        return self.ops.linear_fprop(x, self.weight, self.bias)

    def backward(self, dy: Any) -> Any:
        ops = self.ops
        ops.linear_wgrad(dy, self.x, out=self.dweight)
        ops.bias_grad(dy, out=self.dbias)
        return ops.linear_dgrad(dy, self.weight) if self.needs_dgrad else None

    def describe(self) -> str:
        return f"Linear({self.in_features}->{self.out_features})"


class SoftmaxCrossEntropy:
    """Softmax cross-entropy loss, mean over the minibatch (not a layer of the sequence).

    forward(logits (N, K), labels (N,) int) -> (loss: float, correct: int);
    backward() -> dlogits (N, K) = (softmax - onehot) / N, computed during forward.
    """

    def __init__(self, *, ops: ModuleType) -> None:
        self.ops = ops
        self.dlogits = None

    def forward(self, logits: Any, labels: Any) -> tuple[float, int]:
        loss, self.dlogits, correct = self.ops.softmax_xent(logits, labels)
        return loss, correct

    def backward(self) -> Any:
        return self.dlogits
