"""Pipeline mode (decoupled backpropagation x data parallelism): cuts, modules, delays, references.

In-process checks build modules from the digits model; multi-rank checks run `mpiexec` under a
timeout and compare the run log with hand-written references.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_mpi import FAST, read_log

from mpiasgd.config import Config, ConfigError
from mpiasgd.data import ShardSampler, load_dataset, minibatches
from mpiasgd.model import build_model
from mpiasgd.modes.pipeline import Module, layer_costs, partition
from mpiasgd.ops import numpy_ops
from mpiasgd.optim import fraction_done, learning_rate

B = 16


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


# --- cutting the model -----------------------------------------------------------------------------------

def test_partition_balances_flops_and_takes_given_cuts():
    model = build_model("digits")  # conv1 relu1 pool1 conv2 relu2 pool2 flatten1 fc1
    assert partition(model, 1) == [0, 8]
    assert partition(model, 2) == [0, 3, 8]          # conv2 is 88% of the forward FLOPs
    assert partition(model, 3, cuts=(2, 5)) == [0, 2, 5, 8]
    for balance in ("flops", "params"):  # the cuts minimise the largest module cost: brute force agrees
        costs = layer_costs(model, balance)
        for k in (2, 3, 4):
            def worst(bounds, costs=costs):
                return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
            bounds = partition(model, k, balance=balance)
            assert bounds[0] == 0 and bounds[-1] == 8 and len(bounds) == k + 1 and bounds == sorted(set(bounds))
            best = min(worst([0, *c, 8]) for c in itertools.combinations(range(1, 8), k - 1))
            assert worst(bounds) == best
    with pytest.raises(ConfigError, match="'modules' = 9: model 'digits' has only 8 layers"):
        partition(model, 9)
    with pytest.raises(ConfigError, match=r"expected 1 increasing layer index\(es\) in 1\.\.7"):
        partition(model, 2, cuts=(8,))


def test_modules_chained_give_the_whole_model_gradient(digits):
    """Module 0 then module 1 (no delay) compute exactly what the whole model's forward_backward does."""
    model, ref = build_model("digits"), build_model("digits")
    w = model.init_params(1)
    w += np.random.default_rng(0).standard_normal(w.size).astype(np.float32) * 0.05  # a non-zero classifier
    g_ref = np.zeros_like(w)
    ref.bind(w.copy(), g_ref)
    x, y = digits.batch("train", np.arange(B))
    ref.forward_backward(x, y)
    first, second = Module(model, 0, 3), Module(model, 3, 8)
    assert (first.start, first.stop, second.start, second.stop) == (0, 160, 160, 6090)
    assert first.out_shape == second.in_shape == (16, 4, 4) and second.is_last and not first.is_last
    first.params[...] = w[:160]
    second.params[...] = w[160:]
    _, _, dx = second.loss_backward(second.forward(first.forward(x)), y)
    assert first.backward(dx) is None  # module 0: nothing consumes the gradient w.r.t. the images
    np.testing.assert_allclose(np.concatenate([first.grads, second.grads]), g_ref, rtol=1e-5, atol=1e-7)


# --- by hand: N = 1, K = 2, fully decoupled -----------------------------------------------------------------

def reference_two_modules(digits, cfg, steps, stash=False, shrink=1.0):
    """Module 0 (layers 0-3: conv1 relu1 pool1 conv2) forwards minibatch t at iteration t and back-propagates
    minibatch t-2 with the input gradient module 1 computed at iteration t-1; module 1 forwards, takes the
    loss and back-propagates minibatch t-1 at iteration t. Each updates after its backward (SGD with
    momentum, the run's schedule)."""
    model = build_model("digits")
    w0 = model.init_params(cfg.seed)
    mods = [Module(model, 0, 4), Module(model, 4, 8)]
    mask = cfg.weight_decay * model.decay_mask()
    velocity, decay = [], []
    for m in mods:
        m.params[...] = w0[m.start:m.stop]
        velocity.append(np.zeros(m.size, np.float32))
        decay.append(mask[m.start:m.stop].astype(np.float32))
    sampler = ShardSampler(digits.train_y.size, 1, 0, cfg.seed)
    batches, labels = minibatches(sampler, B), minibatches(sampler, B)
    rng = np.random.default_rng([cfg.seed, 1, 1])

    def update(k, minibatch):
        done = minibatch * B / digits.train_y.size
        lr = learning_rate(cfg, done, fraction_done(cfg, done, minibatch, 0.0))
        numpy_ops.sgd_momentum(mods[k].params, velocity[k], mods[k].grads, decay[k], cfg.momentum, lr)

    stored, act, delta = {}, None, None
    for t in range(steps + 2):  # two more iterations drain the pipeline
        new_act = new_delta = None
        if t < steps:
            x, _ = digits.batch("train", next(batches)[1], rng)
            stored[t] = (x, mods[0].params.copy() if stash else None)
            new_act = (t, mods[0].forward(x).copy())
        if 0 <= t - 1 < steps:
            m, h = act
            y = digits.train_y[next(labels)[1]]
            _, _, dx = mods[1].loss_backward(mods[1].forward(h), y)
            new_delta = (m, dx * np.float32(shrink))
            update(1, m)
        if 0 <= t - 2 < steps:
            m, d = delta
            x, weights = stored.pop(m)
            if weights is not None:
                mods[0].bind(weights)
            mods[0].forward(x)
            mods[0].backward(d)
            mods[0].bind(mods[0].params)
            update(0, m)
        act, delta = new_act, new_delta
    return np.concatenate([mods[0].params, mods[1].params])


