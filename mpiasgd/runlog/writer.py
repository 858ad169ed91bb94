"""The run log's writer (rank 0 alone): `RunLog` buffers rows and flushes them in SWMR mode; `recover`
turns the log of a killed writer into a clean file.

Rows are records (`mpiasgd.runlog.records`): `log.add(PushRow(...))` appends to the table of the
record's type. Times are seconds since the start of training.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import h5py
import numpy as np

from mpiasgd.files import PIECE, RunLogError, ensure_free_space
from mpiasgd.runlog.lock import WriterLock, writer_alive
from mpiasgd.runlog.reader import open_log
from mpiasgd.runlog.records import TABLES, WORKER_ROW, Record, SnapshotRow, WorkerRow, upgrade
from mpiasgd.runlog.superblock import clear_stale_flags


def open_for_writing(path: str, tries: int = 30, wait: float = 0.1) -> h5py.File:
    """`h5py.File(path, "r+")`, tried again for up to `tries * wait` seconds while HDF5's own file lock is
    taken: a reader opening the log (`mpiasgd watch`, `report`) holds a shared lock on it for a moment, and a
    writer reopening it in that moment gets BlockingIOError (errno 11). OSError naming the lock if it stays
    taken; other errors are raised at once."""
    for _ in range(tries):
        try:
            return h5py.File(path, "r+", libver="latest")
        except BlockingIOError:
            time.sleep(wait)
    raise OSError(f"another process held HDF5's lock on the file for {tries * wait:.0f} s (a reader that opened it "
                  "without SWMR, such as h5py.File(path, 'r') outside mpiasgd)")


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


def _close_quietly(f: h5py.File | None) -> None:
    """Close `f` (if any) after a failed write; a second failure while closing adds nothing to the first."""
    try:
        if f is not None:
            f.close()
    except (OSError, RuntimeError):
        pass


def upgrade_tables(f: h5py.File) -> list[str]:
    """Rewrite every appendable table of `f` (open for writing, not in SWMR mode) whose columns are those of
    an older version with the columns added since (`records.upgrade`: nan or 0), creating the tables it
    lacks; returns the names rewritten. A resumed run appends rows of the current records to them."""
    rewritten = []
    for name, dtype in TABLES.items():
        if name in f and f[name].dtype != dtype:
            rows = upgrade(f[name][()], name)
            if rows.dtype != dtype:  # not a table of an older version: left as it is
                continue
            del f[name]
            f.create_dataset(name, data=rows, maxshape=(None,), chunks=(1024,))
            rewritten.append(name)
        elif name not in f:
            f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1024,))
    return rewritten


def append(ds: h5py.Dataset, rows: np.ndarray) -> None:
    """Append `rows` (a structured array of the dataset's dtype, or an array of its shape but the first
    axis) along axis 0 of a resizable dataset."""
    n = ds.shape[0]
    ds.resize(n + len(rows), axis=0)
    ds[n:] = rows


def _worker_table(workers: Sequence[WorkerRow]) -> np.ndarray:
    """(W,) WORKER_ROW array of `workers` (records, each row taken by field name)."""
    return np.array([w.row() for w in workers], dtype=WORKER_ROW)


def _guarded(method: Callable) -> Callable:
    """A RunLog method run holding the log's `guard`: rank 0's signal thread (`signals.watching`) may close the
    log (`end_early`) while the main thread adds or flushes."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.guard:
            return method(self, *args, **kwargs)
    return run


