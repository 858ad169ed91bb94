#!/usr/bin/env python3
"""Scaling of A-SGD throughput with workers on one machine: images/s of 1 server + 2 workers over
1 server + 1 worker, measured side by side (alternating runs, median of each).

    python bench/scaling.py                                  # cifar10, batch 64, 3 rounds of 20 s runs
    python bench/scaling.py --model digits --batch-size 32   # the server-bound extreme (0.8 ms steps)

What it checks: the parameter server's idle wait must not take a core from the workers. On a
2-core machine with 1 BLAS thread per worker, the ideal ratio is 2.0; the goal is >= 1.8. Every
worker gets `--threads 1` in both configurations, so the ratio measures the server's cost and not
BLAS threading. The default workload is the cifar10 network (about 90 ms per minibatch of 64 on
one core), where the server is idle between pushes, which is the property under test; it falls
back to digits, with a notice, when CIFAR-10 is not found (`--data-dir`, $MPIASGD_DATA,
~/.cache/mpiasgd). With digits, steps take under a millisecond and the ratio also measures the
server's per-push cost (about 70 us of Python per push). Images/s of a run = images in applied
pushes / training time, read from its log.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import h5py
from launch import launcher


def run(nranks: int, args: argparse.Namespace, workdir: str, name: str) -> float:
    """One training run of `args.seconds`; returns its images/s from the run log."""
    cmd = [*launcher(), "-n", str(nranks), sys.executable, "-m", "mpiasgd", "train", "--model", args.model,
           *(["--data-dir", args.data_dir] if args.data_dir else []),
           "--epochs", "0", "--max-time", str(args.seconds), "--threads", "1", "--batch-size", str(args.batch_size),
           "--snapshot-interval", "0", "--no-progress", "--name", name, "--run-dir", workdir]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds * 4 + 120)
    if done.returncode != 0:
        sys.exit(f"run failed ({' '.join(cmd)}):\n{done.stdout}\n{done.stderr}")
    with h5py.File(os.path.join(workdir, name + ".h5"), "r") as f:
        return float(f.attrs["images_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cifar10", help="cifar10 (default) or digits")
    parser.add_argument("--batch-size", type=int, default=64, help="minibatch per worker")
    parser.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: $MPIASGD_DATA or ~/.cache/mpiasgd)")
    parser.add_argument("--seconds", type=float, default=20.0, help="training time of each run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each configuration, alternating")
    args = parser.parse_args()
    if args.model == "cifar10":
        from mpiasgd.data import DataError, load_dataset

        try:
            load_dataset("cifar10", args.data_dir)
        except DataError as e:
            print(f"CIFAR-10 not found ({e}); measuring digits with batch 32 instead", flush=True)
            args.model, args.batch_size = "digits", 32
    rates: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            for workers in (1, 2):
                rate = run(workers + 1, args, workdir, f"w{workers}-r{r}")
                rates[workers].append(rate)
                print(f"round {r + 1}: 1 server + {workers} worker(s): {rate:9.1f} images/s", flush=True)
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"\nmodel {args.model}, batch {args.batch_size}/worker, {args.seconds:g} s runs, {os.cpu_count()} cores, "
          f"median of {args.rounds}")
    print(f"  1 server + 1 worker : {one:9.1f} images/s")
    print(f"  1 server + 2 workers: {two:9.1f} images/s")
    print(f"  ratio 2 workers / 1 worker: {two / one:.2f}  (ideal 2.00, goal >= 1.80)")
    print(f"  per-round ratios: {', '.join(f'{b / a:.2f}' for a, b in zip(rates[1], rates[2], strict=True))}")


if __name__ == "__main__":
    main()
