"""--server-threads: a parameter-server rank's update shared among threads gives the bits of one thread (the SGD
step with momentum, weight decay and the staleness rule; an nsync push's accumulated update)."""

from __future__ import annotations

import numpy as np
import pytest
from kit.server import make_server, push, reply, serve_one

from mpiasgd.comms.protocol import Flag, Tag
from mpiasgd.config import Config, ConfigError


def replies(tmp_path, threads: int, nsync: int) -> tuple[list, int]:
    server, net, _ = make_server(tmp_path / f"t{threads}", nsync=nsync, momentum=0.9, weight_decay=0.01,
                                 staleness_lr="inverse", server_threads=threads)
    rng = np.random.default_rng(4)
    out, steps, versions = [], {1: 0, 2: 0}, {1: 0, 2: 0}
    for i in range(6):
        worker = 1 + i % 2
        steps[worker] += 1
        push(net, worker, step=steps[worker], version=versions[worker], grad=rng.standard_normal(6).astype(np.float32),
             lr=0.03, flags=Flag.DELTA if nsync > 1 else 0)
        serve_one(server)
        tag, header, payload = reply(net, worker)
        assert tag == Tag.WEIGHTS
        versions[worker] = int(header["version"])
        out.append(payload)
    return out, server.optimizer.threads


@pytest.mark.parametrize("nsync", [1, 4])
def test_threads_give_the_bits_of_one(tmp_path, nsync):
    (tmp_path / "t1").mkdir()
    (tmp_path / "t3").mkdir()
    one, threads_one = replies(tmp_path, 1, nsync)
    three, threads_three = replies(tmp_path, 3, nsync)
    assert (threads_one, threads_three) == (1, 3)
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(one, three, strict=True))
    assert not np.array_equal(one[0], one[-1])  # (the weights moved)


@pytest.mark.parametrize("threads", [0, 1025])
def test_a_thread_count_out_of_range_is_refused(threads):
    with pytest.raises(ConfigError, match=r"server_threads.*an integer from 1 to 1024"):
        Config(server_threads=threads).validate()
