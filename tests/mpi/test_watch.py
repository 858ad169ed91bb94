"""`mpiasgd watch`: follows a running job's log while it grows and ends with the job (or its kill);
`mpiasgd trace` and `mpiasgd report --plots` of real runs.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

from kit.launch import kill_session, start_mpi, stop_group
from kit.runs import FAST

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
    assert re.match(r"run ended: status completed, test accuracy \d+\.\d\d % \(top-5 \d+\.\d\d %\)$", lines[-1]), out


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


def test_trace_has_a_track_per_rank_and_the_steps_in_order(mpirun, tmp_path):
    import json

    import numpy as np

    from mpiasgd.runlog import open_log

    res = mpirun(3, ["train", *FAST, "--epochs", "0", "--max-pushes", "60", "--checkpoint-interval", "0.02",
                     "--name", "t"], timeout=60)
    assert res.returncode == 0, res.explain()
    log, out = tmp_path / "runs" / "t.h5", tmp_path / "trace.json"
    done = subprocess.run([sys.executable, "-m", "mpiasgd", "trace", str(log), "-o", str(out)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    events = json.loads(out.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert tracks == {0: "rank 0 (server)", 1: "rank 1 (worker)", 2: "rank 2 (worker)"}
    with open_log(str(log)) as f:
        pushes, checkpoints = f["pushes"][()], f["checkpoints"][()]
    spans = [e for e in events if e["name"] == "checkpoint"]  # one span per checkpoint written, on rank 0
    assert len(spans) == len(checkpoints) >= 1 and spans[-1]["args"]["reason"] == "end"
    assert all(e["ph"] == "X" and e["tid"] == 0 and e["dur"] > 0 for e in spans)
    np.testing.assert_allclose([e["dur"] / 1e6 for e in spans], checkpoints["seconds"], rtol=1e-3)
    for rank in (1, 2):
        rows = pushes[pushes["worker"] == rank]
        compute = [e for e in events if e["ph"] == "X" and e["tid"] == rank and e["name"] == "compute"]
        assert len(compute) == len(rows)  # one compute span per push
        ends = np.array([e["ts"] + e["dur"] for e in compute]) / 1e6
        np.testing.assert_allclose(ends, rows["time"], atol=1e-6)  # each ends where rank 0 received the push
        starts = [e["ts"] for e in compute]
        assert starts == sorted(starts) and all(e["dur"] >= 0 for e in compute)
    applies = [e for e in events if e["name"] == "apply"]
    assert len(applies) == 60 and sorted(e["args"]["version"] for e in applies) == list(range(1, 61))
    assert {e["name"] for e in events if e.get("cat") == "event"} >= {"start", "stop", "end"}


def test_report_plots_two_runs(mpirun, tmp_path):
    for name in ("a", "b"):
        res = mpirun(3, ["train", *FAST, "--epochs", "3", "--name", name], timeout=60)
        assert res.returncode == 0, res.explain()
    logs = [str(tmp_path / "runs" / f"{name}.h5") for name in ("a", "b")]
    subprocess.run([sys.executable, "-m", "mpiasgd", "evaluate", logs[0]], check=True, capture_output=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "mpiasgd", "report", *logs, "--plots", str(tmp_path / "plots")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("accuracy", "loss", "staleness", "time"):
        data = (tmp_path / "plots" / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    (tmp_path / "file").write_text("x")
    bad = subprocess.run([sys.executable, "-m", "mpiasgd", "report", logs[0], "--plots", str(tmp_path / "file")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cannot write plots into" in bad.stderr, bad.stderr
