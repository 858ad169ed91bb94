"""A worker lost under ULFM, in-process (the server role without MPI; the ULFM runs: tests/mpi/test_elastic.py):
what the async server drops with it, and how a job tells it runs under ULFM."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kit.server import make_server, push, reply, serve_one
from kit.worker import receive, send, start_worker

from mpiasgd.comms import Flag, Message, Tag, ulfm
from mpiasgd.data import DataError, ShardSampler, lost_test_share
from mpiasgd.data import test_slice as slice_of  # (not named test_*: pytest would collect it)
from mpiasgd.model import build_model


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
    ("ssp", 1, ""), ("easgd", 1, ""), ("sync", 1, ""), ("async", 2, ""), ("easgd", 2, "")])
def test_modes_that_cannot_go_on_say_why(tmp_path, mode, servers, expected):
    server, _, _ = make_server(tmp_path, num_workers=2, mode=mode,
                               **({"staleness_bound": 3} if mode == "ssp" else {}),
                               **({"update_rule": "sgd"} if mode in ("async", "ssp") else {}))
    server.role.cfg = dataclasses.replace(server.role.cfg, servers=servers)
    assert server.role.survives().startswith(expected) and (expected or server.role.survives() == "")


def test_ssp_releases_a_reply_held_behind_a_worker_that_died(tmp_path):
    """ssp, bound 0: worker 1 pushes step 2 while worker 2 is at clock 1: held; worker 2 dies: the slowest
    running clock is worker 1's own, and the held reply goes out."""
    server, net, _ = make_server(tmp_path, num_workers=2, mode="ssp", staleness_bound=0, update_rule="sgd")
    role = server.role
    role.begin()
    grad = np.ones(6, np.float32)
    for w in (1, 2):
        net.take(w)
        push(net, w, step=1, version=0, grad=grad)
        serve_one(server)
    assert [len(net.pending(w)) for w in (1, 2)] == [1, 1]  # (worker 1's reply was held until 2 pushed)
    net.take(1), net.take(2)
    push(net, 1, step=2, version=2, grad=grad)
    serve_one(server)
    assert role.gate.holding(1) and net.pending(1) == []
    role.lose_worker(2)
    assert not role.gate.holding(1)
    assert [m[1] for m in net.pending(1)] == [Tag.LOST, Tag.WEIGHTS]


@pytest.mark.parametrize("env,expected", [({}, False), ({"OMPI_MCA_mpi_ft_enable": "true"}, False),
                                          ({"OMPI_MCA_mpi_ft_enable": "1"}, True)])
def test_ulfm_counts_only_what_mpiexec_with_ft_ulfm_sets(monkeypatch, env, expected):
    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert ulfm.enabled() is expected


def test_survivors_are_told_of_each_death_before_their_next_reply(tmp_path):
    """LOST (header only: step = the dead worker's rank, version = its number among the deaths) goes to each
    survivor once, just before its next reply, so a worker knows of it before it uses those weights."""
    server, net, _ = make_server(tmp_path, num_workers=3, update_rule="sgd")
    server.role.begin()
    grad = np.ones(6, np.float32)
    for w in (1, 2, 3):
        net.take(w)
        push(net, w, step=1, version=0, grad=grad)
        serve_one(server)
    assert [m[1] for m in net.pending(1)] == [Tag.WEIGHTS]
    net.take(1)
    server.role.lose_worker(2)
    push(net, 1, step=2, version=3, grad=grad)
    serve_one(server)
    sent = net.pending(1)
    assert [m[1] for m in sent] == [Tag.LOST, Tag.WEIGHTS]
    notice = Message(0)
    notice.buf[:] = np.frombuffer(sent[0][2], np.uint8)
    assert (int(notice.header["step"]), int(notice.header["version"])) == (2, 1)
    net.take(1), net.take(1)
    push(net, 1, step=3, version=4, grad=grad)
    serve_one(server)
    assert [m[1] for m in net.pending(1)] == [Tag.WEIGHTS]  # told once
    push(net, 3, step=2, version=5, grad=grad)
    serve_one(server)
    assert [m[1] for m in net.pending(3)] == [Tag.WEIGHTS, Tag.LOST, Tag.WEIGHTS]  # worker 3's first reply since


