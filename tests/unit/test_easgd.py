"""Elastic averaging SGD (`--mode easgd`, Zhang et al. 2015), in-process: rank 0's center and a
worker's loop against hand computations of two exchanges, and the paper's alpha rule.
"""

from __future__ import annotations

import numpy as np
import pytest
from kit.fakempi import Network, rank0
from kit.server import push, reply, serve_one
from kit.worker import receive, reference_grad, start_worker

from mpiasgd.comms.protocol import Message, ProtocolError, Tag
from mpiasgd.config import Config, ConfigError
from mpiasgd.data import load_dataset
from mpiasgd.model import build_model
from mpiasgd.modes.easgd import moving_rate
from mpiasgd.ops import numpy_ops
from mpiasgd.runlog import RunLog, open_log

P = 6
B = 16


def make_center(tmp_path, num_workers=2, **overrides):
    cfg = Config(**{"mode": "easgd", "easgd_alpha": 0.25, "lr": 0.5, "momentum": 0.0, "weight_decay": 0.0,
                    "lr_schedule": "constant", "warmup_epochs": 0.0, "epochs": 0, "max_pushes": 100,
                    "snapshot_interval": 0, "progress": False, "comm_timeout": 2.0, **overrides})
    net = Network(num_workers + 1)
    log = RunLog.create(str(tmp_path / "run.h5"), {"config": cfg.to_json()}, [], P, flush_interval=60)
    server = rank0(net.comm(0), cfg, np.arange(P, dtype=np.float32), np.ones(P, np.float32), num_workers, 100, log)
    return server, net, log


def test_two_exchanges_move_the_center_and_answer_with_the_center_used(tmp_path):
    """Worker 1 then worker 2 exchange (both last saw version 0): by hand, with alpha = 0.25,
    delta_1 = a (x_1 - c_0), c_1 = c_0 + delta_1; delta_2 = a (x_2 - c_1), c_2 = c_1 + delta_2;
    each reply carries the center its delta was computed with, so the worker's x_i - delta matches."""
    server, net, log = make_center(tmp_path)
    server.start = 0.0
    a = np.float32(0.25)
    c0 = np.arange(P, dtype=np.float32)
    x1 = np.linspace(-1, 1, P).astype(np.float32)
    x2 = np.full(P, 3.0, np.float32)
    push(net, 1, step=1, version=0, grad=x1, samples=32, lr=0.05, loss=2.0)
    serve_one(server)
    c1 = c0 + a * (x1 - c0)
    np.testing.assert_array_equal(server.params, c1)
    tag, header, payload = reply(net, 1)
    assert tag == Tag.WEIGHTS and (header["step"], header["version"]) == (1, 1)
    np.testing.assert_array_equal(payload, c0)  # the center delta_1 was computed with
    push(net, 2, step=1, version=0, grad=x2, samples=32, lr=0.05, loss=1.0)
    serve_one(server)
    c2 = c1 + a * (x2 - c1)
    np.testing.assert_array_equal(server.params, c2)
    tag, header, payload = reply(net, 2)
    assert tag == Tag.WEIGHTS and header["version"] == 2
    np.testing.assert_array_equal(payload, c1)
    # worker 2 moves by a (x_2 - c_1) toward the center, which moved by as much toward it
    np.testing.assert_allclose(a * (x2 - payload), c2 - c1, rtol=0, atol=1e-6)
    assert server.version == 2 and server.samples == 64
    log.flush()
    with open_log(log.path) as f:
        pushes, updates = f["pushes"][()], f["updates"][()]
    assert pushes["worker"].tolist() == [1, 2] and pushes["staleness"].tolist() == [0, 1]
    assert pushes["version"].tolist() == [1, 2] and pushes["applied"].all()
    np.testing.assert_allclose(updates["grad_norm"], [np.linalg.norm(a * (x1 - c0)), np.linalg.norm(a * (x2 - c1))],
                               rtol=1e-6)


def test_after_the_stop_an_exchange_is_answered_with_stop_and_the_center(tmp_path):
    server, net, _ = make_center(tmp_path, max_pushes=1)
    push(net, 1, step=1, version=0, grad=np.ones(P, np.float32), samples=8)
    serve_one(server)
    assert server.stop_reason == "max_pushes: 1 >= 1"
    assert reply(net, 1)[0] == Tag.STOP  # the stopping exchange itself
    center = server.params.copy()
    push(net, 2, step=1, version=0, grad=np.full(P, 9.0, np.float32), samples=8)
    serve_one(server)
    tag, _, payload = reply(net, 2)
    assert tag == Tag.STOP and np.array_equal(payload, center) and np.array_equal(server.params, center)
    push(net, 2, step=2, version=1, grad=np.zeros(P, np.float32))
    with pytest.raises(ProtocolError, match="PUSH step 2 from worker rank 2 after it was sent STOP"):
        serve_one(server)


