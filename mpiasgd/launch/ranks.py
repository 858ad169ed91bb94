"""Who each process is: its rank, its node's workers, its BLAS threads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from mpiasgd.device import local_worker_rank


@dataclass
class Rank:
    """Who this process is: `rank` in `comm` of `size`; rank 0 is the parameter server."""

    comm: Any
    rank: int
    size: int
    host: str

    @property
    def is_server(self) -> bool:
        return self.rank == 0

    @property
    def num_workers(self) -> int:
        return self.size - 1


def node_workers(me: Rank) -> tuple[int, int]:
    """Collective: (workers on this rank's node, this worker's index among them; -1 on the server).

    The index is the local rank used to pick a GPU; the parameter server takes none, so it is not counted.
    """
    node = me.comm.Split_type(MPI.COMM_TYPE_SHARED)  # collective: every rank calls it
    is_worker = node.allgather(not me.is_server)
    node_rank = node.Get_rank()
    node.Free()
    if me.is_server:
        return sum(is_worker), -1
    index, count = local_worker_rank(is_worker, node_rank)
    return count, index


def blas_threads(me: Rank, requested: int, workers_here: int) -> int:
    """BLAS threads for this rank: `requested`, or (0) the cores this rank may use / workers sharing them.

    The server gets 1 (it only runs vector updates). Workers on one node split the node's cores, so
    ranks never oversubscribe them: 2 workers on 2 cores get 1 thread each.
    """
    if me.is_server:
        return 1
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers_here))
