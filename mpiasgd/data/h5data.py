"""mpiasgd's dataset file: images and labels in HDF5, read a chunk at a time by the worker that owns them.

Layout (format "mpiasgd.data/1"; `mpiasgd data info FILE` prints it for a file):

    /                 attrs: format = "mpiasgd.data/1", name (str), classes (JSON list of K names,
                      index = label), mean and std (float32 (C,): per-channel mean and population
                      standard deviation of the train split in pixel units 0..255, std 1 where 0),
                      pixel_cov (float64 (C, C): covariance of a pixel's channels over the train
                      split, pixel units: AlexNet's PCA colour noise), source (what it was
                      converted from), created (ISO 8601 UTC), command (the `mpiasgd data` command
                      that wrote it, when one did)
    /train/images     uint8 (N, C, H, W), NCHW raw pixels; HDF5 chunks of (chunk, C, H, W) images,
                      uncompressed, so one chunk is one contiguous read of `chunk` whole images
    /train/labels     int64 (N,), 0..K-1
    /test/images      uint8 (M, C, H, W), the held-out split (test or validation), same chunking
    /test/labels      int64 (M,)

A file holds train, test, or both (a training run needs a train split; its test split may come from
a second file). The converters (`mpiasgd.data.convert`) shuffle the training images once, with a
seed, before writing them, so that every chunk mixes the classes: a worker then reads whole chunks
in a random order and shuffles within a window of them (`mpiasgd.data.sampler.ShardSampler` with
`chunk` > 1) and still sees a well-mixed stream.

A file is written as PATH.partial and moved into place when complete; mean, std and pixel_cov are
written last, so a file without them is what a killed conversion left (`unfinished` says so, with
the command that redoes it).

Nothing in a file is executed: attributes are numbers and strings, `classes` is JSON text.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from mpiasgd.data.augment import Augmentation
from mpiasgd.data.dataset import Splits
from mpiasgd.data.errors import DataError

FORMAT = "mpiasgd.data/1"
PARTIAL = ".partial"  # suffix of a file being written (H5Writer), moved into place when complete
SPLITS = ("train", "test")
CHUNK_BYTES = 1 << 20  # target bytes of one HDF5 chunk of images (`default_chunk`)


def default_chunk(image_shape: tuple[int, ...]) -> int:
    """Images per HDF5 chunk for images of `image_shape` (C, H, W): the largest power of two whose chunk
    stays within CHUNK_BYTES (1 MiB), at least 1 and at most 1024 (CIFAR-10: 256, 64x64x3: 64, 224x224x3: 4)."""
    per_image = int(np.prod(image_shape))
    n = 1
    while n * 2 * per_image <= CHUNK_BYTES and n < 1024:
        n *= 2
    return n


class H5Writer:
    """Writes an mpiasgd dataset file; `close()` moves it into place, so a killed conversion leaves no file
    that looks complete (it writes PATH.partial first).

        with H5Writer(path, "cifar10", classes, (3, 32, 32), source="...") as w:
            w.create("train", 50000)
            w.write("train", 0, images, labels)   # uint8 (n, C, H, W), int (n,), at offset 0
            ...

    mean/std are accumulated from the train split's writes (a 256-bin histogram per channel: exact).
    command: the `mpiasgd data` command line that redoes this file (stored and flushed at once, so that a
    reader of the PATH.partial a killed conversion leaves prints it). images: how many images the file will
    hold, all splits together (0: not known yet): the free space is checked for them before the file is
    created, and each `create` checks it again. Raises DataError for images of the wrong dtype or shape,
    labels out of range, a split written incompletely (at `close`), PATH.partial held by a conversion still
    running, or a disk without room for the file (one line: the folder, the bytes still needed and those
    free; PATH.partial removed).
    """

    def __init__(self, path: str, name: str, classes: tuple[str, ...] | list[str], image_shape: tuple[int, ...],
                 source: str, chunk: int | None = None, command: str = "", images: int = 0) -> None:
        import h5py

        if len(image_shape) != 3 or min(image_shape) < 1:
            raise DataError(f"{path}: image shape must be (C, H, W) with positive sizes, got {image_shape}")
        if not classes:
            raise DataError(f"{path}: a dataset needs at least one class name")
        self.path, self.partial = path, path + PARTIAL
        self.classes = tuple(str(c) for c in classes)
        self.image_shape = tuple(int(d) for d in image_shape)
        self.chunk = int(chunk or default_chunk(self.image_shape))
        self.hist = np.zeros((self.image_shape[0], 256), dtype=np.int64)
        self.moments = np.zeros((self.image_shape[0], self.image_shape[0]), dtype=np.float64)  # sum x_c x_d
        self.sizes: dict[str, int] = {}
        self.planned = 0  # bytes of the datasets created so far (checked against the free space)
        self.written: dict[str, int] = {}
        try:
            if os.path.exists(self.partial):  # HDF5's "w" truncates the file before it tries the lock: ask first
                _probe(self.partial)
        except BlockingIOError:  # HDF5's lock on the file: another process (a conversion) has it open
            raise DataError(f"{path}: {self.partial}{RUNNING}; wait for it to finish, or stop it, before converting "
                            "again") from None
        self._check_space(images * self._row_bytes(), 0)
        try:
            # no chunk cache: a chunk goes to disk in its write, so a full disk fails there (HDF5 crashes when
            # it cannot flush a cache at close)
            self.file = h5py.File(self.partial, "w", rdcc_nbytes=0)
        except OSError as e:
            if os.path.exists(self.partial):  # made (or truncated) before HDF5 failed to write its first bytes
                os.remove(self.partial)
            if e.errno == errno.ENOSPC:
                raise self._no_space(images * self._row_bytes(), "[Errno 28] No space left on device") from None
            raise DataError(f"{path}: cannot create the dataset file ({e})") from None
        a = self.file.attrs
        a["format"], a["name"], a["source"] = FORMAT, str(name), str(source)
        if command:
            a["command"] = command
        a["classes"] = json.dumps(list(self.classes))
        a["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            self.file.flush()  # the command on disk before the first image: a killed conversion's file names it
        except (OSError, RuntimeError) as e:
            self.abort()
            if _errno(e) == errno.ENOSPC:
                raise self._no_space(images * self._row_bytes(), _reason(e)) from None
            raise DataError(f"{path}: cannot create the dataset file ({_reason(e)}); the partial file was "
                            "removed") from None

    def __enter__(self) -> H5Writer:
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def create(self, split: str, count: int) -> None:
        """Make the datasets of `split` ("train" or "test") for `count` images."""
        if split not in SPLITS:
            raise DataError(f"{self.path}: split must be one of {SPLITS}, got {split!r}")
        if count < 1:
            raise DataError(f"{self.path}: split '{split}' needs at least one image, got {count}")
        self.planned += count * self._row_bytes()
        try:
            self._check_space(self.planned, os.path.getsize(self.partial))
        except DataError:
            self.abort()
            raise
        g = self.file.create_group(split)
        g.create_dataset("images", shape=(count, *self.image_shape), dtype=np.uint8,
                         chunks=(min(self.chunk, count), *self.image_shape))
        g.create_dataset("labels", shape=(count,), dtype=np.int64)
        self.file.flush()  # the metadata on disk now, so that a failed write leaves nothing to flush
        self.sizes[split], self.written[split] = int(count), 0

    def write(self, split: str, start: int, images: np.ndarray, labels: np.ndarray) -> None:
        """Store images uint8 (n, C, H, W) and labels (n,) of `split` at rows start..start+n-1."""
        images, labels = np.asarray(images), np.asarray(labels)
        n = images.shape[0] if images.ndim else 0
        if images.dtype != np.uint8 or images.shape[1:] != self.image_shape:
            raise DataError(f"{self.path}: images must be uint8 (n, {', '.join(map(str, self.image_shape))}), "
                            f"got {images.dtype} {images.shape}")
        if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
            raise DataError(f"{self.path}: labels must be integers of shape ({n},), got {labels.dtype} {labels.shape}")
        bad = np.flatnonzero((labels < 0) | (labels >= len(self.classes)))
        if bad.size:
            raise DataError(f"{self.path}: label {int(labels[bad[0]])} is outside 0..{len(self.classes) - 1}")
        if split not in self.sizes or not 0 <= start <= self.sizes[split] - n:
            raise DataError(f"{self.path}: rows {start}..{start + n - 1} do not fit split '{split}' "
                            f"({self.sizes.get(split, 0)} images)")
        g = self.file[split]
        try:
            g["images"][start:start + n] = images
            g["labels"][start:start + n] = labels
        except OSError as e:  # a full disk or quota, an I/O error: the partial file goes, one error names it
            size = os.path.getsize(self.partial)
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(self.partial))).free  # before the removal
            self.abort()
            if _errno(e) == errno.ENOSPC:  # another process took the space the check saw free
                raise self._no_space(self.planned - size, f"writing failed: {_reason(e)}", free) from None
            raise DataError(f"{self.path}: writing failed ({_reason(e)}); the partial file was removed") from None
        self.written[split] += n
        if split == "train":
            for c in range(self.image_shape[0]):
                self.hist[c] += np.bincount(images[:, c].ravel(), minlength=256)
            per = max(1, (1 << 20) // int(np.prod(self.image_shape[1:])))  # images per ~1 M float64 values
            for s in range(0, n, per):
                pixels = images[s:s + per].transpose(1, 0, 2, 3).reshape(self.image_shape[0], -1).astype(np.float64)
                self.moments += pixels @ pixels.T  # (C, C)

    def _row_bytes(self) -> int:
        """Bytes of one image and its label in the file."""
        return int(np.prod(self.image_shape)) + 8

    def _check_space(self, planned: int, written: int) -> None:
        """DataError (`_no_space`) unless the disk has room for `planned` bytes of datasets, `written` of them
        on disk already, plus 1 MiB for HDF5's own structures."""
        folder = os.path.dirname(os.path.abspath(self.partial))
        if shutil.disk_usage(folder).free < planned - written + (1 << 20):
            raise self._no_space(planned - written)

    def _no_space(self, needed: int, cause: str = "", free: int | None = None) -> DataError:
        """The one-line error of a disk without room for the file: the folder, what it needs (`needed` bytes of
        datasets not yet on disk, plus 1 MiB for HDF5), what is free (`free`: measured before the partial file
        was removed, which frees its bytes again; default now), and `cause` (the failed call's error)."""
        folder = os.path.dirname(os.path.abspath(self.partial))
        free = shutil.disk_usage(folder).free if free is None else free
        why = f" ({cause})" if cause else ""
        gone = "; the partial file was removed" if cause else ""
        return DataError(f"{self.path}: not enough free space in {folder}{why}: the file needs "
                         f"{_amount(max(0, needed) + (1 << 20))} more, {_amount(free)} are free{gone}")

    def close(self) -> None:
        """Write mean/std, check every split is complete, and move the file into place."""
        short = [f"{s}: {self.written[s]} of {n}" for s, n in self.sizes.items() if self.written[s] < n]
        if short:
            self.abort()
            raise DataError(f"{self.path}: splits written incompletely ({'; '.join(short)} images)")
        if not self.sizes:
            self.abort()
            raise DataError(f"{self.path}: no split written")
        values = np.arange(256, dtype=np.float64)
        if self.hist.sum():
            n = self.hist.sum(axis=1).astype(np.float64)
            mean = self.hist @ values / n
            std = np.sqrt(np.einsum("cv,cv->c", self.hist, (values[None] - mean[:, None]) ** 2) / n)
            cov = self.moments / n[0] - np.outer(mean, mean)
            std[std == 0] = 1.0
        else:  # a test-only file: no statistics of its own (the training file's are used)
            mean, std = np.zeros(self.image_shape[0]), np.ones(self.image_shape[0])
            cov = np.eye(self.image_shape[0])
        self.file.attrs["mean"] = mean.astype(np.float32)
        self.file.attrs["std"] = std.astype(np.float32)
        self.file.attrs["pixel_cov"] = cov
        self.file.close()
        try:
            os.replace(self.partial, self.path)
        except OSError as e:
            os.remove(self.partial)
            raise DataError(f"{self.path}: cannot move the written file into place ({e})") from None

    def abort(self) -> None:
        """Remove the partial file and close it (removed first: closing flushes, which fails on a full disk)."""
        if os.path.exists(self.partial):
            os.remove(self.partial)
        try:
            self.file.close()
        except (OSError, RuntimeError):
            pass  # its buffers had nowhere to go; the file is gone anyway


