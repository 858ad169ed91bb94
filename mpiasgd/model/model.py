"""Sequential CNN over ONE flat float32 parameter vector.

All parameters live in one contiguous vector (and all gradients in another) so that a push or a
pull is a single MPI buffer: `Model.bind(params, grads)` hands every layer views into the two
vectors, so MPI can receive weights straight into `params` and send `grads` without packing.

    model = build_model("cifar10")                   # numpy backend (mpiasgd.model.registry)
    params = model.init_params(seed=0)               # (num_params,) float32, He init
    grads = np.empty_like(params)
    model.bind(params, grads)
    loss, correct = model.forward_backward(x, y)     # grads now hold d(mean loss)/d(params)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np  # host side only: initialisation and masks; compute goes through `ops`

from mpiasgd.model.layers import Layer, Shape, SoftmaxCrossEntropy


class Model:
    """A sequence of layers followed by softmax cross-entropy, parameters in one flat vector.

    Attributes: name, input_shape (C, H, W), num_classes, num_params, params / grads (the bound
    flat vectors, None before `bind`), layers, names (e.g. "conv1"), shapes (per-layer outputs).
    `dtype` is float32; float64 exists only for finite-difference tests.
    """

    def __init__(self, name: str, input_shape: Shape, layers: list[Layer], ops: ModuleType,
                 dtype: Any = np.float32) -> None:
        if not layers:
            raise ValueError(f"model {name!r} has no layers")
        self.name, self.input_shape, self.layers, self.ops = name, tuple(input_shape), layers, ops
        self.dtype = np.dtype(dtype)
        self.loss = SoftmaxCrossEntropy(ops=ops)
        layers[0].needs_dgrad = False  # nothing consumes the gradient w.r.t. the input images
        # derive names, per-layer output shapes and the flat layout (shape arithmetic only)
        counts: dict[str, int] = {}
        self.names: list[str] = []
        self.shapes: list[Shape] = []
        self._layout: list[tuple[str, int, Shape]] = []
        self._slots: list[list[tuple[int, Shape]]] = []  # per layer: (offset, shape) of its params
        shape, offset = self.input_shape, 0
        for layer in layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
            lname = f"{layer.kind}{counts[layer.kind]}"
            shape = tuple(int(d) for d in layer.out_shape(shape))
            slots = []
            for pname, pshape in layer.param_shapes():
                pshape = tuple(int(d) for d in pshape)
                self._layout.append((f"{lname}.{pname}", offset, pshape))
                slots.append((offset, pshape))
                offset += _size(pshape)
            self.names.append(lname)
            self.shapes.append(shape)
            self._slots.append(slots)
        if len(shape) != 1:
            raise ValueError(f"model {name!r} must end in (num_classes,) logits, ends in {shape}")
        self.num_classes = shape[0]
        self.num_params = offset
        self.params = self.grads = None

    # ------------------------------------------------------------------------------------------
    # parameters

    def layout(self) -> list[tuple[str, int, Shape]]:
        """[(parameter name like "conv1.weight", offset into the flat vector, shape)], in order."""
        return list(self._layout)

    def init_params(self, seed: int) -> np.ndarray:
        """Fresh host float32 (num_params,) vector: He/Kaiming normal weights, zero biases, zero classifier.

        Weights ~ N(0, 2/fan_in) (He et al. 2015, for ReLU nets), fan_in = C*k*k for conv and
        in_features for linear layers; drawn in layout order from np.random.default_rng(seed),
        so the same seed always gives the same vector. The last layer (the classifier, followed by
        softmax, not ReLU) starts at zero, as the zero-initialised head of Dosovitskiy et al. 2021:
        the first loss is exactly ln(num_classes) instead of the ~9 that He-scaled logits give
        after max-pooling, which keeps the first asynchronous steps stable.
        """
        rng = np.random.default_rng(seed)
        params = np.zeros(self.num_params, dtype=np.float32)
        classifier = max(i for i, layer in enumerate(self.layers) if layer.param_shapes())
        for i, (layer, slots) in enumerate(zip(self.layers, self._slots, strict=True)):
            for (pname, _), (offset, shape) in zip(layer.param_shapes(), slots, strict=True):
                if pname == "weight" and i != classifier:
                    size = _size(shape)
                    std = np.sqrt(2.0 / layer.fan_in)
                    params[offset:offset + size] = rng.standard_normal(size) * std
        return params

    def decay_mask(self) -> np.ndarray:
        """Host float32 (num_params,): 1.0 on conv/linear weights, 0.0 on biases (no decay there)."""
        mask = np.zeros(self.num_params, dtype=np.float32)
        for pname, offset, shape in self._layout:
            if pname.endswith(".weight"):
                mask[offset:offset + _size(shape)] = 1.0
        return mask

    def bind(self, params: Any, grads: Any) -> None:
        """Make every layer hold views into `params` and `grads` (no copies).

        Both must be 1-D, C-contiguous, of length num_params and dtype float32, distinct and not
        overlapping, arrays of this model's backend. Writing `params` (an MPI receive, an
        optimizer step) changes the layer weights; `forward_backward` overwrites `grads`.
        Raises ValueError naming the array and what was expected.
        """
        expected = f"a 1-D C-contiguous {self.dtype} {self.ops.ndarray.__module__}.ndarray of length {self.num_params}"
        for what, a in (("params", params), ("grads", grads)):
            if not isinstance(a, self.ops.ndarray):
                raise ValueError(f"Model.bind: {what} must be {expected}, got {type(a).__name__}")
            if a.ndim != 1 or a.shape[0] != self.num_params:
                raise ValueError(f"Model.bind: {what} must be {expected}, got shape {a.shape}")
            if a.dtype != self.dtype:
                raise ValueError(f"Model.bind: {what} must be {expected}, got dtype {a.dtype}")
            if not a.flags.c_contiguous:
                raise ValueError(f"Model.bind: {what} must be {expected}, got a non-contiguous array")
        if self.ops.may_share_memory(params, grads):
            raise ValueError("Model.bind: params and grads must be separate, non-overlapping arrays")
        for layer, slots in zip(self.layers, self._slots, strict=True):
            # basic slicing + reshape of a contiguous vector: views, never copies
            layer.bind([params[o:o + _size(s)].reshape(s) for o, s in slots],
                       [grads[o:o + _size(s)].reshape(s) for o, s in slots])
        self.params, self.grads = params, grads

    def param_range(self, first: int, last: int) -> tuple[int, int]:
        """[start, stop) of the flat parameter vector that holds the parameters of layers first..last-1.

        Layers own consecutive ranges in layer order, so any run of layers (a pipeline module) owns
        one contiguous slice. Raises ValueError unless 0 <= first < last <= len(layers).
        """
        if not 0 <= first < last <= len(self.layers):
            raise ValueError(f"Model.param_range: need 0 <= first < last <= {len(self.layers)}, got {first}, {last}")
        start = next((s[0][0] for s in self._slots[first:last] if s), None)
        if start is None:  # no parameters in these layers: an empty range where the next ones start
            start = next((s[0][0] for s in self._slots[last:] if s), self.num_params)
            return start, start
        stop = max(o + _size(shape) for s in self._slots[first:last] for o, shape in s)
        return start, stop

    def bind_layers(self, first: int, last: int, params: Any, grads: Any) -> None:
        """Bind layers first..last-1 to views into `params` and `grads`, which hold just their slice.

        Both are 1-D float32 arrays of length stop - start (see `param_range`); a pipeline module
        keeps only its own parameters. Raises ValueError on a wrong length.
        """
        start, stop = self.param_range(first, last)
        for what, a in (("params", params), ("grads", grads)):
            if a.ndim != 1 or a.shape[0] != stop - start:
                raise ValueError(f"Model.bind_layers: {what} must have shape ({stop - start},), got {a.shape}")
        for layer, slots in zip(self.layers[first:last], self._slots[first:last], strict=True):
            layer.bind([params[o - start:o - start + _size(s)].reshape(s) for o, s in slots],
                       [grads[o - start:o - start + _size(s)].reshape(s) for o, s in slots])

    def layer_flops(self) -> list[int]:
        """Multiply-adds x 2 of each layer's forward pass for one sample (conv and linear; 0 for the rest)."""
        flops = []
        for layer, out in zip(self.layers, self.shapes, strict=True):
            weights = sum(_size(s) for name, s in layer.param_shapes() if name == "weight")
            spatial = _size(out[1:]) if len(out) == 3 else 1
            flops.append(2 * weights * spatial)
        return flops

    # ------------------------------------------------------------------------------------------
    # compute

    def _check_batch(self, op: str, x: Any, y: Any) -> None:
        if self.params is None:
            raise RuntimeError(f"Model.{op}: call bind(params, grads) first")
        shape = getattr(x, "shape", None)
        if shape is None or tuple(shape[1:]) != self.input_shape or getattr(x, "dtype", None) != self.dtype:
            expected = ", ".join(str(d) for d in self.input_shape)
            raise ValueError(f"Model.{op}: x must be {self.dtype} of shape (N, {expected}), "
                             f"got {shape} {getattr(x, 'dtype', type(x).__name__)}")
        if getattr(y, "shape", None) != (shape[0],):
            raise ValueError(f"Model.{op}: y must be integer labels of shape ({shape[0]},), "
                             f"got {getattr(y, 'shape', type(y).__name__)}")

    def forward_backward(self, x: Any, y: Any) -> tuple[float, int]:
        """One minibatch: x (N, C, H, W) float32, y (N,) int labels -> (mean loss, number correct).

        Overwrites `grads` with d(mean loss)/d(params). Raises RuntimeError before `bind`,
        ValueError on wrong shapes/dtypes or out-of-range labels.
        """
        self._check_batch("forward_backward", x, y)
        h = x
        for layer in self.layers:
            h = layer.forward(h)
        loss, correct = self.loss.forward(h, y)
        d = self.loss.backward()
        for layer in reversed(self.layers):
            d = layer.backward(d)
        return loss, correct

    def evaluate(self, x: Any, y: Any, batch_size: int = 1000) -> tuple[float, int]:
        """Forward only, in chunks of `batch_size`: (summed loss over samples, number correct).

        Memory grows with batch_size: the numpy backend keeps ~2.8 MB of conv scratch per cifar10
        sample (about 1.4 GB of forward-only scratch at 1000; 256 is plenty fast on a CPU).
        """
        self._check_batch("evaluate", x, y)
        if batch_size < 1:
            raise ValueError(f"Model.evaluate: batch_size must be >= 1, got {batch_size}")
        loss_sum, correct = 0.0, 0
        for start in range(0, x.shape[0], batch_size):
            h = x[start:start + batch_size]
            for layer in self.layers:
                h = layer.forward(h)
            loss, batch_correct = self.loss.forward(h, y[start:start + batch_size])
            loss_sum += loss * h.shape[0]
            correct += batch_correct
        return loss_sum, correct

    def describe(self) -> str:
        """One line per layer: name, layer, output shape, parameter count; then the total."""
        lines = [f"{self.name}: input {self.input_shape}"]
        for lname, layer, shape in zip(self.names, self.layers, self.shapes, strict=True):
            count = sum(_size(s) for _, s in layer.param_shapes())
            lines.append(f"  {lname:<9} {layer.describe():<26} -> {shape!s:<14} {count:>9,} params")
        lines.append(f"  total {self.num_params:,} parameters")
        return "\n".join(lines)


def _size(shape: Shape) -> int:
    size = 1
    for d in shape:
        size *= d
    return size
