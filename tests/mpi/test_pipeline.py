"""Pipeline mode (decoupled backpropagation x data parallelism) under `mpiexec`: the logged weights
against delayed gradients applied by hand (kit.pipeline), every module's delay, K = 1 = sync, replicas,
training to accuracy, failures. Each job runs under a timeout.
"""

from __future__ import annotations

import numpy as np
import pytest
from kit.pipeline import reference_two_modules
from kit.runs import FAST, B, read_log

from mpiasgd.config import Config
from mpiasgd.model import build_model


@pytest.mark.parametrize("flags,stash,shrink,predict", [([], False, 1.0, False),
                                                        (["--weight-stashing", "--shrink", "0.5"], True, 0.5, False),
                                                        (["--weight-prediction"], False, 1.0, True)],
                         ids=["current", "stashing-shrink", "prediction"])
def test_two_modules_match_delayed_gradients_by_hand(mpirun, tmp_path, digits, flags, stash, shrink, predict):
    steps = 12
    res = mpirun(3, ["train", *FAST, "--mode", "pipeline", "--modules", "2", "--cuts", "4", "--seed", "4",
                     "--lr", "0.05", "--warmup-epochs", "0", "--epochs", "0", "--max-pushes", str(steps),
                     "--snapshot-interval", "0", *flags, "--name", "p2"], timeout=90)
    assert res.returncode == 0, res.explain()
    _, _, params = read_log(tmp_path / "runs" / "p2.h5")
    cfg = Config(model="digits", mode="pipeline", batch_size=B, seed=4, lr=0.05, warmup_epochs=0.0, epochs=0,
                 max_pushes=steps)
    expected = reference_two_modules(digits, cfg, steps, stash, shrink, predict)
    np.testing.assert_allclose(params[-1], expected, rtol=1e-5, atol=1e-7)
    other = reference_two_modules(digits, cfg, steps, not stash and not predict, shrink, False)
    split = build_model("digits").param_range(0, 4)[1]
    assert np.abs(other - expected)[:split].max() > 1e-4  # stashing (prediction) changes module 0's gradients


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
