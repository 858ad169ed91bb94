"""The rows of the run log, one typed record per table, built by name.

    log.add(PushRow(time=t, worker=1, step=5, ...))     # the table ("pushes") comes from the type

Each record is a frozen dataclass whose fields are annotated with their column type (`Float64`,
`Int32`, `Bytes16`, ...: a Python type and the numpy dtype it is stored as). The numpy dtype of a
table (`PushRow.dtype`, also `PUSH_ROW`) is derived from its record: the same field names, in the
same order, with the same types, so the file format is the record class. Records take keyword
arguments only and check nothing (rank 0 builds one per push); `row()` gives the values in column
order, each looked up by its field name. A column added to a table after its first version (`ADDED`)
comes last, with the default nan (unknown), which is also what an older file's rows get for it.

Strings: `Bytes16` and friends are fixed-width ASCII byte strings (b"stop"); `Text` is a
variable-length UTF-8 str (HDF5 vlen). Times are seconds since the start of training.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, ClassVar, TypeVar, get_type_hints

import h5py
import numpy as np

# --- column types: the Python type a field holds, the numpy dtype it is stored as ---
Float64 = Annotated[float, np.dtype("<f8")]
Float32 = Annotated[float, np.dtype("<f4")]
Int64 = Annotated[int, np.dtype("<i8")]
Int32 = Annotated[int, np.dtype("<i4")]
Int8 = Annotated[int, np.dtype("<i1")]  # 0/1 flags
UInt32 = Annotated[int, np.dtype("<u4")]
Bytes16 = Annotated[bytes, np.dtype("S16")]
Bytes48 = Annotated[bytes, np.dtype("S48")]
Bytes64 = Annotated[bytes, np.dtype("S64")]
Text = Annotated[str, h5py.string_dtype()]  # variable-length UTF-8


class Record:
    """Base of the run log's records: `table` (the dataset it is appended to) and `dtype` (its numpy
    structured dtype, derived from the fields) are set by `_table`."""

    __slots__ = ()
    table: ClassVar[str]
    dtype: ClassVar[np.dtype]

    def row(self) -> tuple:
        """The field values in the table's column order (`dtype.names`), each looked up by name."""
        return tuple(getattr(self, name) for name in self.dtype.names)


R = TypeVar("R", bound=Record)


def _table(table: str) -> Callable[[type[R]], type[R]]:
    """Class decorator of a record dataclass: it is stored in `table`, and its `dtype` is derived from its
    fields in order (each annotated with a column type: `Annotated[type, numpy dtype]`). TypeError for
    a field without a column type."""

    def make(cls: type[R]) -> type[R]:
        hints = get_type_hints(cls, include_extras=True)
        columns = []
        for field in dataclasses.fields(cls):
            meta = getattr(hints[field.name], "__metadata__", ())
            if not meta:
                raise TypeError(f"{cls.__name__}.{field.name}: annotate with a column type (Float64, Int32, ...)")
            columns.append((field.name, np.dtype(meta[0])))
        cls.table = table
        cls.dtype = np.dtype(columns)
        return cls

    return make


@_table("pushes")
@dataclass(frozen=True, slots=True, kw_only=True)
class PushRow(Record):
    """One push received (async, ssp), or one worker's REPORT of a step (sync: staleness 0, version = steps
    applied, wait_s = seconds in the allreduces; pipeline: one row per module step)."""

    time: Float64        # s, when rank 0 received it
    worker: Int32        # the worker's rank
    step: Int64          # the worker's step (pushes or sync steps made)
    base_version: Int64  # the server version the gradient was computed from
    version: Int64       # the server version after it was applied
    staleness: Int64     # version when applied - base_version
    loss: Float32        # minibatch mean cross-entropy, nats
    correct: Int32       # images of the minibatch classified right
    samples: Int32       # minibatch size, images
    epoch: Int32         # the worker's epoch over its shard
    compute_s: Float32   # s: data, forward, backward, local steps
    comm_s: Float32      # s: posting the exchange and completing its sends
    wait_s: Float32      # s: waiting for weights (reply, ssp hold, allreduce, pipeline message)
    applied: Int8        # 1 if the server applied it (0: skipped by all workers, or rejected)
    lr: Float32          # step size used, staleness rule included (nsync > 1: local lr x staleness factor)
    rejected: Int8       # 1: a non-finite gradient, not applied
    held_s: Float32      # ssp: s the server held the reply to this worker's previous push
    digest: UInt32       # sync and pipeline: a digest of the worker's weights after the step (replicas agree)
    data_s: Float32 = math.nan  # s of compute_s the step waited for its minibatch (the input pipeline); nan:
                                # unknown (a log written before the column existed)