def _amount(nbytes: int) -> str:
    """A byte count for a message: "1.57 GB", "3.1 MB", "40 kB"."""
    if nbytes >= 10**9:
        return f"{nbytes / 1e9:.2f} GB"
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 10**6 else f"{nbytes / 1e3:.0f} kB"


def _reason(e: BaseException) -> str:
    """The cause of a failed HDF5 call in a few words: "[Errno 28] No space left on device" (h5py puts the errno
    in its multi-line text), else the text's first line."""
    number = _errno(e)
    return f"[Errno {number}] {os.strerror(number)}" if number else str(e).splitlines()[0]


def _errno(e: BaseException) -> int | None:
    """The errno of a failed HDF5 call: the exception's, else the one in h5py's text ("errno = 28")."""
    return getattr(e, "errno", None) or next((int(m) for m in re.findall(r"errno = (\d+)", str(e))), None)


def _probe(path: str) -> None:
    """Open and close `path` for reading: BlockingIOError while another process writes it (HDF5's lock); any other
    failure (a killed conversion's file that cannot be read) is none of the caller's concern."""
    import h5py

    try:
        h5py.File(path, "r").close()
    except BlockingIOError:
        raise
    except OSError:
        pass


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def mpiasgd_file_kind(f: Any) -> str:
    """What other mpiasgd file the open HDF5 file `f` is: "run log" (its /pushes and /updates tables),
    "checkpoint" (its format attribute, `checkpoint.FORMAT`'s prefix), or "" (neither)."""
    if _text(f.attrs.get("format", "")).startswith("mpiasgd-checkpoint"):
        return "checkpoint"
    return "run log" if "pushes" in f and "updates" in f else ""


