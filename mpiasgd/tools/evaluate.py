"""`mpiasgd evaluate RUN.h5`: test-set accuracy of every weight snapshot of a run log, written into the log.

    mpiasgd evaluate runs/NAME.h5      # accuracy of every weight snapshot, written into the log

Snapshot evaluation happens after training, so accuracy against wall time comes from the log
without slowing the run down.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import numpy as np

from mpiasgd.runlog import EVAL_ROW, EvalRow, append, open_log, open_run, recover, writer_alive


def evaluate_snapshots(path: str, data_dir: str | None = None, batch_size: int = 1000,
                       every: int = 1, show: Callable[[np.void], None] | None = None) -> np.ndarray:
    """Evaluate every `every`-th weight snapshot (and the last) of the run log at `path` on the full test set.

    Each result row (an EVAL_ROW row: `EvalRow` fields, loss in nats, accuracy a fraction) is passed to
    `show` as soon as it is computed, then all are stored in the log's `/evals` table (column
    `snapshot` = its index), replacing earlier rows of the same snapshots; returns them, (S,) EVAL_ROW.
    The dataset and network are the run's own (the stored config and network definition, with each
    snapshot's layer buffers); `data_dir` overrides where the data is read. A log whose writer was
    killed is first rewritten into a clean file (`runlog.recover`, status "killed"). Raises
    FileNotFoundError, ValueError (not an mpiasgd log, or no snapshots) or RuntimeError (the run is
    still being written).
    """
    from mpiasgd.data import load_dataset  # late imports: the models pull in the ops backends
    from mpiasgd.model import MODELS, build_model, evaluate
    from mpiasgd.model.spec import stored

    if writer_alive(path):
        raise RuntimeError(f"run log '{path}' is still being written by a running job; evaluate it when it has ended")
    with open_run(path) as f:  # FileNotFoundError / ValueError with a clear message
        cfg = json.loads(f.attrs["config"])
        spec = stored(f.attrs, f"run log '{path}'")
        meta = f["snapshots/meta"][()]
        if len(meta) == 0:
            raise ValueError(f"run log '{path}' has no weight snapshots to evaluate")
        chosen = sorted(set(range(0, len(meta), every)) | {len(meta) - 1})
        snapshots = f["snapshots/params"][chosen]  # (S, P) float32
        buffers = f["snapshots/buffers"][chosen] if "snapshots/buffers" in f else None  # (S, B) float32
    dataset = load_dataset(cfg["dataset"] or MODELS[cfg["model"]].dataset, data_dir or cfg["data_dir"] or None)
    model = build_model(spec, "numpy")  # from the stored definition: data, never a model file
    if model.num_params != snapshots.shape[1]:  # (checked before anything of the network's size is allocated)
        raise ValueError(f"run log '{path}': its network definition has {model.num_params} parameters, the "
                         f"snapshots hold {snapshots.shape[1]}")
    if model.num_buffers and (buffers is None or buffers.shape[1] != model.num_buffers):
        raise ValueError(f"run log '{path}': its network has {model.num_buffers} buffer values, the snapshots "
                         f"hold {'none' if buffers is None else buffers.shape[1]}")
    weights, grads = np.empty(model.num_params, np.float32), np.empty(model.num_params, np.float32)
    state = model.init_buffers()
    model.bind(weights, grads, state)
    idx = np.arange(dataset.test_y.size, dtype=np.int64)
    rows = np.zeros(len(chosen), dtype=EVAL_ROW)
    for k, (i, snap) in enumerate(zip(chosen, snapshots, strict=True)):
        weights[:] = snap
        if model.num_buffers:
            state[:] = buffers[k]
        loss_sum, correct, count = evaluate(model, dataset, idx, batch_size)
        m = meta[i]
        rows[k] = EvalRow(time=m["time"], version=m["version"], epoch=m["epoch"], snapshot=i, loss=loss_sum / count,
                          accuracy=correct / count, count=count).row()
        if show is not None:
            show(rows[k])
    try:
        f = open_log(path, "r+")
    except OSError:  # still marked open for writing: its writer was killed (checked alive above)
        recover(path)
        f = open_log(path, "r+")
    with f:
        old = f["evals"][()]
        keep = old[~np.isin(old["snapshot"], chosen)]
        table = f["evals"]
        table.resize(0, axis=0)
        append(table, np.concatenate([keep, rows]))
        f.attrs["evaluated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return rows
