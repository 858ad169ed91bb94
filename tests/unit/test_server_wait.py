"""--server-wait: the flag and its errors, auto's choice from the ranks and cores of a node, the line rank 0
says, and the server's poll that never sleeps when it spins (the multi-rank runs: tests/mpi/test_server_wait.py)."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
from mpi4py import MPI

from mpiasgd.comms import waits
from mpiasgd.comms.waits import Backoff, Spin, pauser, probe, server_wait
from mpiasgd.config import ConfigError, make_parser, resolve
from mpiasgd.launch.ranks import Rank, node_workers
from mpiasgd.rank0.serve import server_wait_of


def parse(argv):
    return resolve(make_parser().parse_args(argv))


@pytest.mark.parametrize("ranks, cores, choice, why", [
    (2, 2, "spin", "--server-wait auto: 2 ranks on this node, 2 cores, a core per rank"),
    (3, 16, "spin", "--server-wait auto: 3 ranks on this node, 16 cores, a core per rank"),
    (1, 1, "spin", "--server-wait auto: 1 rank on this node, 1 core, a core per rank"),
    (3, 2, "backoff", "--server-wait auto: 3 ranks on this node, 2 cores, fewer cores than ranks (a spinning server "
                      "would take a worker's)"),
    (17, 16, "backoff", "--server-wait auto: 17 ranks on this node, 16 cores, fewer cores than ranks (a spinning "
                        "server would take a worker's)"),
])
def test_auto_spins_where_the_node_has_a_core_per_rank(ranks, cores, choice, why):
    assert server_wait("auto", ranks, cores) == (choice, why)


def test_spin_and_backoff_are_taken_as_asked_whatever_the_node():
    assert server_wait("spin", 5, 2) == ("spin", "--server-wait spin; 5 ranks on this node, 2 cores")
    assert server_wait("backoff", 2, 16) == ("backoff", "--server-wait backoff; 2 ranks on this node, 16 cores")


def test_the_flag_defaults_to_auto_and_takes_each_value_in_every_server_mode():
    assert parse([]).server_wait == "auto"
    for mode in ("async", "ssp", "easgd"):
        for value in ("auto", "spin", "backoff"):
            cfg = parse(["--mode", mode, "--server-wait", value])
            assert (cfg.mode, cfg.server_wait) == (mode, value)
    assert parse(["--servers", "2", "--server-wait", "spin"]).server_wait == "spin"


def test_a_bad_value_is_an_error_naming_the_key_and_the_values():
    with pytest.raises(ConfigError) as e:
        parse(["--server-wait", "sleep"])
    assert str(e.value) == "config key 'server_wait' = 'sleep': expected one of ('auto', 'spin', 'backoff')"


@pytest.mark.parametrize("mode", ["sync", "pipeline"])
def test_a_mode_without_a_parameter_server_refuses_it(mode):
    with pytest.raises(ConfigError) as e:
        parse(["--mode", mode, "--server-wait", "spin"])
    assert str(e.value).startswith(f"config key 'server_wait' = 'spin': expected 'auto' in mode '{mode}' (")
    assert "'server_wait' applies to the async and ssp and easgd modes" in str(e.value)


def me(ranks: int, cores: int) -> SimpleNamespace:
    return SimpleNamespace(node_ranks=ranks, node_cores=cores)


def test_rank0_says_its_choice_and_why():
    cfg = parse(["--server-wait", "auto"])
    assert server_wait_of(cfg, me(2, 2)) == (
        "spin", "the parameter server spins on its requests (no sleep between polls): --server-wait auto: 2 ranks "
                "on this node, 2 cores, a core per rank")
    assert server_wait_of(cfg, me(3, 2)) == (
        "backoff", "the parameter server sleeps between polls of its requests (backoff, 10 us to 2 ms): "
                   "--server-wait auto: 3 ranks on this node, 2 cores, fewer cores than ranks (a spinning server "
                   "would take a worker's)")
    sharded = parse(["--servers", "2"])
    assert server_wait_of(sharded, me(4, 8))[1].endswith("a core per rank; each other shard decides for its own node")
    assert server_wait_of(parse(["--servers", "2", "--server-wait", "spin"]), me(4, 2))[1].endswith(
        "--server-wait spin; 4 ranks on this node, 2 cores")


def test_sync_and_pipeline_rank0_backs_off_and_says_nothing():
    assert server_wait_of(parse(["--mode", "sync"]), me(2, 64)) == ("backoff", "")
    assert server_wait_of(parse(["--mode", "pipeline"]), me(2, 64)) == ("backoff", "")


def test_node_workers_records_the_ranks_and_cores_of_the_node():
    rank = Rank(MPI.COMM_SELF, 0, 1, socket.gethostname())
    assert node_workers(rank) == (0, -1)  # rank 0 alone: no worker on its node
    assert rank.node_ranks == 1 and rank.node_cores == len(os.sched_getaffinity(0))


class LateComm:
    """A communicator whose Improbe finds nothing `empty` times, then a message."""

    def __init__(self, empty: int) -> None:
        self.empty, self.polls = empty, 0

    def Improbe(self, source, tag, status):
        self.polls += 1
        return "message" if self.polls > self.empty else None


def test_a_spinning_probe_polls_without_sleeping_and_a_backoff_sleeps(monkeypatch):
    naps: list[float] = []
    yields: list[None] = []
    monkeypatch.setattr(waits.time, "sleep", naps.append)
    monkeypatch.setattr(waits.os, "sched_yield", lambda: yields.append(None))
    comm = LateComm(200)
    message, _ = probe(comm, 0, 10.0, "test message", pauser("spin"))
    assert message == "message" and comm.polls == 201 and naps == [] and len(yields) == 200  # yields the core only
    comm = LateComm(200)
    probe(comm, 0, 10.0, "test message", pauser("backoff"))
    assert comm.polls == 201 and len(naps) == 200
    assert naps[0] == 0.0 and max(naps) == pytest.approx(Backoff().shortest)  # yields, then naps up to the ceiling


def test_pauser_gives_spin_or_backoff():
    assert isinstance(pauser("spin"), Spin) and isinstance(pauser("backoff"), Backoff)
