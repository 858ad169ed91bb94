#!/usr/bin/env python3
"""How far does the speed-up go? GPU A-SGD's experiment (Paine et al. 2013, arXiv 1312.6186: the number of
clients, nsync, cold and warm start) at the scale it asks for, with `mpiasgd simulate`: time to a target
test accuracy and the speed-up over one worker, for N = 1, 2, 4, ..., 32 workers, nsync = 1, 10, 100, cold
and warm start. One markdown table, one plot, every command.

    python bench/simulate_speedup.py                                 # cifar10, the H200 profile, 33 simulations
    python bench/simulate_speedup.py --workers 1,2,4 --nsync 1 --starts cold --model digits --target-accuracy 0.6 \\
        --epochs 3 --eval-interval 0.5ep --lr 0.05                  # ~1 min check of the script

Each simulation is `python -m mpiasgd simulate --workers N --profile PROFILE --nsync K [--warm-start S]
--stop-accuracy T --eval-interval I --epochs E --lr LR(N) OPTIONS`: real gradients of the real network
on the real shards, the real parameter server, on a virtual clock from the profile (default
bench/profiles/h200-cifar10.json: an H200 per worker, its compute measured, see its note). The run stops at the
first evaluation (every `--eval-interval`, default 0.25 epochs) that reaches `--target-accuracy`
(default 0.60), or after `--epochs` (10; the cosine schedule spans them). The evaluations cost no
virtual time (`--eval-s-per-image 0`, as snapshots evaluated after a run: the workers do not pause).
Time to target = the virtual seconds of training at the weights of that evaluation; speed-up = the
time of one worker with nsync 1 (plain SGD on one GPU) over it. The warm start (GPU A-SGD's) lets
worker 1 train alone for `--warm-start` virtual seconds
(default: half an epoch of one worker under the profile) before the others get weights; N = 1 has none.
The step size follows the README's rule for asynchronous workers (`--lr-rule halve`: `--lr` up to 2
workers, halved each time N doubles after that), with `--async-momentum workers` at nsync 1 (with
nsync > 1 the server adds updates without momentum, and the workers keep theirs).

Every command is read up front as `mpiasgd simulate` reads it, so a bad value stops the script (one line,
exit status 2) before anything runs. `--options` (more `mpiasgd simulate` flags for every simulation, e.g.
`--momentum 0.0 --seed 7`) may not give a flag the script sets itself (--workers, --lr, --nsync, --threads, ...:
the row would not be what the table says); use this script's flag instead. `--reuse` takes a complete log of
a simulation's name in RUN_DIR only if it holds that very simulation: the config the command resolves to
(--options included; keys of bookkeeping and speed aside, see NOT_COMPARED), the number of workers and the
timing model; a log of other settings stops the script naming the keys that differ (and a directory of its
name), a log that cannot be read is moved to NAME.h5.unreadable and simulated again. Times in the table have
3 significant digits, speed-ups 2 decimals.

Cost: each simulation computes every gradient for real, on this machine's CPU, whatever N: for cifar10
0.075 to 0.12 s per minibatch of 64 on one core (1 to 1.5 min per simulated epoch), and about 10 s per
evaluation of the 10,000 test images. `--jobs` (default 2) simulations run at once, each
with one BLAS thread. Every command has a time limit (`--timeout`); a failed one is printed and marked in
the table, the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from launch import Finished, add_run_arguments, distinct_ints, run, run_dir

from mpiasgd.argtypes import fraction
from mpiasgd.config import FIELDS, ConfigError
from mpiasgd.runlog.reader import load
from mpiasgd.runlog.summary import final_eval
from mpiasgd.sim import ProfileError, load_profile
from mpiasgd.tools.report import time_to_accuracy

HERE = Path(__file__).resolve().parent
NUM_TRAIN = {"cifar10": 50_000, "digits": 1_437}  # training images of the built-in sets (the warm-start default)
PROG = "simulate_speedup.py"

# `mpiasgd simulate` options every simulation gets from this script, by their argparse dest: --options may not
# give them (else a row would silently not be what the table says). The value: this script's flag to use
# instead, or what the script sets the option to.
SET_HERE = {"workers": "use this script's --workers", "profile": "use this script's --profile",
            "model": "use this script's --model", "nsync": "use this script's --nsync",
            "epochs": "use this script's --epochs", "eval_interval": "use this script's --eval-interval",
            "stop_accuracy": "use this script's --target-accuracy", "batch_size": "use this script's --batch-size",
            "run_dir": "use this script's --run-dir", "lr": "use this script's --lr and --lr-rule",
            "warm_start": "use this script's --warm-start and --starts",
            "async_momentum": "the script sets 'workers' at nsync 1 and leaves the default otherwise",
            "threads": "the script sets 1 (one BLAS thread per simulation; --jobs of them at once)",
            "snapshot_interval": "the script sets 0 (no snapshots)", "progress": "the script sets --no-progress",
            "eval_s_per_image": "the script sets 0 (evaluations cost no virtual time)",
            "name": "the script names each log n{N}-nsync{K}-{cold|warm}", "overwrite": "the script sets it"}

# Config keys --reuse does not compare: they do not change what a simulation computes, only where and how its log
# is written or how fast it runs. Bookkeeping of the log: name and run_dir (the log's path, checked by its file
# name), overwrite, progress and show_config (printing), flush_interval (real-time flushes),
# tensorboard (a copy of the metrics), snapshot_interval and checkpoint_interval (saved weights; neither feeds
# the table's evaluations nor changes training), eval_batch_size (images per forward pass of an evaluation).
# Speed only: threads (BLAS threads), prefetch and data_in_memory (data loading; the simulator reads every
# minibatch when it is computed), data_dir (where the built-in datasets are kept, not which). Not used by the
# simulator: backend, cuda_aware, conv_algo, share_devices (it always computes on the numpy backend; the timing
# model stands for the devices), comm_timeout and stall_warning (real-time watchdogs; its messages are virtual).
NOT_COMPARED = ("name", "run_dir", "overwrite", "progress", "show_config", "flush_interval", "tensorboard",
                "snapshot_interval", "checkpoint_interval", "eval_batch_size", "threads", "prefetch",
                "data_in_memory", "data_dir", "backend", "cuda_aware", "conv_algo", "share_devices",
                "comm_timeout", "stall_warning")
# The timing model's figures compared with the log's attribute `simulated` (eval_s_per_image: this script sets
# it; batch_size and note: labels of the profile)
TIMING_KEYS = ("compute", "workers", "latency_s", "bandwidth", "server_s")


def ints(text: str) -> list[int]:
    """argparse type: comma-separated distinct integers >= 1, at least one."""
    return distinct_ints(text, 1)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def starts(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("cold", "warm") for v in values):
        raise argparse.ArgumentTypeError(f"expected cold and/or warm, got {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected cold and/or warm, each once, got {text!r}")
    return values


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--profile", default=str(HERE / "profiles" / "h200-cifar10.json"), help="timing profile")
    parser.add_argument("--model", default="cifar10", help="network and dataset")
    parser.add_argument("--workers", type=ints, default=ints("1,2,4,8,16,32"), help="N, comma-separated")
    parser.add_argument("--nsync", type=ints, default=ints("1,10,100"), help="nsync values, comma-separated")
    parser.add_argument("--starts", type=starts, default=starts("cold,warm"), help="cold and/or warm")
    parser.add_argument("--warm-start", type=float, default=None, help="virtual seconds worker 1 trains alone "
                        "(default: half an epoch of one worker under the profile)")
    parser.add_argument("--target-accuracy", type=fraction, default=0.60, metavar="FRACTION",
                        help="test top-1 accuracy the time is measured to")
    parser.add_argument("--epochs", type=float, default=10.0, help="the limit of a run that never reaches it")
    parser.add_argument("--eval-interval", default="0.25ep", help="evaluations during training")
    parser.add_argument("--batch-size", type=positive, default=64, help="minibatch per worker")
    parser.add_argument("--lr", type=float, default=0.02, help="step size (of N <= 2 workers under --lr-rule halve)")
    parser.add_argument("--lr-rule", choices=("fixed", "halve"), default="halve",
                        help="fixed: --lr at every N; halve: --lr x min(1, 2/N), the README's rule for async")
    parser.add_argument("--options", default="", help="more `mpiasgd simulate` options for every simulation, as "
                        "--options='--momentum 0.0 --seed 7' (not those this script sets: --workers, --lr, ...)")
    parser.add_argument("--jobs", type=positive, default=2, help="simulations at once")
    parser.add_argument("--reuse", action="store_true",
                        help="take a simulation whose log in RUN_DIR is complete and of the same settings instead of "
                        "running it again (a table built over several invocations, or extended)")
    parser.add_argument("--plot", default=None, help="PNG of the speed-ups (default RUN_DIR/speedup.png)")
    add_run_arguments(parser, "speedup")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked up front (one line and exit status 2 for a bad one): the profile, --options (nothing
    the script sets itself), RUN_DIR and the plot's folder writable."""
    args = parser.parse_args(argv)
    args.run_dir = run_dir(args, "speedup")
    try:
        args.timing = load_profile(args.profile)  # read once: the warm start and the table's heading use it
    except ProfileError as e:
        parser.error(f"--profile: {e}")
    args.extra = option_list(parser, args.options)
    try:
        os.makedirs(args.run_dir, exist_ok=True)
    except OSError as e:
        parser.error(f"--run-dir '{args.run_dir}': cannot create the folder ({e.strerror})")
    writable(parser, "--run-dir", args.run_dir)
    if args.plot is not None:
        folder = os.path.dirname(os.path.abspath(args.plot))
        if os.path.isdir(args.plot):
            parser.error(f"--plot '{args.plot}' is a directory, expected a PNG file name")
        if not os.path.isdir(folder):
            parser.error(f"--plot '{args.plot}': folder '{folder}' does not exist")
        writable(parser, "--plot", folder)
        from matplotlib.backend_bases import FigureCanvasBase

        kind = os.path.splitext(args.plot)[1].lstrip(".").lower() or "png"
        if kind not in FigureCanvasBase.get_supported_filetypes():
            parser.error(f"--plot '{args.plot}': expected a file name ending in .png (or another image format of "
                         f"matplotlib: {', '.join(sorted(FigureCanvasBase.get_supported_filetypes()))})")
    return args


