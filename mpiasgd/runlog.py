"""The HDF5 run log, written by rank 0 alone.

One file per run, `RUN_DIR/NAME.h5`:

    attrs        config (JSON), versions (JSON), layout (JSON), model, mode, num_workers, num_params,
                 created, run_id, status ("running" | "completed" | "failed" | "preempted" | "killed" |
                 "diverged": --on-divergence stop ended it), and at the end wall_time_s, test_accuracy,
                 test_loss, images_per_s, health ("" or how a dead network ended the run: mpiasgd.health),
                 diverged (the symptom that stopped it, or "")
    /workers     one row per worker: rank, host, pid, threads, backend, shard_size
    /pushes      one row per push received (PUSH_ROW): time, worker, step, base version, version,
                 staleness, loss, correct, samples, epoch, compute/comm/wait seconds, applied, lr (the
                 step used, staleness rule included; nsync > 1: the worker's local step size times
                 the staleness factor), rejected (a non-finite gradient, not applied), held_s (ssp:
                 seconds the server held the reply to this worker's previous push). Sync mode: one
                 row per worker per step from its REPORT (staleness 0; version = steps applied;
                 wait_s = seconds in the allreduces; applied 0 on a step skipped by all workers,
                 rejected 1 on the worker whose own gradient was not finite). digest: sync and
                 pipeline modes, the CRC-32 of the worker's weights after the step (replicas must agree;
                 rank 0 checks it as the rows arrive)
    /updates     one row per server update (UPDATE_ROW): time, version, lr, gradient norm, samples, epoch
    /snapshots/params  (S, P) float32 weights every `snapshot_interval` seconds, first and last included
    /snapshots/meta    (S,) SNAPSHOT_ROW: time, version, samples, epoch
    /evals       EVAL_ROW: time, version, epoch, snapshot (-1: the final weights), loss, accuracy, count
    /events      EVENT_ROW: time, kind, text (start, stop reason, failures, preempt, resume; autotune:
                 a GPU worker's conv tiles chosen at start-up under --conv-algo autotune; pause: rank 0's
                 own loop did not run for a while, not counted as the workers' silence; diverged, dead,
                 recovered: the training loss spiked, the network is dead (loss at ln(classes), chance
                 accuracy) or trains again, mpiasgd.health)
    /checkpoints CHECKPOINT_ROW: time, seconds (to write it), version, samples, elapsed (training seconds
                 it holds), reason (interval | end | preempt | failure: a worker died); the file is
                 RUN_DIR/NAME.ckpt.h5

A resumed run (`--resume`) continues the same file: status goes back to "running", an event
"resume" marks where the new segment starts, the clock continues after the last row, and rows
continue from the checkpoint's version and steps. Rows the previous segment logged after its last
checkpoint stay (nothing logged is lost); their versions and steps are repeated by the new segment,
and their time span is listed in the attribute `superseded` (JSON [[start, end], ...]): `report`
leaves those pushes, updates and evaluations out of its counts.

Times are seconds since the start of training. All tables are chunked and appendable. The file is
written in SWMR mode (HDF5 single-writer/multiple-reader): rows are buffered and flushed every
`flush_interval` seconds, and a reader (`mpiasgd report`, `h5py.File(path, "r", swmr=True)`) can
follow it while it grows; a run killed at any moment leaves a file readable up to its last flush.
A writer killed while it had the file open outside SWMR mode (in `close`) leaves the superblock
marked "open for write": with no live writer, `open_log` (readers, "r+") and `reopen` (--resume)
clear that mark as `h5clear -s` does (`clear_stale_flags`). `open_log` reads a file without a live
writer without SWMR first, so a truncated file fails at once (TruncatedLogError) instead of in
HDF5's SWMR-read retry loop.
While the run lives, rank 0 holds an exclusive lock on `NAME.h5.lock` (`WriterLock`): a second job
cannot overwrite the log, and `writer_alive` tells a running log from a killed one (`recover`
turns the latter into a clean file with status "killed").

A file that cannot be written (disk full, quota, I/O error) raises RunLogError, one line naming the
file and the cause ("[Errno 28] No space left on device"), never HDF5's chained messages. A failed
flush cuts the tables back to their last flushed rows, so the file never points at rows that did not
reach the disk; the log then takes no more rows, and `abandon` (which `close` calls) marks it
"failed" where the disk still has room, closes it and releases the lock. Readable up to the last
flush either way. Every flush first checks the free space (`ensure_free_space`: the buffered rows
and snapshots + 5 % + 1 MiB), so a full disk is this error before HDF5 is called.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import re
import time
import uuid

import h5py
import numpy as np

PUSH_ROW = np.dtype([
    ("time", "<f8"), ("worker", "<i4"), ("step", "<i8"), ("base_version", "<i8"), ("version", "<i8"),
    ("staleness", "<i8"), ("loss", "<f4"), ("correct", "<i4"), ("samples", "<i4"), ("epoch", "<i4"),
    ("compute_s", "<f4"), ("comm_s", "<f4"), ("wait_s", "<f4"), ("applied", "<i1"), ("lr", "<f4"),
    ("rejected", "<i1"), ("held_s", "<f4"), ("digest", "<u4"),
])
UPDATE_ROW = np.dtype([("time", "<f8"), ("version", "<i8"), ("lr", "<f4"), ("grad_norm", "<f4"),
                       ("samples", "<i8"), ("epoch", "<f8")])
SNAPSHOT_ROW = np.dtype([("time", "<f8"), ("version", "<i8"), ("samples", "<i8"), ("epoch", "<f8")])
EVAL_ROW = np.dtype([("time", "<f8"), ("version", "<i8"), ("epoch", "<f8"), ("snapshot", "<i4"),
                     ("loss", "<f8"), ("accuracy", "<f8"), ("count", "<i8")])
EVENT_ROW = np.dtype([("time", "<f8"), ("kind", "S16"), ("text", h5py.string_dtype())])
CHECKPOINT_ROW = np.dtype([("time", "<f8"), ("seconds", "<f4"), ("version", "<i8"), ("samples", "<i8"),
                           ("elapsed", "<f8"), ("reason", "S16")])
WORKER_ROW = np.dtype([("rank", "<i4"), ("host", "S64"), ("pid", "<i8"), ("threads", "<i4"),
                       ("backend", "S16"), ("shard_size", "<i8"),
                       # GPU binding (device -1 and empty strings on numpy workers); transfer: how
                       # weights/grads meet MPI: host (no copies) | pinned (staged) | device (CUDA-aware)
                       ("device", "<i4"), ("device_name", "S64"), ("device_uuid", "S48"), ("transfer", "S16"),
                       # pipeline mode: module k and replica n of the unit (-1 in the other modes)
                       ("module", "<i4"), ("replica", "<i4")])

TABLES = {"pushes": PUSH_ROW, "updates": UPDATE_ROW, "snapshots/meta": SNAPSHOT_ROW,
          "evals": EVAL_ROW, "events": EVENT_ROW, "checkpoints": CHECKPOINT_ROW}


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


def recover(path: str, check_writer: bool = True) -> None:
    """Rewrite the log of a run whose writer was killed into a clean, closed file; status "killed".

    A writer killed in SWMR mode leaves the file marked open for writing: readers (SWMR) see every
    row up to its last flush, but it cannot be opened for writing. This copies every object and
    attribute into `PATH.recover.tmp` and renames it over `PATH`. Raises RuntimeError if the writer
    is alive (`check_writer` False: the caller holds the lock, e.g. a resuming job).
    """
    if check_writer and writer_alive(path):
        raise RuntimeError(f"run log '{path}' is still being written by a running job; try when it has ended")
    tmp = path + ".recover.tmp"
    try:
        with open_log(path) as src, h5py.File(tmp, "w", libver="latest") as dst:
            for key, value in src.attrs.items():
                dst.attrs[key] = value
            for name in src:
                src.copy(src[name], dst, name=name)
            if dst.attrs.get("status") == "running":
                dst.attrs["status"] = "killed"
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):  # disk full: the log stays as it was, no half copy beside it
            os.unlink(tmp)
        raise


def open_log(path: str, mode: str = "r") -> h5py.File:
    """Open a run log for reading (`mode` "r"), also while it is being written or after its writer was killed;
    other modes ("r+") open it for writing, flags a killed writer left cleared first (`clear_stale_flags`).

    Reading: while a live job holds the writer lock, in SWMR mode. Otherwise without SWMR first, so that a
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
    if writer_alive(path):
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


