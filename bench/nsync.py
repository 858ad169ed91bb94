#!/usr/bin/env python3
"""Pushing every minibatch or every NSYNC minibatches: time for the training loss to reach a target
with `--nsync 1`, `10` and `100` on the digits network, 1 parameter server + 2 asynchronous
workers, measured side by side (alternating runs, median of each), with the final test accuracy and
images/s of every setting.

    python bench/nsync.py                                    # nsync 1, 10, 100; 5 rounds of 30-epoch runs; 1-2 min
    python bench/nsync.py --nsync 1,4,16 --target-loss 0.3   # other settings and target

With nsync K a worker takes K local SGD steps (momentum and weight decay on its own copy, at the
step size the server sent with the weights) and pushes its accumulated update, the difference of
its weights from those it pulled, which the server adds as is (no server momentum). With nsync 1 it
pushes each gradient and the server takes the momentum step. The two are the same optimizer per
minibatch (heavy-ball momentum, the same lr), so every setting gets the same flags:

    --lr 0.01 --lr-schedule constant --warmup-epochs 0 --momentum 0.9 (default) --batch-size 32 --epochs 30

lr 0.01 (mpiasgd's default) is stable for all three settings; at 0.05 (`make demo`'s) nsync 10
swung back up to a loss of about 1 in a trial. The schedule is constant without warm-up because the
local steps of a round all take the step size of the pull that began it: under the default warm-up
(0.5 epochs) the first round pulls lr 0, so with nsync 100 the whole first round of each worker
(3,200 images, 4.5 epochs of digits' 1,437 training images between the two workers) would move
nothing, and under the default cosine schedule the step size would follow each run's own progress.

Training loss: the pushes table of a run log has one row per push, with `loss` the mean over that
push's minibatches (its K minibatches for nsync K) and `time` the training seconds at which the
server received it. The curve compared is the trailing mean: at each applied push, the mean loss,
weighted by images, of the latest pushes holding at least `--window` images (default: one epoch),
the push itself at least, undefined until that many images have been pushed. Time to target = the
training seconds of the first push at which that mean is <= `--target-loss`; "-" for a run that
never got there (it counts as infinitely slow in the median). The default target, 0.05, is one
that all three settings reach in about half a second of a 30-epoch run (about 1 s) on 2 cores; 0.3
is reached within the first 0.1-0.2 s, where start-up dominates. Caveat: the loss of a push is that
of the worker's own weights during its K local steps, on its own shard, so for large K the curve
follows the workers' local copies rather than the server's weights (with nsync 100 a worker makes
4.5 passes over its 718-image shard per push); the final test accuracy is the server's.
Images/s = images in applied pushes / training time, read from each log as `mpiasgd report` does.

Every command has a time limit (`--timeout`); a failure prints the command and its output and exits
with status 1. The exact commands are printed at the end.

Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI refuses otherwise).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile

import numpy as np
from trainrun import Trainer, add_benchmark_arguments, cores, int_list, rounds

from mpiasgd.argtypes import positive

WORKERS = 2
MODEL = "digits"


def trailing_mean(loss: np.ndarray, samples: np.ndarray, window: int) -> np.ndarray:
    """The training-loss curve: at each push i, the mean of `loss`, weighted by `samples`, over the
    latest pushes j..i whose samples add up to at least `window` (j as large as possible; the push
    itself at least); NaN while pushes 0..i hold fewer than `window` samples in all.

    `loss` (float, (P,)) is each push's mean minibatch loss, `samples` (int, (P,)) its images, in
    the order the pushes were applied. Returns float64 (P,).
    """
    weights = np.asarray(samples, dtype=np.float64)
    cum_w = np.concatenate([[0.0], np.cumsum(weights)])  # (P + 1,): images in pushes 0..i-1
    cum_lw = np.concatenate([[0.0], np.cumsum(weights * np.asarray(loss, dtype=np.float64))])
    end = np.arange(1, len(weights) + 1)  # the window of push i is pushes start..end-1
    start = np.searchsorted(cum_w, cum_w[end] - window, side="right") - 1  # the last start with >= window
    start = np.minimum(start, end - 1)  # the push itself at least
    full = cum_w[end] >= window
    start = np.maximum(start, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (cum_lw[end] - cum_lw[start]) / (cum_w[end] - cum_w[start])
    return np.where(full, mean, np.nan)


def time_to_loss(times: np.ndarray, loss: np.ndarray, samples: np.ndarray, target: float, window: int) -> float:
    """Seconds (`times` of the pushes, ascending) at which `trailing_mean` first is <= `target`;
    +inf if it never is."""
    curve = trailing_mean(loss, samples, window)
    reached = np.flatnonzero(curve <= target)  # NaN compares False: an undefined mean never counts
    return float(times[reached[0]]) if reached.size else math.inf


def run_time_to_loss(log: dict, target: float, window: int) -> float:
    """`time_to_loss` of a run log's applied pushes."""
    pushes = log["pushes"]
    applied = pushes[pushes["applied"] == 1]
    applied = applied[np.argsort(applied["time"], kind="stable")]
    return time_to_loss(applied["time"], applied["loss"], applied["samples"], target, window)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    work = parser.add_argument_group("workload (the same for every setting)")
    work.add_argument("--nsync", type=int_list, default=[1, 10, 100], metavar="K1,K2,...",
                      help="local steps per push to compare; the first is the reference (default: 1,10,100)")
    work.add_argument("--epochs", type=float, default=30.0, help="length of each run, epochs (default: %(default)g)")
    work.add_argument("--lr", type=float, default=0.01, help="step size, constant (default: %(default)g)")
    work.add_argument("--batch-size", type=positive, default=32,
                      help="minibatch per worker, images (default: %(default)d)")
    bench = add_benchmark_arguments(parser, rounds=5, timeout=180.0)
    bench.add_argument("--target-loss", type=float, default=0.05,
                       help="training loss of the 'time to' column (default: %(default)g)")
    bench.add_argument("--window", type=positive, default=None,
                       help="images in the trailing mean of the training loss (default: one epoch)")
    args = parser.parse_args(argv)
    if not (args.lr > 0 and args.epochs > 0 and args.target_loss > 0):
        parser.error("--lr, --epochs and --target-loss must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    options = ["--model", MODEL, "--epochs", f"{args.epochs:g}", "--batch-size", str(args.batch_size),
               "--lr", f"{args.lr:g}", "--lr-schedule", "constant", "--warmup-epochs", "0", "--threads", "1",
               "--snapshot-interval", "0"]
    print(f"workload: {MODEL} network, 1 server + {WORKERS} async workers, batch {args.batch_size}, lr {args.lr:g} "
          f"constant, no warm-up, {args.epochs:g} epochs per run, --threads 1, nsync "
          f"{', '.join(map(str, args.nsync))}, {args.rounds} rounds, {cores()} cores", flush=True)
    window = args.window

    def show(r: int, name: str, log: dict) -> None:
        w = window or int(log["num_train"])
        reached = seconds(run_time_to_loss(log, args.target_loss, w))
        print(f"round {r}: {name:<9} loss <= {args.target_loss:g} at {reached} s, test accuracy "
              f"{100 * float(log['test_accuracy']):.2f} %, {log['images_per_s']:8.0f} images/s, "
              f"{int(log['version'])} pushes", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(args.run_dir or tmp, args.timeout)
        runs = {f"nsync{k}": (lambda name, k=k: trainer.train(WORKERS, [*options, "--nsync", str(k)], name))
                for k in args.nsync}
        logs = rounds(runs, args.rounds, show)
    window = window or int(logs[f"nsync{args.nsync[0]}"][0]["num_train"])

    times = {k: [run_time_to_loss(log, args.target_loss, window) for log in logs[f"nsync{k}"]] for k in args.nsync}
    ref = statistics.median(times[args.nsync[0]])
    print(f"\nmedians of {args.rounds} rounds; time to loss <= {args.target_loss:g}: training seconds until the "
          f"trailing mean over {window} images first reached it")
    print(f"nsync  pushes  staleness  images/s  test acc  time to {args.target_loss:g} (s)  "
          f"x nsync {args.nsync[0]}  reached  per round (s)")
    for k in args.nsync:
        runs_ = logs[f"nsync{k}"]
        med = statistics.median(times[k])
        ratio = med / ref if math.isfinite(med) and math.isfinite(ref) else math.nan
        reached = sum(math.isfinite(t) for t in times[k])
        print(f"{k:>5}  {statistics.median(int(log['version']) for log in runs_):>6.0f}  "
              f"{statistics.median(float(log['staleness_mean']) for log in runs_):>9.2f}  "
              f"{statistics.median(log['images_per_s'] for log in runs_):>8.0f}  "
              f"{100 * statistics.median(float(log['test_accuracy']) for log in runs_):>7.2f}%  "
              f"{seconds(med):>17}  {ratio:>9.2f}  {reached:>4}/{len(runs_)}  "
              f"{', '.join(seconds(t) for t in times[k])}")
    trainer.print_commands()
    return 0


def seconds(t: float) -> str:
    return f"{t:.2f}" if math.isfinite(t) else "-"


if __name__ == "__main__":
    sys.exit(main())
