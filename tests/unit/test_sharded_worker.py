"""A worker of parameter-server shards (`--servers S > 1`) in-process: its per-shard staging copies (host and
pinned, fp32, fp16, bf16, error feedback) against one server's staging, and its loop against two scripted
shards (the pushes split by the cut, per-shard versions, STOP from one shard and FINISH to the other)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kit.fakempi import Network
from kit.runs import B
from kit.worker import reference_grad

from mpiasgd.comms import Message, ProtocolError, Staging, Tag
from mpiasgd.comms.shard_cut import ShardCut
from mpiasgd.comms.staging import ShardedStaging
from mpiasgd.comms.wire import ErrorFeedback, decode, encode
from mpiasgd.config import Config
from mpiasgd.data import ShardSampler
from mpiasgd.model import build_model
from mpiasgd.modes.asgd import AsgdWorker
from mpiasgd.modes.base import WorkerJob

from .test_device import FakeDevice


@pytest.mark.parametrize("kind", ["host", "pinned"])
@pytest.mark.parametrize("wire,feedback", [("fp32", False), ("fp16", False), ("bf16", False), ("bf16", True)])
@pytest.mark.parametrize("params,buffers,servers", [(1000, 0, 2), (1000, 37, 3), (50, 600, 2)])
def test_shard_payloads_are_the_slices_of_one_servers_message(kind, wire, feedback, params, buffers, servers):
    """Each shard's push carries the cut's slice of what one server's push carries (the buffers after shard 0's
    parameters), bit for bit, error feedback included; the replies' payloads land where one server's would."""
    cut = ShardCut.balanced(params, buffers, servers)
    n = params + buffers
    dev = FakeDevice()
    one = Staging(n, wire, ErrorFeedback(wire, params) if feedback else None)
    many = ShardedStaging(cut, wire, ErrorFeedback(wire, params) if feedback else None,
                          None if kind == "host" else dev.transfers())
    assert many.kind == kind and [m.count for m in many.push] == [cut.count(s) for s in range(servers)]
    rng = np.random.default_rng(5)

    def pieces(whole):  # one server's message cut as the shards' are
        out = []
        for s in range(servers):
            a, b = cut.slice(s)
            out.append(np.concatenate([whole[a:b], whole[params:]]) if s == 0 else whole[a:b])
        return out

    for _ in range(3):  # feedback carries over pushes: the residuals must stay equal too
        g = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        one.grads[:] = g
        many.grads[:] = g
        one.before_send()
        many.finish_compute()
        many.before_send()
        for s, part in enumerate(pieces(one.push.payload)):
            np.testing.assert_array_equal(many.push[s].payload.view(np.uint8), part.view(np.uint8))
    w = rng.standard_normal(n).astype(np.float32)
    coded = encode(wire, w, np.empty(n, one.weights.payload.dtype))
    for s, part in enumerate(pieces(coded)):
        many.weights[s].payload[:] = part
    many.after_receive()
    np.testing.assert_array_equal(many.params, decode(wire, coded, np.empty(n, np.float32)))
    if kind == "pinned":  # every piece crosses on its own; one sync per push
        pieces_in = servers + (1 if buffers else 0)
        assert [c[0] for c in dev.calls].count("to_device") == pieces_in
        assert [c[0] for c in dev.calls].count("sync") == 3


def test_sharded_staging_refuses_feedback_without_a_16_bit_wire():
    with pytest.raises(ValueError, match="error feedback needs a 16-bit wire format"):
        ShardedStaging(ShardCut.balanced(100, 0, 2), "fp32", ErrorFeedback("bf16", 100))


# --- the loop against two scripted shards ---------------------------------------------------------------------

WORKERS, SHARD1 = 2, 3  # ranks: 0 (shard 0), workers 1 and 2, shard 1 = rank 3


def start_sharded_worker(digits, **overrides):
    cfg = Config(batch_size=B, comm_timeout=5.0, seed=3, servers=2, **overrides)
    model = build_model("digits")
    cut = ShardCut.balanced(model.num_params, model.num_buffers, 2)
    net = Network(WORKERS + 2)
    sampler = ShardSampler(digits.train_y.size, WORKERS, 0, cfg.seed)
    staging = ShardedStaging(cut, cfg.wire)
    worker = AsgdWorker(WorkerJob(net.comm(1), cfg, model, digits, sampler, 1, np.arange(20, dtype=np.int64),
                                  staging))
    outcome = {}

    def run():
        try:
            outcome["preempted"] = worker.run()
        except Exception as e:  # the test inspects it
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return net, cut, sampler, thread, outcome


def reply(net, cut, s, tag, params, version, step, **fields):
    a, b = cut.slice(s)
    msg = Message(cut.count(s)).stamp(tag, 0 if s == 0 else SHARD1, version=version, step=step, **fields)
    msg.payload[:] = params[a:b]
    net.post(0 if s == 0 else SHARD1, 1, tag, msg.buf)


def take(net, dest, tag, count, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = net.take(dest, 1, tag)
        if got is not None:
            msg = Message(count)
            msg.buf[:] = np.frombuffer(got[2], np.uint8)
            return msg
        time.sleep(0.001)
    raise AssertionError(f"no {tag.name} from the worker to rank {dest} within {timeout} s")


def test_worker_pushes_each_shard_its_slice_and_finishes_with_every_final_slice(digits):
    net, cut, sampler, thread, outcome = start_sharded_worker(digits)
    model = build_model("digits")
    p0 = model.init_params(0)
    reply(net, cut, 0, Tag.WEIGHTS, p0, version=0, step=0)
    reply(net, cut, 1, Tag.WEIGHTS, p0, version=0, step=0)
    g, _ = reference_grad(p0, digits, sampler.indices(0)[:B])
    pushes = [take(net, 0, Tag.PUSH, cut.count(0)), take(net, SHARD1, Tag.PUSH, cut.count(1))]
    for s, push in enumerate(pushes):  # each shard its slice of the exact gradient, with that shard's version
        a, b = cut.slice(s)
        np.testing.assert_array_equal(push.payload, g[a:b])
        assert (int(push.header["step"]), int(push.header["version"]), int(push.header["samples"])) == (1, 0, B)
    # the shards answer at different versions: the next pushes carry each shard's own
    p1 = p0 - 0.01 * g
    reply(net, cut, 0, Tag.WEIGHTS, p1, version=4, step=1)
    reply(net, cut, 1, Tag.WEIGHTS, p1, version=2, step=1)
    second = [take(net, 0, Tag.PUSH, cut.count(0)), take(net, SHARD1, Tag.PUSH, cut.count(1))]
    assert [int(m.header["version"]) for m in second] == [4, 2]
    g1, _ = reference_grad(p1, digits, sampler.indices(0)[B:2 * B])
    np.testing.assert_array_equal(np.concatenate([m.payload for m in second]), g1)
    # shard 0 has stopped, shard 1 not yet: the worker asks shard 1 for its final slice (FINISH)
    final = p1 - 0.01 * g1
    reply(net, cut, 0, Tag.STOP, final, version=5, step=2)
    reply(net, cut, 1, Tag.WEIGHTS, p1 + 7, version=3, step=2)  # computed on by no one
    finish = take(net, SHARD1, Tag.FINISH, 0)
    assert (int(finish.header["step"]), int(finish.header["sender"])) == (2, 1)
    assert net.pending(0) == []  # no third push
    reply(net, cut, 1, Tag.STOP, final, version=4, step=2)
    result = take(net, 0, Tag.EVAL, 0)
    thread.join(5)
    assert outcome == {"preempted": False} and int(result.header["samples"]) == 20
    from mpiasgd.model import evaluate

    ref = build_model("digits")
    w = final.copy()
    ref.bind(w, np.zeros_like(w))
    assert int(result.header["correct"]) == evaluate(ref, digits, np.arange(20, dtype=np.int64), 256)[1]
    assert net.pending(SHARD1) == []  # nothing else went to shard 1


def test_worker_names_the_shard_of_a_malformed_reply(digits):
    net, cut, _, thread, outcome = start_sharded_worker(digits)
    p0 = build_model("digits").init_params(0)
    reply(net, cut, 0, Tag.WEIGHTS, p0, version=0, step=0)
    bad = Message(cut.count(1) - 1).stamp(Tag.WEIGHTS, SHARD1, version=0, step=0)
    net.post(SHARD1, 1, Tag.WEIGHTS, bad.buf)
    thread.join(10)
    assert isinstance(outcome.get("error"), ProtocolError)
    assert f"from parameter-server shard 1 (rank {SHARD1})" in str(outcome["error"])
    assert f"expected {Message(cut.count(1)).buf.size}" in str(outcome["error"])


# --- flag NONFINITE: every shard's push says whether the whole push is finite as it travels ----------------------

@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_all_finite_reads_every_16_bit_pattern_as_the_server_decodes_it(wire):
    """Each of the 65,536 16-bit patterns, alone and as the last value of a block after finite ones: all_finite
    says what np.isfinite says of the float32 the server decodes."""
    from mpiasgd.comms.staging import all_finite
    from mpiasgd.comms.wire import wire_dtype

    patterns = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(wire_dtype(wire))
    expected = np.isfinite(decode(wire, patterns, np.empty(65536, np.float32)))
    scratch = np.empty(4, np.uint16)
    got = np.array([all_finite(patterns[i:i + 1], wire, scratch) for i in range(65536)])
    np.testing.assert_array_equal(got, expected)
    one = encode(wire, np.ones(9, np.float32), np.empty(9, wire_dtype(wire)))  # blocks of 4: 4, 4, then 1
    for bad in np.flatnonzero(~expected)[::97]:
        one[-1] = patterns[bad]
        assert not all_finite(one, wire, scratch)
    one[-1] = one[0]
    assert all_finite(one, wire, scratch)


NONFINITE_CASES = [  # (where: a shard or the buffers, value, the wire formats in which the push is not finite)
    (1, np.nan, {"fp32", "fp16", "bf16"}),
    (0, -np.inf, {"fp32", "fp16", "bf16"}),
    (2, 1e6, {"fp16"}),    # beyond fp16's range (65504): inf on the wire, the server would reject it
    (1, 1e30, {"fp16"}),   # finite, but its square overflows float32: the dot is not finite, the exact check is
    ("buffers", np.nan, set()),  # the layer buffers: no server checks them
]


# (ErrorFeedback's residual of an inf is inf - inf: numpy warns, then the residual is reset; not what this checks)
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.parametrize("kind", ["host", "pinned"])
@pytest.mark.parametrize("wire,feedback", [("fp32", False), ("fp16", False), ("fp16", True), ("bf16", False),
                                           ("bf16", True)])
@pytest.mark.parametrize("where,value,wires", NONFINITE_CASES,
                         ids=["nan-shard-1", "inf-shard-0", "1e6-shard-2", "1e30-shard-1", "nan-buffers"])
def test_every_shards_push_is_flagged_when_the_whole_push_is_not_finite(monkeypatch, kind, wire, feedback, where,
                                                                         value, wires):
    """A finite push, then one with `value` in one shard's slice (or the buffers), then a finite one again: the
    second carries flag NONFINITE on all 3 pushes exactly when some parameter's value is not finite as encoded
    for the wire, though the other shards' slices are finite; the others carry it on none (a stale bit cleared,
    the other flags kept). The host check runs in blocks (here of 64 values), the device's in one pass."""
    import mpiasgd.comms.staging as staging_module
    from mpiasgd.comms import Flag

    monkeypatch.setattr(staging_module, "CHECK_BLOCK", 64)
    params, buffers, servers = 1000, 37, 3
    cut = ShardCut.balanced(params, buffers, servers)
    st = ShardedStaging(cut, wire, ErrorFeedback(wire, params) if feedback else None,
                        None if kind == "host" else FakeDevice().transfers())
    rng = np.random.default_rng(4)
    if where == "buffers":
        at = params + 5
    else:
        at = cut.slice(where)[1] - 3  # past the first blocks of 64
    for i in range(3):
        g = (rng.standard_normal(params + buffers) * 1e-2).astype(np.float32)
        if i == 1:
            g[at] = value
            assert np.isfinite(np.delete(g, at)).all()
        st.grads[:] = g
        for msg in st.push:  # as the worker stamps them; a stale NONFINITE bit is cleared when the push is finite
            msg.stamp(Tag.PUSH, 1, step=i + 1, flags=Flag.DELTA | (Flag.NONFINITE if i == 2 else 0))
        st.finish_compute()
        st.before_send()
        flagged = i == 1 and wire in wires
        assert st.nonfinite == flagged
        assert [int(m.header["flags"]) for m in st.push] == [Flag.DELTA | (Flag.NONFINITE if flagged else 0)] * 3
        if i == 1 and where != "buffers":  # the value travels in its shard's push only
            others = [s for s in range(servers) if s != where]
            for s in others:
                assert np.isfinite(decode(wire, st.push[s].payload, np.empty(cut.count(s), np.float32))).all()


