"""`RunLog.end_early`: a run that begins to end on a signal closes its log first (status, lock released).

Open MPI's mpiexec, sent SIGTERM, SIGKILLs every rank 0.25 s after the SIGTERM it passes on; rank 0 closes
its log before the checkpoint, so a kill from then on leaves a clean file with status "preempted" and no
lock file. Rows logged afterwards are written in short re-openings (`flush`, `close`) under the lock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from mpiasgd.launch.startup import left_behind
from mpiasgd.runlog import (
    PIECE,
    EventRow,
    RunLog,
    RunLogError,
    SnapshotRow,
    WriterLock,
    open_log,
    superblock_flags,
    writer_alive,
)


def row(t: float) -> EventRow:
    """A row of the log (an event at time `t`)."""
    return EventRow(time=t, kind=b"note", text=f"row at {t}")


def started(path: str, num_params: int = 4) -> RunLog:
    lock = WriterLock(path)
    lock.acquire()
    log = RunLog.create(path, {"config": "{}", "mode": "async"}, [], num_params, flush_interval=60, lock=lock)
    log.add(row(1.0))
    return log


def attrs_and_rows(path: str) -> tuple[dict, int]:
    """The log's attributes and its number of rows (events)."""
    with open_log(path) as f:
        return dict(f.attrs), f["events"].shape[0]


