#!/usr/bin/env python3
"""A-SGD that scales: each asynchronous variant at N = 1, 2, 4, ..., 32 equal workers, at its best step size, in
`mpiasgd simulate` (every gradient computed for real, the real parameter server, a virtual clock from a timing
profile). One markdown table and a JSON file, every command.

    python bench/asgd_scaling.py                                     # cifar10, 15 epochs: hours; run it in parts
    python bench/asgd_scaling.py --model digits --epochs 20 --workers 1,2,4,8,16 --lrs 0.02,0.05,0.1 --seeds 3
    python bench/asgd_scaling.py --dry-run                           # tiny: every code path in about a minute

The protocol (issue 39):
  - every N trains the same total epochs (`--epochs`, passes over the training set by all workers together)
    under the same full schedule (the config's: a linear warm-up of --warmup-epochs, then cosine decay);
  - each (variant, N) runs once per step size of the grid (`--lrs`, seed 0) and keeps the one of the best final
    test accuracy, then `--seeds` - 1 more seeds at it: the table gives the mean (and spread) of the seeds;
  - the reference is one worker of the first variant (plain A-SGD at N = 1 is plain SGD): its mean final
    accuracy minus `--margin` (1 point) is the target; for each cell the virtual seconds and epochs to the first
    evaluation during training (every `--eval-interval`) that reached it (mean over the seeds that did), and
    the speed-up: the reference's time to the target over that time;
  - the timing profile (`--profile`) stands for the devices: by default the H200's measured cifar10 step
    (bench/profiles/h200-cifar10.json: 3.2 ms at batch 64, launch-bound, before CUDA graphs; one server:
    `mpiasgd simulate` models one).

Variants (`--variants`, comma-separated; each is `mpiasgd simulate` flags, VARIANTS): the server's rules as the
product has them today, named after their papers. A cell a variant cannot run (nsync 4 with too few minibatches
for a round) is marked, not run.

Cells are simulations named VARIANT-nN-lrLR-sSEED in RUN_DIR; `--reuse` takes a complete log of the same
settings instead of running it again (the check of bench/simulate_speedup.py: the resolved config, the number
of workers and the timing model), so a long grid runs in parts. `--jobs` simulations at once, one BLAS thread
each. Cost: a cell is one worker's worth of gradients whatever N (cifar10 at batch 64: about 0.1 s each on one
core, 15 epochs about 20 minutes, plus 10 s per evaluation of the test set).

Records (`--results FILE`, a JSON object: cell name -> record, one line each) are how a grid accumulates across
sessions and machines, whose run logs do not last: commit the file. Each cell that runs, or is taken from a
log, is written to FILE as soon as it ends (merged into what FILE holds then; temp file + os.replace), so a
killed grid loses only the cells in flight. A record holds what the summary needs: the final test accuracy,
the virtual training seconds, the final epoch and the evaluations during training as [virtual s, epoch,
top-1]; the signature `--reuse` compares (the resolved config but NOT_COMPARED, the number of workers, the
timing model's TIMING_KEYS); and where it came from (commit, UTC date, command). With `--reuse`, a cell whose
record has the same signature is taken from it, log or none (`NAME: recorded`); a record of other settings
stops the script naming the file, the cell and the keys that differ; else a complete log, else a run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any

from launch import Finished, add_run_arguments, distinct_ints, run, run_dir
from simulate_speedup import NOT_COMPARED, TIMING_KEYS, option_list, reusable, settings

from mpiasgd.config import FIELDS, ConfigError
from mpiasgd.runlog.reader import load
from mpiasgd.runlog.summary import final_eval, periodic_evals

HERE = Path(__file__).resolve().parent
PROG = "asgd_scaling.py"

# name -> (the `mpiasgd simulate` flags of the variant, what it is)
# plain A-SGD's update and DANA-Zero's, whatever the defaults (auto: DANA-GA from 2 workers, 1/staleness for nsync
# updates): a variant names what it is, so that a cell means the same under later defaults
SGD = ["--update-rule", "sgd", "--staleness-lr", "none"]
DANA = ["--update-rule", "dana-zero", "--staleness-lr", "none"]
VARIANTS: dict[str, tuple[list[str], str]] = {
    "sgd": (SGD, "GPU A-SGD / Downpour: the gradient into the server's momentum as for one worker "
                 "(Paine et al. 2013; Dean et al. 2012)"),
    "momentum-workers": ([*SGD, "--async-momentum", "workers"], "the server's momentum max(0, m - (1 - 1/N)): "
                         "asynchrony begets momentum (Mitliagkas et al. 2016)"),
    "lookahead": ([*SGD, "--lookahead", "-1"], "replies N - 1 momentum-only updates ahead along the server's "
                  "momentum (DANA's look-ahead, Hakimi et al. 2019, with one momentum)"),
    "dana-zero": (DANA, "a momentum per worker on the server, the replies one step ahead "
                  "along their sum (DANA-Zero, Hakimi et al. 2019)"),
    "dana-zero-warmup": ([*DANA, "--warmup-epochs", "{warmup}"], "DANA-Zero with a warm-up "
                         "that grows with N: max(0.5, N/4) epochs (the large-batch rule of Goyal et al. 2017 read for "
                         "N stale workers)"),
    "gap-aware": ([*SGD, "--gap-aware"], "each weight's gradient divided by its gap max(1, |w - w_pulled| / C), "
                  "C the mean step (Gap-Aware, Barkai et al. 2020)"),
    "dana-ga": ([*DANA, "--gap-aware"], "DANA-Zero with Gap-Aware's penalty, the gap from "
                "the look-ahead weights (DANA-GA, Barkai et al. 2020)"),
    "dana-ga-warmup": ([*DANA, "--gap-aware", "--warmup-epochs", "{warmup}"], "DANA-GA with the warm-up that grows "
                       "with N: max(0.5, N/4) epochs"),
    "default": ([], "no flags: what a user gets (--update-rule auto: DANA-GA from 2 workers)"),
    "staleness-lr": (["--update-rule", "sgd", "--staleness-lr", "inverse"], "the gradient scaled by 1/staleness "
                     "(Zhang et al. 2016)"),
    "dc-asgd": ([*SGD, "--dc-lambda", "0.04"], "delay compensation g + lambda g*g (w - w_pulled), lambda 0.04 "
                "(Zheng et al. 2017)"),
    "nsync4": ([*SGD, "--nsync", "4"], "4 local steps per exchange, the accumulated update pushed and added in "
               "full (GPU A-SGD's nsync, Downpour)"),
    "nsync4-staleness": (["--update-rule", "sgd", "--nsync", "4", "--staleness-lr", "inverse"], "nsync 4 with "
                         "each accumulated update scaled by 1/staleness: about 1/(N - 1), an average of the N workers' "
                         "updates (the default for nsync > 1: --staleness-lr auto)"),
}
DRY = {"model": "digits", "workers": [1, 2], "variants": ["sgd", "lookahead"], "lrs": [0.05], "seeds": 2,
       "epochs": 1.0, "eval_interval": "0.5ep", "batch_size": 32}


def floats(text: str) -> list[float]:
    """argparse type: comma-separated distinct step sizes > 0."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, e.g. 0.01,0.02; got {text!r}") \
            from None
    if not values or min(values) <= 0 or not all(math.isfinite(v) for v in values) or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"expected distinct finite numbers > 0, e.g. 0.01,0.02; got {text!r}")
    return values


def variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if not names or unknown or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"expected distinct names of {', '.join(VARIANTS)}; got {text!r}")
    return names


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="cifar10", help="network and dataset")
    parser.add_argument("--profile", default=str(HERE / "profiles" / "h200-cifar10.json"), help="timing profile")
    parser.add_argument("--workers", type=lambda t: distinct_ints(t, 1), default=[1, 2, 4, 8, 16, 32],
                        help="N, comma-separated (the first is the reference: 1)")
    parser.add_argument("--variants", type=variants, default=list(VARIANTS), help="comma-separated, the first is "
                        f"the reference at N = 1: {', '.join(VARIANTS)}")
    parser.add_argument("--lrs", type=floats, default=[0.005, 0.01, 0.02, 0.04], help="the step sizes tried")
    parser.add_argument("--seeds", type=int, default=3, help="seeds at the best step size (the grid's is seed 0)")
    parser.add_argument("--epochs", type=float, default=15.0, help="total epochs of every run, whatever N")
    parser.add_argument("--eval-interval", default="1ep", help="evaluations during training (time to target)")
    parser.add_argument("--batch-size", type=int, default=64, help="minibatch per worker")
    parser.add_argument("--margin", type=float, default=0.01, help="the target: the reference's mean final "
                        "accuracy minus this")
    parser.add_argument("--options", default="", help="more `mpiasgd simulate` options for every run, as "
                        "--options='--momentum 0.9 --warmup-epochs 1'")
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once")
    parser.add_argument("--reuse", action="store_true", help="take a complete log of the same settings instead of "
                        "running it again")
    parser.add_argument("--results", default=None, metavar="FILE", help="per-cell records (JSON), merged across "
                        "invocations: each cell that runs or is taken from a log is recorded as it ends; with "
                        "--reuse a cell recorded of the same settings is taken from its record")
    parser.add_argument("--no-run", action="store_true", help="with --reuse: run nothing; the table of the cells "
                        "recorded in --results or logged complete in --run-dir, the others marked 'not run'")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes where not given: " + json.dumps(DRY))
    add_run_arguments(parser, "scaling")
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.dry_run:  # tiny sizes for what the command line does not give
        parser.set_defaults(**DRY)
        args = parser.parse_args(argv)
    if args.workers[0] != 1:
        parser.error(f"--workers must start with 1 (the reference), got {','.join(map(str, args.workers))}")
    if args.seeds < 1 or args.jobs < 1 or args.batch_size < 1 or not args.epochs > 0:
        parser.error("--seeds, --jobs and --batch-size must be >= 1 and --epochs > 0")
    if args.no_run and not args.reuse:
        parser.error("--no-run takes the cells recorded or logged already: give --reuse too")
    args.run_dir = run_dir(args, "scaling")
    args.extra = option_list(parser, args.options)
    os.makedirs(args.run_dir, exist_ok=True)
    if args.results is not None:
        folder = os.path.dirname(os.path.abspath(args.results))
        if os.path.isdir(args.results) or not os.path.isdir(folder):
            parser.error(f"--results '{args.results}': expected a JSON file (existing or not) in an existing folder")
    return args


