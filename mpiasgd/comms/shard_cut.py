"""The cut of the flat parameter vector into parameter-server shards (`--servers S`).

Shard 0 is rank 0; shard s >= 1 is rank N + s, after the N workers (ranks 1..N), so that worker ranks,
and everything that names them (`--straggler`, the run log's rows, reports), are the same for every S.
Shard s owns the contiguous slice [start_s, stop_s) of the P
parameters and applies the pushes to it with its own optimizer state and version counter (as the
server shards of Downpour SGD, ps-lite and MXNet's kvstore). Shard 0 (rank 0) also carries the
B layer buffers (BatchNorm's running statistics) at the end of its messages, and stays the only
writer of the run log. A worker exchanges one message per shard, all in flight at once.

The cut balances the bytes each shard moves per push: shard s's messages carry

    count_s = (stop_s - start_s) + (B if s == 0 else 0)

values, and the cut makes the counts as equal as `ALIGN` allows (every slice but the last starts
and ends on a multiple of ALIGN values: 16 float32 = one 64-byte cache line, so each shard's slice of
a host vector is line-aligned wherever the vector is). Bytes follow counts for any wire format,
since every shard's messages carry the same header and the same element size.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

ALIGN = 16  # values: slices start on a 64-byte line of a float32 vector


class ShardError(ValueError):
    """A cut that cannot be made: more shards than the model has aligned blocks of parameters."""


@dataclass(frozen=True)
class ShardCut:
    """The slices of S shards: `bounds` = (0, stop_0, ..., P), S + 1 increasing offsets into the flat
    parameter vector (float32 (P,)); `num_buffers` = B, the layer buffers shard 0's messages carry.
    S = 1 is the unsharded server: one slice (0, P) with the buffers."""

    bounds: tuple[int, ...]
    num_buffers: int = 0

    def __post_init__(self) -> None:
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in pairwise(b)) or self.num_buffers < 0:
            raise ShardError(f"shard bounds must increase from 0 (every shard at least one parameter), with "
                             f"num_buffers >= 0; got bounds {b}, num_buffers {self.num_buffers}")

    @classmethod
    def balanced(cls, num_params: int, num_buffers: int, shards: int, align: int = ALIGN) -> ShardCut:
        """The cut of `num_params` parameters (and `num_buffers` buffers, on shard 0) into `shards` slices
        whose message counts differ by at most `align` values where the sizes allow (shard 0 takes fewer
        parameters by the buffers it carries). ShardError, naming --servers, when some shard would get no
        parameter (a model smaller than `shards` x `align` values)."""
        if shards < 1:
            raise ShardError(f"--servers must be >= 1, got {shards}")
        total = num_params + num_buffers
        blocks = -(-num_params // align)  # whole aligned blocks of parameters (the last may be short)
        if shards > blocks:
            raise ShardError(f"--servers {shards}: the model's {num_params:,} parameters make {blocks} blocks of "
                             f"{align} values; every shard needs at least one (use --servers <= {blocks})")
        bounds = [0]
        for s in range(1, shards):
            ideal = s * total / shards - num_buffers  # params before shard s's start, buffers counted on shard 0
            cut = round(ideal / align) * align
            lowest = bounds[-1] + align               # shard s-1 keeps at least one block
            highest = (blocks - shards + s) * align   # each shard from s on still gets one block (the last, a value)
            bounds.append(min(max(cut, lowest), highest))
        bounds.append(num_params)
        return cls(tuple(bounds), num_buffers)

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_params(self) -> int:
        return self.bounds[-1]

    def slice(self, s: int) -> tuple[int, int]:
        """(start, stop) of shard `s`'s parameters in the flat vector."""
        return self.bounds[s], self.bounds[s + 1]

    def size(self, s: int) -> int:
        """Parameters shard `s` owns."""
        return self.bounds[s + 1] - self.bounds[s]

    def count(self, s: int) -> int:
        """Values in shard `s`'s PUSH and WEIGHTS payloads: its parameters, then (shard 0) the B buffers."""
        return self.size(s) + (self.num_buffers if s == 0 else 0)

    def rank(self, s: int, num_workers: int) -> int:
        """The MPI rank of shard `s` in a job of `num_workers` workers: 0, then N + 1 .. N + S - 1."""
        return 0 if s == 0 else num_workers + s

    def ranks(self, num_workers: int) -> list[int]:
        """The ranks of every shard, shard 0 first."""
        return [self.rank(s, num_workers) for s in range(self.shards)]

    def shard_of(self, rank: int, num_workers: int) -> int:
        """The shard rank `rank` holds (ValueError for a worker's rank or one past the job)."""
        s = 0 if rank == 0 else rank - num_workers
        if not 0 <= s < self.shards or (rank and s == 0):
            raise ValueError(f"rank {rank} is no parameter-server shard (shards: ranks {self.ranks(num_workers)})")
        return s

    def attrs(self) -> dict:
        """What the run log records of the cut: the bounds and each shard's parameter count."""
        return {"servers": self.shards, "shard_bounds": list(self.bounds),
                "shard_params": [self.size(s) for s in range(self.shards)]}

    def describe(self, num_workers: int | None = None) -> str:
        """One line for the console: each shard's slice and share of the message bytes, and its MPI rank in a
        job of `num_workers` workers (None: the shard numbers only)."""
        total = self.num_params + self.num_buffers
        names = [f"rank {s}" if num_workers is None else f"shard {s} (rank {self.rank(s, num_workers)})"
                 for s in range(self.shards)]
        parts = [f"{name} [{a:,}, {b:,}) {100 * self.count(s) / total:.1f} %"
                 for s, (name, (a, b)) in enumerate(zip(names, pairwise(self.bounds), strict=True))]
        return f"{self.shards} parameter-server shards: " + "; ".join(parts)
