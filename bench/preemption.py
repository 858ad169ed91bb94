"""How fast a job ends on a preemption signal or a dead worker, and what it leaves behind.

    python bench/preemption.py [--rounds 3] [--model digits]

For each case a 3-rank job (5 for pipeline) trains until its log has pushes plus one second, then
gets the signal (or a worker gets SIGKILL); printed per case, median over rounds: seconds from the
signal to the end of mpiexec, the exit status (75 = preempted), the log's status, the checkpoint's
reason and its write time. Goals (issue 6): a signal ends the job within 10 s with a checkpoint,
a dead worker within 30 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
from launch import launcher

from mpiasgd import checkpoint

CASES = [  # (mode, signal, target): target 0 = rank 0, "mpiexec", or a worker rank
    ("async", "SIGTERM", 0), ("async", "SIGUSR1", "mpiexec"), ("async", "SIGTERM", 2), ("ssp", "SIGUSR1", 1),
    ("sync", "SIGUSR1", 0), ("sync", "SIGTERM", 2), ("pipeline", "SIGUSR1", 0), ("pipeline", "SIGTERM", 4),
    ("async", "SIGKILL", 2), ("sync", "SIGKILL", 2),
]


def pid_of(runs: Path, rank: int) -> int:
    if rank == 0:
        return int((runs / "b.h5.lock").read_text())
    with h5py.File(runs / "b.h5", "r", libver="latest", swmr=True) as f:
        workers = f["workers"][()]
    return int(workers["pid"][workers["rank"] == rank][0])


def pushes(runs: Path) -> int:
    try:
        with h5py.File(runs / "b.h5", "r", libver="latest", swmr=True) as f:
            return int(f["pushes"].shape[0])
    except (OSError, KeyError):
        return 0


def one(mode: str, sig: str, target, model: str) -> tuple[float, int, str, str, float]:
    """(seconds to exit, exit status, log status, checkpoint reason, checkpoint write ms) of one case."""
    with tempfile.TemporaryDirectory(prefix="mpre-") as tmp:
        runs = Path(tmp) / "runs"
        nranks = 5 if mode == "pipeline" else 3
        extra = {"pipeline": ["--modules", "2"], "ssp": ["--staleness-bound", "2"]}.get(mode, [])
        cmd = [*launcher(), "-n", str(nranks), sys.executable, "-m", "mpiasgd", "train", "--model", model,
               "--mode", mode, *extra, "--epochs", "0", "--max-time", "300", "--no-progress", "--run-dir", str(runs),
               "--name", "b", "--flush-interval", "0.2"]
        env = {**os.environ, "TMPDIR": tmp}
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while pushes(runs) == 0:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"no pushes: {proc.stderr.read() if proc.poll() is not None else 'timeout'}")
                time.sleep(0.2)
            time.sleep(1.0)
            pid = proc.pid if target == "mpiexec" else pid_of(runs, target)
            t0 = time.monotonic()
            os.kill(pid, getattr(signal, sig))
            proc.wait(timeout=120)
            seconds = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        with h5py.File(runs / "b.h5", "r", libver="latest", swmr=True) as f:
            status = f.attrs["status"]
            status = status.decode() if isinstance(status, bytes) else str(status)
            ck = f["checkpoints"][()] if "checkpoints" in f else []
        try:  # the file itself, CRC-checked: a dead worker's job may end before the log's last flush
            reason = checkpoint.load(str(runs / "b.ckpt.h5")).reason
        except checkpoint.CheckpointError:
            reason = "-"
        write_ms = 1000 * float(ck["seconds"][-1]) if len(ck) else float("nan")
        return seconds, proc.returncode, status, reason, write_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="digits")
    args = parser.parse_args()
    print(f"{'mode':<9} {'signal':<8} {'to':<8} {'s to exit (median, max)':>24} {'exit':>5} {'log status':<11} "
          f"{'checkpoint':<10} {'write ms':>8}")
    for mode, sig, target in CASES:
        results = [one(mode, sig, target, args.model) for _ in range(args.rounds)]
        secs = [r[0] for r in results]
        codes = sorted({r[1] for r in results})
        statuses = sorted({r[2] for r in results})
        reasons = sorted({r[3] for r in results})
        write = statistics.median(r[4] for r in results)
        who = target if target == "mpiexec" else f"rank {target}"
        print(f"{mode:<9} {sig:<8} {who:<8} {statistics.median(secs):>16.2f}, {max(secs):5.2f} "
              f"{','.join(map(str, codes)):>5} {','.join(statuses):<11} {','.join(reasons):<10} {write:8.1f}",
              flush=True)


if __name__ == "__main__":
    main()
