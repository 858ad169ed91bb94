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
bench/profiles/h200-cifar10.json: an H200 per worker, estimated, see its note). The run stops at the
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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from launch import Finished, add_run_arguments, run, run_dir

from mpiasgd.cli import fraction
from mpiasgd.runlog.reader import load
from mpiasgd.runlog.summary import final_eval
from mpiasgd.sim import load_profile
from mpiasgd.tools.report import time_to_accuracy

HERE = Path(__file__).resolve().parent
NUM_TRAIN = {"cifar10": 50_000, "digits": 1_437}  # training images of the built-in sets (the warm-start default)


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def starts(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("cold", "warm") for v in values):
        raise argparse.ArgumentTypeError(f"expected cold and/or warm, got {text!r}")
    return values


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
    parser.add_argument("--batch-size", type=int, default=64, help="minibatch per worker")
    parser.add_argument("--lr", type=float, default=0.02, help="step size (of N <= 2 workers under --lr-rule halve)")
    parser.add_argument("--lr-rule", choices=("fixed", "halve"), default="halve",
                        help="fixed: --lr at every N; halve: --lr x min(1, 2/N), the README's rule for async")
    parser.add_argument("--options", default="", help="more `train` options for every simulation")
    parser.add_argument("--jobs", type=int, default=2, help="simulations at once")
    parser.add_argument("--reuse", action="store_true",
                        help="take a simulation whose log in RUN_DIR is complete and of the same settings instead of "
                        "running it again (a table built over several invocations, or extended)")
    parser.add_argument("--plot", default=None, help="PNG of the speed-ups (default RUN_DIR/speedup.png)")
    add_run_arguments(parser, "speedup")
    args = parser.parse_args(argv)
    args.run_dir = run_dir(args, "speedup")
    return args


def warm_seconds(args: argparse.Namespace) -> float:
    """Half an epoch of one worker under the profile: minibatches x (compute + server + 2 latencies)."""
    if args.warm_start is not None:
        return args.warm_start
    timing = load_profile(args.profile)
    step = timing.compute.mean + timing.server_s + 2 * timing.transfer_s(0)
    return round(0.5 * NUM_TRAIN.get(args.model, 50_000) / args.batch_size * step, 6)


def step_size(args: argparse.Namespace, workers: int) -> float:
    """The step size of a simulation of `workers` workers under --lr-rule."""
    return args.lr * min(1.0, 2.0 / workers) if args.lr_rule == "halve" else args.lr


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.makedirs(args.run_dir, exist_ok=True)
    warm = warm_seconds(args)
    python = [sys.executable, "-m", "mpiasgd"]
    jobs = []
    for k in args.nsync:
        for n in args.workers:
            for start in args.starts:
                if start == "warm" and n == 1:
                    continue  # one worker has no one to warm up for
                name = f"n{n}-nsync{k}-{start}"
                cmd = [*python, "simulate", "--workers", str(n), "--profile", args.profile, "--model", args.model,
                       "--nsync", str(k), "--epochs", f"{args.epochs:g}", "--eval-interval", args.eval_interval,
                       "--stop-accuracy", f"{args.target_accuracy:g}", "--batch-size", str(args.batch_size),
                       "--threads", "1", "--snapshot-interval", "0", "--no-progress", "--run-dir", args.run_dir,
                       "--eval-s-per-image", "0",  # the evaluations cost no virtual time (as evaluated offline)
                       "--name", name, "--overwrite", *(["--warm-start", f"{warm:g}"] if start == "warm" else []),
                       "--lr", f"{step_size(args, n):g}", *(["--async-momentum", "workers"] if k == 1 else []),
                       *shlex.split(args.options)]
                jobs.append(((n, k, start), cmd))

    def one(job: tuple) -> tuple:
        key, cmd = job
        if args.reuse and reusable(args, *key, warm):
            print(f"{key}: reused (its log is complete)", flush=True)
            return key, Finished(cmd, 0, 0.0, "", "")
        done = run(cmd, args.timeout)
        print(f"{key}: {f'{done.seconds:.0f} s' if done.ok else 'FAILED'}", flush=True)
        if not done.ok:
            print(done.explain(args.timeout), file=sys.stderr, flush=True)
        return key, done

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = dict(pool.map(one, jobs))
    rows = {}
    for (n, k, start), done in results.items():
        if not done.ok:
            rows[(n, k, start)] = None
            continue
        r = load(os.path.join(args.run_dir, f"n{n}-nsync{k}-{start}.h5"))
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


def reusable(args: argparse.Namespace, n: int, k: int, start: str, warm: float) -> bool:
    """--reuse: the log of simulation (n, k, start) exists, completed, with the settings this invocation would
    give it (profile, model, nsync, workers, step size, epochs, target, evaluations, warm start); SystemExit
    naming the log when it holds another one."""
    log = os.path.join(args.run_dir, f"n{n}-nsync{k}-{start}.h5")
    if not os.path.exists(log):
        return False
    r = load(log)
    cfg = r["config"]
    def given(x: float) -> float:  # as the command line gives it
        return float(f"{x:g}")

    want = {"model": args.model, "nsync": k, "epochs": given(args.epochs), "batch_size": args.batch_size,
            "lr": given(step_size(args, n)), "stop_accuracy": given(args.target_accuracy),
            "eval_interval": args.eval_interval, "warm_start": given(warm) if start == "warm" else 0.0}
    differ = {key: (cfg.get(key), v) for key, v in want.items() if cfg.get(key) != v}
    if int(r.get("num_workers", -1)) != n:
        differ["workers"] = (r.get("num_workers"), n)
    timing = ("compute", "latency_s", "bandwidth", "server_s")  # the profile's (the script sets the evaluations')
    used, given = json.loads(r.get("simulated") or "{}"), json.loads(load_profile(args.profile).to_json())
    if any(used.get(key) != given.get(key) for key in timing):
        differ["profile"] = "another timing model"
    if differ:
        sys.exit(f"simulate_speedup.py: --reuse: run log '{log}' is of other settings ({differ}); remove it or use "
                 "another --run-dir")
    return r.get("status") == "completed"


def baseline(rows: dict) -> float | None:
    base = rows.get((1, 1, "cold"))
    return base["time"] if base else None


def table(rows: dict, args: argparse.Namespace, warm: float) -> str:
    target = f"{100 * args.target_accuracy:g} %"
    note = load_profile(args.profile).note
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
                if row is None:
                    cells.append("failed")
                elif row["time"] is None:
                    cells.append(f"not reached ({100 * row['accuracy']:.1f} % after {row['epochs']:.1f} ep)")
                else:
                    speed = f" ({base / row['time']:.2f}x)" if base else ""
                    cells.append(f"{row['time']:.2f} s{speed}, s={row['staleness']:.1f}, {row['epochs']:.2f} ep")
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
    sys.exit(main())
