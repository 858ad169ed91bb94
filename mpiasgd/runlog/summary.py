"""The short summary of a run log that `mpiasgd train` prints at its end, and the figures it is made of
(training time, images trained on, applied pushes, the final evaluation), which `mpiasgd report`
shares. Each works on a run as `mpiasgd.runlog.load` reads it.
"""

from __future__ import annotations

import numpy as np

from mpiasgd.runlog.reader import load


def final_eval(run: dict) -> np.void | None:
    """The last evaluation of the final weights (an EVAL_ROW row, snapshot -1), None if the log has none."""
    evals = run["evals"]
    if evals is None or len(evals) == 0:
        return None
    final = evals[evals["snapshot"] == -1]
    return final[-1] if len(final) else None


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
    if run.get("status") == "preempted":
        from mpiasgd.checkpoint import checkpoint_path

        lines.append(f"checkpoint       {checkpoint_path(path)}  (no final evaluation; continue with "
                     f"'--resume {checkpoint_path(path)}')")
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
    health = health_line(run)
    if health:
        lines.append(f"health           {health}")
    if run.get("diverged"):
        lines.append(f"stopped by       --on-divergence stop: {run['diverged']}")
    if run.get("wall_time_s") is not None:
        lines.append(f"wall time        {float(run['wall_time_s']):.1f} s (server, start to end)")
    return lines


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