def test_a_worker_flags_every_shards_push_of_a_gradient_that_is_not_finite(digits):
    """The loop: a push of the gradient of finite weights carries no flag NONFINITE; weights with a NaN (in shard
    1's slice) give a gradient that is not finite, and both shards' pushes carry the flag, besides the header
    the loop stamped."""
    from mpiasgd.comms import Flag

    net, cut, _, thread, outcome = start_sharded_worker(digits)
    p0 = build_model("digits").init_params(0)
    for s in range(2):
        reply(net, cut, s, Tag.WEIGHTS, p0, version=0, step=0)
    first = [take(net, 0, Tag.PUSH, cut.count(0)), take(net, SHARD1, Tag.PUSH, cut.count(1))]
    assert [int(m.header["flags"]) for m in first] == [0, 0]
    assert all(np.isfinite(m.payload).all() for m in first)
    p1 = p0.copy()
    p1[cut.slice(1)[0] + 1] = np.nan
    for s in range(2):
        reply(net, cut, s, Tag.WEIGHTS, p1, version=1, step=1)
    second = [take(net, 0, Tag.PUSH, cut.count(0)), take(net, SHARD1, Tag.PUSH, cut.count(1))]
    assert [int(m.header["flags"]) for m in second] == [Flag.NONFINITE, Flag.NONFINITE]
    assert [int(m.header["step"]) for m in second] == [2, 2]
    assert not np.isfinite(np.concatenate([m.payload[:cut.size(s)] for s, m in enumerate(second)])).all()
    for s in range(2):  # the run ends: both shards answer with STOP
        reply(net, cut, s, Tag.STOP, p0, version=1, step=2)
    take(net, 0, Tag.EVAL, 0)
    thread.join(10)
    assert outcome == {"preempted": False}
