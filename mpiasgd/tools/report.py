"""`mpiasgd report RUN.h5 [RUN2.h5 ...]`: summary tables of run logs, also of running or killed runs.

    python -m mpiasgd report runs/a.h5                        # one run: summary, workers, staleness, snapshots
    python -m mpiasgd report runs/a.h5 runs/b.h5              # each run, then a table comparing them
    python -m mpiasgd report runs/*.h5 --format markdown --target-accuracy 0.6   # the table alone

Everything is computed from the log's tables (pushes, evals, ...), so a run still being written
(read in SWMR mode) or one that was killed reports what it had flushed. Every log is read before
anything is printed: one bad file gives one error naming it and no partial report.
"""

from __future__ import annotations

import csv
import io
import os

import numpy as np

from mpiasgd.argtypes import DEFAULT_TARGET, FORMATS
from mpiasgd.model import build_model
from mpiasgd.model.spec import ModelSpecError, from_json
from mpiasgd.modes.registry import PS_MODES, variant
from mpiasgd.runlog import load
from mpiasgd.runlog.summary import (
    applied_pushes,
    data_wait_share,
    events_of,
    final_eval,
    lost_workers,
    periodic_evals,
    replaced_workers,
    summary_lines,
    trained_images,
    training_time,
)
from mpiasgd.tools.evaluate import SNAPSHOT_HEADER, snapshot_line


def worker_table(run: dict) -> list[str]:
    """Per-worker pushes, images/s, staleness (of applied pushes), time split (compute / communicate / wait)
    and data wait (the share of its compute time the worker's steps waited for minibatches; "-" for a log
    written before it was kept). A worker that died while the run went on (ULFM) and did not push again (a
    resume brings it back) ends its line with when, and so does one that joined late (`mpiasgd simulate
    --join`); its images/s are over the time it was in."""
    pushes, train_time = run["pushes"], training_time(run)
    dead = {int(text.split()[2]): t for t, text in lost_workers(run)}  # ("worker rank R ...")
    dead = {w: t for w, t in dead.items() if not (pushes["time"][pushes["worker"] == w] > t).any()}
    replaced = replaced_workers(run)  # (--respawn: a replacement took the rank; its pushes go on the same line)
    joined = {int(text.split()[2]): t for t, text in events_of(run, "worker_joined")  # (simulate --join)
              if int(text.split()[2]) not in replaced}
    lines = ["rank  host              pushes    images  images/s  stale mean  stale max   compute    comm    wait"
             "  data wait"]
    hosts = {int(w["rank"]): w["host"].decode() for w in run["workers"]} if run["workers"] is not None else {}
    for rank in sorted(set(pushes["worker"].tolist())):
        p = pushes[pushes["worker"] == rank]
        stale = p["staleness"][p["applied"] == 1]  # applied pushes only (pipeline: no warm-up rows)
        images = int(p["samples"][p["applied"] == 1].sum())
        total = float(p["compute_s"].sum() + p["comm_s"].sum() + p["wait_s"].sum()) or 1.0
        share = data_wait_share(p)
        span = min(train_time, dead.get(rank, train_time)) - joined.get(rank, 0.0)  # its time in the run
        lines.append(
            f"{rank:>4}  {hosts.get(rank, '?')[:16]:<16} {len(p):>7} {images:>9} "
            f"{images / span if span > 0 else 0:>9.0f} "
            f"{stale.mean() if stale.size else 0.0:>11.2f} {stale.max() if stale.size else 0:>10} "
            f"{100 * p['compute_s'].sum() / total:>8.1f}% "
            f"{100 * p['comm_s'].sum() / total:>6.1f}% {100 * p['wait_s'].sum() / total:>6.1f}%"
            + (f" {100 * share:>9.1f}%" if share is not None else f" {'-':>10}")
            + (f"  joined at {joined[rank]:.1f} s" if rank in joined else "")
            + (f"  replaced at {replaced[rank]:.1f} s" if rank in replaced else "")
            + (f"  lost at {dead[rank]:.1f} s" if rank in dead else ""))
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
    """The evaluated weight snapshots (`mpiasgd evaluate`), one line each (top-1, top-5, loss)."""
    evals = run["evals"]
    rows = evals[evals["snapshot"] >= 0] if evals is not None else []
    if len(rows) == 0:
        return [f"(no snapshot evaluations: run 'mpiasgd evaluate {run['path']}')"]
    return [SNAPSHOT_HEADER, *(snapshot_line(r) for r in sorted(rows, key=lambda r: r["snapshot"]))]


