"""Evaluation during training (--eval-interval 0.5ep) under `mpiexec`, one job per mode, each under a timeout:
the log has an evaluation row per half epoch (the whole test set, top-5 >= top-1), `watch` prints them with
the curve, `report --plots` draws them; sync's last one equals evaluating the snapshot of its step, and
--tensorboard writes the same figures as event files (tests/unit/test_evals.py: the pieces in-process).
"""

from __future__ import annotations

import numpy as np
import pytest
from kit.runs import FAST, read_log
from kit.tensorboard import scalars

from mpiasgd.model import build_model, evaluate

TEST_IMAGES = 360  # digits' test split


def check_evaluations(rows, epochs: float = 2.0, every: float = 0.5) -> None:
    """At least 2 rows, increasing images trained on, the whole test set each, accuracies in [0, 1], top-5 >= top-1;
    none past the end (the final evaluation is that one)."""
    assert len(rows) >= 2, rows
    assert (np.diff(rows["samples"]) > 0).all() and (np.diff(rows["time"]) > 0).all(), rows
    assert (rows["count"] == TEST_IMAGES).all(), rows
    assert ((0 <= rows["top1"]) & (rows["top1"] <= rows["top5"]) & (rows["top5"] <= 1)).all(), rows
    assert (rows["epoch"] >= every - 1e-6).all() and (rows["epoch"] < epochs).all(), rows
    assert np.isfinite(rows["loss"]).all() and (rows["version_min"] <= rows["version_max"]).all()


@pytest.mark.parametrize("mode", ["async", "easgd", "pipeline"])
def test_evaluations_during_training_are_logged(mpirun, tmp_path, mode):
    flags = ["--mode", mode] + (["--modules", "2"] if mode == "pipeline" else [])
    res = mpirun(3, ["train", *FAST, *flags, "--epochs", "2", "--eval-interval", "0.5ep", "--name", mode],
                 timeout=150)
    assert res.returncode == 0, res.explain()
    assert "mpiasgd: evaluation at epoch" in res.stdout, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / f"{mode}.h5")
    assert attrs["status"] == "completed"
    rows = t["periodic_evals"]
    check_evaluations(rows)
    if mode == "pipeline":  # rank 0 evaluated the snapshot it assembled: the row names it
        assert (rows["snapshot"] >= 0).all() and (rows["version_min"] == rows["version_max"]).all()
    final = t["evals"][-1]
    assert final["snapshot"] == -1 and final["count"] == TEST_IMAGES and final["accuracy"] <= final["top5"] <= 1
    assert 0 <= attrs["test_accuracy"] <= attrs["test_top5"] <= 1


def test_sync_evaluations_match_their_snapshots_and_show_in_watch_report_plots_and_tensorboard(
        mpirun, tmp_path, digits):
    """sync, 2 workers, 2 epochs, --eval-interval 0.5ep, --tensorboard: the last evaluation during training is
    that of the snapshot of the same step (evaluated here by hand); `watch` of the ended run prints one line per
    evaluation with its curve, `report` lists them, `report --plots` draws them; the event files hold the
    evaluations at the same images trained on."""
    res = mpirun(3, ["train", *FAST, "--mode", "sync", "--epochs", "2", "--eval-interval", "0.5ep", "--tensorboard",
                     "--name", "sync"], timeout=150)
    assert res.returncode == 0, res.explain()
    path = tmp_path / "runs" / "sync.h5"
    attrs, t, snapshots = read_log(path)
    rows = t["periodic_evals"]
    check_evaluations(rows)
    assert (rows["version_min"] == rows["version_max"]).all() and (rows["snapshot"] >= 0).all()
    last = rows[-1]
    assert t["snapshots/meta"]["version"][last["snapshot"]] == last["version_min"]
    model = build_model("digits")
    weights = snapshots[last["snapshot"]].copy()
    model.bind(weights, np.zeros_like(weights))
    loss_sum, correct, count, correct5 = evaluate(model, digits, np.arange(TEST_IMAGES, dtype=np.int64), 256)
    # the same weights and images; BLAS may sum in another order here than on the workers: one image at most
    assert abs(last["top1"] * count - correct) <= 1 and abs(last["top5"] * count - correct5) <= 1
    assert last["loss"] == pytest.approx(loss_sum / count, rel=1e-4)

    from mpiasgd.runlog import load
    from mpiasgd.tools.plots import plot_runs
    from mpiasgd.tools.report import report
    from mpiasgd.tools.watch import watch

    lines = []
    assert watch(str(path), interval=0.01, wait=5.0, out=lines.append) == 0
    shown = [line for line in lines if "evaluation: top-1" in line]
    assert len(shown) == len(rows) and "top-1 curve" in shown[-1]
    assert f"{100 * last['top1']:6.2f} %" in shown[-1]
    assert "evaluations during training (--eval-interval):" in report([str(path)])
    assert plot_runs([load(str(path))], str(tmp_path / "plots"))
    tb = scalars(tmp_path / "runs" / "sync.tb")
    assert [step for step, _ in tb["eval/top1"]] == rows["samples"].tolist()
    np.testing.assert_allclose([v for _, v in tb["eval/top5"]], rows["top5"], rtol=1e-6)
    assert len(tb["train/loss"]) >= 1 and tb["test/top1"][0][1] == pytest.approx(attrs["test_accuracy"], rel=1e-6)


