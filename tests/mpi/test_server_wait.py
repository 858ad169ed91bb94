"""--server-wait under `mpiexec`: a run whose server spins completes, and rank 0 says its choice on stdout and
in the log's events; auto with parameter-server shards decides from the node's ranks and cores; and
bench/server_wait.py --dry-run runs its jobs and prints its table. Each job runs under a timeout (a hang
fails the test). The flag and auto's rule in-process: tests/unit/test_server_wait.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

from kit import REPO
from kit.launch import mpi_env
from kit.runs import FAST, read_log

TIMEOUT = 60.0  # seconds per mpiexec job of the bench script (its --timeout)


def server_wait_events(t) -> list[str]:
    events = t["events"]
    return [text.decode() if isinstance(text, bytes) else text
            for text in events["text"][events["kind"] == b"server_wait"]]


def test_a_spinning_server_completes_and_the_log_records_it(mpirun, tmp_path):
    res = mpirun(2, ["train", *FAST, "--server-wait", "spin", "--epochs", "0", "--max-pushes", "60", "--name", "sp"],
                 timeout=180)
    assert res.returncode == 0, res.explain()
    said = (f"the parameter server spins on its requests (no sleep between polls): --server-wait spin; 2 ranks on "
            f"this node, {len(os.sched_getaffinity(0))} cores")  # (--bind-to none: every rank may use every core)
    assert f"mpiasgd: {said}\n" in res.stdout, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "sp.h5")
    assert attrs["status"] == "completed" and attrs["version"] == 60
    assert server_wait_events(t) == [said]
    assert len(t["pushes"]) == 60 and (t["pushes"]["wait_s"] >= 0).all()


def test_auto_with_two_shards_decides_from_the_node(mpirun, tmp_path):
    """1 worker + 2 shards: 3 ranks on this node; spin only with 3 cores or more."""
    res = mpirun(3, ["train", *FAST, "--servers", "2", "--epochs", "0", "--max-pushes", "40", "--name", "au"],
                 timeout=180)
    assert res.returncode == 0, res.explain()
    cores = len(os.sched_getaffinity(0))
    why = "a core per rank" if cores >= 3 else "fewer cores than ranks (a spinning server would take a worker's)"
    doing = ("spins on its requests (no sleep between polls)" if cores >= 3 else
             "sleeps between polls of its requests (backoff, 10 us to 2 ms)")
    said = (f"the parameter server {doing}: --server-wait auto: 3 ranks on this node, {cores} cores, {why}; each "
            "other shard decides for its own node")
    assert f"mpiasgd: {said}\n" in res.stdout, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "au.h5")
    assert attrs["status"] == "completed" and list(attrs["shard_versions"]) == [40, 40]
    assert server_wait_events(t) == [said]


def test_the_bench_script_dry_run_compares_spin_with_backoff(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "server_wait.py"), "--dry-run", "--timeout",
                           f"{TIMEOUT:g}", "--run-dir", "r"], cwd=tmp_path, env=mpi_env(), capture_output=True,
                          text=True, timeout=2 * (TIMEOUT + 40) + 60)  # the script's own limits come first
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    out = done.stdout
    rounds = [line for line in out.splitlines() if line.startswith("round 1: ")]
    assert [line.split()[2] for line in rounds] == ["spin", "backoff"], out
    assert "(medians of 20 pushes; the parameter server spins on its requests" in rounds[0]
    assert "(medians of 20 pushes; the parameter server sleeps between polls" in rounds[1]
    table = {line.split(" | ")[0][2:]: line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    spin, backoff = float(table["spin"][1]), float(table["backoff"][1])
    assert spin > 0 and backoff > 0
    line = next(line for line in out.splitlines() if line.startswith("spin / backoff, the worker's wait per push: "))
    ratio = float(line.split(": ")[1].split()[0])
    assert abs(ratio - spin / backoff) <= 0.01 + 1e-3 * (1 / backoff + spin / backoff ** 2)  # (the table's rounding)
    assert f" ({spin:.3f} against {backoff:.3f} ms; per round: " in line
    assert (tmp_path / "r" / "spin-r1.h5").exists() and (tmp_path / "r" / "backoff-r1.h5").exists()
    assert out.count("--max-pushes 20") == 2 and "--server-wait spin" in out and "--server-wait backoff" in out
