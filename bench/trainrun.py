"""`mpiasgd train` runs for the benchmark scripts: the exact command, run under a time limit, its run
log read back (as `mpiasgd report` reads it), configurations measured in alternating rounds, the
workload fallback from CIFAR-10 to digits, and the command-line options the scripts share.

    from trainrun import Trainer, rounds, workload   # bench/ is on sys.path when a script in it is run

Used by bench/scaling.py, bench/straggler.py and bench/nsync.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from launch import launcher, run

from mpiasgd.argtypes import positive
from mpiasgd.runlog import load
from mpiasgd.tools.report import DEFAULT_TARGET, comparison_row


@dataclass
class Trainer:
    """Runs `mpiexec -n 1+WORKERS python -m mpiasgd train ...` into `run_dir`, each under `limit` seconds.

    Every command is kept in `commands`, in order, for the script to print. A command that fails,
    reaches its limit, or leaves a log whose status is not "completed" ends the calling script:
    the command, its output and its stderr go to stderr, and the exit status is 1.
    """

    run_dir: str
    limit: float  # seconds per command
    commands: list[list[str]] = field(default_factory=list)

    def train(self, workers: int, options: list[str], name: str) -> dict:
        """Train with 1 server + `workers` workers and `options` (train flags); returns the loaded log
        (`mpiasgd.runlog.load`: attributes, config, pushes, ...) with `images_per_s` added (images in
        applied pushes / training time, as in `mpiasgd report`)."""
        cmd = [*launcher(), "-n", str(1 + workers), sys.executable, "-m", "mpiasgd", "train", *options,
               "--no-progress", "--name", name, "--run-dir", self.run_dir]
        self.commands.append(cmd)
        done = run(cmd, self.limit)
        if not done.ok:
            sys.exit(f"{sys.argv[0]}: {done.explain(self.limit)}")
        path = os.path.join(self.run_dir, name + ".h5")
        log = load(path)
        if log.get("status") != "completed":
            sys.exit(f"{sys.argv[0]}: run log {path} has status {log.get('status')!r}, expected 'completed', after:\n"
                     f"  {shlex.join(cmd)}\n--- stderr ---\n{done.stderr}")
        log["images_per_s"] = comparison_row(log, DEFAULT_TARGET)["images_per_s"]
        return log

    def print_commands(self) -> None:
        print(f"\ncommands ({len(self.commands)}, as run):")
        print("\n".join("  " + shlex.join(cmd) for cmd in self.commands))


def compute_ms(logs: list[dict], worker: int | None = None) -> float:
    """Mean milliseconds of compute per push (pushes column `compute_s`: the minibatch gradients, and a
    straggler's sleep) over the applied pushes of `logs`, of `worker` only if given.

    Next to the same figure of a run with fewer workers, it shows whether the workers had a core
    each: workers that contend for cores (with each other or with other jobs) compute more slowly.
    The mean, not the median, because images/s goes with the mean time of a step."""
    values = []
    for log in logs:
        pushes = log["pushes"]
        mine = (pushes["applied"] == 1) & ((pushes["worker"] == worker) if worker is not None else True)
        values.append(pushes["compute_s"][mine])
    return 1e3 * float(np.concatenate(values).mean())


def rounds(configs: dict[str, Callable[[str], dict]], count: int, show: Callable[[int, str, dict], None]
           ) -> dict[str, list[dict]]:
    """Measure every configuration `count` times, in alternating rounds; returns {label: [log per round]}.

    `configs` maps a label to a function that makes one run given a run name. Rounds alternate in
    direction (A B C, C B A, A B C, ...), so a load that drifts during the benchmark weighs on every
    configuration alike. `show(round, label, log)` (round from 1) is called after each run.
    """
    logs: dict[str, list[dict]] = {label: [] for label in configs}
    order = list(configs)
    for r in range(count):
        for label in order if r % 2 == 0 else reversed(order):
            log = configs[label](f"{label}-r{r + 1}")
            logs[label].append(log)
            show(r + 1, label, log)
    return logs


BATCH = {"cifar10": 64, "digits": 32}  # default minibatch per worker of each benchmark workload, images


def workload(model: str, batch_size: int | None, data_dir: str | None) -> tuple[str, int]:
    """(model, batch size) of a benchmark: `model` with `batch_size` (None: the model's `BATCH`), except
    that cifar10 without its data (`data_dir`, $MPIASGD_DATA, ~/.cache/mpiasgd) falls back to digits
    with digits' batch, after printing a notice that says so."""
    if model == "cifar10":
        from mpiasgd.data import DataError, load_dataset

        try:
            load_dataset("cifar10", data_dir)
        except DataError as e:
            print(f"CIFAR-10 not found ({e}); measuring digits with batch {BATCH['digits']} instead", flush=True)
            return "digits", BATCH["digits"]
    return model, batch_size or BATCH[model]


def time_limited(model: str, batch_size: int, data_dir: str | None, seconds: float) -> list[str]:
    """The train options of a throughput run: `seconds` of training (no epoch limit), 1 BLAS thread per
    worker, no snapshots but the first and last."""
    return ["--model", model, *(["--data-dir", data_dir] if data_dir else []), "--epochs", "0",
            "--max-time", f"{seconds:g}", "--threads", "1", "--batch-size", str(batch_size), "--snapshot-interval", "0"]


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# --- command-line options shared by the scripts ---
def seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def nonnegative(text: str) -> float:
    """An argparse type: a number >= 0."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def epochs_type(text: str) -> float:
    """An argparse type: epochs > 0, fractions allowed."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected epochs > 0 (fractions allowed), got {text}")
    return value


def name_list(choices, allow_all: bool = False) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated distinct names from `choices`, in the order given (`allow_all`: or
    "all", every choice)."""
    def parse(text: str) -> list[str]:
        if allow_all and text.strip() == "all":
            return list(choices)
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names or len(set(names)) < len(names):
            raise argparse.ArgumentTypeError(f"expected distinct names from {', '.join(choices)}"
                                             f"{' (or all)' if allow_all else ''}, got {text!r}")
        return names

    return parse


def int_list(text: str) -> list[int]:
    """A comma-separated list of distinct integers >= 1, in the order given."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1 or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 1, got {text!r}")
    return values


