#!/usr/bin/env python3
"""ResNet-20 on CIFAR-10: mpiasgd (`--mode sync`, one worker, numpy backend) against PyTorch (CPU) doing the
same work, then the test accuracy of both, their difference in points, and time per epoch side by side.

    python bench/resnet20_torch.py                                 # 10 epochs each: 2.5-5 h on 2 cores
    python bench/resnet20_torch.py --epochs 0.05 --subset 4        # a smoke run: 4 minibatches each, ~2 min
    python bench/resnet20_torch.py --skip-mpiasgd --json t.json    # PyTorch only

The same work, step for step:
    weights   mpiasgd's `init_params(seed)` and initial buffers, loaded into bench/torch_models.py's
              ResNet_cifar (FDG's/akamaster's) through `mpiasgd.model.export.torch_names`
    data      the minibatches and augmentation worker rank 1 of a 1-worker sync run draws:
              `MinibatchStream(dataset, ShardSampler(N, 1, 0, seed), batch, seed, stream=1)` (`sync_stream`)
    schedule  the sync worker's step size before each step: `learning_rate(schedule, epochs done,
              fraction_done(stop rule, ...))` (`sync_plan`), set on every param group each step
    optimizer torch.optim.SGD (momentum, dampening 0, --nesterov passed through), one param group per
              (decay_mult, lr_mult) of the model (resnet20: decay on every parameter, BatchNorm's too)
    layers    BatchNorm eps and momentum as ours; torch threads = cores (mpiasgd's one worker: the same)

mpiasgd runs as `mpiexec -n 2 python -m mpiasgd train --model resnet20 --mode sync --backend numpy ...`
(its command is printed at the end) into RUN_DIR/mpiasgd.h5 (default RUN_DIR runs/resnet20-torch-TIMESTAMP);
accuracy and timing come from its run log: test_accuracy (its workers evaluate all 10,000 test images),
train_time_s and samples. PyTorch's timing covers the same loop: drawing and augmenting the minibatch,
forward, backward, step. The runs go one after the other, never at once.

Timing on 2 CPU cores shared with other jobs (smoke runs of 4 and 12 steps, batch 128): a step takes
1-2 s on either side (fastest seen: mpiasgd numpy 0.93 s, PyTorch 1.0 s; steps of up to 25 s when other
jobs took the cores, and mpiasgd's first two steps take 6-20 s). 10 epochs are 3,907 steps: about 1.1-2.2 h
each, plus 1 min of start-up and evaluation for mpiasgd. The training losses agree step by step (4 steps:
within 7e-7; 12 steps: 6e-5), and so did the test accuracy after 12 steps.

--subset N stops both after N minibatches (mpiasgd's --max-pushes N: the cosine schedule then anneals
over those N steps, on both sides alike); the output says so: a check of the script, not a result.
Needs PyTorch (pip install -e ".[bench]") unless --skip-torch; mpiexec beside this Python or on PATH
unless --skip-mpiasgd. Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from launch import launcher, run, seconds
from trainrun import cores, epochs_type, nonnegative

from mpiasgd.argtypes import positive
from mpiasgd.data import MinibatchStream, ShardSampler, load_dataset
from mpiasgd.model import Model, build_model
from mpiasgd.model.layers import BatchNorm2d, walk
from mpiasgd.optim import Schedule, StopRule, fraction_done, learning_rate

MODEL = "resnet20"
WORKER_RANK = 1  # the one worker of `mpiexec -n 2`: rank 0 is the (logging) parameter server
GOAL_POINTS = 1.0  # mpiasgd's test accuracy within this many points of PyTorch's


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    work = parser.add_argument_group("workload (the same for both)")
    work.add_argument("--epochs", type=epochs_type, default=10.0, help="passes over the training set (fractions "
                      "allowed)")
    work.add_argument("--batch-size", type=positive, default=128, help="minibatch, images")
    work.add_argument("--lr", type=nonnegative, default=0.1, help="peak learning rate")
    work.add_argument("--momentum", type=nonnegative, default=0.9, help="SGD momentum (heavy ball unless --nesterov)")
    work.add_argument("--nesterov", action="store_true", help="Nesterov momentum (torch.optim.SGD's form, both)")
    work.add_argument("--weight-decay", type=nonnegative, default=5e-4,
                      help="L2 penalty (times each parameter's decay_mult; FDG's DG_parser.py: 5e-4)")
    work.add_argument("--warmup-epochs", type=nonnegative, default=0.0, help="linear warm-up from 0, epochs "
                      "(FDG: none)")
    work.add_argument("--lr-schedule", choices=("cosine", "step", "constant"), default="cosine",
                      help="after warm-up")
    work.add_argument("--lr-milestones", default="", metavar="E1,E2",
                      help="step schedule: epochs where lr is multiplied by 0.1")
    work.add_argument("--seed", type=int, default=0, help="initial weights, shard order and augmentation")
    work.add_argument("--data-dir", default=None, help="CIFAR-10 folder (None: $MPIASGD_DATA, else ~/.cache/mpiasgd)")
    work.add_argument("--subset", type=positive, default=None, metavar="N",
                      help="smoke run: stop both after N minibatches (mpiasgd --max-pushes N)")
    bench = parser.add_argument_group("benchmark")
    bench.add_argument("--skip-torch", action="store_true", help="run mpiasgd only")
    bench.add_argument("--skip-mpiasgd", action="store_true", help="run PyTorch only")
    bench.add_argument("--json", default=None, metavar="OUT", help="also write the results to this JSON file")
    bench.add_argument("--run-dir", default=None, help="folder of mpiasgd's run log (None: "
                       "runs/resnet20-torch-TIMESTAMP)")
    bench.add_argument("--timeout", type=seconds, default=86400.0, help="time limit of mpiasgd's run, seconds")
    args = parser.parse_args(argv)
    if args.skip_torch and args.skip_mpiasgd:
        parser.error("--skip-torch and --skip-mpiasgd together leave nothing to run")
    if args.nesterov and not args.momentum:
        parser.error("--nesterov needs --momentum > 0")
    try:
        args.lr_milestones = tuple(float(m) for m in args.lr_milestones.split(",") if m.strip())
    except ValueError:
        parser.error(f"--lr-milestones: expected comma-separated epochs, got {args.lr_milestones!r}")
    args.run_dir = args.run_dir or os.path.join("runs", f"resnet20-torch-{time.strftime('%Y%m%d-%H%M%S')}")
    return args


# --- the work both do ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """The steps of a 1-worker sync run: `lrs[k]` is the step size of step k (float, as the worker computes it)."""

    lrs: tuple[float, ...]
    batch_size: int
    num_train: int

    @property
    def steps(self) -> int:
        return len(self.lrs)

    @property
    def epochs(self) -> float:
        return self.steps * self.batch_size / self.num_train


def sync_plan(args: argparse.Namespace, num_train: int) -> Plan:
    """The step sizes of `mpiasgd train --mode sync` with one worker (mpiasgd/modes/sync.py `SyncWorker.train`):
    before step k (k applied before it), epochs done = k * B / num_train and lr = schedule(epochs done,
    fraction done by the stop rule); the run ends after the first step at which the rule (--epochs, and
    --max-pushes = --subset) is met. --max-time is not used, so the worker's clock plays no part."""
    schedule = Schedule(lr=args.lr, warmup_epochs=args.warmup_epochs, lr_schedule=args.lr_schedule,
                        lr_milestones=tuple(args.lr_milestones), lr_gamma=0.1)
    rule = StopRule(epochs=args.epochs, max_pushes=args.subset or 0, max_time=0.0)
    lrs, applied = [], 0
    while True:
        done = applied * args.batch_size / num_train
        lrs.append(learning_rate(schedule, done, fraction_done(rule, done, applied, 0.0)))
        applied += 1
        if rule.reason(applied * args.batch_size, num_train, applied, 0.0):
            return Plan(tuple(lrs), args.batch_size, num_train)


