"""The advice when the workers wait for the parameter server more than they compute (`mpiasgd.rank0.advice`)."""

from __future__ import annotations

import numpy as np
import pytest
from kit.server import make_server, push, serve_one

from mpiasgd.config import Config
from mpiasgd.rank0 import advice
from mpiasgd.rank0.advice import ExchangeWatch


def fed(cfg: Config, compute_s: float, wait_s: float, busy_s: float, pushes: int = 60,
        spinning: bool = False) -> ExchangeWatch:
    watch = ExchangeWatch(cfg, spinning)
    for i in range(pushes):
        watch.push(1 + i % 2, compute_s, wait_s)
        watch.served(busy_s)
    return watch


def test_workers_waiting_on_an_idle_server_are_told_the_flags_that_hide_the_exchange():
    watch = fed(Config(), compute_s=0.002, wait_s=0.006, busy_s=0.0005)
    text = watch.advice(elapsed=20.0)
    assert text.startswith("the workers waited for the parameter server 75 % of their time (6.0 ms a push against "
                           "2.0 ms of compute); rank 0 was busy only 0 % of the time: the exchange is the bottleneck")
    assert "--overlap" in text and "--wire bf16" in text and "--nsync 4" in text and "--servers" not in text
    assert "--server-wait" not in text  # auto backed off: the node has no core to spare
    forced = fed(Config(server_wait="backoff"), compute_s=0.002, wait_s=0.006, busy_s=0.0005).advice(elapsed=20.0)
    assert "--server-wait spin (rank 0 polls without sleeping; give it a core of its own)" in forced
    assert watch.pushes == 58  # each worker's first push (start-up) left out
    assert watch.advice(elapsed=30.0) == ""  # once


def test_the_flags_a_run_uses_already_are_not_named():
    text = fed(Config(overlap=True, wire="bf16", nsync=4), 0.002, 0.006, 0.0005, spinning=True).advice(elapsed=20.0)
    assert "the exchange is the bottleneck; a faster interconnect, or more compute per push" in text, text


@pytest.mark.parametrize("flags", [{"dc_lambda": 0.1}, {"lookahead": -1}])
def test_no_nsync_where_the_run_needs_nsync_1(flags):
    text = fed(Config(**flags), 0.002, 0.006, 0.0005).advice(elapsed=20.0)
    assert "--wire bf16" in text and "--nsync" not in text, text


def test_easgd_is_told_its_own_period_not_asyncs_flags():
    text = fed(Config(mode="easgd", easgd_tau=4), 0.002, 0.006, 0.0005).advice(elapsed=20.0)
    assert "try --easgd-tau 8 (exchanges half as often)" in text, text
    assert "--overlap" not in text and "--wire" not in text and "--nsync" not in text


def test_a_busy_server_is_told_to_shard():
    watch = fed(Config(servers=2), compute_s=0.002, wait_s=0.02, busy_s=0.3)  # 60 x 0.3 s of 20 s: 90 %
    text = watch.advice(elapsed=20.0)
    assert "rank 0 was busy 90 % of the time with the updates: try --servers 4" in text and "--nsync 4" in text, text
    assert "--overlap" not in text


@pytest.mark.parametrize("compute_s,wait_s,elapsed,pushes", [
    (0.006, 0.002, 20.0, 60),   # computing more than waiting: nothing to say
    (0.002, 0.006, 5.0, 60),    # too early in the run
    (0.002, 0.006, 20.0, 40),   # too few pushes
    (0.0, 0.0, 20.0, 60),       # no timings (pushes of a test)
])
def test_no_advice(compute_s, wait_s, elapsed, pushes):
    assert fed(Config(), compute_s, wait_s, 0.0, pushes).advice(elapsed) == ""


def test_the_server_advises_once_in_the_log_and_on_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(advice, "ADVISE_AFTER_S", 0.0)
    server, net, log = make_server(tmp_path, max_pushes=1000)
    server.begin()
    for step in range(1, 61):
        for w in (1, 2):
            push(net, w, step=step, version=server.counter.version, grad=np.full(6, 1e-3, np.float32),
                 compute_s=0.001, wait_s=0.004)
            serve_one(server)
    log.flush()
    events = [(e["kind"].decode(), e["text"].decode()) for e in log.file["events"][()]]
    said = [text for kind, text in events if kind == "advice"]
    assert len(said) == 1 and said[0].startswith("the workers waited for the parameter server 80 % of their time")
    assert capsys.readouterr().err.count("mpiasgd: advice: the workers waited") == 1