def writable(parser: argparse.ArgumentParser, flag: str, folder: str) -> None:
    """parser.error unless a file can be created in `folder` (tried, not judged from the mode bits)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        parser.error(f"{flag}: cannot write in folder '{folder}' ({e.strerror or e})")


def option_list(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """--options split as a shell does, read by `mpiasgd simulate`'s own parser; parser.error for one it does not
    know, and for one this script sets itself (SET_HERE) in any form (--flag value, --flag=value, a prefix)."""
    from mpiasgd.sim.cli import make_parser as simulate_parser

    try:
        tokens = shlex.split(text)
    except ValueError as e:
        parser.error(f"--options {text!r}: {e}")
    for token in tokens:
        if token == "-h" or (len(token) > 2 and "--help".startswith(token)):
            parser.error(f"--options: {token} (help) is not an option of a simulation; see python -m mpiasgd "
                         "simulate --help")
    try:
        given = simulate_parser().parse_args(tokens)
    except ConfigError as e:
        parser.error(f"--options {text!r}: {str(e).removeprefix('mpiasgd simulate: ')}")
    for dest, instead in SET_HERE.items():
        if getattr(given, dest, None) is not None:
            flag = "--progress/--no-progress" if dest == "progress" else "--" + dest.replace("_", "-")
            parser.error(f"--options: {flag} is set by this script for every simulation ({instead})")
    return tokens


def warm_seconds(args: argparse.Namespace) -> float:
    """Half an epoch of one worker under the profile: minibatches x (compute + server + 2 latencies)."""
    if args.warm_start is not None:
        return args.warm_start
    timing = args.timing
    step = timing.compute.mean + timing.server_s + 2 * timing.transfer_s(0)
    return round(0.5 * NUM_TRAIN.get(args.model, 50_000) / args.batch_size * step, 6)


def step_size(args: argparse.Namespace, workers: int) -> float:
    """The step size of a simulation of `workers` workers under --lr-rule."""
    return args.lr * min(1.0, 2.0 / workers) if args.lr_rule == "halve" else args.lr


def simulations(args: argparse.Namespace, warm: float) -> list[tuple[tuple[int, int, str], list[str]]]:
    """((N, nsync, start), command) of every simulation of the sweep, in the table's order."""
    python = [sys.executable, "-m", "mpiasgd"]
    jobs = []
    for k in args.nsync:
        for n in args.workers:
            for start in args.starts:
                if start == "warm" and n == 1:
                    continue  # one worker has no one to warm up for
                if not round_fits(args, n, k):
                    continue  # refused by `simulate` (and `train`): marked in the table, not run
                cmd = [*python, "simulate", "--workers", str(n), "--profile", args.profile, "--model", args.model,
                       "--nsync", str(k), "--epochs", f"{args.epochs:g}", "--eval-interval", args.eval_interval,
                       "--stop-accuracy", f"{args.target_accuracy:g}", "--batch-size", str(args.batch_size),
                       "--threads", "1", "--snapshot-interval", "0", "--no-progress", "--run-dir", args.run_dir,
                       "--eval-s-per-image", "0",  # the evaluations cost no virtual time (as evaluated offline)
                       "--name", log_name(n, k, start), "--overwrite",
                       *(["--warm-start", f"{warm:g}"] if start == "warm" else []),
                       "--lr", f"{step_size(args, n):g}", *(["--async-momentum", "workers"] if k == 1 else []),
                       *args.extra]
                jobs.append(((n, k, start), cmd))
    return jobs


