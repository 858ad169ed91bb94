"""Test-set evaluation of a model's bound weights (workers evaluate their test slice at the end of a run;
`mpiasgd evaluate` evaluates a run log's snapshots with it).

    loss_sum, correct, count = evaluate(model, dataset, idx, batch_size=1000)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpiasgd.data import Dataset
    from mpiasgd.model.model import Model


def evaluate(model: Model, dataset: Dataset, idx: np.ndarray, batch_size: int,
             on_batch: Callable[[], None] | None = None) -> tuple[float, int, int]:
    """Forward the test images `idx` ((n,) int64 indices into the test split) through `model` with its
    bound weights, in batches of `batch_size` images.

    Returns (summed cross-entropy loss in nats, number correct, number of images n). Batches are read on
    the host and moved to the model's backend (cupy: to the device; numpy: no copy). `on_batch()` is called
    after each batch (a worker's heartbeat to rank 0: `Tag.ALIVE`). Raises what
    `Model.evaluate` raises: RuntimeError before `bind`, ValueError on images of the wrong shape.
    """
    loss_sum, correct = 0.0, 0
    ops = model.ops
    for start in range(0, idx.size, batch_size):
        x, y = dataset.batch("test", idx[start:start + batch_size])  # (B, C, H, W) float32, (B,) int64
        x, y = ops.asarray(x), ops.asarray(y, y.dtype)
        batch_loss, batch_correct = model.evaluate(x, y, batch_size)
        loss_sum += float(batch_loss)
        correct += int(batch_correct)
        if on_batch is not None:
            on_batch()
    return loss_sum, correct, int(idx.size)