@_table("updates")
@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateRow(Record):
    """One server update of the master weights."""

    time: Float64       # s
    version: Int64      # the server version after the update
    lr: Float32         # step size
    grad_norm: Float32  # L2 norm of the gradient applied (nan where the server does not see it)
    samples: Int64      # images trained on so far
    epoch: Float64      # samples / training set size


@_table("snapshots/meta")
@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRow(Record):
    """The metadata of one weight snapshot; its (P,) float32 weights go to /snapshots/params
    (`RunLog.add_snapshot`)."""

    time: Float64    # s, when the weights were taken
    version: Int64   # their server version
    samples: Int64   # images trained on so far
    epoch: Float64   # samples / training set size


@_table("evals")
@dataclass(frozen=True, slots=True, kw_only=True)
class EvalRow(Record):
    """One test-set evaluation: of a snapshot (`mpiasgd evaluate`) or of the final weights."""

    time: Float64      # s: the snapshot's time, or when the final evaluation arrived
    version: Int64     # server version of the weights evaluated
    epoch: Float64     # their epoch
    snapshot: Int32    # index into /snapshots/meta; -1: the final weights
    loss: Float64      # mean cross-entropy over the images, nats
    accuracy: Float64  # fraction correct, 0..1
    count: Int64       # images evaluated
    top5: Float64 = math.nan  # fraction whose label is among the 5 largest logits (1.0 with <= 5 classes); nan:
                              # unknown (a row written before the column existed)


@_table("periodic_evals")
@dataclass(frozen=True, slots=True, kw_only=True)
class PeriodicEvalRow(Record):
    """One evaluation during training (--eval-interval) of the weights as the mode defines them: async,
    ssp, easgd: the server's weights (easgd: the center) each worker got with a flagged reply, on its test
    slice; sync: the replicas' weights after one step, on every worker's slice; pipeline: the whole-model
    snapshot rank 0 assembled, on the whole test set (rank 0 evaluates it)."""

    time: Float64        # s: when the weights evaluated were taken (the first worker's: answer less its seconds)
    samples: Int64       # images trained on at those weights (mean over the workers when their versions differ)
    epoch: Float64       # samples / training set size
    version_min: Int64   # the oldest version evaluated (async: workers got different versions)
    version_max: Int64   # the newest
    count: Int64         # images evaluated (the whole test set)
    loss: Float64        # mean cross-entropy, nats
    top1: Float64        # fraction whose label is the argmax, 0..1
    top5: Float64        # fraction whose label is among the 5 largest logits (1.0 with <= 5 classes)
    seconds: Float32     # s the slowest evaluator took
    snapshot: Int32      # index into /snapshots/meta of the same weights (sync, pipeline); -1: none


@_table("events")
@dataclass(frozen=True, slots=True, kw_only=True)
class EventRow(Record):
    """Something that happened: start, stop, resume, preempt, failed, warning, pause, autotune, diverged,
    dead, recovered, ... (see `mpiasgd.runlog`)."""

    time: Float64  # s
    kind: Bytes16  # ASCII, e.g. b"stop"
    text: Text     # what happened, for a person


@_table("checkpoints")
@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRow(Record):
    """One checkpoint written (RUN_DIR/NAME.ckpt.h5)."""

    time: Float64     # s, when its writing started
    seconds: Float32  # s it took to write
    version: Int64    # server version it holds
    samples: Int64    # images trained on that it holds
    elapsed: Float64  # s of training it holds
    reason: Bytes16   # b"interval" | b"end" | b"preempt" | b"failure" (a worker died)


@_table("shard_pushes")
@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPushRow(Record):
    """One push as one parameter-server shard saw it (--servers S > 1; empty with one server): each shard
    applies its slice of every push with its own version counter, so each has its own staleness. Shard 0's
    rows are rank 0's; the other shards send theirs in batches (`mpiasgd.rank0.shard_hub`)."""

    time: Float64        # s, when the shard received it (rank 0's clock; a batch's rows are mapped onto it)
    shard: Int32         # the shard (0 = rank 0; s >= 1 = rank N + s)
    worker: Int32        # the worker's rank
    step: Int64          # the worker's step
    base_version: Int64  # the shard's version the push was computed from
    version: Int64       # the shard's version after it was applied
    staleness: Int64     # the shard's version when applied - base_version
    applied: Int8        # 1 if the shard applied it (0: rejected as non-finite, or after the shard stopped)