def round_fits(args: argparse.Namespace, n: int, k: int) -> bool:
    """False when one round of nsync `k` minibatches by each of `n` workers is longer than the run (`--epochs`
    of a built-in set's training images): `mpiasgd simulate` refuses it (mpiasgd.modes.base.round_fits)."""
    from mpiasgd.config import ConfigError
    from mpiasgd.modes.base import round_fits as fits

    if args.model not in NUM_TRAIN:
        return True  # a dataset file: `simulate` judges it
    try:
        fits(args, "nsync", k, n, NUM_TRAIN[args.model])
    except ConfigError:
        return False
    return True


def log_name(n: int, k: int, start: str) -> str:
    return f"n{n}-nsync{k}-{start}"


def settings(cmd: list[str]) -> tuple[Any, Any]:
    """(Config, TimingModel) of simulation command `cmd` (`python -m mpiasgd simulate ...`) as `mpiasgd
    simulate` resolves them; ConfigError (ProfileError) naming the bad value."""
    from mpiasgd.config import resolve
    from mpiasgd.sim.cli import make_parser as simulate_parser
    from mpiasgd.sim.cli import timing_from
    from mpiasgd.sim.engine import check_simulated

    given = simulate_parser().parse_args(cmd[cmd.index("simulate") + 1:])
    cfg = resolve(given)
    check_simulated(cfg, given.workers)
    return cfg, timing_from(given)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parse(parser, argv)
    warm = warm_seconds(args)
    jobs = simulations(args, warm)
    if not jobs:
        parser.error(f"no simulations: --workers {','.join(map(str, args.workers))} with --starts "
                     f"{','.join(args.starts)} (a warm start needs N >= 2)")
    planned = {}
    for key, cmd in jobs:  # every command as `mpiasgd simulate` reads it, before any runs
        try:
            planned[key] = settings(cmd)
        except ConfigError as e:
            parser.error(f"simulation {log_name(*key)}: {str(e).removeprefix('mpiasgd simulate: ')}")
    reused = set()
    if args.reuse:  # every log judged before any simulation runs (a log of other settings stops the script)
        for key, _ in jobs:
            log = os.path.join(args.run_dir, log_name(*key) + ".h5")
            cfg, timing = planned[key]
            if reusable(log, cfg, key[0], timing):
                reused.add(key)

    def one(job: tuple) -> tuple:
        key, cmd = job
        if key in reused:
            print(f"{key}: reused (its log is complete)", flush=True)
            return key, Finished(cmd, 0, 0.0, "", "")
        done = run(cmd, args.timeout)
        print(f"{key}: {f'{done.seconds:.0f} s' if done.ok else 'FAILED'}", flush=True)
        if not done.ok:
            print(done.explain(args.timeout), file=sys.stderr, flush=True)
        return key, done

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = dict(pool.map(one, jobs))
    rows = {}
    for (n, k, start), done in results.items():
        if not done.ok:
            rows[(n, k, start)] = None
            continue
        r = load(os.path.join(args.run_dir, log_name(n, k, start) + ".h5"))
        rows[(n, k, start)] = {"time": time_to_target(r, args.target_accuracy),
                               "accuracy": float(final_eval(r)["accuracy"]),
                               "staleness": float(r.get("staleness_mean", float("nan"))),
                               "epochs": float(r.get("epochs_done", float("nan")))}
    print(f"\n{len(jobs)} simulations in {time.monotonic() - t0:.0f} s of this machine\n")
    print(table(rows, args, warm))
    plot = args.plot or os.path.join(args.run_dir, "speedup.png")
    if draw(rows, args, plot):
        print(f"\nplot: {plot}")
    print("\nCommands (`python bench/simulate_speedup.py " + shlex.join(sys.argv[1:] if argv is None else argv)
          + "`):\n\n```bash\n" + "\n".join(shlex.join(cmd) for _, cmd in jobs) + "\n```")
    return 0 if all(done.ok for done in results.values()) else 1


