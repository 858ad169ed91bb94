"""The run log's writer lock: an exclusive `flock` on `NAME.h5.lock` held by rank 0 while the run lives.

A second job cannot overwrite the log, and `writer_alive` tells a running log from a killed one: the
kernel releases the lock when the writer dies, however it dies.
"""

from __future__ import annotations

import fcntl
import os
import time

from mpiasgd.files import os_error


class WriterLock:
    """An exclusive `flock` on `PATH.lock`, held by the run's writer (rank 0) from start-up to the end.

    It keeps a second job from overwriting a log that is being written (also with --overwrite),
    and tells readers whether a log marked "running" still has a live writer: the kernel releases
    the lock when the writer dies, however it dies.
    """

    def __init__(self, path: str) -> None:
        self.path = path + ".lock"
        self.fd: int | None = None
        self.dead_pid = 0  # the pid a writer that died left in the lock file (0: none, or the file was new)

    def acquire(self, hint: str = "choose another --name") -> None:
        """Take the lock; FileExistsError naming the log (and `hint`) if another live job holds it; OSError
        naming the lock file if it cannot be created or written (disk full): a lock file this call
        created is removed again."""
        while True:
            try:
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
                break
            except FileExistsError:  # left by a job that died, or held by a live one (flock tells)
                try:
                    fd, created = os.open(self.path, os.O_RDWR), False
                    break
                except FileNotFoundError:  # its job released it in between: create it
                    continue
            except OSError as e:
                raise OSError(f"cannot create the lock file '{self.path}' of run log '{self.path[:-5]}': "
                              f"{os_error(e)}") from None
        for attempt in range(10):  # a reader's brief shared lock (`writer_alive`) may be in the way
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == 9:
                    os.close(fd)
                    raise FileExistsError(f"run log '{self.path[:-5]}' is being written by a running job "
                                          f"(lock {self.path} is held); {hint}") from None
                time.sleep(0.1)
        try:
            left = os.read(fd, 32).decode(errors="replace").strip()
            self.dead_pid = int(left) if left.isdigit() else 0  # its flock was free: that writer is gone
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, f"{os.getpid()}\n".encode())  # readers and tests find rank 0's pid here
        except OSError as e:  # disk full: the pid does not fit
            if created:
                os.unlink(self.path)
            os.close(fd)
            raise OSError(f"cannot write the lock file '{self.path}' of run log '{self.path[:-5]}': "
                          f"{os_error(e)}") from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.unlink(self.path)
            os.close(self.fd)
            self.fd = None


def writer_alive(path: str) -> bool:
    """True if a live job holds the writer lock of the run log at `path`."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
