"""Test-set evaluation of a model's bound weights (workers evaluate their test slice during a run
(--eval-interval) and at its end; rank 0 the pipeline's snapshots; `mpiasgd evaluate` a run log's
snapshots).

    loss_sum, correct, count, correct5 = evaluate(model, dataset, idx, batch_size=1000)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from mpiasgd.data import Dataset
    from mpiasgd.model.model import Model


class Evaluation(NamedTuple):
    """What an evaluation of `count` test images gives: summed cross-entropy loss (nats), images whose
    label is the argmax (top-1) and images whose label is among the 5 largest logits (top-5; with 5
    classes or fewer, every image: see `Model.evaluate`). An image whose logits are not all finite counts
    for neither (a NaN network scores 0). Top-5 breaks ties against the label, so correct5 >= correct unless
    5 or more classes tie for the maximum: a network of constant outputs (all logits equal, e.g. zero
    weights) scores top-1 1/K and top-5 0."""

    loss_sum: float
    correct: int
    count: int
    correct5: int


def evaluate(model: Model, dataset: Dataset, idx: np.ndarray, batch_size: int,
             on_batch: Callable[[], None] | None = None) -> Evaluation:
    """Forward the test images `idx` ((n,) int64 indices into the test split) through `model` with its
    bound weights, in batches of `batch_size` images.

    Returns an `Evaluation` (loss_sum, correct, count = n, correct5). Batches are read on the host and moved
    to the model's backend (cupy: to the device; numpy: no copy). `on_batch()` is called after each batch
    (a worker's heartbeat to rank 0, `Tag.ALIVE`; it may raise to abandon the evaluation). Raises what
    `Model.evaluate` raises: RuntimeError before `bind`, ValueError on images of the wrong shape.
    """
    loss_sum, correct, correct5 = 0.0, 0, 0
    ops = model.ops
    for start in range(0, idx.size, batch_size):
        x, y = dataset.batch("test", idx[start:start + batch_size])  # (B, C, H, W) float32, (B,) int64
        x, y = ops.asarray(x), ops.asarray(y, y.dtype)
        batch_loss, batch_correct, batch_correct5 = model.evaluate(x, y, batch_size)
        loss_sum += float(batch_loss)
        correct += int(batch_correct)
        correct5 += int(batch_correct5)
        if on_batch is not None:
            on_batch()
    return Evaluation(loss_sum, correct, int(idx.size), correct5)
