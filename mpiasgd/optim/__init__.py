"""Optimizers and schedules (no config: each takes the values it needs).

    sgd       SGD (rank 0, host, cache-blocked), LocalSGD (a worker's, on its backend), apply_delta,
              staleness_factor, finite_square
    schedule  Schedule (warm-up, constant/step/cosine), StopRule (epochs, max_pushes, max_time),
              EvalSchedule (--eval-interval), snapshot_seconds (--snapshot-interval's auto rule)
"""

from mpiasgd.optim.schedule import (
    AUTO_SNAPSHOTS,
    EvalSchedule,
    Schedule,
    StopRule,
    fraction_done,
    learning_rate,
    snapshot_seconds,
)
from mpiasgd.optim.sgd import CHUNK, SGD, LocalSGD, apply_delta, finite_square, run_blocks, staleness_factor

__all__ = ["AUTO_SNAPSHOTS", "CHUNK", "SGD", "EvalSchedule", "LocalSGD", "Schedule", "StopRule", "apply_delta",
           "finite_square", "fraction_done", "learning_rate", "run_blocks", "snapshot_seconds", "staleness_factor"]
