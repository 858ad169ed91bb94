"""(work in progress, issue 40: --respawn) RoutedComm over the fake network: a joined worker on a communicator of
its own is reached, and heard, under its worker rank."""

from __future__ import annotations

import numpy as np
import pytest
from kit.fakempi import Network
from mpi4py import MPI

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


def test_a_dropped_worker_that_rejoins_is_awaited_and_counted_again(tmp_path):
    """(--respawn) DANA-Zero with 3 workers: worker 2 dropped then back: a zero momentum of its own (the sum
    unchanged), awaited again, and --async-momentum workers counts 3 again."""
    from kit.server import make_server, push, reply, serve_one

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
    assert role.waiting_for() == [1, 2, 3] and 2 not in role.lost
    with pytest.raises(ValueError, match="was not dropped"):
        role.rejoin_worker(2)
    server, _, _ = make_server(tmp_path / "m", num_workers=3, update_rule="sgd", momentum=0.9,
                               async_momentum="workers")
    server.role.lose_worker(3)
    server.role.rejoin_worker(3)
    assert server.role.optimizer.momentum == np.float32(0.9 - (1 - 1 / 3))