INTERRUPTED = "the conversion writing it was interrupted before it finished"


def _target(path: str) -> str:
    """The dataset file that `path` (PATH.partial, or an incomplete file under its final name) is to become."""
    return path[:-len(PARTIAL)] if path.endswith(PARTIAL) else path


RUNNING = " is being written by a conversion still running (it holds the file's lock)"


def still_running(path: str) -> str:
    """The end of a message naming `path`, a file another process holds HDF5's lock on: a conversion writing it."""
    return f"{RUNNING}; wait for it to finish, then use {_target(path)}"


def redo_advice(path: str, attrs: Any = None) -> str | None:
    """How to redo the conversion which left `path` incomplete (a killed `mpiasgd data convert` or `synth`):
    "redo it: COMMAND" with the command stored in the file (`H5Writer`'s `command`), else a sentence saying the
    file does not record it, with what it was converting where the file says. None while a conversion still
    writes it (another process holds HDF5's lock on the file). `attrs`: the file's attributes, when it is open
    already."""
    import h5py

    command, source = "", ""
    try:
        if attrs is None:
            with h5py.File(path, "r") as f:
                attrs = dict(f.attrs)
        command, source = _text(attrs.get("command", "")), _text(attrs.get("source", ""))
    except BlockingIOError:  # the writer is alive
        return None
    except (OSError, KeyError, RuntimeError):  # killed before its first flush: nothing of it can be read
        pass
    if command:
        return f"redo it: {command}"
    what = f" (it was converting: {source})" if source else ""
    return (f"the file does not record the command that wrote it{what}; run that `mpiasgd data convert` or "
            f"`mpiasgd data synth` again, with {_target(path)} as OUT.h5")