def time_to_target(r: dict, target: float) -> float | None:
    """Virtual seconds of training to the first evaluation during training that reached `target`; failing
    that, the training time of the final weights if their evaluation did (the last evaluation during
    training comes before the run's end); None if neither did."""
    t = time_to_accuracy(r, target)
    final = final_eval(r)
    if t is None and final is not None and final["accuracy"] >= target:
        t = float(r["train_time_s"])
    return t


def reusable(log: str, cfg: Any, workers: int, timing: Any) -> bool:
    """--reuse: True if the run log `log` is complete and of the simulation this invocation would run: the same
    config (`cfg`, the command as `mpiasgd simulate` resolves it, --options included; every key but those in
    NOT_COMPARED; a key a log predates counts as its default), number of workers and timing model (TIMING_KEYS
    of `timing`). False if there is no such file, or if it is not a readable run log (one line says so; it is
    moved to LOG.unreadable and the simulation runs again). SystemExit naming the log and the keys (its value,
    the wanted value) when it holds another simulation, and for a directory of that name."""
    if not os.path.lexists(log):
        return False
    if os.path.isdir(log):
        sys.exit(f"{PROG}: --reuse: '{log}' is a directory, expected a run log file (or none); remove it or use "
                 "another --run-dir")
    try:
        r = load(log)
        logged, used = r["config"], json.loads(r.get("simulated") or "{}")
        if not isinstance(logged, dict) or not isinstance(used, dict):
            raise ValueError("its 'config' or 'simulated' attribute is not a JSON object")
    except Exception as e:  # a truncated, corrupt or foreign file (h5py raises many kinds): simulated again
        why = " ".join(str(e).split()) or type(e).__name__
        aside = log + ".unreadable"  # kept, and out of the way: `mpiasgd simulate` can hang on a truncated log
        try:
            os.replace(log, aside)
        except OSError as moving:
            sys.exit(f"{PROG}: --reuse: run log '{log}' is unreadable ({why}) and cannot be moved aside "
                     f"({moving.strerror}); remove it")
        print(f"{PROG}: --reuse: run log '{log}' is unreadable ({why}); moved to '{aside}', the simulation runs "
              "again", flush=True)
        return False
    wanted = json.loads(cfg.to_json())
    differ = {}
    for key, value in wanted.items():
        have = logged.get(key, json.loads(json.dumps(FIELDS[key].default)) if key in FIELDS else None)
        if key not in NOT_COMPARED and have != value:
            differ[key] = (have, value)
    num_workers = r.get("num_workers")
    if num_workers is None or int(num_workers) != workers:
        differ["workers"] = (None if num_workers is None else int(num_workers), workers)
    given = json.loads(json.dumps(timing.to_dict()))
    for key in TIMING_KEYS:
        if used.get(key) != given.get(key):
            differ[f"timing {key}"] = (used.get(key), given.get(key))
    if differ:
        sys.exit(f"{PROG}: --reuse: run log '{log}' is of other settings {differ} (key: (the log's, wanted)); "
                 "remove it or use another --run-dir")
    return r.get("status") == "completed"


