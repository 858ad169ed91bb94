"""Training modes: sync (allreduce), ssp (staleness bound), nsync (accumulated updates), overlap, warm start.

In-process checks drive a role through the fake communicator; multi-rank checks run `mpiexec`
under a timeout and read the run log.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_mpi import FAST, read_log
from test_server import make_server, push, reply, serve_one
from test_worker import receive, reference_grad, start_worker

from mpiasgd.comms.protocol import Flag, Message, ProtocolError, Tag
from mpiasgd.config import Config
from mpiasgd.data import ShardSampler, load_dataset
from mpiasgd.model import build_model
from mpiasgd.modes.asgd import AsgdWorker
from mpiasgd.modes.base import WorkerJob
from mpiasgd.ops import numpy_ops
from mpiasgd.optim import learning_rate

B = 16


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def worker_pair(cfg, digits, params, nworkers=2):
    """Workers 1..nworkers in-process (no communicator), all bound to the one `params` vector."""
    workers = []
    for rank in range(1, nworkers + 1):
        model = build_model("digits")
        model.bind(params, np.zeros(model.num_params, np.float32))
        sampler = ShardSampler(digits.train_y.size, nworkers, rank - 1, cfg.seed)
        workers.append(AsgdWorker(WorkerJob(None, cfg, model, digits, sampler, rank)))
    return workers


# --- sync ----------------------------------------------------------------------------------------------

def test_sync_weights_equal_single_process_reference(mpirun, tmp_path, digits):
    """3 ranks, 8 sync steps: the logged final weights are those of averaging the 2 workers' gradients by hand."""
    steps, seed = 8, 5
    res = mpirun(3, ["train", *FAST, "--mode", "sync", "--seed", str(seed), "--epochs", "0", "--max-pushes",
                     str(steps), "--snapshot-interval", "0", "--name", "sync"], timeout=90)
    assert res.returncode == 0, res.explain()
    attrs, t, params = read_log(tmp_path / "runs" / "sync.h5")
    assert attrs["status"] == "completed" and attrs["mode"] == "sync"

    cfg = Config(model="digits", mode="sync", batch_size=B, seed=seed, epochs=0, max_pushes=steps)
    model = build_model("digits")
    w = model.init_params(seed)
    np.testing.assert_array_equal(params[0], w)  # the first snapshot: the initial weights
    workers = worker_pair(cfg, digits, w)
    velocity = np.zeros_like(w)
    decay = (cfg.weight_decay * model.decay_mask()).astype(np.float32)
    for k in range(steps):
        for worker in workers:
            worker.gradient()
        mean = workers[0].model.grads + workers[1].model.grads  # what the allreduce (MPI.SUM) gives
        mean *= np.float32(1 / 2)
        lr = learning_rate(cfg, k * B * 2 / digits.train_y.size, k / steps)
        numpy_ops.sgd_momentum(w, velocity, mean, decay, cfg.momentum, lr)
    np.testing.assert_allclose(params[-1], w, rtol=1e-5, atol=1e-7)
    assert not np.array_equal(params[-1], params[0])
    # one row per worker per step, staleness 0, every step applied; one update per step
    p = t["pushes"]
    rows = sorted(zip(p["worker"].tolist(), p["step"].tolist(), strict=True))
    assert rows == [(w_, s) for w_ in (1, 2) for s in range(1, steps + 1)]
    assert (p["staleness"] == 0).all() and p["applied"].all()
    assert t["updates"]["version"].tolist() == list(range(1, steps + 1))
    assert attrs["version"] == steps and attrs["samples"] == steps * B * 2
    assert [e["kind"] for e in t["events"]].count(b"stop") == 1


def test_sync_skips_a_non_finite_step_together(mpirun, tmp_path):
    """Worker 2's gradient is NaN in its 3rd step only: both workers skip step 3, the run completes."""
    res = mpirun(3, ["nan1", "2", *FAST, "--mode", "sync", "--epochs", "0", "--max-pushes", "6",
                     "--name", "skip"], timeout=90, script="fault.py")
    assert res.returncode == 0, res.explain()  # the replicas' final checksums agreed, or the run would fail
    attrs, t, params = read_log(tmp_path / "runs" / "skip.h5")
    p = t["pushes"]
    step3 = p[p["step"] == 3]
    assert sorted(step3["worker"].tolist()) == [1, 2] and not step3["applied"].any()
    assert step3["rejected"][step3["worker"] == 2].tolist() == [1]
    assert step3["rejected"][step3["worker"] == 1].tolist() == [0]
    assert p["applied"][p["step"] != 3].all() and p["step"].max() == 7  # 6 applied steps took 7
    skips = [e["text"].decode() for e in t["events"] if e["kind"] == b"skip"]
    assert skips == ["step 3 skipped by every worker: worker rank 2 computed a non-finite gradient"]
    assert t["updates"]["version"].tolist() == list(range(1, 7)) and np.isfinite(params).all()
    assert attrs["rejected"] == 1


def test_sync_monitor_takes_snapshots_only_from_the_first_worker(tmp_path):
    server, net, _ = make_server(tmp_path, mode="sync")
    from fakempi import rank0

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


