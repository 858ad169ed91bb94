"""`mpiasgd trace RUN.h5 -o trace.json`: a Chrome trace of a run (open in Perfetto or chrome://tracing).

One track per rank. Workers (and pipeline units) get, for every push or REPORT row, the spans of
the step that row describes, placed backwards from the time rank 0 received it (workers keep no
clock of their own in the log, so a span is as exact as that arrival time):

    comm      posting the previous exchange and completing its sends (comm_s)
    wait      waiting for weights: the reply, an ssp hold, an allreduce, a pipeline message (wait_s)
    compute   data, forward, backward, local steps (compute_s)

Rank 0 gets a "checkpoint" span for every checkpoint written (its duration is the write), instants
for weight snapshots, for the events of the run (start, stop, skips, warm start, preemption,
resume, failures) and, for async, ssp and easgd, one "apply" instant per applied push (exchange) with its
staleness.
With `--servers S > 1` each other parameter-server shard (rank N + s) gets a track of its own with an
"apply" instant per push it applied (its /shard_pushes rows: worker, step, its version and staleness).
Times are microseconds since the start of training, as the format wants.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from mpiasgd.runlog import load

SPANS = ("comm", "wait", "compute")  # in the order a worker's step goes through them


def trace(path: str) -> dict:
    """The Chrome trace (JSON object format) of the run log at `path`; errors as `mpiasgd.runlog.load`."""
    run = load(path)
    pushes, events = run["pushes"], []
    mode = run.get("mode") or run["config"].get("mode", "async")
    events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rank 0 (server)"}})
    roles = {}
    if run["workers"] is not None:
        for w in run["workers"]:
            module = int(w["module"]) if "module" in w.dtype.names else -1
            roles[int(w["rank"])] = f"rank {int(w['rank'])} (module {module})" if module >= 0 else \
                f"rank {int(w['rank'])} (worker)"
    for rank in sorted(set(roles) | set(pushes["worker"].tolist())):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": roles.get(rank, f"rank {rank}")}})
    us = 1e6
    for row in pushes:
        rank, end = int(row["worker"]), float(row["time"])
        durations = {name: max(0.0, float(row[f"{name}_s"])) for name in SPANS}
        start = end - sum(durations.values())
        for name in SPANS:
            if durations[name] > 0:
                events.append({"name": name, "cat": "worker", "ph": "X", "pid": 0, "tid": rank,
                               "ts": round(start * us, 1), "dur": round(durations[name] * us, 1),
                               "args": {"step": int(row["step"]), "staleness": int(row["staleness"])}})
            start += durations[name]
        if mode in ("async", "ssp", "easgd") and row["applied"]:
            args = {"worker": rank, "version": int(row["version"]), "staleness": int(row["staleness"])}
            events.append({"name": "apply", "cat": "server", "ph": "i", "s": "t", "pid": 0, "tid": 0,
                           "ts": round(end * us, 1), "args": args})
    events += shard_tracks(run, us)
    meta = run["snapshots/meta"]
    for i, snap in enumerate(meta if meta is not None else []):
        events.append({"name": "snapshot", "cat": "server", "ph": "i", "s": "t", "pid": 0, "tid": 0,
                       "ts": round(float(snap["time"]) * us, 1), "args": {"index": i, "version": int(snap["version"])}})
    for c in run.get("checkpoints") if run.get("checkpoints") is not None else []:
        events.append({"name": "checkpoint", "cat": "server", "ph": "X", "pid": 0, "tid": 0,
                       "ts": round(float(c["time"]) * us, 1), "dur": round(float(c["seconds"]) * us, 1),
                       "args": {"version": int(c["version"]), "reason": c["reason"].decode(),
                                "training_s": round(float(c["elapsed"]), 3)}})
    for e in run["events"] if run["events"] is not None else []:
        text = e["text"].decode() if isinstance(e["text"], bytes) else str(e["text"])
        events.append({"name": e["kind"].decode(), "cat": "event", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                       "ts": round(float(e["time"]) * us, 1), "args": {"text": text[:500]}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run": path, "mode": mode, "status": str(run.get("status"))}}


def shard_tracks(run: dict, us: float) -> list[dict]:
    """(--servers S > 1) A track per parameter-server shard of rank >= 1 (its rank from the log's shard_processes)
    with an "apply" instant per push it applied; [] with one server or without shard rows."""
    rows = run.get("shard_pushes")
    if int(run.get("servers") or 1) < 2 or rows is None or not len(rows):
        return []
    processes = json.loads(run.get("shard_processes") or "[]")
    ranks = {s + 1: int(rank) for s, (rank, _host, _pid) in enumerate(processes)}  # shard s >= 1 -> its rank
    workers = int(run.get("num_workers") or 0)
    out = []
    for s in sorted(set(rows["shard"].tolist()) - {0}):
        tid = ranks.get(s, workers + s)
        out.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                    "args": {"name": f"rank {tid} (parameter-server shard {s})"}})
        for row in rows[(rows["shard"] == s) & (rows["applied"] == 1)]:
            out.append({"name": "apply", "cat": "server", "ph": "i", "s": "t", "pid": 0, "tid": tid,
                        "ts": round(float(row["time"]) * us, 1),
                        "args": {"worker": int(row["worker"]), "step": int(row["step"]),
                                 "version": int(row["version"]), "staleness": int(row["staleness"])}})
    return out


def main(path: str, output: str) -> int:
    try:
        data = trace(path)
    except (OSError, ValueError, KeyError) as e:
        print(f"mpiasgd trace: error: {e}", file=sys.stderr)
        return 2
    try:
        with open(output, "w") as f:
            json.dump(data, f, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))
    except OSError as e:
        print(f"mpiasgd trace: error: cannot write the trace to '{output}': {e.strerror or e}", file=sys.stderr)
        return 2
    spans = sum(e["ph"] == "X" for e in data["traceEvents"])
    print(f"{output}: {spans:,} spans on {sum(e['ph'] == 'M' for e in data['traceEvents'])} tracks "
          f"(open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0
