"""The transport of `mpiasgd simulate`: the part of mpi4py's communicator, status and message that rank 0's
loop and the roles use, in one process on a virtual clock. No MPI call is made (mpi4py is not initialised).

A send copies the whole message (header + payload) the moment it is posted, as a buffered MPI send would
(the role may write its buffer again right after), and hands it to the engine with the virtual time it
leaves (`send_time`, which the engine sets); the request returned has completed. Receives are not
posted: the engine hands each arriving message to rank 0's `handle` as a probed message (`Arrived`,
`Envelope`) and copies each reply into a worker's receive buffer itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpiasgd.comms import ProtocolError


class Done:
    """A request that completed when it was posted (its message was copied)."""

    def Test(self, status: Any = None) -> bool:
        return True

    def Wait(self, status: Any = None) -> None:
        return None


class Envelope:
    """What an MPI status says of a message: `source` rank, `tag`, size `nbytes` (Get_count counts bytes;
    rank 0 only asks for MPI.BYTE)."""

    def __init__(self, source: int, tag: int, nbytes: int) -> None:
        self.source, self.tag, self.nbytes = source, tag, nbytes

    def Get_source(self) -> int:
        return self.source

    def Get_tag(self) -> int:
        return self.tag

    def Get_count(self, datatype: Any = None) -> int:
        return self.nbytes


class Arrived:
    """A probed message (mpi4py's MPI.Message): `Recv(buf)` copies its bytes into `buf` (ProtocolError if
    they do not fit, as MPI's truncation error)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def Recv(self, buf: Any, status: Any = None) -> None:
        out = np.asarray(buf).view(np.uint8)
        if len(self.data) > out.size:
            raise ProtocolError(f"simulate: a message of {len(self.data)} bytes into a receive buffer of {out.size}")
        out[:len(self.data)] = np.frombuffer(self.data, np.uint8)


class VirtualComm:
    """The communicator of virtual rank `rank` of `size`: `Isend(buf, dest, tag)` copies `buf` and calls
    `post(source, dest, tag, data, send_time)`; `send_time` (virtual seconds) is when the message leaves,
    set by the engine before the sender runs."""

    def __init__(self, rank: int, size: int, post: Callable[[int, int, int, bytes, float], None]) -> None:
        self.rank, self.size, self.post = rank, size, post
        self.send_time = 0.0

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Isend(self, buf: Any, dest: int, tag: int) -> Done:
        self.post(self.rank, int(dest), int(tag), np.asarray(buf).tobytes(), self.send_time)  # copied now
        return Done()

    def Irecv(self, buf: Any, source: int = -1, tag: int = -1) -> Any:
        raise NotImplementedError("simulate: receives are not posted; the engine delivers each message itself")

    def Improbe(self, source: int = -1, tag: int = -1, status: Any = None) -> Any:
        raise NotImplementedError("simulate: rank 0 is not probed; the engine hands it each message in time order")
