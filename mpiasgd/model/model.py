"""A CNN as a sequence of layers (a residual block is one) over ONE flat float32 parameter vector.

All parameters live in one contiguous vector (and all gradients in another) so that a push or a
pull is a single MPI buffer: `Model.bind(params, grads)` hands every layer views into the two
vectors, so MPI can receive weights straight into `params` and send `grads` without packing. The
layers' buffers (BatchNorm's running statistics) live in a third flat vector, `buffers`, which
snapshots and checkpoints carry next to the weights.

    model = build_model("cifar10")                   # numpy backend (mpiasgd.model.registry)
    params = model.init_params(seed=0)               # (num_params,) float32, He init
    grads = np.empty_like(params)
    model.bind(params, grads)
    loss, correct = model.forward_backward(x, y)     # grads now hold d(mean loss)/d(params)
"""

from __future__ import annotations

from typing import Any

import numpy as np  # host side only: initialisation and masks; compute goes through `ops`

from mpiasgd.model.definition import model_spec
from mpiasgd.model.layers import MAX_EXTENT, Context, Layer, Param, Shape, SoftmaxCrossEntropy, walk
from mpiasgd.ops.protocol import LossStats


class Model:
    """A sequence of layers followed by softmax cross-entropy; parameters in one flat vector, buffers in another.

    Attributes: name, input_shape (C, H, W), num_classes, num_params, num_buffers, params / grads /
    buffers (the bound flat vectors, None before `bind`), layers (top level: a residual block is one),
    names (e.g. "conv1", "res2"), shapes (per-layer outputs), ctx (the `Context` its layers read).
    `dtype` is float32; float64 exists only for finite-difference tests. `ops` is the backend every
    layer runs on (layers built without one get it here). Raises ValueError naming the layer and the
    shapes when a layer does not fit its input.
    """

    def __init__(self, name: str, input_shape: Shape, layers: list[Layer], ops: Any,
                 dtype: Any = np.float32) -> None:
        if not layers:
            raise ValueError(f"model {name!r} has no layers")
        self.name, self.input_shape, self.layers, self.ops = name, tuple(input_shape), list(layers), ops
        self.dtype = np.dtype(dtype)
        self.loss = SoftmaxCrossEntropy(ops=ops)
        self.ctx = Context()
        for index, layer in enumerate(walk(self.layers)):
            if layer.ops is not ops:
                layer.set_ops(ops)
            layer.ctx, layer.index = self.ctx, index
        layers[0].needs_dgrad = False  # nothing consumes the gradient w.r.t. the input images
        # derive names, per-layer output shapes and the flat layouts (shape arithmetic only)
        counts: dict[str, int] = {}
        self.names: list[str] = []
        self.shapes: list[Shape] = []
        self._layout: list[tuple[str, int, Shape]] = []
        self._decl: list[tuple[Param, int]] = []  # per parameter: its declaration and fan-in
        self._slots: list[list[tuple[int, Shape]]] = []  # per layer: (offset, shape) of its params
        self._buffer_layout: list[tuple[str, int, Shape]] = []
        self._fills: list[float] = []
        self._buffer_slots: list[list[tuple[int, Shape]]] = []
        shape, offset, boffset = self.input_shape, 0, 0
        for layer in self.layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
            lname = f"{layer.kind}{counts[layer.kind]}"
            try:
                shape = tuple(int(d) for d in layer.out_shape(shape))
            except ValueError as e:
                raise ValueError(f"model {name!r}, layer {lname}: {e}") from None
            if _size(shape) > MAX_EXTENT:
                raise ValueError(f"model {name!r}, layer {lname}: its output {shape} holds {_size(shape):,} values "
                                 f"per image, more than {MAX_EXTENT:,} (the kernels index within one image with 32-bit "
                                 "ints; the memory would not be there either)")
            fan_ins = layer.param_fan_ins()
            slots = []
            for p, fan_in in zip(layer.params(), fan_ins, strict=True):
                pshape = tuple(int(d) for d in p.shape)
                self._layout.append((f"{lname}.{p.name}", offset, pshape))
                self._decl.append((p, fan_in))
                slots.append((offset, pshape))
                offset += _size(pshape)
            bslots = []
            for b in layer.buffers():
                bshape = tuple(int(d) for d in b.shape)
                self._buffer_layout.append((f"{lname}.{b.name}", boffset, bshape))
                self._fills.append(float(b.fill))
                bslots.append((boffset, bshape))
                boffset += _size(bshape)
            self.names.append(lname)
            self.shapes.append(shape)
            self._slots.append(slots)
            self._buffer_slots.append(bslots)
        if len(shape) != 1:
            raise ValueError(f"model {name!r} must end in (num_classes,) logits, ends in {shape}")
        self.num_classes = shape[0]
        self.num_params = offset
        self.num_buffers = boffset
        self.params = self.grads = self.buffers = None

    # ------------------------------------------------------------------------------------------
    # parameters and buffers

    def layout(self) -> list[tuple[str, int, Shape]]:
        """[(parameter name like "conv1.weight" or "res2.bn1.bias", offset into the flat vector, shape)], in order."""
        return list(self._layout)

    def buffer_layout(self) -> list[tuple[str, int, Shape]]:
        """[(buffer name like "bn1.running_mean", offset into the flat buffer vector, shape)], in order."""
        return list(self._buffer_layout)

    def init_params(self, seed: int) -> np.ndarray:
        """Fresh host float32 (num_params,) vector, each parameter as its layer declares (`Param.init`).

        "he": N(0, 2/fan_in) (He et al. 2015, for ReLU nets), fan_in = C*k*k for conv and in_features
        for linear layers; "normal": N(0, std^2); "zeros"; "ones". The normal draws are made in layout
        order from np.random.default_rng(seed), so the same seed always gives the same vector. The
        built-in networks start their classifier at zero (init "zeros"), as the zero-initialised head
        of Dosovitskiy et al. 2021: the first loss is exactly ln(num_classes) instead of the ~9 that
        He-scaled logits give after max-pooling, which keeps the first asynchronous steps stable.
        """
        rng = np.random.default_rng(seed)
        params = np.zeros(self.num_params, dtype=np.float32)
        for (_, offset, shape), (p, fan_in) in zip(self._layout, self._decl, strict=True):
            size = _size(shape)
            if p.init == "he":
                params[offset:offset + size] = rng.standard_normal(size) * np.sqrt(2.0 / fan_in)
            elif p.init == "normal":
                params[offset:offset + size] = rng.standard_normal(size) * p.std
            elif p.init == "ones":
                params[offset:offset + size] = 1.0
        return params

    def init_buffers(self) -> np.ndarray:
        """Fresh host float32 (num_buffers,) vector: every buffer at its declared fill (running mean 0,
        running variance 1)."""
        buffers = np.zeros(self.num_buffers, dtype=np.float32)
        for (_, offset, shape), fill in zip(self._buffer_layout, self._fills, strict=True):
            buffers[offset:offset + _size(shape)] = fill
        return buffers

    def _per_param(self, value) -> np.ndarray:
        out = np.zeros(self.num_params, dtype=np.float32)
        for (_, offset, shape), (p, _) in zip(self._layout, self._decl, strict=True):
            out[offset:offset + _size(shape)] = value(p)
        return out

    def decay_mult(self) -> np.ndarray:
        """Host float32 (num_params,): each parameter's weight-decay multiplier (`Param.decay_mult`: by
        default 1 on conv/linear weights, 0 on biases and normalisation parameters)."""
        return self._per_param(lambda p: p.decay_mult)

    def decay_mask(self) -> np.ndarray:
        """The same as `decay_mult` (its former name, when multipliers were 0 or 1)."""
        return self.decay_mult()

    def lr_mult(self) -> np.ndarray:
        """Host float32 (num_params,): each parameter's learning-rate multiplier (`Param.lr_mult`, default 1)."""
        return self._per_param(lambda p: p.lr_mult)

    def bind(self, params: Any, grads: Any, buffers: Any = None) -> None:
        """Make every layer hold views into `params`, `grads` and `buffers` (no copies).

        All must be 1-D, C-contiguous, of length num_params (num_buffers) and dtype float32, distinct and
        not overlapping, arrays of this model's backend. `buffers` None: fresh ones at their initial
        values (`init_buffers`) on the backend. Writing `params` (an MPI receive, an optimizer step)
        changes the layer weights; `forward_backward` overwrites `grads` and updates `buffers`.
        Raises ValueError naming the array and what was expected.
        """
        if buffers is None:
            buffers = self.ops.asarray(self.init_buffers(), self.dtype)
        for what, a, n in (("params", params, self.num_params), ("grads", grads, self.num_params),
                           ("buffers", buffers, self.num_buffers)):
            expected = f"a 1-D C-contiguous {self.dtype} {self.ops.ndarray.__module__}.ndarray of length {n}"
            if not isinstance(a, self.ops.ndarray):
                raise ValueError(f"Model.bind: {what} must be {expected}, got {type(a).__name__}")
            if a.ndim != 1 or a.shape[0] != n:
                raise ValueError(f"Model.bind: {what} must be {expected}, got shape {a.shape}")
            if a.dtype != self.dtype:
                raise ValueError(f"Model.bind: {what} must be {expected}, got dtype {a.dtype}")
            if not a.flags.c_contiguous:
                raise ValueError(f"Model.bind: {what} must be {expected}, got a non-contiguous array")
        if self.ops.may_share_memory(params, grads):
            raise ValueError("Model.bind: params and grads must be separate, non-overlapping arrays")
        if self.num_buffers and any(self.ops.may_share_memory(buffers, a) for a in (params, grads)):
            raise ValueError("Model.bind: buffers must not overlap params or grads")
        for layer, slots, bslots in zip(self.layers, self._slots, self._buffer_slots, strict=True):
            # basic slicing + reshape of a contiguous vector: views, never copies
            layer.bind([params[o:o + _size(s)].reshape(s) for o, s in slots],
                       [grads[o:o + _size(s)].reshape(s) for o, s in slots],
                       [buffers[o:o + _size(s)].reshape(s) for o, s in bslots])
        self.params, self.grads, self.buffers = params, grads, buffers

    def param_range(self, first: int, last: int) -> tuple[int, int]:
        """[start, stop) of the flat parameter vector that holds the parameters of layers first..last-1.

        Layers own consecutive ranges in layer order, so any run of layers (a pipeline module) owns
        one contiguous slice. Raises ValueError unless 0 <= first < last <= len(layers).
        """
        return self._range(self._slots, self.num_params, first, last, "param_range")

    def buffer_range(self, first: int, last: int) -> tuple[int, int]:
        """[start, stop) of the flat buffer vector that holds the buffers of layers first..last-1."""
        return self._range(self._buffer_slots, self.num_buffers, first, last, "buffer_range")

    def _range(self, slots_of: list, total: int, first: int, last: int, op: str) -> tuple[int, int]:
        if not 0 <= first < last <= len(self.layers):
            raise ValueError(f"Model.{op}: need 0 <= first < last <= {len(self.layers)}, got {first}, {last}")
        start = next((s[0][0] for s in slots_of[first:last] if s), None)
        if start is None:  # nothing in these layers: an empty range where the next ones start
            start = next((s[0][0] for s in slots_of[last:] if s), total)
            return start, start
        stop = max(o + _size(shape) for s in slots_of[first:last] for o, shape in s)
        return start, stop

    def bind_layers(self, first: int, last: int, params: Any, grads: Any, buffers: Any = None) -> None:
        """Bind layers first..last-1 to views into `params`, `grads` (and `buffers`), which hold just their slice.

        params and grads are 1-D float32 arrays of length stop - start (see `param_range`), buffers of
        the length of `buffer_range` (None: fresh, at their initial values); a pipeline module keeps
        only its own. Raises ValueError on a wrong length.
        """
        start, stop = self.param_range(first, last)
        bstart, bstop = self.buffer_range(first, last)
        if buffers is None:
            buffers = self.ops.asarray(self.init_buffers()[bstart:bstop], self.dtype)
        for what, a, n in (("params", params, stop - start), ("grads", grads, stop - start),
                           ("buffers", buffers, bstop - bstart)):
            if a.ndim != 1 or a.shape[0] != n:
                raise ValueError(f"Model.bind_layers: {what} must have shape ({n},), got {a.shape}")
        for layer, slots, bslots in zip(self.layers[first:last], self._slots[first:last],
                                        self._buffer_slots[first:last], strict=True):
            layer.bind([params[o - start:o - start + _size(s)].reshape(s) for o, s in slots],
                       [grads[o - start:o - start + _size(s)].reshape(s) for o, s in slots],
                       [buffers[o - bstart:o - bstart + _size(s)].reshape(s) for o, s in bslots])

    def layer_flops(self) -> list[int]:
        """Multiply-adds x 2 of each layer's forward pass for one sample (conv and linear, nested ones included;
        0 for the rest)."""
        ins = [self.input_shape, *self.shapes[:-1]]
        return [layer.flops(shape) for layer, shape in zip(self.layers, ins, strict=True)]

    def train(self, mode: bool = True) -> None:
        """Set every layer's `training` flag (BatchNorm: batch statistics; Dropout: on)."""
        for layer in walk(self.layers):
            layer.training = mode

    def eval(self) -> None:
        """Evaluation behaviour in every layer (BatchNorm: running statistics; Dropout: off)."""
        self.train(False)

    def spec(self) -> dict[str, Any]:
        """This network's stored definition (`mpiasgd.model.spec`): JSON data to rebuild it from."""
        return model_spec(self.name, self.input_shape, self.layers)

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

    def forward_backward(self, x: Any, y: Any, minibatch: int | None = None) -> tuple[float, int]:
        """One training minibatch: x (N, C, H, W) float32, y (N,) int labels -> (mean loss, number correct).

        Overwrites `grads` with d(mean loss)/d(params) and updates the buffers (running statistics).
        `minibatch` numbers it for dropout's key (`ctx.minibatch`); None: one more than the last.
        Raises RuntimeError before `bind`, ValueError on wrong shapes/dtypes or out-of-range labels.
        """
        stats = self.forward_backward_deferred(x, y, minibatch)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return stats.get()

    def forward_backward_deferred(self, x: Any, y: Any, minibatch: int | None = None) -> LossStats:
        """`forward_backward` whose (mean loss, number correct) are read later: returns a
        `mpiasgd.ops.protocol.LossStats` (`get()`). On a GPU nothing here waits for the device, so the
        host queues the whole step's kernels while the first ones run; the loss and hits are copied
        when `get()` is called (a worker: once per push, when its gradient is copied out anyway).
        The errors of `forward_backward`; an out-of-range label may be named by `get()` instead."""
        self._check_batch("forward_backward", x, y)
        self.ctx.minibatch = self.ctx.minibatch + 1 if minibatch is None else int(minibatch)
        self.train()
        h = x
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a diverging network
            for layer in self.layers:  # overflows (numpy backend); its non-finite loss and gradient are checked
                h = layer.forward(h)   # by the caller (the push rejected, the divergence reported)
            stats = self.loss.forward_deferred(h, y)
            d = self.loss.backward()
            for layer in reversed(self.layers):
                d = layer.backward(d)
        return stats

    def evaluate(self, x: Any, y: Any, batch_size: int = 1000) -> tuple[float, int, int]:
        """Forward only, in evaluation behaviour (running statistics, no dropout), in chunks of `batch_size`:
        (summed loss over samples, number correct (top-1), number correct in the top 5).

        Top-1 is the argmax (the first maximum on a tie, as the loss op's). Top-5 (`topk_correct`): the label
        is among the 5 largest logits with ties broken against it (fewer than 5 other logits >= the label's),
        so a network of constant outputs is not a top-5 hit everywhere; top-5 >= top-1 unless 5 or more
        classes tie for the maximum; with 5 classes or fewer every image is a top-5 hit
        (top-5 accuracy 1.0 by definition). An image whose logits are not all finite is wrong for both (the
        loss op's argmax would put an all-NaN row at class 0). Memory grows with batch_size: the numpy backend keeps
        ~2.8 MB of conv scratch per cifar10 sample (about 1.4 GB of forward-only scratch at 1000; 256 is
        plenty fast on a CPU).
        """
        self._check_batch("evaluate", x, y)
        if batch_size < 1:
            raise ValueError(f"Model.evaluate: batch_size must be >= 1, got {batch_size}")
        loss_sum, correct, correct5 = 0.0, 0, 0
        self.eval()
        for start in range(0, x.shape[0], batch_size):
            h = x[start:start + batch_size]
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # as in forward_backward: a
                for layer in self.layers:  # diverged network's rows are non-finite, scored wrong below
                    h = layer.forward(h)
                labels = y[start:start + batch_size]
                loss, _ = self.loss.forward(h, labels)
            loss_sum += loss * h.shape[0]
            # host copies: (B, K) logits and (B,) labels, small next to the batch's forward pass
            logits, truth = self.ops.to_numpy(h), self.ops.to_numpy(labels)
            correct += top1_correct(logits, truth)
            correct5 += topk_correct(logits, truth, 5)
        return loss_sum, correct, correct5

    def describe(self) -> str:
        """One line per layer: name, layer, output shape, parameter count; then the total."""
        lines = [f"{self.name}: input {self.input_shape}"]
        for lname, layer, shape in zip(self.names, self.layers, self.shapes, strict=True):
            count = sum(_size(p.shape) for p in layer.params())
            lines.append(f"  {lname:<9} {layer.describe():<26} -> {shape!s:<14} {count:>9,} params")
        lines.append(f"  total {self.num_params:,} parameters" +
                     (f", {self.num_buffers:,} buffer values" if self.num_buffers else ""))
        return "\n".join(lines)


