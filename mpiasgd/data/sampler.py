"""Which training samples a worker sees, and in what order, epoch by epoch.

Sharding (fixed for the whole run):
    perm = np.random.default_rng(seed).permutation(num_samples)
    shard s owns perm[s::num_shards]
so the shards are disjoint, together cover every sample, differ in size by at most one, and do
not change from epoch to epoch. Each worker owns one shard (worker rank r in 1..N uses shard r-1).

Order within a shard (new every epoch):
    np.random.default_rng((seed, epoch, shard)).permutation(shard_size)
so every (seed, epoch, shard) gives the same order on any machine, and no two workers or epochs
share a random stream.
"""

from __future__ import annotations

import operator

import numpy as np

from mpiasgd.data.dataset import DataError


class ShardSampler:
    """One worker's disjoint share of the training set, reshuffled every epoch (see module doc).

    num_samples: size of the training set. num_shards: number of workers (>= 1).
    shard: this worker's shard, 0 <= shard < num_shards. seed: non-negative int, same on all ranks.
    Raises DataError for impossible arguments, including more shards than samples.
    """

    def __init__(self, num_samples: int, num_shards: int, shard: int, seed: int):
        num_samples, num_shards = operator.index(num_samples), operator.index(num_shards)
        shard, seed = operator.index(shard), operator.index(seed)
        if num_shards < 1:
            raise DataError(f"num_shards must be >= 1, got {num_shards}")
        if not 0 <= shard < num_shards:
            raise DataError(f"shard must be in 0..{num_shards - 1}, got {shard}")
        if num_shards > num_samples:
            raise DataError(f"more workers ({num_shards}) than samples ({num_samples})")
        if seed < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        self.num_samples = num_samples
        self.num_shards = num_shards
        self.shard = shard
        self.seed = seed

    def shard_indices(self) -> np.ndarray:
        """This shard's sample indices, int64, in the fixed (epoch-independent) sharding order."""
        perm = np.random.default_rng(self.seed).permutation(self.num_samples)
        return perm[self.shard :: self.num_shards].astype(np.int64)

    def __len__(self) -> int:
        """Number of samples in this shard: ceil or floor of num_samples / num_shards."""
        return len(range(self.shard, self.num_samples, self.num_shards))

    def indices(self, epoch: int) -> np.ndarray:
        """int64 (len(self),): this shard's sample indices in epoch `epoch`'s order (epoch >= 0)."""
        epoch = operator.index(epoch)
        if epoch < 0:
            raise DataError(f"epoch must be >= 0, got {epoch}")
        mine = self.shard_indices()
        order = np.random.default_rng((self.seed, epoch, self.shard)).permutation(mine.size)
        return mine[order]
