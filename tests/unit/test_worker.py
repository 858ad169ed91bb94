"""A worker driven in-process through a fake communicator; the test plays the parameter server."""

from __future__ import annotations

import numpy as np
import pytest
from kit.runs import B
from kit.worker import receive, reference_grad, send, start_worker

from mpiasgd.comms.protocol import HEADER_BYTES, Message, ProtocolError, Tag
from mpiasgd.model import build_model, evaluate


def test_worker_pushes_exact_gradients_and_evaluates(digits):
    net, sampler, thread, outcome = start_worker(digits)
    model = build_model("digits")
    p0 = model.init_params(0)
    send(net, Tag.WEIGHTS, p0, version=0, step=0)
    push1 = receive(net, Tag.PUSH, model.num_params)
    h = push1.header
    assert (h["sender"], h["step"], h["version"], h["samples"], h["epoch"]) == (1, 1, 0, B, 0)
    g, loss = reference_grad(p0, digits, sampler.indices(0)[:B])
    np.testing.assert_array_equal(push1.payload, g)           # the gradient of its first shard minibatch
    assert float(h["loss"]) == pytest.approx(loss)
    assert h["compute_s"] > 0
    # a stale reply: the server moved on to version 5 meanwhile
    p5 = p0 - 0.01 * g
    send(net, Tag.WEIGHTS, p5, version=5, step=1)
    push2 = receive(net, Tag.PUSH, model.num_params)
    assert (push2.header["step"], push2.header["version"]) == (2, 5)
    g2, _ = reference_grad(p5, digits, sampler.indices(0)[B:2 * B])
    np.testing.assert_array_equal(push2.payload, g2)
    # STOP carries the final weights; the worker evaluates its 20 test images with them
    send(net, Tag.STOP, p5, version=6, step=2)
    result = receive(net, Tag.EVAL, 0)
    thread.join(5)
    assert not thread.is_alive() and "error" not in outcome
    ref = build_model("digits")
    w = p5.copy()
    ref.bind(w, np.zeros_like(w))
    loss_sum, correct, count, correct5 = evaluate(ref, digits, np.arange(20, dtype=np.int64), 256)
    assert (result.header["samples"], result.header["correct"]) == (count, correct) == (20, correct)
    assert result.header["correct5"] == correct5 >= correct
    assert float(result.header["loss"]) == pytest.approx(loss_sum, rel=1e-6)
    assert net.pending(0) == []  # nothing else was sent


def bad_reply(net, count, kind):
    params = np.zeros(count, np.float32)
    if kind == "size":
        msg = Message(count - 1).stamp(Tag.WEIGHTS, 0, version=3, step=1)
        net.post(0, 1, Tag.WEIGHTS, msg.buf)
    elif kind == "tag":
        net.post(0, 1, Tag.EVAL, Message(count).stamp(Tag.EVAL, 0, step=1).buf)
    elif kind == "unknown":
        net.post(0, 1, 77, Message(count).buf)
    elif kind == "backwards":
        send(net, Tag.WEIGHTS, params, version=1, step=1)
    elif kind == "wrong-step":
        send(net, Tag.WEIGHTS, params, version=4, step=7)


@pytest.mark.parametrize("kind,match", [
    ("size", f"WEIGHTS message from rank 0 is {HEADER_BYTES + 4 * 6089} bytes, expected {HEADER_BYTES + 4 * 6090}"),
    ("tag", "expected WEIGHTS or STOP from rank 0, got EVAL"),
    ("unknown", "unknown tag 77"),
    ("backwards", "expected step 1 at version >= 3"),
    ("wrong-step", "WEIGHTS answers step 7"),
])
def test_worker_rejects_malformed_replies(digits, kind, match):
    net, _, thread, outcome = start_worker(digits)
    count = build_model("digits").num_params
    send(net, Tag.WEIGHTS, build_model("digits").init_params(0), version=3, step=0)
    receive(net, Tag.PUSH, count)
    bad_reply(net, count, kind)
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), ProtocolError), outcome
    assert match in str(outcome["error"])
    assert str(outcome["error"]).startswith("rank 1:")


def test_worker_times_out_naming_the_wait(digits):
    _, _, thread, outcome = start_worker(digits, timeout=0.3)
    thread.join(10)
    # a worker waits twice --comm-timeout (rank 0, which watches every worker, names a hung one first)
    assert "rank 1: no initial weights from the parameter server (rank 0) after 1 s" in str(outcome["error"])
