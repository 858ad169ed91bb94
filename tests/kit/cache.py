"""Where the test tiers keep compiler output between runs and between clones: the user's cache directory.

    cache_dir("cuda-cpu")   # $MPIASGD_TEST_CACHE/cuda-cpu, else $XDG_CACHE_HOME/mpiasgd/tests/cuda-cpu,
                            # else ~/.cache/mpiasgd/tests/cuda-cpu

Everything under it is named by a hash of what produced it (sources, headers, compiler, flags), so
a clone, a branch or a CI run that builds the same thing finds it, and one that changes a source
builds only that source. Entries not used for PRUNE_DAYS are removed by `prune` (the CUDA-on-CPU
harness calls it once per session); `touch` marks an entry as used. A cache directory that cannot
be created (a read-only home) falls back to the system's temporary directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

PRUNE_DAYS = 30  # an entry unused this long is removed


def cache_root() -> Path:
    """The folder every test cache lives under (see the module docstring), created if missing."""
    explicit = os.environ.get("MPIASGD_TEST_CACHE")
    if explicit:
        root = Path(explicit)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = Path(base) / "mpiasgd" / "tests"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe.{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError:
        root = Path(tempfile.gettempdir()) / "mpiasgd-tests"
        root.mkdir(parents=True, exist_ok=True)
    return root


def cache_dir(name: str) -> Path:
    """The cache folder `name` under `cache_root()`, created if missing."""
    path = cache_root() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def touch(path: Path) -> None:
    """Mark a cache entry (file or folder) as used now, so that `prune` keeps it; a vanished one is fine."""
    try:
        os.utime(path)
    except OSError:
        pass


def prune(folder: Path, days: float = PRUNE_DAYS) -> int:
    """Remove the entries (files or folders) directly under `folder` not used for `days`; returns how many.
    Entries another process removes meanwhile are skipped."""
    cutoff = time.time() - days * 86400.0
    removed = 0
    for entry in folder.iterdir() if folder.is_dir() else ():
        try:
            if entry.stat().st_mtime >= cutoff:
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed += 1
        except OSError:
            continue
    return removed
