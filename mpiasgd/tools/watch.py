"""`mpiasgd watch RUN.h5`: follow a running job's log (SWMR) and print one line per interval.

    python -m mpiasgd watch runs/c10.h5 --interval 5

Each line: seconds of training (the newest row), epoch, applied pushes (less those a resume superseded,
as `report` counts them), mean training loss and images/s over the rows flushed since the previous
line, mean staleness of those rows. A run with
--eval-interval also gets a line per evaluation during training: its top-1 and top-5 test accuracy
and loss, and the top-1 curve so far (one bar per evaluation, lowest to highest, the range beside
it). Only the new rows are read each time, so following a long run costs little. The watch ends when
the job's writer is gone (the log's lock is released): it prints the final status and test accuracy
and exits 0 for a completed run, 1 otherwise (failed, preempted, killed).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import h5py
import numpy as np

from mpiasgd.runlog import TruncatedLogError, open_log, writer_alive
from mpiasgd.runlog.reader import not_superseded, superseded_spans


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


BARS = "▁▂▃▄▅▆▇█"  # the curve's levels, low to high
ASCII_BARS = "_.-:=+*#"  # where the console cannot print those
CURVE_POINTS = 60      # the curve shows the latest this many evaluations


def curve(values: list[float], bars: str = BARS) -> str:
    """A one-line curve of `values`: one character per value (the last CURVE_POINTS), from the lowest level
    at the smallest value to the highest at the largest (all alike: the middle level)."""
    values = values[-CURVE_POINTS:]
    low, high = min(values), max(values)
    top = len(bars) - 1
    if high - low <= 0:
        return bars[top // 2] * len(values)
    return "".join(bars[round(top * (v - low) / (high - low))] for v in values)


def eval_line(row: np.void, history: list[float], bars: str = BARS) -> str:
    """The line of one evaluation during training (a /periodic_evals row), with the top-1 curve of `history`
    (every evaluation so far, this one included; fractions)."""
    span = (f"{row['version_min']}" if row["version_min"] == row["version_max"]
            else f"{row['version_min']}..{row['version_max']}")
    return (f"{float(row['time']):>8.1f} s  epoch {float(row['epoch']):>7.2f}  evaluation: top-1 "
            f"{100 * float(row['top1']):6.2f} %  top-5 {100 * float(row['top5']):6.2f} %  loss "
            f"{float(row['loss']):.4f}  ({int(row['count']):,} images, version {span})  top-1 curve "
            f"{curve(history, bars)} ({100 * min(history):.1f}..{100 * max(history):.1f} %)")


def console_bars() -> str:
    """BARS if standard output can print them, else ASCII_BARS."""
    try:
        BARS.encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return ASCII_BARS
    return BARS


def final_line(path: str) -> tuple[str, int]:
    """(the closing line, exit status) once the writer is gone; it counts the workers lost under ULFM (and those
    --respawn replaced)."""
    with open_log(path) as f:
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        events = f["events"][()] if "events" in f else None
    lost = int((events["kind"] == b"worker_lost").sum()) if events is not None else 0
    replaced = 0 if events is None else sum(  # (--respawn: a replacement took the rank)
        1 for row in events if row["kind"] == b"worker_joined" and b" is back: " in bytes(row["text"]))
    status = str(attrs.get("status", "unknown"))
    if status == "running":
        status = "killed (its writer is gone; rows up to the last flush)"
    health = attrs.get("diverged") or attrs.get("health")  # mpiasgd.health: how a dead network ended it
    accuracy, top5 = attrs.get("test_accuracy"), attrs.get("test_top5")
    acc = (f", test accuracy {100 * float(accuracy):.2f} %" if accuracy is not None and np.isfinite(float(accuracy))
           else "")
    if acc and top5 is not None and np.isfinite(float(top5)):
        acc += f" (top-5 {100 * float(top5):.2f} %)"
    gone = f"; {lost} worker{'s' * (lost != 1)} lost" if lost else ""
    gone += f" ({replaced} replaced)" if replaced else ""
    return (f"run ended: status {status}{acc}{gone}" + (f"; {health}" if health else ""),
            0 if status == "completed" else 1)


# the events `watch` prints as they come (ULFM): kind -> the line's start
SAID_EVENTS = {b"worker_lost": "worker lost", b"worker_joined": "worker back", b"respawn_failed": "no replacement",
               b"attach_refused": "attach refused"}


def watch(path: str, interval: float = 2.0, wait: float = 60.0, out: Callable[[str], None] = print,
          bars: str = BARS) -> int:
    """Follow the run log at `path` until its writer is gone; returns 0 if it completed, 1 otherwise.

    Waits up to `wait` seconds for the log to appear (a job still starting); FileNotFoundError
    after that, ValueError if the file is not a run log (or is still empty after `wait` seconds), or at once
    if it is a truncated one (no live writer and shorter than its superblock says: `TruncatedLogError`).
    Prints a line every `interval` seconds when new rows were flushed, and one per evaluation during
    training (`eval_line`, its curve drawn with `bars`) and one per worker lost, back (--respawn, --attach), not
    brought back, or attach refused (ULFM: `SAID_EVENTS`).
    """
    deadline = time.monotonic() + wait
    seen, applied_total, waiting = 0, 0, False
    evals_seen, history = 0, []  # /periodic_evals rows printed; their top-1, in order
    events_seen = 0  # /events rows looked at (those of SAID_EVENTS are printed)
    while True:
        alive = writer_alive(path)
        try:  # opened afresh each time: a reader holding the file would be in the writer's way at its close
            with open_log(path) as f:
                if "pushes" not in f or "updates" not in f:
                    raise ValueError(f"'{path}' is not an mpiasgd run log (no 'pushes' table)")
                pushes, updates = f["pushes"], f["updates"]
                count = pushes.shape[0]
                rows = pushes[seen:count] if count > seen else None
                spans = superseded_spans(f.attrs.get("superseded"))  # a resumed run's: rows of a segment that died
                epoch = float(updates[updates.shape[0] - 1]["epoch"]) if updates.shape[0] else 0.0
                during = f["periodic_evals"] if "periodic_evals" in f else None  # (older logs have none)
                new_evals = (during[evals_seen:during.shape[0]] if during is not None and during.shape[0] > evals_seen
                             else None)
                events = f["events"] if "events" in f else None
                new_events = (events[events_seen:events.shape[0]] if events is not None
                              and events.shape[0] > events_seen else None)
        except TruncatedLogError as e:  # no writer and cut short: waiting will not mend it (as `report` says)
            raise ValueError(str(e)) from None
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
            rows = not_superseded(rows, spans)
        if rows is not None and len(rows):
            applied_total += int((rows["applied"] == 1).sum())
            out(progress_line(rows, epoch, applied_total))
        if new_events is not None:  # (ULFM) workers dropped, back, not brought back: said as it happens
            events_seen += len(new_events)
            for row in new_events:
                said = SAID_EVENTS.get(bytes(row["kind"]))
                if said:
                    out(f"{said} at {float(row['time']):.1f} s: {row['text'].decode(errors='replace')}")
        if new_evals is not None:
            evals_seen += len(new_evals)
            for row in new_evals:
                history.append(float(row["top1"]))
                out(eval_line(row, history, bars))
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
        return watch(path, interval, wait, lambda line: print(line, flush=True), console_bars())
    except (FileNotFoundError, ValueError) as e:
        print(f"mpiasgd watch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