def flags(variant: str, n: int) -> list[str]:
    """The `mpiasgd simulate` flags of `variant` at N = `n` workers ({warmup}: max(0.5, N/4) epochs)."""
    return [f.format(warmup=f"{max(0.5, n / 4):g}") for f in VARIANTS[variant][0]]


def name(variant: str, n: int, lr: float, seed: int) -> str:
    return f"{variant}-n{n}-lr{lr:g}-s{seed}"


def command(args: argparse.Namespace, variant: str, n: int, lr: float, seed: int) -> list[str]:
    return [sys.executable, "-m", "mpiasgd", "simulate", "--workers", str(n), "--profile", args.profile,
            "--model", args.model, "--epochs", f"{args.epochs:g}", "--eval-interval", args.eval_interval,
            "--batch-size", str(args.batch_size), "--lr", f"{lr:g}", "--seed", str(seed), "--threads", "1",
            "--snapshot-interval", "0", "--no-progress", "--eval-s-per-image", "0", "--run-dir", args.run_dir,
            "--name", name(variant, n, lr, seed), "--overwrite", *flags(variant, n), *args.extra]


class Cells:
    """The simulations of this invocation: each planned once (its command read as `mpiasgd simulate` reads it; a
    cell it refuses is kept with the reason), taken from its record, run or reused, and kept as a record (`read`);
    with --results each one that ran or was read from its log is recorded there as soon as it ends."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.refused: dict[tuple, str] = {}
        self.results: dict[tuple, dict | None] = {}
        self.commands: list[list[str]] = []
        self.planned: dict[tuple, tuple[list[str], Any, Any] | None] = {}
        self.records = read_records(args.results) if args.results else {}
        self.writing = threading.Lock()

    def plan(self, key: tuple) -> tuple[list[str], Any, Any] | None:
        """(command, Config, TimingModel) of cell `key`, read once; None for a cell `mpiasgd simulate` refuses."""
        if key not in self.planned:
            cmd = command(self.args, *key)
            try:
                self.planned[key] = (cmd, *settings(cmd))
            except ConfigError as e:
                self.refused[key] = str(e).removeprefix("mpiasgd simulate: ")
                self.planned[key] = None
        return self.planned[key]

    def recorded(self, key: tuple) -> dict | None:
        """With --reuse and --results: the record of cell `key` if it is of the same settings, None if there is
        none; SystemExit naming the file, the cell and the keys that differ for a record of other settings."""
        record = self.records.get(name(*key)) if self.args.reuse else None
        planned = self.plan(key) if record is not None else None
        if planned is None:
            return None
        missing = [k for k in RECORD_KEYS if k not in record]
        if missing:
            sys.exit(f"{PROG}: --results '{self.args.results}': the record of {name(*key)} lacks {', '.join(missing)} "
                     f"(expected {', '.join(RECORD_KEYS)}); remove it")
        differ = differences(record["signature"], signature(planned[1], key[1], planned[2]))
        if differ:
            sys.exit(f"{PROG}: --reuse: --results '{self.args.results}': {name(*key)} is recorded of other settings "
                     f"{differ} (key: (the record's, wanted)); remove its record or use another --results file")
        return record

    def run(self, keys: list[tuple]) -> None:
        todo = []
        for key in keys:
            if self.plan(key) is None:
                continue
            cmd, cfg, timing = self.planned[key]
            self.commands.append(cmd)
            record = self.recorded(key)
            if record is not None:
                print(f"{name(*key)}: recorded", flush=True)
                self.results[key] = record
                continue
            log = os.path.join(self.args.run_dir, name(*key) + ".h5")
            reused = self.args.reuse and reusable(log, cfg, key[1], timing)
            if self.args.no_run and not reused:  # (--no-run: a table of what is recorded or logged already)
                self.refused[key] = "not run (--no-run)"
                continue
            todo.append((key, cmd, reused))

        def one(job: tuple) -> tuple:
            key, cmd, reused = job
            done = Finished(cmd, 0, 0.0, "", "") if reused else run(cmd, self.args.timeout)
            print(f"{name(*key)}: {'reused' if reused else f'{done.seconds:.0f} s' if done.ok else 'FAILED'}",
                  flush=True)
            if not done.ok:
                print(done.explain(self.args.timeout), file=sys.stderr, flush=True)
                return key, None
            record = self.read(key)
            if self.args.results:
                with self.writing:  # one writer at a time: each merges into what the file holds then
                    write_record(self.args.results, name(*key), record)
            return key, record

        with ThreadPoolExecutor(max_workers=self.args.jobs) as pool:
            self.results.update(pool.map(one, todo))

    def read(self, key: tuple) -> dict:
        """The record of cell `key` from its log (see the module's docstring): what the summary needs, the
        signature and the provenance."""
        cmd, cfg, timing = self.planned[key]
        r = load(os.path.join(self.args.run_dir, name(*key) + ".h5"))
        final = final_eval(r)
        during = periodic_evals(r)
        train_time = float(r["train_time_s"])
        return {"accuracy": float(final["accuracy"]) if final is not None else float("nan"),
                "train_time_s": train_time, "epochs": epochs_at(r, train_time),
                "evals": [[float(t), epochs_at(r, float(t)), float(a)] for t, a in
                          zip(during["time"], during["top1"], strict=True)] if during is not None else [],
                "signature": signature(cfg, key[1], timing), "commit": commit(),
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": shlex.join(cmd)}


RECORD_KEYS = ("signature", "accuracy", "train_time_s", "epochs", "evals")  # what a record taken as a cell needs


def signature(cfg: Any, workers: int, timing: Any) -> dict:
    """What --reuse compares of a cell, as bench/simulate_speedup.py's `reusable` compares a log: the config
    `mpiasgd simulate` resolves (but NOT_COMPARED), the number of workers, the timing model's TIMING_KEYS."""
    given = json.loads(json.dumps(timing.to_dict()))
    return {"config": {k: v for k, v in json.loads(cfg.to_json()).items() if k not in NOT_COMPARED},
            "workers": workers, "timing": {k: given.get(k) for k in TIMING_KEYS}}


def differences(recorded: Any, wanted: dict) -> dict:
    """key -> (the recorded value, the wanted one) of each that differs between two signatures (config keys by
    name, then "workers" and "timing KEY"; a config key a record predates counts as its default, as for a log)."""
    recorded = recorded if isinstance(recorded, dict) else {}
    config = recorded.get("config") if isinstance(recorded.get("config"), dict) else {}
    timing = recorded.get("timing") if isinstance(recorded.get("timing"), dict) else {}
    differ = {}
    for key, value in wanted["config"].items():
        have = config.get(key, json.loads(json.dumps(FIELDS[key].default)) if key in FIELDS else None)
        if have != value:
            differ[key] = (have, value)
    if recorded.get("workers") != wanted["workers"]:
        differ["workers"] = (recorded.get("workers"), wanted["workers"])
    for key in TIMING_KEYS:
        if timing.get(key) != wanted["timing"][key]:
            differ[f"timing {key}"] = (timing.get(key), wanted["timing"][key])
    return differ


@cache
def commit() -> str | None:
    """The short commit of this script's checkout, None outside one (or without git)."""
    try:
        done = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def read_records(path: str) -> dict[str, dict]:
    """The records of --results file `path` ({} if there is none yet); SystemExit naming the file if it is not a
    JSON object of records (cell name -> JSON object)."""
    try:
        with open(path) as f:
            records = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        sys.exit(f"{PROG}: --results '{path}': cannot read it as JSON ({e}); fix or remove it")
    if not isinstance(records, dict) or not all(isinstance(v, dict) for v in records.values()):
        sys.exit(f"{PROG}: --results '{path}': expected a JSON object of records (cell name -> object), got "
                 f"{type(records).__name__} {str(records)[:80]!r}")
    return records


def write_record(path: str, cell: str, record: dict) -> None:
    """Cell `cell`'s record into --results file `path`, merged into what the file holds now (the other cells' kept),
    written whole to a temporary file beside it and moved over it (os.replace: a reader sees the old or the new
    file, never a part); one line per cell, in name order, so that a commit of it shows the cells it changed."""
    records = read_records(path)
    records[cell] = record
    text = "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(records[k], sort_keys=True)}"
                               for k in sorted(records)) + "\n}\n"
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=os.path.basename(path) + ".",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # (mkstemp makes it private; a results file is for everyone to read)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def best_lr(cells: Cells, variant: str, n: int, lrs: list[float]) -> float | None:
    """The grid's step size of the best final accuracy (seed 0); None if every run failed or was refused."""
    runs = [(cells.results.get((variant, n, lr, 0)), lr) for lr in lrs]
    scored = [(c["accuracy"], lr) for c, lr in runs if c and math.isfinite(c["accuracy"])]
    return max(scored)[1] if scored else None


