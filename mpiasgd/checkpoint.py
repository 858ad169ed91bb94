"""Checkpoints: the whole training state in one HDF5 file, written atomically by rank 0.

`RUN_DIR/NAME.ckpt.h5`, next to the run log, replaced at every checkpoint:

    params       float32 (P,)   the weights (async/ssp: the master weights; sync: the workers' common
                                copy; pipeline: every module's slice, assembled)
    momentum     float32 (P,)   the optimizer's velocity (zeros when momentum is 0; async/ssp with
                                nsync > 1: the server's, the workers' local velocities are not kept)
    buffers      float32 (B,)   the layers' buffers (BatchNorm's running statistics; absent when the
                                network has none): async/ssp/easgd: rank 0's average of the workers'
                                latest; sync: the replicas' common copy; pipeline: every module's
    workers      WORKER_STATE (W,): each worker's rank, step (pushes or sync steps made, or pipeline
                                iterations), cursor (minibatches it drew from its shard: its data
                                position), rejected (non-finite pushes)
    shard_versions int64 (S,)   --servers S > 1 only: every parameter-server shard's version, shard 0's
                                (= `version`) first; params and momentum are then every shard's slice,
                                assembled (each as that shard had it when rank 0 asked). A resume sends
                                each shard its slice and version; DC-ASGD's running mean square
                                (--dc-adaptive) is not kept, with one server or many
    wire_bytes   int64 (S, 2)   async/ssp/easgd: the bytes each parameter-server shard had moved at this
                                state, (pushed, pulled), headers included (shard 0 alone with one server;
                                absent in the other modes and in checkpoints written before it was kept):
                                a resume continues the counts from here, whether or not the run log got
                                its /wire_bytes rows (a launcher's SIGKILL right after a signal's
                                checkpoint leaves them unwritten)
    attrs        format, mode, model, num_workers, num_params, version (server updates / sync steps /
                 pipeline minibatches), samples, elapsed (seconds of training the state holds: the
                 schedule's clock), log_time (the run log's clock when it was written), reason,
                 config (JSON), log (the run log's path), run_id (the log's: a resume checks the log
                 is this run's), model_spec (the network's definition, JSON: `mpiasgd.model.spec`),
                 staleness_sum/_max/_count, created, and crc32: a CRC-32 of every array and every
                 attribute above, checked on load with the values' ranges

Random state: the initial weights, the shards and each epoch's shuffle derive from `seed`; the
augmentation of minibatch b of a worker's stream comes from `batch_rng(seed, stream, b)`. So the
seed and the cursors are every random state there is, and a resumed run draws exactly the data
and augmentation the uninterrupted run would have.

Writes are atomic (`write`): a temporary file in the same directory, flushed and fsynced, renamed
over the old checkpoint, then the directory fsynced. A process killed at any moment leaves either
the old or the new checkpoint, never a torn one. `load` verifies the CRC-32s.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import h5py
import numpy as np

from mpiasgd.data.h5data import FORMAT as DATA_FORMAT
from mpiasgd.data.h5data import mpiasgd_file_kind
from mpiasgd.files import PIECE, checkpoint_path, ensure_free_space, os_error  # (checkpoint_path: callers name it here)

FORMAT = "mpiasgd-checkpoint-1"
WORKER_STATE = np.dtype([("rank", "<i4"), ("step", "<i8"), ("cursor", "<i8"), ("rejected", "<i8")])


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, torn or from another run (the message names the file)."""


SCALARS = ("mode", "model", "config", "log", "reason", "run_id", "version", "samples", "staleness_sum",
           "staleness_max", "staleness_count", "elapsed", "log_time")


def crc32(ckpt: Checkpoint) -> int:
    """CRC-32 of the arrays' bytes and of the scalar fields (as JSON): what `load` checks."""
    crc = 0
    optional = (ckpt.buffers, ckpt.shard_versions, ckpt.wire_bytes)  # (absent when empty: older files match)
    arrays = (ckpt.params, ckpt.momentum, ckpt.workers, *(a for a in optional if a.size))
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), crc)
    scalars = [getattr(ckpt, key) for key in SCALARS] + ([ckpt.model_spec] if ckpt.model_spec else [])
    return zlib.crc32(json.dumps(scalars).encode(), crc)