def periodic_table(run: dict) -> list[str]:
    """The evaluations during training (--eval-interval), one line each; [] for a run without any."""
    rows = periodic_evals(run)
    if rows is None:
        return []
    lines = ["evaluations during training (--eval-interval):",
             "  time s   epoch        versions   images    top-1    top-5   test loss  seconds  snapshot"]
    for r in rows:
        versions = (f"{r['version_min']}" if r["version_min"] == r["version_max"]
                    else f"{r['version_min']}..{r['version_max']}")
        lines.append(f"{r['time']:>8.1f} {r['epoch']:>7.2f} {versions:>15} {r['count']:>8} "
                     f"{100 * r['top1']:>7.2f}% {100 * r['top5']:>7.2f}% {r['loss']:>11.4f} {r['seconds']:>8.1f} "
                     f"{r['snapshot'] if r['snapshot'] >= 0 else '-':>9}")
    return lines


def autotune_lines(events: np.ndarray | None) -> list[str]:
    """The conv tiles each GPU worker chose at start-up under --conv-algo autotune (the run log's
    "autotune" events), one line per worker and conv pass, the per-tile timings left out ([] if none)."""
    lines = []
    for e in events if events is not None else []:
        if e["kind"] != b"autotune":
            continue
        text = e["text"].decode() if isinstance(e["text"], bytes) else str(e["text"])
        head, *plans = text.splitlines()
        lines.append(head.split(":")[0] + ":")  # "worker rank R on HOST:"
        lines += [f"  {plan.rsplit(' (', 1)[0]}" for plan in plans]  # "op geometry: tile"
    return ["conv tiles chosen by --conv-algo autotune (timings: the log's events):", *lines] if lines else []


def rule_line(run: dict) -> list[str]:
    """The parameter server's update rule (async, ssp): what `--update-rule auto` chose (the log's "update_rule"
    event, with its reason), else the rule the config names; [] for the other modes or a log from before rules."""
    for e in run["events"] if run.get("events") is not None else []:
        if e["kind"] == b"update_rule":
            text = e["text"].decode() if isinstance(e["text"], bytes) else str(e["text"])
            return [f"update rule: {text}"]
    rule = run["config"].get("update_rule")
    if run.get("mode") not in PS_MODES or rule is None:
        return []
    return [f"update rule: --update-rule {rule}" + (" with Gap-Aware" if run["config"].get("gap_aware") else "")]


def network_lines(run: dict) -> list[str]:
    """The network the run trained, rebuilt from the log's stored definition (data, never a model file): one
    line per top-level layer with its output shape and parameters (`Model.describe`); [] for a log from
    before definitions were stored, or one line saying why the definition cannot be built."""
    text = run.get("model_spec")
    if not text:
        return []
    try:
        return ["network (the log's stored definition):", *build_model(from_json(text)).describe().splitlines()[1:]]
    except ModelSpecError as e:
        return [f"network: the log's stored definition cannot be built ({e})"]


def run_section(run: dict) -> list[str]:
    """The full text report of one loaded run (`load`): summary, workers, staleness histogram, snapshots."""
    path, cfg = run["path"], run["config"]
    out = [f"== {path}",
           f"model {run.get('model')}, mode {run.get('mode')}, {run.get('num_workers')} workers, "
           f"{run.get('num_params')} parameters, batch {cfg.get('batch_size')}, lr {cfg.get('lr')}, "
           f"created {run.get('created')}"]
    out += rule_line(run)
    out += network_lines(run)
    out += summary_lines(path, run)
    if run["pushes"] is not None and len(run["pushes"]):
        out += ["", *worker_table(run), "", *staleness_histogram(run["pushes"])]
    tuned = autotune_lines(run["events"])
    during = periodic_table(run)
    return [*out, *(["", *tuned] if tuned else []), *(["", *during] if during else []), "", *snapshot_table(run), ""]