def sync_stream(dataset: Any, batch_size: int, seed: int) -> MinibatchStream:
    """The minibatches (augmented, normalised float32 (B, 3, 32, 32), int64 labels) that worker rank 1 of a
    1-worker sync run trains on, in order: the data-parallel layout gives it shard 0 of 1 (`Layout.
    data_parallel`, mpiasgd/launch/startup.py builds the ShardSampler from it) and `WorkerLoop` reads it
    through a MinibatchStream whose stream number is the worker's rank."""
    sampler = ShardSampler(dataset.train_y.size, 1, 0, seed)
    return MinibatchStream(dataset, sampler, batch_size, seed, WORKER_RANK)


def initial_state(model: Model, seed: int) -> dict[str, np.ndarray]:
    """{PyTorch state_dict key: float32 array} of mpiasgd's initial weights (`init_params(seed)`, what rank 0
    sends) and buffers (`init_buffers()`), through `torch_names`."""
    from mpiasgd.model.export import torch_names

    names = torch_names(model.spec())
    params, buffers = model.init_params(seed), model.init_buffers()
    state = {}
    for layout, flat in ((model.layout(), params), (model.buffer_layout(), buffers)):
        for name, offset, shape in layout:
            size = int(np.prod(shape))
            state[names[name]] = flat[offset:offset + size].reshape(shape).copy()
    return state


