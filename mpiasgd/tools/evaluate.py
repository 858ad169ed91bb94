"""`mpiasgd evaluate RUN.h5`: test-set accuracy of every weight snapshot of a run log, written into the log.

    mpiasgd evaluate runs/NAME.h5      # accuracy of every weight snapshot, written into the log

Snapshot evaluation happens after training, so accuracy against wall time comes from the log
without slowing the run down (--eval-interval evaluates during the run instead: the log's
/periodic_evals). Each row holds top-1 and top-5 accuracy (`snapshot_line` prints one).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from mpiasgd.data.loader import open_data
from mpiasgd.model import MODELS, build_model, evaluate
from mpiasgd.model.spec import ModelSpecError, stored
from mpiasgd.runlog import EVAL_ROW, EvalRow, append, open_log, open_run, recover, upgrade, writer_alive
from mpiasgd.runlog.reader import reading, require, run_config

SNAPSHOT_HEADER = "snapshot    time s   epoch   test acc   top-5 acc   test loss"


def snapshot_line(r: np.void) -> str:
    """One EVAL_ROW row as a line under SNAPSHOT_HEADER (top-5 "-" for a row written before it was kept)."""
    top5 = f"{100 * r['top5']:>10.2f}%" if "top5" in (r.dtype.names or ()) and np.isfinite(r["top5"]) else f"{'-':>11}"
    return (f"{r['snapshot']:>8} {r['time']:>8.1f} {r['epoch']:>7.2f} {100 * r['accuracy']:>9.2f}% {top5} "
            f"{r['loss']:>11.4f}")


def not_finite(values: np.ndarray | None, what: str) -> list[str]:
    """["3 of 120 `what`"] when some of `values` ((N,) float) are NaN or inf; [] when all are finite (or None)."""
    if values is None:
        return []
    bad = int(values.size - np.count_nonzero(np.isfinite(values)))
    return [f"{bad:,} of {values.size:,} {what}"] if bad else []


def evaluate_snapshots(path: str, data_dir: str | None = None, batch_size: int = 1000,
                       every: int = 1, show: Callable[[np.void], None] | None = None,
                       warn: Callable[[str], None] | None = None) -> np.ndarray:
    """Evaluate every `every`-th weight snapshot (and the last) of the run log at `path` on the full test set.

    Each result row (an EVAL_ROW row: `EvalRow` fields, loss in nats, accuracy and top5 fractions) is passed to
    `show` as soon as it is computed, then all are stored in the log's `/evals` table (column
    `snapshot` = its index), replacing earlier rows of the same snapshots; returns them, (S,) EVAL_ROW.
    A snapshot whose weights or layer buffers are not all finite is evaluated all the same, after a line
    saying so passed to `warn`. The dataset and network are the run's own (the stored config and network
    definition, with each snapshot's layer buffers); `data_dir` overrides where the data is read. A log
    whose writer was killed is first rewritten into a clean file (`runlog.recover`, status "killed").
    Every error names the log: FileNotFoundError, ValueError (not an mpiasgd log, damaged, no snapshots,
    a config or network definition that is not valid, a dataset whose images the network does not take;
    `DataError` for the dataset) or RuntimeError (the run is still being written).
    """
    if writer_alive(path):
        raise RuntimeError(f"run log '{path}' is still being written by a running job; evaluate it when it has ended")
    with open_run(path) as f, reading(path):  # FileNotFoundError / ValueError naming the file
        require(f, path, "snapshots/meta", "snapshots/params")
        cfg = run_config(path, f.attrs["config"])
        spec = stored(f.attrs, f"run log '{path}'")
        meta = f["snapshots/meta"][()]
        if len(meta) == 0:
            raise ValueError(f"run log '{path}' has no weight snapshots to evaluate")
        has_buffers = "snapshots/buffers" in f
        for name in ["snapshots/params"] + (["snapshots/buffers"] if has_buffers else []):
            if f[name].ndim != 2 or f[name].shape[0] < len(meta):
                raise ValueError(f"run log '{path}': /{name} has shape {f[name].shape}, expected (S, width) with "
                                 f"S >= {len(meta)}, the rows of /snapshots/meta")
        chosen = sorted(set(range(0, len(meta), every)) | {len(meta) - 1})
        snapshots = f["snapshots/params"][chosen]  # (S, P) float32
        buffers = f["snapshots/buffers"][chosen] if has_buffers else None  # (S, B) float32
    try:
        model = build_model(spec, "numpy")  # from the stored definition: data, never a model file
    except ModelSpecError as e:
        raise ModelSpecError(f"run log '{path}': its network definition: {e}") from None
    if model.num_params != snapshots.shape[1]:  # (checked before anything of the network's size is allocated)
        raise ValueError(f"run log '{path}': its network definition has {model.num_params} parameters, the "
                         f"snapshots hold {snapshots.shape[1]}")
    if model.num_buffers and (buffers is None or buffers.shape[1] != model.num_buffers):
        raise ValueError(f"run log '{path}': its network has {model.num_buffers} buffer values, the snapshots "
                         f"hold {'none' if buffers is None else buffers.shape[1]}")
    # the run's data: its file (and test file) or its named dataset, with its augmentation (the test crop)
    model_name = cfg.get("model")
    name = cfg.get("data") or cfg.get("dataset") or (MODELS[model_name].dataset if model_name in MODELS else "")
    if not name:
        raise ValueError(f"run log '{path}': its config names no dataset (no 'data' or 'dataset', and 'model' is not "
                         "a built-in network)")
    dataset = open_data(name, data_dir or cfg.get("data_dir") or None, cfg.get("test_data", ""),
                        cfg.get("augment", ""))
    if tuple(spec["input_shape"]) != tuple(dataset.input_shape):
        raise ValueError(f"run log '{path}': its network takes images of shape {tuple(spec['input_shape'])} "
                         f"(C, H, W), the dataset '{name}' gives {tuple(dataset.input_shape)}; evaluate on the "
                         f"data the run trained on")
    weights, grads = np.empty(model.num_params, np.float32), np.empty(model.num_params, np.float32)
    state = model.init_buffers()
    model.bind(weights, grads, state)
    idx = np.arange(dataset.test_y.size, dtype=np.int64)
    rows = np.zeros(len(chosen), dtype=EVAL_ROW)
    for k, (i, snap) in enumerate(zip(chosen, snapshots, strict=True)):
        weights[:] = snap
        if model.num_buffers:
            state[:] = buffers[k]
        broken = not_finite(snap, "weights") + not_finite(buffers[k] if model.num_buffers else None,
                                                          "layer buffer values (BatchNorm running statistics)")
        if broken and warn is not None:
            warn(f"snapshot {i} of run log '{path}': {' and '.join(broken)} are not finite (NaN or inf): its row "
                 f"is that of a broken network")
        loss_sum, correct, count, correct5 = evaluate(model, dataset, idx, batch_size)
        m = meta[i]
        rows[k] = EvalRow(time=m["time"], version=m["version"], epoch=m["epoch"], snapshot=i, loss=loss_sum / count,
                          accuracy=correct / count, count=count, top5=correct5 / count).row()
        if show is not None:
            show(rows[k])
    try:
        f = open_log(path, "r+")
    except OSError:  # still marked open for writing: its writer was killed (checked alive above)
        recover(path)
        f = open_log(path, "r+")
    with f:
        old = upgrade(f["evals"][()], "evals")  # a log written before top5 was kept: the column added, nan
        keep = old[~np.isin(old["snapshot"], chosen)]
        if f["evals"].dtype != EVAL_ROW:
            del f["evals"]
            f.create_dataset("evals", shape=(0,), maxshape=(None,), dtype=EVAL_ROW, chunks=(1024,))
        table = f["evals"]
        table.resize(0, axis=0)
        append(table, np.concatenate([keep, rows]))
        f.attrs["evaluated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return rows
