"""`mpiasgd report RUN.h5 [RUN2.h5 ...] --plots DIR`: PNG plots of run logs (matplotlib, no display).

    accuracy.png   test accuracy against training time and against epochs, runs overlaid: the evaluations
                   during training (--eval-interval: top-1 solid with dots, top-5 dashed), the evaluated
                   snapshots (`mpiasgd evaluate RUN.h5`; dotted when both are there), the final evaluation
                   marked (*)
    loss.png       training loss (mean over the applied pushes of each 1 % of the run) against
                   training time and against epochs, runs overlaid
    staleness.png  staleness histogram per worker, one panel per run
    time.png       per worker the split of its time into compute, communicate and wait, stacked bars,
                   one panel per run
"""

from __future__ import annotations

import os

import numpy as np

from mpiasgd.runlog.summary import periodic_evals


def _name(run: dict) -> str:
    base = os.path.basename(run["path"])
    return base[:-3] if base.endswith(".h5") else base


def _applied(run: dict) -> np.ndarray:
    pushes = run["pushes"]
    return pushes[pushes["applied"] == 1]


def _epochs_at(run: dict, times: np.ndarray) -> np.ndarray:
    """Epoch at each training time, from the updates table (samples / training set)."""
    updates = run["updates"]
    if updates is None or len(updates) == 0:
        return np.zeros_like(times)
    return np.interp(times, updates["time"], updates["epoch"])


def plot_runs(runs: list[dict], out_dir: str) -> list[str]:
    """Write the four PNGs for `runs` (each `mpiasgd.runlog.load`) into `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []

    def save(fig, name: str) -> None:
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, (by_time, by_epoch) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for run in runs:
        color = None
        during = periodic_evals(run)
        if during is not None:  # --eval-interval: the curve the run logged as it trained
            line, = by_time.plot(during["time"], 100 * during["top1"], marker="o", markersize=3,
                                 label=f"{_name(run)} top-1")
            color = line.get_color()
            by_time.plot(during["time"], 100 * during["top5"], linestyle="--", color=color, alpha=0.6,
                         label=f"{_name(run)} top-5")
            by_epoch.plot(during["epoch"], 100 * during["top1"], marker="o", markersize=3, color=color)
            by_epoch.plot(during["epoch"], 100 * during["top5"], linestyle="--", color=color, alpha=0.6)
        evals, meta = run["evals"], run["snapshots/meta"]
        if evals is None or meta is None:
            continue
        snaps = evals[evals["snapshot"] >= 0]
        snaps = snaps[np.argsort(snaps["snapshot"])]
        t = meta["time"][snaps["snapshot"]]
        if color is None or len(snaps):
            line, = by_time.plot(t, 100 * snaps["accuracy"], marker=".", linestyle="-" if color is None else ":",
                                 color=color, label=_name(run) if color is None else f"{_name(run)} snapshots")
            color = line.get_color()
            by_epoch.plot(meta["epoch"][snaps["snapshot"]], 100 * snaps["accuracy"], marker=".", color=color,
                          linestyle=line.get_linestyle())
        final = evals[evals["snapshot"] == -1]
        if len(final):
            end = float(run.get("train_time_s") or (t.max() if len(t) else 0.0))
            by_time.plot([end], [100 * final["accuracy"][-1]], marker="*", markersize=12, color=color)
            by_epoch.plot([float(final["epoch"][-1])], [100 * final["accuracy"][-1]], marker="*", markersize=12,
                          color=color)
    by_time.set(xlabel="training time (s)", ylabel="test accuracy (%)", title="test accuracy")
    by_epoch.set(xlabel="epoch", title="test accuracy by epoch (* final)")
    by_time.legend()
    save(fig, "accuracy.png")

    fig, (by_time, by_epoch) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for run in runs:
        applied = _applied(run)
        if len(applied) == 0:
            continue
        chunks = np.array_split(np.argsort(applied["time"], kind="stable"), min(100, len(applied)))
        t = np.array([applied["time"][c].mean() for c in chunks])
        loss = np.array([applied["loss"][c].mean() for c in chunks])
        line, = by_time.plot(t, loss, label=_name(run))
        by_epoch.plot(_epochs_at(run, t), loss, color=line.get_color())
    by_time.set(xlabel="training time (s)", ylabel="training loss", title="training loss", yscale="log")
    by_epoch.set(xlabel="epoch", title="training loss (mean of each 1 % of the pushes)")
    by_time.legend()
    save(fig, "loss.png")

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        applied = _applied(run)
        workers = sorted(set(applied["worker"].tolist()))
        top = int(applied["staleness"].max()) if len(applied) else 0
        bins = np.arange(top + 2) - 0.5
        ax.hist([applied["staleness"][applied["worker"] == w] for w in workers] or [[]], bins=bins,
                label=[f"rank {w}" for w in workers] or None)
        ax.set(xlabel="staleness", ylabel="applied pushes", title=f"{_name(run)}: staleness per worker")
        if workers:
            ax.legend()
    save(fig, "staleness.png")

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.6), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        pushes = run["pushes"]
        workers = sorted(set(pushes["worker"].tolist()))
        bottom = np.zeros(len(workers))
        for part in ("compute", "comm", "wait"):
            seconds = np.array([pushes[f"{part}_s"][pushes["worker"] == w].sum() for w in workers])
            ax.bar([str(w) for w in workers], seconds, bottom=bottom, label=part)
            bottom += seconds
        ax.set(xlabel="worker rank", ylabel="seconds", title=f"{_name(run)}: time per worker")
        ax.legend()
    save(fig, "time.png")
    return paths