def summarize(cells: Cells, args: argparse.Namespace, chosen: dict) -> dict:
    """Per (variant, N): the step size, the seeds' final accuracies, and the time and epochs to the target."""
    ref_variant = args.variants[0]
    ref_lr = chosen.get((ref_variant, 1))
    ref = [cells.results.get((ref_variant, 1, ref_lr, s)) for s in range(args.seeds)] if ref_lr else []
    ref_acc = [c["accuracy"] for c in ref if c]
    target = (sum(ref_acc) / len(ref_acc) - args.margin) if ref_acc else None
    out: dict = {"target": target, "reference": f"{ref_variant}, N = 1", "cells": {}}
    ref_time = None
    for variant in args.variants:
        for n in args.workers:
            lr = chosen.get((variant, n))
            key = f"{variant} N={n}"
            if lr is None:
                why = next((cells.refused[k] for k in cells.refused if k[:2] == (variant, n)), "every run failed")
                out["cells"][key] = {"lr": None, "why": why}
                continue
            runs = [cells.results.get((variant, n, lr, s)) for s in range(args.seeds)]
            acc = [c["accuracy"] for c in runs if c]
            times, epochs = [], []
            for c in runs:
                reached = time_to_target(c, target) if c and target is not None else None
                if reached is not None:
                    times.append(reached[0])
                    epochs.append(reached[1])
            cell = {"lr": lr, "accuracy": acc, "reached": f"{len(times)}/{len(acc)}",
                    "time_s": sum(times) / len(times) if times else None,
                    "epochs": sum(epochs) / len(epochs) if epochs else None}
            if (variant, n) == (ref_variant, 1):
                ref_time = cell["time_s"]
            out["cells"][key] = cell
    for cell in out["cells"].values():
        cell["speedup"] = (ref_time / cell["time_s"]) if ref_time and cell.get("time_s") else None
    return out