def test_a_long_evaluation_neither_stalls_the_run_nor_holds_the_other_worker(mpirun, tmp_path):
    """Worker 2's evaluations take 6 s each (twice --comm-timeout): its ALIVE messages keep rank 0's stall watch
    quiet, and worker 1 keeps pushing meanwhile (async workers never wait on each other)."""
    res = mpirun(3, ["longeval", "2", *FAST, "--epochs", "0", "--max-time", "4", "--eval-interval", "0.5ep",
                     "--comm-timeout", "3", "--stall-warning", "0", "--name", "long"], timeout=150, script="fault.py")
    assert res.returncode == 0, res.explain()
    assert "has sent nothing" not in res.stderr, res.explain()
    _, t, _ = read_log(tmp_path / "runs" / "long.h5")
    (row,) = t["periodic_evals"]
    assert row["seconds"] >= 6 and row["count"] == TEST_IMAGES
    p = t["pushes"]
    during = p[(p["time"] > row["time"] + 1) & (p["time"] < row["time"] + 3)]  # (the run stops at 4 s)
    assert (during["worker"] == 1).sum() > 0 and (during["worker"] == 2).sum() == 0, during


def test_a_signal_during_an_evaluation_abandons_it_and_ends_the_run(tmp_path):
    """Worker 2's evaluations take 6 s (12 batches of 0.5 s); SIGUSR1 reaches it during the first one: it
    abandons it at its next batch, the evaluation is not logged (an event says why), and the run ends
    preempted (exit 75) well before that evaluation would have ended."""
    import os
    import signal
    import subprocess
    import time

    from kit.launch import SCRIPTS, mpi_command, mpi_env, stop_group

    runs = tmp_path / "runs"
    cmd = mpi_command(3, (str(SCRIPTS / "fault.py"),), ["longeval", "2", *FAST, "--epochs", "50", "--eval-interval",
                                                        "0.5ep", "--name", "sig"])
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline, epoch, t = time.monotonic() + 60, 0.0, None
        while epoch < 0.7 and time.monotonic() < deadline and proc.poll() is None:  # worker 1 trains on meanwhile
            time.sleep(0.1)
            try:
                _, t, _ = read_log(runs / "sig.h5")
            except (OSError, KeyError):
                continue
            epoch = float(t["updates"]["epoch"][-1]) if len(t["updates"]) else 0.0
        assert epoch >= 0.7, f"the run did not reach epoch 0.7 within 60 s (exit {proc.poll()})"
        pid = int(t["workers"]["pid"][t["workers"]["rank"] == 2][0])
        os.kill(pid, signal.SIGUSR1)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        stop_group(proc)
    assert proc.returncode == 75 and seconds < 5, (proc.returncode, seconds, err)
    attrs, t, _ = read_log(runs / "sig.h5")
    assert attrs["status"] == "preempted" and len(t["periodic_evals"]) == 0
    texts = [e["text"].decode() for e in t["events"] if e["kind"] == b"evaluation"]
    # (the next one may have been asked for before rank 0 heard of the signal: the STOPs then withdraw it)
    assert texts[0] == "evaluation 1 during training not logged: worker rank 2 abandoned it (a signal, or the run " \
                       "ended)", texts
    assert all(" during training not logged: " in text for text in texts[1:]), texts


def test_tensorboard_without_tensorboardx_is_a_start_up_error(mpirun, tmp_path):
    """--tensorboard where tensorboardX cannot be imported: one error line naming the extra to install, exit
    status 2, no run log left behind."""
    from kit import REPO

    fake = tmp_path / "hide"
    (fake / "tensorboardX").mkdir(parents=True)
    (fake / "tensorboardX" / "__init__.py").write_text("raise ImportError('No module named tensorboardX')\n")
    res = mpirun(3, ["train", *FAST, "--epochs", "1", "--tensorboard", "--name", "tb"], timeout=90,
                 env={"PYTHONPATH": f"{fake}:{REPO}"})
    assert res.returncode == 2, res.explain()
    assert "mpiasgd: error: --tensorboard needs the tensorboardX package" in res.stderr, res.explain()
    assert 'pip install -e ".[tensorboard]"' in res.stderr and "Traceback" not in res.stderr, res.explain()
    assert not (tmp_path / "runs" / "tb.h5").exists() and not (tmp_path / "runs" / "tb.h5.lock").exists()
