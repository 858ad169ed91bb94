"""Parameter-server shards (`--servers S`) in-process through the fake communicator: given the same arrival
order, S shards, each applying its slice of every push, end with the weights of one server, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from kit.fakempi import Network, rank0
from kit.server import make_server, serve_one

from mpiasgd.comms.protocol import HEADER_BYTES, Message, Tag
from mpiasgd.comms.shard_cut import ShardCut
from mpiasgd.comms.wire import decode, encode, wire_dtype
from mpiasgd.config import Config
from mpiasgd.runlog import RunLog, open_log

P = 1000          # parameters
WORKERS = 3
NUM_TRAIN = 400   # images per epoch: the schedule's clock moves within the scripted pushes


def plain_sgd(overrides):
    """--update-rule sgd for the parameter-server modes unless the test gives a rule: these tests check the protocol
    on A-SGD's update, whose replies are the master weights (the default, auto, is DANA-Zero for 2+ workers)."""
    return {"update_rule": "sgd"} if overrides.get("mode", "async") in ("async", "ssp") else {}


def shards(tmp_path, servers, **overrides):
    """The S servers of one job (S = 1: the unsharded server): [(rank, server)], the network and the cut."""
    cfg = Config(**{"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "lr_schedule": "cosine", "warmup_epochs": 0.5,
                    "epochs": 0, "max_pushes": 1000, "snapshot_interval": 0, "progress": False, "comm_timeout": 2.0,
                    "servers": servers, **plain_sgd(overrides), **overrides})
    cut = ShardCut.balanced(P, 0, servers)
    net = Network(WORKERS + servers)
    params = np.linspace(-1, 1, P, dtype=np.float32)
    decay = (np.arange(P) % 7 != 0).astype(np.float32)  # some parameters without weight decay (biases)
    out = []
    for s in range(servers):
        rank = cut.rank(s, WORKERS)
        log = RunLog.create(str(tmp_path / f"shard{s}.h5"), {"config": cfg.to_json()}, [], cut.size(s),
                            flush_interval=60)
        out.append((rank, rank0(net.comm(rank), cfg, params.copy(), decay, WORKERS, NUM_TRAIN, log)))
    return out, net, cut, cfg


def push_slices(net, cut, servers, worker, step, versions, grad, wire):
    """Worker `worker` pushes its gradient: shard s gets its slice, with the version of the weights it came from."""
    for s, (rank, _) in enumerate(servers):
        a, b = cut.slice(s)
        msg = Message(b - a, wire).stamp(Tag.PUSH, worker, step=step, version=versions[s], samples=32, loss=2.0)
        encode(wire, np.ascontiguousarray(grad[a:b]), msg.payload)
        net.post(worker, rank, Tag.PUSH, msg.buf)