@pytest.mark.parametrize("chunk", [1, 8])
def test_the_lost_shards_are_dealt_to_the_survivors_from_the_next_epoch(chunk):
    """Each sample is still read once per epoch: the survivors' epochs after a re-deal cover the training set,
    the epochs before it are unchanged, and a second death re-deals both lost shards."""
    n, shards = 100, 4
    samplers = [ShardSampler(n, shards, s, seed=1, chunk=chunk, window=2) for s in range(shards)]
    before = [s.indices(0) for s in samplers]
    assert sorted(np.concatenate(before).tolist()) == list(range(n))
    for s in (0, 2, 3):
        assert samplers[s].redeal([1]) == 1  # epoch 0 drawn: from epoch 1 on
    np.testing.assert_array_equal(samplers[0].indices(0), before[0])
    epoch1 = np.concatenate([samplers[s].indices(1) for s in (0, 2, 3)])
    assert sorted(epoch1.tolist()) == list(range(n))
    assert len(samplers[0].indices(1)) > len(samplers[0])  # (len: the shard at the start)
    for s in (0, 2):
        assert samplers[s].redeal([1, 3]) == 2
    epoch2 = np.concatenate([samplers[s].indices(2) for s in (0, 2)])
    assert sorted(epoch2.tolist()) == list(range(n))
    with pytest.raises(DataError, match="not this shard"):
        samplers[1].redeal([1])


def test_the_lost_test_slices_are_dealt_to_the_survivors():
    lost = [2, 4]
    shares = [np.concatenate([slice_of(101, 5, w), lost_test_share(101, 5, w, lost)]) for w in (1, 3, 5)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(101))
    assert lost_test_share(101, 5, 1, []).size == 0
    with pytest.raises(DataError, match="among the lost"):
        lost_test_share(101, 5, 2, lost)


def test_a_worker_told_of_a_death_evaluates_a_share_of_its_test_slice(digits):
    """Worker rank 1 of 2 (its 20 test images, kit.worker) hears that worker rank 2 died: its final EVAL covers
    worker rank 2's slice of the 360 test images as well (180..359); a notice naming itself is a ProtocolError."""
    net, _, thread, outcome = start_worker(digits)
    count = build_model("digits").num_params
    send(net, Tag.WEIGHTS, build_model("digits").init_params(0), version=0, step=0)
    receive(net, Tag.PUSH, count)
    net.post(0, 1, Tag.LOST, Message(0).stamp(Tag.LOST, 0, step=2, version=1).buf)
    send(net, Tag.STOP, build_model("digits").init_params(0), version=1, step=1)
    result = receive(net, Tag.EVAL, 0)
    thread.join(10)
    assert "error" not in outcome and int(result.header["samples"]) == 20 + 180

    net, _, thread, outcome = start_worker(digits)
    send(net, Tag.WEIGHTS, build_model("digits").init_params(0), version=0, step=0)
    receive(net, Tag.PUSH, count)
    net.post(0, 1, Tag.LOST, Message(0).stamp(Tag.LOST, 0, step=1, version=1).buf)
    thread.join(10)
    assert "LOST notice 1 from rank 0 tells the death of worker rank 1" in str(outcome.get("error"))


def test_a_worker_told_of_a_return_gives_the_share_back(digits):
    """(--respawn) Worker rank 1 of 2 hears that worker rank 2 died, then that it is back (flag JOINED): its final
    EVAL covers its own 20 test images only. A return of a worker not told dead is a ProtocolError."""
    net, _, thread, outcome = start_worker(digits)
    count = build_model("digits").num_params
    send(net, Tag.WEIGHTS, build_model("digits").init_params(0), version=0, step=0)
    receive(net, Tag.PUSH, count)
    net.post(0, 1, Tag.LOST, Message(0).stamp(Tag.LOST, 0, step=2, version=1).buf)
    net.post(0, 1, Tag.LOST, Message(0).stamp(Tag.LOST, 0, step=2, version=2, flags=Flag.JOINED).buf)
    send(net, Tag.STOP, build_model("digits").init_params(0), version=1, step=1)
    result = receive(net, Tag.EVAL, 0)
    thread.join(10)
    assert "error" not in outcome and int(result.header["samples"]) == 20

    net, _, thread, outcome = start_worker(digits)
    send(net, Tag.WEIGHTS, build_model("digits").init_params(0), version=0, step=0)
    receive(net, Tag.PUSH, count)
    net.post(0, 1, Tag.LOST, Message(0).stamp(Tag.LOST, 0, step=2, version=1, flags=Flag.JOINED).buf)
    thread.join(10)
    assert "LOST notice 1 from rank 0 tells the return of worker rank 2" in str(outcome.get("error"))


