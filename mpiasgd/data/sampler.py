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

Workers that die (issue 40: `redeal`): the blocks of the shards whose workers are gone are dealt to
the surviving shards, from the first epoch a shard has not drawn yet on,
    lost = concatenate(the blocks of the lost shards, in shard order)
    surviving shard number i of k (in shard order) adds lost[i::k] to its own blocks
so each sample is still seen once per epoch (the survivors' epochs need not line up). The test set's
slices are dealt the same way (`lost_test_share`).
"""

from __future__ import annotations

import operator
import threading

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
        self.all_blocks = np.random.default_rng(seed).permutation(blocks).astype(np.int64)
        self.blocks = self.all_blocks[shard::num_shards]
        self.size = int(np.minimum(chunk, num_samples - self.blocks * chunk).sum())  # the last block may be short
        self.changes: list[tuple[int, np.ndarray]] = []  # (first epoch, blocks from then on): `redeal`
        self.drawn = -1  # the largest epoch `indices` was asked for (the prefetch thread may ask)
        self.lock = threading.Lock()

    def shard_blocks(self, shard: int) -> np.ndarray:
        """The blocks shard `shard` owns at the start (int64)."""
        return self.all_blocks[shard::self.num_shards]

    def redeal(self, lost: list[int]) -> int:
        """The shards `lost` (every lost shard so far; this one not among them) are gone: from the first epoch
        not drawn yet on, this shard also reads its share of their blocks (module doc). Returns that epoch.
        DataError if this shard is among `lost` or a shard number is out of range."""
        lost = sorted(set(lost))
        if self.shard in lost or any(not 0 <= s < self.num_shards for s in lost):
            raise DataError(f"redeal: lost shards {lost} must be in 0..{self.num_shards - 1} and not this "
                            f"shard ({self.shard})")
        survivors = [s for s in range(self.num_shards) if s not in lost]
        extra = (np.concatenate([self.shard_blocks(s) for s in lost]) if lost else
                 np.zeros(0, dtype=np.int64))[survivors.index(self.shard)::len(survivors)]
        with self.lock:
            first = self.drawn + 1
            self.changes = [c for c in self.changes if c[0] < first] + [(first, np.concatenate([self.blocks, extra]))]
        return first

    def blocks_for(self, epoch: int) -> np.ndarray:
        """The blocks this shard reads in epoch `epoch` (its own, and after a `redeal` a share of lost ones)."""
        out = self.blocks
        for first, blocks in self.changes:
            if epoch >= first:
                out = blocks
        return out

    def shard_indices(self) -> np.ndarray:
        """This shard's sample indices, int64, in the fixed (epoch-independent) sharding order."""
        if self.chunk == 1:
            return self.blocks.copy()
        return np.concatenate([self._block(b) for b in self.blocks])

    def _block(self, b: int) -> np.ndarray:
        return np.arange(b * self.chunk, min((b + 1) * self.chunk, self.num_samples), dtype=np.int64)

    def __len__(self) -> int:
        """Number of samples in this shard at the start (chunk 1: ceil or floor of num_samples / num_shards; a
        `redeal` makes later epochs longer)."""
        return self.size

    def indices(self, epoch: int) -> np.ndarray:
        """int64: this shard's sample indices in epoch `epoch`'s order (epoch >= 0): len(self) of them, more
        after a `redeal`."""
        epoch = operator.index(epoch)
        if epoch < 0:
            raise DataError(f"epoch must be >= 0, got {epoch}")
        with self.lock:
            self.drawn = max(self.drawn, epoch)
            mine = self.blocks_for(epoch)
        rng = np.random.default_rng((self.seed, epoch, self.shard))
        order = rng.permutation(mine.size)
        if self.chunk == 1:
            return mine[order]
        blocks = mine[order]
        out = []
        for start in range(0, blocks.size, self.window):
            window = np.concatenate([self._block(b) for b in blocks[start:start + self.window]])
            out.append(window[rng.permutation(window.size)])
        return np.concatenate(out)


def test_slice(num_test: int, num_workers: int, rank: int) -> np.ndarray:
    """The test images worker `rank` (1..num_workers) evaluates: int64 indices, a contiguous slice of the
    `num_test` (the slices of all workers cover the test split once)."""
    return np.array_split(np.arange(num_test, dtype=np.int64), num_workers)[rank - 1]


def lost_test_share(num_test: int, num_workers: int, rank: int, lost: list[int]) -> np.ndarray:
    """The test images worker `rank` evaluates besides its own slice once the workers `lost` (ranks) are gone:
    its share of their slices (dealt as the lost shards' blocks, module doc), so that the survivors still
    cover the test split once. int64 (empty when none is lost); DataError if `rank` is among `lost`."""
    lost = sorted(set(lost))
    if rank in lost:
        raise DataError(f"lost_test_share: worker rank {rank} is among the lost {lost}")
    if not lost:
        return np.zeros(0, dtype=np.int64)
    survivors = [w for w in range(1, num_workers + 1) if w not in lost]
    theirs = np.concatenate([test_slice(num_test, num_workers, w) for w in lost])
    return theirs[survivors.index(rank)::len(survivors)]
