"""The minibatch stream of a worker: its shard's indices epoch after epoch, and the augmentation
generator of each minibatch, both reproducible from one number, the cursor (minibatches drawn).

A resumed worker continues its stream exactly: `MinibatchStream(..., cursor=c)` yields what the
uninterrupted stream yields after its first c minibatches, images and augmentation alike.

With `prefetch` > 0 a background thread reads, augments and normalises the next `prefetch` minibatches
while the current one computes (a bounded queue). What it yields is the same, minibatch for
minibatch: each minibatch is a function of its number alone, never of timing. numpy and h5py release
the GIL while they copy and read, so the thread overlaps the step on a CPU worker too.
"""

from __future__ import annotations

import queue
import threading
import time
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
    (a pipeline's last module takes only the labels; only on a stream without prefetch). Either
    advances `cursor` by one. `prefetch`: minibatches prepared ahead by a background thread (0:
    none, `next()` reads in the caller). `data_s`: seconds the last `next()` waited for its
    minibatch (without prefetch: all its reading and augmenting). `close()` stops the thread.
    """

    def __init__(self, dataset: Any, sampler: ShardSampler, batch_size: int, seed: int, stream: int,
                 cursor: int = 0, prefetch: int = 0) -> None:
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.seed, self.stream, self.prefetch = seed, stream, prefetch
        self.data_s = 0.0
        self.thread: threading.Thread | None = None
        self.seek(cursor)

    def seek(self, cursor: int) -> None:
        """Continue after the first `cursor` minibatches (a resumed worker's data position)."""
        self.close()
        self.cursor = cursor
        if not self.prefetch:
            self.batches = minibatches(self.sampler, self.batch_size, cursor)
        else:  # the thread draws the indices
            self.queue: queue.Queue = queue.Queue(maxsize=self.prefetch)
            self.stopping = threading.Event()
            self.thread = threading.Thread(target=self._produce, args=(cursor, self.queue, self.stopping),
                                           name=f"prefetch-{self.stream}", daemon=True)
            self.thread.start()

    def make(self, cursor: int, epoch: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Minibatch number `cursor` (its indices `idx`, drawn in `epoch`): read, augmented, normalised."""
        x, y = self.dataset.batch("train", idx, batch_rng(self.seed, self.stream, cursor))
        return x, y, epoch

    def _produce(self, cursor: int, out: queue.Queue, stopping: threading.Event) -> None:
        """(prefetch thread) Minibatches cursor, cursor + 1, ... into `out` until `stopping` is set."""
        batches = minibatches(self.sampler, self.batch_size, cursor)
        try:
            while not stopping.is_set():
                epoch, idx = next(batches)
                item = self.make(cursor, epoch, idx)
                cursor += 1
                while not stopping.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the training thread, which raises it where it reads
            out.put(e)

    def next_indices(self) -> tuple[int, np.ndarray]:
        if self.prefetch:
            raise RuntimeError("next_indices() on a prefetching stream: use next()")
        self.cursor += 1
        return next(self.batches)

    def next(self) -> tuple[np.ndarray, np.ndarray, int]:
        t0 = time.perf_counter()
        if self.prefetch:
            item = self.queue.get()
            if isinstance(item, BaseException):
                raise item
            self.cursor += 1
        else:
            epoch, idx = next(self.batches)
            item = self.make(self.cursor, epoch, idx)  # augmentation reproducible from the cursor
            self.cursor += 1
        self.data_s = time.perf_counter() - t0
        return item

    def close(self) -> None:
        """Stop the prefetch thread (if any) and drop what it prepared."""
        if self.thread is not None:
            self.stopping.set()
            self.thread.join()
            self.thread = None
