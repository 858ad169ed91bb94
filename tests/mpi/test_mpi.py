"""Real multi-rank runs under mpiexec (each under a timeout: a hang fails the test, with its output).

Test bodies are written in terms of the number of ranks, so the same checks run with 2, 3 and 5.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from kit.launch import kill_session, session_pids, start_mpi, stop_group
from kit.runs import FAST, read_log, wait_for_pushes

from mpiasgd.runlog import open_log
from mpiasgd.signals import EXIT_PREEMPTED


@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_async_run_writes_consistent_log(mpirun, tmp_path, nranks):
    workers = nranks - 1
    res = mpirun(nranks, ["train", *FAST, "--max-pushes", "120", "--epochs", "0", "--name", "t"], timeout=120)
    assert res.returncode == 0, res.explain()
    assert "test accuracy" in res.stdout and "staleness" in res.stdout, res.explain()
    attrs, t, params = read_log(tmp_path / "runs" / "t.h5")
    assert attrs["status"] == "completed" and attrs["num_workers"] == workers
    pushes, applied = t["pushes"], t["pushes"][t["pushes"]["applied"] == 1]
    # every worker pushed, with consecutive steps 1..n, and exactly max_pushes were applied
    assert sorted(set(pushes["worker"].tolist())) == list(range(1, nranks))
    for w in range(1, nranks):
        assert pushes["step"][pushes["worker"] == w].tolist() == list(range(1, (pushes["worker"] == w).sum() + 1))
    assert len(applied) == 120 and applied["version"].tolist() == list(range(1, 121))
    # staleness = server version before the update - base version; drained pushes are at most one per worker
    assert (applied["staleness"] == applied["version"] - 1 - applied["base_version"]).all()
    assert applied["staleness"].min() >= 0
    assert len(pushes) - len(applied) <= workers
    # updates: one per applied push, lr warms up from 0
    assert len(t["updates"]) == 120 and t["updates"]["lr"][0] == 0.0
    # snapshots: first at version 0, last at the final version, params stored for each
    meta = t["snapshots/meta"]
    assert meta["version"][0] == 0 and meta["version"][-1] == 120 and len(meta) >= 2
    assert params.shape == (len(meta), int(attrs["num_params"])) and np.isfinite(params).all()
    assert not np.array_equal(params[0], params[-1])
    # final evaluation: all 360 digits test images, shared by the workers
    final = t["evals"][t["evals"]["snapshot"] == -1]
    assert final["count"].tolist() == [360] and 0.0 <= final["accuracy"][0] <= 1.0
    assert t["workers"]["rank"].tolist() == list(range(1, nranks))


def test_digits_converges_and_evaluate_report(mpirun, tmp_path):
    res = mpirun(3, ["train", *FAST, "--epochs", "12", "--name", "conv"], timeout=180)
    assert res.returncode == 0, res.explain()
    attrs, _, _ = read_log(tmp_path / "runs" / "conv.h5")
    assert attrs["test_accuracy"] >= 0.93, res.explain()
    assert attrs["epochs_done"] >= 12
    log = str(tmp_path / "runs" / "conv.h5")
    for _ in range(2):  # a second evaluation replaces the rows of the first
        ev = subprocess.run([sys.executable, "-m", "mpiasgd", "evaluate", log], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
        assert ev.returncode == 0, ev.stderr
    _, t2, _ = read_log(log)
    snaps = t2["evals"][t2["evals"]["snapshot"] >= 0]
    assert snaps["snapshot"].tolist() == list(range(len(t2["snapshots/meta"])))
    assert (t2["evals"]["snapshot"] == -1).sum() == 1
    assert snaps["accuracy"][0] < 0.5 < snaps["accuracy"][-1]      # untrained vs trained weights
    assert snaps["accuracy"][-1] == pytest.approx(attrs["test_accuracy"], abs=1e-6)
    rep = subprocess.run([sys.executable, "-m", "mpiasgd", "report", log], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    assert "staleness" in rep.stdout and "compute" in rep.stdout and "snapshot" in rep.stdout


def test_log_readable_while_it_grows(tmp_path):
    """SWMR: a reader follows the log of a running job and sees the push table grow."""
    import time

    proc = start_mpi(3, ["train", *FAST, "--epochs", "0", "--max-time", "6", "--name", "live"], tmp_path)
    try:
        path, seen = tmp_path / "runs" / "live.h5", []
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if path.exists():
                try:
                    with open_log(str(path)) as f:
                        if f.attrs["status"] == "running":
                            seen.append(f["pushes"].shape[0])
                except OSError:
                    pass  # created but not yet in SWMR mode
            time.sleep(0.5)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        stop_group(proc)
    growing = [n for n in seen if n > 0]
    assert len(growing) >= 3 and growing == sorted(growing) and growing[-1] > growing[0], seen


def test_overwrite_refused_while_log_is_written(mpirun, tmp_path):
    # the busy run lasts until it is told to stop (SIGUSR1 through mpiexec), so however slowly the
    # second job starts on a loaded machine, it meets a log that is being written
    proc = start_mpi(3, ["train", *FAST, "--epochs", "0", "--max-time", "120", "--name", "busy"], tmp_path)
    try:
        wait_for_pushes(tmp_path / "runs" / "busy.h5", proc)
        res = mpirun(3, ["train", *FAST, "--name", "busy", "--overwrite"], timeout=60)
        assert proc.poll() is None, "the busy run ended before the second job was refused"
        assert res.returncode == 2 and "is being written by a running job" in res.stderr, res.explain()
        os.kill(proc.pid, signal.SIGUSR1)
        assert proc.wait(timeout=60) == EXIT_PREEMPTED, proc.stderr.read()
    finally:
        stop_group(proc)
    attrs, _, _ = read_log(tmp_path / "runs" / "busy.h5")
    assert attrs["status"] == "preempted"  # the refused job left the log alone
    assert not (tmp_path / "runs" / "busy.h5.lock").exists()


def test_killed_run_reported_and_recovered_by_evaluate(tmp_path):
    import signal
    import time

    proc = start_mpi(3, ["train", *FAST, "--epochs", "0", "--max-time", "60", "--name", "dead"], tmp_path)
    log = tmp_path / "runs" / "dead.h5"
    try:
        wait_for_pushes(log, proc)
        time.sleep(1.0)
        kill_session(proc.pid, signal.SIGKILL)  # every rank dies at once: no chance to close the log
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop_group(proc)
    rep = subprocess.run([sys.executable, "-m", "mpiasgd", "report", str(log)], capture_output=True, text=True,
                         timeout=60)
    assert rep.returncode == 0 and "status: killed" in rep.stdout, rep.stdout + rep.stderr
    ev = subprocess.run([sys.executable, "-m", "mpiasgd", "evaluate", str(log)], capture_output=True, text=True,
                        timeout=120)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    attrs, t, _ = read_log(log)
    assert attrs["status"] == "killed"
    assert len(t["evals"]) == len(t["snapshots/meta"]) >= 1 and len(t["pushes"]) > 0


def test_straggler_pushes_fewer_times(mpirun, tmp_path):
    res = mpirun(3, ["train", *FAST, "--batch-size", "64",
                     "--epochs", "0", "--max-time", "4", "--straggler", "2:4", "--name", "slow"], timeout=90)
    assert res.returncode == 0, res.explain()
    _, t, _ = read_log(tmp_path / "runs" / "slow.h5")
    p = t["pushes"]
    fast, slow = p[p["worker"] == 1], p[p["worker"] == 2]
    ratio = len(slow) / len(fast)
    assert 0.1 < ratio < 0.5, (len(fast), len(slow))               # ideal 1/4 of the pushes
    assert np.median(slow["compute_s"]) > 2.5 * np.median(fast["compute_s"])


def test_stop_by_wall_time(mpirun, tmp_path):
    res = mpirun(3, ["train", *FAST, "--epochs", "0", "--max-time", "2", "--name", "timed"], timeout=60)
    assert res.returncode == 0, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "timed.h5")
    assert attrs["stop_reason"].startswith("max_time")
    stops = [e["text"] for e in t["events"] if e["kind"] == b"stop"]
    assert len(stops) == 1 and stops[0].decode().startswith("max_time")
    assert 2.0 <= attrs["train_time_s"] < 10.0


def test_worker_exception_aborts_job_and_keeps_log(mpirun, tmp_path):
    res = mpirun(3, ["raise", "2", *FAST, "--epochs", "50", "--name", "crash"], timeout=60, script="fault.py")
    assert res.returncode != 0, res.explain()
    assert res.seconds < 30, res.explain()
    assert "injected failure" in res.stderr and "rank 2" in res.stderr, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "crash.h5")
    assert attrs["status"] == "failed"
    failed = [e for e in t["events"] if e["kind"] == b"failed"]
    assert failed and "injected failure" in failed[0]["text"].decode()
    assert len(t["pushes"]) >= 4   # the pushes made before the failure are in the log


def test_server_exception_aborts_job(mpirun, tmp_path):
    res = mpirun(3, ["server", "0", *FAST, "--epochs", "50", "--name", "scrash"], timeout=60, script="fault.py")
    assert res.returncode != 0 and res.seconds < 30, res.explain()
    assert "injected server failure" in res.stderr and "rank 0" in res.stderr, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "scrash.h5")
    assert attrs["status"] == "failed" and len(t["pushes"]) == 4


def test_non_finite_gradients_rejected_then_run_stops(mpirun, tmp_path):
    res = mpirun(3, ["nan", "2", *FAST, "--epochs", "50", "--max-rejects", "5", "--name", "nan"], timeout=60,
                 script="fault.py")
    assert res.returncode != 0 and res.seconds < 30, res.explain()
    assert "worker rank 2 pushed 5 non-finite gradients in a row" in res.stderr, res.explain()
    assert "Traceback" not in res.stderr, res.explain()  # one error line: the message says all
    attrs, t, _ = read_log(tmp_path / "runs" / "nan.h5")
    assert attrs["status"] == "failed"
    rejected = t["pushes"][t["pushes"]["rejected"] == 1]
    assert set(rejected["worker"].tolist()) == {2} and len(rejected) == 5 and not rejected["applied"].any()


@pytest.mark.parametrize("kind,expected", [("badtag", "unknown tag 99"), ("badsize", "bytes, expected")])
def test_malformed_message_aborts_with_clear_error(mpirun, kind, expected):
    res = mpirun(3, [kind, "1", *FAST, "--epochs", "50", "--name", kind], timeout=60, script="fault.py")
    assert res.returncode != 0 and res.seconds < 30, res.explain()
    assert expected in res.stderr and "from rank 1" in res.stderr, res.explain()


@pytest.mark.parametrize("args,expected", [
    (["--lr", "-1"], "config key 'lr' = -1.0: expected a finite number > 0"),
    (["--modle", "digits"], "unrecognized arguments: --modle"),
    (["--batch-size", "many"], "argument --batch-size: invalid int value"),
    (["--model", "cifar10", "--data-dir", "/nonexistent/cifar"], "/nonexistent/cifar"),
    (["--batch-size", "5000"], "(ranks 0, 1, 2): config key 'batch_size' = 5000: larger than the smallest"),
    (["--run-dir", "/proc/version"], "'run_dir' = '/proc/version': is a file"),
])
def test_bad_input_gives_one_error(mpirun, args, expected):
    res = mpirun(3, ["train", *FAST, *args], timeout=60)
    assert res.returncode == 2, res.explain()
    errors = [line for line in res.stderr.splitlines() if line.startswith("mpiasgd: error")]
    assert len(errors) == 1 and expected in errors[0], res.explain()
    assert "Traceback" not in res.stderr


def test_single_rank_is_refused(mpirun):
    res = mpirun(1, ["train", *FAST], timeout=60)
    assert res.returncode == 2 and "at least 2 MPI ranks" in res.stderr, res.explain()


def test_existing_log_not_overwritten(mpirun, tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "keep.h5").write_bytes(b"precious")
    res = mpirun(3, ["train", *FAST, "--name", "keep"], timeout=60)
    assert res.returncode == 2 and "exists" in res.stderr, res.explain()
    assert (tmp_path / "runs" / "keep.h5").read_bytes() == b"precious"


def test_backend_cupy_without_gpu_is_one_startup_error(mpirun):
    from mpiasgd.ops import cuda_device_count

    if cuda_device_count() > 0:
        pytest.skip("a CUDA device is visible: --backend cupy runs here (tests/gpu covers it)")
    res = mpirun(3, ["train", *FAST, "--backend", "cupy", "--name", "nogpu"], timeout=60)
    assert res.returncode == 2, res.explain()
    errors = [line for line in res.stderr.splitlines() if line.startswith("mpiasgd: error")]
    assert len(errors) == 1 and errors[0].startswith("mpiasgd: error (ranks 1, 2): --backend cupy:"), res.explain()
    assert "no usable CUDA device (" in errors[0] or "needs cupy" in errors[0], res.explain()
    assert "Traceback" not in res.stderr


def test_auto_backend_resolution_is_logged(mpirun, tmp_path):
    from mpiasgd.ops import cuda_device_count

    res = mpirun(2, ["train", *FAST, "--max-pushes", "5", "--epochs", "0", "--name", "auto", "--share-devices"],
                 timeout=60)
    assert res.returncode == 0, res.explain()
    _, t, _ = read_log(tmp_path / "runs" / "auto.h5")
    w = t["workers"][0]
    if cuda_device_count() == 0:
        assert (w["backend"], w["device"], w["device_name"], w["device_uuid"], w["transfer"]) == \
            (b"cpu", -1, b"", b"", b"host")
        assert "cpu (host) x1" in res.stdout
    else:
        assert w["backend"] == b"cupy" and w["device"] >= 0 and w["transfer"] in (b"pinned", b"device")
