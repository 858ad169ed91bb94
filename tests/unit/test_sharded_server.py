"""Parameter-server shards (`--servers S`) in-process through the fake communicator: given the same arrival
order, S shards, each applying its slice of every push, end with the weights of one server, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from kit.fakempi import Network, rank0
from kit.server import serve_one

from mpiasgd.comms.protocol import HEADER_BYTES, Message, Tag
from mpiasgd.comms.shards import ShardCut
from mpiasgd.comms.wire import decode, encode, wire_dtype
from mpiasgd.config import Config
from mpiasgd.runlog import RunLog, open_log

P = 1000          # parameters
WORKERS = 3
NUM_TRAIN = 400   # images per epoch: the schedule's clock moves within the scripted pushes


def shards(tmp_path, servers, **overrides):
    """The S servers of one job (S = 1: the unsharded server): [(rank, server)], the network and the cut."""
    cfg = Config(**{"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "lr_schedule": "cosine", "warmup_epochs": 0.5,
                    "epochs": 0, "max_pushes": 1000, "snapshot_interval": 0, "progress": False, "comm_timeout": 2.0,
                    "servers": servers, **overrides})
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
