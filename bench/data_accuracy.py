#!/usr/bin/env python3
"""Does a dataset file train as well as the official files? The cifar10 network on CIFAR-10 read from the
official layout (in memory) and from an mpiasgd dataset file (`mpiasgd data convert`: shuffled once, read a
chunk at a time with the window shuffle), each with seeds 0 and 1 (the run-to-run noise), evaluated during
training (`--eval-interval`), with the accuracy curves plotted by `mpiasgd report --plots`.

    python bench/data_accuracy.py                     # 4 epochs per run, 4 runs: ~40 min on 2 cores
    python bench/data_accuracy.py --epochs 1          # a quick look

Every run: `mpiexec -n 3` (parameter server + 2 workers), --mode sync (the accuracy does not depend on
timing), batch 64 per worker, lr 0.02, cosine schedule, --eval-interval 0.5ep. The file is written first
if absent (`mpiasgd data convert DATA_DIR $TMPDIR/mpiasgd-cifar10.h5`).

Goal (issue 19): the file's accuracy within run-to-run noise of the official files': the difference of
the seed means no larger than the spread between seeds. The exact commands are printed at the end.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from input_pipeline import ensure_file
from trainrun import Trainer, cores

from mpiasgd.argtypes import positive

WORKERS = 2
FLAGS = ["--model", "cifar10", "--mode", "sync", "--lr", "0.02", "--lr-schedule", "cosine", "--eval-interval", "0.5ep",
         "--threads", "1", "--snapshot-interval", "0"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=float, default=4.0, help="epochs per run")
    parser.add_argument("--seeds", type=positive, default=2, help="seeds per data source (0, 1, ...)")
    parser.add_argument("--batch-size", type=positive, default=64, help="minibatch per worker, images")
    parser.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: $MPIASGD_DATA or ~/.cache/mpiasgd)")
    parser.add_argument("--file", default=None, help="the dataset file (default: $TMPDIR/mpiasgd-cifar10.h5)")
    parser.add_argument("--run-dir", default=None, help="keep the run logs here (default: runs/data-accuracy-TIME)")
    parser.add_argument("--plots", default=None, help="folder of the plots (default: RUN_DIR/plots)")
    parser.add_argument("--timeout", type=float, default=6 * 3600, help="time limit of each run, seconds")
    args = parser.parse_args()
    path = args.file or os.path.join(tempfile.gettempdir(), "mpiasgd-cifar10.h5")
    run_dir = args.run_dir or os.path.join("runs", time.strftime("data-accuracy-%Y%m%d-%H%M%S"))
    trainer = Trainer(run_dir, args.timeout)
    ensure_file(path, args.data_dir, args.timeout, trainer.commands)
    sources = {"official": ["--data-dir", args.data_dir] if args.data_dir else [], "file": ["--data", path]}
    acc: dict[str, list[float]] = {label: [] for label in sources}
    names = []
    for seed in range(args.seeds):
        for label, extra in sources.items():  # the two sources side by side, seed after seed
            name = f"{label}-s{seed}"
            log = trainer.train(WORKERS, [*FLAGS, *extra, "--epochs", f"{args.epochs:g}", "--seed", str(seed),
                                          "--batch-size", str(args.batch_size)], name)
            acc[label].append(float(log["test_accuracy"]))
            names.append(os.path.join(run_dir, name + ".h5"))
            print(f"{name:<12} test accuracy {100 * acc[label][-1]:.2f} %", flush=True)
    plots = args.plots or os.path.join(run_dir, "plots")
    cmd = [sys.executable, "-m", "mpiasgd", "report", *names, "--plots", plots]
    trainer.commands.append(cmd)
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    print(f"\ncifar10 network, CIFAR-10, sync, {WORKERS} workers x batch {args.batch_size}, {args.epochs:g} epochs, "
          f"{cores()} cores, "
          f"{time.strftime('%Y-%m-%d')}:\n")
    print("| data | " + " | ".join(f"seed {s}" for s in range(args.seeds)) + " | mean |")
    print("| :-- |" + " ---: |" * (args.seeds + 1))
    for label, values in acc.items():
        print(f"| {label} | " + " | ".join(f"{100 * v:.2f} %" for v in values)
              + f" | {100 * statistics.mean(values):.2f} % |")
    diff = statistics.mean(acc["file"]) - statistics.mean(acc["official"])
    spread = max(max(v) - min(v) for v in acc.values())
    print(f"\nfile - official: {100 * diff:+.2f} points; largest spread between seeds of one source: "
          f"{100 * spread:.2f} points; within run-to-run noise: {'yes' if abs(diff) <= spread else 'no'}")
    print(f"accuracy curves (evaluations during training): {os.path.join(plots, 'accuracy.png')}")
    trainer.print_commands()
    return 0


if __name__ == "__main__":
    sys.exit(main())