def param_groups(model: Model) -> dict[tuple[float, float], list[str]]:
    """{(decay_mult, lr_mult): [parameter names, in layout order]}: the optimizer's param groups. ValueError
    if a parameter's multipliers vary inside it (no torch param group can say that)."""
    decay, lr = model.decay_mult(), model.lr_mult()
    groups: dict[tuple[float, float], list[str]] = {}
    for name, offset, shape in model.layout():
        part = slice(offset, offset + int(np.prod(shape)))
        d, m = decay[part], lr[part]
        if (d != d[0]).any() or (m != m[0]).any():
            raise ValueError(f"parameter {name}: its decay or lr multipliers vary inside it")
        groups.setdefault((float(d[0]), float(m[0])), []).append(name)
    return groups


def batchnorm_settings(model: Model) -> tuple[float, float]:
    """(eps, momentum) of the model's BatchNorm layers; ValueError if they differ from layer to layer."""
    found = {(layer.eps, layer.momentum) for layer in walk(model.layers) if isinstance(layer, BatchNorm2d)}
    if len(found) != 1:
        raise ValueError(f"expected one BatchNorm (eps, momentum) in the model, found {sorted(found)}")
    return found.pop()


# --- the two runs -------------------------------------------------------------------------------------------


@dataclass
class Result:
    """One framework's run: final test accuracy (fraction), seconds of training, steps and images trained."""

    name: str
    test_accuracy: float
    train_time_s: float
    steps: int
    images: int
    num_train: int
    extra: dict = field(default_factory=dict)

    @property
    def s_per_epoch(self) -> float:
        return self.train_time_s * self.num_train / self.images

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.train_time_s / self.steps

    @property
    def images_per_s(self) -> float:
        return self.images / self.train_time_s

    def as_dict(self) -> dict:
        return {**asdict(self), "s_per_epoch": self.s_per_epoch, "ms_per_step": self.ms_per_step,
                "images_per_s": self.images_per_s}


def train_options(args: argparse.Namespace) -> list[str]:
    """`mpiasgd train` flags of the run (the launcher and `-n 2` excluded)."""
    optional = [*(["--data-dir", args.data_dir] if args.data_dir else []),
                *(["--max-pushes", str(args.subset)] if args.subset else []),
                *(["--nesterov"] if args.nesterov else []),
                *(["--lr-milestones", ",".join(f"{m:g}" for m in args.lr_milestones)] if args.lr_milestones else [])]
    return ["--model", MODEL, "--mode", "sync", "--backend", "numpy", "--epochs", f"{args.epochs:g}",
            "--batch-size", str(args.batch_size), "--lr", f"{args.lr:g}", "--momentum", f"{args.momentum:g}",
            "--weight-decay", f"{args.weight_decay:g}", "--warmup-epochs", f"{args.warmup_epochs:g}",
            "--lr-schedule", args.lr_schedule, "--seed", str(args.seed), *optional,
            "--snapshot-interval", "0", "--checkpoint-interval", "0", "--no-progress",
            "--run-dir", args.run_dir, "--name", "mpiasgd"]


