"""Optimizers and schedules (no config: each takes the values it needs).

    sgd       SGD (rank 0, host, one compiled loop), NumpySGD (its numpy reference, cache-blocked),
              LocalSGD (a worker's, on its backend), apply_delta, staleness_factor, finite_square
    compiled  the loops of SGD and apply_delta (numba; imported by their first update)
    delay     DelayCompensation (DC-ASGD), LookAhead (--lookahead, DANA), explicit_momentum (--async-momentum)
    schedule  Schedule (warm-up, constant/step/cosine), StopRule (epochs, max_pushes, max_time),
              EvalSchedule (--eval-interval), snapshot_seconds (--snapshot-interval's auto rule)
"""

from mpiasgd.optim.delay import (
    DelayCompensation,
    GapAware,
    LookAhead,
    explicit_momentum,
    lookahead_factor,
    lookahead_steps,
)
from mpiasgd.optim.schedule import (
    AUTO_SNAPSHOTS,
    EvalSchedule,
    Schedule,
    StopRule,
    fraction_done,
    learning_rate,
    snapshot_seconds,
)
from mpiasgd.optim.sgd import (
    CHUNK,
    SGD,
    LocalSGD,
    NumpySGD,
    apply_delta,
    finite_square,
    run_blocks,
    staleness_factor,
)

__all__ = ["AUTO_SNAPSHOTS", "CHUNK", "SGD", "DelayCompensation", "EvalSchedule", "GapAware", "LocalSGD", "LookAhead",
           "NumpySGD", "Schedule", "StopRule", "apply_delta", "explicit_momentum", "finite_square", "fraction_done",
           "learning_rate", "lookahead_factor", "lookahead_steps", "run_blocks", "snapshot_seconds", "staleness_factor"]
