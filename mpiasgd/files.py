"""The files of a run on disk: where a run log's checkpoint is, and writes that fail on a full disk (the run
log and checkpoints): a one-line error, and a free-space check made before HDF5 is called (HDF5 fails badly
on a full disk: chained errors, a crash). It imports nothing of mpiasgd: the run log, the checkpoint and
the tools that name their files all use it."""

from __future__ import annotations

import errno
import os
import re

PIECE = 1 << 20  # float32 values one HDF5 call writes (4 MiB) where a long write must leave way to another thread:
# h5py holds its global lock, and the GIL, for a whole call (checkpoint arrays; run-log snapshots, their chunks)


def checkpoint_path(log_path: str) -> str:
    """The checkpoint file of the run log `RUN_DIR/NAME.h5`: `RUN_DIR/NAME.ckpt.h5`."""
    return log_path[:-3] + ".ckpt.h5" if log_path.endswith(".h5") else log_path + ".ckpt.h5"


class RunLogError(OSError):
    """The run log at `path` cannot be `doing` ("written", "created", "reopened"): disk full, quota, I/O error.

    The message is one line naming the file and the cause, e.g. "run log 'runs/x.h5' cannot be
    written: [Errno 28] No space left on device"; `cause` is that cause as an OSError.
    """

    def __init__(self, path: str, error: BaseException, doing: str = "written") -> None:
        self.path = path
        self.cause = os_error(error)
        super().__init__(f"run log '{path}' cannot be {doing}: {self.cause}")


def os_error(error: BaseException) -> OSError:
    """`error` (an OSError, or the RuntimeError h5py raises when HDF5 fails to write) as a plain OSError with
    a one-line text: "[Errno 28] No space left on device" when it carries an errno (HDF5 puts it in its
    text: "errno = 28"), else the first line of its text."""
    number = error.errno if isinstance(error, OSError) and error.errno else None
    if number is None:
        found = re.search(r"errno = (\d+)", str(error))
        number = int(found.group(1)) if found else None
    if number:
        return OSError(number, os.strerror(number))
    lines = str(error).strip().splitlines()
    return OSError(lines[0] if lines else type(error).__name__)



FREE_MARGIN = 1 << 20  # bytes kept free beyond a write's data and 5 % of it: HDF5's metadata (object headers,
                       # chunk indexes, free-space records) and whatever else shares the file system


def ensure_free_space(path: str, nbytes: int) -> None:
    """OSError(ENOSPC) ("[Errno 28] No space left on device (for this write: ... free, ... needed ...)") unless the
    file system holding `path` has room for a write of `nbytes` bytes of data: nbytes + 5 % + FREE_MARGIN (1 MiB)
    free for this user (f_bavail).
    Checked before HDF5 is called, so a full disk is one clean error instead of HDF5's failure paths."""
    st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    free, need = st.f_bavail * st.f_frsize, nbytes + nbytes // 20 + FREE_MARGIN
    if free < need:  # (the OS has not said so yet: the message says what was checked)
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (for this write: {mib(free)} free, {mib(need)} "
                                    f"needed: its {mib(nbytes)} + 5 % + {mib(FREE_MARGIN)} kept free)")


def mib(nbytes: int) -> str:
    """A size for a message: whole KiB below 1 MiB (384 KiB), else MiB with 2 decimals (2.05 MiB)."""
    return f"{nbytes / 1024:.0f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.2f} MiB"

