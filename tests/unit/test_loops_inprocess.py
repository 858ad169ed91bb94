"""Sync and pipeline mode run in-process: rank 0's loop and every worker loop in a thread of its own,
joined through the fake communicator (`kit.fakempi`: a Network to and from rank 0, and a `Group` with
Iallreduce for each communicator the mode splits off).

The final weights rank 0 holds are compared with single-process references (sync here; kit.pipeline's
for decoupled backpropagation); crafted messages that break the protocol end a loop with a
ProtocolError that names them. Every thread is joined under a timeout.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from kit.fakempi import Group, Network, rank0
from kit.pipeline import reference_two_modules
from kit.runs import read_log
from kit.server import serve_one
from kit.threads import JOIN_TIMEOUT, join, start
from kit.worker import worker_pair

from mpiasgd import checkpoint
from mpiasgd.comms.protocol import Flag, Message, ProtocolError, Tag
from mpiasgd.config import Config
from mpiasgd.data import ShardSampler, minibatches
from mpiasgd.model import build_model, evaluate
from mpiasgd.modes.base import WorkerJob
from mpiasgd.modes.pipeline import MODE as PIPELINE
from mpiasgd.modes.pipeline import Module, PipelineUnit
from mpiasgd.modes.sync import SyncWorker
from mpiasgd.ops import numpy_ops
from mpiasgd.optim import fraction_done, learning_rate
from mpiasgd.runlog import RunLog

B = 16
COMM_TIMEOUT = 5.0  # seconds: rank 0 names a silent worker after this, a worker gives up after twice it
# weights and velocities against the references: equal today (the same numpy ops in the same order), but a
# BLAS may block its sums differently by thread or alignment
TOL = {"rtol": 1e-5, "atol": 1e-7}


def wait_for(what: str, found, timeout: float = 5.0):
    """Poll `found()` until it returns something other than None; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = found()
        if got is not None:
            return got
        time.sleep(0.001)  # a poll interval, not a synchronisation: the condition is what is waited for
    raise AssertionError(f"no {what} within {timeout:g} s")


def new_log(tmp_path, cfg, num_params: int) -> RunLog:
    return RunLog.create(str(tmp_path / "run.h5"), {"config": cfg.to_json()}, [], num_params, flush_interval=60)


def message(count: int, data: bytes) -> Message:
    msg = Message(count)
    msg.buf[:] = np.frombuffer(data, np.uint8)
    return msg


def final_evaluation(digits, params: np.ndarray, idx: np.ndarray) -> tuple[float, int, int, int]:
    """(loss sum, correct, images, top-5 correct) of the weights `params` on the test images `idx`, by hand."""
    model = build_model("digits")
    model.bind(params.copy(), np.zeros_like(params))
    return evaluate(model, digits, idx, 256)


# --- sync ------------------------------------------------------------------------------------------------

def sync_reference(cfg, digits, steps: int, nworkers: int) -> tuple[np.ndarray, np.ndarray]:
    """(weights, velocity) after `steps` sync steps by hand (test_modes.py's reference, for N workers): the
    workers' gradients summed in rank order, times 1/N, one momentum SGD step on the run's schedule."""
    model = build_model("digits")
    w = model.init_params(cfg.seed)
    workers = worker_pair(cfg, digits, w, nworkers)
    velocity = np.zeros_like(w)
    decay = (cfg.weight_decay * model.decay_mask()).astype(np.float32)
    for k in range(steps):
        for worker in workers:
            worker.gradient()
        mean = workers[0].model.grads.copy()  # what the allreduce (MPI.SUM) gives
        for worker in workers[1:]:
            mean += worker.model.grads
        mean *= np.float32(1 / nworkers)
        peak = cfg.lr * nworkers if cfg.lr_scaling == "linear" else cfg.lr  # Goyal et al.'s linear scaling rule
        lr = learning_rate(dataclasses.replace(cfg, lr=peak), k * B * nworkers / digits.train_y.size, k / steps)
        numpy_ops.sgd_momentum(w, velocity, mean, decay, cfg.momentum, lr)
    return w, velocity


def sync_config(**overrides) -> Config:
    return Config(**{"model": "digits", "mode": "sync", "batch_size": B, "seed": 5, "epochs": 0, "max_pushes": 6,
                     "snapshot_interval": 0, "progress": False, "comm_timeout": COMM_TIMEOUT, **overrides})