@pytest.mark.parametrize("flags,stash,shrink", [([], False, 1.0),
                                                (["--weight-stashing", "--shrink", "0.5"], True, 0.5)])
def test_two_modules_match_delayed_gradients_by_hand(mpirun, tmp_path, digits, flags, stash, shrink):
    steps = 12
    res = mpirun(3, ["train", *FAST, "--mode", "pipeline", "--modules", "2", "--cuts", "4", "--seed", "4",
                     "--lr", "0.05", "--warmup-epochs", "0", "--epochs", "0", "--max-pushes", str(steps),
                     "--snapshot-interval", "0", *flags, "--name", "p2"], timeout=90)
    assert res.returncode == 0, res.explain()
    _, _, params = read_log(tmp_path / "runs" / "p2.h5")
    cfg = Config(model="digits", mode="pipeline", batch_size=B, seed=4, lr=0.05, warmup_epochs=0.0, epochs=0,
                 max_pushes=steps)
    expected = reference_two_modules(digits, cfg, steps, stash, shrink)
    np.testing.assert_allclose(params[-1], expected, rtol=1e-5, atol=1e-7)
    other = reference_two_modules(digits, cfg, steps, not stash, shrink)
    split = build_model("digits").param_range(0, 4)[1]
    assert np.abs(other - expected)[:split].max() > 1e-4  # stashing changes module 0's gradients


# --- delays, K = 1, replicas ------------------------------------------------------------------------------------

