"""A network defined outside the package (tests/mpi/nets/small_bn.py: BatchNorm, residual blocks, dropout)
trained under `mpiexec` in async, sync and pipeline mode, then evaluated from its run log alone."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from kit import REPO

from mpiasgd.model import build_model
from mpiasgd.model.spec import from_json, resolve
from mpiasgd.tools.evaluate import evaluate_snapshots

NET = str(REPO / "tests" / "mpi" / "nets" / "small_bn.py")
RUN = ["--dataset", "digits", "--batch-size", "32", "--lr", "0.05", "--no-progress", "--comm-timeout", "60",
       "--snapshot-interval", "0.5", "--flush-interval", "0.2"]


@pytest.mark.parametrize("mode, extra", [
    ("async", ["--epochs", "4"]),
    ("sync", ["--epochs", "4"]),
    ("pipeline", ["--epochs", "4", "--modules", "2", "--cuts", "4"]),
])
def test_user_network_trains_and_evaluates_from_its_log(mpirun, tmp_path, mode, extra):
    res = mpirun(3, ["train", "--model", f"{NET}:build", "--mode", mode, *RUN, *extra, "--name", mode], timeout=180)
    assert res.returncode == 0, res.explain()
    path = tmp_path / "runs" / f"{mode}.h5"
    with h5py.File(path, "r") as f:
        spec = from_json(f.attrs["model_spec"])
        params, buffers = f["snapshots/params"][()], f["snapshots/buffers"][()]
        accuracy = float(f.attrs["test_accuracy"])
        assert json.loads(f.attrs["config"])["model"] == f"{NET}:build"
    # the log holds the definition the file produced, as data
    assert spec == resolve(f"{NET}:build", (1, 8, 8))
    model = build_model(spec)
    assert params.shape[1] == model.num_params == 33594 and buffers.shape[1] == model.num_buffers == 352
    init = model.init_buffers()
    np.testing.assert_array_equal(buffers[0], init)  # the first snapshot: the initial state
    assert not np.allclose(buffers[-1], init)        # the running statistics moved with training
    assert accuracy > 0.85, res.stdout
    # evaluated from the log alone (the file could be gone): the last snapshot with its buffers
    rows = evaluate_snapshots(str(path), every=1000)
    assert rows["accuracy"][-1] == accuracy  # the workers evaluated the same weights and buffers


def test_a_network_that_does_not_fit_the_data_is_one_startup_error(mpirun, tmp_path):
    res = mpirun(3, ["train", "--model", f"{NET}:wrong_input", *RUN, "--epochs", "1", "--name", "bad"], timeout=60)
    assert res.returncode == 2
    assert ("mpiasgd: error (ranks 0, 1, 2): --model '" + NET + ":wrong_input': model 'small_bn', layer conv1: "
            "Conv2d(3->8, k3 s1 p1): expects inputs (3, H, W), got (1, 8, 8)") in res.stderr, res.explain()
    res = mpirun(3, ["train", "--model", f"{NET}:wrong_classes", *RUN, "--epochs", "1", "--name", "bad"], timeout=60)
    assert res.returncode == 2
    assert (f"--model '{NET}:wrong_classes': model 'small_bn', its last layer fc1 (Linear(8->3)) gives 3 logits, "
            "dataset 'digits' has 10 classes") in res.stderr, res.explain()
    assert not (tmp_path / "runs" / "bad.h5").exists()


def test_a_model_file_that_exits_or_uses_numpy_sizes_never_hangs_startup(mpirun, tmp_path):
    """Rank 0 alone runs the file while the workers wait for its definition: a SystemExit there is reported as
    the start-up error (exit 2, within seconds), and NumPy integer sizes are stored as plain numbers."""
    res = mpirun(3, ["train", "--model", f"{NET}:exits", *RUN, "--epochs", "1", "--name", "x"], timeout=60)
    assert res.returncode == 2 and res.seconds < 30, res.explain()
    assert f"mpiasgd: error (rank 0): --model '{NET}:exits': exits() raised SystemExit: 3" in res.stderr
    res = mpirun(3, ["train", "--model", f"{NET}:numpy_sizes", *RUN, "--epochs", "0", "--max-pushes", "4",
                     "--name", "np"], timeout=60)
    assert res.returncode == 0, res.explain()
    with h5py.File(tmp_path / "runs" / "np.h5", "r") as f:
        layers = json.loads(f.attrs["model_spec"])["layers"]
    assert layers[0]["out_channels"] == 8 and layers[-1]["out_features"] == 10


def test_a_model_file_that_never_returns_is_stopped_not_hung(mpirun, tmp_path):
    """Rank 0 stops a file's function after --model-timeout (one start-up error naming it); a file that blocks
    that stop leaves rank 0 stuck, and the workers abort the job after --model-timeout + --comm-timeout."""
    run = [a for a in RUN if a not in ("--comm-timeout", "60")]
    res = mpirun(3, ["train", "--model", f"{NET}:sleeps", *run, "--epochs", "1", "--model-timeout", "2",
                     "--name", "x"], timeout=60)
    assert res.returncode == 2 and res.seconds < 30, res.explain()
    assert (f"mpiasgd: error (rank 0): --model '{NET}:sleeps': importing '{NET}' and calling sleeps() took more "
            "than 2 s (--model-timeout): does it loop or wait?") in res.stderr, res.explain()
    res = mpirun(3, ["train", "--model", f"{NET}:deaf", *run, "--epochs", "1", "--model-timeout", "1",
                     "--comm-timeout", "2", "--name", "x"], timeout=60)
    assert res.returncode != 0 and res.seconds < 30, res.explain()
    assert "rank 0 sent no network definition within 3 s (--model-timeout + --comm-timeout)" in res.stderr
    assert not (tmp_path / "runs" / "x.h5").exists()


def test_a_thread_the_model_file_leaves_running_does_not_keep_the_job_alive(mpirun, tmp_path):
    res = mpirun(3, ["train", "--model", f"{NET}:thread_then_raises", *RUN, "--epochs", "1", "--name", "t"],
                 timeout=60)
    assert res.returncode == 2 and res.seconds < 30, res.explain()
    assert f"mpiasgd: error (rank 0): --model '{NET}:thread_then_raises': thread_then_raises() raised RuntimeError: " \
           "bad net" in res.stderr
    warning = ("mpiasgd: warning: rank 0: thread(s) users-thread still running (started by the --model file?): "
               "exiting without waiting for them")
    assert warning in res.stderr, res.explain()
    res = mpirun(3, ["train", "--model", f"{NET}:with_thread", *RUN, "--epochs", "0", "--max-pushes", "4",
                     "--name", "t"], timeout=60)
    assert res.returncode == 0 and res.seconds < 30 and warning in res.stderr, res.explain()
    with h5py.File(tmp_path / "runs" / "t.h5", "r") as f:
        assert f.attrs["status"] == "completed"
