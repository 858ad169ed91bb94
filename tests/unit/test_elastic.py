"""A worker lost under ULFM, in-process (the server role without MPI; the ULFM runs: tests/mpi/test_elastic.py):
what the async server drops with it, and how a job tells it runs under ULFM."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kit.server import make_server, push, reply, serve_one

from mpiasgd.comms import ulfm


def test_a_lost_worker_leaves_the_sum_of_momenta_the_waits_and_the_look_ahead(tmp_path):
    server, net, _ = make_server(tmp_path, num_workers=3, update_rule="dana-zero", momentum=0.9)
    server.role.begin()
    rng = np.random.default_rng(0)
    for w in (1, 2, 3):
        net.take(w)
        push(net, w, step=1, version=0, grad=rng.standard_normal(6).astype(np.float32))
        serve_one(server)
        reply(net, w)
    role = server.role
    push(net, 2, step=2, version=1, grad=rng.standard_normal(6).astype(np.float32))
    serve_one(server)  # its reply posted, not received: worker rank 2 dies with it in flight
    assert role.out[2].pending()
    v1, v3 = role.dana.velocities[1].copy(), role.dana.velocities[3].copy()
    assert role.survives() == "" and role.waiting_for() == [1, 2, 3]
    role.lose_worker(2)
    np.testing.assert_allclose(role.dana.total, v1 + v3, rtol=1e-6, atol=1e-7)
    assert 2 not in role.dana.velocities and role.waiting_for() == [1, 3] and not role.done()
    assert role.out[2].pending() == []  # (its reply's send is dropped: to a dead rank it may never complete)


def test_lookahead_auto_and_momentum_for_workers_follow_the_workers_left(tmp_path):
    server, _, _ = make_server(tmp_path, num_workers=3, update_rule="sgd", momentum=0.9, lookahead=-1.0,
                               async_momentum="workers")
    role = server.role
    assert role.optimizer.momentum == np.float32(0.9 - (1 - 1 / 3))
    role.lose_worker(3)
    assert role.optimizer.momentum == np.float32(0.9 - (1 - 1 / 2))
    m = 0.9 - 0.5
    assert role.lookahead.factor == pytest.approx(m * (1 - m ** 1) / (1 - m))  # K = N - 1 = 1 for 2 workers


@pytest.mark.parametrize("mode,servers,expected", [
    ("ssp", 1, "mode 'ssp' does not drop a dead worker yet"), ("async", 2, "--servers S > 1 does not drop")])
def test_modes_that_cannot_go_on_say_why(tmp_path, mode, servers, expected):
    server, _, _ = make_server(tmp_path, num_workers=2, mode=mode, update_rule="sgd",
                               **({"staleness_bound": 3} if mode == "ssp" else {}))
    server.role.cfg = dataclasses.replace(server.role.cfg, servers=servers)
    assert server.role.survives().startswith(expected)


@pytest.mark.parametrize("env,expected", [({}, False), ({"OMPI_MCA_mpi_ft_enable": "true"}, False),
                                          ({"OMPI_MCA_mpi_ft_enable": "1"}, True)])
def test_ulfm_counts_only_what_mpiexec_with_ft_ulfm_sets(monkeypatch, env, expected):
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert ulfm.enabled() is expected