def baseline(rows: dict) -> float | None:
    base = rows.get((1, 1, "cold"))
    return base["time"] if base else None


def seconds3(t: float) -> str:
    """Seconds to 3 significant digits (0.0234, 4.00, 12.3), whole seconds from 100 on (1234, not 1.23e+03)."""
    return f"{t:.0f}" if t >= 99.95 else f"{t:#.3g}"


def table(rows: dict, args: argparse.Namespace, warm: float) -> str:
    target = f"{100 * args.target_accuracy:g} %"
    note = args.timing.note
    rule = (f"lr {args.lr:g} x min(1, 2/N)" if args.lr_rule == "halve" else f"lr {args.lr:g}")
    lines = [f"{args.model}, batch {args.batch_size} per worker, {rule}, `{args.options}`, profile `{args.profile}`"
             f"{' (' + note.split(':')[0] + ')' if note else ''}; warm start {warm:g} virtual s; "
             f"{time.strftime('%Y-%m-%d')}. Time to {target} test accuracy in virtual seconds (speed-up over one "
             f"worker, nsync 1), mean staleness, epochs trained to get there.", "",
             "| N | " + " | ".join(f"nsync {k} {s}" for k in args.nsync for s in args.starts) + " |",
             "|---:|" + "---:|" * (len(args.nsync) * len(args.starts))]
    base = baseline(rows)
    for n in args.workers:
        cells = []
        for k in args.nsync:
            for s in args.starts:
                if s == "warm" and n == 1:
                    cells.append("-")
                    continue
                row = rows.get((n, k, s))
                if not round_fits(args, n, k):
                    cells.append("- (one round is longer than the run)")
                elif row is None:
                    cells.append("failed")
                elif row["time"] is None:
                    cells.append(f"not reached ({100 * row['accuracy']:.1f} % after {row['epochs']:.1f} ep)")
                else:
                    speed = f" ({base / row['time']:.2f}x)" if base else ""
                    cells.append(f"{seconds3(row['time'])} s{speed}, s={row['staleness']:.1f}, {row['epochs']:.2f} ep")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(rows: dict, args: argparse.Namespace, path: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = baseline(rows)
    if not base:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in args.nsync:
        for s in args.starts:
            pts = [(n, base / rows[(n, k, s)]["time"]) for n in args.workers
                   if rows.get((n, k, s)) and rows[(n, k, s)]["time"]]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-" if s == "cold" else "s--", label=f"nsync {k}, {s}")
    ax.plot(args.workers, args.workers, ":", color="gray", label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("workers N")
    ax.set_ylabel(f"speed-up to {100 * args.target_accuracy:g} % (vs 1 worker)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    import mpi4py

    # no MPI in this process: reading the commands as `mpiasgd simulate` does imports mpi4py.MPI (for its
    # constants), which must not initialise MPI (as in mpiasgd/sim/cli.py)
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    sys.exit(main())