def time_to_target(record: dict, target: float) -> tuple[float, float] | None:
    """(virtual seconds, epochs) of a cell's record to the first evaluation during training that reached `target`;
    failing that, the training time and final epoch if the final weights' evaluation did (the last evaluation
    during training comes before the run's end); None if neither did."""
    for seconds, epochs, accuracy in sorted(record["evals"]):  # in time order (as written)
        if accuracy >= target:
            return seconds, epochs
    return (record["train_time_s"], record["epochs"]) if record["accuracy"] >= target else None


def epochs_at(log: dict, seconds: float) -> float:
    """Epochs trained by virtual second `seconds` (the last update at or before it)."""
    updates = log.get("updates")
    if updates is None or not len(updates):
        return float("nan")
    done = updates[updates["time"] <= seconds + 1e-9]
    return float(done["epoch"][-1]) if len(done) else 0.0


def table(summary: dict, args: argparse.Namespace) -> str:
    target = summary["target"]
    lines = [f"{args.model}, batch {args.batch_size} per worker, {args.epochs:g} epochs at every N, step sizes "
             f"{','.join(f'{x:g}' for x in args.lrs)} (seed 0) then {args.seeds} seeds at the best, profile "
             f"`{args.profile}`, `{args.options}`; {time.strftime('%Y-%m-%d')}. Target: {summary['reference']}'s mean "
             f"final accuracy - {100 * args.margin:g} points = "
             f"{'-' if target is None else f'{100 * target:.2f} %'}. Cell: final test accuracy, mean (min-max) % "
             "[step size]; virtual seconds to the target (speed-up over the reference), epochs; reached/seeds.", "",
             "| N | " + " | ".join(args.variants) + " |", "|---:|" + "---|" * len(args.variants)]
    for n in args.workers:
        row = []
        for variant in args.variants:
            c = summary["cells"][f"{variant} N={n}"]
            if c["lr"] is None:
                row.append(f"- ({c['why']})")
                continue
            acc = c["accuracy"]
            text = (f"{100 * sum(acc) / len(acc):.2f} ({100 * min(acc):.1f}-{100 * max(acc):.1f}) [{c['lr']:g}]"
                    if acc else f"failed [{c['lr']:g}]")
            if c["time_s"] is not None:
                speed = f" ({c['speedup']:.2f}x)" if c["speedup"] else ""
                text += f"; {c['time_s']:#.3g} s{speed}, {c['epochs']:.2f} ep"
            else:
                text += "; not reached"
            row.append(f"{text}; {c['reached']}")
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    lines += ["", "Variants:", *[f"- `{v}` (`{' '.join(VARIANTS[v][0]) or 'no flags'}`): {VARIANTS[v][1]}"
                                 for v in args.variants]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t0 = time.monotonic()
    cells = Cells(args)
    for key in [(v, n, lr, s) for v in args.variants for n in args.workers for lr in args.lrs
                for s in range(args.seeds)]:
        cells.recorded(key)  # every record the grid may take judged up front: one of other settings stops it now
    cells.run([(v, n, lr, 0) for v in args.variants for n in args.workers for lr in args.lrs])
    chosen = {(v, n): best_lr(cells, v, n, args.lrs) for v in args.variants for n in args.workers}
    cells.run([(v, n, lr, s) for (v, n), lr in chosen.items() if lr is not None for s in range(1, args.seeds)])
    summary = summarize(cells, args, chosen)
    text = table(summary, args)
    print(f"\n{len(cells.commands)} simulations in {time.monotonic() - t0:.0f} s of this machine\n\n{text}")
    with open(os.path.join(args.run_dir, "asgd_scaling.json"), "w") as f:
        json.dump({"argv": sys.argv[1:] if argv is None else argv, "summary": summary,
                   "commands": [shlex.join(c) for c in cells.commands]}, f, indent=1, default=str)
    with open(os.path.join(args.run_dir, "asgd_scaling.md"), "w") as f:
        f.write(text + "\n\nCommands:\n\n```bash\n" + "\n".join(shlex.join(c) for c in cells.commands) + "\n```\n")
    failed = [name(*k) for k, v in cells.results.items() if v is None]
    if failed:
        print(f"{PROG}: {len(failed)} simulation(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    import mpi4py

    mpi4py.rc.initialize = False  # no MPI here: reading a command as `mpiasgd simulate` does imports mpi4py.MPI
    mpi4py.rc.finalize = False
    sys.exit(main())
