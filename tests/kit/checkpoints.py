"""A checkpoint with known fields (mpiasgd.checkpoint.Checkpoint), for the file-format and disk tests."""

from __future__ import annotations

import numpy as np

from mpiasgd import checkpoint
from mpiasgd.checkpoint import Checkpoint


def make_ckpt(P=10, seed=0, version=7):
    rng = np.random.default_rng(seed)
    rows = np.array([(1, 5, 6, 0), (2, 4, 4, 1)], dtype=checkpoint.WORKER_STATE)
    return Checkpoint(params=rng.standard_normal(P).astype(np.float32),
                      momentum=rng.standard_normal(P).astype(np.float32), workers=rows, version=version,
                      samples=320, elapsed=12.5, log_time=13.0, config='{"model": "digits"}', log="runs/x.h5",
                      mode="async", model="digits", reason="interval", staleness_sum=9, staleness_max=3,
                      staleness_count=7)