class TruncatedLogError(OSError):
    """The run log is shorter than its superblock says (cut short): the message names the file and both sizes."""


# --- the superblock's file consistency flags (HDF5 superblock versions 2 and 3, at offset 0) ---
SIGNATURE = b"\x89HDF\r\n\x1a\n"
SWMR_WRITE = 0x04  # flag bits: 0x01 open for writing, 0x04 open for SWMR writing


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 `hashlittle(data, len(data), initval)` (2006, public domain): the 32-bit checksum
    HDF5 stores after its metadata (H5_checksum_metadata = H5_checksum_lookup3 with initval 0).
    lookup3(b"") = 0xdeadbeef; lookup3(b"Four score and seven years ago") = 0x17770551."""
    m = 0xFFFFFFFF

    def rot(x: int, k: int) -> int:
        return ((x << k) | (x >> (32 - k))) & m

    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & m
    i = 0
    while n - i > 12:  # every 12-byte block but the last: mix
        a = (a + int.from_bytes(data[i:i + 4], "little")) & m
        b = (b + int.from_bytes(data[i + 4:i + 8], "little")) & m
        c = (c + int.from_bytes(data[i + 8:i + 12], "little")) & m
        a = (a - c) & m ^ rot(c, 4)
        c = (c + b) & m
        b = (b - a) & m ^ rot(a, 6)
        a = (a + c) & m
        c = (c - b) & m ^ rot(b, 8)
        b = (b + a) & m
        a = (a - c) & m ^ rot(c, 16)
        c = (c + b) & m
        b = (b - a) & m ^ rot(a, 19)
        a = (a + c) & m
        c = (c - b) & m ^ rot(b, 4)
        b = (b + a) & m
        i += 12
    if n == i:  # nothing left (only for empty data)
        return c
    tail = data[i:] + bytes(12 - (n - i))  # the last 1..12 bytes, zero-padded
    a = (a + int.from_bytes(tail[0:4], "little")) & m
    b = (b + int.from_bytes(tail[4:8], "little")) & m
    c = (c + int.from_bytes(tail[8:12], "little")) & m
    c = (c ^ b) - rot(b, 14) & m
    a = (a ^ c) - rot(c, 11) & m
    b = (b ^ a) - rot(a, 25) & m
    c = (c ^ b) - rot(b, 16) & m
    a = (a ^ c) - rot(c, 4) & m
    b = (b ^ a) - rot(a, 14) & m
    c = (c ^ b) - rot(b, 24) & m
    return c


def _superblock(path: str) -> tuple[bytes, int] | None:
    """(the superblock's bytes before its checksum, the stored checksum) of a version 2/3 superblock at
    offset 0 whose checksum `lookup3` reproduces; None for anything else (or an unreadable file)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
    except OSError:
        return None
    if head[:8] != SIGNATURE or len(head) < 12 or head[8] not in (2, 3):
        return None
    n = 12 + 4 * head[9]  # signature, version, sizes of offsets and lengths, flags; 4 addresses
    if len(head) < n + 4:
        return None
    stored = int.from_bytes(head[n:n + 4], "little")
    return (head[:n], stored) if lookup3(head[:n]) == stored else None


def superblock_flags(path: str) -> int | None:
    """The file consistency flags of the HDF5 file at `path` (0: closed cleanly; 0x01: open for writing; 0x05:
    open for SWMR writing), None if its superblock is not one `clear_stale_flags` understands."""
    sb = _superblock(path)
    return None if sb is None else sb[0][11]


def clear_stale_flags(path: str, check_writer: bool = True) -> bool:
    """Clear the file consistency flags a killed writer left in the superblock, as `h5clear -s` does: the
    flags byte set to 0 and the superblock checksum (`lookup3`) recomputed. True if they were cleared.

    A writer killed while it had the file open (rank 0 killed inside `RunLog.close`'s non-SWMR reopen)
    leaves them set: HDF5 then refuses every later open ("file is already open for write", "not already
    open for SWMR writing"). Nothing is changed (False) if the writer is alive (`check_writer` False: the
    caller holds the lock, so it is not), the flags are 0, or the superblock is not version 2/3 with a
    checksum `lookup3` reproduces. OSError if the file cannot be written (read-only).
    """
    if check_writer and writer_alive(path):
        return False
    sb = _superblock(path)
    if sb is None or sb[0][11] == 0:
        return False
    head = bytearray(sb[0])
    head[11] = 0
    with open(path, "r+b") as fh:
        fh.seek(len(head))
        fh.write(lookup3(bytes(head)).to_bytes(4, "little"))
        fh.seek(11)
        fh.write(b"\0")
        fh.flush()
        os.fsync(fh.fileno())
    return True


# --- free space, checked before a write (HDF5 fails badly on a full disk: chained errors, a crash) ---
FREE_MARGIN = 1 << 20  # bytes kept free beyond a write's data and 5 % of it: HDF5's metadata (object headers,
                       # chunk indexes, free-space records) and whatever else shares the file system


def ensure_free_space(path: str, nbytes: int) -> None:
    """OSError(ENOSPC) ("[Errno 28] No space left on device") unless the file system holding `path` has room
    for a write of `nbytes` bytes of data: nbytes + 5 % + FREE_MARGIN (1 MiB) free for this user (f_bavail).
    Checked before HDF5 is called, so a full disk is one clean error instead of HDF5's failure paths."""
    st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    if st.f_bavail * st.f_frsize < nbytes + nbytes // 20 + FREE_MARGIN:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _close_quietly(f: h5py.File | None) -> None:
    """Close `f` (if any) after a failed write; a second failure while closing adds nothing to the first."""
    try:
        if f is not None:
            f.close()
    except (OSError, RuntimeError):
        pass


def append(ds: h5py.Dataset, rows: np.ndarray) -> None:
    """Append `rows` along axis 0 of a resizable dataset."""
    n = ds.shape[0]
    ds.resize(n + len(rows), axis=0)
    ds[n:] = rows


class RunLog:
    """Buffered, appendable writer of one run log (server only). Use `RunLog.create`."""

    def __init__(self, path: str, file: h5py.File, flush_interval: float, lock: WriterLock | None = None) -> None:
        self.path = path
        self.file = file
        self.lock = lock
        self.flush_interval = flush_interval
        self.pending: dict[str, list] = {name: [] for name in TABLES}
        self.pending_params: list[np.ndarray] = []
        self.last_flush = time.monotonic()
        self.error: RunLogError | None = None  # the write failure that broke the log (it takes no more rows)
        self.outcome = ""                      # what `abandon` made of a broken log, for the error message
        run_id = file.attrs.get("run_id", "")
        self.run_id = run_id.decode() if isinstance(run_id, bytes) else str(run_id)

    @classmethod
    def create(cls, path: str, attrs: dict, workers: list[tuple], num_params: int,
               flush_interval: float, lock: WriterLock | None = None) -> RunLog:
        """Create the file with every dataset, then switch to SWMR mode (no new objects after that).

        `attrs` values that are not str/int/float are stored as JSON. An existing file at `path` is
        replaced: the caller decides (train.setup refuses one unless --overwrite, holding `lock`).
        `lock` is released by `close`. RunLogError if the file cannot be created (disk full): no
        part of it is left; the caller releases `lock`.
        """
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        f, existed = None, os.path.exists(path)
        try:
            f = h5py.File(path, "w", libver="latest")
            cls._fill(f, attrs, workers, num_params)
        except (OSError, RuntimeError) as e:  # RuntimeError: h5py's, when HDF5 fails to write
            _close_quietly(f)
            if (f is not None or not existed) and os.path.exists(path):  # ours: created or truncated above
                os.unlink(path)
            raise RunLogError(path, e, "created") from e
        return cls(path, f, flush_interval, lock)

    @staticmethod
    def _fill(f: h5py.File, attrs: dict, workers: list[tuple], num_params: int) -> None:
        """`create`'s attributes and datasets in the new file `f`, then SWMR mode."""
        for key, value in attrs.items():
            f.attrs[key] = value if isinstance(value, (str, int, float)) else json.dumps(value)
        f.attrs["created"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        f.attrs["status"] = "running"
        if not f.attrs.get("run_id"):  # a resumed run whose log was lost keeps its checkpoint's id
            f.attrs["run_id"] = uuid.uuid4().hex  # its checkpoints carry it: a resume checks they belong here
        f.create_dataset("workers", data=np.array(workers, dtype=WORKER_ROW))
        for name, dtype in TABLES.items():
            f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1024,))
        f.create_dataset("snapshots/params", shape=(0, num_params), maxshape=(None, num_params),
                         dtype=np.float32, chunks=(1, num_params))
        f.swmr_mode = True

    @classmethod
    def reopen(cls, path: str, workers: list[tuple], flush_interval: float, lock: WriterLock,
               resumed_at: float | None = None) -> RunLog:
        """Continue the log at `path` for a resumed run (caller holds `lock`): a log left by a killed writer
        is recovered first; status becomes "running"; the workers table is replaced by this job's
        (pids and hosts change); tables added since the log was written are created. Rows after
        `resumed_at` (the log time of the checkpoint resumed from) came from a segment that died
        after that checkpoint: their time span is appended to the attribute `superseded` (JSON list of
        [start, end]), which readers use to leave them out of counts. RunLogError if it cannot be
        written (disk full)."""
        f = None
        try:
            clear_stale_flags(path, check_writer=False)  # killed inside close's non-SWMR reopen
            with open_log(path) as f:
                status = f.attrs.get("status")
            if status == "running":  # its writer was killed (we hold the lock): make it writable again
                recover(path, check_writer=False)
            f = h5py.File(path, "r+", libver="latest")
            f.attrs["status"] = "running"
            log = cls(path, f, flush_interval, lock)
            last = log.last_time()
            if resumed_at is not None and last > resumed_at:  # a segment that died after its checkpoint
                spans = [*json.loads(f.attrs.get("superseded", "[]")), [resumed_at, last]]
                f.attrs["superseded"] = json.dumps(spans)
            del f["workers"]
            f.create_dataset("workers", data=np.array(workers, dtype=WORKER_ROW))
            for name, dtype in TABLES.items():
                if name not in f:
                    f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1024,))
            f.swmr_mode = True
        except (OSError, RuntimeError) as e:  # RuntimeError: h5py's, when HDF5 fails to write
            _close_quietly(f)
            raise RunLogError(path, e, "reopened") from e
        return log

    def last_time(self) -> float:
        """The latest time of any row in the file (0 for an empty log): where a resumed run's clock starts."""
        latest = 0.0
        for name in TABLES:
            ds = self.file[name]
            if ds.shape[0]:
                latest = max(latest, float(ds[ds.shape[0] - 1]["time"]))
        return latest

    # --- appending (server only; rows reach the file at the next flush; a broken log drops them) ---
    def add(self, table: str, row: tuple) -> None:
        if self.error is None:
            self.pending[table].append(row)

    def add_snapshot(self, row: tuple, params: np.ndarray) -> None:
        if self.error is None:
            self.pending["snapshots/meta"].append(row)
            self.pending_params.append(params.copy())

    def maybe_flush(self) -> None:
        if time.monotonic() - self.last_flush >= self.flush_interval:
            self.flush()

    def flush(self) -> None:
        """Write every buffered row and make it visible to readers.

        Checked first (`ensure_free_space`): the buffered rows and snapshots plus 5 % and 1 MiB must fit on
        the disk, else RunLogError before HDF5 is called.
        RunLogError if the file cannot be written (disk full): the tables this flush grew are cut back
        to their rows before it (readers never see rows that did not reach the disk), the buffered
        rows are dropped and the log is broken: `add` and `flush` do nothing from then on, and `close`
        ends it as `abandon` does.
        """
        if self.error is not None or self.file is None:
            return
        need = sum(p.nbytes for p in self.pending_params)
        need += sum(len(rows) * TABLES[name].itemsize for name, rows in self.pending.items())
        try:
            if need:
                ensure_free_space(self.path, need)  # before HDF5: its own ENOSPC paths stay the rare fallback
        except OSError as e:
            self.error = RunLogError(self.path, e)
            self.pending_params.clear()
            for rows in self.pending.values():
                rows.clear()
            raise self.error from None
        before: dict[str, int] = {}  # the rows of each table this flush grows, before it
        try:
            if self.pending_params:
                ds = self.file["snapshots/params"]
                before["snapshots/params"] = ds.shape[0]
                append(ds, np.stack(self.pending_params))
                ds.flush()
            for name, rows in self.pending.items():
                if rows:
                    ds = self.file[name]
                    before[name] = ds.shape[0]
                    append(ds, np.array(rows, dtype=TABLES[name]))
                    ds.flush()
            self.file.flush()
        except (OSError, RuntimeError) as e:  # RuntimeError: h5py's, when HDF5 fails to write
            self.error = RunLogError(self.path, e)
            for name, n in before.items():  # no row that may not be on disk stays referenced
                try:
                    self.file[name].resize(n, axis=0)
                except (OSError, RuntimeError):
                    pass
            raise self.error from e
        finally:
            self.pending_params.clear()
            for rows in self.pending.values():
                rows.clear()
        self.last_flush = time.monotonic()

    def close(self, status: str, attrs: dict | None = None) -> None:
        """Flush, close, and record the final `status` and summary `attrs` (reopened, in SWMR mode; closed
        cleanly after); release the lock. RunLogError if the file cannot be written: the log is then ended by `abandon`
        (status "failed" where the disk allows), its `outcome` says how."""
        if self.file is None:
            return
        try:
            self.flush()
            if self.error is None:
                self.file.close()
        except RunLogError:
            pass
        except (OSError, RuntimeError) as e:  # the close's own writes
            self.error = RunLogError(self.path, e)
        if self.error is not None:
            self.abandon()
            raise self.error
        self.file = None
        try:
            with h5py.File(self.path, "r+", libver="latest") as f:
                # SWMR mode again at once: rank 0 killed from here on leaves a file SWMR readers read (killed
                # before it, `clear_stale_flags` repairs it), and live readers are not refused meanwhile
                f.swmr_mode = True
                f.attrs["status"] = status
                for key, value in (attrs or {}).items():
                    f.attrs[key] = value
        except (OSError, RuntimeError) as e:
            self.error = RunLogError(self.path, e)
            self.outcome = f"its status could not be set to '{status}'"
            raise self.error from e
        finally:
            if self.lock is not None:
                self.lock.release()

    def abandon(self) -> str:
        """End a log that cannot be written (after RunLogError), never raising: status "failed" set in place
        (the file stays in SWMR mode: no new objects), the file closed, the lock released. Returns (and
        keeps in `outcome`) what became of it, for the error message. Readers see every row up to the
        last flush that succeeded, whether or not the status could be written."""
        if self.file is not None:
            try:
                self.file.attrs.modify("status", "failed")
                self.file.flush()
                self.outcome = "the log is closed with status 'failed', readable up to its last flush"
            except (OSError, RuntimeError):
                self.outcome = ("its status could not be set to 'failed' (it stays 'running'); it is readable up "
                                "to its last flush")
            try:
                self.file.close()
            except (OSError, RuntimeError):
                pass  # HDF5 keeps it open; the process ends soon
            self.file = None
        if self.lock is not None:
            self.lock.release()
        return self.outcome
