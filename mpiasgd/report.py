"""`mpiasgd report RUN.h5 [RUN2.h5 ...]`: summary tables of run logs, also of running or killed runs.

Everything is computed from the log's tables (pushes, evals, ...), so a run still being written
(read in SWMR mode) or one that was killed reports what it had flushed.
"""

from __future__ import annotations

import json
import os

import numpy as np

from mpiasgd.runlog import open_log, writer_alive


def _attr(f, key: str, default=None):
    value = f.attrs.get(key, default)
    return value.decode() if isinstance(value, bytes) else value


def open_run(path: str):
    """Open the run log at `path` for reading (an h5py.File, SWMR), checking that it is one.

    Raises FileNotFoundError if it does not exist, ValueError if it is not an mpiasgd run log.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"run log '{path}' not found")
    try:
        f = open_log(path)
    except OSError as e:
        raise ValueError(f"'{path}' is not a readable HDF5 file ({e})") from None
    if "config" not in f.attrs or "pushes" not in f:
        f.close()
        raise ValueError(f"'{path}' is not an mpiasgd run log (no 'config' attribute or 'pushes' table)")
    return f


def load(path: str) -> dict:
    """Read what a report needs from the run log at `path` (errors as `open_run`).

    A log marked "running" whose writer is gone gets status "killed".
    """
    with open_run(path) as f:
        run = {key: _attr(f, key) for key in f.attrs}
        for name in ("pushes", "updates", "evals", "workers", "snapshots/meta", "events"):
            run[name] = f[name][()] if name in f else None
    run["config"] = json.loads(run.get("config") or "{}")
    run["path"] = path
    if run.get("status") == "running" and not writer_alive(path):
        run["status"] = "killed (its writer is gone; rows up to the last flush)"
    return run


def _final_eval(run: dict):
    evals = run["evals"]
    if evals is None or len(evals) == 0:
        return None
    final = evals[evals["snapshot"] == -1]
    return final[-1] if len(final) else None


def _train_time(run: dict) -> float:
    value = run.get("train_time_s")
    if value:
        return float(value)
    pushes = run["pushes"]
    return float(pushes["time"].max()) if pushes is not None and len(pushes) else 0.0


def summary_lines(path: str, run: dict | None = None) -> list[str]:
    """The short summary printed at the end of `mpiasgd train`: accuracy, images/s, staleness, time."""
    run = run or load(path)
    pushes = run["pushes"]
    applied = pushes[pushes["applied"] == 1] if pushes is not None else pushes
    final = _final_eval(run)
    train_time = _train_time(run)
    images = int(applied["samples"].sum()) if applied is not None else 0
    lines = [f"run log          {path}  (status: {run.get('status')})"]
    if final is not None:
        lines.append(f"test accuracy    {100 * final['accuracy']:.2f} %  on {final['count']:,} images "
                     f"(loss {final['loss']:.4f})")
    lines.append(f"images/s         {images / train_time if train_time else 0:,.0f}  "
                 f"({images:,} images in {train_time:.1f} s of training, "
                 f"{images / max(1, int(run.get('num_train') or 1)):.2f} epochs)")
    if applied is not None and len(applied):
        lines.append(f"staleness        mean {applied['staleness'].mean():.2f}, max {applied['staleness'].max()}")
    if pushes is not None and "rejected" in (pushes.dtype.names or ()) and pushes["rejected"].any():
        bad = pushes[pushes["rejected"] == 1]
        per = ", ".join(f"rank {w}: {(bad['worker'] == w).sum()}" for w in sorted(set(bad["worker"].tolist())))
        lines.append(f"rejected pushes  {len(bad)} non-finite gradients ({per})")
    if run.get("wall_time_s") is not None:
        lines.append(f"wall time        {float(run['wall_time_s']):.1f} s (server, start to end)")
    return lines


def worker_table(run: dict) -> list[str]:
    """Per-worker pushes, images/s, staleness and time split (compute / communicate / wait)."""
    pushes, train_time = run["pushes"], _train_time(run)
    lines = ["rank  host              pushes    images  images/s  stale mean  stale max   compute    comm    wait"]
    hosts = {int(w["rank"]): w["host"].decode() for w in run["workers"]} if run["workers"] is not None else {}
    for rank in sorted(set(pushes["worker"].tolist())):
        p = pushes[pushes["worker"] == rank]
        total = float(p["compute_s"].sum() + p["comm_s"].sum() + p["wait_s"].sum()) or 1.0
        lines.append(
            f"{rank:>4}  {hosts.get(rank, '?')[:16]:<16} {len(p):>7} {int(p['samples'].sum()):>9} "
            f"{p['samples'].sum() / train_time if train_time else 0:>9.0f} {p['staleness'].mean():>11.2f} "
            f"{p['staleness'].max():>10} {100 * p['compute_s'].sum() / total:>8.1f}% "
            f"{100 * p['comm_s'].sum() / total:>6.1f}% {100 * p['wait_s'].sum() / total:>6.1f}%")
    return lines


def staleness_histogram(pushes: np.ndarray, width: int = 40) -> list[str]:
    """Text histogram of the staleness of applied pushes."""
    applied = pushes[pushes["applied"] == 1]
    if len(applied) == 0:
        return ["(no applied pushes)"]
    values, counts = np.unique(applied["staleness"], return_counts=True)
    lines = ["staleness   pushes"]
    for v, c in zip(values, counts, strict=True):
        lines.append(f"{v:>9} {c:>8}  {'#' * max(1, round(width * c / counts.max()))}")
    return lines


def snapshot_table(run: dict) -> list[str]:
    evals = run["evals"]
    rows = evals[evals["snapshot"] >= 0] if evals is not None else []
    if len(rows) == 0:
        return [f"(no snapshot evaluations: run 'mpiasgd evaluate {run['path']}')"]
    lines = ["snapshot    time s   epoch   version   test acc   test loss"]
    for r in sorted(rows, key=lambda r: r["snapshot"]):
        lines.append(f"{r['snapshot']:>8} {r['time']:>8.1f} {r['epoch']:>7.2f} {r['version']:>9} "
                     f"{100 * r['accuracy']:>9.2f}% {r['loss']:>11.4f}")
    return lines


def report(paths: list[str]) -> str:
    """The full report of each run log in `paths`, as text."""
    out = []
    for path in paths:
        run = load(path)
        cfg = run["config"]
        out.append(f"== {path}")
        out.append(f"model {run.get('model')}, mode {run.get('mode')}, {run.get('num_workers')} workers, "
                   f"{run.get('num_params')} parameters, batch {cfg.get('batch_size')}, lr {cfg.get('lr')}, "
                   f"created {run.get('created')}")
        out += summary_lines(path, run)
        if run["pushes"] is not None and len(run["pushes"]):
            out += ["", *worker_table(run), "", *staleness_histogram(run["pushes"])]
        out += ["", *snapshot_table(run), ""]
    return "\n".join(out)
