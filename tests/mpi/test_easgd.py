"""Elastic averaging SGD (`--mode easgd`, Zhang et al. 2015): a whole run under `mpiexec` (log,
checkpoint, resume). The exchanges against hand computations are in tests/unit/test_easgd.py.
"""

from __future__ import annotations

from kit.runs import FAST, read_log


def test_easgd_run_logs_checkpoints_and_resumes(mpirun, tmp_path):
    """A whole run: pushes with staleness, snapshots of the center, an end checkpoint; a resume trains on
    from it and continues the versions."""
    res = mpirun(3, ["train", *FAST, "--mode", "easgd", "--easgd-tau", "2", "--lr", "0.05", "--epochs", "3",
                     "--name", "e"], timeout=120)
    assert res.returncode == 0, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "e.h5")
    assert attrs["status"] == "completed" and attrs["mode"] == "easgd" and attrs["test_accuracy"] > 0.8
    p = t["pushes"]
    assert p["staleness"].max() >= 1 and p["samples"].max() == 2 * 16 and len(t["snapshots/meta"]) >= 2
    first_version = int(attrs["version"])
    res = mpirun(3, ["train", "--resume", "runs/e.ckpt.h5", "--epochs", "5", "--no-progress"], timeout=120)
    assert res.returncode == 0, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "e.h5")
    assert attrs["status"] == "completed" and int(attrs["version"]) > first_version
    assert [e for e in t["events"]["kind"] if e == b"resume"] == [b"resume"]
    assert attrs["epochs_done"] >= 5
