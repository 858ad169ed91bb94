"""(--respawn) RoutedComm over the fake network: a joined worker on a communicator of its own is reached, and heard,
under its worker rank; a late message of the dead worker it replaced is discarded; the failed ranks it reports are
worker ranks. The server's side of a rejoin (DANA-Zero, the counted workers). End to end: tests/mpi/test_elastic.py."""

from __future__ import annotations

import numpy as np
import pytest
from kit.fakempi import Network
from kit.server import make_server, push, reply, serve_one
from mpi4py import MPI

from mpiasgd.comms import Flag, ulfm
from mpiasgd.comms.routed import JOINED_RANK, RoutedComm


def test_a_joined_worker_is_reached_and_heard_under_its_worker_rank():
    world, merged = Network(4), Network(2)  # rank 0 and workers 1-3; rank 0 and the replacement of worker 2
    comm = RoutedComm(world.comm(0))
    comm.join(2, merged.comm(0))
    comm.Isend(np.array([7], np.uint8), dest=2, tag=11)
    comm.Isend(np.array([8], np.uint8), dest=3, tag=11)
    assert merged.take(JOINED_RANK) == (0, 11, b"\x07") and world.take(3) == (0, 11, b"\x08")
    assert world.pending(2) == []  # (the dead worker's rank on COMM_WORLD gets nothing)
    merged.post(JOINED_RANK, 0, 12, b"\x09")
    world.post(1, 0, 12, b"\x0a")
    status = MPI.Status()
    first = comm.Improbe(MPI.ANY_SOURCE, 12, status)
    assert status.Get_source() == 1  # COMM_WORLD first
    buf = np.empty(1, np.uint8)
    first.Recv(buf)
    assert buf[0] == 10
    second = comm.Improbe(MPI.ANY_SOURCE, 12, status)
    assert status.Get_source() == 2  # the joined worker, named by its worker rank
    second.Recv(buf)
    assert buf[0] == 9 and comm.Improbe(MPI.ANY_SOURCE, 12, status) is None
    merged.post(JOINED_RANK, 0, 13, b"\x01")
    assert comm.Improbe(2, 13, status) is not None and status.Get_source() == 2
    with pytest.raises(ValueError, match="from any source"):
        comm.Irecv(buf)
    assert comm.Get_rank() == 0 and comm.Get_size() == 4


def test_a_late_message_of_the_replaced_worker_is_discarded():
    world, merged = Network(4), Network(2)
    comm = RoutedComm(world.comm(0))
    comm.join(2, merged.comm(0))
    world.post(2, 0, 12, b"\x05\x06")  # sent by the dead worker rank 2 before it died
    world.post(3, 0, 12, b"\x07")
    status = MPI.Status()
    found = comm.Improbe(MPI.ANY_SOURCE, 12, status)
    assert found is not None and status.Get_source() == 3 and comm.stale == 1
    assert comm.Improbe(MPI.ANY_SOURCE, 12, status) is None and world.pending(0) == []


class Failures:
    """The ULFM calls `ulfm.failed_ranks` makes, on a communicator whose ranks `dead` have failed."""

    def __init__(self, size: int, dead: list[int]) -> None:
        self.size, self.dead, self.acked = size, dead, False

    def Ack_failed(self) -> None:
        self.acked = True

    def Get_failed(self):
        return FailedGroup(self.dead)

    def Get_group(self):
        return FailedGroup(list(range(self.size)))


class FailedGroup:
    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks

    def Get_size(self) -> int:
        return len(self.ranks)

    def Free(self) -> None:
        pass


def test_the_failed_ranks_are_worker_ranks(monkeypatch):
    """COMM_WORLD's failed rank 2 was replaced (not reported again); rank 3 died; the replacement of rank 1 died on
    its own communicator: ranks 1 and 3 are reported, every failure acknowledged."""
    class Groups:  # mpi4py's Group.Translate_ranks for these groups (its types cannot be patched)
        UNDEFINED = MPI.UNDEFINED

        class Group:
            @staticmethod
            def Translate_ranks(group, ranks, other):
                return [group.ranks[r] for r in ranks]

    monkeypatch.setattr(ulfm, "MPI", Groups)
    world, first, second = Failures(4, [2, 3]), Failures(2, [JOINED_RANK]), Failures(2, [])
    comm = RoutedComm(world)
    comm.join(1, first)
    comm.join(2, second)
    assert ulfm.failed_ranks(comm) == [1, 3] and world.acked and first.acked and second.acked


