"""Optimizers and schedules (no config: each takes the values it needs).

    sgd       SGD (rank 0, host, cache-blocked), LocalSGD (a worker's, on its backend), apply_delta,
              staleness_factor, finite_square
    schedule  Schedule (warm-up, constant/step/cosine), StopRule (epochs, max_pushes, max_time)
"""

from mpiasgd.optim.schedule import Schedule, StopRule, fraction_done, learning_rate
from mpiasgd.optim.sgd import CHUNK, SGD, LocalSGD, apply_delta, finite_square, run_blocks, staleness_factor

__all__ = ["CHUNK", "SGD", "LocalSGD", "Schedule", "StopRule", "apply_delta", "finite_square",
           "fraction_done", "learning_rate", "run_blocks", "staleness_factor"]
