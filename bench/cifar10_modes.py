#!/usr/bin/env python3
"""Training modes compared on CIFAR-10 with 1 parameter server + 2 workers, the same epochs each:
synchronous, asynchronous, asynchronous with staleness-aware steps, stale-synchronous. One
markdown table for docs/benchmarks/modes.md.

    python bench/cifar10_modes.py                     # cifar10, 10 epochs, the four modes below, one after another
    python bench/cifar10_modes.py --model digits --epochs 3 --modes async,async-inverse   # ~10 s check of the script

Modes (`--modes`, comma-separated; run in the order given):

    sync             --mode sync
    async            --mode async
    async-inverse    --mode async --staleness-lr inverse
    ssp              --mode ssp --staleness-bound 2
    NAME             any other training mode by its name (`mpiasgd.modes.registry`), with its defaults:
                     e.g. easgd (--mode easgd: tau 4, alpha 0.9 / workers)

Each mode is one run log, RUN_DIR/MODE.h5 (default RUN_DIR: runs/modes-MODEL-TIMESTAMP), made by
`mpiexec -n 3 python -m mpiasgd train ...` with the shared options (model, epochs, batch size, lr,
snapshot interval), then `python -m mpiasgd evaluate RUN.h5` (test accuracy of every weight snapshot).
At the end `python -m mpiasgd report --format markdown --target-accuracy T RUN.h5 ...` prints the
comparison (test accuracy, time to T, images/s, staleness), followed by every command exactly as run.

Timing on 2 CPU cores (numpy workers; async measured at about 1,500 images/s): per mode about 5.5 min
of training and 3 min evaluating its ~23 snapshots, so about 35 min for the four (sync may take longer).

Every command has a time limit (`--timeout`, per command); a command that fails or reaches it has
its output printed, and the script stops there with exit status 1 (the logs written so far stay).
Python is this interpreter (`sys.executable`), mpiexec the one beside it (else on PATH).

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from launch import add_run_arguments, launcher, run, run_dir

from mpiasgd.argtypes import fraction, positive
from mpiasgd.modes.registry import MODES as REGISTRY
from mpiasgd.runlog import summary_lines

WORKERS = 2
MODES = {  # name -> the train options that make the mode
    "sync": ["--mode", "sync"],
    "async": ["--mode", "async"],
    "async-inverse": ["--mode", "async", "--staleness-lr", "inverse"],
    "ssp": ["--mode", "ssp", "--staleness-bound", "2"],
}


def mode_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODES and name not in REGISTRY]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown) or '(none)'}: "
                                         f"expected a comma-separated list of {', '.join(MODES)} or a mode "
                                         f"name ({', '.join(REGISTRY)})")
    if len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"a mode is listed twice in {text!r}")
    return names


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    work = parser.add_argument_group("workload (the same for every mode)")
    work.add_argument("--model", default="cifar10", help="network and dataset: cifar10 | digits")
    work.add_argument("--epochs", type=float, default=10.0, help="passes over the training set per run")
    work.add_argument("--batch-size", type=positive, default=64, help="minibatch per worker, images")
    work.add_argument("--lr", type=float, default=0.02, help="peak learning rate")
    work.add_argument("--snapshot-interval", type=float, default=15.0, help="weight snapshot every this many seconds")
    work.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: $MPIASGD_DATA or ~/.cache/mpiasgd)")
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--modes", type=mode_list, default=list(MODES), metavar="M1,M2,...",
                       help=f"which modes, in order: {', '.join(MODES)}, or any mode by its name")
    bench.add_argument("--target-accuracy", type=fraction, default=0.60, metavar="FRACTION",
                       help="test accuracy of the 'time to' column, a fraction (0.6 = 60 %%)")
    add_run_arguments(bench, "modes")
    args = parser.parse_args(argv)
    args.run_dir = run_dir(args, "modes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    mpiexec = launcher()
    python = [sys.executable, "-m", "mpiasgd"]
    data = ["--data-dir", args.data_dir] if args.data_dir else []
    shared = ["--model", args.model, *data, "--epochs", f"{args.epochs:g}", "--batch-size", str(args.batch_size),
              "--lr", str(args.lr), "--snapshot-interval", str(args.snapshot_interval),
              "--run-dir", args.run_dir, "--no-progress"]
    commands, logs = [], []
    for i, mode in enumerate(args.modes, 1):
        log = os.path.join(args.run_dir, mode + ".h5")
        options = MODES.get(mode, ["--mode", mode])  # a variant above, or a mode by its name
        steps = [("training", [*mpiexec, "-n", str(1 + WORKERS), *python, "train", *shared, *options,
                               "--name", mode]),
                 ("evaluating every snapshot", [*python, "evaluate", log, *data])]
        for what, cmd in steps:
            print(f"[{i}/{len(args.modes)}] {mode}: {what} ...", end=" ", flush=True)
            done = run(cmd, args.timeout)
            commands.append(cmd)
            print(f"{done.seconds:.0f} s" if done.ok else "FAILED", flush=True)
            if not done.ok:
                print(done.explain(args.timeout), file=sys.stderr, flush=True)
                return 1
        print("\n".join("    " + line for line in summary_lines(log)[1:]), flush=True)
        logs.append(log)
    report = [*python, "report", "--format", "markdown", "--target-accuracy", f"{args.target_accuracy:g}", *logs]
    done = run(report, 120.0)
    commands.append(report)
    if not done.ok:
        print(done.explain(120.0), file=sys.stderr)
        return 1
    print(f"\n{args.model}, {args.epochs:g} epochs per run, batch {args.batch_size} per worker, lr {args.lr:g}, "
          f"1 parameter server + {WORKERS} workers, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}. "
          f"Time to {100 * args.target_accuracy:g}%: seconds of training until an evaluated weight snapshot "
          f"(every {args.snapshot_interval:g} s) first reached {100 * args.target_accuracy:g}% test accuracy.\n")
    print(done.stdout.rstrip("\n"))
    print("\nCommands (`python bench/cifar10_modes.py " + shlex.join(sys.argv[1:] if argv is None else argv)
          + "`):\n\n```bash\n" + "\n".join(shlex.join(cmd) for cmd in commands) + "\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
