"""A disk that fills up under `mpiexec`: the failure injected on rank 0 (tests/mpi/scripts/fault.py), and
end-to-end runs on a real 3 MB tmpfs, mounted for the test when this process may mount one (root),
else skipped with the reason. The in-process checks are in tests/unit/test_disk_full.py.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from kit.runs import FAST, read_log

from mpiasgd import checkpoint

# --- multi-rank, failure injected on rank 0 -----------------------------------------------------------

def errors(stderr: str) -> list[str]:
    """The product's error lines (Open MPI's abort banner may come first: its forwarding can add a space)."""
    return [line.strip() for line in stderr.splitlines() if line.strip().startswith("mpiasgd: error")]


@pytest.mark.parametrize("kind", ["logfull", "diskfull"])
def test_full_disk_while_flushing_ends_the_job_in_one_line(mpirun, tmp_path, kind):
    """logfull: rank 0's log flushes fail from the 30th dataset flush on, its checkpoint still fits;
    diskfull: the checkpoint fails too."""
    res = mpirun(3, [kind, "0", *FAST, "--epochs", "0", "--max-time", "60", "--name", "full"], timeout=60,
                 script="fault.py")
    assert res.returncode != 0 and res.seconds < 30, res.explain()
    assert errors(res.stderr) == ["mpiasgd: error: rank 0: run log 'runs/full.h5' cannot be written: [Errno 28] "
                                  "No space left on device; the log is closed with status 'failed', readable up "
                                  "to its last flush"], res.explain()
    assert "Traceback" not in res.stderr and "h5py" not in res.stderr, res.explain()
    if kind == "logfull":
        assert ("mpiasgd: checkpoint 'runs/full.ckpt.h5' written (version " in res.stderr
                and "continue with --resume runs/full.ckpt.h5" in res.stderr), res.explain()
        assert checkpoint.load(str(tmp_path / "runs" / "full.ckpt.h5")).reason == "failure"
    else:
        assert ("mpiasgd: warning: checkpoint 'runs/full.ckpt.h5' not written ([Errno 28] No space left on "
                "device)") in res.stderr, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "full.h5")
    assert attrs["status"] == "failed" and len(t["pushes"]) > 0
    assert not (tmp_path / "runs" / "full.h5.lock").exists()


def test_log_that_cannot_be_created_ends_the_job_in_one_line(mpirun, tmp_path):
    res = mpirun(3, ["nocreate", "0", *FAST, "--name", "nc"], timeout=60, script="fault.py")
    assert res.returncode != 0 and res.seconds < 30, res.explain()
    assert errors(res.stderr) == ["mpiasgd: error: rank 0: run log 'runs/nc.h5' cannot be created: [Errno 28] No "
                                  "space left on device"], res.explain()
    assert "Traceback" not in res.stderr, res.explain()
    assert os.listdir(tmp_path / "runs") == []  # neither the log nor its lock file


def test_log_fills_a_real_tmpfs(mpirun, small_disk, tiny_cifar):
    """cifar10 weights (0.34 MB) snapshotted every 0.2 s fill 3 MB within seconds."""
    root, _ = tiny_cifar
    res = mpirun(3, ["train", "--model", "cifar10", "--data-dir", str(root), "--batch-size", "8", "--epochs", "0",
                     "--max-time", "60", "--snapshot-interval", "0.2", "--flush-interval", "0.2", "--no-progress",
                     "--run-dir", str(small_disk), "--name", "x"], timeout=90)
    assert res.returncode != 0 and res.seconds < 60, res.explain()
    path = small_disk / "x.h5"
    assert len(errors(res.stderr)) == 1, res.explain()
    # (the free-space check before a flush says what it found: "... device (for this write: ...); ")
    assert errors(res.stderr)[0].startswith(f"mpiasgd: error: rank 0: run log '{path}' cannot be written: [Errno 28] "
                                            "No space left on device"), res.explain()
    assert "; the log is closed with status 'failed'" in errors(res.stderr)[0], res.explain()
    assert f"checkpoint '{small_disk / 'x.ckpt.h5'}'" in res.stderr, res.explain()  # written, or says why not
    assert "Traceback" not in res.stderr, res.explain()
    assert not (small_disk / "x.h5.lock").exists()
    attrs, t, params = read_log(path)  # readable up to its last flush, whatever its status
    assert attrs["status"] in ("failed", "running") and len(t["pushes"]) > 0
    assert len(params) == len(t["snapshots/meta"]) >= 1 and np.isfinite(params).all()
    if "closed with status 'failed'" in errors(res.stderr)[0]:
        assert attrs["status"] == "failed"


def test_start_on_a_full_tmpfs_names_the_lock_file_and_leaves_none(mpirun, small_disk):
    subprocess.run(["dd", "if=/dev/zero", f"of={small_disk / 'filler'}", "bs=64k"], capture_output=True)
    res = mpirun(3, ["train", *FAST, "--run-dir", str(small_disk), "--name", "y"], timeout=60)
    assert res.returncode == 2, res.explain()
    lock = small_disk / "y.h5.lock"
    assert errors(res.stderr) == [f"mpiasgd: error (rank 0): cannot write the lock file '{lock}' of run log "
                                  f"'{small_disk / 'y.h5'}': [Errno 28] No space left on device"], res.explain()
    assert sorted(os.listdir(small_disk)) == ["filler"]
