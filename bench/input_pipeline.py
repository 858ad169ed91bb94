#!/usr/bin/env python3
"""Is the input pipeline hidden? Images/s of the cifar10 network trained from CIFAR-10 in an mpiasgd dataset
file (read a chunk at a time, minibatches prepared by the background prefetch) against the in-memory path
(the whole set in memory, each minibatch gathered and augmented inside the step, `--prefetch 0`: how every
run read its data before dataset files), measured side by side in alternating rounds, with the share of
the step each worker spent waiting for its minibatch (the run log's `data_s` over `compute_s`).

    python bench/input_pipeline.py                 # 3 rounds of 40 s runs per configuration, ~6 min
    python bench/input_pipeline.py --seconds 20 --rounds 2

The file is written first if absent: `mpiasgd data convert DATA_DIR $TMPDIR/mpiasgd-cifar10.h5` (either
official layout of CIFAR-10 in --data-dir, $MPIASGD_DATA or ~/.cache/mpiasgd).

Configurations, each `mpiexec -n 3` (parameter server + 2 async workers, 1 BLAS thread each), batch 64:
    memory           --model cifar10 --prefetch 0           (the in-memory path, as before)
    memory+prefetch  --model cifar10                         (in memory, default --prefetch 2)
    file             --model cifar10 --data FILE             (from the file, default --prefetch 2)

Goals (issue 19): file within 5 % of memory in images/s; data wait below 5 % of the step for the file.
Images/s = images in applied pushes / training time, as `mpiasgd report` computes it. Medians over the
rounds. The exact commands are printed at the end.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from launch import run
from trainrun import Trainer, add_benchmark_arguments, command_limit, cores, rounds, time_limited

from mpiasgd.argtypes import positive

WORKERS = 2
BATCH = 64


def data_share(log: dict) -> float:
    """Seconds waited for minibatches over seconds of compute, summed over the run's applied pushes."""
    pushes = log["pushes"]
    applied = pushes["applied"] == 1
    return float(pushes["data_s"][applied].sum() / pushes["compute_s"][applied].sum())


def ensure_file(path: str, data_dir: str | None, limit: float, commands: list[list[str]]) -> None:
    if os.path.exists(path):
        return
    from mpiasgd.data import default_data_dir

    cmd = [sys.executable, "-m", "mpiasgd", "data", "convert", data_dir or default_data_dir(), path, "--no-progress"]
    commands.append(cmd)
    t0 = time.perf_counter()
    done = run(cmd, limit)
    if not done.ok:
        sys.exit(f"{sys.argv[0]}: {done.explain(limit)}")
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: $MPIASGD_DATA or ~/.cache/mpiasgd)")
    parser.add_argument("--file", default=None, help="the dataset file (default: $TMPDIR/mpiasgd-cifar10.h5)")
    parser.add_argument("--batch-size", type=positive, default=BATCH, help="minibatch per worker, images")
    add_benchmark_arguments(parser, rounds=3, run_seconds=40.0)
    args = parser.parse_args()
    limit = command_limit(args)
    path = args.file or os.path.join(tempfile.gettempdir(), "mpiasgd-cifar10.h5")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(args.run_dir or tmp, limit)
        ensure_file(path, args.data_dir, limit, trainer.commands)
        base = time_limited("cifar10", args.batch_size, args.data_dir, args.seconds)
        configs = {
            "memory": lambda name: trainer.train(WORKERS, [*base, "--prefetch", "0"], name),
            "memory+prefetch": lambda name: trainer.train(WORKERS, base, name),
            "file": lambda name: trainer.train(WORKERS, [*time_limited("cifar10", args.batch_size, None, args.seconds),
                                                         "--data", path], name),
        }

        def show(r: int, label: str, log: dict) -> None:
            print(f"round {r} {label:<16} {log['images_per_s']:8.1f} images/s   data wait "
                  f"{100 * data_share(log):5.2f} % of the step", flush=True)

        logs = rounds(configs, args.rounds, show)
    ips = {label: statistics.median(log["images_per_s"] for log in runs) for label, runs in logs.items()}
    wait = {label: statistics.median(data_share(log) for log in runs) for label, runs in logs.items()}
    print(f"\ncifar10 network, CIFAR-10, {WORKERS} async workers, batch {args.batch_size}, {args.seconds:g} s runs, "
          f"{args.rounds} rounds, {cores()} cores, {time.strftime('%Y-%m-%d')}; medians:\n")
    print("| configuration | images/s | vs memory | data wait, % of step |")
    print("| :-- | ---: | ---: | ---: |")
    for label in logs:
        print(f"| {label} | {ips[label]:.1f} | {ips[label] / ips['memory']:.3f} | {100 * wait[label]:.2f} |")
    ratio = ips["file"] / ips["memory"]
    print(f"\nfile within 5 % of memory: {'yes' if ratio >= 0.95 else 'no'} (ratio {ratio:.3f}); data wait of the "
          f"file below 5 % of the step: {'yes' if wait['file'] < 0.05 else 'no'} ({100 * wait['file']:.2f} %)")
    per_round = [f / m for f, m in zip((log["images_per_s"] for log in logs["file"]),
                                        (log["images_per_s"] for log in logs["memory"]), strict=True)]
    print(f"per-round ratios file/memory: {', '.join(f'{r:.3f}' for r in per_round)} "
          f"(median {float(np.median(per_round)):.3f})")
    trainer.print_commands()
    return 0


if __name__ == "__main__":
    sys.exit(main())