def identity(path: str) -> tuple[int, int, int, int, int]:
    """(device, inode, size in bytes, modification time ns, status-change time ns) of the file at `path`: what
    changes when it is rewritten in place (size, times: a write with its modification time set back still moves
    the status-change time) or replaced by another file (device, inode)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _clock(ns: int) -> str:
    """A file time in ns as 'YYYY-MM-DD HH:MM:SS.mmm' UTC."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns // 10**6 % 1000:03d}"


def _created(path: str) -> str:
    """The `created` attribute of the dataset file at `path` (what a conversion stamps it with); '' if unreadable."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return _text(f.attrs.get("created", ""))
    except (OSError, KeyError, RuntimeError):  # still being written, truncated, not HDF5: no stamp to compare
        return ""


def what_changed(path: str, was: tuple[int, ...], now: tuple[int, ...], created: str) -> str:
    """What differs between two `identity` tuples of the file at `path`, e.g. "replaced by another file: inode
    51 -> 77; modified 2026-12-06 04:40:01.123 -> 04:40:03.456 UTC; another conversion: created ... -> ...".
    `created`: the opened file's `created` attribute, compared with the new file's when it was replaced (a copy
    keeps it; a conversion stamps the second it began). Only what differs is said."""
    parts = []
    if was[:2] != now[:2]:
        where = f"device {was[0]} -> {now[0]}, " if was[0] != now[0] else ""
        parts.append(f"replaced by another file: {where}inode {was[1]} -> {now[1]}")
    if was[2] != now[2]:
        parts.append(f"size {was[2]:,} -> {now[2]:,} bytes")
    if was[3] != now[3]:
        old, new = _clock(was[3]), _clock(now[3])
        parts.append(f"modified {old} -> {new[11:] if new[:10] == old[:10] else new} UTC")
    elif was[4] != now[4]:
        parts.append(f"written in place with its modification time kept (status changed {_clock(was[4])} -> "
                     f"{_clock(now[4])} UTC)")
    if was[:2] != now[:2] and created:
        stamp = _created(path)
        if stamp and stamp != created:
            parts.append(f"another conversion: created {created} -> {stamp}")
    return "; ".join(parts)


class ChunkCache:
    """The most recently read chunks of one split's images (an LRU of `capacity` chunks), plus chunks pinned
    in memory for good (`pin`: a worker's whole shard with --data-in-memory). Thread-safe.

    Before each read from the file it checks that the file at `path` is still the one opened (`identity`):
    HDF5 reads zeros past the end of a file truncated under it, and another file at the same path would
    mix two datasets. DataError naming the file and what changed then (`what_changed`; `created`: the
    file's `created` attribute)."""

    def __init__(self, images: Any, chunk: int, capacity: int, path: str = "", created: str = "") -> None:
        self.images, self.chunk, self.capacity = images, chunk, max(1, capacity)
        self.path, self.created = path, created
        self.opened = identity(path) if path else None
        self.recent: OrderedDict[int, np.ndarray] = OrderedDict()
        self.pinned: dict[int, np.ndarray] = {}
        self.reads = 0  # chunks read from the file
        self.lock = threading.Lock()

    def read(self, c: int) -> np.ndarray:
        with self.lock:
            got = self.pinned.get(c)
            if got is None:
                got = self.recent.get(c)
                if got is None:
                    self.check()
                    got = self.images[c * self.chunk:(c + 1) * self.chunk]  # one HDF5 chunk, one read
                    self.reads += 1
                    self.recent[c] = got
                    if len(self.recent) > self.capacity:
                        self.recent.popitem(last=False)
                else:
                    self.recent.move_to_end(c)
            return got

    def check(self) -> None:
        """DataError unless the file at `path` is the one opened (not rewritten, truncated, replaced or gone)."""
        if self.opened is None:
            return
        try:
            now = identity(self.path)
        except OSError as e:
            raise DataError(f"{self.path}: the dataset file went away while the run reads it ({e.strerror})") from None
        if now != self.opened:
            raise DataError(f"{self.path}: the dataset file changed while the run reads it "
                            f"({what_changed(self.path, self.opened, now, self.created)}); rerun, or --resume, "
                            "once it is complete")

    def pin(self, chunks: np.ndarray) -> None:
        for c in np.unique(chunks):
            self.pinned[int(c)] = self.read(int(c))
        with self.lock:
            self.recent.clear()

    def gather(self, idx: np.ndarray) -> np.ndarray:
        """uint8 (len(idx), C, H, W): the images at `idx`, chunk by chunk."""
        out = np.empty((idx.size, *self.images.shape[1:]), dtype=np.uint8)
        chunks = idx // self.chunk
        for c in np.unique(chunks):
            rows = np.flatnonzero(chunks == c)
            out[rows] = self.read(int(c))[idx[rows] - c * self.chunk]
        return out


class H5Dataset(Splits):
    """A dataset file (see the module doc) opened for training: labels, class names, mean and std in memory,
    images read from disk on request a chunk at a time (`batch`). The same interface as the in-memory
    `Dataset` (`image_shape`, `train_y`, `test_y`, `batch`), plus `chunk`, the images per chunk that the
    sampler keeps together.

    path: the file; test_path: another file whose test split to use (None: this file's). cache_chunks:
    chunks of each split kept after reading (the shuffle window plus a little: each chunk is then read
    once per epoch). Raises DataError naming the file for anything malformed or truncated.
    """

    def __init__(self, path: str, test_path: str | None = None, cache_chunks: int = 32,
                 augmentation: Any = None) -> None:
        self.path = path
        info = self._open(path, need="train")
        self.file, a = info
        self.name = _text(a["name"])
        self.classes = self._classes(path, a)
        self.mean, self.std = self._stats(path, a)
        cov = np.asarray(a.get("pixel_cov", np.eye(self.mean.size)), dtype=np.float64)
        self.pixel_cov = cov if cov.shape == (self.mean.size, self.mean.size) and np.all(np.isfinite(cov)) else None
        self.source = os.path.abspath(path)
        train = self._split(path, self.file, "train", len(self.classes))
        self.image_shape = tuple(int(d) for d in train[0].shape[1:])
        if self.mean.shape != (self.image_shape[0],) or self.std.shape != (self.image_shape[0],):
            raise DataError(f"{path}: attributes mean and std must be float (C,) = ({self.image_shape[0]},), "
                            f"got {self.mean.shape} and {self.std.shape}")
        if test_path:
            tfile, ta = self._open(test_path, need="test")
            tclasses = self._classes(test_path, ta)
            if tclasses != self.classes:
                raise DataError(f"{test_path}: its classes {list(tclasses[:5])}... differ from those of {path} "
                                f"{list(self.classes[:5])}...")
        else:
            tfile, test_path = self.file, path
        test = self._split(test_path, tfile, "test", len(self.classes)) if "test" in tfile else None
        if test is not None and tuple(test[0].shape[1:]) != self.image_shape:
            raise DataError(f"{test_path}: test images are {tuple(test[0].shape[1:])}, train images "
                            f"{self.image_shape} ({path})")
        self.train_y = train[1]
        self.test_y = test[1] if test is not None else np.zeros(0, dtype=np.int64)
        self.chunk = int(train[0].chunks[0])
        self.caches = {"train": ChunkCache(train[0], self.chunk, cache_chunks, path, _text(a.get("created", "")))}
        if test is not None:
            self.caches["test"] = ChunkCache(test[0], int(test[0].chunks[0]), cache_chunks, test_path,
                                             _text(tfile.attrs.get("created", "")))
        # what identifies the file's content (a run log keeps it; a resume checks that the file is the same)
        self.fingerprint = json.dumps({"name": self.name, "created": _text(a.get("created", "")),
                                       "train": self.num_train, "test": self.num_test, "chunk": self.chunk,
                                       "shape": list(self.image_shape), "classes": len(self.classes)})
        self.augmentation = augmentation if augmentation is not None else Augmentation.default(self.image_shape)

    @staticmethod
    def _open(path: str, need: str) -> tuple[Any, Any]:
        import h5py

        if not os.path.isfile(path):
            partial = path + PARTIAL
            if os.path.isfile(partial):  # what a conversion still running, or a killed one, leaves
                redo = redo_advice(partial)
                if redo is None:
                    raise DataError(f"dataset file {path} does not exist yet: {partial}{still_running(partial)}")
                raise DataError(f"dataset file {path} does not exist; {partial} is an incomplete one: {INTERRUPTED}; "
                                f"{redo}")
            what = "is not a file" if os.path.exists(path) else "does not exist"
            raise DataError(f"dataset file {path} {what}; expected an HDF5 file written by `mpiasgd data convert`")
        try:
            f = h5py.File(path, "r")
        except OSError as e:
            if path.endswith(PARTIAL):
                H5Dataset._incomplete(path, redo_advice(path))
            raise DataError(f"{path}: not a readable HDF5 file, truncated or not HDF5 ({e})") from None
        a = f.attrs
        fmt = _text(a.get("format", ""))
        if fmt != FORMAT:
            kind = mpiasgd_file_kind(f)
            f.close()
            if kind:
                raise DataError(f"{path} is an mpiasgd {kind}, not a dataset; --data takes a file written by "
                                "`mpiasgd data convert`")
            raise DataError(f"{path}: attribute format is {fmt!r}, expected {FORMAT!r} (a file written by "
                            "`mpiasgd data convert` or `mpiasgd data synth`)")
        if "mean" not in a:  # written last (H5Writer.close): the conversion never got there
            redo = redo_advice(path, a)
            f.close()
            H5Dataset._incomplete(path, redo)
        if need not in f:
            holds = sorted(f)
            f.close()
            raise DataError(f"{path}: has no '{need}' split (it holds {holds}); expected /{need}/images and "
                            f"/{need}/labels")
        return f, a

    @staticmethod
    def _incomplete(path: str, redo: str | None) -> None:
        """Raise the DataError of `path`, a file a conversion is still writing (`redo` None) or left incomplete."""
        if redo is None:
            raise DataError(f"{path}{still_running(path)}")
        raise DataError(f"{path}: an incomplete dataset file: {INTERRUPTED}; {redo}")

    @staticmethod
    def _classes(path: str, a: Any) -> tuple[str, ...]:
        try:
            classes = json.loads(_text(a["classes"]))
        except (KeyError, ValueError) as e:
            raise DataError(f"{path}: attribute classes must be a JSON list of class names ({e})") from None
        if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
            raise DataError(f"{path}: attribute classes must be a non-empty JSON list of strings")
        return tuple(classes)

    @staticmethod
    def _stats(path: str, a: Any) -> tuple[np.ndarray, np.ndarray]:
        try:
            mean = np.asarray(a["mean"], dtype=np.float32).reshape(-1)
            std = np.asarray(a["std"], dtype=np.float32).reshape(-1)
        except (KeyError, ValueError, TypeError) as e:
            raise DataError(f"{path}: attributes mean and std must be per-channel numbers ({e})") from None
        if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std > 0)):
            raise DataError(f"{path}: attributes mean {mean} and std {std} must be finite, std > 0")
        mean.setflags(write=False)
        std.setflags(write=False)
        return mean, std

    @staticmethod
    def _split(path: str, f: Any, split: str, num_classes: int) -> tuple[Any, np.ndarray]:
        import h5py

        g = f[split]
        images, labels = g.get("images"), g.get("labels")
        if not isinstance(images, h5py.Dataset) or not isinstance(labels, h5py.Dataset):
            raise DataError(f"{path}: /{split} must hold the datasets images and labels")
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[0] == 0:
            raise DataError(f"{path}: /{split}/images must be uint8 (N, C, H, W) with N > 0, got {images.dtype} "
                            f"{images.shape}")
        if images.chunks is None or images.chunks[1:] != images.shape[1:]:
            raise DataError(f"{path}: /{split}/images must be chunked by whole images (chunks (n, C, H, W)), got "
                            f"{images.chunks}")
        if labels.shape != (images.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
            raise DataError(f"{path}: /{split}/labels must be integers ({images.shape[0]},), got {labels.dtype} "
                            f"{labels.shape}")
        try:
            y = np.asarray(labels[...], dtype=np.int64)
            images[images.shape[0] - 1]  # the last image: a truncated file fails here, not in training
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: /{split} cannot be read, the file is truncated or damaged ({e})") from None
        bad = np.flatnonzero((y < 0) | (y >= num_classes))
        if bad.size:
            raise DataError(f"{path}: /{split}/labels[{int(bad[0])}] = {int(y[bad[0]])} is outside "
                            f"0..{num_classes - 1} ({num_classes} classes)")
        y.setflags(write=False)
        return images, y

    def with_augmentation(self, augmentation: Any) -> H5Dataset:
        """Train with `augmentation` (`augment.Augmentation`) from now on; returns self. DataError if it cannot
        apply to this file's images."""
        try:
            augmentation.check(self.image_shape, self.pixel_cov)
        except DataError as e:
            raise DataError(f"{self.path}: {e}") from None
        self.augmentation = augmentation
        return self

    def keep_in_memory(self, idx: np.ndarray) -> None:
        """Read the chunks of training images `idx` (a worker's shard) into memory for the whole run."""
        self.caches["train"].pin(np.asarray(idx) // self.chunk)

    def images(self, split: str, idx: np.ndarray) -> np.ndarray:
        """Raw uint8 (len(idx), C, H, W) images of `split` at int indices `idx`, read a chunk at a time."""
        if split not in self.caches:
            raise ValueError(f"split must be one of {sorted(self.caches)}, got {split!r}")
        idx = np.asarray(idx, dtype=np.int64)
        try:
            return self.caches[split].gather(idx)
        except OSError as e:
            raise DataError(f"{self.path}: reading /{split}/images failed ({e})") from None

    def batch(self, split: str, idx: np.ndarray, rng: np.random.Generator | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """A minibatch: x float32 (B, C', H', W') augmented (train, with an rng) and normalised by the file's
        mean and std, and y int64 (B,). See `Dataset.batch`; the augmentation is `self.augmentation`."""
        ys = self.train_y if split == "train" else self.test_y
        idx = np.asarray(idx, dtype=np.int64)
        raw = self.images(split, idx)
        if split == "train" and rng is not None:
            return self.augmentation.train(raw, rng, self.mean, self.std, self.pixel_cov), ys[idx]
        return self.augmentation.test(raw, self.mean, self.std), ys[idx]

    def close(self) -> None:
        self.file.close()