class RunLog:
    """Buffered, appendable writer of one run log (server only). Use `RunLog.create`.

    Rows are records (`mpiasgd.runlog.records`) given to `add` (snapshots: `add_snapshot`); they reach
    the file at the next `flush` (`maybe_flush`: every `flush_interval` seconds). Every method that adds,
    writes or closes holds `guard` (a re-entrant lock): another thread may end the log early (`end_early`).
    """

    def __init__(self, path: str, file: h5py.File, flush_interval: float, lock: WriterLock | None = None) -> None:
        self.path = path
        self.file = file
        self.lock = lock
        self.guard = threading.RLock()
        self.hurry = threading.Event()  # set by `ending_now`: a snapshot write under way stops at its next chunk
        self.flush_interval = flush_interval
        self.pending: dict[str, list] = {name: [] for name in TABLES}
        self.pending_params: list[np.ndarray] = []
        self.pending_workers: list[np.void] = []  # /workers rows replaced (--respawn), written at the next flush
        self.pending_buffers: list[np.ndarray] = []
        self.last_flush = time.monotonic()
        self.error: RunLogError | None = None  # the write failure that broke the log (it takes no more rows)
        self.outcome = ""                      # what `abandon` made of a broken log, for the error message
        self.ended = ""                        # the status `end_early` closed the file with ("": open)
        self.reopen_at = 0.0                   # (after `end_early`) not opened again before (time.monotonic())
        self.taken_over = False                # (after `end_early`) another job took the lock: the log is its now
        self.sizes: dict[str, int] = {}        # (closed by `end_early`) each table's rows in the file
        self.has_buffers = "snapshots/buffers" in file
        run_id = file.attrs.get("run_id", "")
        self.run_id = run_id.decode() if isinstance(run_id, bytes) else str(run_id)

    @classmethod
    def create(cls, path: str, attrs: dict, workers: Sequence[WorkerRow], num_params: int,
               flush_interval: float, lock: WriterLock | None = None, num_buffers: int = 0) -> RunLog:
        """Create the file with every dataset, then switch to SWMR mode (no new objects after that).

        `workers` fill the /workers table (`WorkerRow`s); `num_params` (P) is the width of /snapshots/params,
        `num_buffers` (B) of /snapshots/buffers (created only when B > 0: the layers' buffers). `attrs`
        values that are not str/int/float are stored as JSON. An existing file at `path` is replaced:
        the caller decides (launch.startup refuses one unless --overwrite, holding `lock`). `lock` is
        released by `close`. RunLogError if the file cannot be created (disk full): no part of it is
        left; the caller releases `lock`.
        """
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        f, existed = None, os.path.exists(path)
        try:
            f = h5py.File(path, "w", libver="latest")
            cls._fill(f, attrs, workers, num_params, num_buffers)
        except (OSError, RuntimeError) as e:  # RuntimeError: h5py's, when HDF5 fails to write
            _close_quietly(f)
            if (f is not None or not existed) and os.path.exists(path):  # ours: created or truncated above
                os.unlink(path)
            raise RunLogError(path, e, "created") from e
        return cls(path, f, flush_interval, lock)

    @staticmethod
    def _fill(f: h5py.File, attrs: dict, workers: Sequence[WorkerRow], num_params: int, num_buffers: int) -> None:
        """`create`'s attributes and datasets in the new file `f`, then SWMR mode."""
        for key, value in attrs.items():
            f.attrs[key] = value if isinstance(value, (str, int, float)) else json.dumps(value)
        f.attrs["created"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        f.attrs["status"] = "running"
        if not f.attrs.get("run_id"):  # a resumed run whose log was lost keeps its checkpoint's id
            f.attrs["run_id"] = uuid.uuid4().hex  # its checkpoints carry it: a resume checks they belong here
        f.create_dataset("workers", data=_worker_table(workers))
        for name, dtype in TABLES.items():
            f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(1024,))
        # chunks of PIECE values at most: a snapshot is written a chunk at a time (`_append_snapshots`)
        f.create_dataset("snapshots/params", shape=(0, num_params), maxshape=(None, num_params),
                         dtype=np.float32, chunks=(1, max(1, min(num_params, PIECE))))
        if num_buffers:
            f.create_dataset("snapshots/buffers", shape=(0, num_buffers), maxshape=(None, num_buffers),
                             dtype=np.float32, chunks=(1, min(num_buffers, PIECE)))
        f.swmr_mode = True

    @classmethod
    def reopen(cls, path: str, workers: Sequence[WorkerRow], flush_interval: float, lock: WriterLock,
               resumed_at: float | None = None, resumed_steps: Sequence[tuple[int, int]] = ()) -> RunLog:
        """Continue the log at `path` for a resumed run (caller holds `lock`): a log left by a killed writer
        is recovered first; status becomes "running"; the workers table is replaced by this job's
        (pids and hosts change); tables added since the log was written are created, and tables whose
        columns are an older version's rewritten (`upgrade_tables`). Rows after
        `resumed_at` (the log time of the checkpoint resumed from) came from a segment that died
        after that checkpoint: their time span is appended to the attribute `superseded` (JSON list of
        [start, end], with `resumed_steps`, the (worker rank, step) pairs the checkpoint held, as a third
        element [[rank, step], ...]), which readers use to leave them out of counts (`reader.not_superseded`).
        RunLogError if it cannot be written (disk full)."""
        f = None
        try:
            clear_stale_flags(path, check_writer=False)  # killed inside close's non-SWMR reopen
            with open_log(path, hold_lock=True) as f:  # (not in SWMR mode: a damaged file fails at once)
                status = f.attrs.get("status")
            if status == "running":  # its writer was killed (we hold the lock): make it writable again
                recover(path, check_writer=False)
            f = open_for_writing(path)
            f.attrs["status"] = "running"
            log = cls(path, f, flush_interval, lock)
            last = log.last_time()
            if resumed_at is not None and last > resumed_at:  # a segment that died after its checkpoint
                span = [resumed_at, last] + ([[[int(r), int(s)] for r, s in resumed_steps]] if resumed_steps else [])
                spans = [*json.loads(f.attrs.get("superseded", "[]")), span]
                f.attrs["superseded"] = json.dumps(spans)
            del f["workers"]
            f.create_dataset("workers", data=_worker_table(workers))
            upgrade_tables(f)  # tables and columns added since the log was written
            f.swmr_mode = True
        except (OSError, RuntimeError) as e:  # RuntimeError: h5py's, when HDF5 fails to write
            _close_quietly(f)
            raise RunLogError(path, e, "reopened") from e
        return log

    def last_time(self) -> float:
        """The latest time of any row in the file (0 for an empty log): where a resumed run's clock starts."""
        latest = 0.0
        for name in TABLES:
            if name not in self.file:  # a table added since the log was written (created by `reopen`)
                continue
            ds = self.file[name]
            if ds.shape[0]:
                latest = max(latest, float(ds[ds.shape[0] - 1]["time"]))
        return latest

    @_guarded
    def rows(self, table: str) -> int:
        """Rows of `table` (e.g. "snapshots/meta"), flushed and buffered: the index the next row will have."""
        flushed = self.file[table].shape[0] if self.file is not None else self.sizes.get(table, 0)
        return flushed + len(self.pending[table])

    def snapshot_values(self) -> int:
        """float32 values in one weight snapshot: the parameters and the layers' buffers."""
        return sum(self.file[name].shape[1] for name in ("snapshots/params", "snapshots/buffers") if name in self.file)

    # --- appending (server only; rows reach the file at the next flush; a broken log drops them) ---
    @_guarded
    def add(self, record: Record) -> None:
        """Buffer one row: appended to the record's table (`record.table`), its values taken by field name
        (`record.row()`).

        ValueError for a record of a table `add` does not append to: /snapshots/meta (its weights come
        with it: `add_snapshot`) or /workers (written whole by `create`, `reopen`). Nothing is buffered
        once the log is broken (`error`).
        """
        if isinstance(record, SnapshotRow):
            raise ValueError("RunLog.add: a SnapshotRow goes with its weights; use RunLog.add_snapshot")
        if record.table not in self.pending:
            raise ValueError(f"RunLog.add: {type(record).__name__} rows are written whole by RunLog.create "
                             f"and RunLog.reopen")
        if self.error is None:
            self.pending[record.table].append(record.row())

    @_guarded
    def add_snapshot(self, record: SnapshotRow, params: np.ndarray, buffers: np.ndarray | None = None) -> None:
        """Buffer one weight snapshot: its metadata `record`, `params`, the (P,) float32 weights, and `buffers`,
        the (B,) float32 layer buffers when the log has /snapshots/buffers; copied (the caller may go on
        writing them). ValueError when buffers are missing for a log that keeps them, or given to one that
        does not."""
        has = self.has_buffers
        if has != (buffers is not None and buffers.size > 0):
            raise ValueError(f"RunLog.add_snapshot: this log {'keeps' if has else 'has no'} layer buffers, got "
                             f"{'none' if buffers is None else buffers.size}")
        if self.error is None:
            self.pending["snapshots/meta"].append(record.row())
            self.pending_params.append(params.copy())
            if has:
                self.pending_buffers.append(buffers.copy())

    @_guarded
    def replace_worker(self, record: WorkerRow) -> None:
        """(--respawn) The /workers row of rank `record.rank` becomes `record` (a replacement took the rank: its
        host, pid, device) at the next flush, written in place (SWMR allows writes to existing rows). ValueError
        for a rank the table does not hold (at the flush: the log is then broken, as for a write error)."""
        if self.error is None:
            self.pending_workers.append(np.array(record.row(), dtype=WORKER_ROW)[()])

    @_guarded
    def maybe_flush(self) -> None:
        """`flush` if `flush_interval` seconds have passed since the last one (RunLogError as `flush`); nothing
        once `end_early` closed the file (its rows wait for an explicit `flush` or `close`)."""
        if not self.ended and time.monotonic() - self.last_flush >= self.flush_interval:
            self.flush()

    @_guarded
    def flush(self) -> None:
        """Write every buffered row and make it visible to readers.

        Checked first (`ensure_free_space`): the buffered rows and snapshots plus 5 % and 1 MiB must fit on
        the disk, else RunLogError before HDF5 is called.
        RunLogError if the file cannot be written (disk full): the tables this flush grew are cut back
        to their rows before it (readers never see rows that did not reach the disk), the buffered
        rows are dropped and the log is broken: `add` and `flush` do nothing from then on, and `close`
        ends it as `abandon` does. After `end_early` the rows are written in one short opening of the file
        (`_open_again`, the lock taken and released again; not within its `hold`: they wait); RunLogError also
        if that cannot be done.
        """
        self._write(snapshots=not self.hurry.is_set())

    def _write(self, snapshots: bool) -> None:
        """`flush`; the buffered snapshots (their weights and their rows of /snapshots/meta) stay buffered when
        not `snapshots`, or when `hurry` is set during their write (the rows written of them are cut back)."""
        if self.error is not None:
            return
        if self.file is None:
            if self.ended and any(self.pending.values()) and time.monotonic() >= self.reopen_at:
                self._open_again()
                try:
                    self._write(snapshots)
                finally:
                    self._set_aside()
            return
        snapshots = snapshots and bool(self.pending_params)
        need = sum(p.nbytes for p in (*self.pending_params, *self.pending_buffers)) if snapshots else 0
        need += sum(len(rows) * TABLES[name].itemsize for name, rows in self.pending.items())
        need += len(self.pending_workers) * WORKER_ROW.itemsize
        try:
            if need:
                ensure_free_space(self.path, need)  # before HDF5: its own ENOSPC paths stay the rare fallback
        except OSError as e:
            self.error = RunLogError(self.path, e)
            self.pending_params.clear()
            self.pending_buffers.clear()
            for rows in self.pending.values():
                rows.clear()
            raise self.error from None
        before: dict[str, int] = {}  # the rows of each table this flush grows, before it
        try:
            if snapshots:
                snapshots = self._append_snapshots(before)
            for name, rows in self.pending.items():
                if rows and (snapshots or name != "snapshots/meta"):
                    ds = self.file[name]
                    before[name] = ds.shape[0]
                    append(ds, np.array(rows, dtype=TABLES[name]))
                    ds.flush()
            if self.pending_workers:
                table = self.file["workers"]
                ranks = table.fields("rank")[()]
                for row in self.pending_workers:
                    at = np.flatnonzero(ranks == row["rank"])
                    if not at.size:
                        raise ValueError(f"run log '{self.path}': no row of worker rank {int(row['rank'])} in /workers")
                    table[int(at[0])] = row
                table.flush()
            self.file.flush()
        except (OSError, RuntimeError, ValueError) as e:  # RuntimeError: h5py's, when HDF5 fails to write
            self.error = RunLogError(self.path, e)
            for name, n in before.items():  # no row that may not be on disk stays referenced
                try:
                    self.file[name].resize(n, axis=0)
                except (OSError, RuntimeError):
                    pass
            raise self.error from e
        finally:
            self.pending_workers.clear()
            if snapshots or self.error is not None:
                self.pending_params.clear()
                self.pending_buffers.clear()
            for name, rows in self.pending.items():
                if snapshots or self.error is not None or name != "snapshots/meta":
                    rows.clear()
        self.last_flush = time.monotonic()

    def _append_snapshots(self, before: dict[str, int]) -> bool:
        """(`_write`) Append the buffered snapshots' weights (and buffers) a chunk at a time (at most PIECE
        values: h5py holds its lock and the GIL for each write); False, with the rows cut back to `before`'s,
        when `hurry` was set meanwhile (another thread ends the log: they wait)."""
        for name, rows in (("snapshots/params", self.pending_params), ("snapshots/buffers", self.pending_buffers)):
            if not rows:
                continue
            ds = self.file[name]
            n, width = ds.shape[0], (ds.chunks or ds.shape)[1]
            before[name] = n
            ds.resize(n + len(rows), axis=0)
            for i, values in enumerate(rows):
                for start in range(0, ds.shape[1], width):
                    if self.hurry.is_set():
                        for written, count in before.items():
                            self.file[written].resize(count, axis=0)
                        before.clear()
                        return False
                    ds[n + i, start:start + width] = values[start:start + width]
            ds.flush()
        return True

    @_guarded
    def close(self, status: str, attrs: dict | None = None) -> None:
        """Flush, close, and record the final `status` and summary `attrs` (reopened, in SWMR mode; closed
        cleanly after); release the lock. RunLogError if the file cannot be written: the log is then ended by `abandon`
        (status "failed" where the disk allows), its `outcome` says how. After `end_early` the file is opened
        again first, once its `hold` has passed (`_open_again`: RunLogError if the lock or the file cannot be
        had; it then stays as `end_early` left it)."""
        if self.file is None:
            if not self.ended or self.error is not None:
                return
            time.sleep(max(0.0, self.reopen_at - time.monotonic()))
            self._open_again()
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
            with open_for_writing(self.path) as f:
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

    @_guarded
    def abandon(self) -> str:
        """End a log that cannot be written (after RunLogError), never raising: status "failed" set in place
        (the file stays in SWMR mode: no new objects), the file closed, the lock released. Returns (and
        keeps in `outcome`) what became of it, for the error message. Readers see every row up to the
        last flush that succeeded, whether or not the status could be written."""
        if self.file is None and self.ended and not self.outcome:
            self.outcome = self._ended_note()
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

    # --- the end of a run the launcher may kill at any moment ---
    @_guarded
    def end_early(self, status: str, hold: float = 0.0) -> None:
        """Close the file now with `status` ("preempted", "failed") and release the lock, before the run's last
        work (its checkpoint, the workers' answers): a launcher may kill this process at any moment from here
        on (Open MPI's mpiexec, sent SIGTERM or seeing a rank die, SIGKILLs every rank 0.25 s after the
        SIGTERM it passes on). Killed after this, it leaves a file closed cleanly with `status`, no lock file,
        and only the rows added since not written, and the buffered snapshots (megabytes: they are not written
        now). Rows added from now on stay in memory: `flush` writes them in one short opening of the file,
        `close` with the final status and summary, neither within `hold` seconds from now (`close` waits): a
        kill expected in that time finds no file open and no lock taken. RunLogError (and the log is broken,
        as by `flush`) if the rows or the status cannot be written. Nothing happens a second time."""
        if self.file is None or self.error is not None:
            return
        self.reopen_at = time.monotonic() + hold
        self._write(snapshots=False)
        try:
            self.file.attrs.modify("status", status)  # in place: SWMR mode makes no new objects
        except (OSError, RuntimeError) as e:  # RuntimeError: h5py's, when HDF5 fails to write
            self.error = RunLogError(self.path, e)
            raise self.error from e
        self.ended = status
        self._set_aside()

    @contextlib.contextmanager
    def ending_now(self) -> Iterator[None]:
        """Hold `guard` (from another thread: rank 0's signal thread, to `end_early`), taking it as soon as the
        thread that holds it has written the snapshot chunk under way (`hurry`): the snapshots wait."""
        self.hurry.set()
        try:
            with self.guard:
                yield
        finally:
            self.hurry.clear()

    def _set_aside(self) -> None:
        """(after `end_early`) Close the file, keeping each table's length for `rows`, and release the lock."""
        try:
            self.sizes = {name: self.file[name].shape[0] for name in self.pending if name in self.file}
            self.file.close()
        except (OSError, RuntimeError) as e:
            self.error = self.error or RunLogError(self.path, e)
        finally:
            self.file = None
            if self.lock is not None:
                self.lock.release()
        if self.error is not None:
            raise self.error

    def _open_again(self) -> None:
        """(after `end_early`) Take the lock again and open the file for writing, in SWMR mode at once (readers
        are not refused). RunLogError naming what stood in the way (another job took the lock over:
        `taken_over`; the file is gone or damaged): nothing is held then, and the log takes no more rows."""
        try:
            if self.lock is not None:
                self.lock.acquire(hint=f"this run, which closed it with status '{self.ended}' when it began to "
                                       f"end, leaves it to that job")
            self.file = open_for_writing(self.path)
            self.file.swmr_mode = True
        except (OSError, RuntimeError) as e:
            self.taken_over = isinstance(e, FileExistsError)  # another live job holds the lock
            _close_quietly(self.file)
            self.file = None
            if self.lock is not None:
                self.lock.release()
            self.error = RunLogError(self.path, e, "reopened")
            self.outcome = self._ended_note()
            raise self.error from e

    def _ended_note(self) -> str:
        """What a log `end_early` closed is, when it cannot be opened again: for the error message."""
        return (f"it stays closed with status '{self.ended}' (set when the run began to end), readable up to its "
                f"last flush")
