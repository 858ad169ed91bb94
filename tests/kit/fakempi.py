"""An in-process stand-in for the part of mpi4py's communicator the roles use, for unit tests.

`Network` holds one queue of messages per rank; `Network.comm(rank)` returns a communicator with
Isend (eager: the bytes are copied at once), Irecv, Improbe/Message.Recv and Get_rank/Get_size.
Tests inject crafted messages (reordered, stale, duplicate, malformed) with `Network.post` and
drive a role's `handle`, or run a role in a thread and play its peers. `Group(size).comm(rank)` adds
`Iallreduce` among threads, for the communicators a mode splits off (sync's workers, a pipeline's).
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


# --- rank 0 in-process ----------------------------------------------------------------------------------


class Rank0View:
    """A rank-0 loop seen as one object, as tests read it: an attribute is looked up on the loop
    (`Rank0`: handle, tick, run, comm, cfg, last_seen), then its recorder (version, stop_reason, log,
    checkpoint_path, start, ...), then its mode's role (params, last_step, held, start_workers, ...);
    setting one sets it where it lives."""

    def __init__(self, r0) -> None:
        object.__setattr__(self, "r0", r0)

    def _owner(self, name: str):
        r0 = object.__getattribute__(self, "r0")
        for part in (r0, r0.rec, r0.role):
            if hasattr(part, name):
                return part
        raise AttributeError(name)

    def __getattr__(self, name: str):
        return getattr(self._owner(name), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._owner(name), name, value)


def rank0(comm, cfg, params, decay_mask, num_workers: int, num_train: int, log, progress=None, model=None,
          dataset=None, layout=None, health=None) -> Rank0View:
    """Rank 0 of mode `cfg.mode` over `comm`, as `mpiasgd.rank0.serve` builds it (no gather, no log creation)."""
    from mpiasgd.modes.base import Layout
    from mpiasgd.modes.registry import load
    from mpiasgd.rank0.loop import Rank0
    from mpiasgd.rank0.recorder import Recorder

    mode = load(cfg.mode)
    rec = Recorder(cfg, log, range(1, num_workers + 1), num_train, progress, health)
    layout = layout or Layout.data_parallel(num_workers)
    return Rank0View(Rank0(comm, cfg, rec, lambda r0: mode.rank0(r0, params, decay_mask, model, dataset, layout)))


# --- collectives among threads ---------------------------------------------------------------------------

REDUCTIONS = {"SUM": np.add, "MAX": np.maximum}  # the ops the fake Iallreduce does (mpi4py's Op is unhashable)


def op_name(op) -> str:
    """"SUM" or "MAX" for MPI.SUM or MPI.MAX; NotImplementedError for another op."""
    for name in REDUCTIONS:
        if op == getattr(MPI, name):
            return name
    raise NotImplementedError(f"fake Iallreduce: op {op} (only MPI.SUM and MPI.MAX)")


class Group(Network):
    """A Network whose communicators also reduce: `Group(size).comm(rank)` is a `GroupComm`, one per thread.

    Stands in for a communicator made by `comm.Split` (sync mode's workers; a pipeline's replica or
    module): point-to-point as `Network`, plus `Iallreduce` as one collective among all `size` ranks.
    """

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.rounds: dict[int, Round] = {}  # the i-th collective call of every rank -> its contributions

    def comm(self, rank: int) -> GroupComm:
        return GroupComm(self, rank)

    def contribute(self, call: int, rank: int, values: np.ndarray, op: str) -> Round:
        """Rank `rank`'s contribution to its `call`-th collective. ValueError when it does not match the
        others' (another op, dtype or size: the ranks called different collectives)."""
        with self.lock:
            got = self.rounds.setdefault(call, Round(op, values.dtype, values.shape))
            if (op, values.dtype, values.shape) != (got.op, got.dtype, got.shape):
                raise ValueError(f"fake Iallreduce #{call}: rank {rank} gave op {op}, {values.dtype} "
                                 f"{values.shape}; the others {got.op}, {got.dtype} {got.shape}")
            got.values[rank] = values.copy()  # MPI owns the buffer until the request completes: copy now
            return got

    def result(self, call: int, rnd: Round) -> np.ndarray | None:
        """The reduction of collective `call`, once all ranks contributed (None before). It is reduced in
        rank order, so every rank gets the same bits (as a deterministic MPI reduction would)."""
        with self.lock:
            if len(rnd.values) < self.size:
                return None
            if rnd.result is None:
                reduce = REDUCTIONS[rnd.op]
                rnd.result = rnd.values[0].copy()
                for r in range(1, self.size):
                    reduce(rnd.result, rnd.values[r], out=rnd.result)
            rnd.readers += 1
            if rnd.readers == self.size:  # every rank has its copy: forget the round
                self.rounds.pop(call, None)
            return rnd.result


class Round:
    """One collective call: the op, dtype and shape every rank must give, and what each gave."""

    def __init__(self, op: str, dtype, shape) -> None:
        self.op, self.dtype, self.shape = op, dtype, shape
        self.values: dict[int, np.ndarray] = {}
        self.result: np.ndarray | None = None
        self.readers = 0


class AllreduceRequest:
    """Completes (Test() True) once every rank of the group has called the same Iallreduce; then the
    reduction is in `buf`."""

    def __init__(self, group: Group, call: int, rnd: Round, buf: np.ndarray) -> None:
        self.group, self.call, self.round, self.buf = group, call, rnd, buf
        self.done = False

    def Test(self, status=None) -> bool:
        if not self.done:
            result = self.group.result(self.call, self.round)
            if result is None:
                return False
            self.buf[...] = result
            self.done = True
        return True


class GroupComm(FakeComm):
    """A rank of a `Group`: FakeComm plus `Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM | MPI.MAX)`."""

    def __init__(self, group: Group, rank: int) -> None:
        super().__init__(group, rank)
        self.calls = 0  # collectives this rank has called: matches its i-th with the others' i-th

    def Iallreduce(self, sendbuf, recvbuf, op) -> AllreduceRequest:
        if sendbuf is not MPI.IN_PLACE:
            raise NotImplementedError("fake Iallreduce: only in place (sendbuf MPI.IN_PLACE)")
        buf = np.asarray(recvbuf)
        call, self.calls = self.calls, self.calls + 1
        return AllreduceRequest(self.net, call, self.net.contribute(call, self.rank, buf, op_name(op)), buf)
