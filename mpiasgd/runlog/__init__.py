"""The HDF5 run log, written by rank 0 alone.

One file per run, `RUN_DIR/NAME.h5`:

    attrs        config (JSON), versions (JSON), layout (JSON: parameter names, offsets, shapes), model
                 (the --model given), model_spec (the network's definition, JSON data:
                 `mpiasgd.model.spec`; evaluate, report, export and --resume rebuild the network from
                 it, never from a file), buffer_layout (JSON), mode, num_workers, num_params, num_buffers,
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
                 pipeline modes, a digest of the worker's weights after the step (replicas must agree;
                 rank 0 checks it as the rows arrive); data_s: seconds of compute_s the step waited for its
                 minibatch (the input pipeline; `report` prints its share, "data wait")
    /shard_pushes  (--servers S > 1; empty otherwise) SHARD_PUSH_ROW, one row per push per parameter-server
                 shard: time, shard, worker, step, base_version, version, staleness (each shard's own
                 versions), applied; the log's attributes then also hold the cut (servers, shard_bounds,
                 shard_params), the shards' processes (shard_processes: JSON [[rank, host, pid], ...]) and, at
                 the end, shard_versions, shard_staleness_mean and shard_staleness_max (the applied rows of
                 this table, every segment of a resumed run but the superseded spans), shard_wire_bytes_pushed
                 and shard_wire_bytes_pulled (each shard's part of wire_bytes_pushed and wire_bytes_pulled)
    /updates     one row per server update (UPDATE_ROW): time, version, lr, gradient norm, samples, epoch
    /snapshots/params  (S, P) float32 weights every `snapshot_interval` seconds (default -1, auto: max(5 s,
                       model bytes / 1 MB/s): `optim.snapshot_seconds`), first and last included; sync and
                       pipeline also at every evaluation during training
    /snapshots/buffers (S, B) float32 the layers' buffers with each snapshot (BatchNorm's running statistics;
                       only for a network that has buffers): async/ssp/easgd: rank 0's average of the
                       workers' latest; sync: the replicas' common copy; pipeline: every module's
    /snapshots/meta    (S,) SNAPSHOT_ROW: time, version, samples, epoch
    /evals       EVAL_ROW: time, version, epoch, snapshot (-1: the final weights), loss, accuracy (top-1),
                 count, top5 (top-5 accuracy; 1.0 with 5 classes or fewer)
    /periodic_evals  PERIODIC_EVAL_ROW, one per evaluation during training (--eval-interval): time (when the
                 weights were taken), samples, epoch, version_min, version_max (async: the versions the
                 workers got), count, loss, top1, top5, seconds (the slowest evaluator's), snapshot (the
                 snapshot of the same weights in sync and pipeline mode, else -1)
    /events      EVENT_ROW: time, kind, text (start, stop reason, failures, preempt, resume; autotune:
                 a GPU worker's conv tiles chosen at start-up under --conv-algo autotune; pause: rank 0's
                 own loop did not run for a while, not counted as the workers' silence; diverged, dead,
                 recovered: the training loss spiked, the network is dead (loss at ln(classes), chance
                 accuracy) or trains again, mpiasgd.health; fault_tolerance: ULFM or not, at start-up;
                 worker_lost: a worker died under ULFM and the run went on without it; late_message: a
                 message of a dropped worker, discarded)
    /checkpoints CHECKPOINT_ROW: time, seconds (to write it), version, samples, elapsed (training seconds
                 it holds), reason (interval | end | preempt | failure: a worker died); the file is
                 RUN_DIR/NAME.ckpt.h5
    /wire_bytes  (async, ssp, easgd) WIRE_BYTES_ROW, one row per parameter-server shard with every checkpoint: time
                 (the checkpoint's log time), shard, pushed, pulled: the bytes of the exchange (PUSH received;
                 WEIGHTS and STOP sent; headers included) the shard had moved by then, so that a resumed run's
                 summary attributes wire_bytes_pushed and wire_bytes_pulled (every shard's) continue from its
                 checkpoint's (the checkpoint keeps the same counts, `checkpoint.Checkpoint.wire_bytes`, which a
                 resume takes first; from a checkpoint without them and a log without these rows, older or
                 lost, they count from the resume)

A resumed run (`--resume`) continues the same file: status goes back to "running", an event
"resume" marks where the new segment starts, the clock continues after the last row, and rows
continue from the checkpoint's version and steps. Rows the previous segment logged after its last
checkpoint stay (nothing logged is lost); their versions and steps are repeated by the new segment,
and their time span is listed in the attribute `superseded` (JSON [[start, end], ...]): `report`
leaves those pushes, updates and evaluations out of its counts. A log written by an older version is
upgraded when resumed: tables it lacks are created, and the columns added since (`records.ADDED`) are
appended to its tables (nan: unknown); readers see them the same way.

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
turns the latter into a clean file with status "killed"). A run that begins to end on a signal closes
the file and releases the lock at once (`RunLog.end_early`: status "preempted"), as its launcher may
kill it any moment; the rows it logs after that are written in short re-openings under the lock.

A file that cannot be written (disk full, quota, I/O error) raises RunLogError, one line naming the
file and the cause ("[Errno 28] No space left on device"), never HDF5's chained messages. A failed
flush cuts the tables back to their last flushed rows, so the file never points at rows that did not
reach the disk; the log then takes no more rows, and `abandon` (which `close` calls) marks it
"failed" where the disk still has room, closes it and releases the lock. Readable up to the last
flush either way. Every flush first checks the free space (`ensure_free_space`: the buffered rows
and snapshots + 5 % + 1 MiB), so a full disk is this error before HDF5 is called.

Every table's row is a typed record (`records`: PushRow, UpdateRow, SnapshotRow, EvalRow, PeriodicEvalRow,
EventRow, CheckpointRow, ShardPushRow, WireBytesRow, WorkerRow) whose fields are its columns;
`RunLog.add(record)` appends to the table of the record's type.

    records.py     the rows: one record class per table, its numpy dtype derived from it
    writer.py      RunLog (buffered SWMR writer), recover
    reader.py      open_log, open_run, load (a run log as a dict of attributes and tables)
    summary.py     summary_lines (the end of `mpiasgd train`) and the figures `mpiasgd report` shares
    tensorboard.py TensorBoard: the metrics as TensorBoard event files (--tensorboard; tensorboardX)
    lock.py        WriterLock, writer_alive
    superblock.py  the superblock's consistency flags: clear_stale_flags, lookup3
    (mpiasgd/files.py: RunLogError, ensure_free_space (a full disk), PIECE, checkpoint_path)
"""