def top1_correct(logits: np.ndarray, labels: np.ndarray) -> int:
    """Images whose label is the argmax of their logits (the first maximum on a tie), among those whose logits
    are all finite: (N, K) float host logits, (N,) int labels. A row with a NaN or an infinite logit is wrong."""
    finite = np.isfinite(logits).all(axis=1)  # (N,)
    return int(np.count_nonzero(finite & (logits.argmax(axis=1) == labels)))


def topk_correct(logits: np.ndarray, labels: np.ndarray, k: int) -> int:
    """Images whose label is among the `k` largest of their logits: (N, K) float host logits, (N,) int labels.

    Ties are broken against the label (pessimistic, as evaluators without torch.topk's arbitrary order do):
    a hit has fewer than `k` other logits greater than or equal to the label's, so constant outputs (every
    logit equal) are no hit at all rather than a hit for every image; the top-1 hit of an argmax
    (`top1_correct`) is a top-k hit unless k or more classes tie for the maximum. A row with a NaN or an
    infinite logit is never a hit, for any k (a NaN network scores 0, not the images of one class). With
    K <= k classes every image with finite logits is a hit (top-k accuracy 1.0 by definition).
    """
    if logits.shape[0] == 0:
        return 0
    own = logits[np.arange(logits.shape[0]), labels.astype(np.int64)]  # (N,) the label's logit
    rivals = (logits >= own[:, None]).sum(axis=1) - 1                 # (N,) other logits >= it (ties lose)
    return int(np.count_nonzero((rivals < k) & np.isfinite(logits).all(axis=1)))


def _size(shape: Shape) -> int:
    size = 1
    for d in shape:
        size *= d
    return size