def run_mpiasgd(args: argparse.Namespace, plan: Plan, commands: list[list[str]]) -> Result | None:
    """Train with mpiasgd through its CLI; the result from its run log (None after printing why it failed)."""
    from mpiasgd.runlog import load

    cmd = [*launcher(), "-n", "2", sys.executable, "-m", "mpiasgd", "train", *train_options(args)]
    commands.append(cmd)
    print(f"mpiasgd: training {plan.steps} steps ...", end=" ", flush=True)
    done = run(cmd, args.timeout)
    print(f"{done.seconds:.0f} s" if done.ok else "FAILED", flush=True)
    if not done.ok:
        print(done.explain(args.timeout), file=sys.stderr, flush=True)
        return None
    path = os.path.join(args.run_dir, "mpiasgd.h5")
    log = load(path)
    if log.get("status") != "completed":
        print(f"{sys.argv[0]}: run log {path} has status {log.get('status')!r}, expected 'completed'", file=sys.stderr)
        return None
    steps = int(log["version"])
    if steps != plan.steps:
        print(f"warning: mpiasgd took {steps} steps, the plan for PyTorch has {plan.steps}", file=sys.stderr)
    pushes = log["pushes"]
    applied = pushes[pushes["applied"] == 1]
    applied = applied[np.argsort(applied["step"], kind="stable")]
    return Result("mpiasgd", float(log["test_accuracy"]), float(log["train_time_s"]), steps, int(log["samples"]),
                  int(log.get("num_train") or plan.num_train),
                  {"log": path, "compute_ms_per_step": 1e3 * float(applied["compute_s"].mean()),
                   "wall_time_s": float(log["wall_time_s"]), "losses": applied["loss"].astype(float).tolist()})


