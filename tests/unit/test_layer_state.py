"""Layer state (BatchNorm's running statistics, the model's flat `buffers`) under the training modes,
in-process on a tiny BatchNorm + residual network over the digits:

    layers' caches   `Layer.save_cache` / `load_cache` round trips back-propagate the saved forward
    sync             the replicas hold the same buffers, the mean of theirs after every step; rank 0
                     starts them from its own; snapshots and checkpoints carry them
    pipeline         each module's buffers: updated once per minibatch (the recomputed forward leaves
                     them alone), averaged over the replicas, assembled by rank 0 for snapshots,
                     checkpoints and the final evaluation; --pipeline-activations recompute | store
                     against hand-written delayed-gradient loops
    async            rank 0 snapshots the mean of the workers' latest pushed buffers

The loops run in threads over the fake communicator (`kit.fakempi`) as in test_loops_inprocess.py;
every thread is joined under a timeout.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from kit.fakempi import Group, Network, rank0
from kit.runs import B
from kit.server import serve_one
from kit.threads import run_threads

from mpiasgd import checkpoint
from mpiasgd.comms.protocol import Message, Tag
from mpiasgd.config import Config
from mpiasgd.data import MinibatchStream, ShardSampler
from mpiasgd.model import Model, evaluate
from mpiasgd.model.layers import (
    AvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool,
    Linear,
    LocalResponseNorm,
    MaxPool2d,
    ReLU,
    Residual,
    SubsamplePad,
)
from mpiasgd.modes.base import WorkerJob, dropout_seed
from mpiasgd.modes.pipeline import MODE as PIPELINE
from mpiasgd.modes.pipeline import Module, PipelineUnit
from mpiasgd.modes.sync import SyncWorker
from mpiasgd.ops import get_backend, numpy_ops
from mpiasgd.runlog import RunLog, open_log

COMM_TIMEOUT = 5.0   # seconds: rank 0 names a silent worker after this
JOIN_TIMEOUT = 30.0  # seconds for every thread of a test to end (a healthy run takes about a second)
TOL = {"rtol": 1e-5, "atol": 1e-6}  # against the references: the same numpy ops, but BLAS may block sums otherwise
CUT = 5  # module 0 of 2: bn1 conv1 bn2 relu1 drop1 (layers 0..4); module 1: res1 pool1 flatten1 fc1


def bn_net(momentum: float = 0.1, p: float = 0.25) -> Model:
    """1x8x8 -> 10: BatchNorm on the images (its statistics are the data's alone), conv-BN-ReLU, dropout,
    a residual block of two conv-BN, max-pooling and a zero-initialised classifier; 50 buffer values."""
    def bn(c: int) -> BatchNorm2d:
        return BatchNorm2d(c, momentum=momentum)

    layers = [bn(1), Conv2d(1, 8, 3, pad=1, bias=False), bn(8), ReLU(), Dropout(p),
              Residual([Conv2d(8, 8, 3, pad=1, bias=False), bn(8), ReLU(), Conv2d(8, 8, 3, pad=1, bias=False), bn(8)],
                       [], [ReLU()]),
              MaxPool2d(2, 2), Flatten(), Linear(128, 10, init="zeros")]
    return Model("bn_digits", (1, 8, 8), layers, get_backend("numpy"))


def new_log(tmp_path, cfg, model: Model) -> RunLog:
    return RunLog.create(str(tmp_path / "run.h5"), {"config": cfg.to_json()}, [], model.num_params,
                         flush_interval=60, num_buffers=model.num_buffers)


def logged_buffers(path) -> np.ndarray:
    """The run log's /snapshots/buffers, (S, B) float32."""
    with open_log(str(path)) as f:
        return f["snapshots/buffers"][()]


def by_hand(model: Model, digits, params: np.ndarray, buffers: np.ndarray, idx: np.ndarray) -> tuple:
    """(loss sum, correct, images, top-5 correct) of `params` with `buffers` on the test images `idx`."""
    model.bind(params.copy(), np.zeros_like(params), buffers.copy())
    return evaluate(model, digits, idx, 256)


def mean_in_order(arrays: list[np.ndarray]) -> np.ndarray:
    """What an allreduce (MPI.SUM, in rank order, as the fake one) then * 1/N gives."""
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    total *= np.float32(1.0 / len(arrays))
    return total


# --- the layers' caches ----------------------------------------------------------------------------------

def every_layer_net() -> Model:
    """A network holding every built-in layer that caches something (LRN, a strided residual block with an
    option-A shortcut, both poolings, dropout, global pooling)."""
    layers = [Conv2d(1, 4, 3, pad=1), BatchNorm2d(4), ReLU(), LocalResponseNorm(3, alpha=0.1, k=2.0),
              Residual([Conv2d(4, 8, 3, 2, 1, bias=False), BatchNorm2d(8), ReLU(), Conv2d(8, 8, 3, 1, 1, bias=False),
                        BatchNorm2d(8)], [SubsamplePad(4, 8, 2)], [ReLU()]),
              MaxPool2d(3, 1, pad=1), AvgPool2d(2, 2), Dropout(0.5), GlobalAvgPool(), Flatten(), Linear(8, 10)]
    return Model("every_layer", (1, 8, 8), layers, get_backend("numpy"))


def test_saved_caches_back_propagate_the_saved_forward(digits):
    """Forward minibatch 1, save every layer's cache, forward minibatch 2 (another dropout key, other
    statistics), load the saved caches: the backward gives exactly the gradients (weights and input) of
    minibatch 1's forward followed by its backward; without the load it gives minibatch 2's."""
    model = every_layer_net()
    params = model.init_params(0)
    params += np.random.default_rng(1).standard_normal(params.size).astype(np.float32) * 0.1
    model.bind(params, np.zeros_like(params))
    module = Module(model, 1, len(model.layers))  # from layer 1: its input gradient is computed too
    module.params[...] = params[module.start:module.stop]
    (x1, _), (x2, _) = digits.batch("train", np.arange(B)), digits.batch("train", np.arange(B, 2 * B))
    first = model.layers[0]
    h1, h2 = first.forward(x1), first.forward(x2)
    dy = np.random.default_rng(2).standard_normal((B, 10)).astype(np.float32)

    def backward_of(h, minibatch):
        model.ctx.minibatch = minibatch
        module.forward(h)
        dx = module.backward(dy)
        return dx, module.grads.copy()

    dx1, g1 = backward_of(h1, 1)
    model.ctx.minibatch = 1
    module.forward(h1)
    saved = module.save_cache()
    dx2, g2 = backward_of(h2, 2)
    assert np.abs(g1 - g2).max() > 1e-3 and np.abs(dx1 - dx2).max() > 1e-3  # the caches matter
    module.load_cache(saved)
    np.testing.assert_array_equal(module.backward(dy), dx1)
    np.testing.assert_array_equal(module.grads, g1)
    res = model.layers[4]
    with pytest.raises(ValueError, match=r"load_cache: 7 children, the state has 1"):
        res.load_cache({"children": [{}]})
    with pytest.raises(ValueError, match=r"load_cache: expected the keys \['x'\], got \['y'\]"):
        model.layers[0].load_cache({"y": None})


# --- sync --------------------------------------------------------------------------------------------------

def sync_config(**overrides) -> Config:
    return Config(**{"model": "digits", "mode": "sync", "batch_size": B, "seed": 5, "epochs": 0, "max_pushes": 6,
                     "lr": 0.05, "lr_schedule": "constant", "warmup_epochs": 0.0, "snapshot_interval": 0,
                     "progress": False, "comm_timeout": COMM_TIMEOUT, **overrides})


def sync_reference(cfg, digits, nworkers: int, buffers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(weights, buffers) after cfg.max_pushes sync steps by hand: every worker (its own stream, dropout key
    and buffers, starting from `buffers`) computes a gradient; the gradients and the buffers are each
    summed in rank order and times 1/N; the buffers' mean becomes every worker's; one momentum SGD step."""
    w = bn_net().init_params(cfg.seed)
    velocity = np.zeros_like(w)
    workers = []
    for rank in range(1, nworkers + 1):
        sampler = ShardSampler(digits.train_y.size, nworkers, rank - 1, cfg.seed)
        worker = SyncWorker(WorkerJob(None, cfg, bn_net(), digits, sampler, rank))
        worker.buffers[...] = buffers
        worker.bind(w, np.zeros_like(w))
        workers.append(worker)
    decay = (cfg.weight_decay * workers[0].model.decay_mult()).astype(np.float32)
    for _ in range(cfg.max_pushes):
        for worker in workers:
            worker.gradient()
        mean = mean_in_order([worker.model.grads for worker in workers])
        common = mean_in_order([worker.buffers for worker in workers])
        for worker in workers:
            worker.buffers[...] = common
        numpy_ops.sgd_momentum(w, velocity, mean, decay, cfg.momentum, cfg.lr)
    return w, workers[0].buffers.copy()


@pytest.mark.parametrize("nworkers", [2, 3])
def test_sync_replicas_hold_the_mean_buffers(tmp_path, digits, nworkers):
    """Rank 0 starts the workers from its buffers (here other than the initial ones, as a resumed run's);
    after 6 steps every worker holds the same buffers, those of the hand computation (the mean of the
    replicas' after every step), and rank 0's last snapshot, its log and the end checkpoint carry them;
    each worker's evaluation used them."""
    cfg = sync_config()
    model = bn_net()
    P, Bn = model.num_params, model.num_buffers
    p0 = model.init_params(cfg.seed)
    start = model.init_buffers() * np.float32(1.5) + np.float32(0.25)  # running mean 0.25, var 1.75
    net, group = Network(1 + nworkers), Group(nworkers)
    log = new_log(tmp_path, cfg, model)
    server = rank0(net.comm(0), cfg, p0.copy(), model.decay_mask(), nworkers, digits.train_y.size, log, model=model)
    server.r0.role.buffers[:] = start
    slices = np.array_split(np.arange(digits.test_y.size, dtype=np.int64), nworkers)
    workers = {}
    for w in range(1, nworkers + 1):
        sampler = ShardSampler(digits.train_y.size, nworkers, w - 1, cfg.seed)
        workers[w] = SyncWorker(WorkerJob(net.comm(w), cfg, bn_net(), digits, sampler, w, slices[w - 1],
                                          comms=group.comm(w - 1)))
    threads = run_threads({"rank 0": server.run, **{f"worker rank {w}": wk.run for w, wk in workers.items()}},
                          JOIN_TIMEOUT)
    log.close("completed", threads[0].result)

    expected_w, expected_b = sync_reference(cfg, digits, nworkers, start)
    held = [wk.buffers for wk in workers.values()]
    assert held[0].shape == (Bn,) and all(np.array_equal(b, held[0]) for b in held[1:])  # bit for bit
    np.testing.assert_allclose(held[0], expected_b, **TOL)
    np.testing.assert_allclose(server.params, expected_w, **TOL)
    np.testing.assert_array_equal(server.r0.role.buffers, held[0])  # the first worker's final SNAPSHOT
    for fresh in (model.init_buffers(), start):
        assert np.abs(held[0] - fresh).max() > 1e-3
    snapshots = logged_buffers(tmp_path / "run.h5")
    assert snapshots.shape == (2, Bn)  # the first and the final snapshot
    np.testing.assert_array_equal(snapshots[0], start)
    np.testing.assert_array_equal(snapshots[-1], held[0])
    ckpt = checkpoint.load(server.checkpoint_path)
    assert (ckpt.reason, ckpt.params.size, ckpt.buffers.size) == ("end", P, Bn)
    np.testing.assert_array_equal(ckpt.buffers, held[0])
    np.testing.assert_array_equal(ckpt.params, server.params)
    for w in workers:
        loss_sum, correct, count, correct5 = by_hand(bn_net(), digits, server.params, held[0], slices[w - 1])
        assert server.evals[w][1:] == (correct, count, correct5)
        assert server.evals[w][0] == pytest.approx(loss_sum, rel=1e-5)


# --- pipeline ----------------------------------------------------------------------------------------------

def pipeline_config(**overrides) -> Config:
    """2 modules cut before layer 5 (module 0 holds the images' BatchNorm, conv-BN and dropout), 12 minibatches
    per replica."""
    return Config(**{"model": "digits", "mode": "pipeline", "modules": 2, "cuts": str(CUT), "batch_size": B,
                     "seed": 4, "lr": 0.05, "lr_schedule": "constant", "warmup_epochs": 0.0, "epochs": 0,
                     "max_pushes": 12, "snapshot_interval": 0, "progress": False, "comm_timeout": COMM_TIMEOUT,
                     **overrides})


def reference_pipeline(digits, cfg, replicas: int) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """(weights, buffers, the last module's loss per minibatch) of N replicas of the 2-module FDG pipeline
    (delays 2 and 0) by hand, with the semantics the units implement:

    every forward of minibatch m (module k of replica n: its unit's dropout seed, key m) updates that
    module's running statistics; the replicas' buffers are averaged (sum in replica order, times 1/N)
    after each forward, their gradients before each update. Module 0 back-propagates minibatch m two
    iterations later: `recompute` re-runs its forward on the stored input (same key m, running
    statistics untouched) at the weights of that moment (stashed ones with weight_stashing); `store`
    puts back the layer caches of m's forward."""
    K, store, steps = 2, cfg.pipeline_activations == "store", cfg.max_pushes
    w0 = bn_net().init_params(cfg.seed)
    units = []  # [module 0, module 1] of each replica, each on a model of its own (the unit's dropout seed)
    for n in range(replicas):
        mods = []
        for k in range(K):
            model = bn_net()
            model.ctx.seed = dropout_seed(cfg.seed, 1 + n * K + k)
            mods.append(Module(model, 0, CUT) if k == 0 else Module(model, CUT, len(model.layers)))
        units.append(mods)
    params = [w0[m.start:m.stop].copy() for m in units[0]]
    velocity = [np.zeros_like(p) for p in params]
    mult = units[0][0].model.decay_mult()
    decay = [(cfg.weight_decay * mult[m.start:m.stop]).astype(np.float32) for m in units[0]]
    for mods in units:
        for k, mod in enumerate(mods):
            mod.params = params[k]
            mod.bind(params[k])
    streams = [MinibatchStream(digits, ShardSampler(digits.train_y.size, replicas, n, cfg.seed), B, cfg.seed, 1 + n)
               for n in range(replicas)]

    def forward(mod, m, x):
        mod.model.ctx.minibatch = m
        return mod.forward(x)

    def average(k, grads: bool):
        mods = [u[k] for u in units]
        if replicas > 1:
            common = mean_in_order([mod.buffers for mod in mods])
            for mod in mods:
                mod.buffers[...] = common
        if grads:
            mean = mean_in_order([mod.grads for mod in mods]) if replicas > 1 else mods[0].grads
            numpy_ops.sgd_momentum(params[k], velocity[k], mean, decay[k], cfg.momentum, cfg.lr)

    stored = [{} for _ in range(replicas)]
    labels = [{} for _ in range(replicas)]
    act, delta, losses = [None] * replicas, [None] * replicas, []
    for t in range(steps + 2):  # two more iterations drain the pipeline
        new_act, new_delta = [None] * replicas, [None] * replicas
        if t < steps:  # module 0: forward of minibatch t
            for n, mods in enumerate(units):
                x, y, _ = streams[n].next()
                labels[n][t] = y
                h = forward(mods[0], t, x).copy()
                stashed = params[0].copy() if cfg.weight_stashing else None
                stored[n][t] = (mods[0].save_cache() if store else x, stashed)
                new_act[n] = (t, h)
        if 0 <= t - 1 < steps:  # module 1: forward, loss and backward of minibatch t - 1
            for n, mods in enumerate(units):
                m, h = act[n]
                loss, _, dx = mods[1].loss_backward(forward(mods[1], m, h), labels[n].pop(m))
                if n == 0:
                    losses.append(loss)
                new_delta[n] = (m, dx)
            average(1, grads=True)
        if t < steps:
            average(0, grads=False)  # module 0's buffers after its forward (its update follows)
        if 0 <= t - 2 < steps:  # module 0: backward of minibatch t - 2
            for n, mods in enumerate(units):
                m, d = delta[n]
                state, stashed = stored[n].pop(m)
                if stashed is not None:
                    mods[0].bind(stashed)
                if store:
                    mods[0].load_cache(state)
                else:
                    mods[0].model.ctx.update_buffers = False
                    forward(mods[0], m, state)
                    mods[0].model.ctx.update_buffers = True
                mods[0].backward(d)
                mods[0].bind(params[0])
            mods0 = [u[0] for u in units]
            mean = mean_in_order([mod.grads for mod in mods0]) if replicas > 1 else mods0[0].grads
            numpy_ops.sgd_momentum(params[0], velocity[0], mean, decay[0], cfg.momentum, cfg.lr)
        act, delta = new_act, new_delta
    buffers = np.concatenate([units[0][0].buffers, units[0][1].buffers])
    return np.concatenate(params), buffers, losses


def images_statistics(digits, cfg, replicas: int, momentum: float = 0.1) -> np.ndarray:
    """The images' BatchNorm running (mean, var) after every replica's cfg.max_pushes minibatches, each
    minibatch counted once, in order; averaged over the replicas (averaging commutes with the update)."""
    out = []
    for n in range(replicas):
        stream = MinibatchStream(digits, ShardSampler(digits.train_y.size, replicas, n, cfg.seed), B, cfg.seed, 1 + n)
        mean, var = np.zeros(1, np.float32), np.ones(1, np.float32)
        for _ in range(cfg.max_pushes):
            numpy_ops.batchnorm_stats(stream.next()[0], mean, var, momentum)
        out.append(np.concatenate([mean, var]))
    return mean_in_order(out)


def run_pipeline(tmp_path, digits, cfg, replicas: int) -> tuple:
    """Rank 0 and N x K units of bn_net in threads: (rank 0, {rank: unit}, summary, layout)."""
    K = cfg.modules
    model = bn_net()
    layout = PIPELINE.layout(cfg, model, K * replicas, digits.train_y.size)
    net = Network(1 + K * replicas)
    log = new_log(tmp_path, cfg, model)
    server = rank0(net.comm(0), cfg, model.init_params(cfg.seed), model.decay_mask(), K * replicas,
                   digits.train_y.size, log, model=bn_net(), dataset=digits, layout=layout)
    pipes, datas = [Group(K) for _ in range(replicas)], [Group(replicas) for _ in range(K)]
    units = {}
    for w in range(1, K * replicas + 1):
        k, n = layout.place[w]
        sampler = ShardSampler(digits.train_y.size, layout.shards, layout.shard[w], cfg.seed)
        units[w] = PipelineUnit(WorkerJob(net.comm(w), cfg, bn_net(), digits, sampler, w,
                                          comms=(pipes[n].comm(k), datas[k].comm(n)), layout=layout))
    threads = run_threads({"rank 0": server.run, **{f"unit rank {w}": u.run for w, u in units.items()}}, JOIN_TIMEOUT)
    summary = threads[0].result
    log.close("completed", summary)
    assert all(net.pending(r) == [] for r in range(1 + K * replicas))  # nothing left over
    return server, units, summary, layout


@pytest.mark.parametrize("replicas,flags", [
    (1, {}), (2, {}), (1, {"pipeline_activations": "store"}), (2, {"pipeline_activations": "store"}),
    (1, {"weight_stashing": True}), (2, {"pipeline_activations": "store", "weight_stashing": True})])
def test_pipeline_buffers_follow_the_delayed_gradient_loop_by_hand(tmp_path, digits, replicas, flags):
    """N x 2 units, 12 minibatches per replica: rank 0 ends with the weights and buffers of the hand-written
    loop (`reference_pipeline`), the replicas of each module hold identical buffers, the images' BatchNorm
    counted every minibatch exactly once, and the log's snapshots, the end checkpoint and rank 0's final
    evaluation carry the assembled buffers."""
    cfg = pipeline_config(**flags)
    server, units, summary, layout = run_pipeline(tmp_path, digits, cfg, replicas)
    model = bn_net()
    Bn = model.num_buffers
    expected_w, expected_b, _ = reference_pipeline(digits, cfg, replicas)
    np.testing.assert_allclose(server.params, expected_w, **TOL)
    np.testing.assert_allclose(server.r0.role.buffers, expected_b, **TOL)
    assert np.abs(expected_b - model.init_buffers()).max() > 1e-2
    for k in range(cfg.modules):  # the replicas of a module hold the same buffers, bit for bit
        held = [u.module.buffers for w, u in units.items() if layout.place[w][0] == k]
        assert all(np.array_equal(b, held[0]) for b in held[1:]), k
    # the images' BatchNorm (buffers 0, 1): every minibatch's statistics once, none recomputed
    stats = images_statistics(digits, cfg, replicas)
    np.testing.assert_allclose(server.r0.role.buffers[:2], stats, rtol=1e-6, atol=0)
    if replicas == 1:
        np.testing.assert_array_equal(server.r0.role.buffers[:2], stats)
    snapshots = logged_buffers(tmp_path / "run.h5")
    assert snapshots.shape[1] == Bn
    np.testing.assert_array_equal(snapshots[0], model.init_buffers())
    np.testing.assert_array_equal(snapshots[-1], server.r0.role.buffers)
    ckpt = checkpoint.load(server.checkpoint_path)
    assert (ckpt.reason, ckpt.buffers.size) == ("end", Bn)
    np.testing.assert_array_equal(ckpt.buffers, server.r0.role.buffers)
    np.testing.assert_array_equal(ckpt.params, server.params)
    loss_sum, correct, count, _ = by_hand(model, digits, server.params, server.r0.role.buffers,
                                          np.arange(digits.test_y.size))
    assert summary["test_accuracy"] == correct / count
    assert summary["test_loss"] == pytest.approx(loss_sum / count, rel=1e-6)


def test_recomputed_forward_leaves_the_running_statistics_alone(digits):
    """With momentum 1 the running mean is the mean of the last minibatch that updated it. Module 0's order
    of a 2-module FDG pipeline, driven by hand through `PipelineUnit.recompute`: forward m, then the
    recomputed forward of m - 2. The images' running mean ends at minibatch 11's (the last forward), not
    at minibatch 9's (the last recompute), and the recompute leaves ctx.update_buffers set again."""
    cfg = pipeline_config()
    stream = MinibatchStream(digits, ShardSampler(digits.train_y.size, 1, 0, cfg.seed), B, cfg.seed, 1)
    batches = [stream.next()[0] for _ in range(cfg.max_pushes)]
    model = bn_net(momentum=1.0)
    module = Module(model, 0, CUT)
    module.params[...] = model.init_params(cfg.seed)[module.start:module.stop]
    unit = PipelineUnit.__new__(PipelineUnit)  # only its recompute: the rest needs communicators
    unit.module = module
    for m, x in enumerate(batches):
        model.ctx.minibatch = m
        module.forward(x)
        if m >= 2:
            unit.recompute(batches[m - 2], m - 2)  # module 0's backward lags two minibatches (FDG, K = 2)
    last = batches[-1].mean(dtype=np.float64)
    np.testing.assert_allclose(module.buffers[0], last, rtol=1e-6)
    assert abs(module.buffers[0] - batches[-3].mean(dtype=np.float64)) > 1e-3
    assert model.ctx.update_buffers  # set back after every recompute


def test_store_and_recompute_both_train_and_agree_without_delay(tmp_path, digits):
    """48 minibatches: with K = 2 both semantics lower the loss (the last module's first minibatches against its
    last ones, and the test loss below ln 10, the zero classifier's) and differ (module 0's backward sees other
    activations); K = 1 (no delay, nothing kept): they are the same run bit for bit."""
    runs = {}
    for activations in ("recompute", "store"):
        for K in (1, 2):
            cfg = pipeline_config(pipeline_activations=activations, modules=K, cuts="" if K == 1 else str(CUT),
                                  max_pushes=48)
            path = tmp_path / f"{activations}-{K}"
            path.mkdir()
            server, _, summary, _ = run_pipeline(path, digits, cfg, 1)
            runs[activations, K] = (server.params.copy(), server.r0.role.buffers.copy(), summary)
            with open_log(str(path / "run.h5")) as f:
                pushes = f["pushes"][()]
            rows = pushes[(pushes["worker"] == K) & (pushes["applied"] == 1)]  # the last module: every loss
            losses = rows["loss"][np.argsort(rows["epoch"])]
            assert losses.size == cfg.max_pushes
            assert losses[-4:].mean() < losses[:4].mean() - 0.5, (activations, K, losses)
            assert summary["test_loss"] < math.log(10) - 0.5, (activations, K, summary["test_loss"])
    for i in (0, 1):
        np.testing.assert_array_equal(runs["recompute", 1][i], runs["store", 1][i])
    assert np.abs(runs["recompute", 2][0] - runs["store", 2][0]).max() > 1e-4


# --- async ------------------------------------------------------------------------------------------------

def test_async_server_snapshots_the_mean_of_the_workers_latest_buffers(tmp_path):
    """Each PUSH carries the worker's buffers after its gradient: rank 0 snapshots and checkpoints the mean
    of every worker's latest (a non-finite one is not kept)."""
    cfg = Config(lr=0.1, momentum=0.0, weight_decay=0.0, lr_schedule="constant", warmup_epochs=0.0, epochs=0,
                 max_pushes=100, snapshot_interval=0, progress=False, comm_timeout=2.0)
    model = bn_net()
    P, Bn = model.num_params, model.num_buffers
    net = Network(3)
    log = new_log(tmp_path, cfg, model)
    server = rank0(net.comm(0), cfg, model.init_params(0), model.decay_mask(), 2, 100, log, model=model)
    server.r0.role.begin()
    rng = np.random.default_rng(3)
    pushed = {1: [], 2: []}
    for step, w, finite in ((1, 1, True), (1, 2, True), (2, 1, True), (2, 2, False)):
        msg = Message(P + Bn).stamp(Tag.PUSH, w, step=step, version=0, samples=B, loss=1.0)
        msg.payload[:P] = 0.0
        msg.payload[P:] = rng.standard_normal(Bn).astype(np.float32) if finite else np.nan
        if finite:
            pushed[w].append(msg.payload[P:].copy())
        net.post(w, 0, Tag.PUSH, msg.buf)
        serve_one(server)
    expected = np.mean([pushed[1][-1], pushed[2][-1]], axis=0, dtype=np.float64).astype(np.float32)
    np.testing.assert_array_equal(server.r0.role.current_buffers(), expected)
    state = server.r0.role.state("interval")
    np.testing.assert_array_equal(state.buffers, expected)