def test_a_non_finite_worker_is_rejected_not_averaged_in(tmp_path):
    server, net, _ = make_center(tmp_path, max_rejects=2)
    before = server.params.copy()
    bad = np.full(P, np.nan, np.float32)
    push(net, 1, step=1, version=0, grad=bad)
    serve_one(server)
    assert np.array_equal(server.params, before) and server.version == 0 and server.rejected[1] == 1
    assert reply(net, 1)[0] == Tag.WEIGHTS
    push(net, 1, step=2, version=0, grad=bad)
    with pytest.raises(Exception, match="2 non-finite weight vectors in a row"):
        serve_one(server)


def test_alpha_defaults_to_the_papers_beta_over_p_rule():
    assert moving_rate(Config(mode="easgd"), 2) == pytest.approx(0.45)
    assert moving_rate(Config(mode="easgd"), 8) == pytest.approx(0.9 / 8)
    assert moving_rate(Config(mode="easgd", easgd_alpha=0.1), 8) == 0.1
    with pytest.raises(ConfigError, match=r"'easgd_alpha' = 1.0: expected 0 < alpha < 1"):
        Config(mode="easgd", easgd_alpha=1.0).validate()
    with pytest.raises(ConfigError, match="'easgd_tau' = 0: expected an integer >= 1"):
        Config(mode="easgd", easgd_tau=0).validate()
    with pytest.raises(ConfigError, match="'easgd_tau' = 8: expected 4 unless --mode easgd"):
        Config(easgd_tau=8).validate()


def test_the_worker_takes_tau_local_steps_then_its_elastic_step(tmp_path):
    """tau 2, alpha 0.3: push 1 is x after two momentum SGD steps from the center c0; the reply's center c
    moves x to x - 0.3 (x - c); push 2 is that after two more steps (the velocity carried on)."""
    digits = load_dataset("digits")
    cfg = Config(mode="easgd", easgd_tau=2, easgd_alpha=0.3, batch_size=B, seed=3, comm_timeout=5.0)
    net, sampler, thread, outcome = start_worker(digits, mode="easgd", easgd_tau=2, easgd_alpha=0.3)
    model = build_model("digits")
    c0 = model.init_params(0)
    lr = 0.05
    msg = Message(c0.size).stamp(Tag.WEIGHTS, 0, version=0, step=0, lr=lr)
    msg.payload[:] = c0
    net.post(0, 1, Tag.WEIGHTS, msg.buf)
    # by hand: momentum SGD on this shard's minibatches, in order
    decay = (cfg.weight_decay * model.decay_mask()).astype(np.float32)
    x, v = c0.copy(), np.zeros_like(c0)
    order = sampler.indices(0)

    def local_steps(first):
        for k in range(first, first + 2):
            g, _ = reference_grad(x, digits, order[k * B:(k + 1) * B])
            numpy_ops.sgd_momentum(x, v, g, decay, cfg.momentum, lr)

    local_steps(0)
    push1 = receive(net, Tag.PUSH, c0.size)
    assert (push1.header["step"], push1.header["version"], push1.header["samples"]) == (1, 0, 2 * B)
    np.testing.assert_allclose(push1.payload, x, rtol=1e-5, atol=1e-7)
    c = c0 + np.float32(0.01)
    reply1 = Message(c0.size).stamp(Tag.WEIGHTS, 0, version=3, step=1, lr=lr)
    reply1.payload[:] = c
    net.post(0, 1, Tag.WEIGHTS, reply1.buf)
    x = push1.payload - np.float32(0.3) * (push1.payload - c)  # the elastic step on what was pushed
    local_steps(2)
    push2 = receive(net, Tag.PUSH, c0.size)
    assert (push2.header["step"], push2.header["version"]) == (2, 3)
    np.testing.assert_allclose(push2.payload, x, rtol=1e-4, atol=1e-6)
    stop = Message(c0.size).stamp(Tag.STOP, 0, version=4, step=2)
    stop.payload[:] = c
    net.post(0, 1, Tag.STOP, stop.buf)
    result = receive(net, Tag.EVAL, 0)
    thread.join(5)
    assert not thread.is_alive() and "error" not in outcome
    assert result.header["samples"] == 20  # it evaluated the center STOP carried on its 20 test images


@pytest.mark.parametrize("mode, key, value", [("async", "nsync", 300), ("easgd", "easgd_tau", 300)])
def test_a_round_longer_than_the_run_is_refused(mode, key, value):
    """nsync and easgd's tau: one round of local steps by both workers (300 x 32 x 2 images) is longer than
    a 1-epoch run of 1,437 images; a round that fits is taken."""
    from mpiasgd.modes.registry import load

    cfg = Config(mode=mode, epochs=1, **{key: value}).validate()
    with pytest.raises(ConfigError, match=rf"'{key}' = 300: one round of local steps by every worker \(300 x 32 "
                                          r"images x 2 workers\) is longer than the run \(1 epochs of 1437 images\)"):
        load(mode).layout(cfg, None, 2, 1437)
    fits = Config(mode=mode, epochs=1, **{key: 20}).validate()
    assert load(mode).layout(fits, None, 2, 1437).shards == 2