def run_torch(args: argparse.Namespace, dataset: Any, plan: Plan) -> Result:
    """Train the reference PyTorch ResNet-20 on the same work (see the module docstring) and evaluate it on
    the whole test set in evaluation mode (running statistics)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch_models import reference  # bench/torch_models.py

    threads = cores()
    torch.set_num_threads(threads)
    model = build_model(MODEL)
    net = reference(model.spec())
    state = {key: torch.from_numpy(value) for key, value in initial_state(model, args.seed).items()}
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or any(not key.endswith("num_batches_tracked") for key in missing):
        raise RuntimeError(f"PyTorch's ResNet-20 does not take mpiasgd's names: unexpected {unexpected}, "
                           f"missing {missing}")
    eps, momentum = batchnorm_settings(model)
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eps, module.momentum = eps, momentum
    by_name = dict(net.named_parameters())
    from mpiasgd.model.export import torch_names

    names = torch_names(model.spec())
    groups = [{"params": [by_name[names[n]] for n in members], "weight_decay": args.weight_decay * decay,
               "lr_mult": lr_mult} for (decay, lr_mult), members in param_groups(model).items()]
    optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, dampening=0.0, nesterov=args.nesterov)
    stream = sync_stream(dataset, args.batch_size, args.seed)
    net.train()
    every = max(1, plan.steps // 10)
    print(f"PyTorch {torch.__version__}: training {plan.steps} steps on {threads} threads ...", flush=True)
    losses = []
    start = time.perf_counter()
    for k, lr in enumerate(plan.lrs):
        x, y, _ = stream.next()  # (B, 3, 32, 32) float32, (B,) int64
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_mult"]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if (k + 1) % every == 0 or k + 1 == plan.steps:
            print(f"    step {k + 1}/{plan.steps}: loss {np.mean(losses[-every:]):.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    train_s = time.perf_counter() - start
    net.eval()
    correct = 0
    with torch.no_grad():
        for first in range(0, dataset.test_y.size, 1000):
            x, y = dataset.batch("test", np.arange(first, min(first + 1000, dataset.test_y.size)))
            correct += int((net(torch.from_numpy(x)).argmax(1).numpy() == y).sum())
    return Result("PyTorch", correct / dataset.test_y.size, train_s, plan.steps, plan.steps * args.batch_size,
                  plan.num_train, {"version": torch.__version__, "threads": threads, "losses": losses})


# --- output -------------------------------------------------------------------------------------------------


def verdict(ours: Result | None, ref: Result | None) -> tuple[float | None, str]:
    """(mpiasgd's accuracy minus PyTorch's in points, None without both; the goal line)."""
    goal = f"mpiasgd within {GOAL_POINTS:g} point of PyTorch"
    if ours is None or ref is None:
        return None, f"{goal}: not assessed (only one of the two ran)"
    diff = 100 * (ours.test_accuracy - ref.test_accuracy)
    return diff, f"{goal}: {'yes' if abs(diff) <= GOAL_POINTS else 'no'} ({diff:+.2f} points)"


def loss_line(ours: list[float], ref: list[float]) -> str:
    """How far apart the two runs' training losses are, step by step (the minibatch losses before each update:
    the same work gives the same losses up to float32 rounding, which grows as the runs go on)."""
    n = min(len(ours), len(ref))
    if n == 0:
        return "training loss per step: no steps to compare"
    diff = np.abs(np.asarray(ours[:n]) - np.asarray(ref[:n]))
    worst = int(np.argmax(diff))
    first = min(n, 10)
    return (f"training loss per step, |mpiasgd - PyTorch| over {n} steps: max {diff.max():.2e} (step {worst + 1}: "
            f"{ours[worst]:.5f} vs {ref[worst]:.5f}), steps 1-{first} max {diff[:first].max():.2e}, last "
            f"{diff[-1]:.2e}" + ("" if len(ours) == len(ref) else f" (steps: mpiasgd {len(ours)}, PyTorch {len(ref)})"))


def table_lines(results: list[Result]) -> list[str]:
    """A markdown table: framework, test accuracy, s per epoch, ms per step, images/s, time ratio to the first."""
    lines = ["| run | test accuracy | s per epoch | ms per step | images/s | time / first |",
             "| :-- | ------------: | ----------: | ----------: | -------: | -----------: |"]
    for r in results:
        lines.append(f"| {r.name} | {100 * r.test_accuracy:.2f}% | {r.s_per_epoch:,.0f} | {r.ms_per_step:,.0f} | "
                     f"{r.images_per_s:,.1f} | {r.s_per_epoch / results[0].s_per_epoch:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    dataset = load_dataset("cifar10", args.data_dir)  # DataError naming the folder without CIFAR-10
    plan = sync_plan(args, dataset.train_y.size)
    subset = (f"SUBSET: {plan.steps} minibatches only ({plan.epochs:.3f} epochs), not {args.epochs:g} epochs: a "
              f"smoke run, its accuracies say nothing" if args.subset else "")
    if subset:
        print(subset, flush=True)
    commands: list[list[str]] = []
    ours = None if args.skip_mpiasgd else run_mpiasgd(args, plan, commands)
    if not args.skip_mpiasgd and ours is None:
        return 1
    ref = None if args.skip_torch else run_torch(args, dataset, plan)
    results = [r for r in (ours, ref) if r is not None]
    diff, goal = verdict(ours, ref)
    print(f"\nResNet-20 on CIFAR-10, {plan.steps} steps of {args.batch_size} images ({plan.epochs:.3g} epochs), lr "
          f"{args.lr:g} {args.lr_schedule}, warm-up {args.warmup_epochs:g} epochs, momentum {args.momentum:g}"
          f"{' nesterov' if args.nesterov else ''}, weight decay {args.weight_decay:g}, seed {args.seed}; mpiasgd "
          f"sync 1 worker numpy, PyTorch CPU; {cores()} cores, {time.strftime('%Y-%m-%d')}."
          + (f"\n{subset}." if subset else "") + "\n")
    print("\n".join(table_lines(results)))
    if ours is not None:
        print(f"\nmpiasgd: {ours.extra['compute_ms_per_step']:,.0f} ms per step of forward + backward (pushes table "
              f"compute_s), run log {ours.extra['log']}")
    if diff is not None:
        print(loss_line(ours.extra["losses"], ref.extra["losses"]))
        print(f"test accuracy mpiasgd - PyTorch: {diff:+.2f} points; time per epoch mpiasgd / PyTorch: "
              f"{ours.s_per_epoch / ref.s_per_epoch:.2f}")
    print(goal)
    if commands:
        print("\nCommands (`python bench/resnet20_torch.py " + shlex.join(sys.argv[1:] if argv is None else argv)
              + "`):\n\n```bash\n" + "\n".join(shlex.join(cmd) for cmd in commands) + "\n```")
    if args.json:
        out = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "subset": bool(args.subset),
               "steps": plan.steps, "epochs": plan.epochs, "cores": cores(), "date": time.strftime("%Y-%m-%d"),
               "results": {r.name: r.as_dict() for r in results}, "difference_points": diff, "verdict": goal,
               "commands": [shlex.join(cmd) for cmd in commands]}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