def add_workload_arguments(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The group `title` with --model (cifar10 | digits), --batch-size and --data-dir; returns it."""
    work = parser.add_argument_group(title)
    work.add_argument("--model", default="cifar10", choices=("cifar10", "digits"),
                      help="network and dataset (default: cifar10; digits if CIFAR-10 is not found)")
    work.add_argument("--batch-size", type=positive, default=None,
                      help="minibatch per worker, images (default: 64 for cifar10, 32 for digits)")
    work.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: $MPIASGD_DATA or ~/.cache/mpiasgd)")
    return work


def add_benchmark_arguments(parser: argparse.ArgumentParser, rounds: int, run_seconds: float | None = None,
                            timeout: float | None = None) -> argparse._ArgumentGroup:
    """The group "benchmark": --seconds (training time of a run; only if `run_seconds` is given, its
    default), --rounds, --timeout (default `timeout`, else 3 x SECONDS + 180) and --run-dir; returns it."""
    bench = parser.add_argument_group("benchmark")
    if run_seconds is not None:
        bench.add_argument("--seconds", type=seconds, default=run_seconds,
                           help="training time of each run (default: %(default)g)")
    bench.add_argument("--rounds", type=positive, default=rounds,
                       help="runs of each configuration, alternating (default: %(default)d)")
    bench.add_argument("--timeout", type=seconds, default=timeout,
                       help="time limit of each command, seconds (default: "
                            + (f"{timeout:g})" if timeout else "3 x SECONDS + 180)"))
    bench.add_argument("--run-dir", default=None, help="keep the run logs here (default: a temporary folder)")
    return bench


def command_limit(args: argparse.Namespace) -> float:
    """Seconds each command may take: --timeout, else 3 x --seconds + 180 (start-up and evaluation)."""
    return args.timeout or 3 * args.seconds + 180