# --- comparison of several runs ---


def time_to_accuracy(run: dict, target: float) -> float | None:
    """Seconds of training at which the earliest evaluated weights had test accuracy >= `target`: a weight
    snapshot evaluated after the run, or an evaluation during it (--eval-interval).

    `target` is a fraction (0.6 = 60 %). Snapshot evaluations are the evals rows with snapshot >= 0
    (written by `mpiasgd evaluate RUN.h5`); `snapshot` indexes /snapshots/meta, whose `time` is the
    training time at which the weights were taken; a /periodic_evals row's `time` is that of its weights.
    None if nothing was evaluated or nothing reached `target`. Raises IndexError if a row names a
    snapshot the log does not have.
    """
    evals, meta = run["evals"], run["snapshots/meta"]
    times = []
    if evals is not None and meta is not None:
        reached = evals["snapshot"][(evals["snapshot"] >= 0) & (evals["accuracy"] >= target)]
        times += meta["time"][reached].tolist()
    during = periodic_evals(run)
    if during is not None:
        times += during["time"][during["top1"] >= target].tolist()
    return float(min(times)) if times else None


def mode_options(cfg: dict) -> str:
    """The options that make a mode variant, short: e.g. "s=2" (ssp), "overlap", "warm 30s", "K=2 beta=0.5",
    "tau=4" (easgd; the labels come from the modes' registry), and the stragglers."""
    parts = [variant(cfg)] if variant(cfg) else []
    if cfg.get("straggler"):
        parts.append(f"straggler {cfg['straggler']}")
    return " ".join(parts)


def mode_label(run: dict) -> str | None:
    """The run's mode (None for a log that names none), marked "(simulated)" for a log of `mpiasgd simulate`."""
    mode = run.get("mode") or run["config"].get("mode")
    return f"{mode} (simulated)" if mode and run.get("clock") == "virtual" else mode


def comparison_row(run: dict, target: float) -> dict:
    """One row of the comparison table, raw values (None where the log has none), keys as `CSV_COLUMNS`.

    nsync is 1 and staleness_lr "none" for logs written before those config keys existed (what those
    runs did). images/s = images in applied pushes / training time, as in `summary_lines`. Staleness
    is over applied pushes; p99 is the smallest staleness that at least 99 % of them do not exceed.
    """
    cfg, applied = run["config"], applied_pushes(run)
    stale = applied["staleness"] if applied is not None and len(applied) else None
    final, train_time = final_eval(run), training_time(run)
    workers = run.get("num_workers")
    if workers is None and run["workers"] is not None:
        workers = len(run["workers"])
    name = os.path.basename(run["path"])
    return {
        "run": name[:-3] if name.endswith(".h5") else name,
        "status": str(run.get("status") or "unknown").split()[0],  # "killed (its writer is gone ...)" -> killed
        "mode": mode_label(run),
        "options": mode_options(cfg),
        "workers": None if workers is None else int(workers),
        "nsync": int(cfg.get("nsync", 1)),
        "staleness_lr": cfg.get("staleness_lr", "none"),
        "test_accuracy": None if final is None else float(final["accuracy"]),
        "target_accuracy": target,
        "time_to_target_s": time_to_accuracy(run, target),
        "images_per_s": trained_images(run) / train_time if train_time else None,
        "staleness_mean": None if stale is None else float(stale.mean()),
        "staleness_p99": None if stale is None else int(np.percentile(stale, 99, method="inverted_cdf")),
    }


CSV_COLUMNS = ("run", "status", "mode", "options", "workers", "nsync", "staleness_lr", "test_accuracy",
               "target_accuracy", "time_to_target_s", "images_per_s", "staleness_mean", "staleness_p99")
