"""The short summary of a run log that `mpiasgd train` prints at its end, and the figures it is made of
(training time, images trained on, applied pushes, the final evaluation), which `mpiasgd report`
shares. Each works on a run as `mpiasgd.runlog.load` reads it.
"""

from __future__ import annotations

import os

import numpy as np

from mpiasgd.files import checkpoint_path
from mpiasgd.runlog.reader import load


def final_eval(run: dict) -> np.void | None:
    """The last evaluation of the final weights (an EVAL_ROW row, snapshot -1), None if the log has none."""
    evals = run["evals"]
    if evals is None or len(evals) == 0:
        return None
    final = evals[evals["snapshot"] == -1]
    return final[-1] if len(final) else None


def periodic_evals(run: dict) -> np.ndarray | None:
    """The evaluations during training (/periodic_evals rows, in time order), None if there are none."""
    rows = run.get("periodic_evals")
    if rows is None or len(rows) == 0:
        return None
    return rows[np.argsort(rows["time"], kind="stable")]


def data_wait_share(pushes: np.ndarray | None) -> float | None:
    """Seconds the workers' steps waited for their minibatches / their compute seconds (the pushes table's
    data_s and compute_s), over the rows that have data_s; None without any."""
    if pushes is None or "data_s" not in (pushes.dtype.names or ()):
        return None
    known = pushes[np.isfinite(pushes["data_s"])]
    compute = float(known["compute_s"].sum()) if len(known) else 0.0
    return float(known["data_s"].sum()) / compute if compute > 0 else None


def training_time(run: dict) -> float:
    """Seconds of training: the summary's (a run that ended), else the last push's time less the spans
    superseded by resumes (a running or killed run; its summary attributes may be a segment's)."""
    value = run.get("train_time_s")
    if value and str(run.get("status")) in ("completed", "preempted"):
        return float(value)
    pushes = run["pushes"]
    last = float(pushes["time"].max()) if pushes is not None and len(pushes) else 0.0
    return max(0.0, last - run.get("superseded_s", 0.0))


def applied_pushes(run: dict) -> np.ndarray | None:
    """The rows of the pushes table that the server applied (None if the log has no pushes table)."""
    pushes = run["pushes"]
    return pushes[pushes["applied"] == 1] if pushes is not None else None


def trained_images(run: dict) -> int:
    """Images trained on (the numerator of images/s): the summary's count for a run that ended (it spans
    every segment, also one whose log was lost), else the images in applied pushes."""
    value = run.get("samples")
    if value and str(run.get("status")) in ("completed", "preempted"):
        return int(value)
    applied = applied_pushes(run)
    return int(applied["samples"].sum()) if applied is not None else 0


def shard_figures(run: dict) -> list[tuple[int, float | None, int | None]] | None:
    """(--servers S > 1) Each shard's (version, staleness mean, staleness max), shard 0 first; None with one
    server, or without the final versions or any shard rows. The staleness is over the applied rows of
    /shard_pushes (every segment of a resumed run, the superseded spans left out, as the pushes' staleness
    is), else the summary's attributes (shard_staleness_mean, shard_staleness_max: None without them); the
    version the summary's (shard_versions), else (a killed run) the last a shard's rows reached."""
    servers = int(run.get("servers") or 1)
    if servers < 2:
        return None
    rows = run.get("shard_pushes")
    rows = rows[rows["applied"] == 1] if rows is not None and len(rows) else None
    versions = run.get("shard_versions")
    if versions is None and rows is None:
        return None
    means, maxima = list(run.get("shard_staleness_mean", [])), list(run.get("shard_staleness_max", []))
    out = []
    for s in range(servers if versions is None else len(versions)):
        mine = rows[rows["shard"] == s] if rows is not None else None
        if versions is not None:
            version = int(versions[s])
        else:
            version = int(mine["version"].max()) if len(mine) else 0
        if mine is not None and len(mine):
            mean, top = float(mine["staleness"].mean()), int(mine["staleness"].max())
        elif rows is None and s < len(means) and s < len(maxima):  # (a log without the table's rows)
            mean, top = float(means[s]), int(maxima[s])
        else:
            mean = top = None
        out.append((version, mean, top))
    return out


