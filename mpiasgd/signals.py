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

Open MPI's mpiexec, sent SIGTERM or SIGINT itself (Ctrl-C), stops forwarding the ranks' output before it passes
the signal on, so rank 0's lines after it reach no one. `install()` therefore keeps a descriptor of the
launcher's own stderr where the launcher is this process's parent (`launcher_stderr`), and `say` writes a line
there: rank 0's one line on a preemption (where the checkpoint is, the flag to resume) reaches the user's
terminal or the batch job's output file either way.

Python runs a signal handler in the main thread only between two bytecodes, so not while that thread is
inside one long C call (a NumPy update of a large network, an MPI wait, an fsync), and the launcher's
SIGKILL may come first. `install()` therefore also makes the C-level handler write each signal to a pipe
(`signal.set_wakeup_fd`) read by a thread of its own, which runs the callbacks given to `watching` at
once (rank 0: close the run log, `Rank0.close_log_on_signal`): NumPy, MPI and file I/O release the GIL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_PREEMPTED = 75
# s after a signal in which rank 0, its log closed (`RunLog.end_early`), does not open it again: Open MPI's mpiexec,
# sent SIGTERM or SIGINT, passes SIGTERM on and SIGKILLs every rank 0.25 s later (measured with 5.0.x)
KILL_WINDOW = 1.0

_received: list[str] = []
_rank: int | None = None
_seen = {"handler": 0, "watcher": 0}  # the signals each path has taken (each delivery reaches both)
_callbacks: list[Callable[[str], None]] = []
_wakeup: tuple[int, int] | None = None  # (read, write) ends of the pipe the C-level handler writes to
_noting = threading.Lock()  # (the main thread's handler and the signal thread)
_launcher: list[int] = []  # the descriptor of the launcher's stderr (`launcher_stderr`), when there is one
LAUNCHERS = ("prterun", "mpiexec", "mpirun", "orterun")  # Open MPI's launchers (/proc/PID/comm, 15 characters)


class Terminated(KeyboardInterrupt):
    """(`mpiasgd simulate`) SIGTERM reached the simulation: it ends as on Ctrl-C (the log closed 'failed'), with
    status 143."""


def _note(path: str, name: str) -> bool:
    """Take one delivery of signal `name` seen by `path` ("handler", "watcher"); True for the run's first
    signal (whichever path sees it first records it, and says it: `_say_first`)."""
    with _noting:
        _seen[path] += 1
        if _seen[path] > len(_received):
            _received.append(name)
            return len(_received) == 1
        return False


def _say_first(name: str) -> None:
    """(the first signal) A worker's line naming its rank: the job's output says which rank got what."""
    if _rank is not None:
        try:
            os.write(2, f"mpiasgd: rank {_rank}: {name} received: this rank stops (rank 0, while it runs, ends the "
                        f"run with a checkpoint where it holds the state)\n".encode())
        except OSError:  # the launcher is gone (LossyStream): a line less, and the run goes on
            pass


def _handler(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    if _note("handler", name):
        _say_first(name)


def _watch(read_end: int) -> None:
    """(a daemon thread) Take each signal byte the C-level handler writes, at once: record it, say the first,
    run the callbacks (an exception in one is printed, not raised: the main thread still sees the signal)."""
    while True:
        try:
            data = os.read(read_end, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum not in PREEMPT_SIGNALS:
                continue
            name = signal.Signals(signum).name
            if _note("watcher", name):
                _say_first(name)
            for callback in list(_callbacks):
                try:
                    callback(name)
                except Exception as e:
                    try:
                        os.write(2, f"mpiasgd: on {name}: {type(e).__name__}: {e}\n".encode())
                    except OSError:
                        pass


def install() -> None:
    """Route PREEMPT_SIGNALS to the flag read by `received()` (main thread only), start the thread that runs the
    `watching` callbacks the moment a signal arrives, and make stdout and stderr outlive the launcher
    (`LossyStream`). `mpiasgd train` does it first thing, so a signal during start-up is not lost: the run then
    ends at its first step."""
    global _wakeup
    _received.clear()
    _seen.update(handler=0, watcher=0)
    for signum in PREEMPT_SIGNALS:
        signal.signal(signum, _handler)
    if _wakeup is None:
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # the C-level handler must never block
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        _wakeup = (read_end, write_end)
        threading.Thread(target=_watch, args=(read_end,), name="mpiasgd-signals", daemon=True).start()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, LossyStream):
            setattr(sys, name, LossyStream(stream))
    if not _launcher:
        fd = launcher_stderr(os.getppid())
        if fd is not None:
            _launcher.append(fd)


def launcher_stderr(pid: int) -> int | None:
    """A descriptor open for writing on the stderr of process `pid` when it is an Open MPI launcher on this host
    (`LAUNCHERS`: the parent of the ranks it starts here) whose stderr is not /dev/null; None otherwise (another
    launcher, srun, a rank on another host, no permission)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() not in LAUNCHERS:
                return None
        if os.path.realpath(f"/proc/{pid}/fd/2") == os.devnull:
            return None
        return os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None


def say(text: str) -> None:
    """Write the line `text` to the launcher's own stderr where `install` found it (`launcher_stderr`: it reaches
    the user even after the launcher stopped forwarding the ranks' output, on its own SIGTERM), else to this
    process's stderr; a write that fails drops the line. Safe from any thread (one `os.write`)."""
    data = (text.rstrip("\n") + "\n").encode("utf-8", "replace")
    for fd in (*_launcher, 2):
        try:
            os.write(fd, data)
            return
        except OSError:  # the launcher is gone, or its pipe full: this process's own stderr, else nothing
            continue


@contextlib.contextmanager
def watching(callback: Callable[[str], None]) -> Iterator[None]:
    """Within the block, call `callback(name)` ("SIGTERM", ...) from the signal thread the moment a preemption
    signal arrives (after `install()`; without it, never), while the main thread may be inside a long C call.
    The callback runs concurrently with the main thread: what it touches must be guarded (`RunLog.guard`)."""
    _callbacks.append(callback)
    try:
        yield
    finally:
        _callbacks.remove(callback)


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
