#!/usr/bin/env python3
"""A straggler, asynchronous against synchronous: images/s of `--mode async` over `--mode sync` with
1 parameter server + 2 workers, worker rank 2 slowed 3x (`--straggler 2:3`), measured side by side
(alternating runs, median of each and the ratio of every round).

    python bench/straggler.py                                  # cifar10, batch 64, 3 rounds of 20 s runs; ~3 min
    python bench/straggler.py --model digits --seconds 5       # the server-bound extreme (0.8 ms steps); ~1 min

The ideal: let r be the images/s of one worker at full speed. `--straggler 2:3` makes worker 2
sleep twice its compute time after every minibatch, so it delivers r/3.

    async: each worker pushes at its own pace          r + r/3 = 4/3 r
    sync:  every step waits for the slowest worker     2 workers x r/3 = 2/3 r
    async / sync = (4/3) / (2/3) = 2.0                 (factor F: (1 + 1/F) / (2/F) = (F + 1) / 2)

The goal is >= 1.8 (0.9 of the ideal). Both hold when the server's work per push and the allreduce
are small next to a step and each worker has a core to itself. Where the workers contend for cores
(other jobs on a shared machine, or two cores that do not compute as two), sync suffers more than
async and the ratio can exceed the ideal: the sync workers compute at the same moments and slow each
other, and worker 2 sleeps twice its own, slowed, compute time, while in async worker 2 computes a
third of the time only. The script prints both modes' mean compute time per minibatch of worker 1,
equal without contention, to show it.

The default workload is the cifar10 network (about 75 ms per minibatch of 64 on one core), so the
sleep dominates, as with a slow device on a real heterogeneous cluster; it falls back to digits
(batch 32), with a notice, when CIFAR-10 is not found (`--data-dir`, $MPIASGD_DATA,
~/.cache/mpiasgd). With digits, steps take under a millisecond and the ratio also measures the
server's cost per push.

Both modes run with the same model, batch size, seed, `--threads 1` per worker and a time limit
(`--epochs 0 --max-time SECONDS`). Images/s of a run = images in applied pushes / training time,
read from its log as `mpiasgd report` does; r is measured as the images/s of worker 1 in async runs.
Every command has a time limit (`--timeout`); a failure prints the command and its output and exits
with status 1. The exact commands are printed at the end.

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
    rounds,
    time_limited,
    workload,
)

WORKERS = 2
SLOW_RANK = 2  # the straggler: the last worker
MODES = ("async", "sync")


def worker_rate(log: dict, rank: int) -> float:
    """Images/s of worker `rank` alone: images in its applied pushes / training time."""
    pushes = log["pushes"]
    mine = pushes[(pushes["worker"] == rank) & (pushes["applied"] == 1)]
    return float(mine["samples"].sum()) / float(log["train_time_s"])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    work = add_workload_arguments(parser, "workload (the same for both modes)")
    work.add_argument("--factor", type=float, default=3.0,
                      help=f"worker rank {SLOW_RANK} is this many times slower (default: %(default)g)")
    add_benchmark_arguments(parser, rounds=3, run_seconds=20.0)
    args = parser.parse_args(argv)
    if not args.factor > 1:
        parser.error(f"--factor must be > 1, got {args.factor:g}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    model, batch = workload(args.model, args.batch_size, args.data_dir)
    factor = f"{args.factor:g}"
    print(f"workload: {model} network, batch {batch} per worker, --threads 1, 1 server + {WORKERS} workers, "
          f"worker rank {SLOW_RANK} {factor}x slower (--straggler {SLOW_RANK}:{factor}), {args.seconds:g} s of "
          f"training per run, {args.rounds} rounds, {cores()} cores", flush=True)
    options = [*time_limited(model, batch, args.data_dir, args.seconds), "--straggler", f"{SLOW_RANK}:{factor}"]

    def show(r: int, mode: str, log: dict) -> None:
        print(f"round {r}: {mode:<5} {log['images_per_s']:9.1f} images/s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(args.run_dir or tmp, command_limit(args))
        configs = {mode: (lambda name, mode=mode: trainer.train(WORKERS, [*options, "--mode", mode], name))
                   for mode in MODES}
        logs = rounds(configs, args.rounds, show)
    rate = {mode: [log["images_per_s"] for log in logs[mode]] for mode in MODES}
    ratios = [a / s for a, s in zip(rate["async"], rate["sync"], strict=True)]
    one = statistics.median(worker_rate(log, 1) for log in logs["async"])  # r: a worker at full speed
    ideal = (args.factor + 1) / 2
    med = {mode: statistics.median(rate[mode]) for mode in MODES}
    ratio = med["async"] / med["sync"]

    print("\nround  async images/s  sync images/s  async/sync")
    for r, (a, s, q) in enumerate(zip(rate["async"], rate["sync"], ratios, strict=True), 1):
        print(f"{r:>5}  {a:>14.1f}  {s:>13.1f}  {q:>10.2f}")
    print(f"median {med['async']:>13.1f}  {med['sync']:>13.1f}  {ratio:>10.2f}   (median of the round ratios: "
          f"{statistics.median(ratios):.2f})")
    print(f"\nr = worker 1's images/s in the async runs (median) = {one:.1f}")
    print(f"  async: {med['async'] / one:.2f} r   (ideal 1 + 1/{factor} = {1 + 1 / args.factor:.2f} r)")
    print(f"  sync:  {med['sync'] / one:.2f} r   (ideal 2/{factor} = {2 / args.factor:.2f} r)")
    ms = {mode: [compute_ms(logs[mode], w) for w in (1, 2)] for mode in MODES}
    print(f"mean compute per minibatch, ms (worker {SLOW_RANK}'s includes its sleep):")
    for mode in MODES:
        print(f"  {mode + ':':<6} worker 1 {ms[mode][0]:.1f}, worker 2 {ms[mode][1]:.1f}")
    print(f"  worker 1 sync / async: {ms['sync'][0] / ms['async'][0]:.2f}  (1.00 when each worker has a core to "
          f"itself; above, the workers contend for cores, which costs sync more: there they compute at the same "
          f"moments, and worker {SLOW_RANK} sleeps {factor} - 1 times its slowed compute)")
    goal = 0.9 * ideal
    verdict = "met" if ratio >= goal else "NOT met"
    print(f"async / sync = {ratio:.2f}   ideal {ideal:.2f}, goal >= {goal:.2f}: {verdict}")
    trainer.print_commands()
    return 0


if __name__ == "__main__":
    sys.exit(main())
