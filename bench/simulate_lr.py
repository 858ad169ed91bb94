#!/usr/bin/env python3
"""Which step size for N asynchronous workers? A learning-rate grid per number of workers and per variant,
run with `mpiasgd simulate` (equal workers on a virtual clock: real gradients, the real server), reporting
each (variant, N)'s best step size and its accuracy: the evidence for the learning-rate rule of the README.

    python bench/simulate_lr.py                                       # digits, N = 1..16, 6 step sizes, 2 variants
    python bench/simulate_lr.py --model cifar10 --epochs 3 --workers 1,2,4 --lrs 0.005,0.01,0.02,0.04

Variants (`--variants`): fixed (`--async-momentum fixed`, momentum 0.9 at every N), workers
(`--async-momentum workers`: max(0, 0.9 - (1 - 1/N))) and lookahead (momentum 0.9, `--lookahead -1`: the
replies look N - 1 momentum-only updates ahead, DANA). Every run: `--epochs` (default 10), batch
`--batch-size` per worker, the cosine schedule, seed 0, equal workers computing `--compute-s` virtual
seconds per minibatch with a coefficient of variation of 0.2 (the order of arrivals varies as on a real
cluster), no latency. The table gives the final test accuracy of every run and marks each row's best; a
best at the end of the grid is flagged.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from launch import add_run_arguments, run, run_dir

from mpiasgd.runlog.reader import load
from mpiasgd.runlog.summary import final_eval

VARIANTS = {"fixed": ["--async-momentum", "fixed", "--update-rule", "sgd"], "workers": ["--async-momentum", "workers"],
            "lookahead": ["--async-momentum", "fixed", "--lookahead", "-1"]}


def numbers(kind: type):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
        return values
    return parse


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="digits", help="network and dataset")
    parser.add_argument("--epochs", type=float, default=10.0, help="epochs of every run")
    parser.add_argument("--batch-size", type=int, default=32, help="minibatch per worker")
    parser.add_argument("--workers", type=numbers(int), default=numbers(int)("1,2,4,8,16"), help="N values")
    parser.add_argument("--lrs", type=numbers(float), default=numbers(float)("0.0025,0.005,0.01,0.02,0.04,0.08"),
                        help="step sizes")
    parser.add_argument("--variants", default="fixed,workers", help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--compute-s", type=float, default=0.01, help="virtual seconds per minibatch")
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once")
    add_run_arguments(parser, "lr")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants: expected names from {', '.join(VARIANTS)}")
    args.run_dir = run_dir(args, "lr")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.makedirs(args.run_dir, exist_ok=True)
    python = [sys.executable, "-m", "mpiasgd", "simulate"]
    jobs = {(v, n, lr): [*python, "--workers", str(n), "--model", args.model, "--epochs", f"{args.epochs:g}",
                         "--batch-size", str(args.batch_size), "--lr", f"{lr:g}", "--compute-s", f"{args.compute_s:g}",
                         "--compute-cv", "0.2", "--threads", "1", "--snapshot-interval", "0", "--no-progress",
                         "--run-dir", args.run_dir, "--overwrite", "--name", f"{v}-n{n}-lr{lr:g}", *VARIANTS[v]]
            for v in args.variants for n in args.workers for lr in args.lrs}

    def one(key: tuple) -> tuple:
        done = run(jobs[key], args.timeout)
        if not done.ok:
            print(done.explain(args.timeout), file=sys.stderr, flush=True)
            return key, None
        v, n, lr = key
        return key, float(final_eval(load(os.path.join(args.run_dir, f"{v}-n{n}-lr{lr:g}.h5")))["accuracy"])

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        acc = dict(pool.map(one, jobs))
    print(f"{args.model}, {args.epochs:g} epochs, batch {args.batch_size} per worker, simulated equal workers; "
          f"{len(jobs)} simulations in {time.monotonic() - t0:.0f} s, {time.strftime('%Y-%m-%d')}. Final test "
          f"accuracy; **bold**: the row's best step size.\n")
    print("| variant | N | " + " | ".join(f"lr {lr:g}" for lr in args.lrs) + " | best lr |")
    print("|---|---:|" + "---:|" * (len(args.lrs) + 1))
    for v in args.variants:
        for n in args.workers:
            row = [acc[(v, n, lr)] for lr in args.lrs]
            got = [a for a in row if a is not None]
            best = max(got) if got else None
            cells = ["failed" if a is None else (f"**{100 * a:.1f} %**" if a == best else f"{100 * a:.1f} %")
                     for a in row]
            best_lr = args.lrs[row.index(best)] if best is not None else None
            edge = " (edge)" if best_lr in (args.lrs[0], args.lrs[-1]) else ""
            print(f"| {v} | {n} | " + " | ".join(cells) + (f" | {best_lr:g}{edge} |" if best_lr else " | - |"))
    return 0 if all(a is not None for a in acc.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