def reply_of(net, worker, source, count, wire):
    """The weights of the last message `source` sent to `worker` (decoded) and its header's version."""
    sent = [(s, t, d) for s, t, d in net.pending(worker) if s == source]
    _, tag, data = sent[-1]
    msg = Message((len(data) - HEADER_BYTES) // wire_dtype(wire).itemsize, wire)
    msg.buf[:] = np.frombuffer(data, np.uint8)
    assert Tag(tag) == Tag.WEIGHTS and msg.count == count
    return decode(wire, msg.payload, np.empty(count, np.float32)), int(msg.header["version"])


ORDER = [1, 2, 3, 1, 1, 2, 3, 3, 1, 2, 2, 1, 3, 1, 2, 3, 3, 3, 1, 2]  # the arrival order of the pushes


@pytest.mark.parametrize("options", [
    {},
    {"nesterov": True, "staleness_lr": "inverse"},
    {"dc_lambda": 2.0, "dc_adaptive": 0.9},
    {"lookahead": -1.0, "wire": "bf16"},
    {"mode": "ssp", "staleness_bound": 5, "wire": "fp16"},
], ids=["momentum", "nesterov-inverse", "dc-asgd-a", "lookahead-bf16", "ssp-fp16"])
@pytest.mark.parametrize("servers", [2, 3])
def test_shards_end_with_the_weights_of_one_server(tmp_path, servers, options):
    wire = options.get("wire", "fp32")
    runs = {}
    for S in (1, servers):
        job, net, cut, _ = shards(tmp_path / f"S{S}", S, **options)
        for _, server in job:
            server.start_workers()
        pulled = {w: [0] * S for w in range(1, WORKERS + 1)}  # the version of each shard's slice each worker holds
        weights = {w: None for w in range(1, WORKERS + 1)}
        steps = dict.fromkeys(range(1, WORKERS + 1), 0)
        rng = np.random.default_rng(11)
        grads = [rng.standard_normal(P).astype(np.float32) for _ in ORDER]
        for w, g in zip(ORDER, grads, strict=True):
            steps[w] += 1
            push_slices(net, cut, job, w, steps[w], pulled[w], g, wire)
            for _, server in job:
                serve_one(server)
            parts = [reply_of(net, w, rank, cut.count(s), wire) for s, (rank, _) in enumerate(job)]
            pulled[w] = [version for _, version in parts]
            weights[w] = np.concatenate([values for values, _ in parts])
        assert all(len(set(v)) == 1 for v in pulled.values())  # every shard is at the same version: same order
        params = np.concatenate([server.params for _, server in job])
        runs[S] = (params, weights, [server.rec.version for _, server in job], cut)
    one, many = runs[1], runs[servers]
    np.testing.assert_array_equal(many[0], one[0])             # the master weights, bit for bit
    for w in range(1, WORKERS + 1):
        np.testing.assert_array_equal(many[1][w], one[1][w])   # what every worker was last sent
    assert many[2] == [len(ORDER)] * servers                    # each shard counted every push
    assert many[3].shards == servers and sum(many[3].size(s) for s in range(servers)) == P


EXCHANGES = [1, 2, 3, 1, 1, 2, 3, 3, 1, 2, 2, 1, 3, 1, 2, 3, 3, 3, 1, 2]  # easgd: the arrival order of the exchanges
NOT_FINITE = 9  # easgd: the exchange whose x_i is NaN everywhere (rejected by every shard)


@pytest.mark.parametrize("servers", [2, 3])
def test_easgd_shards_end_with_the_center_of_one_server(tmp_path, servers):
    """--mode easgd: S shards, each moving its slice of the center x~ toward its slice of x_i, end with the center
    of one server bit for bit when the exchanges arrive in the same order; so does every reply (the center before
    each update, assembled from S slices), and so every worker's elastic step x_i -= alpha (x_i - x~). Both equal
    a reference computed here: x~ += alpha (x_i - x~) in float32. A non-finite x_i moves no shard's center and is
    answered with the center as it is."""
    from mpiasgd.modes.easgd import elastic_difference

    alpha = 0.3
    rng = np.random.default_rng(7)
    noise = [rng.standard_normal(P).astype(np.float32) for _ in EXCHANGES]  # each round's local steps, made up
    runs = {}
    for S in (1, servers):
        job, net, cut, _ = shards(tmp_path / f"S{S}", S, mode="easgd", easgd_alpha=alpha, momentum=0.0)
        for _, server in job:
            server.role.begin()  # the initial center to every worker
        x, pulled = {}, {}  # each worker's x_i; the version of each shard's slice of the center it last got
        for w in range(1, WORKERS + 1):
            parts = [reply_of(net, w, rank, cut.count(s), "fp32") for s, (rank, _) in enumerate(job)]
            x[w] = np.concatenate([values for values, _ in parts])  # x_i starts at the center
            pulled[w] = [version for _, version in parts]
        steps = dict.fromkeys(range(1, WORKERS + 1), 0)
        replies, sent = [], []
        for i, (w, g) in enumerate(zip(EXCHANGES, noise, strict=True)):
            steps[w] += 1
            x[w] = x[w] + np.float32(0.1) * g  # tau local steps
            sent.append(np.full(P, np.nan, np.float32) if i == NOT_FINITE else x[w].copy())
            push_slices(net, cut, job, w, steps[w], pulled[w], sent[-1], "fp32")
            for _, server in job:
                serve_one(server)
            parts = [reply_of(net, w, rank, cut.count(s), "fp32") for s, (rank, _) in enumerate(job)]
            pulled[w] = [version for _, version in parts]
            center = np.concatenate([values for values, _ in parts])
            replies.append(center)
            if i != NOT_FINITE:
                x[w] -= elastic_difference(x[w], center, alpha)  # the worker's elastic step, on the whole vector
        assert all(len(set(v)) == 1 for v in pulled.values())  # every shard is at the same version: same order
        params = np.concatenate([server.params for _, server in job])
        runs[S] = (params, replies, x, [server.rec.version for _, server in job], cut, sent)
    one, many = runs[1], runs[servers]
    np.testing.assert_array_equal(many[5][0], one[5][0])          # (the same exchanges, from the same replies)
    center = np.linspace(-1, 1, P, dtype=np.float32)              # the reference: one center, in this order
    for i, pushed in enumerate(one[5]):
        np.testing.assert_array_equal(one[1][i], center)          # the reply: the center before the update
        if i != NOT_FINITE:
            center = center + elastic_difference(pushed, center, alpha)
    assert not np.array_equal(center, np.linspace(-1, 1, P, dtype=np.float32))
    np.testing.assert_array_equal(one[0], center)
    np.testing.assert_array_equal(many[0], one[0])                # the center, bit for bit
    for a, b in zip(many[1], one[1], strict=True):                # every reply: the center before its update
        np.testing.assert_array_equal(a, b)
    for w in range(1, WORKERS + 1):
        np.testing.assert_array_equal(many[2][w], one[2][w])      # every worker's x_i after its elastic step
    assert many[3] == [len(EXCHANGES) - 1] * servers              # each shard applied every finite exchange
    assert many[4].shards == servers


def test_each_shard_logs_its_own_staleness(tmp_path):
    """Worker 1 pushes twice before worker 2's first push reaches shard 0, and after it at shard 1 (the pushes of
    one worker travel separately to each shard): the shards apply them in different orders, and each logs the
    staleness it saw."""
    job, net, cut, _ = shards(tmp_path, 2)
    (_, a), (rank_b, b) = job
    for _, server in job:
        server.start_workers()
    rng = np.random.default_rng(2)
    g1, g2, g3 = (rng.standard_normal(P).astype(np.float32) for _ in range(3))
    push_slices(net, cut, job[:1], 1, 1, [0], g1, "fp32")   # shard 0: 1.1, 1.2, then 2.1
    serve_one(a)
    push_slices(net, cut, job[:1], 1, 2, [1], g2, "fp32")
    serve_one(a)
    push_slices(net, cut, job[:1], 2, 1, [0], g3, "fp32")
    serve_one(a)
    for w, step, g in ((2, 1, g3), (1, 1, g1)):              # shard 1: 2.1, 1.1, then 1.2
        msg = Message(cut.size(1)).stamp(Tag.PUSH, w, step=step, version=0, samples=32, loss=2.0)
        msg.payload[:] = g[cut.slice(1)[0]:]
        net.post(w, rank_b, Tag.PUSH, msg.buf)
        serve_one(b)
    msg = Message(cut.size(1)).stamp(Tag.PUSH, 1, step=2, version=2, samples=32, loss=2.0)
    msg.payload[:] = g2[cut.slice(1)[0]:]
    net.post(1, rank_b, Tag.PUSH, msg.buf)
    serve_one(b)
    staleness = []
    for server in (a, b):
        server.rec.log.flush()
        with open_log(server.rec.log.path) as fh:
            staleness.append(fh["pushes"]["staleness"].tolist())
    assert staleness == [[0, 0, 2], [0, 1, 0]]
    assert a.rec.version == b.rec.version == 3


# --- the shards' links over the fake network: a shard of rank >= 1 (HubLink) and rank 0 (ShardHub) ---------------

def linked(tmp_path, servers=2, **overrides):
    """Rank 0 (with its ShardHub and a log) and shard 1 (rank WORKERS + 1, with its HubLink and a ShardRecorder)
    of one job over one fake network, as `mpiasgd.rank0.serve` builds them: (hub's loop, shard's loop, net, cut)."""
    from mpiasgd.modes.registry import load
    from mpiasgd.rank0.loop import Rank0
    from mpiasgd.rank0.recorder import Recorder
    from mpiasgd.rank0.shard_hub import HubLink, ShardHub
    from mpiasgd.rank0.shard_recorder import ShardRecorder

    cfg = Config(**{"lr": 0.1, "momentum": 0.9, "epochs": 0, "max_pushes": 4, "snapshot_interval": 0,
                    "progress": False, "comm_timeout": 2.0, "servers": servers, **plain_sgd(overrides), **overrides})
    mode = load(cfg.mode)
    net = Network(WORKERS + servers)
    params = np.linspace(-1, 1, P, dtype=np.float32)
    decay = np.ones(P, np.float32)
    cut = ShardCut.balanced(P, 0, servers)

    def role(r0):
        return mode.rank0(r0, params.copy(), decay, None, None, None)

    log = RunLog.create(str(tmp_path / "run.h5"), {"config": cfg.to_json()}, [], P, flush_interval=60)
    hub = Rank0(net.comm(0), cfg, Recorder(cfg, log, range(1, WORKERS + 1), NUM_TRAIN), role, make_link=ShardHub)
    rank = cut.rank(1, WORKERS)
    shard = Rank0(net.comm(rank), cfg, ShardRecorder(cfg, range(1, WORKERS + 1), NUM_TRAIN, 1, rank), role,
                  make_link=HubLink)
    for loop in (hub, shard):  # as `Rank0.run`: the compiled update loaded before the clocks start. Else a first
        loop.role.warm_up()    # push that loads it (0.5-1 s) lets rank 0's ALIVE and the shard's rows (every
        loop.rec.begin()       # --comm-timeout / 4 = 0.5 s) queue ahead of the pushes a test posts next
    return hub, shard, net, cut


def serve(loop):
    from mpiasgd.comms import Backoff, probe

    loop.handle(*probe(loop.comm, loop.rank, 1.0, "test message", Backoff()))
    loop.tick()


def test_a_push_of_the_wrong_size_names_the_shard_and_the_size_expected(tmp_path):
    from mpiasgd.comms import ProtocolError, message_bytes

    _, shard, net, cut = linked(tmp_path)
    rank = cut.rank(1, WORKERS)
    msg = Message(cut.count(1) + 3).stamp(Tag.PUSH, 2, step=1, version=0, samples=32)
    net.post(2, rank, Tag.PUSH, msg.buf)
    a, b = cut.slice(1)
    with pytest.raises(ProtocolError, match=(
            rf"rank {rank}: PUSH message from rank 2 is {message_bytes(cut.count(1) + 3)} bytes, expected "
            rf"{message_bytes(cut.count(1))} \(160-byte header \+ {cut.count(1)} float32 values\) for "
            rf"parameter-server shard 1 of 2 \(parameters \[{a:,}, {b:,}\)\)")):
        serve(shard)


def test_only_rank_0_may_control_a_shard_and_only_shards_send_rank_0_rows(tmp_path):
    from mpiasgd.comms import ProtocolError

    hub, shard, net, cut = linked(tmp_path)
    rank = cut.rank(1, WORKERS)
    net.post(1, rank, Tag.SHARD_STOP, Message(0).stamp(Tag.SHARD_STOP, 1).buf)  # a worker cannot stop a shard
    with pytest.raises(ProtocolError, match=rf"rank {rank}: SHARD_STOP message from rank 1, which may not send it "
                                            r"here \(from ranks 0;"):
        serve(shard)
    net.post(2, 0, Tag.SHARD_ROWS, Message(0).stamp(Tag.SHARD_ROWS, 2).buf)
    with pytest.raises(ProtocolError, match=rf"SHARD_ROWS message from rank 2, which may not send it here \(from "
                                            rf"ranks {rank};"):
        serve(hub)
    net.post(1, rank, Tag.EVAL, Message(0).stamp(Tag.EVAL, 1).buf)  # EVAL goes to rank 0 only
    with pytest.raises(ProtocolError, match=r"EVAL message from rank 1, which may not send it here"):
        serve(shard)


def stop_steps(data):
    """{worker: step} of a SHARD_STOPPED or SHARD_FINAL's bytes."""
    from mpiasgd.comms.protocol import STOP_STEP, rows_of

    msg = Message((len(data) - HEADER_BYTES) // 4)
    msg.buf[:] = np.frombuffer(data, np.uint8)
    return {int(w): int(step) for w, step in rows_of(msg, STOP_STEP, -1, -1)[["worker", "step"]].tolist()}


def test_a_shard_stops_on_rank_0s_word_and_finishes_its_workers(tmp_path):
    """Shard 1 keeps applying pushes past --max-pushes (only rank 0 decides). On SHARD_STOP (flag PREEMPT) it tells
    rank 0 each worker's last step (SHARD_STOPPED) and defers a push, a FINISH and a FETCH until SHARD_FINAL says
    which pushes every shard applies (here: not worker 1's step 3, which is dropped); then it answers them with STOP
    (flag PREEMPT) and its final slice, and FETCH with its slice and velocity; END before every worker got STOP is
    refused; its rows reach rank 0's log."""
    from mpiasgd.comms import Flag, ProtocolError
    from mpiasgd.rank0.shard_hub import steps_message
    from mpiasgd.runlog import open_log

    hub, shard, net, cut = linked(tmp_path, max_pushes=2)
    rank = cut.rank(1, WORKERS)
    role = shard.role
    role.start_workers()
    for w in (1, 2):
        net.take(w)  # the initial weights
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(P).astype(np.float32) for _ in range(4)]
    for i, w in enumerate((1, 2, 1)):  # three pushes: past --max-pushes 2, still applied here
        push_to(net, cut, 1, rank, w, 1 + (i == 2), role.rec.version, grads[i])
        serve(shard)
        assert Tag(net.pending(w)[-1][1]) == Tag.WEIGHTS
        net.take(w)
    assert role.rec.version == 3 and not role.rec.stop_reason
    net.post(2, rank, Tag.FINISH, Message(0).stamp(Tag.FINISH, 2, step=1).buf)  # worker 2: rank 0 said STOP
    serve(shard)
    assert net.pending(2) == []  # held until this shard stops
    net.post(0, rank, Tag.SHARD_STOP, Message(0).stamp(Tag.SHARD_STOP, 0, flags=Flag.PREEMPT).buf)
    serve(shard)
    final = role.params.copy()
    told = net.take(0, rank, Tag.SHARD_STOPPED)
    assert stop_steps(told[2]) == {1: 2, 2: 1, 3: 0}  # the last step it applied of each worker
    assert net.pending(2) == []  # still held: the shards have not agreed yet
    push_to(net, cut, 1, rank, 1, 3, 3, grads[3])  # deferred (no answer yet), then dropped
    serve(shard)
    net.post(0, rank, Tag.FETCH, Message(0).stamp(Tag.FETCH, 0, step=7).buf)  # deferred
    serve(shard)
    assert net.pending(1) == [] and net.pending(0) == [] and role.rec.version == 3
    net.post(0, rank, Tag.SHARD_FINAL, steps_message(Tag.SHARD_FINAL, 0, {1: 2, 2: 1, 3: 0}).buf)
    serve(shard)
    stop = reply_of_tag(net, 2, rank, cut.count(1))
    assert stop[0] == Tag.STOP and int(stop[1]["flags"]) & Flag.PREEMPT and int(stop[1]["step"]) == 1
    np.testing.assert_array_equal(stop[2], final)
    stop = reply_of_tag(net, 1, rank, cut.count(1))
    assert stop[0] == Tag.STOP and int(stop[1]["step"]) == 3 and role.rec.version == 3
    np.testing.assert_array_equal(stop[2], final)
    np.testing.assert_array_equal(role.params, final)
    got = net.take(0, rank, Tag.SLICE)
    msg = Message(2 * cut.size(1))
    msg.buf[:] = np.frombuffer(got[2], np.uint8)
    assert (int(msg.header["step"]), int(msg.header["version"])) == (7, 3)
    np.testing.assert_array_equal(msg.payload[:cut.size(1)], final)
    np.testing.assert_array_equal(msg.payload[cut.size(1):], role.optimizer.velocity)
    net.post(0, rank, Tag.SHARD_FINAL, steps_message(Tag.SHARD_FINAL, 0, {1: 2, 2: 1, 3: 0}).buf)
    with pytest.raises(ProtocolError, match=r"SHARD_FINAL from rank 0 a second time"):
        serve(shard)
    net.post(1, rank, Tag.FINISH, Message(0).stamp(Tag.FINISH, 1, step=3).buf)  # after its STOP: refused
    with pytest.raises(ProtocolError, match=r"FINISH step 3 from worker rank 1 after it was sent STOP"):
        serve(shard)
    net.post(0, rank, Tag.END, Message(0).stamp(Tag.END, 0).buf)
    with pytest.raises(ProtocolError, match=r"END from rank 0 before workers \[3\] were sent STOP"):
        serve(shard)
    net.post(3, rank, Tag.FINISH, Message(0).stamp(Tag.FINISH, 3, step=0).buf)  # it never pushed: step 0
    serve(shard)
    assert reply_of_tag(net, 3, rank, cut.count(1))[0] == Tag.STOP
    net.post(0, rank, Tag.END, Message(0).stamp(Tag.END, 0).buf)
    serve(shard)
    assert shard.done() and shard.link.preempted
    shard.finish()  # its last rows, flag FINAL
    while net.pending(0):
        serve(hub)
    hub.rec.log.flush()
    with open_log(hub.rec.log.path) as f:
        rows = f["shard_pushes"][()]
    assert rows["shard"].tolist() == [1] * 4 and rows["applied"].tolist() == [1, 1, 1, 0]
    assert rows["version"].tolist() == [1, 2, 3, 3] and rank in hub.link.ended
    assert hub.rec.shards.versions[1] == 3


def test_a_final_step_behind_what_a_shard_applied_or_naming_other_workers_is_refused(tmp_path):
    from mpiasgd.comms import ProtocolError
    from mpiasgd.rank0.shard_hub import steps_message

    _, shard, net, cut = linked(tmp_path)
    rank = cut.rank(1, WORKERS)
    net.post(0, rank, Tag.SHARD_FINAL, steps_message(Tag.SHARD_FINAL, 0, {1: 0, 2: 0, 3: 0}).buf)
    with pytest.raises(ProtocolError, match=rf"rank {rank} \(parameter-server shard 1\): SHARD_FINAL from rank 0 "
                                            r"before SHARD_STOP"):
        serve(shard)
    shard.role.start_workers()
    push_to(net, cut, 1, rank, 2, 1, 0, np.ones(P, np.float32))
    serve(shard)
    net.post(0, rank, Tag.SHARD_STOP, Message(0).stamp(Tag.SHARD_STOP, 0).buf)
    serve(shard)
    net.post(0, rank, Tag.SHARD_FINAL, steps_message(Tag.SHARD_FINAL, 0, {1: 0, 2: 1}).buf)
    with pytest.raises(ProtocolError, match=r"SHARD_FINAL from rank 0 holds steps \{1: 0, 2: 1\}, expected one "
                                            r"step >= 0 for each worker \[1, 2, 3\]"):
        serve(shard)
    with pytest.raises(ProtocolError, match=r"the agreed final steps \{1: 0, 2: 0, 3: 0\} .* behind this shard's "
                                            r"applied steps \(worker: \(applied, final\)\) \{2: \(1, 0\)\}"):
        shard.role.agreement.settle({1: 0, 2: 0, 3: 0})


@pytest.mark.parametrize("mode", ["async", "easgd"])
def test_the_shards_apply_the_same_pushes_whichever_way_the_stop_races_them(tmp_path, mode):
    """--max-pushes 2. Rank 0 applies worker 1's and worker 2's first pushes and decides to stop; worker 3's first
    push is still on its way to rank 0. Shard 1 has applied worker 1's and worker 3's; worker 2's is still on its
    way to it. Before the agreement each shard would have ended with another set of pushes (rank 0 without
    worker 3's, shard 1 without worker 2's). Now both apply all three, end at version 3, drop worker 1's second
    push, and every STOP of a shard carries the same final slice; rank 0 logs both shards' pushes alike. (easgd:
    the pushes are x_i, the exchanges of the center's slices; the same agreement.)"""

    hub, shard, net, cut, rank = started(tmp_path, max_pushes=2, mode=mode)
    rng = np.random.default_rng(5)
    g = {w: rng.standard_normal(P).astype(np.float32) for w in range(1, WORKERS + 1)}
    for w in (1, 2):  # rank 0: version 2, the stop
        push_to(net, cut, 0, 0, w, 1, hub.rec.version, g[w])
        serve(hub)
    assert hub.rec.stop_reason and hub.rec.version == 2
    assert Tag(net.take(1, 0)[1]) == Tag.WEIGHTS and net.pending(2) == []  # worker 2's STOP: once settled
    stop_to_shard = net.take(rank, 0, Tag.SHARD_STOP)
    for w in (1, 3):  # shard 1, before it hears of the stop
        push_to(net, cut, 1, rank, w, 1, shard.rec.version, g[w])
        serve(shard)
        assert Tag(net.take(w, rank)[1]) == Tag.WEIGHTS
    net.post(0, rank, Tag.SHARD_STOP, stop_to_shard[2])
    serve(shard)  # SHARD_STOPPED {1: 1, 2: 0, 3: 1}
    push_to(net, cut, 1, rank, 2, 1, 0, g[2])  # worker 2's first push reaches shard 1: deferred
    serve(shard)
    push_to(net, cut, 0, 0, 3, 1, 0, g[3])  # worker 3's reaches rank 0: deferred
    serve(hub)
    assert hub.rec.version == 2 and shard.rec.version == 2 and net.pending(3) == []
    for w in (0, 1):  # worker 1 got WEIGHTS from both shards: its second push, to both
        push_to(net, cut, w, (0, rank)[w], 1, 2, (hub, shard)[w].rec.version, g[1])
    serve(hub)  # rank 0 takes worker 1's second push (deferred) ...
    serve(hub)  # ... and shard 1's SHARD_STOPPED: SHARD_FINAL {1: 1, 2: 1, 3: 1}; rank 0 applies worker 3's push
    assert hub.role.agreement.final == {1: 1, 2: 1, 3: 1} and hub.rec.version == 3
    while net.pending(rank):  # shard 1: worker 1's second push (deferred), SHARD_FINAL: worker 2's applied
        serve(shard)
    assert shard.role.agreement.final == {1: 1, 2: 1, 3: 1} and shard.rec.version == 3
    finals = {}
    for s, (loop, src) in enumerate(((hub, 0), (shard, rank))):
        for w in range(1, WORKERS + 1):
            if w == 3 and s == 1:  # shard 1 answered worker 3's push with WEIGHTS: worker 3 asks with FINISH
                net.post(3, rank, Tag.FINISH, Message(0).stamp(Tag.FINISH, 3, step=1).buf)
                serve(shard)
            tag, header, payload = reply_of_tag(net, w, src, cut.count(s))
            assert tag == Tag.STOP and int(header["version"]) == 3, (s, w, tag)
            finals.setdefault(s, payload)
            np.testing.assert_array_equal(payload, finals[s])
        np.testing.assert_array_equal(finals[s], loop.role.params)
    mine, theirs = logged(hub, shard, net, "pushes", "shard_pushes")
    theirs = theirs[theirs["shard"] == 1]
    applied = [sorted((int(r["worker"]), int(r["step"])) for r in rows if r["applied"]) for rows in (mine, theirs)]
    assert applied[0] == applied[1] == [(1, 1), (2, 1), (3, 1)]
    dropped = [sorted((int(r["worker"]), int(r["step"])) for r in rows if not r["applied"]) for rows in (mine, theirs)]
    assert dropped[0] == dropped[1] == [(1, 2)]


def logged(hub, shard, net, *tables):
    """Shard 1's rows sent and taken into rank 0's log, flushed; the log's `tables`, in that order."""
    from mpiasgd.runlog import open_log

    shard.link.send_rows()
    drain(hub, net)
    hub.rec.log.flush()
    with open_log(hub.rec.log.path) as f:
        return [f[name][()] for name in tables]


def drain(loop, net):
    """`loop` handles every message queued for its rank (rank 0 may have sent a shard ALIVE meanwhile; a shard may
    have sent rank 0 its rows), in arrival order."""
    while net.pending(loop.rank):
        serve(loop)


@pytest.mark.parametrize("mode", ["async", "easgd"])
def test_an_interval_checkpoint_is_one_cut_whichever_way_the_pause_races_the_pushes(tmp_path, mode):
    """Rank 0 applies worker 1's and worker 2's first pushes and an interval checkpoint falls due (`pause`); worker
    3's first push is still on its way to rank 0. Shard 1 has applied worker 1's and worker 3's; worker 2's is
    still on its way to it. Taken as they stood, the two slices would hold different pushes. In the pause both
    apply all three (version 3) and hold worker 1's second push; the checkpoint holds version 3 on both shards,
    the worker rows of those pushes and (async) the weights each shard sent with its reply at version 3. Then
    each shard processes the held push: version 4, and worker 1 is answered with WEIGHTS by both."""
    from mpiasgd import checkpoint

    hub, shard, net, cut, rank = started(tmp_path, mode=mode)
    answering(hub, shard, net)
    rng = np.random.default_rng(8)
    g = {w: rng.standard_normal(P).astype(np.float32) for w in range(1, WORKERS + 1)}
    for w in (1, 2):  # rank 0: version 2, then the pause
        push_to(net, cut, 0, 0, w, 1, hub.rec.version, g[w])
        drain(hub, net)
    hub.link.pause()
    assert hub.link.pausing and not hub.link.paused()
    pause = net.take(rank, 0, Tag.SHARD_PAUSE)
    for w in (1, 3):  # shard 1, before it hears of the pause
        push_to(net, cut, 1, rank, w, 1, shard.rec.version, g[w])
        drain(shard, net)
        assert Tag(net.pending(w)[-1][1]) == Tag.WEIGHTS
    net.post(0, rank, Tag.SHARD_PAUSE, pause[2])
    drain(shard, net)
    paused = net.take(0, rank, Tag.SHARD_PAUSED)
    assert stop_steps(paused[2]) == {1: 1, 2: 0, 3: 1}  # the last step shard 1 applied of each worker
    push_to(net, cut, 1, rank, 2, 1, 0, g[2])  # worker 2's first push reaches shard 1: held
    drain(shard, net)
    push_to(net, cut, 0, 0, 3, 1, 0, g[3])  # worker 3's reaches rank 0: held
    drain(hub, net)
    assert hub.rec.version == 2 and shard.rec.version == 2
    assert [src for src, _, _ in net.pending(2)] == [0] and [src for src, _, _ in net.pending(3)] == [rank]
    for s in (0, 1):  # worker 1 got WEIGHTS from both shards: its second push, to both
        push_to(net, cut, s, (0, rank)[s], 1, 2, (hub, shard)[s].rec.version, g[1])
    drain(shard, net)  # shard 1 holds it
    drain(hub, net)  # rank 0 holds it
    assert hub.rec.version == 2 and hub.role.agreement.final is None and hub.role.agreement.deferred == [3, 1]
    assert shard.role.agreement.deferred == [2, 1]
    net.post(rank, 0, Tag.SHARD_PAUSED, paused[2])
    # shard 1's SHARD_PAUSED: SHARD_FINAL {1: 1, 2: 1, 3: 1}; rank 0 applies worker 3's push, writes the
    # checkpoint (shard 1 answers its FETCH once it has applied worker 2's), then both process worker 1's second
    drain(hub, net)
    ck = checkpoint.load(str(tmp_path / "run.ckpt.h5"))
    assert ck.reason == "interval" and ck.version == 3 and ck.shard_versions.tolist() == [3, 3]
    assert {int(r["rank"]): int(r["step"]) for r in ck.workers} == {1: 1, 2: 1, 3: 1}
    at3 = [reply_of_tag(net, 3, 0, cut.count(0)), reply_of_tag(net, 2, rank, cut.count(1))]  # each at version 3
    assert [(tag, int(header["version"])) for tag, header, _ in at3] == [(Tag.WEIGHTS, 3)] * 2
    if mode == "async":  # (easgd replies with the center before the exchange's update)
        np.testing.assert_array_equal(ck.params, np.concatenate([at3[0][2], at3[1][2]]))
    assert not hub.link.pausing and not shard.role.agreement.pausing
    assert hub.role.agreement.final is None is shard.role.agreement.final
    assert hub.rec.version == shard.rec.version == 4  # worker 1's second push, held in the pause
    for s, src in enumerate((0, rank)):
        tag, header, _ = reply_of_tag(net, 1, src, cut.count(s))
        assert tag == Tag.WEIGHTS and int(header["step"]) == 2 and int(header["version"]) == 4


def answering(hub, shard, net):
    """Rank 0's waits for shard 1's answers (a snapshot's or checkpoint's SLICE) serve shard 1 meanwhile."""
    def await_shard(r, what, poll):
        while not (got := poll()):
            drain(shard, net)
        return got

    hub.link.await_shard = await_shard


def test_a_pause_out_of_turn_is_refused(tmp_path):
    """A shard refuses SHARD_PAUSE while paused or after SHARD_STOP, SHARD_STOP while paused (rank 0 tells the
    stop after the pause), and FETCH flag RESUME without a pause; rank 0 refuses SHARD_PAUSED it did not ask for."""
    from mpiasgd.comms import Flag, ProtocolError
    from mpiasgd.rank0.shard_hub import steps_message

    hub, shard, net, _, rank = started(tmp_path)
    net.post(0, rank, Tag.FETCH, Message(0).stamp(Tag.FETCH, 0, step=1, flags=Flag.RESUME).buf)
    with pytest.raises(ProtocolError, match=rf"rank {rank} \(parameter-server shard 1\): FETCH flag RESUME from "
                                            r"rank 0 without SHARD_PAUSE"):
        serve(shard)
    net.post(rank, 0, Tag.SHARD_PAUSED, steps_message(Tag.SHARD_PAUSED, rank, {1: 0, 2: 0, 3: 0}).buf)
    with pytest.raises(ProtocolError, match=rf"rank 0: SHARD_PAUSED from rank {rank} before SHARD_PAUSE"):
        serve(hub)
    net.post(0, rank, Tag.SHARD_PAUSE, Message(0).stamp(Tag.SHARD_PAUSE, 0).buf)
    drain(shard, net)
    assert shard.role.agreement.pausing and net.take(0, rank, Tag.SHARD_PAUSED) is not None
    net.post(0, rank, Tag.SHARD_PAUSE, Message(0).stamp(Tag.SHARD_PAUSE, 0).buf)
    with pytest.raises(ProtocolError, match=r"SHARD_PAUSE from rank 0 while paused"):
        serve(shard)
    net.post(0, rank, Tag.SHARD_STOP, Message(0).stamp(Tag.SHARD_STOP, 0).buf)
    with pytest.raises(ProtocolError, match=r"SHARD_STOP from rank 0 while paused"):
        serve(shard)
    with pytest.raises(ProtocolError, match=r"resumed before the pause's pushes were applied"):
        shard.role.agreement.resume()
    _, other, net2, cut2 = linked(tmp_path / "b")
    rank2 = cut2.rank(1, WORKERS)
    net2.post(0, rank2, Tag.SHARD_STOP, Message(0).stamp(Tag.SHARD_STOP, 0).buf)
    drain(other, net2)
    net2.post(0, rank2, Tag.SHARD_PAUSE, Message(0).stamp(Tag.SHARD_PAUSE, 0).buf)
    with pytest.raises(ProtocolError, match=r"SHARD_PAUSE from rank 0 after SHARD_STOP"):
        serve(other)


def test_a_stop_decided_in_a_pause_is_told_the_shards_after_it(tmp_path):
    """--max-pushes 3: the push that reaches the limit on rank 0 is applied in the pause (it is within the agreed
    steps). Rank 0 writes the pause's checkpoint (version 3 on both shards) and tells the shards the stop only
    then. Shard 1 meanwhile processed a push it held in the pause (worker 1's second); the stop's agreement
    includes it, so rank 0 applies it too: both end at version 4."""
    from mpiasgd import checkpoint

    hub, shard, net, cut, rank = started(tmp_path, max_pushes=3)
    answering(hub, shard, net)
    grad = np.full(P, 0.01, np.float32)
    for w in (1, 2):  # both shards: version 2
        for s, r, loop in ((0, 0, hub), (1, rank, shard)):
            push_to(net, cut, s, r, w, 1, loop.rec.version, grad)
            drain(loop, net)
            net.take(w, r)
    push_to(net, cut, 1, rank, 3, 1, 2, grad)  # worker 3's push reaches shard 1 first: version 3 there
    drain(shard, net)
    hub.link.pause()
    drain(shard, net)  # SHARD_PAUSE: SHARD_PAUSED {1: 1, 2: 1, 3: 1}
    push_to(net, cut, 1, rank, 1, 2, 3, grad)  # worker 1's second push (as if rank 0 had answered): held
    drain(shard, net)
    drain(hub, net)  # SHARD_PAUSED: final {.., 3: 1}; rank 0 waits for worker 3's push
    assert hub.link.pausing and not hub.link.paused() and not hub.rec.stop_reason
    push_to(net, cut, 0, 0, 3, 1, 2, grad)
    drain(hub, net)  # applied (version 3): the stop; then the pause's checkpoint, and the pause ends
    ck = checkpoint.load(str(tmp_path / "run.ckpt.h5"))
    assert ck.reason == "interval" and ck.shard_versions.tolist() == [3, 3]
    assert hub.rec.stop_reason and not hub.link.pausing and not hub.link.stop_told  # told at the next tick
    assert shard.rec.version == 4 and not shard.rec.stop_reason  # shard 1 processed the push it held
    assert [src for src, _, _ in net.pending(3)] == [rank]  # rank 0's STOP to worker 3 waits for the agreement
    hub.tick()
    assert hub.link.stop_told
    drain(shard, net)  # SHARD_STOP: SHARD_STOPPED {1: 2, 2: 1, 3: 1}
    drain(hub, net)  # final {1: 2, 2: 1, 3: 1}: rank 0 waits for worker 1's second push
    assert hub.role.agreement.final == {1: 2, 2: 1, 3: 1} and not hub.role.settled()
    push_to(net, cut, 0, 0, 1, 2, 3, grad)
    drain(hub, net)
    drain(shard, net)
    assert hub.role.settled() and shard.role.settled() and hub.rec.version == shard.rec.version == 4
    assert [(src, Tag(tag)) for src, tag, _ in net.pending(3)] == [(rank, Tag.WEIGHTS), (0, Tag.STOP)]


def test_a_silent_shard_is_named_before_the_workers_waiting_for_it(tmp_path):
    """A hung shard: the workers, waiting for its replies, fall silent too (here as long as it). Rank 0 names the
    shard, not a worker (it named the workers when their silence was looked at first)."""
    from mpiasgd.comms import CommTimeout

    hub, _, _, _, rank = started(tmp_path)
    now = hub.rec.now()
    for r in hub.last_seen:
        hub.last_seen[r] = now - 10.0  # every worker and shard 1: silent for 10 s (--comm-timeout 2)
    with pytest.raises(CommTimeout, match=rf"rank 0: parameter-server shard 1 \(rank {rank}\) has sent nothing"):
        hub.check_stalls()
    hub.last_seen[rank] = hub.rec.now()  # shard 1 spoke: now a worker is the one named
    with pytest.raises(CommTimeout, match=r"rank 0: worker rank \d has sent nothing"):
        hub.check_stalls()


def push_to(net, cut, s, rank, worker, step, version, grad):
    """Worker `worker`'s push to shard `s` (rank `rank`): its slice of `grad`."""
    a, b = cut.slice(s)
    msg = Message(b - a).stamp(Tag.PUSH, worker, step=step, version=version, samples=32, loss=2.0)
    msg.payload[:] = grad[a:b]
    net.post(worker, rank, Tag.PUSH, msg.buf)


def reply_of_tag(net, worker, source, count):
    """(tag, header, payload) of the last message `source` sent `worker` (taken off the network)."""
    got = [(s, t, d) for s, t, d in net.pending(worker) if s == source][-1]
    net.take(worker, source)
    msg = Message(count)
    msg.buf[:] = np.frombuffer(got[2], np.uint8)
    return Tag(got[1]), msg.header, msg.payload.copy()


def test_rank_0_assembles_every_shards_slice(tmp_path):
    """ShardHub.assemble: SHARD_STOP first once the run stops, then FETCH; the answers go where the cut says."""
    hub, _, net, cut = linked(tmp_path)
    rank = cut.rank(1, WORKERS)
    a, b = cut.slice(1)
    answer = Message(2 * (b - a)).stamp(Tag.SLICE, rank, step=1, version=9)
    answer.payload[:b - a] = 5.0
    answer.payload[b - a:] = -1.0
    net.post(rank, 0, Tag.SLICE, answer.buf)  # already there: the hub's receive takes it
    hub.rec.stop("test")
    params, velocity, versions = hub.link.assemble(np.zeros(cut.size(0), np.float32), np.ones(cut.size(0),
                                                                                                np.float32))
    assert [Tag(t) for _, t, _ in net.pending(rank)] == [Tag.SHARD_STOP, Tag.FETCH]
    assert params[:a].tolist() == [0.0] * a and params[a:].tolist() == [5.0] * (b - a)
    assert velocity[:a].tolist() == [1.0] * a and velocity[a:].tolist() == [-1.0] * (b - a)
    assert versions == [0, 9]


def test_a_shards_recorder_keeps_rows_for_rank_0_and_decides_nothing(tmp_path):
    from mpiasgd.rank0.recorder import TrainingDiverged
    from mpiasgd.rank0.shard_recorder import ShardRecorder

    cfg = Config(epochs=0, max_pushes=1, max_rejects=2, progress=False, servers=2)
    rec = ShardRecorder(cfg, range(1, 3), NUM_TRAIN, 1, 4)
    assert not rec.keeps_log and rec.snapshots.seconds == 0 and rec.checkpoints.seconds == 0
    rec.begin()
    rec.counter.version = 5
    rec.check_stop()  # past --max-pushes 1: only rank 0 decides
    assert not rec.stop_reason
    rec.push(worker=2, step=3, base_version=3, version=5, staleness=1, applied=True, loss=2.0, samples=32)
    rows = rec.take_rows()
    assert rows[["shard", "worker", "step", "base_version", "version", "staleness", "applied"]].tolist() == [
        (1, 2, 3, 3, 5, 1, 1)]
    assert len(rec.take_rows()) == 0 and rec.snapshot(np.zeros(3, np.float32)) == -1
    rec.reject(1, 4)
    with pytest.raises(TrainingDiverged, match=r"rank 4 \(parameter-server shard 1\): worker rank 1 pushed 2 "
                                               r"non-finite gradients in a row"):
        rec.reject(1, 5)
    rec.stop("rank 0 stopped the run")
    assert rec.stop_reason and rec.summary({}, "") == {}


# --- the bytes every shard moves, and a resume's figures (`mpiasgd.rank0.recorder.ShardFigures`) ---

def exchange(net, cut, hub, shard, pushes):
    """`pushes` [(worker, step, base version)]: each pushed to both shards, each shard answering; the replies
    taken off the network."""
    rank = cut.rank(1, WORKERS)
    grad = np.full(P, 0.01, np.float32)
    for w, step, base in pushes:
        push_to(net, cut, 0, 0, w, step, base, grad)
        serve(hub)
        push_to(net, cut, 1, rank, w, step, base, grad)
        serve(shard)
        for source in (0, rank):  # (each loop handled the push, not a message its clock sent ahead of it)
            reply = net.take(w, source)
            assert reply is not None and Tag(reply[1]) == Tag.WEIGHTS, f"rank {source} did not answer worker {w}"


def started(tmp_path, max_pushes=100, **overrides):
    """`linked` with both shards' initial weights sent and taken by every worker: (hub's loop, shard's loop, net,
    cut, shard 1's rank)."""
    hub, shard, net, cut = linked(tmp_path, max_pushes=max_pushes, **overrides)
    rank = cut.rank(1, WORKERS)
    hub.role.begin()
    shard.role.begin()
    for w in range(1, WORKERS + 1):
        net.take(w, 0)
        net.take(w, rank)
    return hub, shard, net, cut, rank


@pytest.mark.parametrize("servers", [1, 2])
def test_a_dead_workers_preemption_says_checkpointing_only_where_it_checkpoints(tmp_path, capsys, servers):
    """The launcher's SIGTERM after a worker died: with one server rank 0 checkpoints, and says so; with 2 shards the
    dead worker's last push never reaches every shard, no checkpoint is written, and rank 0 said "checkpointing"
    before its final line said "no checkpoint written now"."""
    import subprocess

    from mpiasgd.rank0.loop import Preempted

    if servers == 1:
        server, _, _ = make_server(tmp_path, num_workers=WORKERS, checkpoint_interval=0)
        server.r0.role.begin()
        loop = server.r0
    else:
        loop, _, _, _, _ = started(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()  # (a pid that has exited)
    loop.pids = {1: (loop.host, dead.pid)}
    with pytest.raises(Preempted) as e:
        loop.preempt("SIGTERM received by rank 0")
    assert e.value.dead and e.value.waiting == [1]
    said = capsys.readouterr().err
    if servers == 1:
        assert ": checkpointing and ending the run" in said and "checkpoint" in loop.resume_note(), said
    else:
        assert "checkpointing" not in said and ": ending the run without a checkpoint" in said, said
        assert loop.resume_note().startswith("no checkpoint written now (with --servers")


def test_rank_0_sums_the_bytes_of_every_shard(tmp_path):
    """Each shard counts the bytes of its own exchange (its slice); shard 1's counts reach rank 0 with its rows and
    its slices, and the summary's wire_bytes_* are every shard's (shard_wire_bytes_*: each one's), not rank 0's
    alone (which was about 1/S of them)."""
    from mpiasgd.comms import message_bytes

    hub, shard, net, cut, rank = started(tmp_path)
    exchange(net, cut, hub, shard, [(1, 1, 0), (2, 1, 0)])
    size = [message_bytes(cut.count(s)) for s in range(2)]
    assert size[0] != size[1]  # (P = 1000 cut 500 / 500: the same size only if the counts are equal)
    mine = {"pushed": 2 * size[1], "pulled": (WORKERS + 2) * size[1]}  # the initial weights, two replies
    assert shard.rec.wire_bytes == mine
    assert hub.rec.wire_bytes == {"pushed": 2 * size[0], "pulled": (WORKERS + 2) * size[0]}
    assert hub.rec.wire_summary()["wire_bytes_pushed"] == 2 * size[0]  # nothing heard from shard 1 yet
    shard.link.send_rows()
    drain(hub, net)
    assert hub.rec.shards.wire[1] == [mine["pushed"], mine["pulled"]]
    exchange(net, cut, hub, shard, [(3, 1, 0)])  # then a SLICE (a snapshot's or checkpoint's) says more
    shard.link.send_slice(hub.link.requests + 1)  # (the answer to the FETCH that `assemble` sends)
    hub.link.assemble(hub.role.params)
    assert net.take(rank, 0, Tag.FETCH) is not None
    assert hub.rec.shards.wire[1] == [3 * size[1], (WORKERS + 3) * size[1]]
    summary = hub.rec.wire_summary()
    assert summary == {"wire_bytes_pushed": 3 * (size[0] + size[1]),
                       "wire_bytes_pulled": (WORKERS + 3) * (size[0] + size[1]),
                       "shard_wire_bytes_pushed": [3 * size[0], 3 * size[1]],
                       "shard_wire_bytes_pulled": [(WORKERS + 3) * size[0], (WORKERS + 3) * size[1]]}
    assert {k: summary[k] for k in ("wire_bytes_pushed", "wire_bytes_pulled")} == {
        k: v for k, v in hub.rec.summary({}, "test").items() if k.startswith("wire_bytes_")}


def test_a_resume_continues_the_bytes_and_every_shards_staleness_from_the_log(tmp_path):
    """A resumed run's bytes (every shard's) continue from its checkpoint's (/wire_bytes rows, logged with the
    checkpoint), and each shard's staleness covers the log's rows before the resume, less the span the resume
    superseded (pushes logged after the checkpoint by the segment that died), as the run's staleness does."""
    import time

    from mpiasgd import checkpoint
    from mpiasgd.rank0.recorder import Recorder, ShardFigures

    hub, shard, net, cut, rank = started(tmp_path)
    exchange(net, cut, hub, shard, [(1, 1, 0), (2, 1, 0), (3, 1, 0)])  # staleness 0, 1, 2 on both shards
    shard.link.send_rows()
    drain(hub, net)
    shard.link.send_slice(hub.link.requests + 1)  # the answer to the checkpoint's FETCH
    assert hub.rec.write_checkpoint(hub.role.state("interval"))
    assert net.take(rank, 0, Tag.FETCH) is not None  # (answered above)
    at_checkpoint = hub.rec.wire_by_shard()
    assert at_checkpoint == [(shard_bytes[0], shard_bytes[1]) for shard_bytes in (
        (hub.rec.wire_bytes["pushed"], hub.rec.wire_bytes["pulled"]),
        (shard.rec.wire_bytes["pushed"], shard.rec.wire_bytes["pulled"]))]
    time.sleep(0.05)
    exchange(net, cut, hub, shard, [(1, 2, 0)])  # after the checkpoint: staleness 3, then the segment dies
    shard.link.send_rows()
    drain(hub, net)
    assert hub.rec.shards.staleness_max == [3, 3]
    hub.rec.log.flush()
    hub.rec.log.file.close()  # (killed: no summary)
    ckpt = checkpoint.load(hub.rec.checkpoint_path)
    assert ckpt.steps() == [(1, 1), (2, 1), (3, 1)][:WORKERS]
    log = RunLog.reopen(hub.rec.log.path, [], 60, None, resumed_at=ckpt.log_time, resumed_steps=ckpt.steps())
    try:
        rec = Recorder(hub.cfg, log, range(1, WORKERS + 1), NUM_TRAIN)
        rec.shards = ShardFigures(2)  # (as the ShardHub makes it, before the restore)
        rec.restore(ckpt)
        assert rec.wire_by_shard() == at_checkpoint
        figures = rec.shards.summary()
        assert figures["shard_staleness_mean"] == [1.0, 1.0] and figures["shard_staleness_max"] == [2, 2]
        rec.count_wire(pushed=10, pulled=20)  # this job's bytes add to the checkpoint's
        rec.shards.report_wire(1, 30, 40)
        assert rec.wire_by_shard() == [(at_checkpoint[0][0] + 10, at_checkpoint[0][1] + 20),
                                       (at_checkpoint[1][0] + 30, at_checkpoint[1][1] + 40)]
    finally:
        log.close("completed")


def test_a_resume_without_the_logs_rows_counts_from_zero(tmp_path):
    """A checkpoint without counts of its own (written before it kept them) whose log has no /wire_bytes rows at
    its time (a log written before them, or a new one): the bytes count from the resume, and a shard's
    staleness from the rows there are."""
    from mpiasgd import checkpoint
    from mpiasgd.rank0.recorder import Recorder, ShardFigures

    cfg = Config(epochs=0, max_pushes=10, progress=False, servers=2)
    log = RunLog.create(str(tmp_path / "new.h5"), {"config": cfg.to_json()}, [], 4, flush_interval=60)
    try:
        rec = Recorder(cfg, log, range(1, 3), NUM_TRAIN)
        rec.shards = ShardFigures(2)
        ckpt = checkpoint.Checkpoint(params=np.zeros(4, np.float32), momentum=np.zeros(4, np.float32),
                                     workers=np.zeros(0, checkpoint.WORKER_STATE), version=7, samples=10,
                                     elapsed=1.0, log_time=1.0, config=cfg.to_json(), log=log.path, mode=cfg.mode,
                                     model=cfg.model, reason="interval")
        rec.restore(ckpt)
        assert rec.wire_bytes is None and rec.wire_by_shard() is None and rec.wire_summary() == {}
        assert rec.shards.summary()["shard_staleness_max"] == [0, 0]
    finally:
        log.close("completed")


@pytest.mark.parametrize("servers", [1, 2])
def test_a_signals_checkpoint_whose_log_rows_were_lost_still_continues_the_bytes(tmp_path, servers):
    """A signal: the log is closed at once (`end_early`), the checkpoint is written, and the launcher's SIGKILL
    comes before the log is opened again, so neither its /checkpoints nor its /wire_bytes rows reach the file.
    The resume continues every shard's bytes from the checkpoint's own counts (it restarted them from zero)."""
    from mpiasgd import checkpoint
    from mpiasgd.rank0.recorder import Recorder, ShardFigures
    from mpiasgd.runlog import WriterLock

    cfg = Config(epochs=0, max_pushes=10, progress=False, checkpoint_interval=0, servers=servers)
    path = str(tmp_path / "killed.h5")
    log = RunLog.create(path, {"config": cfg.to_json()}, [], 4, flush_interval=60)
    rec = Recorder(cfg, log, range(1, 3), NUM_TRAIN)
    rec.shards = ShardFigures(servers) if servers > 1 else None
    rec.begin()
    rec.count_wire(pushed=1000, pulled=3000)
    if servers > 1:
        rec.shards.report_wire(1, 500, 700)
    log.end_early("preempted", hold=60.0)  # (the signal thread's close; rows added later wait for 60 s)
    zeros = np.zeros(4, np.float32)
    versions = [0] * servers if servers > 1 else None
    assert rec.write_checkpoint(rec.checkpoint(zeros, zeros, "preempt", {1: (1, 1), 2: (1, 1)}, 1.0,
                                               shard_versions=versions))
    # SIGKILL now: the rows of the checkpoint stay in memory, never written
    with open_log(path) as f:
        assert "wire_bytes" not in f or f["wire_bytes"].shape[0] == 0
    ckpt = checkpoint.load(rec.checkpoint_path)
    expected = [(1000, 3000), (500, 700)][:servers]
    assert ckpt.wire_bytes.tolist() == [list(pair) for pair in expected]
    lock = WriterLock(path)
    lock.acquire()
    log = RunLog.reopen(path, [], 60, lock, resumed_at=ckpt.log_time)
    try:
        rec = Recorder(cfg, log, range(1, 3), NUM_TRAIN)
        rec.shards = ShardFigures(servers) if servers > 1 else None
        rec.restore(ckpt)
        assert rec.wire_by_shard() == expected
        rec.count_wire(pushed=7, pulled=9)
        assert rec.wire_summary()["wire_bytes_pushed"] == 1000 + 7 + (500 if servers > 1 else 0)
    finally:
        log.close("completed")


@pytest.mark.parametrize(("servers", "expected"), [
    (1, "mpiasgd train needs at least 2 MPI ranks (1 parameter server + workers), got 1; launch it with e.g. "
        "'mpiexec -n 3 python -m mpiasgd train'"),
    (2, "mpiasgd train --servers 2 needs at least 3 MPI ranks (2 parameter-server shards + workers), got 1; "
        "launch it with e.g. 'mpiexec -n 4 python -m mpiasgd train --servers 2' (2 workers)"),
    (3, "mpiasgd train --servers 3 needs at least 4 MPI ranks"),
])
def test_a_single_rank_is_told_the_ranks_its_servers_need(servers, expected):
    from mpiasgd.config import ConfigError
    from mpiasgd.launch.ranks import Rank
    from mpiasgd.launch.startup import setup

    with pytest.raises(ConfigError) as e:
        setup(Config(servers=servers), Rank(comm=None, rank=0, size=1, host="h", servers=servers), None, None, {})
    assert str(e.value).startswith(expected)


def test_one_servers_bytes_continue_across_a_resume(tmp_path):
    """--servers 1: each checkpoint logs rank 0's bytes (one /wire_bytes row, shard 0, at its log time), and a
    resume from it continues them (they counted from the resume before)."""
    from mpiasgd import checkpoint
    from mpiasgd.rank0.recorder import Recorder
    from mpiasgd.runlog import WriterLock

    cfg = Config(epochs=0, max_pushes=10, progress=False, checkpoint_interval=0)
    path = str(tmp_path / "one.h5")
    log = RunLog.create(path, {"config": cfg.to_json()}, [], 4, flush_interval=60)
    rec = Recorder(cfg, log, range(1, 3), NUM_TRAIN)
    rec.begin()
    rec.count_wire(pushed=100, pulled=300)
    zeros = np.zeros(4, np.float32)
    assert rec.write_checkpoint(rec.checkpoint(zeros, zeros, "interval", {1: (1, 1), 2: (1, 1)}, 1.0))
    rec.count_wire(pushed=100, pulled=100)  # after the checkpoint: superseded by the resume
    log.close("preempted", rec.summary({}, "signal"))
    with open_log(path) as f:
        assert f["wire_bytes"][()][["shard", "pushed", "pulled"]].tolist() == [(0, 100, 300)]
        assert (int(f.attrs["wire_bytes_pushed"]), int(f.attrs["wire_bytes_pulled"])) == (200, 400)
        assert "shard_wire_bytes_pushed" not in f.attrs
    ckpt = checkpoint.load(rec.checkpoint_path)
    lock = WriterLock(path)
    lock.acquire()
    log = RunLog.reopen(path, [], 60, lock, resumed_at=ckpt.log_time)
    rec = Recorder(cfg, log, range(1, 3), NUM_TRAIN)
    rec.restore(ckpt)
    rec.count_wire(pushed=7, pulled=9)
    assert rec.wire_summary() == {"wire_bytes_pushed": 107, "wire_bytes_pulled": 309}
    log.close("completed")


@pytest.mark.parametrize("mode", ["async", "easgd"])
def test_the_push_that_carries_a_workers_signal_is_applied_on_every_shard(tmp_path, mode):
    """A worker's push flagged PREEMPT (a signal reached it) stops the run on rank 0 after rank 0 applied it, and the
    shard that hears the stop before the push arrives applies it too: both shards at version 1. (It was dropped on
    rank 0 and applied on shard 1, so resumes carried the difference on.)"""
    from mpiasgd.comms import Flag

    hub, shard, net, cut, rank = started(tmp_path, mode=mode)
    grad = np.full(P, 0.01, np.float32)
    a, b = cut.slice(0)
    msg = Message(b - a).stamp(Tag.PUSH, 1, step=1, version=0, samples=32, loss=2.0, flags=Flag.PREEMPT)
    msg.payload[:] = grad[a:b]
    net.post(1, 0, Tag.PUSH, msg.buf)
    serve(hub)  # applied, then the signal: the stop, SHARD_STOP
    assert hub.preempted and hub.rec.version == 1 and hub.rec.stop_reason
    hub.checkpoint_due = ""  # (the signal's checkpoint waits for the agreement; not what this test looks at)
    push_to(net, cut, 1, rank, 1, 1, 0, grad)  # reaches shard 1 after SHARD_STOP: deferred
    while net.pending(rank):
        serve(shard)
    assert shard.rec.version == 0
    serve(hub)  # shard 1's SHARD_STOPPED {1: 0, ...}: final {1: 1, ...}
    assert hub.role.agreement.final == {1: 1, 2: 0, 3: 0}
    while net.pending(rank):  # SHARD_FINAL: the deferred push applied
        serve(shard)
    assert shard.rec.version == hub.rec.version == 1 and shard.link.preempted


# --- a push that is not finite in one shard's slice only: the worker's flag NONFINITE -------------------------------

def push_flagged(net, cut, s, rank, worker, step, version, values, wire, flags):
    """Worker `worker`'s push to shard `s` (rank `rank`): its slice of `values` in wire format `wire`, with `flags`."""
    a, b = cut.slice(s)
    msg = Message(b - a, wire).stamp(Tag.PUSH, worker, step=step, version=version, samples=32, loss=2.0, flags=flags)
    encode(wire, np.ascontiguousarray(values[a:b]), msg.payload)
    net.post(worker, rank, Tag.PUSH, msg.buf)


@pytest.mark.parametrize("options", [
    {"mode": "async"},
    {"mode": "async", "wire": "fp16"},
    {"mode": "async", "dc_lambda": 2.0},
    {"mode": "ssp", "staleness_bound": 3},
    {"mode": "easgd"},
], ids=["async", "async-fp16", "dc-asgd", "ssp", "easgd"])
def test_a_push_not_finite_in_one_shards_slice_only_is_rejected_by_every_shard(tmp_path, options):
    """Worker 2's push holds a NaN in shard 1's slice only (shard 0's slice is finite), and the worker flagged every
    shard's push NONFINITE, as its staging does: both shards reject it (no update, the same version, the same
    applied set in the log, one reject counted for worker 2 on each) and answer it with WEIGHTS carrying the
    weights as they were. (Without the flag shard 0 applied it and shard 1 rejected it: the shards diverged.)"""
    from mpiasgd.comms import Flag
    from mpiasgd.comms.wire import roundtrip

    wire = options.get("wire", "fp32")
    hub, shard, net, cut, rank = started(tmp_path, **options)
    loops, sources = (hub, shard), (0, rank)
    rng = np.random.default_rng(9)
    good = (rng.standard_normal(P) * 0.1).astype(np.float32)
    for s in range(2):  # worker 1's finite push: applied on both shards
        push_flagged(net, cut, s, sources[s], 1, 1, 0, good, wire, 0)
        drain(loops[s], net)
        assert Tag(net.take(1, sources[s])[1]) == Tag.WEIGHTS
    assert hub.rec.version == shard.rec.version == 1
    before = [loop.role.params.copy() for loop in loops]
    bad = (rng.standard_normal(P) * 0.1).astype(np.float32)
    a = cut.slice(1)[0]
    bad[a + 7] = np.nan
    assert np.isfinite(bad[:a]).all()  # shard 0's slice is finite: only the flag tells it
    for s in range(2):
        push_flagged(net, cut, s, sources[s], 2, 1, 0, bad, wire, Flag.NONFINITE)
        drain(loops[s], net)
    assert hub.rec.version == shard.rec.version == 1
    for s, loop in enumerate(loops):
        np.testing.assert_array_equal(loop.role.params, before[s])  # no update on either shard
        weights, version = reply_of(net, 2, sources[s], cut.count(s), wire)  # WEIGHTS, the weights as they are
        assert version == 1
        np.testing.assert_array_equal(weights, roundtrip(wire, before[s]))
        assert loop.rec.rejected[2] == 1 and loop.rec.rejects_in_row[2] == 1 and loop.rec.rejected[1] == 0
    mine, theirs = logged(hub, shard, net, "pushes", "shard_pushes")
    theirs = theirs[theirs["shard"] == 1]
    rows = [sorted((int(r["worker"]), int(r["step"]), int(r["applied"]), int(r["version"])) for r in t)
            for t in (mine, theirs)]
    assert rows[0] == rows[1] == [(1, 1, 1, 1), (2, 1, 0, 1)]
    assert mine["rejected"].tolist() == [0, 1]


@pytest.mark.parametrize("mode", ["async", "easgd"])
def test_a_worker_that_dies_in_the_middle_of_its_push_is_counted_alike_by_every_shard(tmp_path, mode, capsys):
    """(ULFM) Worker 3 dies while it sends its first push: it reaches shard 1 (applied there) and never rank 0.
    Both shards drop worker 3 (`Rank0.lose`); a push of it that reached rank 0 later is discarded, not merged.
    At the stop (--max-pushes 3) the shards agree on worker 3's step 1 and rank 0 counts that push with nothing
    applied (`count_lost`): both end at version 4 with the same pushes, rank 0 logs the count (event
    "lost_push", shard 0's row), every survivor gets STOP, and worker 3 nothing."""

    hub, shard, net, cut, rank = started(tmp_path, max_pushes=3, mode=mode)
    rng = np.random.default_rng(7)
    g = {w: rng.standard_normal(P).astype(np.float32) for w in range(1, WORKERS + 1)}
    for w in (1, 2):
        for s, loop in enumerate((hub, shard)):
            push_to(net, cut, s, (0, rank)[s], w, 1, loop.rec.version, g[w])
            serve(loop)
            assert Tag(net.take(w, (0, rank)[s])[1]) == Tag.WEIGHTS
    push_to(net, cut, 1, rank, 3, 1, 2, g[3])  # worker 3's push reaches shard 1 only: it dies
    serve(shard)
    assert shard.rec.version == 3 and hub.rec.version == 2
    net.take(3, rank)
    for loop in (hub, shard):
        loop.lose([3])
    assert "worker rank 3 died after step 0 (ULFM reported it): dropped, 2 workers go on" in capsys.readouterr().err
    assert shard.role.lost == hub.role.lost == {3}
    push_to(net, cut, 0, 0, 3, 1, 2, g[3])  # (the late part of its push: discarded)
    serve(hub)
    assert hub.rec.version == 2 and net.pending(3) == []
    push_to(net, cut, 1, rank, 1, 2, 3, g[1])
    serve(shard)
    push_to(net, cut, 0, 0, 1, 2, 2, g[1])  # rank 0: version 3, the stop
    serve(hub)
    assert hub.rec.stop_reason and shard.rec.version == 4
    drain(shard, net)  # SHARD_STOP: SHARD_STOPPED {1: 2, 2: 1, 3: 1}
    drain(hub, net)    # SHARD_FINAL: rank 0 counts worker 3's step 1
    drain(shard, net)
    assert hub.role.agreement.final == shard.role.agreement.final == {1: 2, 2: 1, 3: 1}
    assert hub.rec.version == shard.rec.version == 4 and hub.role.settled() and shard.role.settled()
    assert Tag(net.take(1, rank)[1]) == Tag.WEIGHTS  # (before shard 1 heard of the stop): worker 1 asks FINISH
    net.post(1, rank, Tag.FINISH, Message(0).stamp(Tag.FINISH, 1, step=2).buf)
    serve(shard)
    for s, loop in enumerate((hub, shard)):  # worker 2's second push, after the stop: dropped, answered STOP
        push_to(net, cut, s, (0, rank)[s], 2, 2, 3, g[2])
        serve(loop)
    for w in (1, 2):  # the survivors end with STOP from both shards
        for s, src in enumerate((0, rank)):
            tag, header, _ = reply_of_tag(net, w, src, cut.count(s))
            assert tag == Tag.STOP and int(header["version"]) == 4, (w, s)
    assert net.pending(3) == []
    rows, events = logged(hub, shard, net, "shard_pushes", "events")
    for s in (0, 1):
        mine = rows[(rows["shard"] == s) & (rows["applied"] == 1)]
        assert sorted(mine[["worker", "step"]].tolist()) == [(1, 1), (1, 2), (2, 1), (3, 1)], s
        assert sorted(mine["version"].tolist()) == [1, 2, 3, 4], s
    kinds = [k.decode() for k in events["kind"]]
    assert kinds.count("worker_lost") == 1 and kinds.count("lost_push") == 1 and kinds.count("late_message") == 1
