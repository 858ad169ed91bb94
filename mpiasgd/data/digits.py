"""scikit-learn's bundled handwritten digits (1,797 8x8 grey images, 10 classes): the small, offline dataset.

Pixels are 0..16 (the UCI "optdigits" counts), stored as uint8 (N, 1, 8, 8). The test split is
fixed and stratified: 360 images, `train_test_split(..., test_size=360, stratify=y,
random_state=0)`; train is the other 1,437. No download ever happens; the split is cached as arrays
(`cache_path`) after the first load.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from importlib import metadata

import numpy as np

from mpiasgd.data.dataset import Dataset

TEST_SIZE = 360  # images held out for test, stratified by class
SPLIT_SEED = 0  # random_state of the split, fixed so every run and rank sees the same split
ARRAYS = ("train_x", "train_y", "test_x", "test_y")


def cache_path() -> str | None:
    """Where the split arrays are kept between processes: `$XDG_CACHE_HOME/mpiasgd` (~/.cache/mpiasgd), a file
    named by scikit-learn's version (its loader and split make the arrays); None when scikit-learn is missing."""
    try:
        version = metadata.version("scikit-learn")
    except metadata.PackageNotFoundError:
        return None
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "mpiasgd", f"digits-split-sklearn-{version}.npz")


def _digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 of the arrays' names, shapes, dtypes and bytes, in `ARRAYS` order."""
    h = hashlib.sha256()
    for k in ARRAYS:
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.shape}:{a.dtype.str};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _read_cache(path: str) -> dict[str, np.ndarray] | None:
    """The cached arrays, or None (then rebuilt) when the file is missing, unreadable (torn, empty, not an npz)
    or not what `_write_cache` wrote: its SHA-256 of the arrays must match, so changed content is rebuilt too."""
    try:
        with np.load(path, allow_pickle=False) as z:  # data only: no pickle, no code
            arrays = {k: np.asarray(z[k]) for k in ARRAYS}
            digest = str(z["sha256"])
    except Exception:  # whatever is wrong with the file: EOFError, BadZipFile, a bare .npy, ...
        return None
    shapes = {"train_x": (1437, 1, 8, 8), "train_y": (1437,), "test_x": (TEST_SIZE, 1, 8, 8), "test_y": (TEST_SIZE,)}
    if any(arrays[k].shape != shapes[k] or arrays[k].dtype != (np.uint8 if k.endswith("x") else np.int64)
           for k in ARRAYS) or digest != _digest(arrays):
        return None
    return arrays


def _write_cache(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write the arrays and their SHA-256 atomically (a temporary file, flushed to disk, then renamed: ranks
    starting together, and a crash, never leave half a file under the name); a cache that cannot be written
    (read-only home, full disk) is skipped."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".digits-", suffix=".npz", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays, sha256=np.array(_digest(arrays)))
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from other users of a shared home
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def _split_with_sklearn() -> dict[str, np.ndarray]:
    # Imported here: scikit-learn takes 1-3 s to import (per rank: most of a small job's start-up), so it is
    # imported only when the cache has no split yet.
    from sklearn.datasets import load_digits as sklearn_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_load_digits()
    images = bunch.images.astype(np.uint8)[:, None, :, :]  # (N, 1, 8, 8), exact: values are 0..16
    labels = bunch.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=TEST_SIZE, stratify=labels, random_state=SPLIT_SEED
    )
    return {"train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_y}


def load_digits() -> Dataset:
    """The digits dataset: train (1437, 1, 8, 8), test (360, 1, 8, 8) uint8 in 0..16; no augmentation.

    The split is scikit-learn's (`train_test_split`, stratified, `random_state=0`); it is kept in the user
    cache (`cache_path`) after the first load, so that later processes read 115 KB instead of importing
    scikit-learn."""
    path = cache_path()
    arrays = _read_cache(path) if path else None
    if arrays is None:
        arrays = _split_with_sklearn()
        if path:
            _write_cache(path, arrays)
    return Dataset.from_arrays(
        name="digits",
        **arrays,
        classes=tuple(str(c) for c in range(10)),
        augment=False,
        source="sklearn.datasets.load_digits",
    )