@pytest.mark.parametrize("nranks,modules,decoupling", [(4, 3, "full"), (4, 3, "backward"), (5, 2, "full")])
def test_every_module_has_the_documented_delay(mpirun, tmp_path, nranks, modules, decoupling):
    res = mpirun(nranks, ["train", *FAST, "--mode", "pipeline", "--modules", str(modules), "--decoupling",
                          decoupling, "--epochs", "0", "--max-pushes", "30", "--name", "delay"], timeout=90)
    assert res.returncode == 0, res.explain()
    attrs, t, params = read_log(tmp_path / "runs" / "delay.h5")
    workers, p = t["workers"], t["pushes"]
    replicas = (nranks - 1) // modules
    assert workers["module"].tolist() == [r % modules for r in range(nranks - 1)]
    assert workers["replica"].tolist() == [r // modules for r in range(nranks - 1)]
    for rank, k in zip(workers["rank"].tolist(), workers["module"].tolist(), strict=True):
        rows = p[p["worker"] == rank]
        delay = (2 if decoupling == "full" else 1) * (modules - 1 - k)
        applied = rows[rows["applied"] == 1]
        assert (applied["staleness"] == delay).all(), (rank, k, set(applied["staleness"].tolist()))
        assert len(applied) == 30                                   # every minibatch's gradient, once
        assert applied["epoch"].tolist() == list(range(30))         # in order
        assert rows["step"][rows["applied"] == 0].tolist() == list(range(delay + (k if decoupling == "full" else 0)))
    assert p["samples"].sum() == 30 * B * replicas and attrs["samples"] == 30 * B * replicas
    if replicas > 1:  # the replicas' weights after every iteration: one digest per (module, iteration)
        for k in range(modules):
            ranks = workers["rank"][workers["module"] == k]
            rows = p[np.isin(p["worker"], ranks)]
            for step in set(rows["step"].tolist()):
                assert len(set(rows["digest"][rows["step"] == step].tolist())) == 1
    assert params.shape[1] == attrs["num_params"] and np.isfinite(params).all()


def test_one_module_is_synchronous_data_parallelism(mpirun, tmp_path):
    common = [*FAST, "--seed", "6", "--epochs", "0", "--max-pushes", "10", "--snapshot-interval", "0"]
    res = mpirun(3, ["train", *common, "--mode", "sync", "--name", "sync"], timeout=90)
    assert res.returncode == 0, res.explain()
    res = mpirun(3, ["train", *common, "--mode", "pipeline", "--modules", "1", "--name", "k1"], timeout=90)
    assert res.returncode == 0, res.explain()
    _, _, sync = read_log(tmp_path / "runs" / "sync.h5")
    _, _, pipe = read_log(tmp_path / "runs" / "k1.h5")
    np.testing.assert_array_equal(pipe[-1], sync[-1])
    assert not np.array_equal(pipe[-1], pipe[0])


def test_diverging_replicas_stop_the_run(mpirun, tmp_path):
    res = mpirun(5, ["perturb", "3", *FAST, "--mode", "pipeline", "--modules", "2", "--epochs", "0",
                     "--max-pushes", "30", "--name", "bad"], timeout=60, script="fault.py")
    assert res.returncode != 0 and res.seconds < 30, res.explain()
    assert "the replicas' weights differ after step" in res.stderr, res.explain()
    attrs, _, _ = read_log(tmp_path / "runs" / "bad.h5")
    assert attrs["status"] == "failed"


def test_wrong_number_of_ranks_is_one_error(mpirun):
    res = mpirun(4, ["train", *FAST, "--mode", "pipeline", "--modules", "2", "--name", "x"], timeout=60)
    assert res.returncode == 2, res.explain()
    errors = [line for line in res.stderr.splitlines() if line.startswith("mpiasgd: error")]
    assert errors == ["mpiasgd: error (ranks 0, 1, 2, 3): --mode pipeline with --modules 2 needs 1 + N x 2 ranks "
                      "(rank 0 logs; N replicas of 2 modules), got 4 ranks; launch e.g. 'mpiexec -n 3'"], res.explain()


@pytest.mark.parametrize("nranks,modules", [(3, 2), (5, 2), (4, 3)])
def test_pipeline_trains_digits(mpirun, tmp_path, nranks, modules):
    res = mpirun(nranks, ["train", *FAST, "--mode", "pipeline", "--modules", str(modules), "--epochs", "30",
                          "--name", "acc"], timeout=120)
    assert res.returncode == 0, res.explain()
    attrs, _, _ = read_log(tmp_path / "runs" / "acc.h5")
    assert attrs["test_accuracy"] >= 0.93 and attrs["test_count"] == 360


def test_non_finite_module_gradients_are_skipped_then_stop_the_run(mpirun, tmp_path):
    """Unit rank 1 (module 0) gets NaN gradients from its 3rd backward on: each is skipped (not applied),
    logged, and --max-rejects of them in a row end the run with an error naming the unit."""
    res = mpirun(4, ["nanmodule", "1", *FAST, "--mode", "pipeline", "--modules", "3", "--epochs", "5",
                     "--max-rejects", "4", "--name", "nan"], timeout=60, script="fault.py")
    assert res.returncode != 0 and res.seconds < 30, res.explain()
    assert "worker rank 1 pushed 4 non-finite gradients in a row" in res.stderr, res.explain()
    attrs, t, params = read_log(tmp_path / "runs" / "nan.h5")
    assert attrs["status"] == "failed"
    p = t["pushes"]
    bad = p[p["rejected"] == 1]
    assert set(bad["worker"].tolist()) == {1} and len(bad) == 4 and not bad["applied"].any()
    assert (bad["staleness"] == 4).all()  # module 0 of 3: its delay
    assert sum(e["kind"] == b"skip" for e in t["events"]) == 4
    assert np.isfinite(params).all()  # no NaN reached the weights


def test_pipeline_options_need_pipeline_mode_and_stragglers_must_be_workers(mpirun, tmp_path):
    res = mpirun(3, ["train", *FAST, "--mode", "sync", "--modules", "3", "--name", "x"], timeout=60)
    assert res.returncode == 2 and "'modules' = 3: expected 2 unless --mode pipeline" in res.stderr, res.explain()
    res = mpirun(3, ["train", *FAST, "--straggler", "3:2", "--name", "x"], timeout=60)
    assert res.returncode == 2, res.explain()
    assert "'straggler' = '3:2': rank(s) [3] are not workers (workers are ranks 1..2)" in res.stderr, res.explain()
    assert not list((tmp_path / "runs").glob("x.h5*"))  # neither a log nor a stale lock file is left