def sync_worker(cfg, digits, net: Network, workers: Group, w: int, test_idx: np.ndarray) -> SyncWorker:
    """Worker rank `w` of sync mode: rank w of `net` (rank 0's), rank w - 1 of the workers' communicator."""
    size = workers.size
    sampler = ShardSampler(digits.train_y.size, size, w - 1, cfg.seed)
    return SyncWorker(WorkerJob(net.comm(w), cfg, build_model("digits"), digits, sampler, w, test_idx,
                                comms=workers.comm(w - 1)))


@pytest.mark.parametrize("nworkers,scaling", [(2, "none"), (3, "none"), (2, "linear")])
def test_sync_run_in_process_equals_the_single_process_reference(tmp_path, digits, nworkers, scaling):
    """Rank 0 (SyncMonitor in the loop) and the workers (SyncWorker, allreducing over a fake workers'
    communicator) run 6 steps in threads: the final weights, the log's rows, the end checkpoint and
    every worker's evaluation are those of the hand computation (--lr-scaling linear: the step size
    times the workers)."""
    cfg = sync_config(lr_scaling=scaling)
    steps, num_train = cfg.max_pushes, digits.train_y.size
    model = build_model("digits")
    p0 = model.init_params(cfg.seed)
    net, group = Network(1 + nworkers), Group(nworkers)
    log = new_log(tmp_path, cfg, model.num_params)
    server = rank0(net.comm(0), cfg, p0.copy(), model.decay_mask(), nworkers, num_train, log)
    slices = np.array_split(np.arange(digits.test_y.size, dtype=np.int64), nworkers)
    loops = {"rank 0": server.run}
    for w in range(1, nworkers + 1):
        loops[f"worker rank {w}"] = sync_worker(cfg, digits, net, group, w, slices[w - 1]).run
    threads = start(loops)
    join(threads)
    summary = threads[0].result
    log.close("completed", summary)

    expected, velocity = sync_reference(cfg, digits, steps, nworkers)
    np.testing.assert_allclose(server.params, expected, **TOL)  # the first worker's final SNAPSHOT
    assert not np.array_equal(expected, p0)
    assert [t.result for t in threads[1:]] == [False] * nworkers  # not preempted
    attrs, t, snapshots = read_log(tmp_path / "run.h5")
    np.testing.assert_array_equal(snapshots[0], p0)
    np.testing.assert_array_equal(snapshots[-1], server.params)
    # one REPORT row per worker per step, every step applied at staleness 0, the same weights everywhere
    p = t["pushes"]
    assert sorted(zip(p["worker"].tolist(), p["step"].tolist(), strict=True)) == [
        (w, s) for w in range(1, nworkers + 1) for s in range(1, steps + 1)]
    assert (p["staleness"] == 0).all() and p["applied"].all() and not p["rejected"].any()
    assert (p["samples"] == B).all() and (p["version"] == p["step"]).all()
    assert all(len(set(p["digest"][p["step"] == s].tolist())) == 1 for s in range(1, steps + 1))
    assert t["updates"]["version"].tolist() == list(range(1, steps + 1))
    assert summary["version"] == steps and summary["samples"] == steps * B * nworkers
    # every worker's EVAL reached rank 0: its slice of the test set, evaluated with the final weights
    for w in range(1, nworkers + 1):
        loss_sum, correct, count, correct5 = final_evaluation(digits, server.params, slices[w - 1])
        got = server.evals[w]
        assert got[1:] == (correct, count, correct5) and got[0] == pytest.approx(loss_sum, rel=1e-6), w
    assert summary["test_count"] == digits.test_y.size == t["evals"]["count"][-1]
    assert summary["test_accuracy"] == pytest.approx(sum(e[1] for e in server.evals.values()) / digits.test_y.size)
    # the first worker's CHECKPOINT at the end: the weights and the velocity
    ckpt = checkpoint.load(server.checkpoint_path)
    assert (ckpt.reason, ckpt.version, ckpt.samples) == ("end", steps, steps * B * nworkers)
    np.testing.assert_array_equal(ckpt.params, server.params)
    np.testing.assert_allclose(ckpt.momentum, velocity, **TOL)
    assert [e["kind"] for e in t["events"]].count(b"stop") == 1 and attrs["status"] == "completed"
    assert all(net.pending(r) == [] for r in range(1 + nworkers)) and group.rounds == {}  # nothing left over


