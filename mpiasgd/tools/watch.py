"""`mpiasgd watch RUN.h5`: follow a running job's log (SWMR) and print one line per interval.

    python -m mpiasgd watch runs/c10.h5 --interval 5

Each line: seconds of training (the newest row), epoch, applied pushes, mean training loss and
images/s over the rows flushed since the previous line, mean staleness of those rows. Only the
new rows are read each time, so following a long run costs little. The watch ends when the job's
writer is gone (the log's lock is released): it prints the final status and test accuracy and
exits 0 for a completed run, 1 otherwise (failed, preempted, killed).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import h5py
import numpy as np

from mpiasgd.runlog import open_log, writer_alive


def progress_line(rows: np.ndarray, epoch: float, applied_total: int) -> str:
    """One line from the push rows flushed since the last line (applied ones only)."""
    applied = rows[rows["applied"] == 1]
    t = float(rows["time"].max())
    span = float(applied["time"].max() - applied["time"].min()) if len(applied) > 1 else 0.0
    rate = f"{applied['samples'].sum() / span:>9,.0f}" if span > 0 else f"{'-':>9}"
    loss = f"{float(applied['loss'].mean()):.4f}" if len(applied) else "-"
    stale = f"{float(applied['staleness'].mean()):.2f}" if len(applied) else "-"
    return (f"{t:>8.1f} s  epoch {epoch:>7.2f}  pushes {applied_total:>9,}  loss {loss:>7}  images/s {rate}  "
            f"staleness {stale}")


def final_line(path: str) -> tuple[str, int]:
    """(the closing line, exit status) once the writer is gone."""
    with open_log(path) as f:
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    status = str(attrs.get("status", "unknown"))
    if status == "running":
        status = "killed (its writer is gone; rows up to the last flush)"
    health = attrs.get("diverged") or attrs.get("health")  # mpiasgd.health: how a dead network ended it
    accuracy = attrs.get("test_accuracy")
    acc = (f", test accuracy {100 * float(accuracy):.2f} %" if accuracy is not None and np.isfinite(float(accuracy))
           else "")
    return f"run ended: status {status}{acc}" + (f"; {health}" if health else ""), 0 if status == "completed" else 1


def watch(path: str, interval: float = 2.0, wait: float = 60.0, out: Callable[[str], None] = print) -> int:
    """Follow the run log at `path` until its writer is gone; returns 0 if it completed, 1 otherwise.

    Waits up to `wait` seconds for the log to appear (a job still starting); FileNotFoundError
    after that, ValueError if the file is not a run log (or is still empty after `wait` seconds).
    Prints a line every `interval` seconds when new rows were flushed.
    """
    deadline = time.monotonic() + wait
    seen, applied_total, waiting = 0, 0, False
    while True:
        alive = writer_alive(path)
        try:  # opened afresh each time: a reader holding the file would be in the writer's way at its close
            with open_log(path) as f:
                if "pushes" not in f or "updates" not in f:
                    raise ValueError(f"'{path}' is not an mpiasgd run log (no 'pushes' table)")
                pushes, updates = f["pushes"], f["updates"]
                count = pushes.shape[0]
                rows = pushes[seen:count] if count > seen else None
                epoch = float(updates[updates.shape[0] - 1]["epoch"]) if updates.shape[0] else 0.0
        except (FileNotFoundError, OSError):  # not there yet, or created but not yet in SWMR mode
            if os.path.isfile(path) and os.path.getsize(path) >= 8 and not h5py.is_hdf5(path):
                raise ValueError(f"'{path}' is not an mpiasgd run log (not an HDF5 file)") from None
            empty = os.path.isfile(path)  # created, not yet written (a job starting), or not a log at all
            if time.monotonic() > deadline:
                if empty:
                    raise ValueError(f"'{path}' stayed without an HDF5 header for {wait:g} s (size "
                                     f"{os.path.getsize(path)} bytes): not an mpiasgd run log") from None
                raise FileNotFoundError(f"run log '{path}' did not appear within {wait:g} s") from None
            if not waiting:
                waiting = True
                what = ("to be written (it has no HDF5 header yet)" if empty else "to appear")
                print(f"mpiasgd watch: waiting up to {wait:g} s for run log '{path}' {what}", file=sys.stderr,
                      flush=True)
            time.sleep(min(interval, 0.5))
            continue
        if rows is not None:
            seen = count
            applied_total += int((rows["applied"] == 1).sum())
            out(progress_line(rows, epoch, applied_total))
        if not alive:
            break
        time.sleep(interval)
    line, status = final_line(path)
    out(line)
    return status


def main(path: str, interval: float, wait: float) -> int:
    if os.path.isdir(path):
        print(f"mpiasgd watch: error: '{path}' is a directory, expected a run log file (runs/NAME.h5)",
              file=sys.stderr)
        return 2
    if not os.path.exists(path) and wait <= 0:
        print(f"mpiasgd watch: error: run log '{path}' not found", file=sys.stderr)
        return 2
    try:
        return watch(path, interval, wait, lambda line: print(line, flush=True))
    except (FileNotFoundError, ValueError) as e:
        print(f"mpiasgd watch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
