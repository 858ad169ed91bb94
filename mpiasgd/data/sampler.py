"""Which training samples a worker sees, and in what order, epoch by epoch.

Sharding (fixed for the whole run), in blocks of `chunk` consecutive samples (chunk 1: single
samples, the in-memory datasets; an HDF5 dataset file: its chunk of images, so that a worker
reads whole chunks, `mpiasgd.data.h5data`):
    blocks = ceil(num_samples / chunk); perm = np.random.default_rng(seed).permutation(blocks)
    shard s owns the samples of blocks perm[s::num_shards]
so the shards are disjoint, together cover every sample, differ in size by at most one block, and
do not change from epoch to epoch. Each worker owns one shard (worker rank r in 1..N uses shard r-1).

Order within a shard (new every epoch), rng = np.random.default_rng((seed, epoch, shard)):
    chunk 1: rng.permutation of the shard's samples;
    chunk > 1: the shard's blocks in the order rng.permutation(its blocks), then, window by
    window of `window` consecutive blocks, the samples of the window in the order of
    rng.permutation (drawn window after window from the same rng)
so every (seed, epoch, shard) gives the same order on any machine, no two workers or epochs share
a random stream, and a minibatch touches at most two windows' blocks: reading a block once per epoch
needs a cache of window + 1 blocks. The shuffle is a local one, as a shuffle buffer: files written
by `mpiasgd data convert` are shuffled once at conversion, so every block already mixes classes.
"""

from __future__ import annotations

import operator

import numpy as np

from mpiasgd.data.errors import DataError


class ShardSampler:
    """One worker's disjoint share of the training set, reshuffled every epoch (see module doc).

    num_samples: size of the training set. num_shards: number of workers (>= 1).
    shard: this worker's shard, 0 <= shard < num_shards. seed: non-negative int, same on all ranks.
    chunk: samples per block kept together (>= 1). window: blocks shuffled together (>= 1; chunk > 1).
    Raises DataError for impossible arguments, including more shards than blocks.
    """

    def __init__(self, num_samples: int, num_shards: int, shard: int, seed: int, chunk: int = 1,
                 window: int = 16):
        num_samples, num_shards = operator.index(num_samples), operator.index(num_shards)
        shard, seed = operator.index(shard), operator.index(seed)
        chunk, window = operator.index(chunk), operator.index(window)
        if num_shards < 1:
            raise DataError(f"num_shards must be >= 1, got {num_shards}")
        if not 0 <= shard < num_shards:
            raise DataError(f"shard must be in 0..{num_shards - 1}, got {shard}")
        if chunk < 1 or window < 1:
            raise DataError(f"chunk and window must be >= 1, got {chunk} and {window}")
        blocks = -(-num_samples // chunk)
        if num_shards > blocks:
            raise DataError(f"more workers ({num_shards}) than samples ({num_samples})" if chunk == 1 else
                            f"more workers ({num_shards}) than chunks ({blocks} of {chunk} images in the file): "
                            "each worker reads whole chunks")
        if seed < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        self.num_samples = num_samples
        self.num_shards = num_shards
        self.shard = shard
        self.seed = seed
        self.chunk = chunk
        self.window = window
        self.blocks = np.random.default_rng(seed).permutation(blocks)[shard::num_shards].astype(np.int64)
        self.size = int(np.minimum(chunk, num_samples - self.blocks * chunk).sum())  # the last block may be short

    def shard_indices(self) -> np.ndarray:
        """This shard's sample indices, int64, in the fixed (epoch-independent) sharding order."""
        if self.chunk == 1:
            return self.blocks.copy()
        return np.concatenate([self._block(b) for b in self.blocks])

    def _block(self, b: int) -> np.ndarray:
        return np.arange(b * self.chunk, min((b + 1) * self.chunk, self.num_samples), dtype=np.int64)

    def __len__(self) -> int:
        """Number of samples in this shard (chunk 1: ceil or floor of num_samples / num_shards)."""
        return self.size

    def indices(self, epoch: int) -> np.ndarray:
        """int64 (len(self),): this shard's sample indices in epoch `epoch`'s order (epoch >= 0)."""
        epoch = operator.index(epoch)
        if epoch < 0:
            raise DataError(f"epoch must be >= 0, got {epoch}")
        rng = np.random.default_rng((self.seed, epoch, self.shard))
        order = rng.permutation(self.blocks.size)
        if self.chunk == 1:
            return self.blocks[order]
        blocks = self.blocks[order]
        out = []
        for start in range(0, blocks.size, self.window):
            window = np.concatenate([self._block(b) for b in blocks[start:start + self.window]])
            out.append(window[rng.permutation(window.size)])
        return np.concatenate(out)
