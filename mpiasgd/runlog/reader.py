"""Reading a run log, also while it is being written or after its writer was killed.

`open_log` opens the HDF5 file (SWMR while a live writer holds the lock; stale flags cleared; a
truncated file a one-line error), `open_run` checks that a file is an mpiasgd run log, and `load`
reads what the summary and the offline tools need into a dict. Every error names the file: `reading`
turns what HDF5 raises on a damaged file into one, `require` names a missing table, `run_config` a
config attribute that is not JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator

import h5py
import numpy as np

from mpiasgd.runlog.lock import writer_alive
from mpiasgd.runlog.records import upgrade
from mpiasgd.runlog.superblock import SWMR_WRITE, clear_stale_flags, superblock_flags


class TruncatedLogError(OSError):
    """The run log is shorter than its superblock says (cut short): the message names the file and both sizes."""


class DamagedLogError(ValueError):
    """HDF5 opened the run log but cannot read part of it (a bad checksum, an object it cannot open)."""


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    """Read the run log at `path` inside this block: what h5py raises on a damaged file (OSError, RuntimeError
    or KeyError: "incorrect metadata checksum", "bad object header version number") becomes a DamagedLogError
    naming it. Keep only h5py reads inside: an error of another cause would be named damage too."""
    try:
        yield
    except (OSError, RuntimeError, KeyError) as e:
        text = " ".join(str(e.args[0] if e.args else e).split())  # one line; a KeyError's text without quotes
        raise DamagedLogError(f"run log '{path}': the file is damaged, HDF5 cannot read it ({text})") from None


def require(f: h5py.File, path: str, *names: str) -> None:
    """ValueError naming the file and the first of the tables `names` ("snapshots/meta") it lacks, or the group
    above it ("/snapshots"): every log mpiasgd writes has them, so the file was edited or damaged."""
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts) + 1):
            part = "/".join(parts[:depth])
            if part not in f:
                kind = "group" if depth < len(parts) else "table"
                raise ValueError(f"run log '{path}' has no /{part} {kind} (every run log mpiasgd writes has one: "
                                 f"the file was edited or is damaged)")


def run_config(path: str, text: str | bytes | None) -> dict:
    """The run's config: the `config` attribute `text` of the log at `path`, a JSON object ({} when empty).
    ValueError naming the file and the attribute when it is not JSON or not an object."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"run log '{path}': its config attribute is a {type(text).__name__}, expected JSON text")
    try:
        cfg = json.loads(text or "{}")
    except (ValueError, RecursionError) as e:
        raise ValueError(f"run log '{path}': its config attribute is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(cfg), "number")
        raise ValueError(f"run log '{path}': its config attribute holds a JSON {kind}, expected an object "
                         "({\"model\": ...})")
    return cfg


def open_log(path: str, mode: str = "r", hold_lock: bool = False) -> h5py.File:
    """Open a run log for reading (`mode` "r"), also while it is being written or after its writer was killed;
    other modes ("r+") open it for writing, flags a killed writer left cleared first (`clear_stale_flags`).

    Reading: while a live job holds the writer lock, in SWMR mode (unless `hold_lock`: the caller holds that
    lock itself and has not opened the file, so no one is writing it). Otherwise without SWMR first, so that a
    damaged file fails at once (HDF5's SWMR reader retries a truncated file for many minutes): a truncated
    file is a TruncatedLogError ("'x.h5' is truncated (5000 bytes, the file says 378542): ..."); a file
    a killed SWMR writer left open for writing is read in SWMR mode (every row up to its last flush);
    one a writer killed outside SWMR mode left open (in `RunLog.close`) has its flags cleared first.
    OSError (h5py's) for anything else that is not a readable HDF5 file.
    """
    if mode != "r":
        flags = superblock_flags(path)
        if flags and not flags & SWMR_WRITE:
            clear_stale_flags(path)
        return h5py.File(path, mode, libver="latest")
    if not hold_lock and writer_alive(path):
        return h5py.File(path, "r", libver="latest", swmr=True)
    try:
        return h5py.File(path, "r", libver="latest")
    except OSError as e:
        text = str(e)
        truncated = re.search(r"truncated file: eof = (\d+),.*stored_eof = (\d+)", text)
        if truncated:
            raise TruncatedLogError(f"'{path}' is truncated ({truncated.group(1)} bytes, the file says "
                                    f"{truncated.group(2)}): it was cut short (a copy or a disk that filled up); "
                                    f"it cannot be read") from None
        if "already open for write" not in text:
            raise
    flags = superblock_flags(path) or 0
    if flags & SWMR_WRITE:  # a killed SWMR writer: readable in SWMR mode up to its last flush
        return h5py.File(path, "r", libver="latest", swmr=True)
    if not clear_stale_flags(path):
        raise OSError(f"run log '{path}' was left marked open for writing by a writer that was killed, and its "
                      f"flags could not be cleared (run `h5clear -s {path}`)")
    return h5py.File(path, "r", libver="latest")


def _attr(f, key: str, default=None):
    value = f.attrs.get(key, default)
    return value.decode() if isinstance(value, bytes) else value


def open_run(path: str) -> h5py.File:
    """Open the run log at `path` for reading (`open_log`: SWMR while it is written), checking that it is one.

    Raises FileNotFoundError if it does not exist, IsADirectoryError for a directory (naming the .h5
    files in it), ValueError if it is empty or not an mpiasgd run log, DamagedLogError (a ValueError) if
    HDF5 opens it but cannot read its root group.
    """
    if os.path.isdir(path):
        logs = sorted(name for name in os.listdir(path) if name.endswith(".h5") and not name.endswith(".ckpt.h5"))
        inside = f"; the .h5 files in it: {', '.join(logs[:5])}{' ...' if len(logs) > 5 else ''}" if logs else ""
        raise IsADirectoryError(f"'{path}' is a directory, expected a run log file (runs/NAME.h5){inside}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"run log '{path}' not found")
    if os.path.getsize(path) == 0:
        raise ValueError(f"'{path}' is empty (0 bytes), expected an mpiasgd run log (HDF5)")
    try:
        f = open_log(path)
    except TruncatedLogError as e:  # names the file and both sizes already
        raise ValueError(str(e)) from None
    except OSError as e:
        raise ValueError(f"'{path}' is not a readable HDF5 file ({e})") from None
    try:
        with reading(path):
            foreign = "config" not in f.attrs or "pushes" not in f
    except DamagedLogError:
        f.close()
        raise
    if foreign:
        f.close()
        raise ValueError(f"'{path}' is not an mpiasgd run log (no 'config' attribute or 'pushes' table)")
    return f


def superseded_spans(value: str | bytes | None) -> list[list]:
    """The time spans a resumed run superseded: the attribute `superseded` (JSON [[start, end], ...]) parsed,
    [] when absent or malformed. A span may carry a third element, the steps its checkpoint held
    ([[rank, step], ...], one per worker: `RunLog.reopen`); one that is not such a list is dropped."""
    if isinstance(value, bytes):
        value = value.decode()
    try:
        spans = json.loads(value or "[]")
    except ValueError:
        return []
    if not isinstance(spans, list):
        return []
    out = []
    for span in spans:
        if not isinstance(span, list) or len(span) < 2 or not all(isinstance(t, (int, float)) for t in span[:2]):
            return []
        held = span[2] if len(span) > 2 else None
        good = isinstance(held, list) and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) for v in p) for p in held)
        out.append([float(span[0]), float(span[1])] + ([held] if good else []))
    return out