from mpiasgd.files import FREE_MARGIN, PIECE, RunLogError, ensure_free_space, os_error
from mpiasgd.runlog.lock import WriterLock, writer_alive
from mpiasgd.runlog.reader import TruncatedLogError, load, open_log, open_run
from mpiasgd.runlog.records import (
    CHECKPOINT_ROW,
    EVAL_ROW,
    EVENT_ROW,
    PERIODIC_EVAL_ROW,
    PUSH_ROW,
    SHARD_PUSH_ROW,
    SNAPSHOT_ROW,
    TABLES,
    UPDATE_ROW,
    WIRE_BYTES_ROW,
    WORKER_ROW,
    CheckpointRow,
    EvalRow,
    EventRow,
    PeriodicEvalRow,
    PushRow,
    Record,
    ShardPushRow,
    SnapshotRow,
    UpdateRow,
    WireBytesRow,
    WorkerRow,
    upgrade,
)
from mpiasgd.runlog.summary import health_line, summary_lines
from mpiasgd.runlog.superblock import SIGNATURE, SWMR_WRITE, clear_stale_flags, lookup3, superblock_flags
from mpiasgd.runlog.writer import RunLog, append, recover, upgrade_tables

__all__ = [
    "CHECKPOINT_ROW", "EVAL_ROW", "EVENT_ROW", "FREE_MARGIN", "PERIODIC_EVAL_ROW", "PIECE", "PUSH_ROW",
    "SHARD_PUSH_ROW", "SIGNATURE", "SNAPSHOT_ROW", "SWMR_WRITE", "TABLES", "UPDATE_ROW", "WIRE_BYTES_ROW", "WORKER_ROW",
    "CheckpointRow", "EvalRow", "EventRow", "PeriodicEvalRow", "PushRow", "Record", "RunLog", "RunLogError",
    "ShardPushRow", "SnapshotRow", "TruncatedLogError", "UpdateRow", "WireBytesRow", "WorkerRow", "WriterLock",
    "append", "clear_stale_flags", "ensure_free_space", "health_line", "load", "lookup3", "open_log", "open_run",
    "os_error", "recover", "summary_lines", "superblock_flags", "upgrade", "upgrade_tables", "writer_alive",
]
