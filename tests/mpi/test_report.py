"""`mpiasgd report` on a real run: one short digits run under `mpiexec`, its snapshots evaluated; the
table agrees with what the server recorded. The table on crafted logs: tests/unit/test_report.py.
"""

from __future__ import annotations

import csv
import io
import subprocess
import sys

import numpy as np
import pytest

from mpiasgd.runlog import open_log
from mpiasgd.tools.report import report


def test_real_run_compared(mpirun, tmp_path):
    """A short digits run, its snapshots evaluated: the table agrees with what the server recorded."""
    from mpiasgd.tools.evaluate import evaluate_snapshots

    res = mpirun(3, ["train", "--model", "digits", "--epochs", "3", "--batch-size", "32", "--lr", "0.05",
                     "--snapshot-interval", "0.05", "--no-progress", "--name", "real"], timeout=120)
    assert res.returncode == 0, res.explain()
    path = str(tmp_path / "runs" / "real.h5")
    evals = evaluate_snapshots(path)
    with open_log(path) as f:
        attrs, meta = dict(f.attrs), f["snapshots/meta"][()]
    first = int(np.flatnonzero(evals["accuracy"] >= 0.5)[0])
    rows = list(csv.DictReader(io.StringIO(report([path, path], 0.5, "csv"))))
    assert rows[0] == rows[1]
    assert float(rows[0]["time_to_target_s"]) == pytest.approx(meta["time"][evals["snapshot"][first]], abs=0.005)
    assert float(rows[0]["images_per_s"]) == pytest.approx(attrs["images_per_s"], abs=0.05)
    assert float(rows[0]["staleness_mean"]) == pytest.approx(attrs["staleness_mean"], abs=5e-4)
    assert float(rows[0]["test_accuracy"]) == pytest.approx(attrs["test_accuracy"], abs=5e-5)
    assert rows[0]["mode"] == "async" and rows[0]["workers"] == "2"
    out = subprocess.run([sys.executable, "-m", "mpiasgd", "report", path, path, "--target-accuracy", "0.5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "== comparison of 2 runs" in out.stdout, out.stderr