def test_a_dropped_worker_that_rejoins_is_awaited_and_counted_again(tmp_path):
    """(--respawn) DANA-Zero with 3 workers: worker 2 dropped then back: a zero momentum of its own (the sum
    unchanged), awaited again, told to the others (a notice with flag JOINED after the death's), and --async-momentum
    workers counts 3 again."""
    server, net, _ = make_server(tmp_path, num_workers=3, update_rule="dana-zero", momentum=0.9)
    role = server.role
    role.begin()
    rng = np.random.default_rng(0)
    for w in (1, 2, 3):
        net.take(w)
        push(net, w, step=1, version=0, grad=rng.standard_normal(6).astype(np.float32))
        serve_one(server)
        reply(net, w)
    role.lose_worker(2)
    total = role.dana.total.copy()
    role.rejoin_worker(2)
    assert not role.dana.velocities[2].any() and np.array_equal(role.dana.total, total)
    assert role.waiting_for() == [1, 2, 3] and 2 not in role.lost and role.lost_order == []
    assert role.notice_order == [(2, 0), (2, int(Flag.JOINED))] and 2 in role.rejoined
    assert role.periodic.workers == [1, 2, 3]  # asked again at the next --eval-interval evaluation
    with pytest.raises(ValueError, match="was not dropped"):
        role.rejoin_worker(2)
    server, _, _ = make_server(tmp_path / "m", num_workers=3, update_rule="sgd", momentum=0.9,
                               async_momentum="workers")
    server.role.lose_worker(3)
    server.role.rejoin_worker(3)
    assert server.role.optimizer.momentum == np.float32(0.9 - (1 - 1 / 3))


def test_an_ssp_replacement_starts_at_the_slowest_clock(tmp_path):
    """(--respawn, ssp) Worker 2 died after step 1 while the others went on to step 3: its replacement continues
    from step 1, and its clock starts at the slowest running clock (3), not 1 + 3 (it would be held until the others
    had made three more pushes)."""
    server, net, _ = make_server(tmp_path, num_workers=3, mode="ssp", staleness_bound=2, update_rule="sgd")
    role = server.role
    role.begin()
    rng = np.random.default_rng(0)
    for w in (1, 2, 3):
        net.take(w)
    for step in (1, 2, 3):
        for w in ((1, 2, 3) if step == 1 else (1, 3)):
            push(net, w, step=step, version=role.counter.version, grad=rng.standard_normal(6).astype(np.float32))
            serve_one(server)
            reply(net, w)
        if step == 1:
            role.lose_worker(2)
    role.rejoin_worker(2)
    role.join_worker(2)
    assert role.last_step[2] == 1 and role.gate.clock(2) == role.gate.slowest_clock() == 3


class DeadPeer:
    """A joined worker's communicator whose peer died: every probe raises ULFM's failure; its failed ranks."""

    def __init__(self) -> None:
        self.probes = 0

    def Improbe(self, source, tag, status):
        self.probes += 1
        raise MPI.Exception(MPI.ERR_PROC_FAILED)


def test_a_dead_joined_worker_does_not_starve_the_joined_workers_after_it(monkeypatch):
    """(a new user's trial) Joined workers 2 and 3; 2 dies: its probe raises once, rank 0 hears of it
    (`failed_ranks`), and from then on joined worker 3 is heard (it was starved: every probe stopped at 2's
    failure). A new replacement for 2 is probed again."""
    world, merged3, again = Network(4), Network(2), Network(2)
    comm = RoutedComm(world.comm(0))
    dead = DeadPeer()
    comm.join(2, dead)
    comm.join(3, merged3.comm(0))
    living = (comm.base, comm.joined[3])
    merged3.post(JOINED_RANK, 0, 12, b"\x03")
    status = MPI.Status()
    with pytest.raises(MPI.Exception):
        comm.Improbe(MPI.ANY_SOURCE, 12, status)
    monkeypatch.setattr(ulfm, "failed_ranks", lambda c: [] if any(c is x for x in living) else [JOINED_RANK])
    assert comm.failed_ranks() == [2]
    found = comm.Improbe(MPI.ANY_SOURCE, 12, status)
    assert found is not None and status.Get_source() == 3 and dead.probes == 1
    assert comm.failed_ranks() == [2]  # (still dead, still reported: rank 0 drops it once)
    comm.join(2, again.comm(0))
    again.post(JOINED_RANK, 0, 12, b"\x02")
    assert comm.Improbe(MPI.ANY_SOURCE, 12, status) is not None and status.Get_source() == 2
