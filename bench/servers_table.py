#!/usr/bin/env python3
"""The largest built-in network under async with 2 workers: images/s and the workers' share of time
waiting for pulls, with one or two parameter-server shards (`--servers`), fp32 or fp16 on the wire
(`--wire`), at nsync 1 and 10 (issue 21's table).

    python bench/servers_table.py                          # alexnet_1gpu_64, batch 16, 8 runs (about 6 min on 2 cores)
    python bench/servers_table.py --model cifar10 --minibatches 200 --batch-size 64
    python bench/servers_table.py --wires bf16                # the same rows with bf16 on the wire
    python bench/servers_table.py --backend cupy --share-devices --batch-size 128 --minibatches 50   # one GPU

Every run: `mpiexec -n 2 + S ... train --mode async --model MODEL` on its default dataset, each worker
computing `--minibatches` minibatches (nsync 1: that many pushes each; nsync 10: a tenth of them),
lr 0.01, no snapshots or checkpoints during training. From the run log:

    images/s    the summary's images per second of training (both workers)
    wait share  sum of the pushes' wait_s over sum of compute_s + comm_s + wait_s, leaving out each
                worker's first push (its wait is the start-up's)

The configurations run one after another, in the order of the table, so a machine whose load drifts
biases the later rows: quote the table with its date and load, and rerun rows to compare.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import numpy as np
from launch import add_run_arguments, launcher, run, run_dir

from mpiasgd.runlog.reader import load

WORKERS = 2


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="alexnet_1gpu_64", help="network (and its default dataset)")
    parser.add_argument("--batch-size", type=int, default=16, help="minibatch per worker")
    parser.add_argument("--wires", default="fp32,fp16", help="wire formats, comma-separated (fp32, fp16, bf16)")
    parser.add_argument("--minibatches", type=int, default=20, help="minibatches each worker computes (a multiple "
                        "of 10)")
    parser.add_argument("--backend", default="auto", help="the workers' ops backend (train --backend: auto, "
                        "numpy, cpu, cupy)")
    parser.add_argument("--share-devices", action="store_true", help="let the two workers share one GPU "
                        "(train --share-devices; a machine with one GPU)")
    add_run_arguments(parser, "servers")
    args = parser.parse_args(argv)
    if args.minibatches < 10 or args.minibatches % 10:
        parser.error(f"--minibatches must be a positive multiple of 10 (nsync 10), got {args.minibatches}")
    args.wires = [w.strip() for w in args.wires.split(",") if w.strip()]
    if not args.wires or any(w not in ("fp32", "fp16", "bf16") for w in args.wires):
        parser.error(f"--wires: expected formats from fp32, fp16, bf16, got {args.wires}")
    args.run_dir = run_dir(args, "servers")
    return args


def wait_share(log: dict) -> float:
    """Sum of wait_s over sum of compute_s + comm_s + wait_s of the pushes, each worker's first left out."""
    rows = log["pushes"]
    later = np.ones(len(rows), bool)
    for w in np.unique(rows["worker"]):
        later[np.flatnonzero(rows["worker"] == w)[:1]] = False
    rows = rows[later]
    busy = float(rows["compute_s"].sum() + rows["comm_s"].sum() + rows["wait_s"].sum())
    return float(rows["wait_s"].sum()) / busy if busy > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    mpiexec = launcher()
    rows, commands = [], []
    configs = [(nsync, servers, wire) for nsync in (1, 10) for servers in (1, 2) for wire in args.wires]
    for i, (nsync, servers, wire) in enumerate(configs, 1):
        name = f"n{nsync}-s{servers}-{wire}"
        pushes = WORKERS * args.minibatches // nsync
        cmd = [*mpiexec, "-n", str(WORKERS + servers), sys.executable, "-m", "mpiasgd", "train", "--mode", "async",
               "--model", args.model, "--batch-size", str(args.batch_size), "--nsync", str(nsync), "--servers",
               str(servers), "--wire", wire, "--epochs", "0", "--max-pushes", str(pushes), "--lr", "0.01",
               "--snapshot-interval", "0", "--checkpoint-interval", "0", "--threads", "1", "--no-progress",
               "--backend", args.backend, *(["--share-devices"] if args.share_devices else []),
               "--run-dir", args.run_dir, "--name", name, "--overwrite"]
        commands.append(cmd)
        print(f"[{i}/{len(configs)}] {name} ...", end=" ", flush=True)
        done = run(cmd, args.timeout)
        if not done.ok:
            print("FAILED")
            print(done.explain(args.timeout), file=sys.stderr)
            return 1
        log = load(os.path.join(args.run_dir, name + ".h5"))
        rows.append((nsync, servers, wire, float(log["images_per_s"]), wait_share(log), float(log["train_time_s"])))
        print(f"{rows[-1][3]:.1f} images/s, waiting {100 * rows[-1][4]:.1f} %", flush=True)
    print(f"\n{args.model}, batch {args.batch_size} per worker, {WORKERS} workers ({args.backend} backend"
          f"{', sharing one GPU' if args.share_devices else ''}), {args.minibatches} minibatches each, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| nsync | servers | wire | images/s | workers' time waiting for pulls | training s |")
    print("|---:|---:|---|---:|---:|---:|")
    for nsync, servers, wire, rate, share, seconds in rows:
        print(f"| {nsync} | {servers} | {wire} | {rate:.1f} | {100 * share:.1f} % | {seconds:.1f} |")
    print("\nCommands:\n\n```bash\n" + "\n".join(shlex.join(c) for c in commands) + "\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
