#!/usr/bin/env python3
"""Does `mpiasgd simulate` reproduce a real run? Real asynchronous runs with 1 parameter server + N workers
(`--workers`, default 2), then for each a simulation of N workers whose timing model is fitted from that run's
own log (`--fit`): the staleness distribution (mean, p99, the share of each value) and the final test
accuracy, side by side.

    python bench/simulate_validate.py                                  # cifar10, 3 epochs, seeds 0,1,2
    python bench/simulate_validate.py --options="--straggler 2:3 --lr 0.01"   # an uneven pair of workers
    python bench/simulate_validate.py --model digits --epochs 2 --seeds 0,1   # ~30 s check of the script
    python bench/simulate_validate.py --model digits --workers 4 --epochs 20 --options="--lr 0.02"  # oversubscribed

For every seed: `mpiexec -n N+1 python -m mpiasgd train --seed S ...` (the real run), then `python -m mpiasgd
simulate --workers N --fit REAL.h5 --seed S ...` with the same options (Open MPI's mpiexec with
`--oversubscribe`: N + 1 ranks may exceed the cores). The fit (`mpiasgd.sim.timing.fit_run_log`) takes
each worker's measured compute seconds per minibatch as an empirical distribution (drawn with replacement),
the server's seconds per update as the shortest gap between two updates, and the one-way latency as (median
of wait_s + comm_s - held_s - server_s) / 2. `--fits draw,replay` (the default) simulates each real run
twice: compute times drawn at random from the measured ones, and replayed in their measured order
(`--fit-replay`, a trace-driven simulation). Goals (issue 20): the simulated mean and p99 staleness within
10 % of the real run's, and the simulated final accuracy within the real runs' run-to-run spread (their
range over the seeds). The mean alone says little: while every worker always has one push in flight it is
N - 1 in any arrival order (each of the N pushes in flight sees the other N - 1 applied), so the table also
gives the shares of staleness 0, 1, ..., N and > N and their total variation distance (half the sum of the
absolute differences of the shares: 0 = the same distribution).
The runs take the product's defaults (`--update-rule auto`: DANA-Zero from 2 workers) unless `--options`
says otherwise; the real run and the simulation resolve the rule the same way (rank 0's role is shared).

Every command has a time limit (`--timeout`); a failure prints the command and its output and stops the
script with exit status 1.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import numpy as np
from launch import add_run_arguments, distinct_ints, launcher, run_dir, run_steps

from mpiasgd.runlog.reader import load
from mpiasgd.runlog.summary import final_eval


def seeds(text: str) -> list[int]:
    """argparse type: comma-separated distinct integers >= 0, at least one."""
    return distinct_ints(text, 0, "0,1,2")


def workers(text: str) -> int:
    """argparse type: an integer >= 2 (asynchronous SGD with one worker has no staleness to compare)."""
    if not text.strip().isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}")
    return int(text)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="simulate_validate.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="cifar10", help="network and dataset")
    parser.add_argument("--epochs", type=float, default=3.0, help="epochs of every run")
    parser.add_argument("--workers", type=workers, default=2, help="workers of every run (1 server + N workers; "
                        "the real runs under mpiexec -n N+1)")
    parser.add_argument("--batch-size", type=int, default=64, help="minibatch per worker")
    parser.add_argument("--seeds", type=seeds, default=seeds("0,1,2"), help="one real and one simulated run per "
                        "seed (comma-separated, distinct, >= 0)")
    parser.add_argument("--options", default="--lr 0.01", help="more `train` options for every run")
    parser.add_argument("--fits", default="draw,replay", help="how the simulations take the fitted compute times: "
                        "draw (at random, with replacement) and/or replay (in their order: --fit-replay)")
    add_run_arguments(parser, "validate")
    args = parser.parse_args(argv)
    args.fits = [f.strip() for f in args.fits.split(",") if f.strip()]
    if not args.fits or any(f not in ("draw", "replay") for f in args.fits):
        parser.error(f"--fits: expected draw and/or replay, got {args.fits}")
    args.run_dir = run_dir(args, "validate")
    return args


def staleness(path: str, n: int) -> dict:
    """Staleness of the applied pushes of the run log at `path` of `n` workers: mean, p99 (the smallest value at
    least 99 % of the pushes do not exceed: staleness is an integer), the share of 0, 1, ..., n and >= n + 1,
    and the final test accuracy."""
    r = load(path)
    p = r["pushes"]
    s = p["staleness"][p["applied"].astype(bool)].astype(np.float64)
    return {"mean": float(s.mean()), "p99": float(np.percentile(s, 99, method="inverted_cdf")),
            "share": [float((s == k).mean()) for k in range(n + 1)] + [float((s > n).mean())],
            "accuracy": float(final_eval(r)["accuracy"]), "pushes": int(s.size)}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    mpiexec = launcher()
    python = [sys.executable, "-m", "mpiasgd"]
    shared = ["--model", args.model, "--epochs", f"{args.epochs:g}", "--batch-size", str(args.batch_size),
              "--run-dir", args.run_dir, "--no-progress", "--threads", "1", "--snapshot-interval", "0",
              "--overwrite", *shlex.split(args.options)]
    commands, rows = [], []
    for seed in args.seeds:
        real = os.path.join(args.run_dir, f"real-{seed}.h5")
        steps = [("real run", [*mpiexec, "-n", str(1 + args.workers), *python, "train", *shared, "--seed", str(seed),
                               "--name", f"real-{seed}"])]
        for fit in args.fits:
            steps.append((f"simulated run ({fit})", [*python, "simulate", "--workers", str(args.workers), "--fit", real,
                                                     *(["--fit-replay"] if fit == "replay" else []), *shared,
                                                     "--seed", str(seed), "--name", f"sim-{fit}-{seed}"]))
        if not run_steps(f"seed {seed}", steps, args.timeout, commands):
            return 1
        real_row = staleness(real, args.workers)
        for fit in args.fits:
            sim = staleness(os.path.join(args.run_dir, f"sim-{fit}-{seed}.h5"), args.workers)
            rows.append((seed, fit, real_row, sim))
    bins = " / ".join(str(k) for k in range(args.workers + 1))
    print(f"\n{args.model}, {args.epochs:g} epochs, batch {args.batch_size} per worker, 1 server + {args.workers} "
          f"workers, `{args.options}`, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}. Staleness of the "
          f"applied pushes; share of staleness {bins} / >= {args.workers + 1}.\n")
    print(f"| seed | run | pushes | mean staleness | p99 | shares {bins} / >={args.workers + 1} | test accuracy |")
    print("|---:|---|---:|---:|---:|---|---:|")
    shown = set()
    for seed, fit, real, sim in rows:
        for name, s in (("real", real), (f"simulated ({fit})", sim)):
            if (seed, name) in shown:
                continue
            shown.add((seed, name))
            shares = " / ".join(f"{100 * x:.1f} %" for x in s["share"])
            print(f"| {seed} | {name} | {s['pushes']:,} | {s['mean']:.3f} | {s['p99']:.0f} | {shares} | "
                  f"{100 * s['accuracy']:.2f} % |")
    real_acc = [real["accuracy"] for _, fit, real, _ in rows if fit == args.fits[0]]
    spread = max(real_acc) - min(real_acc)
    print(f"\nreal runs: final accuracy {100 * statistics.fmean(real_acc):.2f} % (range {100 * min(real_acc):.2f}.."
          f"{100 * max(real_acc):.2f}: run-to-run spread {100 * spread:.2f} points)")
    for fit in args.fits:
        mine = [(real, sim) for _, f, real, sim in rows if f == fit]
        mean_err = [abs(s["mean"] - r["mean"]) / r["mean"] for r, s in mine if r["mean"]]
        p99_err = [abs(s["p99"] - r["p99"]) / r["p99"] for r, s in mine if r["p99"]]
        tv = [0.5 * sum(abs(a - b) for a, b in zip(r["share"], s["share"], strict=True)) for r, s in mine]
        acc = [s["accuracy"] for _, s in mine]
        gap = 100 * (statistics.fmean(acc) - statistics.fmean(real_acc))
        print(f"simulated ({fit}): mean staleness off by {', '.join(f'{100 * e:.1f} %' for e in mean_err)}; p99 off "
              f"by {', '.join(f'{100 * e:.1f} %' for e in p99_err)} (goal <= 10 %); total variation distance "
              f"{', '.join(f'{d:.3f}' for d in tv)}; final accuracy {100 * statistics.fmean(acc):.2f} % "
              f"({', '.join(f'{100 * a:.2f}' for a in acc)}), {gap:+.2f} points from the real mean")
    print("\nCommands (`python bench/simulate_validate.py " + shlex.join(sys.argv[1:] if argv is None else argv)
          + "`):\n\n```bash\n" + "\n".join(shlex.join(cmd) for cmd in commands) + "\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