@_table("wire_bytes")
@dataclass(frozen=True, slots=True, kw_only=True)
class WireBytesRow(Record):
    """The bytes of the parameter-server exchange (async, ssp, easgd) one shard had moved when the state of a
    checkpoint was taken: one row per shard (shard 0 alone with one server) with every checkpoint written, at
    the checkpoint's log time. A resume continues the counts (the summary's wire_bytes_*) from its checkpoint's
    own copy (`checkpoint.Checkpoint.wire_bytes`), or from these rows for a checkpoint without one; the modes
    that do not count them write none."""

    time: Float64  # s: the checkpoint's log time (its `log_time`)
    shard: Int32   # the parameter-server shard (0 = rank 0; s >= 1 = rank N + s)
    pushed: Int64  # bytes of the PUSH messages it had received since the run's start, headers included
    pulled: Int64  # bytes of the WEIGHTS and STOP messages it had sent since the run's start


@_table("workers")
@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerRow(Record):
    """One worker of the job (the /workers table, written whole by `RunLog.create` and `reopen`)."""

    rank: Int32           # MPI rank
    host: Bytes64         # host name
    pid: Int64            # process id
    threads: Int32        # BLAS threads
    backend: Bytes16      # ops backend: b"numpy" | b"cupy"
    shard_size: Int64     # training images in its shard
    device: Int32         # GPU ordinal; -1 on numpy workers
    device_name: Bytes64  # GPU name; b"" on numpy workers
    device_uuid: Bytes48  # GPU UUID; b"" on numpy workers
    transfer: Bytes16     # how weights and gradients meet MPI: b"host" | b"pinned" (staged) | b"device" (CUDA-aware)
    module: Int32         # pipeline mode: the module k of its unit; -1 in the other modes
    replica: Int32        # pipeline mode: the replica n of its unit; -1 in the other modes


# the tables' dtypes under their historical names
PUSH_ROW = PushRow.dtype
UPDATE_ROW = UpdateRow.dtype
SHARD_PUSH_ROW = ShardPushRow.dtype
WIRE_BYTES_ROW = WireBytesRow.dtype
SNAPSHOT_ROW = SnapshotRow.dtype
EVAL_ROW = EvalRow.dtype
PERIODIC_EVAL_ROW = PeriodicEvalRow.dtype
EVENT_ROW = EventRow.dtype
CHECKPOINT_ROW = CheckpointRow.dtype
WORKER_ROW = WorkerRow.dtype

# the appendable tables (buffered by RunLog, flushed together); /workers is written whole
RECORDS: tuple[type[Record], ...] = (PushRow, UpdateRow, SnapshotRow, EvalRow, PeriodicEvalRow, EventRow,
                                     CheckpointRow, ShardPushRow, WireBytesRow)
TABLES: dict[str, np.dtype] = {record.table: record.dtype for record in RECORDS}


# columns added to a table since its first version, in order (all at its end): a log written before has
# them added by `upgrade` (nan: unknown) when it is read or resumed
ADDED: dict[str, tuple[str, ...]] = {"pushes": ("data_s",), "evals": ("top5",)}


def upgrade(rows: np.ndarray, table: str) -> np.ndarray:
    """`rows` of `table` as written by an older version, with the columns added since (`ADDED`) that it lacks
    appended: nan for a float, 0 otherwise. Rows that lack none of them are returned as they are (also
    rows that lack other columns: not a table this version wrote, which the reader then names)."""
    names = rows.dtype.names or ()
    missing = [name for name in ADDED.get(table, ()) if name not in names]
    if not missing:
        return rows
    dtype = TABLES[table]
    out = np.zeros(len(rows), dtype=np.dtype([*((n, rows.dtype[n]) for n in names),
                                              *((n, dtype[n]) for n in missing)]))
    for name in names:
        out[name] = rows[name]
    for name in missing:
        if dtype[name].kind == "f":
            out[name] = np.nan
    return out
