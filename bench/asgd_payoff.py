#!/usr/bin/env python3
"""Does asynchrony pay off? The training modes on CIFAR-10 with 1 parameter server + 2 workers, each at
its own best step size (`grid`), and with one of the two workers 3x slower (`straggler`).

    python bench/asgd_payoff.py grid                     # 5 variants x 3 step sizes, 10 epochs each
    python bench/asgd_payoff.py grid --variants sync,async --lrs 0.01,0.02,0.04
    python bench/asgd_payoff.py straggler --lr sync=0.04,async-dca=0.02    # time to 65 %, worker 2 3x slower
    python bench/asgd_payoff.py grid --model digits --epochs 1 --variants sync,async --lrs 0.05,0.1   # ~1 min check

`grid`: every variant trains `--epochs` (10) at every step size of `--lrs` (comma-separated; a variant
may have its own: `--lrs sync=0.02:0.04:0.08,0.01:0.02:0.04` gives sync its list and every other
variant the last one). The table gives each run's final test accuracy (all 10,000 test images, the
final weights) and marks each variant's best; a best at the edge of its grid is flagged, since the
grid then does not bracket the optimum. The asynchronous variants are compared with sync each at
its own best step size, as modes should be compared (Goyal et al. 2017 tune per batch size).

`straggler`: worker rank 2 is 3x slower (`--straggler 2:3`); each variant runs at the step size
given by `--lr VARIANT=LR,...` (the grid's best), with weight snapshots every `--snapshot-interval`
seconds evaluated after the run (`mpiasgd evaluate`: the evaluation costs the run no time), and the
table gives the seconds of training until the test accuracy first reached `--target-accuracy`
(0.65), and its ratio to sync's.

Variants (`--variants`, comma-separated):

    sync           --mode sync
    async          --mode async
    async-inverse  --mode async --staleness-lr inverse                 (Zhang et al. 2016)
    async-momentum --mode async --async-momentum workers               (Mitliagkas et al. 2016)
    async-dca      --mode async --dc-lambda 2 --dc-adaptive 0.95       (DC-ASGD-a, Zheng et al. 2017)
    async-dca-mom  --mode async --dc-lambda 2 --dc-adaptive 0.95 --async-momentum workers
    async-lookahead --mode async --lookahead -1                      (DANA's look-ahead, Hakimi et al. 2019)
    async-nesterov --mode async --nesterov
    ssp            --mode ssp --staleness-bound 2

Shared: cifar10 network, batch 64 per worker, momentum 0.9, weight decay 5e-4, cosine schedule with
0.5 epochs of warm-up, seed 0. On 2 CPU cores one 10-epoch run takes about 5.5 min (sync longer).
Every command has a time limit (`--timeout`); a failure prints the command and its output and stops
the script with exit status 1 (the logs so far stay in RUN_DIR). The commands are printed at the end.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from launch import add_run_arguments, launcher, run_dir, run_steps

from mpiasgd.argtypes import fraction, positive
from mpiasgd.runlog.reader import load
from mpiasgd.runlog.summary import final_eval
from mpiasgd.tools.report import time_to_accuracy

WORKERS = 2
VARIANTS = {
    "sync": ["--mode", "sync"],
    "async": ["--mode", "async", "--update-rule", "sgd"],  # (plain A-SGD; the default, auto, is DANA-Zero for 2)
    "async-dana": ["--mode", "async", "--update-rule", "dana-zero"],
    "async-inverse": ["--mode", "async", "--staleness-lr", "inverse"],
    "async-momentum": ["--mode", "async", "--async-momentum", "workers"],
    "async-dca": ["--mode", "async", "--dc-lambda", "2", "--dc-adaptive", "0.95"],
    "async-dca-mom": ["--mode", "async", "--dc-lambda", "2", "--dc-adaptive", "0.95", "--async-momentum", "workers"],
    "async-lookahead": ["--mode", "async", "--lookahead", "-1"],
    "async-nesterov": ["--mode", "async", "--nesterov"],  # (auto: sgd, since dana-zero rules out --nesterov)
    "ssp": ["--mode", "ssp", "--staleness-bound", "2", "--update-rule", "sgd"],
}
DEFAULT_VARIANTS = "sync,async,async-momentum,async-dca,async-dca-mom"


def variant_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"expected distinct variants from {', '.join(VARIANTS)}, got {text!r}")
    return names


def step_sizes(text: str) -> dict[str, list[float]]:
    """'0.01:0.02' or 'sync=0.02:0.04,0.01:0.02' -> {variant or '*': [lr, ...]}; ',' also separates a plain list."""
    out: dict[str, list[float]] = {}
    plain: list[float] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" in part:
                name, values = part.split("=", 1)
                if name not in VARIANTS:
                    raise ValueError(f"unknown variant {name!r}")
                out[name] = [float(v) for v in values.split(":")]
            else:
                plain += [float(v) for v in part.split(":")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"step sizes {text!r}: {e}") from None
    if plain:
        out["*"] = plain
    if not out or any(not lr > 0 for lrs in out.values() for lr in lrs):
        raise argparse.ArgumentTypeError(f"expected step sizes > 0, got {text!r}")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("what", choices=("grid", "straggler"), help="the learning-rate grid, or the straggler race")
    parser.add_argument("--model", default="cifar10", help="network and dataset: cifar10 | digits")
    parser.add_argument("--epochs", type=float, default=10.0, help="passes over the training set per run")
    parser.add_argument("--batch-size", type=positive, default=64, help="minibatch per worker, images")
    parser.add_argument("--variants", type=variant_list, default=None, metavar="V1,V2,...",
                        help=f"which variants, in order (default grid: {DEFAULT_VARIANTS}; straggler: those of --lr)")
    parser.add_argument("--lrs", type=step_sizes, default=step_sizes("0.01:0.02:0.04"),
                        help="grid: step sizes, ':'-separated, per variant as NAME=A:B:C")
    parser.add_argument("--lr", type=step_sizes, default=None, help="straggler: VARIANT=LR,... (each its best)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (weights, data order); runs of a "
                        "seed other than 0 are named VARIANT-lrLR-sSEED")
    parser.add_argument("--straggler", default="2:3", help="straggler: --straggler of the runs")
    parser.add_argument("--target-accuracy", type=fraction, default=0.65, metavar="FRACTION",
                        help="straggler: test accuracy of the 'time to' column")
    parser.add_argument("--snapshot-interval", type=float, default=10.0, help="straggler: seconds between snapshots")
    parser.add_argument("--reuse", action="store_true", help="take a run whose log in RUN_DIR is complete instead "
                        "of training it again (a grid continued, or extended with more step sizes); without it, "
                        "and for a log left incomplete, the run is trained again over its log (--overwrite)")
    parser.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: $MPIASGD_DATA or ~/.cache/mpiasgd)")
    add_run_arguments(parser, "payoff")
    args = parser.parse_args(argv)
    if args.what == "straggler" and not args.lr:
        parser.error("straggler needs --lr VARIANT=LR,... (the grid's best step size of each variant)")
    if args.variants is None:
        args.variants = variant_list(DEFAULT_VARIANTS) if args.what == "grid" else [v for v in args.lr if v != "*"]
    args.run_dir = run_dir(args, "payoff")
    return args


def lrs_of(table: dict[str, list[float]], variant: str) -> list[float]:
    lrs = table.get(variant, table.get("*"))
    if lrs is None:
        sys.exit(f"asgd_payoff.py: no step size for variant {variant!r}")
    return lrs


def reusable(log: str, args: argparse.Namespace, variant: str, lr: float) -> bool:
    """--reuse: the run log `log` exists, completed, from the same workload (model, epochs, batch size, mode, step
    size; straggler: and its snapshots evaluated); SystemExit naming the log when it is another run's."""
    if not os.path.exists(log):
        return False
    r = load(log)
    cfg = r["config"]
    want = {"model": args.model, "epochs": args.epochs, "batch_size": args.batch_size, "lr": lr,
            "mode": VARIANTS[variant][1], "seed": args.seed}
    differ = {k: (cfg.get(k), v) for k, v in want.items() if cfg.get(k) != v}
    if differ:
        sys.exit(f"asgd_payoff.py: --reuse: run log '{log}' is of another workload ({differ}); remove it or use "
                 "another --run-dir")
    evaluated = r["evals"] is not None and bool((r["evals"]["snapshot"] >= 0).any())
    return r.get("status") == "completed" and (args.what == "grid" or evaluated)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    mpiexec = launcher()
    python = [sys.executable, "-m", "mpiasgd"]
    data = ["--data-dir", args.data_dir] if args.data_dir else []
    shared = ["--model", args.model, *data, "--epochs", f"{args.epochs:g}", "--batch-size", str(args.batch_size),
              "--run-dir", args.run_dir, "--no-progress", "--threads", "1", "--overwrite", "--seed", str(args.seed)]
    if args.what == "straggler":
        shared += ["--straggler", args.straggler, "--snapshot-interval", f"{args.snapshot_interval:g}"]
    else:
        shared += ["--snapshot-interval", "0"]
    jobs = [(v, lr) for v in args.variants for lr in lrs_of(args.lrs if args.what == "grid" else args.lr, v)]
    commands, rows = [], []
    for i, (variant, lr) in enumerate(jobs, 1):
        name = f"{variant}-lr{lr:g}" + (f"-s{args.seed}" if args.seed else "")
        log = os.path.join(args.run_dir, name + ".h5")
        steps = [("training", [*mpiexec, "-n", str(1 + WORKERS), *python, "train", *shared, *VARIANTS[variant],
                               "--lr", f"{lr:g}", "--name", name])]
        if args.what == "straggler":
            steps.append(("evaluating the snapshots", [*python, "evaluate", log, *data]))
        if args.reuse and reusable(log, args, variant, lr):
            print(f"[{i}/{len(jobs)}] {name}: reused (its log is complete)", flush=True)
            commands += [cmd for _, cmd in steps]
        elif not run_steps(f"[{i}/{len(jobs)}] {name}", steps, args.timeout, commands):
            return 1
        r = load(log)
        final = final_eval(r)
        rows.append({"variant": variant, "lr": lr, "accuracy": float(final["accuracy"]),
                     "time_s": float(r.get("train_time_s", float("nan"))),
                     "to_target": time_to_accuracy(r, args.target_accuracy) if args.what == "straggler" else None,
                     "staleness": float(r.get("staleness_mean", float("nan")))})
        print(f"    test accuracy {100 * rows[-1]['accuracy']:.2f} %", flush=True)
    print()
    head = (f"{args.model}, {args.epochs:g} epochs, batch {args.batch_size} per worker, seed {args.seed}, 1 server + "
            f"{WORKERS} workers, "
            f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    if args.what == "grid":
        print(grid_table(rows, head))
    else:
        print(straggler_table(rows, head, args))
    cmdline = shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"\nCommands (`python bench/asgd_payoff.py {cmdline}`):\n\n```bash\n"
          + "\n".join(shlex.join(cmd) for cmd in commands) + "\n```")
    return 0