def failure_cause(run: dict) -> str:
    """The first line of the last "preempt" or "failed" event of a failed run ("" where there is none)."""
    events = run.get("events")
    if events is None:
        return ""
    for row in reversed(events):
        if row["kind"] in (b"preempt", b"failed"):
            text = row["text"].decode() if isinstance(row["text"], bytes) else str(row["text"])
            return text.strip().splitlines()[0] if text.strip() else ""
    return ""


def events_of(run: dict, kind: str) -> list[tuple[float, str]]:
    """(training-log time, text) of each event of `kind` in the log `run` (as `load` reads it)."""
    events = run.get("events")
    return [(float(row["time"]), row["text"].decode() if isinstance(row["text"], bytes) else str(row["text"]))
            for row in (events if events is not None else []) if row["kind"] == kind.encode()]


def lost_workers(run: dict) -> list[tuple[float, str]]:
    """(training-log time, text) of each "worker_lost" event: a worker that died under ULFM and was dropped while
    the run went on."""
    return events_of(run, "worker_lost")


ATTACH_ORIGIN = "an attach from"  # how a worker_joined event names a worker `mpiasgd attach` asked for ("... ADDRESS")


def replaced_workers(run: dict) -> dict[int, float]:
    """{worker rank: training-log time} of each replacement that took a dead worker's rank (--respawn: a
    "worker_joined" event "worker rank R is back: ..."); the last one where a rank was replaced more than once."""
    return {int(text.split()[2]): t for t, text in events_of(run, "worker_joined") if " is back: " in text}


def summary_lines(path: str, run: dict | None = None) -> list[str]:
    """The short summary printed at the end of `mpiasgd train`: accuracy, images/s, staleness, time, one
    line each. `run` is the log at `path` as `load` reads it (read here if None: errors as `load`)."""
    run = run or load(path)
    pushes = run["pushes"]
    applied = applied_pushes(run)
    final = final_eval(run)
    train_time = training_time(run)
    images = trained_images(run)
    lines = [f"run log          {path}  (status: {run.get('status')})"]
    if run.get("clock") == "virtual":
        lines.append("simulated        by `mpiasgd simulate`: every time below is virtual seconds (the timing model is "
                     "the log's attribute 'simulated')")
    if run.get("status") == "preempted":
        lines.append(f"checkpoint       {checkpoint_path(path)}  (no final evaluation; continue with "
                     f"'--resume {checkpoint_path(path)}')")
    elif run.get("status") == "failed":  # the cause from the events (a dead worker, an error), and what is left
        cause = failure_cause(run)
        if cause:
            lines.append(f"failed           {cause}")
        ckpt = checkpoint_path(path)
        if os.path.isfile(ckpt):
            lines.append(f"checkpoint       {ckpt}  (continue with '--resume {ckpt}')")
    lost, back = lost_workers(run), events_of(run, "worker_joined")
    if lost:
        ranks, by = [], set()
        for t, text in lost:  # ("worker rank R ..."), and the replacement that took R next (--respawn, attach)
            rank = text.split()[2]
            again = [(u, joined) for u, joined in back if u >= t and joined.startswith(f"worker rank {rank} is back: ")]
            ranks.append(f"rank {rank} at {t:.1f} s" + (f" (replaced at {again[0][0]:.1f} s)" if again else ""))
            if again:
                by.add("mpiasgd attach" if ATTACH_ORIGIN in again[0][1] else "--respawn")
        replaced = sum("replaced" in r for r in ranks)
        how = ("died; the run went on without them" if not replaced else
               f"died; the run went on, {replaced} replaced by {' and '.join(sorted(by))}")
        failed = len(events_of(run, "respawn_failed"))
        how += f"; {failed} replacement{'s' * (failed != 1)} did not start (events respawn_failed)" if failed else ""
        lines.append(f"workers lost     {len(lost)} ({how}): {', '.join(ranks)}")
    if final is not None:
        top5 = final["top5"] if "top5" in (final.dtype.names or ()) else float("nan")
        lines.append(f"test accuracy    {100 * final['accuracy']:.2f} %  on {final['count']:,} images "
                     + (f"(top-5 {100 * top5:.2f} %, loss {final['loss']:.4f})" if np.isfinite(top5)
                        else f"(loss {final['loss']:.4f})"))
    during = periodic_evals(run)
    if during is not None:
        best = during[int(np.argmax(during["top1"]))]
        lines.append(f"during training  {len(during)} evaluations (--eval-interval); best top-1 "
                     f"{100 * best['top1']:.2f} % at epoch {best['epoch']:.2f}, last {100 * during['top1'][-1]:.2f} % "
                     f"at epoch {during['epoch'][-1]:.2f}")
    lines.append(f"images/s         {images / train_time if train_time else 0:,.0f}  "
                 f"({images:,} images in {train_time:.1f} s of training, "
                 f"{images / max(1, int(run.get('num_train') or 1)):.2f} epochs)")
    if applied is not None and len(applied):
        lines.append(f"staleness        mean {applied['staleness'].mean():.2f}, max {applied['staleness'].max()}")
    shards = shard_figures(run)
    if shards:  # --servers S > 1
        parts = "; ".join(f"shard {s}: version {v}" + (f", staleness mean {mean:.2f} max {top}" if mean is not None
                                                         else "")
                          for s, (v, mean, top) in enumerate(shards))
        lines.append(f"shards           {parts}")
    wire = wire_line(run)
    if wire:
        lines.append(f"wire             {wire}")
    share = data_wait_share(pushes)
    if share is not None:
        lines.append(f"data wait        {100 * share:.1f} % of the step (the workers' compute time spent waiting "
                     f"for minibatches)")
    if pushes is not None and "rejected" in (pushes.dtype.names or ()) and pushes["rejected"].any():
        bad = pushes[pushes["rejected"] == 1]
        per = ", ".join(f"rank {w}: {(bad['worker'] == w).sum()}" for w in sorted(set(bad["worker"].tolist())))
        lines.append(f"rejected pushes  {len(bad)} non-finite gradients ({per})")
    health = health_line(run)
    if health:
        lines.append(f"health           {health}")
    if run.get("diverged"):
        lines.append(f"stopped by       --on-divergence stop: {run['diverged']}")
    elif run.get("stop_reason"):
        lines.append(f"stopped by       {run['stop_reason']}")
    if run.get("wall_time_s") is not None:
        lines.append(f"wall time        {float(run['wall_time_s']):.1f} s (server, start to end)")
    return lines


