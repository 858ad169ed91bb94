"""Preemption signals: SIGTERM, SIGUSR1 (and SIGINT) on any rank end the run with a checkpoint.

A scheduler warns a job before it ends it (SLURM: `--signal=USR1@120`, `scancel --signal`, and
SIGTERM at the time limit, KillWait seconds before SIGKILL). `install()` makes those signals set a
flag instead of killing the process; the roles poll `received()` between messages and steps:

    rank 0     stops the run, writes a checkpoint, tells the workers (STOP with flag PREEMPT)
    a worker   flags its next PUSH or REPORT (or, in sync mode, the control allreduce) with PREEMPT,
               which makes rank 0 do the same

Every rank then exits with EXIT_PREEMPTED (75, EX_TEMPFAIL: "try again"), which a job script can
take as its cue to requeue the job and `--resume` from the checkpoint.

The launcher may be gone by then: SLURM ending a job signals every process of it, Open MPI's mpiexec
among them, which then exits at once, and with it the pipes that carry the ranks' output. `install()`
therefore makes stdout and stderr drop what can no longer be written (`LossyStream`): the run still ends
with its checkpoint and its log closed, instead of failing on its first line of output.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_PREEMPTED = 75
# s after a signal in which rank 0, its log closed (`RunLog.end_early`), does not open it again: Open MPI's mpiexec,
# sent SIGTERM or SIGINT, passes SIGTERM on and SIGKILLs every rank 0.25 s later (measured with 5.0.x)
KILL_WINDOW = 1.0

_received: list[str] = []
_rank: int | None = None


def _handler(signum: int, frame: Any) -> None:
    _received.append(signal.Signals(signum).name)
    if len(_received) == 1 and _rank is not None:  # the job's output names the rank that got it
        try:
            os.write(2, f"mpiasgd: rank {_rank}: {_received[0]} received: the run ends with a checkpoint\n".encode())
        except OSError:  # the launcher is gone (LossyStream): a line less, and the run goes on
            pass


def install() -> None:
    """Route PREEMPT_SIGNALS to the flag read by `received()` (main thread only), and make stdout and stderr
    outlive the launcher (`LossyStream`). `mpiasgd train` does it first thing, so a signal during start-up is
    not lost: the run then ends at its first step."""
    _received.clear()
    for signum in PREEMPT_SIGNALS:
        signal.signal(signum, _handler)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, LossyStream):
            setattr(sys, name, LossyStream(stream))


class LossyStream:
    """A text stream (sys.stdout, sys.stderr) whose reader may go away: the launcher that carried the output
    exited (SLURM signalled it too). The first write or flush that finds the pipe broken points the file
    descriptor at /dev/null (so no later write, nor Python's own flush at exit, fails: exit status 120) and
    drops the text; anything else is the wrapped stream's."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        """The reader is gone: from now on the descriptor writes to /dev/null; what the buffer held is lost."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self.stream.fileno())
        finally:
            os.close(devnull)
        try:
            self.stream.flush()  # (to /dev/null now: the buffer is emptied)
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def ignore() -> None:
    """Ignore PREEMPT_SIGNALS from now on: the run has ended. (At exit Python resets the handlers it
    installed to the default action, and MPI_Finalize can take a moment: a second signal then would
    kill the rank and turn its exit status 75 into 128 + the signal.)"""
    for signum in PREEMPT_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def set_rank(rank: int | None) -> None:
    """A worker's `rank`, printed to stderr when its first signal arrives (rank 0 says more itself)."""
    global _rank
    _rank = rank


def received() -> str:
    """The name of the first preemption signal received since `install()`, or ""."""
    return _received[0] if _received else ""