def grid_table(rows: list[dict], head: str) -> str:
    lines = [head + ". Final test accuracy; **bold**: the variant's best step size.", "",
             "| variant | lr | test accuracy | training s | mean staleness |", "|---|---:|---:|---:|---:|"]
    best: dict[str, dict] = {}
    for row in rows:
        if row["variant"] not in best or row["accuracy"] > best[row["variant"]]["accuracy"]:
            best[row["variant"]] = row
    for row in rows:
        acc = f"{100 * row['accuracy']:.2f} %"
        lines.append(f"| {row['variant']} | {row['lr']:g} | {f'**{acc}**' if best[row['variant']] is row else acc} | "
                     f"{row['time_s']:.1f} | {row['staleness']:.2f} |")
    lines += ["", "| variant | best lr | test accuracy | vs sync (points) |", "|---|---:|---:|---:|"]
    sync = best.get("sync")
    for variant, row in best.items():
        lrs = sorted(r["lr"] for r in rows if r["variant"] == variant)
        edge = " (edge of the grid)" if len(lrs) > 1 and row["lr"] in (lrs[0], lrs[-1]) else ""
        gap = f"{100 * (row['accuracy'] - sync['accuracy']):+.2f}" if sync is not None else "-"
        lines.append(f"| {variant} | {row['lr']:g}{edge} | {100 * row['accuracy']:.2f} % | {gap} |")
    return "\n".join(lines)


def straggler_table(rows: list[dict], head: str, args: argparse.Namespace) -> str:
    target = 100 * args.target_accuracy
    lines = [f"{head}, --straggler {args.straggler}. Time to {target:g} %: seconds of training until a weight "
             f"snapshot (every {args.snapshot_interval:g} s) first reached it.", "",
             f"| variant | lr | time to {target:g} % (s) | vs sync | final accuracy | mean staleness |",
             "|---|---:|---:|---:|---:|---:|"]
    sync = next((r["to_target"] for r in rows if r["variant"] == "sync"), None)
    for row in rows:
        t = row["to_target"]
        ratio = f"{t / sync:.2f}x" if t is not None and sync else "-"
        lines.append(f"| {row['variant']} | {row['lr']:g} | {'not reached' if t is None else f'{t:.0f}'} | {ratio} | "
                     f"{100 * row['accuracy']:.2f} % | {row['staleness']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
