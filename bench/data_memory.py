#!/usr/bin/env python3
"""Memory of every rank when the training set is far larger than one rank should hold: peak RSS of the
parameter server and of each worker training from an mpiasgd dataset file, against what loading the
training set whole takes (what every rank did before dataset files: `Dataset` in memory).

    python bench/data_memory.py                    # 200,000 synthetic 64x64 images (2.5 GB), 2 workers, ~5 min
    python bench/data_memory.py --count 20000      # a quick look

Steps, each command printed at the end:
  1. `mpiasgd data synth FILE --count N --size S --classes 1000` unless FILE exists with that content.
  2. `mpiexec -n 1+W python bench/peak_rss.py DIR train --data FILE --model bench/nets/tiny64.py:build ...`
     for --pushes pushes: the peak RSS of each rank (getrusage's ru_maxrss, written at exit by
     bench/peak_rss.py). A worker reads its shard a chunk at a time (the shuffle window's chunks
     cached), rank 0 reads the labels only.
  3. The same with --data-in-memory: each worker keeps its shard (1/W of the set) in memory.
  4. One process that reads the whole training split into memory as one uint8 array, as every rank
     did before: its peak RSS, and that times the ranks of step 2.

Goal (issue 19): every rank of step 2 under 600 MiB.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from launch import launcher, run

from mpiasgd.argtypes import positive

HERE = os.path.dirname(os.path.abspath(__file__))
GOAL_MIB = 600
WHOLE = """
import resource, sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r") as f:
    x = f["train/images"][...]          # the whole training split, uint8, as an in-memory Dataset holds it
    y = np.asarray(f["train/labels"][...], np.int64)
print(x.nbytes / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def synth(path: str, args: argparse.Namespace, commands: list[list[str]]) -> float:
    """Write the synthetic file unless it is there with the asked content; returns the seconds it took (0)."""
    if os.path.exists(path):
        import h5py

        with h5py.File(path, "r") as f:
            shape = f["train/images"].shape
        if shape == (args.count, 3, args.size, args.size):
            return 0.0
    cmd = [sys.executable, "-m", "mpiasgd", "data", "synth", path, "--count", str(args.count), "--size",
           str(args.size), "--classes", "1000", "--overwrite", "--no-progress"]
    commands.append(cmd)
    t0 = time.perf_counter()
    done = run(cmd, args.timeout)
    if not done.ok:
        sys.exit(f"{sys.argv[0]}: {done.explain(args.timeout)}")
    return time.perf_counter() - t0


def train(path: str, args: argparse.Namespace, run_dir: str, name: str, extra: list[str],
          commands: list[list[str]]) -> dict[int, float]:
    """Peak RSS (MiB) of every rank of one training run: {rank: MiB}."""
    out = os.path.join(run_dir, name + "-rss")
    os.makedirs(out, exist_ok=True)
    cmd = [*launcher(), "-n", str(1 + args.workers), sys.executable, os.path.join(HERE, "peak_rss.py"), out,
           "train", "--data", path, "--model", os.path.join(HERE, "nets", "tiny64.py") + ":build",
           "--epochs", "0", "--max-pushes", str(args.pushes), "--batch-size", str(args.batch_size), "--threads", "1",
           "--snapshot-interval", "0", "--checkpoint-interval", "0", "--no-progress", "--run-dir", run_dir,
           "--name", name, *extra]
    commands.append(cmd)
    done = run(cmd, args.timeout)
    if not done.ok:
        sys.exit(f"{sys.argv[0]}: {done.explain(args.timeout)}")
    peaks = {}
    for rank in range(1 + args.workers):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            peaks[rank] = json.load(f)["peak_rss_mib"]
    return peaks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--count", type=positive, default=200_000, help="training images in the synthetic file")
    parser.add_argument("--size", type=positive, default=64, help="image side, pixels")
    parser.add_argument("--workers", type=positive, default=2, help="worker ranks")
    parser.add_argument("--pushes", type=positive, default=300, help="pushes each training run makes (--max-pushes)")
    parser.add_argument("--batch-size", type=positive, default=64, help="minibatch per worker, images")
    parser.add_argument("--file", default=None,
                        help="the synthetic file (default: $TMPDIR/mpiasgd-synth-SIZE-COUNT.h5, kept for the next run)")
    parser.add_argument("--run-dir", default=None, help="keep the run logs here (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="time limit of each command, seconds")
    args = parser.parse_args()
    path = args.file or os.path.join(tempfile.gettempdir(), f"mpiasgd-synth-{args.size}-{args.count}.h5")
    commands: list[list[str]] = []
    made = synth(path, args, commands)
    size_gb = os.path.getsize(path) / 1e9
    print(f"dataset file {path}: {args.count:,} images 3x{args.size}x{args.size}, {size_gb:.2f} GB"
          + (f" (written in {made:.0f} s)" if made else " (already there)"), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or tmp
        chunked = train(path, args, run_dir, "mem-chunks", [], commands)
        shard = train(path, args, run_dir, "mem-shard", ["--data-in-memory"], commands)
    cmd = [sys.executable, "-c", WHOLE, path]
    commands.append(cmd)
    whole = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=True)
    data_mib, whole_mib = (float(v) for v in whole.stdout.split())
    ranks = 1 + args.workers
    print(f"\npeak RSS per rank, MiB ({args.workers} workers, {args.pushes} pushes of {args.batch_size} images, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}):\n")
    print("| rank | role | from the file (chunks) | --data-in-memory (shard) | whole set in memory |")
    print("| ---: | :--- | ---: | ---: | ---: |")
    for rank in range(ranks):
        role = "parameter server" if rank == 0 else "worker"
        print(f"| {rank} | {role} | {chunked[rank]:,.0f} | {shard[rank]:,.0f} | {whole_mib:,.0f} |")
    print(f"\nthe training images: {data_mib:,.0f} MiB; loading them whole on every rank: {ranks} x {whole_mib:,.0f} "
          f"= {ranks * whole_mib:,.0f} MiB against {sum(chunked.values()):,.0f} MiB from the file "
          f"({ranks * whole_mib / sum(chunked.values()):.1f}x less)")
    worst = max(chunked.values())
    print(f"every rank under {GOAL_MIB} MiB: {'yes' if worst < GOAL_MIB else 'no'} (largest: {worst:,.0f} MiB)")
    print(f"\ncommands ({len(commands)}, as run):")
    print("\n".join("  " + shlex.join(c) for c in commands))
    return 0


if __name__ == "__main__":
    sys.exit(main())