@pytest.mark.parametrize("rule,factor", [("none", 1.0), ("inverse", 0.5), ("sqrt", 2 ** -0.5)])
def test_server_adds_accumulated_update_scaled_by_staleness_rule(tmp_path, rule, factor):
    server, net, log = make_server(tmp_path, nsync=4, staleness_lr=rule, momentum=0.9, weight_decay=0.1)
    before = server.params.copy()
    server.version = 2  # the push below was computed from version 0: staleness 2
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


def test_overlap_run_has_exactly_one_step_of_extra_staleness(mpirun, tmp_path):
    """One worker: without overlap every push has staleness 0; with it, every push after the first has 1."""
    res = mpirun(2, ["train", *FAST, "--overlap", "--epochs", "0", "--max-pushes", "60", "--name", "ov"],
                 timeout=60)
    assert res.returncode == 0, res.explain()
    _, t, _ = read_log(tmp_path / "runs" / "ov.h5")
    applied = t["pushes"][t["pushes"]["applied"] == 1]
    assert applied["staleness"].tolist() == [0] + [1] * 59


# --- ssp -------------------------------------------------------------------------------------------------

def max_lead_before_stop(pushes):
    """For each applied push (w, step c) in arrival order: c - 1 - (fewest pushes of any other worker so far)."""
    workers = sorted(set(pushes["worker"].tolist()))
    clocks = dict.fromkeys(workers, 0)
    lead = 0
    for row in pushes[pushes["applied"] == 1]:
        w, c = int(row["worker"]), int(row["step"])
        lead = max(lead, c - 1 - min(clocks[o] for o in workers if o != w))
        clocks[w] = c
    return lead


@pytest.mark.parametrize("mode,bound", [("ssp", 1), ("ssp", 0), ("async", None)])
def test_ssp_never_lets_a_worker_pass_the_bound(mpirun, tmp_path, mode, bound):
    """3 workers, worker 3 four times slower: ssp keeps every lead within the bound; async does not."""
    flags = ["--mode", mode] + (["--staleness-bound", str(bound)] if bound is not None else [])
    res = mpirun(4, ["train", *FAST, *flags, "--straggler", "3:4", "--epochs", "0", "--max-pushes", "240",
                     "--name", "ssp"], timeout=90)
    assert res.returncode == 0, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "ssp.h5")
    lead = max_lead_before_stop(t["pushes"])
    if mode == "ssp":
        assert lead <= bound, lead
        assert attrs["held_s"] > 0 and t["pushes"]["held_s"].max() > 0  # the fast workers were held
    else:
        assert lead > 3, lead  # the check can fail: unbounded, the fast workers run ahead
        assert attrs["held_s"] == 0


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


# --- warm start ----------------------------------------------------------------------------------------------

def test_warm_start_lets_worker_1_train_alone_first(mpirun, tmp_path):
    res = mpirun(3, ["train", *FAST, "--warm-start", "1.5", "--epochs", "0", "--max-time", "3",
                     "--name", "warm"], timeout=60)
    assert res.returncode == 0, res.explain()
    _, t, _ = read_log(tmp_path / "runs" / "warm.h5")
    p = t["pushes"]
    first2 = p["time"][p["worker"] == 2].min()
    assert p["time"][p["worker"] == 1].min() < 1.0 and 1.5 <= first2 < 2.5
    assert (p["worker"][p["time"] < 1.5] == 1).all() and (p["time"] < 1.5).sum() > 10
    kinds = [e["kind"] for e in t["events"]]
    assert b"warm_start" in kinds and b"warm_start_end" in kinds


@pytest.mark.parametrize("mode", [["--mode", "async"], ["--mode", "ssp", "--staleness-bound", "1"]])
def test_a_hung_worker_is_named_while_the_others_train(mpirun, tmp_path, mode):
    """Worker 2 hangs in its 20th minibatch: rank 0 warns after --stall-warning and ends the run after
    --comm-timeout, naming rank 2, although worker 1 keeps pushing (async) or waits on a held reply (ssp)."""
    res = mpirun(3, ["hang", "2", *FAST, *mode, "--epochs", "0", "--max-time", "60", "--comm-timeout", "3",
                     "--stall-warning", "1", "--name", "hung"], timeout=60, script="fault.py")
    assert res.returncode != 0 and res.seconds < 30, res.explain()
    assert "rank 0: worker rank 2 has sent nothing for" in res.stderr, res.explain()
    assert "rank 1 failed" not in res.stderr, res.explain()
    assert "mpiasgd: warning: worker rank 2 has sent nothing for" in res.stderr, res.explain()
    assert "warning: worker rank 1" not in res.stderr, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "hung.h5")
    assert attrs["status"] == "failed"
    warnings = [e for e in t["events"] if e["kind"] == b"warning"]
    assert len(warnings) == 1 and warnings[0]["text"].decode().startswith("worker rank 2 has sent nothing for 1.")
    failed = next(e for e in t["events"] if e["kind"] == b"failed")
    assert warnings[0]["time"] < failed["time"]
    text = failed["text"].decode()  # one traceback, the stall's (helper-23: the probe's timeout came twice)
    assert text.count("comms.CommTimeout:") == 1 and "During handling of the above exception" not in text, text
    p = t["pushes"]
    assert (p["worker"] == 2).sum() == 19 and (p["worker"] == 1).sum() >= 19
