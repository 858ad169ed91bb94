"""`mpiasgd watch` on files that are not a run log (yet): refused at once, or waited for and refused.
Following a live job, `trace` and `report --plots` of real runs: tests/mpi/test_watch.py.
"""

from __future__ import annotations

import subprocess
import sys
import time


def test_watch_refuses_a_file_that_is_not_a_run_log(tmp_path):
    bad = tmp_path / "x.h5"
    import h5py

    with h5py.File(bad, "w", libver="latest") as f:
        f["data"] = [1, 2, 3]
    res = subprocess.run([sys.executable, "-m", "mpiasgd", "watch", str(bad), "--wait", "1"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "is not an mpiasgd run log" in res.stderr, res.stderr


def test_watch_refuses_a_file_that_is_not_hdf5_at_once_and_says_it_waits_for_a_missing_one(tmp_path):
    """An existing file that is not HDF5 is refused at once, not after --wait seconds of silence
    (helper-23); a missing log is waited for, and the wait is said."""
    text = tmp_path / "notes.txt"
    text.write_text("not a log\n" * 10)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "mpiasgd", "watch", str(text), "--wait", "30"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "is not an mpiasgd run log (not an HDF5 file)" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 20
    res = subprocess.run([sys.executable, "-m", "mpiasgd", "watch", str(tmp_path / "later.h5"), "--wait", "1"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "waiting up to 1 s for run log" in res.stderr and "did not appear within 1 s" in res.stderr


def test_watch_says_an_empty_file_is_empty_and_refuses_a_directory(tmp_path):
    """A 0-byte log (a job creating it, or not a log at all) is waited for as empty, then refused as not a
    run log, not as "did not appear"; a directory is refused at once, naming what was expected."""
    empty = tmp_path / "empty.h5"
    empty.write_bytes(b"")
    res = subprocess.run([sys.executable, "-m", "mpiasgd", "watch", str(empty), "--wait", "1"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "to be written (it has no HDF5 header yet)" in res.stderr and "did not appear" not in res.stderr, res.stderr
    assert f"'{empty}' stayed without an HDF5 header for 1 s (size 0 bytes): not an mpiasgd run log" in res.stderr
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "mpiasgd", "watch", str(tmp_path), "--wait", "30"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and time.monotonic() - t0 < 20
    assert f"'{tmp_path}' is a directory, expected a run log file" in res.stderr, res.stderr
