"""Training modes in-process: sync (rank 0's monitor), nsync (accumulated updates), overlap, ssp (hold
and release): a role driven through the fake communicator. The multi-rank checks: tests/mpi/test_modes.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from kit.runs import B
from kit.server import make_server, push, reply, serve_one
from kit.worker import receive, reference_grad, start_worker, worker_pair

from mpiasgd.comms.protocol import Flag, Message, ProtocolError, Tag
from mpiasgd.config import Config
from mpiasgd.model import build_model
from mpiasgd.ops import numpy_ops


def test_sync_monitor_takes_snapshots_only_from_the_first_worker(tmp_path):
    server, net, _ = make_server(tmp_path, mode="sync")
    from kit.fakempi import rank0

    monitor = rank0(server.comm, server.cfg, server.params, np.ones(6, np.float32), 2, 100, server.log)
    msg = Message(6).stamp(Tag.SNAPSHOT, 2, step=1, version=1)
    net.post(2, 0, Tag.SNAPSHOT, msg.buf)
    with pytest.raises(ProtocolError, match="rank 0: SNAPSHOT from worker rank 2; only rank 1 sends them"):
        serve_one(monitor)
    net.post(1, 0, Tag.PUSH, Message(6).stamp(Tag.PUSH, 1, step=1).buf)
    with pytest.raises(ProtocolError, match="unexpected PUSH message from rank 1 \\(in mode 'sync' rank 0 "
                                            "receives REPORT, SNAPSHOT, CHECKPOINT, EVAL and ERROR\\)"):
        serve_one(monitor)


# --- nsync: accumulated updates ------------------------------------------------------------------------

def test_nsync_push_carries_the_accumulated_update(digits):
    """nsync 3: the push is (weights after 3 local SGD steps) - (weights pulled), flagged DELTA."""
    net, _, thread, outcome = start_worker(digits, nsync=3)
    cfg = Config(batch_size=B, seed=3, nsync=3)
    p0 = build_model("digits").init_params(0)
    lr = 0.05
    msg = Message(p0.size).stamp(Tag.WEIGHTS, 0, version=0, step=0, lr=lr)
    msg.payload[:] = p0
    net.post(0, 1, Tag.WEIGHTS, msg.buf)
    pushed = receive(net, Tag.PUSH, p0.size)
    h = pushed.header
    assert (h["step"], h["version"], h["samples"], h["flags"]) == (1, 0, 3 * B, Flag.DELTA)
    assert float(h["lr"]) == lr
    # by hand: three momentum SGD steps on the first three minibatches of the shard
    ref = worker_pair(cfg, digits, p0.copy(), nworkers=2)[0]
    w, v = ref.model.params, np.zeros_like(p0)
    decay = (cfg.weight_decay * ref.model.decay_mask()).astype(np.float32)
    for _ in range(3):
        ref.gradient()
        numpy_ops.sgd_momentum(w, v, ref.model.grads, decay, cfg.momentum, lr)
    np.testing.assert_allclose(pushed.payload, w - p0, rtol=1e-5, atol=1e-8)
    assert np.abs(pushed.payload).max() > 1e-4
    stop = Message(p0.size).stamp(Tag.STOP, 0, version=1, step=1)
    net.post(0, 1, Tag.STOP, stop.buf)
    receive(net, Tag.EVAL, 0)
    thread.join(5)
    assert not thread.is_alive() and "error" not in outcome


@pytest.mark.parametrize("rule,factor", [("none", 1.0), ("inverse", 0.5), ("sqrt", 2 ** -0.5), ("auto", 0.5)])
def test_server_adds_accumulated_update_scaled_by_staleness_rule(tmp_path, rule, factor):
    server, net, log = make_server(tmp_path, nsync=4, staleness_lr=rule, momentum=0.9, weight_decay=0.1)
    before = server.params.copy()
    server.counter.version = 2  # the push below was computed from version 0: staleness 2
    u = np.linspace(-1, 1, 6).astype(np.float32)
    push(net, 1, step=1, version=0, grad=u, lr=0.03, flags=Flag.DELTA)
    serve_one(server)
    np.testing.assert_allclose(server.params, before + np.float32(factor) * u, rtol=1e-6)  # no momentum, no decay
    tag, header, payload = reply(net, 1)
    assert tag == Tag.WEIGHTS and header["version"] == 3 and np.array_equal(payload, server.params)
    log.flush()
    from mpiasgd.runlog import open_log

    with open_log(log.path) as f:
        row = f["pushes"][-1]
    assert row["staleness"] == 2 and row["lr"] == pytest.approx(0.03 * factor)


def test_server_refuses_a_gradient_when_nsync_expects_updates(tmp_path):
    server, net, _ = make_server(tmp_path, nsync=4)
    push(net, 1, step=1, version=0, grad=np.ones(6, np.float32))
    with pytest.raises(ProtocolError, match="carries a gradient, but nsync is 4"):
        serve_one(server)


# --- overlap -----------------------------------------------------------------------------------------------

def test_overlap_computes_on_the_weights_at_hand(digits):
    """--overlap: push 2 is computed on the initial weights while reply 1 is in flight; push 3 on reply 1's."""
    net, sampler, thread, outcome = start_worker(digits, overlap=True)
    p0 = build_model("digits").init_params(0)
    p1 = p0 * np.float32(0.5)

    def send(tag, params, version, step):
        msg = Message(params.size).stamp(tag, 0, version=version, step=step)
        msg.payload[:] = params
        net.post(0, 1, tag, msg.buf)

    send(Tag.WEIGHTS, p0, 0, 0)
    push1 = receive(net, Tag.PUSH, p0.size)
    idx = sampler.indices(0)
    np.testing.assert_array_equal(push1.payload, reference_grad(p0, digits, idx[:B])[0])
    send(Tag.WEIGHTS, p1, 1, 1)
    push2 = receive(net, Tag.PUSH, p0.size)
    assert (push2.header["step"], push2.header["version"]) == (2, 0)  # computed before reply 1 was used
    np.testing.assert_array_equal(push2.payload, reference_grad(p0, digits, idx[B:2 * B])[0])
    send(Tag.WEIGHTS, p0, 2, 2)
    push3 = receive(net, Tag.PUSH, p0.size)
    assert (push3.header["step"], push3.header["version"]) == (3, 1)
    np.testing.assert_array_equal(push3.payload, reference_grad(p1, digits, idx[2 * B:3 * B])[0])
    send(Tag.STOP, p1, 3, 3)  # the gradient computed meanwhile is dropped; it evaluates the STOP weights
    result = receive(net, Tag.EVAL, 0)
    thread.join(5)
    assert not thread.is_alive() and "error" not in outcome and result.header["samples"] == 20
    assert [t for _, t, _ in net.pending(0)] == []


def test_ssp_holds_then_releases_in_process(tmp_path):
    """Crafted pushes: worker 1 two clocks ahead of worker 2 with bound 1 waits until worker 2 pushes."""
    server, net, _ = make_server(tmp_path, mode="ssp", staleness_bound=1)
    server.start_workers()
    net.queues[1].clear()
    net.queues[2].clear()
    g = np.zeros(6, np.float32)
    push(net, 1, step=1, version=0, grad=g)
    serve_one(server)
    assert len(net.pending(1)) == 1  # clock 1 vs 0: within the bound, answered
    push(net, 1, step=2, version=1, grad=g)
    serve_one(server)
    assert len(net.pending(1)) == 1 and 1 in server.held  # clock 2 vs 0: held
    push(net, 2, step=1, version=0, grad=g)
    serve_one(server)
    assert len(net.pending(1)) == 2 and not server.held  # worker 2 reached clock 1: released
    tag, header, _ = reply(net, 1)
    assert tag == Tag.WEIGHTS and header["step"] == 2 and header["version"] == 3
