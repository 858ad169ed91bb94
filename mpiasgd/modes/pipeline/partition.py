"""Cutting the layer list into K modules, and a module: its layers over one slice of the weights."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpiasgd.config import ConfigError


def layer_costs(model: Any, balance: str) -> list[float]:
    """Per-layer cost for balancing: forward work ("flops") or parameter count ("params").

    "flops": 2 x multiply-adds of conv/linear layers plus one operation per output element, so
    layers without weights (ReLU, pooling) are not free. "params": the parameter count, plus 1e-6
    per output element only to break ties between cuts.
    """
    outputs = [int(np.prod(s)) for s in model.shapes]
    if balance == "params":
        sizes = [model.param_range(i, i + 1) for i in range(len(model.layers))]
        return [float(stop - start) + 1e-6 * out for (start, stop), out in zip(sizes, outputs, strict=True)]
    return [float(f + out) for f, out in zip(model.layer_flops(), outputs, strict=True)]


def partition(model: Any, modules: int, cuts: tuple[int, ...] = (), balance: str = "flops") -> list[int]:
    """Module boundaries [0, c_1, ..., c_{K-1}, L]: module k is layers bounds[k]..bounds[k+1]-1.

    `cuts` given: used as they are (ConfigError if out of range). Otherwise the K-1 cuts that
    minimise the largest module cost (`layer_costs`), by dynamic programming over the L layers.
    """
    count = len(model.layers)
    if modules > count:
        raise ConfigError(f"config key 'modules' = {modules}: model '{model.name}' has only {count} layers")
    if cuts:
        if len(cuts) != modules - 1 or cuts[-1] >= count:
            raise ConfigError(f"config key 'cuts' = {','.join(map(str, cuts))!r}: expected {modules - 1} increasing "
                              f"layer index(es) in 1..{count - 1} for model '{model.name}' ({count} layers)")
        return [0, *cuts, count]
    costs = layer_costs(model, balance)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    # best[j][i]: the smallest max-module cost of layers 0..i-1 in j modules; split[j][i]: its last cut
    best = np.full((modules + 1, count + 1), np.inf)
    split = np.zeros((modules + 1, count + 1), dtype=int)
    best[0][0] = 0.0
    for j in range(1, modules + 1):
        for i in range(j, count + 1):
            for c in range(j - 1, i):
                value = max(best[j - 1][c], prefix[i] - prefix[c])
                if value < best[j][i]:
                    best[j][i], split[j][i] = value, c
    bounds, i = [count], count
    for j in range(modules, 0, -1):
        i = int(split[j][i])
        bounds.append(i)
    return bounds[::-1]


def describe_partition(model: Any, bounds: list[int], balance: str, decoupling: str = "full") -> str:
    """One line per module: its layers, parameters, share of the balanced cost, and delay in iterations."""
    costs = layer_costs(model, balance)
    total = sum(costs) or 1.0
    what = "forward work" if balance == "flops" else "parameters"
    K = len(bounds) - 1
    delay = [(2 if decoupling == "full" else 1) * (K - 1 - k) for k in range(K)]
    lines = []
    for k in range(len(bounds) - 1):
        first, last = bounds[k], bounds[k + 1]
        start, stop = model.param_range(first, last)
        share = sum(costs[first:last]) / total
        lines.append(f"  module {k}: layers {first}..{last - 1} ({', '.join(model.names[first:last])}), "
                     f"{stop - start:,} parameters, {share:.0%} of the {what}, delay {delay[k]}")
    return "\n".join(lines)


class Module:
    """Layers first..last-1 of `model` with their parameters in one module-local flat vector.

    `params`/`grads` (float32 (size,), on the model's backend) are the slice [start, stop) of the
    whole model's vectors; `buffers` (float32 (bsize,)) the slice [bstart, bstop) of its buffer vector
    (the module's layers' running statistics, at their initial values until set), bound with every
    `bind`. forward(x (B, *in_shape)) -> (B, *out_shape); backward(dy) -> dx, or None for module 0
    (nothing consumes the gradient w.r.t. the images).
    """

    def __init__(self, model: Any, first: int, last: int) -> None:
        self.model, self.first, self.last = model, first, last
        self.layers = model.layers[first:last]
        self.start, self.stop = model.param_range(first, last)
        self.size = self.stop - self.start
        self.bstart, self.bstop = model.buffer_range(first, last)
        self.bsize = self.bstop - self.bstart
        self.in_shape = tuple(model.input_shape if first == 0 else model.shapes[first - 1])
        self.out_shape = tuple(model.shapes[last - 1])
        self.is_last = last == len(model.layers)
        ops = model.ops
        self.params, self.grads = ops.zeros(self.size), ops.zeros(self.size)
        self.buffers = ops.asarray(model.init_buffers()[self.bstart:self.bstop])
        self.bind(self.params)

    def bind(self, params: Any) -> None:
        """Compute with `params` (the current weights, or a stashed copy); gradients go to `grads`, the
        running statistics stay in `buffers`."""
        self.model.bind_layers(self.first, self.last, params, self.grads, self.buffers)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, dy: Any) -> Any:
        for layer in reversed(self.layers):
            dy = layer.backward(dy)
        return dy

    def save_cache(self) -> list:
        """What the last forward cached in every layer (`Layer.save_cache`): --pipeline-activations store."""
        return [layer.save_cache() for layer in self.layers]

    def load_cache(self, state: list) -> None:
        """Put back a `save_cache()` state: the next `backward` back-propagates that forward's minibatch."""
        for layer, layer_state in zip(self.layers, state, strict=True):
            layer.load_cache(layer_state)

    def loss_backward(self, logits: Any, labels: Any) -> tuple[float, int, Any]:
        """(last module) loss of `logits`, then backward: (mean loss, correct, dx)."""
        loss, correct = self.model.loss.forward(logits, labels)
        return loss, correct, self.backward(self.model.loss.backward())
