"""Test-set evaluation: of bound weights (workers, at the end of a run) and of a run log's snapshots.

    mpiasgd evaluate runs/NAME.h5      # accuracy of every weight snapshot, written into the log

Snapshot evaluation happens after training, so accuracy against wall time comes from the log
without slowing the run down.
"""

from __future__ import annotations

import json
import time

import numpy as np

from mpiasgd.runlog import append, open_log


def evaluate(model, dataset, idx: np.ndarray, batch_size: int) -> tuple[float, int, int]:
    """Forward the test images `idx` (int64) through `model` with its bound weights.

    Returns (summed cross-entropy loss, number correct, number of images), in batches of `batch_size`.
    """
    loss_sum, correct = 0.0, 0
    for start in range(0, idx.size, batch_size):
        x, y = dataset.batch("test", idx[start:start + batch_size])  # (B, C, H, W) float32, (B,) int64
        batch_loss, batch_correct = model.evaluate(x, y, batch_size)
        loss_sum += float(batch_loss)
        correct += int(batch_correct)
    return loss_sum, correct, int(idx.size)


def evaluate_snapshots(path: str, data_dir: str | None = None, batch_size: int = 1000,
                       every: int = 1) -> np.ndarray:
    """Evaluate every `every`-th weight snapshot of the run log at `path` on the full test set.

    Appends one row per snapshot to the log's `/evals` table (column `snapshot` = its index;
    earlier rows for the same snapshots are kept) and returns the new rows (EVAL_ROW). The
    dataset and model are the run's own (from the stored config); `data_dir` overrides where the
    data is read. Raises FileNotFoundError, or ValueError if the log has no snapshots.
    """
    from mpiasgd.data import load_dataset
    from mpiasgd.model import build_model
    from mpiasgd.runlog import EVAL_ROW

    with open_log(path) as f:
        cfg = json.loads(f.attrs["config"])
        meta = f["snapshots/meta"][()]
        params = f["snapshots/params"]
        if len(meta) == 0:
            raise ValueError(f"run log '{path}' has no weight snapshots to evaluate")
        chosen = sorted(set(range(0, len(meta), every)) | {len(meta) - 1})
        snapshots = params[chosen]                       # (S, P) float32
    dataset = load_dataset(cfg["dataset"] or cfg["model"], data_dir or cfg["data_dir"] or None)
    model = build_model(cfg["model"], "numpy")
    weights, grads = np.empty(model.num_params, np.float32), np.empty(model.num_params, np.float32)
    model.bind(weights, grads)
    idx = np.arange(dataset.test_y.size, dtype=np.int64)
    rows = []
    for i, snap in zip(chosen, snapshots, strict=True):
        weights[:] = snap
        loss_sum, correct, count = evaluate(model, dataset, idx, batch_size)
        m = meta[i]
        rows.append((m["time"], m["version"], m["epoch"], i, loss_sum / count, correct / count, count))
    rows = np.array(rows, dtype=EVAL_ROW)
    with open_log(path, "r+") as f:
        append(f["evals"], rows)
        f.attrs["evaluated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return rows
