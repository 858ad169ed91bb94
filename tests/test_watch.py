"""`mpiasgd watch`: follows a running job's log while it grows and ends with the job."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

from conftest import kill_session, start_mpi, stop_group
from test_mpi import FAST

LINE = re.compile(r"^\s+(\d+\.\d) s  epoch\s+(\d+\.\d\d)  pushes\s+([\d,]+)  loss\s+(\S+)  images/s\s+(\S+)")


def watch(path, *extra):
    return subprocess.Popen([sys.executable, "-m", "mpiasgd", "watch", str(path), "--interval", "0.5", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_watch_follows_a_run_to_its_end(tmp_path):
    proc = start_mpi(3, ["train", *FAST, "--epochs", "0", "--max-time", "5", "--name", "live"], tmp_path)
    try:
        watcher = watch(tmp_path / "runs" / "live.h5")  # started before the log exists: it waits for it
        out, err = watcher.communicate(timeout=90)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        stop_group(proc)
    lines = out.splitlines()
    progress = [LINE.match(line) for line in lines[:-1]]
    assert watcher.returncode == 0 and len(lines) >= 4 and all(progress), (out, err)
    times = [float(m.group(1)) for m in progress]
    pushes = [int(m.group(3).replace(",", "")) for m in progress]
    assert times == sorted(times) and pushes == sorted(pushes) and pushes[0] > 0, out
    assert re.match(r"run ended: status completed, test accuracy \d+\.\d\d %$", lines[-1]), out


def test_watch_reports_a_killed_run(tmp_path):
    proc = start_mpi(3, ["train", *FAST, "--epochs", "0", "--max-time", "60", "--name", "doomed"], tmp_path)
    try:
        watcher = watch(tmp_path / "runs" / "doomed.h5")
        deadline = time.monotonic() + 60
        while not (tmp_path / "runs" / "doomed.h5").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.5)
        kill_session(proc.pid, signal.SIGKILL)
        out, err = watcher.communicate(timeout=60)
    finally:
        stop_group(proc)
    assert watcher.returncode == 1, (out, err)
    assert out.splitlines()[-1].startswith("run ended: status killed"), out


def test_watch_refuses_a_file_that_is_not_a_run_log(tmp_path):
    bad = tmp_path / "x.h5"
    import h5py

    with h5py.File(bad, "w", libver="latest") as f:
        f["data"] = [1, 2, 3]
    res = subprocess.run([sys.executable, "-m", "mpiasgd", "watch", str(bad), "--wait", "1"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "is not an mpiasgd run log" in res.stderr, res.stderr