CSV_DIGITS = {"test_accuracy": 4, "time_to_target_s": 2, "images_per_s": 1, "staleness_mean": 3}


def _cells(row: dict) -> list[str]:
    """The human-readable cells of one row (text and markdown); "-" where there is no value."""
    def show(key: str, fmt: str) -> str:
        return "-" if row[key] is None else format(row[key], fmt)

    name = row["run"] if row["status"] == "completed" else f"{row['run']} ({row['status']})"
    acc = "-" if row["test_accuracy"] is None else f"{100 * row['test_accuracy']:.2f}%"
    mode = f"{row['mode']} {row['options']}".rstrip()
    return [name, mode, show("workers", "d"), show("nsync", "d"), str(row["staleness_lr"]), acc,
            show("time_to_target_s", ".1f"), show("images_per_s", ",.0f"), show("staleness_mean", ".2f"),
            show("staleness_p99", "d")]


def comparison_table(rows: list[dict], target: float, fmt: str = "text") -> str:
    """The comparison table of `rows` (`comparison_row`) as `fmt`: text | markdown | csv.

    text and markdown: one line per run, percentages and rounded numbers, numbers right-aligned,
    "-" for a missing value; a run that did not complete has its status after its name. csv: the
    raw values under `CSV_COLUMNS` (accuracies as fractions, seconds, images/s), empty for missing.
    """
    if fmt == "csv":
        buf = io.StringIO()
        out = csv.writer(buf, lineterminator="\n")
        out.writerow(CSV_COLUMNS)
        for row in rows:
            out.writerow(["" if row[k] is None else round(row[k], CSV_DIGITS[k]) if k in CSV_DIGITS else row[k]
                          for k in CSV_COLUMNS])
        return buf.getvalue().rstrip("\n")
    if fmt not in FORMATS:
        raise ValueError(f"unknown table format {fmt!r}: expected one of {FORMATS}")
    header = ["run", "mode", "workers", "nsync", "staleness lr", "test acc", f"time to {100 * target:g}% (s)",
              "images/s", "staleness mean", "staleness p99"]
    right = [False, False, True, True, False, True, True, True, True, True]
    table = [header, *(_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]

    def line(cells: list[str], sep: str) -> str:
        return sep.join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True))

    if fmt == "text":
        return "\n".join(line(cells, "  ").rstrip() for cells in table)
    rule = [("-" * (w - 1) + ":") if r else (":" + "-" * (w - 1)) for w, r in zip(widths, right, strict=True)]
    return "\n".join(f"| {line(cells, ' | ')} |" for cells in [header, rule, *table[1:]])


def report(paths: list[str], target: float = DEFAULT_TARGET, fmt: str = "text") -> str:
    """The report of the run logs at `paths`, as text.

    fmt "text": each run's full report (`run_section`), then, for two or more runs, the comparison
    table. "markdown" or "csv": the comparison table alone, for any number of runs. `target` (a
    fraction) is the test accuracy of the "time to" column. Every log is read before anything is
    formatted; raises FileNotFoundError or ValueError naming the first file that is missing, not an
    mpiasgd run log, or malformed.
    """
    sections: list[str] = []
    rows: list[dict] = []
    for path in paths:
        run = load(path)
        try:
            if fmt == "text":
                sections += run_section(run)
            if fmt != "text" or len(paths) > 1:
                rows.append(comparison_row(run, target))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"run log '{path}' is malformed ({type(e).__name__}: {e})") from None
    if fmt != "text":
        return comparison_table(rows, target, fmt)
    if rows:
        sections += [f"== comparison of {len(rows)} runs", comparison_table(rows, target, "text"),
                     f"time to {100 * target:g}%: seconds of training until evaluated weights (a snapshot, or an "
                     f"evaluation during training) first had {100 * target:g}% test accuracy ('-': none did, or "
                     f"none evaluated: mpiasgd evaluate RUN.h5, or --eval-interval)",
                     "staleness: over applied pushes; p99: the smallest value that 99% of them do not exceed", ""]
    return "\n".join(sections)