def not_superseded(rows: np.ndarray, spans: list[list], by_step: bool = False) -> np.ndarray:
    """The `rows` (with a `time` column) outside every superseded span (start, end].

    `by_step` (rows with `worker` and `step` columns: /shard_pushes): a span that records the steps its
    checkpoint held leaves out instead the rows logged up to its end whose step the checkpoint does not hold
    (step > that worker's step there). A shard's rows carry its clock mapped onto rank 0's and a shard
    holds pushes during a checkpoint's pause, so their times cannot tell which side of the checkpoint they
    fall on; the checkpoint is one cut in every worker's steps (`mpiasgd.rank0.shard_hub`)."""
    if not spans or not len(rows):
        return rows
    keep = np.ones(len(rows), bool)
    time = rows["time"]
    for start, end, *held in spans:
        after = time > start
        if by_step and held:
            ranks, steps = rows["worker"], rows["step"]
            known = np.zeros(len(rows), bool)
            beyond = np.zeros(len(rows), bool)
            for rank, step in held[0]:
                mine = ranks == rank
                known |= mine
                beyond |= mine & (steps > step)
            after = np.where(known, beyond, after)
        keep &= ~(after & (time <= end))
    return rows[keep]


LIVE_READ_TRIES = 6  # reads of a log being written, 0.1 s, 0.2 s, ... apart (1.5 s in all) before it is named damaged


def _read_tables(path: str) -> dict:
    """Every attribute and table `load` reads, as stored (errors as `load`)."""
    with open_run(path) as f, reading(path):
        run = {key: _attr(f, key) for key in f.attrs}
        for name in ("pushes", "updates", "evals", "periodic_evals", "workers", "snapshots/meta", "events",
                     "checkpoints", "shard_pushes"):
            run[name] = f[name][()] if name in f else None
            if run[name] is not None:
                run[name] = upgrade(run[name], name)
    return run


def load(path: str) -> dict:
    """Read what a report needs from the run log at `path` (errors as `open_run`; ValueError for a config
    attribute that is not a JSON object, DamagedLogError for a file HDF5 cannot read).

    The dict holds every file attribute (bytes decoded to str), "config" parsed from its JSON, "path",
    the tables "pushes", "updates", "evals", "periodic_evals", "workers", "snapshots/meta", "events",
    "checkpoints", "shard_pushes" as structured arrays of their dtypes (`mpiasgd.runlog.records`; a table
    of an older version with the columns added since, nan: `records.upgrade`; None where the file has no
    such table), rows of pushes, shard pushes, updates and evaluations a resumed run superseded left out,
    and "superseded_s" (seconds of such spans). A log marked "running" whose writer is gone gets status
    "killed (...)". A read of a log being written that fails (a flush caught half-way) is tried again,
    `LIVE_READ_TRIES` times in all, before it is a DamagedLogError.
    """
    for attempt in range(LIVE_READ_TRIES):
        try:
            run = _read_tables(path)
            break
        except DamagedLogError:
            # a live writer's flush caught half-way: SWMR orders the tables' metadata, not the global heap that
            # holds the events' text, so a row may point at text not yet written ("bad heap index"); read again
            if attempt + 1 == LIVE_READ_TRIES or not writer_alive(path):
                raise
            time.sleep(0.1 * (attempt + 1))
    run["config"] = run_config(path, run.get("config"))
    run["path"] = path
    # rows a resumed run superseded (logged by a segment that died after its last checkpoint)
    spans = superseded_spans(run.get("superseded"))
    for name in ("pushes", "updates", "evals", "periodic_evals", "shard_pushes"):
        if run[name] is not None:
            run[name] = not_superseded(run[name], spans, by_step=name == "shard_pushes")
    run["superseded_s"] = sum(span[1] - span[0] for span in spans)
    if run.get("status") == "running" and not writer_alive(path):
        run["status"] = "killed (its writer is gone; rows up to the last flush)"
    return run