def test_sync_worker_refuses_a_stop_instead_of_the_initial_weights(digits):
    """A STOP (of the weights' size) as rank 0's first message ends the worker at once, naming both tags."""
    cfg = sync_config()
    net = Network(3)
    worker = sync_worker(cfg, digits, net, Group(2), 1, np.arange(0, dtype=np.int64))
    threads = start({"worker rank 1": worker.run})
    count = build_model("digits").num_params
    net.post(0, 1, Tag.STOP, Message(count).stamp(Tag.STOP, 0, step=0, version=0).buf)
    threads[0].join(JOIN_TIMEOUT)
    assert not threads[0].is_alive()
    assert isinstance(threads[0].error, ProtocolError), repr(threads[0].error)
    assert str(threads[0].error) == "rank 1: expected the initial WEIGHTS from rank 0, got STOP"
    assert net.pending(0) == []  # it sent nothing: no REPORT, no EVAL


@pytest.mark.parametrize("reports,error,match", [
    # two REPORTs of step 1 with different weight digests: the step, both workers and both digests
    ([(1, 1, 0x1234ABCD, 0), (2, 1, 0x1234ABCE, 0)], RuntimeError,
     r"^rank 0: the replicas' weights differ after step 1: worker rank 2 has digest 1234abce, worker rank 1 has "
     r"1234abcd$"),
    # worker 1 skips from step 1 to step 3 (a lost or reordered REPORT)
    ([(1, 1, 7, 0), (1, 3, 7, 0)], ProtocolError,
     r"^rank 0: REPORT from worker rank 1 has step 3, expected 2 \(duplicate or out-of-order report\)$"),
    # worker 2 reports again after the REPORT it flagged LAST
    ([(2, 1, 7, Flag.LAST), (2, 2, 7, 0)], ProtocolError,
     r"^rank 0: REPORT step 2 from worker rank 2 after its last step$"),
])
def test_sync_monitor_refuses_reports_outside_the_protocol(tmp_path, reports, error, match):
    """Crafted REPORTs (worker, step, digest, flags): every one but the last is taken, the last ends the run."""
    cfg = sync_config()
    net = Network(3)
    log = new_log(tmp_path, cfg, 6)
    server = rank0(net.comm(0), cfg, np.zeros(6, np.float32), np.ones(6, np.float32), 2, 100, log)
    for w, step, digest, flags in reports:
        report = Message(0).stamp(Tag.REPORT, w, step=step, version=step, samples=B, loss=2.0, lr=0.01,
                                  digest=digest, flags=flags)
        net.post(w, 0, Tag.REPORT, report.buf)
    for w, step, _, _ in reports[:-1]:
        serve_one(server)
        assert server.last_step[w] == step and server.version == step
    with pytest.raises(error, match=match):
        serve_one(server)


# --- pipeline ----------------------------------------------------------------------------------------------

def pipeline_config(**overrides) -> Config:
    """test_pipeline.py's hand-checked run: 2 modules cut before layer 4, 12 minibatches per replica."""
    return Config(**{"model": "digits", "mode": "pipeline", "modules": 2, "cuts": "4", "batch_size": B, "seed": 4,
                     "lr": 0.05, "warmup_epochs": 0.0, "epochs": 0, "max_pushes": 12, "snapshot_interval": 0,
                     "progress": False, "comm_timeout": COMM_TIMEOUT, **overrides})


