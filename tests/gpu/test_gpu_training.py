"""Training with `--backend cupy` under mpiexec, against the numpy backend from the same seed.

With one worker (2 ranks) the order of pushes is deterministic, so the first 20 minibatch losses of
the two backends must agree to float32 rounding (compounded over 20 SGD steps); then a 3-rank
smoke run with two workers (on one GPU with --share-devices when only one is visible), and the
start-up error when two workers would share a GPU without it. The cifar10 model runs on a small
random CIFAR-10 written here (the machine needs no download).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from kit.cifar import write_py_batch
from kit.launch import run_mpi

from mpiasgd.ops import cuda_device_count
from mpiasgd.runlog import open_log

pytestmark = pytest.mark.gpu
STEPS = 20
COMMON = ["--batch-size", "32", "--snapshot-interval", "0", "--no-progress", "--comm-timeout", "120", "--seed", "5"]


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    """A random CIFAR-10 in the python layout: 5 x 200 train, 100 test images."""
    root = tmp_path_factory.mktemp("cifar")
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(7)
    for i in range(5):
        write_py_batch(folder / f"data_batch_{i + 1}", rng.integers(0, 256, (200, 3, 32, 32), dtype=np.uint8),
                       rng.integers(0, 10, 200))
    write_py_batch(folder / "test_batch", rng.integers(0, 256, (100, 3, 32, 32), dtype=np.uint8),
                   rng.integers(0, 10, 100))
    return root


def train(tmp_path, nranks, backend, name, extra):
    res = run_mpi(nranks, ["train", *COMMON, "--backend", backend, "--name", name, *extra], 240, tmp_path)
    assert res.returncode == 0, res.explain()
    with open_log(str(tmp_path / "runs" / f"{name}.h5")) as f:
        return f["pushes"][()], f["workers"][()], dict(f.attrs)


@pytest.mark.parametrize("model", ["digits", "cifar10"])
def test_first_losses_match_numpy(tmp_path, cifar_dir, model):
    extra = ["--model", model, "--max-pushes", str(STEPS), "--epochs", "0", "--data-dir", str(cifar_dir)]
    ref, _, _ = train(tmp_path, 2, "numpy", f"{model}-np", extra)
    got, workers, attrs = train(tmp_path, 2, "cupy", f"{model}-cp", extra)
    ref, got = ref[ref["applied"] == 1], got[got["applied"] == 1]
    assert ref["step"].tolist() == got["step"].tolist() == list(range(1, STEPS + 1))
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=2e-3, atol=2e-4,
                               err_msg=f"{model}: losses of the first {STEPS} steps, cupy vs numpy")
    assert got["correct"].tolist() == pytest.approx(ref["correct"].tolist(), abs=2)
    w = workers[0]
    assert w["backend"] == b"cupy" and w["device"] == 0 and w["transfer"] in (b"pinned", b"device")
    assert w["device_name"] and w["device_uuid"].startswith(b"GPU-")
    assert np.isfinite(attrs["test_loss"])


def test_three_ranks_smoke(tmp_path, cifar_dir):
    share = ["--share-devices"] if cuda_device_count() < 2 else []
    pushes, workers, attrs = train(tmp_path, 3, "auto", "smoke",  # autotune: start-up compiles every tile
                                   ["--model", "cifar10", "--epochs", "1", "--data-dir", str(cifar_dir),
                                    "--conv-algo", "autotune", *share])
    assert attrs["status"] == "completed" and sorted(set(pushes["worker"].tolist())) == [1, 2]
    assert json.loads(attrs["config"])["conv_algo"] == "autotune"
    with open_log(str(tmp_path / "runs" / "smoke.h5")) as f:
        tuned = [row["text"].decode() if isinstance(row["text"], bytes) else row["text"]
                 for row in f["events"][()] if row["kind"] == b"autotune"]
    assert [t.split(":")[0] for t in tuned] == [f"worker rank {r} on {workers['host'][r - 1].decode()}" for r in (1, 2)]
    assert all(t.count("conv2d_") == 8 for t in tuned), tuned  # 3 fprop + 3 wgrad + 2 dgrad (not conv1's)
    assert workers["backend"].tolist() == [b"cupy", b"cupy"]
    assert workers["device"].tolist() == [0, 0] if share else [0, 1]
    assert np.isfinite(pushes["loss"]).all() and 0.0 <= attrs["test_accuracy"] <= 1.0


def test_two_workers_on_one_gpu_need_share_devices(tmp_path):
    n = cuda_device_count() + 2  # one more worker than devices: local rank modulo devices repeats one
    res = run_mpi(n, ["train", *COMMON, "--backend", "cupy", "--name", "shared", "--max-pushes", "5"], 240, tmp_path)
    assert res.returncode == 2, res.explain()
    errors = [line for line in res.stderr.splitlines() if line.startswith("mpiasgd: error")]
    assert len(errors) == 1 and "would share one GPU" in errors[0] and "--share-devices" in errors[0], res.explain()


@pytest.mark.parametrize("mode", [["--nsync", "3"], ["--overlap"], ["--mode", "ssp", "--staleness-bound", "1"],
                                  ["--mode", "sync"]])
def test_modes_on_the_gpu(tmp_path, mode):
    """Each training mode with 2 cupy workers (one GPU shared if need be) completes and learns digits."""
    share = ["--share-devices"] if cuda_device_count() < 2 else []
    pushes, workers, attrs = train(tmp_path, 3, "cupy", "gpu-mode", ["--model", "digits", "--epochs", "5", *mode,
                                                                    *share])
    assert attrs["status"] == "completed" and workers["backend"].tolist() == [b"cupy", b"cupy"]
    assert np.isfinite(pushes["loss"]).all() and attrs["test_accuracy"] > 0.8


def test_sync_mode_weights_match_numpy(tmp_path):
    """Sync mode is deterministic: after 20 steps the cupy workers' weights match the numpy backend's."""
    share = ["--share-devices"] if cuda_device_count() < 2 else []
    extra = ["--model", "digits", "--mode", "sync", "--epochs", "0", "--max-pushes", str(STEPS)]
    train(tmp_path, 3, "cupy", "sync-cp", [*extra, *share])
    train(tmp_path, 3, "numpy", "sync-np", extra)
    with open_log(str(tmp_path / "runs" / "sync-cp.h5")) as f, open_log(str(tmp_path / "runs" / "sync-np.h5")) as g:
        np.testing.assert_allclose(f["snapshots/params"][-1], g["snapshots/params"][-1], rtol=1e-3, atol=1e-5)


def test_pipeline_modules_on_the_gpu_match_numpy(tmp_path):
    """Two pipeline modules on cupy workers: after 20 iterations the weights match the numpy backend's."""
    share = ["--share-devices"] if cuda_device_count() < 2 else []
    extra = ["--model", "digits", "--mode", "pipeline", "--modules", "2", "--epochs", "0", "--max-pushes", str(STEPS)]
    train(tmp_path, 3, "cupy", "pipe-cp", [*extra, *share])
    train(tmp_path, 3, "numpy", "pipe-np", extra)
    with open_log(str(tmp_path / "runs" / "pipe-cp.h5")) as f, open_log(str(tmp_path / "runs" / "pipe-np.h5")) as g:
        np.testing.assert_allclose(f["snapshots/params"][-1], g["snapshots/params"][-1], rtol=1e-3, atol=1e-5)
        assert f.attrs["test_accuracy"] == pytest.approx(g.attrs["test_accuracy"], abs=0.02)