def megabytes(n: float) -> str:
    """`n` bytes in MB (10^6 bytes), e.g. "12.3 MB"."""
    return f"{n / 1e6:,.1f} MB"


def wire_line(run: dict) -> str:
    """(async, ssp, easgd) The wire format and the bytes moved, from the summary's wire_bytes_pushed and
    wire_bytes_pulled (every shard's; a resumed run's every job): "fp16: 12.3 MB pushed (2,072 bytes a push),
    13.0 MB pulled", with each shard's part under --servers S > 1; "" for a log without them (other modes, a
    killed run)."""
    pushed, pulled = run.get("wire_bytes_pushed"), run.get("wire_bytes_pulled")
    if pushed is None or pulled is None:
        return ""
    pushes = run["pushes"]
    wire = run.get("config", {}).get("wire", "fp32")
    each = f" ({int(pushed) / len(pushes):,.0f} bytes a push)" if pushes is not None and len(pushes) else ""
    text = f"{wire}: {megabytes(int(pushed))} pushed{each}, {megabytes(int(pulled))} pulled"
    shards_pushed, shards_pulled = run.get("shard_wire_bytes_pushed"), run.get("shard_wire_bytes_pulled")
    if shards_pushed is not None and shards_pulled is not None and len(shards_pushed) > 1:
        text += " (" + "; ".join(f"shard {s}: {megabytes(int(a))} pushed, {megabytes(int(b))} pulled"
                                 for s, (a, b) in enumerate(zip(shards_pushed, shards_pulled, strict=True))) + ")"
    return text


def health_line(run: dict) -> str:
    """How the run ended by the divergence watch (`mpiasgd.health`): "" if healthy. The summary's `health`
    attribute; for a log without it (killed, or written before it existed), its first dead-network event
    if no recovery followed."""
    if run.get("health") is not None:
        return str(run["health"])
    state = ""
    for e in run["events"] if run.get("events") is not None else []:
        kind = e["kind"].decode()
        if kind == "dead":
            state = state or f"dead: {e['text'].decode() if isinstance(e['text'], bytes) else e['text']}"
        elif kind == "recovered":
            state = ""
    return state