def reference_replicas(digits, cfg, steps: int, replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """(weights, velocity) of `replicas` copies of reference_two_modules' pipeline (full decoupling, no
    stashing) on shards 0..N-1: each module's gradient is the replicas' sum in replica order times 1/N
    (the allreduce), and the schedule counts the images of all replicas."""
    model = build_model("digits")
    w0 = model.init_params(cfg.seed)
    mask = cfg.weight_decay * model.decay_mask()
    copies = [[Module(m, 0, 4), Module(m, 4, 8)] for m in (build_model("digits") for _ in range(replicas))]
    params = [w0[mod.start:mod.stop].copy() for mod in copies[0]]
    velocity = [np.zeros_like(w) for w in params]
    decay = [mask[mod.start:mod.stop].astype(np.float32) for mod in copies[0]]
    for mods in copies:  # every replica computes with the one copy of each module's weights
        for k, mod in enumerate(mods):
            mod.params = params[k]
            mod.bind(mod.params)
    streams = [ShardSampler(digits.train_y.size, replicas, n, cfg.seed) for n in range(replicas)]
    batches = [minibatches(s, B) for s in streams]
    labels = [minibatches(s, B) for s in streams]

    def update(k, minibatch):
        grads = copies[0][k].grads.copy()
        for mods in copies[1:]:
            grads += mods[k].grads
        if replicas > 1:
            grads *= np.float32(1.0 / replicas)
        done = minibatch * B * replicas / digits.train_y.size
        lr = learning_rate(cfg, done, fraction_done(cfg, done, minibatch, 0.0))
        numpy_ops.sgd_momentum(params[k], velocity[k], grads, decay[k], cfg.momentum, lr)

    stored = [{} for _ in range(replicas)]
    act, delta = [None] * replicas, [None] * replicas
    for t in range(steps + 2):  # two more iterations drain the pipeline
        new_act, new_delta = [None] * replicas, [None] * replicas
        for n, mods in enumerate(copies):
            if t < steps:
                x, _ = digits.batch("train", next(batches[n])[1])
                stored[n][t] = x
                new_act[n] = (t, mods[0].forward(x).copy())
        if 0 <= t - 1 < steps:
            for n, mods in enumerate(copies):
                m, h = act[n]
                y = digits.train_y[next(labels[n])[1]]
                _, _, dx = mods[1].loss_backward(mods[1].forward(h), y)
                new_delta[n] = (m, dx)
            update(1, m)
        if 0 <= t - 2 < steps:
            for n, mods in enumerate(copies):
                m, d = delta[n]
                mods[0].forward(stored[n].pop(m))
                mods[0].backward(d)
            update(0, m)
        act, delta = new_act, new_delta
    return np.concatenate(params), np.concatenate(velocity)


def pipeline_units(cfg, digits, net: Network, layout) -> dict:
    """{name: run} of every unit of `layout`: rank 1 + n*K + k is rank k of replica n's pipeline
    communicator and rank n of module k's data communicator."""
    K, N = cfg.modules, layout.shards
    pipes, datas = [Group(K) for _ in range(N)], [Group(N) for _ in range(K)]
    units = {}
    for w in range(1, K * N + 1):
        k, n = layout.place[w]
        sampler = ShardSampler(digits.train_y.size, layout.shards, layout.shard[w], cfg.seed)
        job = WorkerJob(net.comm(w), cfg, build_model("digits"), digits, sampler, w,
                        comms=(pipes[n].comm(k), datas[k].comm(n)), layout=layout)
        units[f"unit rank {w} (module {k}, replica {n})"] = PipelineUnit(job).run
    return units


@pytest.mark.parametrize("replicas,flags", [(1, {}), (1, {"weight_stashing": True, "shrink": 0.5}),
                                            (1, {"weight_prediction": True}), (2, {})])
def test_pipeline_run_in_process_equals_delayed_gradients_by_hand(tmp_path, digits, replicas, flags):
    """Rank 0 (PipelineMonitor in the loop) and N x 2 units in threads, 12 minibatches per replica: rank 0
    ends with the weights of the hand-written delayed-gradient loop, logs every module's REPORTs at its
    delay, writes the end checkpoint and evaluates the final weights on the whole test set."""
    cfg = pipeline_config(**flags)
    K, steps, num_train = cfg.modules, cfg.max_pushes, digits.train_y.size
    model = build_model("digits")
    p0 = model.init_params(cfg.seed)
    layout = PIPELINE.layout(cfg, model, K * replicas, num_train)
    assert layout.shards == replicas and layout.attrs["module_bounds"] == [0, 4, 8]
    net = Network(1 + K * replicas)
    log = new_log(tmp_path, cfg, model.num_params)
    server = rank0(net.comm(0), cfg, p0.copy(), model.decay_mask(), K * replicas, num_train, log,
                   model=build_model("digits"), dataset=digits, layout=layout)
    threads = start({"rank 0": server.run, **pipeline_units(cfg, digits, net, layout)})
    join(threads)
    summary = threads[0].result
    log.close("completed", summary)

    if replicas == 1:  # test_pipeline.py's reference
        expected = reference_two_modules(digits, cfg, steps, cfg.weight_stashing, cfg.shrink, cfg.weight_prediction)
    else:
        expected, _ = reference_replicas(digits, cfg, steps, replicas)
    np.testing.assert_allclose(server.params, expected, **TOL)  # replica 0's final SNAPSHOTs
    assert np.abs(expected - p0).max() > 1e-3
    assert [t.result for t in threads[1:]] == [False] * (K * replicas)  # not preempted
    attrs, t, snapshots = read_log(tmp_path / "run.h5")
    np.testing.assert_array_equal(snapshots[-1], server.params)
    # REPORT rows: every unit applies each minibatch's gradient once, in order, at its module's delay
    p = t["pushes"]
    for w in range(1, K * replicas + 1):
        k = layout.place[w][0]
        delay = 2 * (K - 1 - k)
        rows = p[p["worker"] == w]
        applied = rows[rows["applied"] == 1]
        assert rows["step"].tolist() == list(range(steps + delay + k)), w  # warm-up + minibatches (drained)
        assert (applied["staleness"] == delay).all() and applied["epoch"].tolist() == list(range(steps)), w
        assert rows["step"][rows["applied"] == 0].tolist() == list(range(delay + k)), w
        assert (rows["samples"].sum(), rows["rejected"].any()) == (steps * B if k == K - 1 else 0, False), w
    assert t["updates"]["version"].tolist() == list(range(1, steps + 1))
    assert summary["version"] == steps and summary["samples"] == steps * B * replicas
    assert summary["staleness_max"] == 2 * (K - 1)
    # rank 0 evaluated the final weights itself, on every test image
    loss_sum, correct, count, _ = final_evaluation(digits, server.params, np.arange(digits.test_y.size))
    assert summary["test_count"] == count == digits.test_y.size
    assert summary["test_accuracy"] == correct / count
    assert summary["test_loss"] == pytest.approx(loss_sum / count, rel=1e-6)
    # replica 0's CHECKPOINTs after the final drain: the whole model's weights
    ckpt = checkpoint.load(server.checkpoint_path)
    assert (ckpt.reason, ckpt.version, ckpt.samples) == ("end", steps, steps * B * replicas)
    np.testing.assert_array_equal(ckpt.params, server.params)
    if not flags:  # and each module's velocity
        np.testing.assert_allclose(ckpt.momentum, reference_replicas(digits, cfg, steps, replicas)[1], **TOL)
    assert attrs["status"] == "completed" and [e["kind"] for e in t["events"]].count(b"stop") == 1
    assert all(net.pending(r) == [] for r in range(1 + K * replicas))  # nothing left over


def test_replicated_reference_with_one_replica_is_the_pipeline_reference(digits):
    """reference_replicas (used for N = 2 above) reduces to test_pipeline.py's reference for N = 1."""
    cfg = pipeline_config(max_pushes=5)
    expected = reference_two_modules(digits, cfg, 5)
    got, velocity = reference_replicas(digits, cfg, 5, 1)
    np.testing.assert_array_equal(got, expected)
    assert np.abs(velocity).max() > 0


def test_unit_refuses_a_gradient_for_the_wrong_minibatch(digits):
    """Module 0 of 2 (delay 2) gets, for its first backward (minibatch 0), a GRADIENT stamped minibatch 1:
    ProtocolError naming both minibatches and the module it came from. Before that it sent module 1 the
    activation of minibatch 0, as computed by hand."""
    cfg = pipeline_config()
    model = build_model("digits")
    layout = PIPELINE.layout(cfg, model, 2, digits.train_y.size)
    net, pipe = Network(3), Group(2)
    sampler = ShardSampler(digits.train_y.size, 1, 0, cfg.seed)
    unit = PipelineUnit(WorkerJob(net.comm(1), cfg, build_model("digits"), digits, sampler, 1,
                                  comms=(pipe.comm(0), Group(1).comm(0)), layout=layout))
    threads = start({"unit rank 1": unit.run})
    first = Module(model, 0, 4)
    p0 = model.init_params(cfg.seed)
    weights = Message(first.size).stamp(Tag.WEIGHTS, 0, version=0)
    weights.payload[:] = p0[first.start:first.stop]
    net.post(0, 1, Tag.WEIGHTS, weights.buf)
    out = B * int(np.prod(first.out_shape))
    _, _, data = wait_for("ACTIVATION of minibatch 0 from module 0", lambda: pipe.take(1, 0, Tag.ACTIVATION))
    act = message(out, data)
    first.params[...] = p0[first.start:first.stop]
    x, _ = digits.batch("train", next(minibatches(sampler, B))[1])
    assert (act.header["sender"], act.header["step"], int(act.header["flags"]) & Flag.LAST) == (0, 0, 0)
    np.testing.assert_allclose(act.payload, first.forward(x).ravel(), rtol=1e-6, atol=1e-7)
    gradient = Message(out).stamp(Tag.GRADIENT, 1, step=1)
    gradient.payload[:] = 1.0
    pipe.post(1, 0, Tag.GRADIENT, gradient.buf)
    threads[0].join(JOIN_TIMEOUT)
    assert not threads[0].is_alive()
    assert isinstance(threads[0].error, ProtocolError), repr(threads[0].error)
    assert str(threads[0].error) == "rank 1: GRADIENT for minibatch 1 from module 1, expected minibatch 0"
    reports = [message(0, d).header for _, tag, d in net.pending(0) if tag == Tag.REPORT]
    assert [int(h["step"]) for h in reports] == [0, 1]  # iterations 0 and 1 (warm-up), then the bad gradient
    assert all(int(h["flags"]) & Flag.WARMUP for h in reports)


def test_pipeline_monitor_takes_snapshots_only_from_replica_0(tmp_path):
    """A SNAPSHOT from unit rank 3 (module 0 of replica 1): rank 0 ends the run naming the ranks that may send."""
    cfg = pipeline_config()
    model = build_model("digits")
    layout = PIPELINE.layout(cfg, model, 4, 100)  # 2 replicas x 2 modules
    net = Network(5)
    log = new_log(tmp_path, cfg, model.num_params)
    server = rank0(net.comm(0), cfg, model.init_params(0), model.decay_mask(), 4, 100, log, model=model,
                   layout=layout)
    size = model.param_range(0, 4)[1]
    net.post(3, 0, Tag.SNAPSHOT, Message(size).stamp(Tag.SNAPSHOT, 3, step=0).buf)
    with pytest.raises(ProtocolError, match=r"^rank 0: SNAPSHOT from unit rank 3; only replica 0 \(ranks 1\.\.2\) "
                                            r"sends them$"):
        serve_one(server)


def test_unit_checks_the_stop_rank0_sends(digits):
    """Module 0 (here K = 1: the whole model) takes rank 0's STOP with the checks every receive has (as
    SyncWorker does): a STOP whose header claims another sender is a ProtocolError naming it, not an
    order to end the run."""
    cfg = pipeline_config(modules=1, cuts="")
    model = build_model("digits")
    layout = PIPELINE.layout(cfg, model, 1, digits.train_y.size)
    net = Network(2)
    sampler = ShardSampler(digits.train_y.size, 1, 0, cfg.seed)
    unit = PipelineUnit(WorkerJob(net.comm(1), cfg, build_model("digits"), digits, sampler, 1,
                                  comms=(Group(1).comm(0), Group(1).comm(0)), layout=layout))
    weights = Message(model.num_params).stamp(Tag.WEIGHTS, 0, version=0)
    weights.payload[:] = model.init_params(cfg.seed)
    net.post(0, 1, Tag.WEIGHTS, weights.buf)
    net.post(0, 1, Tag.STOP, Message(0).stamp(Tag.STOP, 5).buf)  # arrives from rank 0, claims rank 5
    threads = start({"unit rank 1": unit.run})
    threads[0].join(JOIN_TIMEOUT)
    assert not threads[0].is_alive()
    assert isinstance(threads[0].error, ProtocolError), (
        f"the unit ended with {threads[0].error!r} (returned {threads[0].result!r}) after a STOP claiming sender 5")
    assert str(threads[0].error) == "rank 1: STOP message from rank 0 claims sender 5"
