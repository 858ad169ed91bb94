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


def test_watch_refuses_a_truncated_log_at_once_as_report_does(tmp_path):
    """A run log cut short (its superblock readable, the file shorter than it says) with no writer is refused at
    once with `report`'s message, not waited for as a log "with no HDF5 header yet" (issue 36)."""
    from mpiasgd.runlog import PushRow, RunLog

    path = tmp_path / "good.h5"
    log = RunLog.create(str(path), {"config": "{}"}, [], 3, flush_interval=60.0)
    for i in range(200):
        log.add(PushRow(**{**dict.fromkeys(PushRow.dtype.names, 0), "time": float(i), "worker": 1, "applied": 1,
                           "samples": 32, "loss": 2.0}))
    log.close("completed", {})
    size = path.stat().st_size
    cut = tmp_path / "trunc.h5"
    cut.write_bytes(path.read_bytes()[:size // 2])
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "mpiasgd", "watch", str(cut), "--wait", "30"], capture_output=True,
                         text=True, timeout=60)
    assert time.monotonic() - t0 < 20, res.stderr
    assert res.returncode == 2 and "waiting" not in res.stderr, res.stderr
    assert (f"mpiasgd watch: error: '{cut}' is truncated ({size // 2} bytes, the file says {size}): it was cut "
            "short") in res.stderr, res.stderr
    report = subprocess.run([sys.executable, "-m", "mpiasgd", "report", str(cut)], capture_output=True, text=True,
                            timeout=60)
    assert report.stderr.split("error: ", 1)[1] == res.stderr.split("error: ", 1)[1]


def test_the_curve_and_the_evaluation_line():
    """One bar per evaluation from the lowest level (smallest value) to the highest; equal values the middle
    level; the line carries top-1, top-5, loss, images, versions and the curve's range."""
    import numpy as np

    from mpiasgd.runlog import PERIODIC_EVAL_ROW
    from mpiasgd.tools.watch import ASCII_BARS, BARS, curve, eval_line

    assert curve([0.1, 0.5, 0.9]) == "▁▅█" and curve([0.5, 0.5]) == "▄▄"
    assert curve([0.2, 0.4], ASCII_BARS) == "_#" and len(curve(list(range(100)))) == 60
    row = np.zeros(1, PERIODIC_EVAL_ROW)[0]
    row["time"], row["epoch"], row["version_min"], row["version_max"] = 12.5, 0.5, 40, 42
    row["count"], row["loss"], row["top1"], row["top5"] = 360, 0.4567, 0.852, 0.991
    assert eval_line(row, [0.5, 0.852]) == (
        "    12.5 s  epoch    0.50  evaluation: top-1  85.20 %  top-5  99.10 %  loss 0.4567  (360 images, version "
        f"40..42)  top-1 curve {BARS[0]}{BARS[-1]} (50.0..85.2 %)")


def test_watch_prints_each_evaluation_during_training_of_an_ended_run(tmp_path):
    """A run that has ended (no live writer): its progress, a line per worker lost (ULFM), one line per evaluation
    with the curve so far, then the final line with top-5."""
    from mpiasgd.runlog import EventRow, PeriodicEvalRow, RunLog
    from mpiasgd.runlog.records import PushRow
    from mpiasgd.tools.watch import watch

    path = str(tmp_path / "w.h5")
    log = RunLog.create(path, {"config": "{}"}, [], 3, flush_interval=60.0)
    log.add(PushRow(**{**dict.fromkeys(PushRow.dtype.names, 0), "time": 1.0, "worker": 1, "applied": 1,
                       "samples": 32, "loss": 2.0}))
    log.add(EventRow(time=1.5, kind=b"worker_lost", text=b"worker rank 2 on vm died after step 9 (ULFM reported "
                                                         b"it): dropped, 1 worker goes on"))
    log.add(EventRow(time=1.6, kind=b"attach_refused", text=b"an attach from 10.0.0.7:5 refused: a wrong token"))
    log.add(EventRow(time=1.7, kind=b"worker_joined", text=b"worker rank 2 is back: a replacement on vm (pid 7)"))
    log.add(EventRow(time=1.8, kind=b"checkpoint", text=b"not said"))
    for t, top1 in ((1.0, 0.5), (2.0, 0.7)):
        log.add(PeriodicEvalRow(time=t, samples=32, epoch=t, version_min=1, version_max=1, count=360, loss=1.0,
                                top1=top1, top5=0.9, seconds=0.1, snapshot=-1))
    log.close("completed", {"test_accuracy": 0.75, "test_top5": 0.95})
    lines = []
    assert watch(path, interval=0.01, wait=1.0, out=lines.append) == 0
    assert len(lines) == 7 and "pushes" in lines[0]
    assert lines[1] == "worker lost at 1.5 s: worker rank 2 on vm died after step 9 (ULFM reported it): dropped, 1 " \
                       "worker goes on"
    assert lines[2] == "attach refused at 1.6 s: an attach from 10.0.0.7:5 refused: a wrong token"
    assert lines[3] == "worker back at 1.7 s: worker rank 2 is back: a replacement on vm (pid 7)"
    assert "top-1  50.00 %" in lines[4] and lines[4].endswith("top-1 curve ▄ (50.0..50.0 %)")
    assert "top-1  70.00 %" in lines[5] and lines[5].endswith("top-1 curve ▁█ (50.0..70.0 %)")
    assert lines[6] == "run ended: status completed, test accuracy 75.00 % (top-5 95.00 %); 1 worker lost (1 replaced)"


def test_watch_leaves_out_the_pushes_a_resume_superseded(tmp_path):
    """A resumed run's log: the pushes a segment logged after its checkpoint and then died are not counted (as
    `report` leaves them out); the resumed segment's are."""
    import json

    from mpiasgd.runlog import RunLog
    from mpiasgd.runlog.records import PushRow
    from mpiasgd.tools.watch import watch

    path = str(tmp_path / "r.h5")
    log = RunLog.create(path, {"config": "{}"}, [], 3, flush_interval=60.0)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):  # 3.0 and 4.0: after the checkpoint at 2.5, then the job died
        log.add(PushRow(**{**dict.fromkeys(PushRow.dtype.names, 0), "time": t, "worker": 1, "applied": 1,
                           "samples": 32, "loss": 2.0}))
    log.file.attrs["superseded"] = json.dumps([[2.5, 4.0]])
    log.close("completed")
    lines = []
    assert watch(path, interval=0.01, wait=1.0, out=lines.append) == 0
    assert "pushes         3" in lines[0] and lines[0].startswith("     5.0 s")