@dataclass
class Checkpoint:
    """The training state of a run (see the module docstring for every field's meaning)."""

    params: np.ndarray
    momentum: np.ndarray
    workers: np.ndarray
    version: int
    samples: int
    elapsed: float
    log_time: float
    config: str
    log: str
    mode: str
    model: str
    reason: str = ""
    run_id: str = ""
    staleness_sum: int = 0
    staleness_max: int = 0
    staleness_count: int = 0
    path: str = ""
    buffers: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    model_spec: str = ""  # JSON text; "" in checkpoints written before networks had stored definitions
    shard_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (S,), --servers S > 1
    wire_bytes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))  # (S, 2) bytes pushed, pulled

    @property
    def num_workers(self) -> int:
        return int(self.workers.size)

    def steps(self) -> list[tuple[int, int]]:
        """(worker rank, step) of every worker: the cut a resume continues from (`RunLog.reopen`)."""
        return list(zip(self.workers["rank"].tolist(), self.workers["step"].tolist(), strict=True))

    def worker(self, rank: int) -> np.void:
        """The WORKER_STATE row of worker `rank`."""
        return self.workers[int(np.flatnonzero(self.workers["rank"] == rank)[0])]


def write(path: str, ckpt: Checkpoint, between: Callable[[], None] | None = None) -> float:
    """Write `ckpt` to `path` atomically (see the module docstring); returns the seconds it took.

    Raises OSError (disk full, permissions) with a one-line text, e.g. "[Errno 28] No space left on
    device" (h5py's multi-line errors and RuntimeErrors are turned into it): the previous checkpoint
    is left as it was, and the temporary file is removed. The free space is checked first
    (`runlog.ensure_free_space`: params and momentum, 2 x P x 4 bytes, plus 5 % and 1 MiB); a write
    that fails anyway prints nothing (h5py's "Exception ignored" reports of its objects' failing
    closes are kept back and become the OSError).

    `between` is called between the write's steps (after each piece of PIECE values of params and momentum, and
    before the fsync), where the write can take long (a 60 MB checkpoint: up to a second on a busy disk): rank 0
    answers a signal there (`Rank0.close_log_on_signal`) instead of after the write.
    """
    step = between or (lambda: None)
    t0 = time.perf_counter()
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    remove_stale_temporaries(path)
    size = (2 * int(ckpt.params.size) + int(ckpt.buffers.size)) * 4 + ckpt.workers.size * WORKER_STATE.itemsize
    ensure_free_space(tmp, size)  # ENOSPC before HDF5 is called: on a full disk it fails noisily, even crashes
    try:
        with _quiet_hdf5_cleanup(tmp), h5py.File(tmp, "w") as f:
            _write_in_pieces(f, "params", ckpt.params, step)
            _write_in_pieces(f, "momentum", ckpt.momentum, step)
            f.create_dataset("workers", data=ckpt.workers.astype(WORKER_STATE, copy=False))
            if ckpt.buffers.size:
                f.create_dataset("buffers", data=ckpt.buffers.astype(np.float32, copy=False))
            if ckpt.shard_versions.size:
                ckpt.shard_versions = ckpt.shard_versions.astype(np.int64, copy=False)
                f.create_dataset("shard_versions", data=ckpt.shard_versions)
            if ckpt.wire_bytes.size:
                ckpt.wire_bytes = ckpt.wire_bytes.astype(np.int64, copy=False).reshape(-1, 2)
                f.create_dataset("wire_bytes", data=ckpt.wire_bytes)
            a = f.attrs
            if ckpt.model_spec:
                a["model_spec"] = ckpt.model_spec
            a["format"] = FORMAT
            for key in ("mode", "model", "config", "log", "reason", "run_id"):
                a[key] = getattr(ckpt, key)
            for key in ("version", "samples", "staleness_sum", "staleness_max", "staleness_count"):
                setattr(ckpt, key, int(getattr(ckpt, key)))
                a[key] = getattr(ckpt, key)
            ckpt.elapsed, ckpt.log_time = float(ckpt.elapsed), float(ckpt.log_time)
            a["elapsed"], a["log_time"] = ckpt.elapsed, ckpt.log_time
            a["num_workers"], a["num_params"] = ckpt.num_workers, int(ckpt.params.size)
            a["crc32"] = crc32(ckpt)
            a["created"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        step()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data is on disk before the name points at it
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)  # and the rename itself
        finally:
            os.close(fd)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, (OSError, RuntimeError)):  # RuntimeError: h5py's, when HDF5 fails to write
            raise os_error(e) from e
        raise
    return time.perf_counter() - t0


def _write_in_pieces(f: h5py.File, name: str, values: np.ndarray, step: Callable[[], None]) -> None:
    """Write the (P,) `values` as float32 dataset `name` of `f`, PIECE values at a time, calling `step` after
    each: h5py serialises every HDF5 call of the process, so rank 0's signal thread, closing the run log the
    moment a signal arrives (`signals.watching`), waits for one piece at most, not for the whole array."""
    values = values.astype(np.float32, copy=False)
    ds = f.create_dataset(name, shape=values.shape, dtype=np.float32)
    flat = values.reshape(-1)
    for start in range(0, flat.size, PIECE):
        ds[start:start + PIECE] = flat[start:start + PIECE]
        step()
    if not flat.size:
        step()


