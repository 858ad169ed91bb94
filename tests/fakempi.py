"""An in-process stand-in for the part of mpi4py's communicator the roles use, for unit tests.

`Network` holds one queue of messages per rank; `Network.comm(rank)` returns a communicator with
Isend (eager: the bytes are copied at once), Irecv, Improbe/Message.Recv and Get_rank/Get_size.
Tests inject crafted messages (reordered, stale, duplicate, malformed) with `Network.post` and
drive a role's `handle`, or run a role in a thread and play its peers.
"""

from __future__ import annotations

import threading

import numpy as np
from mpi4py import MPI


class Truncated(RuntimeError):
    pass


class Network:
    def __init__(self, size: int) -> None:
        self.size = size
        self.queues: dict[int, list[tuple[int, int, bytes]]] = {r: [] for r in range(size)}
        self.lock = threading.Lock()

    def comm(self, rank: int) -> FakeComm:
        return FakeComm(self, rank)

    def post(self, source: int, dest: int, tag: int, data) -> None:
        """Deliver bytes `data` (a numpy buffer or bytes) from `source` to `dest` with `tag`."""
        with self.lock:
            self.queues[dest].append((source, int(tag), bytes(np.asarray(data, dtype=np.uint8).tobytes()
                                                               if not isinstance(data, bytes) else data)))

    def take(self, dest: int, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG):
        """Remove and return the first (source, tag, bytes) queued for `dest` that matches, or None."""
        with self.lock:
            for i, (s, t, _data) in enumerate(self.queues[dest]):
                if source in (MPI.ANY_SOURCE, s) and tag in (MPI.ANY_TAG, t):
                    return self.queues[dest].pop(i)
        return None

    def pending(self, dest: int) -> list[tuple[int, int, bytes]]:
        with self.lock:
            return list(self.queues[dest])


def _fill(status, source: int, tag: int, nbytes: int) -> None:
    if status is not None:
        status.Set_source(source)
        status.Set_tag(tag)
        status.Set_elements(MPI.BYTE, nbytes)


def _copy_into(buf: np.ndarray, data: bytes) -> None:
    if len(data) > buf.nbytes:
        raise Truncated(f"message of {len(data)} bytes into a buffer of {buf.nbytes}")
    buf.view(np.uint8)[: len(data)] = np.frombuffer(data, dtype=np.uint8)


class DoneRequest:
    def Test(self, status=None) -> bool:
        return True

    def Wait(self, status=None) -> None:
        return None


class RecvRequest:
    def __init__(self, net: Network, rank: int, buf: np.ndarray, source: int, tag: int) -> None:
        self.net, self.rank, self.buf, self.source, self.tag = net, rank, buf, source, tag
        self.done = False
        self.envelope = None

    def Test(self, status=None) -> bool:
        if not self.done:
            got = self.net.take(self.rank, self.source, self.tag)
            if got is None:
                return False
            source, tag, data = got
            _copy_into(self.buf, data)
            self.envelope = (source, tag, len(data))
            self.done = True
        _fill(status, *self.envelope)
        return True


class FakeMessage:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def Recv(self, buf, status=None) -> None:
        _copy_into(np.asarray(buf), self.data)


class FakeComm:
    def __init__(self, net: Network, rank: int) -> None:
        self.net, self.rank = net, rank

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.net.size

    def Isend(self, buf, dest: int, tag: int) -> DoneRequest:
        self.net.post(self.rank, dest, tag, bytes(np.asarray(buf).tobytes()))
        return DoneRequest()

    def Irecv(self, buf, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> RecvRequest:
        return RecvRequest(self.net, self.rank, np.asarray(buf), source, tag)

    def Improbe(self, source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, status=None):
        got = self.net.take(self.rank, source, tag)
        if got is None:
            return None
        s, t, data = got
        _fill(status, s, t, len(data))
        return FakeMessage(data)
