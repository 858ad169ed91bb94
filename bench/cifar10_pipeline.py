#!/usr/bin/env python3
"""Decoupled backpropagation on CIFAR-10: plain backprop (K = 1) against K = 2 and 3 pipeline modules,
with and without FDG's gradient shrinking, the same epochs each. One markdown table for docs/benchmarks/pipeline.md.

    python bench/cifar10_pipeline.py                    # cifar10_deep (six 3x3 convs), 5 epochs, 5 configurations
    python bench/cifar10_pipeline.py --model digits --epochs 3 --configs K1,K2   # a few seconds: checks the script

Configurations (`--configs`, run in the order given; one replica, N = 1, so 1 + K ranks):

    K1          --modules 1                      plain backpropagation (= synchronous SGD on one worker)
    K2, K3      --modules 2 / 3                  fully decoupled (module k's gradient 2(K-1-k) iterations old)
    K2-s0.5     --modules 2 --shrink 0.5         ... with gradient shrinking beta = 0.5
    K3-s0.5     --modules 3 --shrink 0.5

Each is `mpiexec -n 1+K python -m mpiasgd train --mode pipeline ...` into RUN_DIR/CONFIG.h5 (default
RUN_DIR: runs/pipeline-MODEL-TIMESTAMP). The table gives the final test accuracy (all 10,000 test
images, evaluated by rank 0), the training time per epoch and images/s. On a machine with fewer
cores than ranks (K = 3 on 2 cores) the time per epoch measures oversubscription, not the method.

Every command has a time limit (`--timeout`); a failure prints its output and ends the script with
exit status 1. Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from launch import add_run_arguments, launcher, run, run_dir
from trainrun import name_list

from mpiasgd.argtypes import positive
from mpiasgd.runlog import load

CONFIGS = {  # name -> (modules K, shrink beta)
    "K1": (1, 1.0), "K2": (2, 1.0), "K2-s0.5": (2, 0.5), "K3": (3, 1.0), "K3-s0.5": (3, 0.5),
}


config_list = name_list(CONFIGS)  # argparse type: comma-separated config names


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="cifar10_deep", help="network: cifar10_deep | cifar10 | digits")
    parser.add_argument("--epochs", type=float, default=5.0, help="passes over the training set per run")
    parser.add_argument("--batch-size", type=positive, default=64, help="minibatch, images")
    parser.add_argument("--lr", type=float, default=0.02, help="peak learning rate")
    parser.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: $MPIASGD_DATA or ~/.cache/mpiasgd)")
    parser.add_argument("--configs", type=config_list, default=list(CONFIGS), metavar="C1,C2,...",
                        help=f"which configurations, in order: {', '.join(CONFIGS)}")
    add_run_arguments(parser, "pipeline")
    args = parser.parse_args(argv)
    args.run_dir = run_dir(args, "pipeline")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    mpiexec = launcher()
    shared = ["--model", args.model, *(["--data-dir", args.data_dir] if args.data_dir else []),
              "--epochs", f"{args.epochs:g}", "--batch-size", str(args.batch_size), "--lr", str(args.lr),
              "--mode", "pipeline", "--snapshot-interval", "0", "--run-dir", args.run_dir, "--no-progress"]
    commands, rows = [], []
    for i, name in enumerate(args.configs, 1):
        modules, shrink = CONFIGS[name]
        cmd = [*mpiexec, "-n", str(1 + modules), sys.executable, "-m", "mpiasgd", "train", *shared,
               "--modules", str(modules), "--shrink", f"{shrink:g}", "--name", name]
        print(f"[{i}/{len(args.configs)}] {name}: training ...", end=" ", flush=True)
        done = run(cmd, args.timeout)
        commands.append(cmd)
        print(f"{done.seconds:.0f} s" if done.ok else "FAILED", flush=True)
        if not done.ok:
            print(done.explain(args.timeout), file=sys.stderr, flush=True)
            return 1
        log = load(os.path.join(args.run_dir, name + ".h5"))
        epochs = float(log["epochs_done"])
        rows.append((name, modules, shrink, float(log["test_accuracy"]), float(log["train_time_s"]) / epochs,
                     float(log["images_per_s"])))
        print(f"    test accuracy {100 * rows[-1][3]:.2f} %, {rows[-1][4]:.1f} s per epoch", flush=True)
    print(f"\n{args.model}, {args.epochs:g} epochs per run, batch {args.batch_size}, lr {args.lr:g}, one replica "
          f"(1 + K ranks), fully decoupled, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}.\n")
    print("| config | modules K | shrink beta | test accuracy | s per epoch | images/s |")
    print("| :----- | --------: | ----------: | ------------: | ----------: | -------: |")
    for name, modules, shrink, accuracy, per_epoch, rate in rows:
        print(f"| {name} | {modules} | {shrink:g} | {100 * accuracy:.2f}% | {per_epoch:.1f} | {rate:,.0f} |")
    print("\nCommands (`python bench/cifar10_pipeline.py " + shlex.join(sys.argv[1:] if argv is None else argv)
          + "`):\n\n```bash\n" + "\n".join(shlex.join(cmd) for cmd in commands) + "\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