@contextlib.contextmanager
def _quiet_hdf5_cleanup(tmp: str):
    """Keep back what h5py prints when an object of the file `tmp` fails to close (its data cannot be written:
    disk full): a traceback written straight to sys.stderr, then "Exception ignored in: ObjectID.__dealloc__"
    through sys.unraisablehook. The first such error is raised on leaving (a write that lost data must not
    look done); stderr text and reports about anything else are passed on."""
    kept: list[BaseException] = []
    previous_hook, previous_stderr, captured = sys.unraisablehook, sys.stderr, io.StringIO()

    def hook(report) -> None:
        if os.path.basename(tmp) in str(report.exc_value):
            kept.append(report.exc_value)
        else:
            previous_hook(report)

    sys.unraisablehook, sys.stderr = hook, captured
    try:
        yield
    finally:
        sys.unraisablehook, sys.stderr = previous_hook, previous_stderr
        text = captured.getvalue()
        if text and os.path.basename(tmp) not in text:
            previous_stderr.write(text)
    if kept:
        raise kept[0]


def remove_stale_temporaries(path: str) -> list[str]:
    """Delete the temporary files of checkpoints of `path` whose writer died mid-write (kill -9, node
    failure); returns their paths. A live writer's file (its pid exists on this host) is kept."""
    directory, prefix = os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp."
    removed = []
    for name in os.listdir(directory):
        pid = name[len(prefix):]
        stale = pid.isdigit() and (int(pid) == os.getpid() or not os.path.exists(f"/proc/{pid}"))
        if name.startswith(prefix) and stale:
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    return removed


