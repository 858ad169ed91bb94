#!/usr/bin/env python3
"""Scaling of throughput with workers on one machine: images/s of 1 server + 1, 2 and 4 workers, in
the asynchronous and the synchronous mode, each over 1 worker of the same mode, measured side by side
(alternating runs, median of each and the ratio of every round).

    python bench/scaling.py                                  # cifar10, batch 64, 2 rounds of 8 s runs; ~4 min
    python bench/scaling.py --workers 1,2 --modes async --rounds 3 --seconds 20   # the 2-worker A-SGD check; ~3 min
    python bench/scaling.py --model digits                   # the server-bound extreme (batch 32, 0.8 ms steps)

What it checks: the parameter server's idle wait must not take a core from the workers. Every
worker gets `--threads 1` in every configuration, so a ratio measures the server's cost (async) or
the allreduce's (sync) and not BLAS threading. With N workers on C cores the ideal ratio is
min(N, C): on a 2-core machine 2.0 for 2 workers, and still 2.0 for 4 workers, which share the 2
cores (oversubscribed, flagged in the table). The goal for 2 workers async is >= 1.8.

The table also gives each configuration's mean compute time per minibatch (pushes column
`compute_s`). It is the same in every row when each worker has a core to itself; when it grows with
the workers, they are contending for cores (4 workers on 2 cores, or other jobs on a shared
machine), and the ratio falls short for that reason rather than the server's or the allreduce's.

The default workload is the cifar10 network (about 75 ms per minibatch of 64 on one core), where
the server is idle between pushes, which is the property under test; it falls back to digits (batch
32), with a notice, when CIFAR-10 is not found (`--data-dir`, $MPIASGD_DATA, ~/.cache/mpiasgd).
With digits, steps take under a millisecond and the ratio also measures the server's per-push cost
(about 70 us of Python per push). Images/s of a run = images in applied pushes / training time
(`--epochs 0 --max-time SECONDS`), read from its log as `mpiasgd report` does.

Time: each run costs SECONDS of training plus start-up (loading CIFAR-10 on every rank) and the final
evaluation of the 10,000 test images, about 13 s with 1 worker and 22 s with 4 on 2 cores. Every
command has a time limit (`--timeout`); a failure prints the command and its output and exits with
status 1. The exact commands are printed at the end.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from trainrun import (
    Trainer,
    add_benchmark_arguments,
    add_workload_arguments,
    command_limit,
    compute_ms,
    cores,
    int_list,
    rounds,
    time_limited,
    workload,
)

MODES = ("async", "sync")
GOAL_2_ASYNC = 1.8  # images/s of 2 workers over 1 worker, async


def mode_list(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or any(m not in MODES for m in names) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(MODES)}, got {text!r}")
    return names


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser, "workload (the same for every configuration)")
    bench = add_benchmark_arguments(parser, rounds=2, run_seconds=8.0)
    bench.add_argument("--workers", type=int_list, default=[1, 2, 4], metavar="N1,N2,...",
                       help="worker counts (default: 1,2,4; ratios are over 1 worker, which is always run)")
    bench.add_argument("--modes", type=mode_list, default=list(MODES), metavar="M1,M2",
                       help="training modes: async, sync (default: both)")
    args = parser.parse_args(argv)
    args.workers = sorted({1, *args.workers})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    model, batch = workload(args.model, args.batch_size, args.data_dir)
    ncores = cores()
    print(f"workload: {model} network, batch {batch} per worker, --threads 1, 1 server + "
          f"{', '.join(map(str, args.workers))} workers, modes {', '.join(args.modes)}, {args.seconds:g} s of "
          f"training per run, {args.rounds} rounds, {ncores} cores", flush=True)
    options = time_limited(model, batch, args.data_dir, args.seconds)
    configs = [(mode, n) for n in args.workers for mode in args.modes]

    def label(mode: str, n: int) -> str:
        return f"{mode}-{n}w"

    def show(r: int, name: str, log: dict) -> None:
        print(f"round {r}: {name:<9} {log['images_per_s']:9.1f} images/s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(args.run_dir or tmp, command_limit(args))
        runs = {label(mode, n): (lambda name, mode=mode, n=n: trainer.train(n, [*options, "--mode", mode], name))
                for mode, n in configs}
        logs = rounds(runs, args.rounds, show)
    rate = {key: [log["images_per_s"] for log in runs_] for key, runs_ in logs.items()}
    med = {key: statistics.median(values) for key, values in rate.items()}

    def ratios(mode: str, n: int) -> list[float]:
        return [b / a for a, b in zip(rate[label(mode, 1)], rate[label(mode, n)], strict=True)]

    print(f"\nimages/s (median of {args.rounds}), ratio over 1 worker of the same mode (ideal: min(workers, cores) = "
          f"min(N, {ncores})), and mean compute ms per minibatch (the same in every row when each worker has "
          f"a core to itself)")
    head = "".join(f"  {mode + ' images/s':>15} {'ratio':>6} {'ms':>6}" for mode in args.modes)
    print(f"workers  ranks{head}  ideal")
    for n in args.workers:
        cells = "".join(f"  {med[label(mode, n)]:>15.1f} {med[label(mode, n)] / med[label(mode, 1)]:>6.2f} "
                        f"{compute_ms(logs[label(mode, n)]):>6.1f}" for mode in args.modes)
        flag = f"  oversubscribed: {n} workers on {ncores} cores" if n > ncores else ""
        print(f"{n:>7}  {n + 1:>5}{cells}  {min(n, ncores):>5.2f}{flag}")
    print("per-round ratios over 1 worker:")
    for mode, n in configs:
        if n > 1:
            print(f"  {label(mode, n):<9} {', '.join(f'{q:.2f}' for q in ratios(mode, n))}")
    if "async" in args.modes and 2 in args.workers:
        two = med[label("async", 2)] / med[label("async", 1)]
        verdict = "met" if two >= GOAL_2_ASYNC else "NOT met"
        print(f"async, 2 workers / 1 worker: {two:.2f}   ideal {min(2, ncores):.2f}, goal >= {GOAL_2_ASYNC:.2f}: "
              f"{verdict}")
    trainer.print_commands()
    return 0


if __name__ == "__main__":
    sys.exit(main())
