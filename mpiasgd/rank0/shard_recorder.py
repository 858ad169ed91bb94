"""The recorder of a parameter-server shard of rank >= 1 (`--servers S > 1`): the figures its role keeps,
no log.

A shard runs rank 0's loop with its mode's server on its slice (`mpiasgd.rank0.loop`), and the server
reports to a recorder as rank 0's does. This one keeps what the server's rules need: the shard's version
(its own counter), the images it has applied (the schedule's clock, `epoch`), its training clock, the
staleness it saw, its rejected pushes (TrainingDiverged, naming the shard, after --max-rejects in a row,
as on rank 0). It decides nothing: no stopping rule, no divergence watch, no snapshots or checkpoints;
the stop comes from rank 0 (`stop`, called by the HubLink on SHARD_STOP). Its push rows are kept
(`rows`) until the HubLink sends them to rank 0, which logs them (/shard_pushes); the bytes of its exchange
with the workers (`count_wire`, in this job) go with them and with its slices, and rank 0 adds them to the
run's (`wire_bytes_pushed`, `wire_bytes_pulled`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mpiasgd import checkpoint
from mpiasgd.config import Config
from mpiasgd.rank0.recorder import Recorder
from mpiasgd.runlog import ShardPushRow


class ShardRecorder(Recorder):
    """The recorder of parameter-server shard `shard` (rank `rank` >= 1): see the module docstring. `cfg`,
    `workers` (the worker ranks) and `num_train` (images in one epoch) as for a Recorder."""

    keeps_log = False

    def __init__(self, cfg: Config, workers: range, num_train: int, shard: int, rank: int) -> None:
        super().__init__(cfg, None, workers, num_train)
        self.shard, self.rank = shard, rank
        self.who = f"rank {rank} (parameter-server shard {shard})"
        self.rows: list[tuple] = []  # ShardPushRow rows not yet sent to rank 0

    # --- clocks: training seconds continue from a resumed checkpoint's ---
    def begin(self) -> None:
        self.start = time.perf_counter() - (self.resumed.elapsed if self.resumed is not None else 0.0)

    # --- what it records: its push rows; the log's other rows are rank 0's ---
    def event(self, kind: str, text: str, at: float | None = None) -> None:
        """Nothing: rank 0 logs the run's events."""

    def warn(self, text: str) -> None:
        """Nothing: rank 0 warns about the same pushes."""

    def push(self, *, worker: int, step: int, base_version: int, version: int, staleness: int, applied: bool,
             **figures: Any) -> None:
        """One ShardPushRow of this shard, kept for rank 0 (the worker's other `figures` are rank 0's to log)."""
        self.rows.append(ShardPushRow(time=self.now(), shard=self.shard, worker=worker, step=step,
                                      base_version=base_version, version=version, staleness=staleness,
                                      applied=applied).row())

    def lost_push(self, worker: int, step: int, version: int) -> None:
        """A dead worker's push counted here with nothing applied (`Recorder.lost_push`): this shard's row."""
        self.push(worker=worker, step=step, base_version=version, version=version, staleness=0, applied=True)

    def take_rows(self) -> np.ndarray:
        """The push rows kept since the last call (SHARD_PUSH_ROW (n,)), now no longer kept."""
        rows = np.array(self.rows, dtype=ShardPushRow.dtype)
        self.rows = []
        return rows

    def update(self, *, version: int, lr: float, grad_norm: float = float("nan")) -> None:
        self.lr = float(lr)

    def training_loss(self, loss: float, correct: int, samples: int) -> None:
        """Nothing: rank 0 watches the training loss."""

    def check_stop(self) -> None:
        """Nothing: only rank 0 decides when the run stops (it tells the shards)."""

    # --- rank 0's duties: none here ---
    def snapshot(self, params: np.ndarray, buffers: np.ndarray | None = None, version: int | None = None,
                 samples: int | None = None) -> int:
        return -1

    def write_checkpoint(self, ckpt: checkpoint.Checkpoint) -> bool:
        return False

    def maybe_flush(self) -> None:
        """Nothing: the HubLink sends the rows at the log's flush interval."""

    def show_progress(self, force: bool = False) -> None:
        pass

    def finish_watch(self) -> None:
        pass

    def close_tensorboard(self) -> None:
        pass

    def restore(self, ckpt: checkpoint.Checkpoint) -> None:
        """Continue from `ckpt`, this shard's slice of rank 0's checkpoint (its training seconds; the role restores
        its version and images): staleness, rejects and bytes moved count from the resume (rank 0 keeps the
        run's)."""
        self.resumed = ckpt

    def summary(self, evals: dict, preempted: str) -> dict:
        return {}