@contextlib.contextmanager
def _opened(path: str):
    """The checkpoint file at `path`, open for reading, its format checked; every failure to find, open or
    read it (inside the `with` too) is a CheckpointError naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint '{path}' not found" + (" (it is a directory)" if os.path.isdir(path)
                                                                  else _why_missing(path)))
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(_not_a_checkpoint(path, f))
            yield f
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint '{path}' cannot be read: {e}") from None


def _why_missing(path: str) -> str:
    """What is beside a checkpoint `path` that does not exist: the unfinished write of a rank 0 killed while it wrote
    (`.NAME.tmp.PID`, nothing to resume from), and the run log of the same name, a run that wrote no checkpoint
    (killed before its first: --checkpoint-interval, or at the end or a signal); "" if neither."""
    directory = os.path.dirname(os.path.abspath(path))
    prefix = f".{os.path.basename(path)}.tmp."
    try:
        torn = sorted(n for n in os.listdir(directory) if n.startswith(prefix))
    except OSError:
        return ""
    notes = []
    if torn:
        notes.append(f"'{os.path.join(os.path.dirname(path), torn[-1])}' is a write that did not finish (rank 0 "
                     "was killed while it wrote: it holds nothing to resume from)")
    log = path[:-len(".ckpt.h5")] + ".h5" if path.endswith(".ckpt.h5") else ""
    if log and os.path.isfile(log):
        notes.append(f"its run log '{log}' is of a run that wrote no checkpoint (ended or killed before its first: "
                     "every --checkpoint-interval seconds, at the end and on a signal); start it again (--overwrite)")
    return f": {'; '.join(notes)}" if notes else ""


def _not_a_checkpoint(path: str, f: h5py.File) -> str:
    """What the open HDF5 file `f` at `path` is instead of a checkpoint, and which file to give: a run log
    (its run's name, and its checkpoint NAME.ckpt.h5 when that is beside it), a dataset, or another file."""
    if mpiasgd_file_kind(f) == "run log":
        try:
            name = json.loads(f.attrs["config"])["name"]
        except (KeyError, TypeError, ValueError):  # (a log without a readable config: its file's name)
            name = os.path.basename(path)[:-3] if path.endswith(".h5") else os.path.basename(path)
        ckpt = checkpoint_path(path)
        where = (f"its checkpoint is '{ckpt}'" if os.path.isfile(ckpt) else
                 f"its run's checkpoint would be '{ckpt}', which does not exist (a run writes it every "
                 "--checkpoint-interval seconds and at its end)")
        return f"'{path}' is the run log of run '{name}', not a checkpoint: {where}"
    if f.attrs.get("format") == DATA_FORMAT:
        return (f"'{path}' is a dataset file (made by `mpiasgd data`), not a checkpoint: a run's "
                "checkpoint is the NAME.ckpt.h5 beside its run log NAME.h5")
    return f"'{path}' is not an mpiasgd checkpoint (format attribute {f.attrs.get('format')!r}, expected {FORMAT!r})"


def load(path: str) -> Checkpoint:
    """Read and verify the checkpoint at `path`; CheckpointError naming the file and what is wrong."""
    with _opened(path) as f:
        a = f.attrs
        ckpt = Checkpoint(
            params=f["params"][()], momentum=f["momentum"][()], workers=f["workers"][()],
            version=int(a["version"]), samples=int(a["samples"]), elapsed=float(a["elapsed"]),
            log_time=float(a["log_time"]), config=str(a["config"]), log=str(a["log"]), mode=str(a["mode"]),
            model=str(a["model"]), reason=str(a["reason"]), run_id=str(a["run_id"]),
            staleness_sum=int(a["staleness_sum"]), staleness_max=int(a["staleness_max"]),
            staleness_count=int(a["staleness_count"]), path=path,
            buffers=f["buffers"][()] if "buffers" in f else np.zeros(0, np.float32),
            model_spec=str(a.get("model_spec", "")),
            shard_versions=f["shard_versions"][()] if "shard_versions" in f else np.zeros(0, np.int64),
            wire_bytes=f["wire_bytes"][()] if "wire_bytes" in f else np.zeros((0, 2), np.int64))
        stored = int(a["crc32"])
    if crc32(ckpt) != stored:
        raise CheckpointError(f"checkpoint '{path}' is corrupt: its contents do not match the CRC-32 stored with them")
    problem = check_values(ckpt)
    if problem:
        raise CheckpointError(f"checkpoint '{path}' is corrupt: {problem}")
    return ckpt


def check_values(ckpt: Checkpoint) -> str:
    """What is out of range in `ckpt` ("" if nothing): shapes, dtypes, counts, clocks."""
    w = ckpt.workers
    if ckpt.params.dtype != np.float32 or ckpt.params.ndim != 1 or ckpt.momentum.shape != ckpt.params.shape:
        return f"params {ckpt.params.dtype}{ckpt.params.shape}, momentum {ckpt.momentum.dtype}{ckpt.momentum.shape}"
    if not (np.isfinite(ckpt.params).all() and np.isfinite(ckpt.momentum).all()):
        return "non-finite weights or momentum"
    if ckpt.buffers.dtype != np.float32 or ckpt.buffers.ndim != 1 or not np.isfinite(ckpt.buffers).all():
        return f"buffers {ckpt.buffers.dtype}{ckpt.buffers.shape} (expected finite float32 (B,))"
    sv = ckpt.shard_versions
    if sv.dtype != np.int64 or sv.ndim != 1 or sv.size == 1 or (sv < 0).any():
        return f"shard_versions {sv.dtype}{sv.shape} {sv.tolist()} (expected none, or S >= 2 versions >= 0)"
    if sv.size and int(sv[0]) != ckpt.version:
        return f"shard_versions[0] = {int(sv[0])}, but version = {ckpt.version} (shard 0's)"
    wb, shards = ckpt.wire_bytes, max(1, sv.size)
    if wb.size and (wb.dtype != np.int64 or wb.shape != (shards, 2) or (wb < 0).any()):
        return f"wire_bytes {wb.dtype}{wb.shape} (expected none, or int64 ({shards}, 2) byte counts >= 0)"
    if w.dtype != WORKER_STATE or w.ndim != 1 or w.size < 1:
        return f"workers table {w.dtype} {w.shape}"
    if (w["rank"] < 1).any() or np.unique(w["rank"]).size != w.size:
        return f"worker ranks {w['rank'].tolist()} (expected distinct ranks >= 1)"
    for column in ("step", "cursor", "rejected"):
        if (w[column] < 0).any():
            return f"negative worker {column}s {w[column].tolist()}"
    for key in ("version", "samples", "staleness_sum", "staleness_max", "staleness_count"):
        if getattr(ckpt, key) < 0:
            return f"{key} = {getattr(ckpt, key)} (expected >= 0)"
    for key in ("elapsed", "log_time"):
        value = getattr(ckpt, key)
        if not (math.isfinite(value) and value >= 0):
            return f"{key} = {value} (expected seconds >= 0)"
    return ""


def load_model_spec(path: str) -> str:
    """The network definition (JSON text) stored in the checkpoint at `path`, "" for a checkpoint without one;
    read without the arrays (the full `load` verifies it with the rest)."""
    with _opened(path) as f:
        return str(f.attrs.get("model_spec", ""))


def load_config(path: str) -> dict:
    """The config (as a dict of keys) stored in the checkpoint at `path`, read without the arrays."""
    with _opened(path) as f:
        return json.loads(f.attrs["config"])