def split_run(tmp_path, backend, name, extra):
    """10 steps, then --resume to 20; returns the final checkpoint."""
    from mpiasgd import checkpoint

    train(tmp_path, 3, backend, name, [*extra, "--max-pushes", "10"])
    res = run_mpi(3, ["train", "--resume", f"runs/{name}.ckpt.h5", "--max-pushes", "20", "--no-progress"], 240,
                  tmp_path)
    assert res.returncode == 0, res.explain()
    return checkpoint.load(str(tmp_path / "runs" / f"{name}.ckpt.h5"))


def test_resume_on_the_gpu(tmp_path, cifar_dir):
    """cupy workers, cifar10 (augmentation on). Sync: 20 steps straight and 10 + --resume + 10 end with
    the same checkpoint, bit for bit. Pipeline (K = 2): 10 + --resume + 10 on cupy matches the same on
    numpy to float32 rounding (the momentum crosses the resume through the checkpoint; it is compared by
    norm, see below)."""
    from mpiasgd import checkpoint

    share = ["--share-devices"] if cuda_device_count() < 2 else []
    extra = ["--model", "cifar10", "--data-dir", str(cifar_dir), "--epochs", "0", "--lr-schedule", "constant"]
    sync = [*extra, "--mode", "sync", *share]
    train(tmp_path, 3, "cupy", "straight", [*sync, "--max-pushes", "20"])
    a = checkpoint.load(str(tmp_path / "runs" / "straight.ckpt.h5"))
    b = split_run(tmp_path, "cupy", "split", sync)
    assert a.version == b.version == 20
    np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(a.momentum, b.momentum)
    pipe = [*extra, "--mode", "pipeline", "--modules", "2"]
    c, d = split_run(tmp_path, "cupy", "pipe-cp", [*pipe, *share]), split_run(tmp_path, "numpy", "pipe-np", pipe)
    assert c.version == d.version == 20
    np.testing.assert_allclose(c.params, d.params, rtol=1e-3, atol=1e-5)
    # The momentum is the last steps' gradients: where the two backends' float32 sums leave two inputs of a
    # max-pool window a rounding apart, the window's argmax can differ, and every weight of that filter then
    # takes a different term (the first H200 run: 128 of 85,098 values off by up to 1.3e-4, the first five
    # in one conv1 filter). So the momentum is compared as a whole: its norm's relative error, max over max.
    diff = c.momentum.astype(np.float64) - d.momentum
    assert np.linalg.norm(diff) <= 1e-3 * np.linalg.norm(d.momentum), (np.linalg.norm(diff), np.linalg.norm(d.momentum))
    assert np.abs(diff).max() <= 1e-2 * np.abs(d.momentum).max(), (np.abs(diff).max(), np.abs(d.momentum).max())