def killed_child(code: str, path: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `code` (argv: the log's path, this folder) in a child that must end by SIGKILL, leaving the log at
    `path` closed 'preempted' with one row, a clean superblock and no lock file."""
    res = subprocess.run([sys.executable, "-c", code, path, os.path.dirname(__file__)], capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == -signal.SIGKILL, res.stdout + res.stderr
    attrs, rows = attrs_and_rows(path)
    assert attrs["status"] == "preempted" and rows == 1 and superblock_flags(path) == 0
    assert not os.path.exists(path + ".lock")
    return res


def test_end_early_closes_the_file_with_its_status_and_releases_the_lock(tmp_path):
    path = str(tmp_path / "run.h5")
    log = started(path)
    log.end_early("preempted")
    attrs, rows = attrs_and_rows(path)
    assert attrs["status"] == "preempted" and rows == 1  # the rows before it are in the file
    assert superblock_flags(path) == 0 and not os.path.exists(path + ".lock") and not writer_alive(path)
    log.end_early("failed")  # a second time: nothing
    log.add(row(2.0))
    log.maybe_flush()  # nothing either: the rows wait for an explicit flush
    assert attrs_and_rows(path)[1] == 1
    log.flush()  # one short opening under the lock, released after
    assert attrs_and_rows(path)[1] == 2 and not os.path.exists(path + ".lock")
    assert log.rows("snapshots/meta") == 0
    log.add_snapshot(SnapshotRow(time=3.0, version=1, samples=16, epoch=0.0), np.zeros(4, np.float32))
    assert log.rows("snapshots/meta") == 1
    log.add(row(3.0))
    log.close("preempted", {"version": 7})
    attrs, rows = attrs_and_rows(path)
    assert (attrs["status"], attrs["version"], rows) == ("preempted", 7, 3)
    with open_log(path) as f:
        assert f["snapshots/params"].shape == (1, 4)
    assert superblock_flags(path) == 0 and not os.path.exists(path + ".lock")


def test_a_writer_killed_after_end_early_leaves_a_clean_preempted_log_and_no_lock(tmp_path):
    path = str(tmp_path / "run.h5")
    code = ("import os, signal, sys\n"
            "sys.path.insert(0, sys.argv[2])\n"
            "from test_runlog_end_early import row, started\n"
            "log = started(sys.argv[1])\n"
            "log.end_early('preempted')\n"
            "log.add(row(2.0))  # a row after it: lost with the process\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    killed_child(code, path, timeout=60)
    lock = WriterLock(path)  # the next job: nothing to say about what this one left, and it continues the log
    lock.acquire()
    assert left_behind(path, lock) == "" and lock.dead_pid == 0
    log = RunLog.reopen(path, [], 60, lock)
    log.close("completed")
    assert attrs_and_rows(path)[0]["status"] == "completed"


def test_a_job_that_took_the_lock_after_end_early_keeps_the_log(tmp_path):
    path = str(tmp_path / "run.h5")
    log = started(path)
    log.end_early("preempted")
    other = WriterLock(path)  # another job of that name started meanwhile
    other.acquire()
    log.add(row(2.0))
    with pytest.raises(RunLogError, match=r"^run log '.*run\.h5' cannot be reopened: run log '.*' is being written "
                                          r"by a running job"):
        log.close("preempted")
    assert "stays closed with status 'preempted'" in log.outcome and log.taken_over
    assert writer_alive(path) and attrs_and_rows(path)[1] == 1  # its lock and the file are untouched
    log.close("preempted")  # a broken log: nothing more
    assert log.abandon() == log.outcome and writer_alive(path)
    other.release()


def test_rows_after_end_early_wait_for_its_hold(tmp_path):
    """`hold`: the seconds in which a launcher's kill is expected (signals.KILL_WINDOW); the file is not opened
    again before they have passed: `flush` keeps the rows, `close` waits."""
    path = str(tmp_path / "run.h5")
    log = started(path)
    start = time.monotonic()
    log.end_early("preempted", hold=0.5)
    log.add(row(2.0))
    log.flush()
    assert attrs_and_rows(path)[1] == 1 and not os.path.exists(path + ".lock")
    log.close("preempted", {"version": 3})
    assert time.monotonic() - start >= 0.5
    attrs, rows = attrs_and_rows(path)
    assert (attrs["status"], attrs["version"], rows) == ("preempted", 3, 2) and not os.path.exists(path + ".lock")


def test_a_signal_closes_the_log_while_the_main_thread_is_inside_one_long_c_call(tmp_path):
    """Python runs a signal handler between two bytecodes only; the launcher's SIGKILL (Open MPI's mpiexec: 0.25 s
    after the SIGTERM it passes on) may come before a long NumPy call returns. `signals.watching` closes the log
    from the signal thread at once; the process is then killed before the call ends, as the launcher would."""
    path = str(tmp_path / "run.h5")
    code = ("import os, signal, sys, threading, time\n"
            "import numpy as np\n"
            "sys.path.insert(0, sys.argv[2])\n"
            "from mpiasgd import signals\n"
            "from test_runlog_end_early import started\n"
            "signals.install()\n"
            "log = started(sys.argv[1])\n"
            "y = np.random.default_rng(0).random(40_000_000)\n"
            "closed = []\n"
            "def on_signal(name):\n"
            "    log.end_early('preempted')\n"
            "    closed.append(time.monotonic())\n"
            "    print(f'closed {closed[0] - t0:.3f} s after the call began, on {name}', flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)  # the launcher's kill, before the call returns\n"
            "threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
            "with signals.watching(on_signal):\n"
            "    t0 = time.monotonic()\n"
            "    y.sort(kind='quicksort')  # one C call of seconds (the GIL released)\n"
            "print(f'the call returned after {time.monotonic() - t0:.3f} s', flush=True)\n")
    res = killed_child(code, path, timeout=120)
    assert "closed" in res.stdout and "returned" not in res.stdout, res.stdout
    assert "rank" not in res.stderr  # (no rank set: no worker's line)


class SetAfter:
    """A stand-in for `RunLog.hurry` that reads as set from its `n`-th check on (another thread ending the log
    while a snapshot is being written), counting the checks."""

    def __init__(self, n: int) -> None:
        self.n, self.checks = n, 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks > self.n


def test_end_early_leaves_the_buffered_snapshots_for_later_and_writes_them_at_close(tmp_path):
    path = str(tmp_path / "run.h5")
    log = started(path, num_params=PIECE + 7)
    weights = np.arange(PIECE + 7, dtype=np.float32)
    log.add_snapshot(SnapshotRow(time=1.5, version=3, samples=48, epoch=0.1), weights)
    log.end_early("preempted")
    attrs, rows = attrs_and_rows(path)
    assert attrs["status"] == "preempted" and rows == 1  # the event, not the snapshot: it waits
    with open_log(path) as f:
        assert f["snapshots/meta"].shape[0] == 0 and f["snapshots/params"].shape == (0, PIECE + 7)
        assert f["snapshots/params"].chunks == (1, PIECE)  # written a chunk at a time
    assert log.rows("snapshots/meta") == 1
    log.close("preempted")
    with open_log(path) as f:
        assert f["snapshots/meta"][0]["version"] == 3
        np.testing.assert_array_equal(f["snapshots/params"][0], weights)


def test_a_snapshot_write_stops_at_its_next_chunk_when_another_thread_ends_the_log(tmp_path):
    """`RunLog.ending_now` sets `hurry`: the snapshot under way is cut back to the rows before it (its meta row
    not written either), the other rows are written, and the snapshot waits for the next flush."""
    path = str(tmp_path / "run.h5")
    log = started(path, num_params=3 * PIECE)
    first, second = (np.full(3 * PIECE, v, dtype=np.float32) for v in (1.0, 2.0))
    log.add_snapshot(SnapshotRow(time=1.0, version=1, samples=16, epoch=0.0), first)
    log.flush()
    log.add_snapshot(SnapshotRow(time=2.0, version=2, samples=32, epoch=0.0), second)
    log.add(row(2.5))
    log.hurry = SetAfter(2)  # two chunks of three written, then the other thread wants the log
    log.flush()
    assert log.hurry.checks == 3
    with open_log(path) as f:
        assert f["snapshots/meta"].shape[0] == 1 and f["snapshots/params"].shape[0] == 1
        assert f["events"].shape[0] == 2  # the event added with it is written
        np.testing.assert_array_equal(f["snapshots/params"][0], first)
    assert log.rows("snapshots/meta") == 2
    log.hurry = threading.Event()  # the other thread is done
    log.flush()
    with open_log(path) as f:
        assert [int(v) for v in f["snapshots/meta"]["version"]] == [1, 2]
        np.testing.assert_array_equal(f["snapshots/params"][1], second)
    log.close("completed")


def test_the_early_close_on_a_launchers_sigterm_names_the_worker_that_died(tmp_path, monkeypatch):
    """A launcher SIGTERMs the other ranks when one dies, and SIGKILLs them soon after: rank 0's early close on
    that signal (`Rank0.close_log_on_signal`) already names the dead worker in its "preempt" event and
    closes the log as failed, since the later "failed" event may never be written."""
    import socket

    from kit.server import make_server

    from mpiasgd import signals
    from mpiasgd.runlog import open_log

    server, _, log = make_server(tmp_path)
    server.begin()
    dead = subprocess.Popen(["true"])
    dead.wait()
    server.r0.pids = {1: (socket.gethostname(), dead.pid), 2: (socket.gethostname(), os.getpid())}
    monkeypatch.setattr(signals, "received", lambda: "SIGTERM")
    server.close_log_on_signal()
    assert log.ended
    with open_log(str(tmp_path / "run.h5")) as f:
        events = [(e["kind"].decode(), e["text"].decode()) for e in f["events"][()]]
        status = f.attrs["status"]
    host = socket.gethostname()
    assert ("preempt", f"SIGTERM received by rank 0; worker rank 1 (pid {dead.pid} on {host}) has exited") in events
    assert status == "failed"


def test_close_waits_out_a_readers_brief_hdf5_lock(tmp_path):
    """A reader opening the log (`watch`, `report`) holds HDF5's shared lock on the file for a moment; the
    writer's reopen in `close` meets it as BlockingIOError (errno 11) and tries again instead of failing."""
    import fcntl

    path = str(tmp_path / "run.h5")
    log = started(path)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # as HDF5's reader takes it while it opens the file
    threading.Timer(0.5, lambda: os.close(fd)).start()  # and lets go of it
    t0 = time.monotonic()
    log.close("completed")
    assert 0.4 < time.monotonic() - t0 < 3.0
    assert attrs_and_rows(path)[0]["status"] == "completed" and not os.path.exists(path + ".lock")


def test_close_gives_up_on_an_hdf5_lock_that_stays(tmp_path):
    import fcntl

    path = str(tmp_path / "run.h5")
    log = started(path)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        with pytest.raises(RunLogError, match="another process held HDF5's lock on the file for 3 s"):
            log.close("completed")
    finally:
        os.close(fd)
    assert log.outcome == "its status could not be set to 'completed'" and not os.path.exists(path + ".lock")