def test_the_job_scripts_launch_under_ulfm_with_mpiexec_and_refuse_srun(tmp_path):
    """jobs/launch.sh with FAULT_TOLERANT=1: mpiexec gets ULFM's flags (docs/training.md's launch line); srun is
    refused naming why (Open MPI turns ULFM on through its own launcher only). A stand-in mpiexec records its
    arguments."""
    import os
    import subprocess

    from kit import REPO

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "mpiexec"
    fake.write_text('#!/bin/sh\necho "mpiexec $*" > "$SEEN"\n')
    fake.chmod(0o755)
    seen = tmp_path / "seen.txt"
    script = f'source {REPO / "jobs" / "launch.sh"}; launch 5 train --model digits; echo "rc=$?"'
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MPIASGD_HOME": str(tmp_path), "SEEN": str(seen),
           "SLURM_JOB_ID": "7", "FAULT_TOLERANT": "1"}
    env.pop("VENV", None)
    done = subprocess.run(["bash", "-c", script], env={**env, "LAUNCHER": "mpiexec"}, capture_output=True, text=True,
                          timeout=60)
    assert "rc=0" in done.stdout, done.stdout + done.stderr
    assert seen.read_text().strip() == ("mpiexec -n 5 --with-ft ulfm --mca mpi_ft_detector true --mca "
                                        "mpi_ft_detector_thread true python -m mpiasgd train --model digits")
    done = subprocess.run(["bash", "-c", script], env={**env, "LAUNCHER": "srun"}, capture_output=True, text=True,
                          timeout=60)
    assert "rc=2" in done.stdout and "FAULT_TOLERANT=1 needs LAUNCHER=mpiexec" in done.stderr, done.stderr


def test_min_workers_counts_a_worker_whose_replacement_starts_until_it_fails(tmp_path):
    """(--respawn) With --min-workers 3 of 3 workers, a death whose replacement rank 0 starts does not end the run
    (the worker is coming back); when that replacement does not start, the run ends there, status failed."""
    from types import SimpleNamespace

    from mpiasgd.rank0.loop import Preempted

    server, _, log = make_server(tmp_path, num_workers=3, min_workers=3, respawn=True)
    r0 = server.r0
    spawned = []
    r0.respawner = SimpleNamespace(pending={}, will_replace=lambda w: True, spawn=spawned.append)
    server.role.begin()
    r0.lose([2])
    assert spawned == [2] and r0.role.lost == {2} and not r0.preempted
    r0.respawner.pending[2] = object()  # starting: still counted
    r0.short_of_workers(2, "an earlier one")
    assert not r0.preempted
    del r0.respawner.pending[2]
    with pytest.raises(Preempted):
        r0.short_of_workers(2, "the replacement for worker rank 2 could not start: DataError")
    assert "2 workers left, fewer than --min-workers 3" in r0.preempted and log.ended
    server2, _, _ = make_server(tmp_path / "b", num_workers=3, min_workers=3, respawn=True)
    server2.r0.respawner = SimpleNamespace(pending={}, will_replace=lambda w: False, spawn=spawned.append)  # (no
    # replacement: the death itself ends the run, as without --respawn)
    server2.role.begin()
    with pytest.raises(Preempted):
        server2.r0.lose([3])
    assert spawned == [2] and "fewer than --min-workers 3" in server2.r0.preempted


def test_a_dropped_worker_is_not_named_dead_at_a_signal(tmp_path):
    """(a new user's trial) A worker dropped under ULFM and not brought back: a signal that follows ends the run as
    preempted, not as failed by that worker's death (`exited_workers` leaves the dropped ones out)."""
    import socket
    import subprocess
    import sys

    server, _, _ = make_server(tmp_path, num_workers=3)
    r0 = server.r0
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    r0.pids = {2: (socket.gethostname(), ended.pid), 3: (socket.gethostname(), ended.pid)}
    assert [w for w, _, _ in r0.exited_workers()] == [2, 3]
    r0.role.lose_worker(2)
    assert [w for w, _, _ in r0.exited_workers()] == [3]
