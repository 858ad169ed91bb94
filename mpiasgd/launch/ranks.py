"""Who each process is: its rank, its node's workers, its BLAS threads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from mpiasgd.device import local_worker_rank


@dataclass
class Rank:
    """Who this process is: `rank` in `comm` of `size`, in a job of `servers` parameter-server shards
    (--servers S) and size - S workers. Rank 0 is the parameter server (shard 0) and the only writer of the
    run log; workers are ranks 1..N; shard s >= 1 is rank N + s (`mpiasgd.comms.shard_cut`)."""

    comm: Any
    rank: int
    size: int
    host: str
    servers: int = 1
    node_ranks: int = 1  # ranks of the job on this rank's node (set by `node_workers`)
    node_cores: int = 1  # cores those ranks may use between them: the union of their CPU affinities (idem)

    @property
    def num_workers(self) -> int:
        return self.size - self.servers

    @property
    def is_rank0(self) -> bool:
        """Rank 0: the parameter server (shard 0), the run log's writer, the one who prints start-up errors."""
        return self.rank == 0

    @property
    def is_shard(self) -> bool:
        """A parameter-server shard of rank >= 1 (--servers S > 1): ranks N + 1 .. N + S - 1."""
        return self.rank > self.num_workers

    @property
    def is_worker(self) -> bool:
        return 1 <= self.rank <= self.num_workers


def node_workers(me: Rank) -> tuple[int, int]:
    """Collective: (workers on this rank's node, this worker's index among them; -1 on a server rank).

    The index is the local rank used to pick a GPU; the parameter-server ranks (rank 0 and the shards) take
    none, so they are not counted. Sets `me.node_ranks` and `me.node_cores` (--server-wait auto).
    """
    node = me.comm.Split_type(MPI.COMM_TYPE_SHARED)  # collective: every rank calls it
    gathered = node.allgather((me.is_worker, sorted(cpus())))
    is_worker = [w for w, _ in gathered]
    me.node_ranks, me.node_cores = len(gathered), len(set().union(*(c for _, c in gathered)))
    node_rank = node.Get_rank()
    node.Free()
    if not me.is_worker:
        return sum(is_worker), -1
    index, count = local_worker_rank(is_worker, node_rank)
    return count, index


def blas_threads(me: Rank, requested: int, workers_here: int, server_claim: int = 0) -> int:
    """BLAS threads for this rank: `requested`, or (0) the cores this rank may use, less the `server_claim`
    cores the node's parameter-server ranks keep busy (`server_cores`), shared by the workers on the node.

    The server ranks (rank 0 and the shards) get 1 (their update has threads of its own: --server-threads).
    Workers on one node split the node's cores, so ranks never oversubscribe them: 2 workers on 2 cores get 1
    thread each; 2 workers on 16 cores beside a spinning server 7 each.
    """
    if not me.is_worker:
        return 1
    if requested:
        return requested
    return max(1, (len(cpus()) - server_claim) // max(1, workers_here))


def server_cores(me: Rank, server_threads: int, spins: bool, workers_here: int) -> int:
    """(after `node_workers`) The cores the parameter-server ranks on this rank's node keep busy: each its
    `server_threads` (--server-threads) where more than one, else one where it spins (`spins`: --server-wait as
    resolved for this node, `mpiasgd.comms.waits.server_wait`), else none (a server that backs off between
    polls shares a core)."""
    servers = max(0, me.node_ranks - workers_here)
    return servers * (server_threads if server_threads > 1 else int(spins))


def cpus() -> set[int]:
    """The CPUs this process may run on (its affinity; where there is none to read, every CPU)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
