"""The minibatch stream of a worker: its shard's indices epoch after epoch, and the augmentation
generator of each minibatch, both reproducible from one number, the cursor (minibatches drawn).

A resumed worker continues its stream exactly: `MinibatchStream(..., cursor=c)` yields what the
uninterrupted stream yields after its first c minibatches, images and augmentation alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from mpiasgd.data.sampler import ShardSampler


def batch_rng(seed: int, stream: int, b: int) -> np.random.Generator:
    """The augmentation generator of minibatch `b` (0-based) of data stream `stream` (a worker's rank;
    in pipeline mode 1 + the replica): independent of everything drawn before, so a resumed worker
    continues the sequence exactly from its cursor."""
    return np.random.default_rng([seed, 1, stream, b])


def minibatches(sampler: ShardSampler, batch_size: int, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
    """Endless (epoch, indices) minibatches of `batch_size` over `sampler`'s shard, reshuffled every
    epoch; a batch may straddle two epochs (indices: int64 (batch_size,)). `start` skips the first
    `start` minibatches (a resumed worker's cursor) without drawing them."""
    skip = start * batch_size
    epoch, offset = divmod(skip, len(sampler))
    queue = sampler.indices(epoch)[offset:]
    epoch += 1
    while True:
        while queue.size < batch_size:
            queue = np.concatenate([queue, sampler.indices(epoch)])
            epoch += 1
        yield epoch - 1, queue[:batch_size]
        queue = queue[batch_size:]


class MinibatchStream:
    """Training minibatches of `dataset` over `sampler`'s shard for data stream `stream` (a worker's
    rank; pipeline: 1 + the replica), starting after `cursor` minibatches.

    `next()` -> (x float32 (B, C, H, W) augmented and normalised, y int64 (B,), epoch over the
    shard), host arrays; `next_indices()` -> (epoch, int64 (B,) indices) without reading images
    (a pipeline's last module takes only the labels). Either advances `cursor` by one.
    """

    def __init__(self, dataset: Any, sampler: ShardSampler, batch_size: int, seed: int, stream: int,
                 cursor: int = 0) -> None:
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.seed, self.stream = seed, stream
        self.seek(cursor)

    def seek(self, cursor: int) -> None:
        """Continue after the first `cursor` minibatches (a resumed worker's data position)."""
        self.cursor = cursor
        self.batches = minibatches(self.sampler, self.batch_size, cursor)

    def next_indices(self) -> tuple[int, np.ndarray]:
        self.cursor += 1
        return next(self.batches)

    def next(self) -> tuple[np.ndarray, np.ndarray, int]:
        rng = batch_rng(self.seed, self.stream, self.cursor)  # augmentation, reproducible from the cursor
        epoch, idx = self.next_indices()
        x, y = self.dataset.batch("train", idx, rng)
        return x, y, epoch
