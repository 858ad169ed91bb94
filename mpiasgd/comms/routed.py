"""(`--respawn`, `--attach`) Rank 0's communicator when some workers live on communicators of
their own: a replacement worker started with `MPI_Comm_spawn` talks to rank 0 on the 2-rank communicator of
`Intercomm_merge` (rank 0 there is rank 0, the worker rank 1), yet keeps the worker rank W of the one it
replaces, so the roles go on calling `comm.Isend(buf, dest=W, ...)` and reading `status.Get_source()` as
before. RoutedComm routes each send and receive by worker rank, and probes every communicator in turn (but
those of joined workers reported dead), setting the status's source to the worker rank (`Status.Set_source`). A
message on COMM_WORLD from a rank a replacement took (sent by the dead worker before it died, delivered late) is
received and discarded (`stale`).

Measured with the wheel's Open MPI 5.0.11 (docs/training.md, workers that die): spawn + merge take 1.2-2.6 s,
also under ULFM.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd.comms import ulfm

JOINED_RANK = 1  # a joined worker's rank on its merged communicator (rank 0 is rank 0)


class RoutedComm:
    """`base` (COMM_WORLD) plus `joined` {worker rank: its merged communicator}: the calls rank 0's loop and roles
    make (Isend, Irecv, Improbe, Get_rank, Get_size, Abort, and ULFM's Ack_failed, Get_failed, Get_group on
    `base`), each routed by worker rank."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self.joined: dict[int, Any] = {}
        self.dead: set[int] = set()  # joined workers whose death was reported (`failed_ranks`): no longer probed
        self.stale = 0  # messages of dead workers whose rank a replacement took, discarded

    def join(self, w: int, comm: Any) -> None:
        """Worker rank `w` now lives on `comm` (rank JOINED_RANK there): every call for `w` goes to it."""
        self.joined[w] = comm
        self.dead.discard(w)

    def route(self, rank: int) -> tuple[Any, int]:
        """(the communicator, the rank on it) of worker rank `rank`."""
        comm = self.joined.get(rank)
        return (self.base, rank) if comm is None else (comm, JOINED_RANK)

    # --- point to point ---
    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Any:
        comm, r = self.route(dest)
        return comm.Isend(buf, dest=r, tag=tag)

    def Irecv(self, buf: Any, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> Any:
        if source == MPI.ANY_SOURCE and self.joined:
            raise ValueError("RoutedComm.Irecv from any source: post it per worker (the joined ones live on "
                             "communicators of their own)")
        comm, r = (self.base, source) if source == MPI.ANY_SOURCE else self.route(source)
        return comm.Irecv(buf, source=r, tag=tag)

    def Improbe(self, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status: Any = None) -> Any:
        """A matched message from `source` (any: `base` first, then each joined worker's communicator), or None;
        `status` (if given) then names the worker rank as its source."""
        if source != MPI.ANY_SOURCE:
            comm, r = self.route(source)
            found = comm.Improbe(source=r, tag=tag, status=status)
            if found is not None and status is not None and comm is not self.base:
                status.Set_source(source)
            return found
        status = status if status is not None else MPI.Status()
        while True:
            found = self.base.Improbe(source=MPI.ANY_SOURCE, tag=tag, status=status)
            if found is None or status.Get_source() not in self.joined:
                break
            found.Recv(np.empty(max(1, status.Get_count(MPI.BYTE)), np.uint8))  # the dead worker's: not merged
            self.stale += 1
        if found is not None:
            return found
        for w, comm in self.joined.items():
            if w in self.dead:  # (a probe there raises its failure again: the workers after it would starve)
                continue
            found = comm.Improbe(source=JOINED_RANK, tag=tag, status=status)
            if found is not None:
                if status is not None:
                    status.Set_source(w)
                return found
        return None

    # --- ULFM ---
    def failed_ranks(self) -> list[int]:
        """(`ulfm.failed_ranks`) The worker ranks known dead, each failure acknowledged: those of COMM_WORLD whose
        rank no replacement took, and each joined worker whose communicator reports its death; ascending."""
        dead = [r for r in ulfm.failed_ranks(self.base) if r not in self.joined]
        gone = [w for w, comm in self.joined.items() if w in self.dead or ulfm.failed_ranks(comm)]
        self.dead.update(gone)
        return sorted(dead + gone)

    # --- the rest: COMM_WORLD's ---
    def Get_rank(self) -> int:
        return self.base.Get_rank()

    def Get_size(self) -> int:
        return self.base.Get_size()

    def __getattr__(self, name: str) -> Any:  # Abort, Ack_failed, Get_failed, Get_group: the job's own
        return getattr(self.base, name)
