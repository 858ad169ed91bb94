"""Divergence and dead-network detection (mpiasgd.health) in real runs: a step size far too large in
every mode, and too many asynchronous workers, under `mpiexec`. The rules: tests/unit/test_health.py.
"""

from __future__ import annotations

import pytest
from kit.runs import FAST, read_log

from mpiasgd.cli import main


@pytest.mark.parametrize("mode", ["async", "sync", "pipeline"])
def test_a_run_with_a_far_too_large_step_stops_with_status_diverged(mpirun, tmp_path, mode, capsys):
    """--lr 3 on digits: the network dies; --on-divergence stop ends the run there in every mode (the workers
    evaluate the final weights), exit status 3, status 'diverged', and report says why. In sync and pipeline
    modes (one push order) the loss first spikes; in async mode the order of pushes decides whether it spikes
    past the rule's bound before it dies (1 run in about 30 on CI did not), so a spike, if any, comes first."""
    name = f"div-{mode}"
    res = mpirun(3, ["train", *FAST, "--mode", mode, "--lr", "3", "--epochs", "12", "--on-divergence", "stop",
                     "--name", name], timeout=120)
    assert res.returncode == 3, res.explain()
    spiked = "mpiasgd: warning: training loss spiked to" in res.stderr
    assert spiked or mode == "async", res.explain()
    assert "mpiasgd: error: run stopped (--on-divergence stop): the network looks dead" in res.stderr, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / f"{name}.h5")
    kinds = [e["kind"].decode() for e in t["events"]]
    assert attrs["status"] == "diverged" and attrs["diverged"].startswith("the network looks dead"), attrs
    assert ("diverged" in kinds) == spiked, kinds
    assert (not spiked or kinds.index("diverged") < kinds.index("dead")) and kinds.index("dead") < kinds.index("stop")
    assert kinds[-1] == "end", kinds
    assert float(attrs["epochs_done"]) < 11 and int(attrs["test_count"]) == 360  # stopped early, evaluated
    assert main(["report", str(tmp_path / "runs" / f"{name}.h5")]) == 0
    out = capsys.readouterr().out
    assert "(status: diverged)" in out and "stopped by       --on-divergence stop: the network looks dead" in out


def test_a_dead_async_run_is_warned_about_and_reported(mpirun, tmp_path, capsys):
    """The defect as found: 8 async workers at --lr 0.1 with A-SGD's update kill the digits network (the default
    update for 8 workers, DANA-GA, learns there: 94 %); the run completes at chance accuracy, and now the log,
    stderr and report say it is dead (default --on-divergence warn)."""
    res = mpirun(9, ["train", "--model", "digits", "--epochs", "6", "--lr", "0.1", "--update-rule", "sgd",
                     "--no-progress", "--name", "dead"], timeout=180)
    assert res.returncode == 0, res.explain()
    assert "mpiasgd: warning: the network looks dead from epoch" in res.stderr, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "dead.h5")
    assert attrs["status"] == "completed" and attrs["test_accuracy"] < 0.2
    assert attrs["health"].startswith("dead from epoch") and b"dead" in t["events"]["kind"].tolist()
    assert main(["report", str(tmp_path / "runs" / "dead.h5")]) == 0
    assert "health           dead from epoch" in capsys.readouterr().out
