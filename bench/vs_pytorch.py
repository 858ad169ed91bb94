#!/usr/bin/env python3
"""mpiasgd's CPU workers against PyTorch on the same work: one training step on one thread (`step`),
2-process training throughput against PyTorch DDP (`ddp`) and 2-process time to a test accuracy against
PyTorch DDP (`race`). The goals: mpiasgd at >= 0.9 of PyTorch's speed; its time to 65 % <= 1.1 x DDP's.

    python bench/vs_pytorch.py                                        # = step: cifar10 and resnet20, batch 64 and 128;
                                                                      #   ~3 min on 2 cores
    python bench/vs_pytorch.py step --rounds 1 --steps 2 --batches 64 # a smoke run, ~15 s
    python bench/vs_pytorch.py step --profile --json step.json        # + per-layer fprop/bprop tables, conv passes
    python bench/vs_pytorch.py ddp                                    # DDP vs mpiasgd sync and async, 200 steps each;
                                                                      #   ~4 min (CIFAR-10 needed)
    python bench/vs_pytorch.py ddp --steps 20 --warmup 5              # a smoke run, ~1 min
    python bench/vs_pytorch.py race                                   # time to 60/65/70 %, mpiasgd sync vs DDP, up
                                                                      #   to 10 epochs each; ~30-40 min on 2 cores
    python bench/vs_pytorch.py race --epochs 0.2 --eval-every 0.1 --targets 0.2,0.25 --no-stop   # smoke, ~1.5 min

`step` (the default) measures milliseconds per training step of one process on ONE thread
(OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = MKL_NUM_THREADS = 1 before numpy and torch load, and
torch.set_num_threads(1)), for each --models x --batches:

    mpiasgd  what a sync worker does per minibatch (mpiasgd/modes/sync.py): `Model.forward_backward(x, y)`
             (forward, softmax cross-entropy, backward into the flat gradient, BatchNorm statistics
             updated) and `LocalSGD.step(lr)` (the backend's `sgd_momentum` over the flat parameters),
             on each backend of --backends (default numpy, the reference, and cpu, what --backend auto
             runs without a GPU), each timed in every round against the same PyTorch steps
    PyTorch  bench/torch_models.py's reference network of the same spec: zero_grad(set_to_none=True),
             forward, F.cross_entropy, backward, torch.optim.SGD.step() (momentum, dampening 0), loss.item()

Both start from mpiasgd's `init_params(--seed)` and initial buffers (loaded into PyTorch through
`mpiasgd.model.export.torch_names`, as bench/resnet20_torch.py does), train on one fixed random batch
(float32 NCHW N(0, 1) images, uniform labels; the same arrays on both sides) in training mode, with lr
0.02, momentum 0.9, weight decay 5e-4 times each parameter's decay_mult (PyTorch: one param group per
multiplier) and BatchNorm's eps and momentum as ours. After --warmup steps each (default 2), --rounds
rounds (default 5) each time --steps steps (default 10) of mpiasgd, then of PyTorch. A round's figure is
its mean ms per step; the table gives the median over rounds per side and the ratio PyTorch ms / mpiasgd
ms of those medians (mpiasgd's speed as a fraction of PyTorch's; goal >= 0.9); its last column lists
every round's own ratio. The warm-up steps' losses of both sides are compared (the same
weights, batch and updates: equal up to float32 rounding) as a check that both do the same work; the
first is ln(classes) on both sides (the built-in classifiers start at zero), the second and later ones
depend on the updates.

--profile adds, per model and batch, --steps more steps of each side with timers (not the timed ones):
per top-level layer (a residual block is one) the forward and backward milliseconds, medians over the
steps. mpiasgd: each layer's `forward`/`backward` wrapped with perf_counter; PyTorch: forward pre/post
hooks and full backward pre/post hooks on the module of the same weights (a module whose input needs
no gradient, the first, ends its backward when `loss.backward()` returns: its post hook fires before
its weight gradient is computed). "loss" is the loss forward and its backward (PyTorch: from
`backward()` to the first module's backward pre hook); "other" is what the pass took outside the
listed layers (PyTorch's functional ReLU and average pooling of the ResNets land there: they have no
module). Then, for mpiasgd, every convolution's passes (`ops.conv2d_fprop/dgrad/wgrad`, `bias_grad`,
timed by wrapping the backend object's attributes while profiling) with their GFLOP/s (2 x multiply-adds
each pass).

`ddp` measures images/s of training by 2 processes of 1 thread each, --steps steps per worker (default
200), on the timed window after --warmup steps (default 20):

    PyTorch DDP    torch.multiprocessing.spawn of 2 processes, gloo, init_method file:// in a temporary
                   folder; each rank trains the reference network on exactly what mpiasgd's worker of
                   rank + 1 draws: `MinibatchStream(dataset, ShardSampler(N, 2, rank, seed), 64, seed,
                   rank + 1, prefetch=2)`, i.e. the data-parallel shard and the dataset's training
                   augmentation (CIFAR-10: pad-4 random crop and horizontal flip, normalised; a
                   background thread prepares 2 minibatches ahead, as a worker's --prefetch 2).
                   Window: barrier, steps warmup+1..steps (data included), barrier, on rank 0's clock.
    mpiasgd sync   mpiexec -n 3 python -m mpiasgd train --model cifar10 --mode sync --backend cpu
                   --threads 1 --max-pushes STEPS --epochs 0 ... (rank 0 logs, ranks 1-2 train)
    mpiasgd async  the same with --mode async --max-pushes 2 x STEPS (pushes applied by the server,
                   both workers together); rank 0 is the parameter server
    Window (mpiasgd): the applied rows of the run log's pushes table (one per worker and step) in time
                   order; the images of the rows after the first 2 x WARMUP over the time from that row
                   to the last (rank 0's receive times).

Both sides: batch 64 per worker, lr 0.02 constant (mpiasgd: --lr-schedule constant --warmup-epochs 0),
momentum 0.9, weight decay 5e-4 on weights only (cifar10's decay_mult: 0 on biases), the same initial
weights (`init_params(--seed)`). The mpiasgd runs also evaluate the test set at the end (outside the
window); their whole-run images/s (the run log's samples / train_time_s, as `mpiasgd report`) is shown
beside. Ratios sync/DDP and async/DDP of the window's images/s, goal >= 0.9. --rounds runs each
configuration that many times in alternating order (DDP, sync, async, then reversed); medians.
Needs CIFAR-10 (see the README's Data section; it exits 2 with one line saying how to get it).

`race` trains to a test accuracy, 2 workers x 1 thread, CIFAR-10's `cifar10` network, each side once
(DDP first): the time to each --targets accuracy (default 0.60,0.65,0.70) is the training time, evaluation
excluded, at the first evaluation at or above it. Both sides: batch 64 per worker (an update averages 128
images), lr 0.02 with a linear warm-up from 0 over 0.5 epochs, then cosine to 0 at --epochs (default 10),
momentum 0.9, weight decay 5e-4 on weights only, the same initial weights, shards and augmentation as
`ddp`; the whole test set (10,000 images: each process or worker half, the counts summed) is evaluated
every --eval-every epochs (default 0.25; at the first step at or past each multiple) and after the last
step. The step size of every update comes from mpiasgd itself: the DDP side takes the `Schedule` and
`StopRule` of mpiasgd's command as `mpiasgd.config.resolve` reads it (`race_setup`) and computes each
step's size with `mpiasgd.optim.learning_rate` as a sync worker does (`race_lr`: the epochs done before
the update; the first update's is 0), and decides its evaluations with mpiasgd's `EvalSchedule`.

    mpiasgd sync   mpiexec -n 3 python -m mpiasgd train --model cifar10 --mode sync --backend BACKEND
                   --threads 1 --batch-size 64 --lr 0.02 --lr-scaling none --lr-schedule cosine
                   --warmup-epochs 0.5 --epochs EPOCHS --eval-interval EVERYep [--stop-accuracy A] ...
                   Its clock does NOT pause for evaluations (README, "Evaluation during training": the
                   run's clock includes them), and a /periodic_evals row's `time` is rank 0's log clock when
                   the evaluated weights were taken (the REPORT of that step), `seconds` the slowest
                   evaluator's: the training time of evaluation k is its `time` less the `seconds` of
                   evaluations 1..k-1 (`mpiasgd_evals`); the final evaluation's is the last applied push's
                   time less all of them. images/s = images in applied pushes / that training time.
    PyTorch DDP    2 spawned processes, gloo, as `ddp` (`race_worker`); at each evaluation both ranks stop
                   the clock after a barrier, evaluate their half of the test set (eval mode, no_grad;
                   all_reduce of the correct counts and losses), and start it again after a barrier.
                   images/s = images trained on / training time.

By default each run stops at its first evaluation at or above the highest target (--stop-at A: at A;
mpiasgd: --stop-accuracy, after which its workers may take a step or two more and evaluate the final
weights; DDP stops at that evaluation); --no-stop trains all --epochs. The schedule's length stays
--epochs either way. The table gives per run the time to each target ('-' when not reached), the final
accuracy and images/s; then the evaluations side by side (the same steps on both sides: compare the
accuracies for the same-work check), the ratio mpiasgd time / DDP time at --ratio-at (default 0.65, or
the middle of --targets when 0.65 is not one; goal <= 1.1) and the commands. --run-dir keeps mpiasgd's
run log (default: a temporary folder). Needs CIFAR-10, as `ddp`.

Needs PyTorch (pip install -e '.[bench]'; exits 2 with one line otherwise) and, for `ddp` and `race`,
mpiexec beside this Python or on PATH. Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
`--json PATH` writes every number (per-step times, per-round figures, profiles, commands).
"""

from __future__ import annotations

import os
import sys

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
if __name__ == "__main__":  # one thread on both sides: before numpy (OpenBLAS) and torch (OpenMP) are loaded
    for _var in THREAD_VARS:
        os.environ[_var] = "1"

import argparse  # noqa: E402  (after the thread settings)
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from launch import launcher, run, seconds  # noqa: E402  (bench/ is on sys.path when a script in it is run)
from trainrun import int_list, name_list  # noqa: E402

from mpiasgd.argtypes import positive  # noqa: E402
from mpiasgd.model import MODELS, Model, build_model  # noqa: E402
from mpiasgd.model.layers import BatchNorm2d, Conv2d, walk  # noqa: E402
from mpiasgd.ops import BACKENDS  # noqa: E402
from mpiasgd.optim import LocalSGD  # noqa: E402

GOAL = 0.9  # mpiasgd's speed as a fraction of PyTorch's
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.9, 5e-4  # both subcommands, both sides
DDP_WORLD = 2  # processes (PyTorch) = workers (mpiasgd)
DDP_BATCH = 64  # images per worker and step
CONV_OPS = ("conv2d_fprop", "conv2d_dgrad", "conv2d_wgrad", "bias_grad")  # the backend ops --profile times
NEEDS_TORCH = "needs PyTorch: pip install -e '.[bench]'"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vs_pytorch.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{step,ddp,race}", help="step (the default) | ddp | race")
    step = sub.add_parser("step", help="one training step on one thread: ms per step, mpiasgd vs PyTorch",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    step.add_argument("--models", type=name_list(list(MODELS)), default=["cifar10", "resnet20"],
                      metavar="M1,M2", help="built-in networks, comma-separated")
    step.add_argument("--batches", type=int_list, default=[64, 128], metavar="B1,B2",
                      help="minibatch sizes, images, comma-separated")
    step.add_argument("--backends", type=name_list([b for b in BACKENDS if b != "cupy"]), default=["numpy", "cpu"],
                      metavar="B1,B2", help="mpiasgd ops backends, each timed in every round (numpy: the "
                      "reference; cpu: what --backend auto runs without a GPU)")
    step.add_argument("--rounds", type=positive, default=5, help="rounds of --steps steps each side, alternating")
    step.add_argument("--steps", type=positive, default=10, help="timed steps per side and round (and profiled "
                      "steps per side with --profile)")
    step.add_argument("--warmup", type=int, default=2, help="untimed steps per side before the rounds; their "
                      "losses are compared")
    step.add_argument("--profile", action="store_true", help="also time every layer's passes (separate steps)")
    step.add_argument("--seed", type=int, default=0, help="initial weights and the random batch")
    step.add_argument("--json", default=None, metavar="PATH", help="also write every number to this JSON file")
    ddp = sub.add_parser("ddp", help="2-process training: images/s, mpiasgd sync and async vs PyTorch DDP",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ddp.add_argument("--steps", type=positive, default=200, help="steps per worker, the warm-up included")
    ddp.add_argument("--warmup", type=int, default=20, help="steps per worker before the timed window")
    ddp.add_argument("--rounds", type=positive, default=1, help="runs of each configuration, alternating")
    ddp.add_argument("--modes", type=name_list(["sync", "async"]), default=["sync", "async"], metavar="M1,M2",
                     help="mpiasgd modes to run: sync, async")
    add_training_options(ddp, timeout=1800.0)
    race = add_race_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("step", "ddp", "race", "-h", "--help"):
        argv = ["step", *argv]  # step is the default subcommand
    args = parser.parse_args(argv)
    which = {"step": step, "ddp": ddp, "race": race}[args.command]
    least = 2 if args.command == "step" else 1  # step: the first warm-up loss is ln(classes) on both sides
    if args.command != "race" and args.warmup < least:
        which.error(f"--warmup: expected an integer >= {least}, got {args.warmup}"
                    + (" (the warm-up losses are the same-work check; the first is ln(classes) on both sides)"
                       if args.command == "step" else ""))
    if not 0 <= args.seed < 2**32:
        which.error(f"--seed: expected an integer from 0 to 2**32 - 1, got {args.seed}")
    if args.json:  # checked now, not after the whole benchmark
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            which.error(f"--json {args.json}: folder {folder} does not exist or is not writable")
    if args.command == "ddp" and args.warmup >= args.steps:
        ddp.error(f"--warmup {args.warmup} leaves no timed steps of --steps {args.steps}: use fewer")
    if args.command == "race":
        check_race(race, args)
    return args


def torch_or_exit() -> Any:
    """The torch module; without it one line on stderr and exit status 2."""
    try:
        import torch
    except ImportError:
        print(f"vs_pytorch.py: {NEEDS_TORCH}", file=sys.stderr)
        sys.exit(2)
    return torch


def median(values: list[float]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))


# --- the same work on both sides -----------------------------------------------------------------------------


def param_groups(model: Model) -> dict[tuple[float, float], list[str]]:
    """{(decay_mult, lr_mult): [parameter names]} (bench/resnet20_torch.py's: its ValueError if one varies
    inside a parameter)."""
    from resnet20_torch import param_groups as groups  # bench/resnet20_torch.py

    return groups(model)


def reference_net(model: Model, seed: int) -> Any:
    """bench/torch_models.py's network of `model`'s spec with mpiasgd's `init_params(seed)` and initial
    buffers, BatchNorm eps/momentum as ours, in training mode."""
    from resnet20_torch import batchnorm_settings, initial_state  # bench/resnet20_torch.py
    from torch import from_numpy, nn
    from torch_models import reference  # bench/torch_models.py (imports torch)

    net = reference(model.spec())
    state = {key: from_numpy(value) for key, value in initial_state(model, seed).items()}
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or any(not key.endswith("num_batches_tracked") for key in missing):
        raise RuntimeError(f"PyTorch's {model.name} does not take mpiasgd's names: unexpected {unexpected}, "
                           f"missing {missing}")
    if any(isinstance(layer, BatchNorm2d) for layer in walk(model.layers)):
        eps, momentum = batchnorm_settings(model)
        for module in net.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.eps, module.momentum = eps, momentum
    return net.train()


def torch_optimizer(model: Model, net: Any) -> Any:
    """torch.optim.SGD over `net` as `LocalSGD` over `model`: one param group per (decay_mult, lr_mult)."""
    import torch

    from mpiasgd.model.export import torch_names

    names, by_name = torch_names(model.spec()), dict(net.named_parameters())
    groups = [{"params": [by_name[names[n]] for n in members], "weight_decay": WEIGHT_DECAY * decay,
               "lr": LR * lr_mult} for (decay, lr_mult), members in param_groups(model).items()]
    return torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM, dampening=0.0)


@dataclass
class Ours:
    """mpiasgd's side of `step`: the bound model and its worker optimizer."""

    model: Model
    local: LocalSGD

    @classmethod
    def build(cls, name: str, backend: str | None, seed: int) -> Ours:
        model = build_model(name) if backend is None else build_model(name, backend)
        ops = model.ops
        model.bind(ops.asarray(model.init_params(seed)), ops.zeros(model.num_params), None)
        return cls(model, LocalSGD(model, MOMENTUM, WEIGHT_DECAY))

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One sync worker's step on (x, y): forward, loss, backward, the local SGD update; the loss."""
        loss, _ = self.model.forward_backward(x, y)
        self.local.step(LR)
        return float(loss)


@dataclass
class Theirs:
    """PyTorch's side of `step`: the reference network and its optimizer."""

    net: Any
    optimizer: Any
    cross_entropy: Any  # torch.nn.functional.cross_entropy

    @classmethod
    def build(cls, model: Model, seed: int) -> Theirs:
        import torch.nn.functional as F

        net = reference_net(model, seed)
        return cls(net, torch_optimizer(model, net), F.cross_entropy)

    def step(self, x: Any, y: Any) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.cross_entropy(self.net(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.item()


def random_batch(model: Model, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(x float32 (B, C, H, W) N(0, 1), y int64 (B,) uniform over the classes) from `seed`."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *model.input_shape), dtype=np.float32)
    return x, rng.integers(0, model.num_classes, batch, dtype=np.int64)


def timed(step: Callable[[Any, Any], float], x: Any, y: Any, count: int) -> list[float]:
    """Seconds of each of `count` calls step(x, y)."""
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        step(x, y)
        out.append(time.perf_counter() - t0)
    return out


# --- step: profiles ------------------------------------------------------------------------------------------


class OursProfile:
    """Timers around mpiasgd's layers (top level and nested), its loss and the backend's conv ops, installed
    as instance attributes (`install`) and taken off again (`remove`); `step` runs one profiled step and
    appends its seconds per key to `steps`: (layer, "fprop" | "bprop") with nested layers as "res1.conv1",
    (layer, op name) for CONV_OPS, ("loss" | "other" | "pass", "fprop" | "bprop"), ("update", "") and
    ("step", ""); `flops` holds 2 x multiply-adds of each conv layer's pass (each of the three)."""

    def __init__(self, ours: Ours) -> None:
        self.ours = ours
        self.stack: list[str] = []  # qualified names of the layers being run, innermost last
        self.now: dict[tuple[str, str], float] = {}  # this step's seconds per key
        self.marks: dict[str, float] = {}
        self.steps: list[dict[tuple[str, str], float]] = []
        self.flops: dict[str, int] = {}
        self.patched: list[tuple[Any, str]] = []
        self.top: list[str] = list(ours.model.names)
        self.convs: list[str] = []

    def _add(self, key: tuple[str, str], dt: float) -> None:
        self.now[key] = self.now.get(key, 0.0) + dt

    def _patch(self, obj: Any, attr: str, wrapper: Any) -> None:
        setattr(obj, attr, wrapper)  # an instance attribute: it shadows the class's method or staticmethod
        self.patched.append((obj, attr))

    def _layer(self, layer: Any, qname: str) -> None:
        for method, what in (("forward", "fprop"), ("backward", "bprop")):
            fn = getattr(layer, method)

            def wrapper(*a: Any, fn: Any = fn, key: tuple[str, str] = (qname, what), **k: Any) -> Any:
                self.stack.append(key[0])
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self._add(key, time.perf_counter() - t0)
                    self.stack.pop()

            self._patch(layer, method, wrapper)
        if isinstance(layer, Conv2d):
            self.convs.append(qname)
        named = layer.named_children() if hasattr(layer, "named_children") else \
            [(f"{child.kind}{i + 1}", child) for i, child in enumerate(layer.children())]
        for name, child in named:
            self._layer(child, f"{qname}.{name}")

    def _op(self, ops: Any, name: str) -> None:
        fn = getattr(ops, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            dt = time.perf_counter() - t0
            layer = self.stack[-1] if self.stack else "?"
            self._add((layer, name), dt)
            if name == "conv2d_fprop":  # 2 x (N K P Q) x (C R S): each of fprop, dgrad and wgrad
                self.flops[layer] = 2 * int(out.size) * int(np.prod(a[1].shape[1:]))
            return out

        self._patch(ops, name, wrapper)

    def _loss(self) -> None:
        loss = self.ours.model.loss
        # (the methods `Model.forward_backward` calls: the deferred forward, whose loss is read after backward)
        for method, what, mark in (("forward_deferred", "fprop", "loss_f0"), ("backward", "bprop", "loss_b1")):
            fn = getattr(loss, method)

            def wrapper(*a: Any, fn: Any = fn, what: str = what, mark: str = mark, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    t1 = time.perf_counter()
                    self._add(("loss", what), t1 - t0)
                    self.marks[mark] = t0 if mark == "loss_f0" else t1

            self._patch(loss, method, wrapper)

    def install(self) -> None:
        model = self.ours.model
        for name, layer in zip(model.names, model.layers, strict=True):
            self._layer(layer, name)
        self._loss()
        for name in CONV_OPS:
            self._op(model.ops, name)

    def remove(self) -> None:
        for obj, attr in reversed(self.patched):
            delattr(obj, attr)  # back to the class's own
        self.patched.clear()

    def step(self, x: np.ndarray, y: np.ndarray) -> None:
        self.now, self.marks = {}, {}
        t0 = time.perf_counter()
        self.ours.model.forward_backward(x, y)
        t1 = time.perf_counter()
        self.ours.local.step(LR)
        t2 = time.perf_counter()
        self._add(("update", ""), t2 - t1)
        self._add(("step", ""), t2 - t0)
        # the layers' passes: from the start to the loss, and from the loss's backward to the end
        for what, layers in (("fprop", self.marks["loss_f0"] - t0), ("bprop", t1 - self.marks["loss_b1"])):
            self._add(("other", what), layers - sum(self.now.get((name, what), 0.0) for name in self.top))
            self._add(("pass", what), layers + self.now[("loss", what)])
        self.steps.append(self.now)


class TorchProfile:
    """Hooks on the PyTorch modules that hold the weights of mpiasgd's top-level layers (`modules`: our
    layer name -> module path, None where PyTorch has no module); `step` runs one profiled step and keeps
    its seconds per key as `OursProfile` does (conv ops not split)."""

    def __init__(self, theirs: Theirs, modules: dict[str, str | None]) -> None:
        self.theirs, self.modules = theirs, modules
        self.handles: list[Any] = []
        self.start: dict[str, float] = {}
        self.needs_grad: dict[str, bool] = {}
        self.back_start: dict[str, float] = {}
        self.back_end: dict[str, float] = {}
        self.now: dict[tuple[str, str], float] = {}
        self.steps: list[dict[tuple[str, str], float]] = []

    def install(self) -> None:
        net = self.theirs.net
        for ours, path in self.modules.items():
            if path is None:
                continue
            module = net.get_submodule(path)

            def pre(_m: Any, inputs: Any, ours: str = ours) -> None:
                self.needs_grad[ours] = bool(inputs and getattr(inputs[0], "requires_grad", False))
                self.start[ours] = time.perf_counter()

            def post(_m: Any, _inputs: Any, _out: Any, ours: str = ours) -> None:
                self.now[(ours, "fprop")] = time.perf_counter() - self.start[ours]

            def back_pre(_m: Any, _grad_out: Any, ours: str = ours) -> None:
                self.back_start[ours] = time.perf_counter()

            def back_post(_m: Any, _grad_in: Any, _grad_out: Any, ours: str = ours) -> None:
                self.back_end[ours] = time.perf_counter()

            self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post),
                             module.register_full_backward_pre_hook(back_pre),
                             module.register_full_backward_hook(back_post)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def step(self, x: Any, y: Any) -> None:
        net, optimizer = self.theirs.net, self.theirs.optimizer
        self.now, self.back_start, self.back_end = {}, {}, {}
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        out = net(x)
        t2 = time.perf_counter()
        loss = self.theirs.cross_entropy(out, y)
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
        optimizer.step()
        loss.item()
        t5 = time.perf_counter()
        for ours in self.back_start:
            end = self.back_end.get(ours, t4) if self.needs_grad.get(ours, True) else t4
            self.now[(ours, "bprop")] = end - self.back_start[ours]
        layers = [ours for ours, path in self.modules.items() if path is not None]
        self.now[("loss", "fprop")] = t3 - t2
        self.now[("loss", "bprop")] = min(self.back_start.values(), default=t4) - t3  # to the first module's
        self.now[("update", "")] = (t1 - t0) + (t5 - t4)
        self.now[("step", "")] = t5 - t0
        # the layers' passes: net(x), and backward() less the loss's share
        for what, inside in (("fprop", t2 - t1), ("bprop", t4 - t3 - self.now[("loss", "bprop")])):
            self.now[("other", what)] = inside - sum(self.now.get((name, what), 0.0) for name in layers)
            self.now[("pass", what)] = inside + self.now[("loss", what)]
        self.steps.append(self.now)


def torch_modules(model: Model, net: Any) -> dict[str, str | None]:
    """{mpiasgd top-level layer name: path of the PyTorch module holding the same weights, None where there
    is none}. Layers with parameters: the deepest module that holds all of them (`torch_names`); the other
    layers of a sequential reference (features, flatten, classifier): the module at the same index."""
    from mpiasgd.model.export import torch_names

    names = torch_names(model.spec())
    children = dict(net.named_children())
    kinds = [d["type"] for d in model.spec()["layers"]]
    cut = kinds.index("Flatten") if "features" in children and "Flatten" in kinds else None
    out: dict[str, str | None] = {}
    for i, lname in enumerate(model.names):
        paths = [names[p].split(".")[:-1] for p, _, _ in model.layout() if p.startswith(lname + ".")]
        if paths:
            common = paths[0]
            for path in paths[1:]:
                n = 0
                while n < min(len(common), len(path)) and common[n] == path[n]:
                    n += 1
                common = common[:n]
            out[lname] = ".".join(common) or None
        elif cut is not None:
            out[lname] = f"features.{i}" if i < cut else "flatten" if i == cut else f"classifier.{i - cut - 1}"
        else:
            out[lname] = None
    return out


def medians(steps: list[dict[tuple[str, str], float]]) -> dict[tuple[str, str], float]:
    """{key: median ms over the steps} (a key missing in a step counts as 0 there)."""
    keys = {key for step in steps for key in step}
    return {key: 1e3 * median([step.get(key, 0.0) for step in steps]) for key in keys}


def profile_lines(ours: dict, theirs: dict, modules: dict[str, str | None], model: Model) -> list[str]:
    """The per-layer markdown table: layer (= PyTorch module), ours/torch fprop ms, ours/torch bprop ms."""
    def cell(table: dict, key: tuple[str, str], present: bool = True) -> str:
        return f"{table[key]:.2f}" if present and key in table else "-"

    lines = ["| layer | ours fprop ms | torch fprop ms | ours bprop ms | torch bprop ms |",
             "| :-- | --: | --: | --: | --: |"]
    for lname, layer in zip(model.names, model.layers, strict=True):
        path = modules[lname]
        what = layer.describe().replace("|", "\\|")  # a residual block's "main | shortcut"
        label = f"{lname} {what} = {path}" if path else f"{lname} {what} (torch: no module)"
        lines.append(f"| {label} | {cell(ours, (lname, 'fprop'))} | {cell(theirs, (lname, 'fprop'), bool(path))} | "
                     f"{cell(ours, (lname, 'bprop'))} | {cell(theirs, (lname, 'bprop'), bool(path))} |")
    for name, label in (("loss", "loss (softmax cross-entropy)"), ("other", "other (outside the layers above)"),
                        ("pass", "**pass total**")):
        lines.append(f"| {label} | {cell(ours, (name, 'fprop'))} | {cell(theirs, (name, 'fprop'))} | "
                     f"{cell(ours, (name, 'bprop'))} | {cell(theirs, (name, 'bprop'))} |")
    lines.append(f"\nupdate (SGD momentum): ours {ours[('update', '')]:.2f} ms (LocalSGD.step), PyTorch "
                 f"{theirs[('update', '')]:.2f} ms (zero_grad + SGD.step); whole profiled step: ours "
                 f"{ours[('step', '')]:.2f} ms, PyTorch {theirs[('step', '')]:.2f} ms (timers and hooks included)")
    return lines


def conv_lines(ours: dict, convs: list[str], flops: dict[str, int], step_ms: float) -> list[str]:
    """mpiasgd's conv passes: ms and GFLOP/s of fprop, dgrad, wgrad, ms of the bias gradient, share of the step."""
    def rate(ms: float, layer: str) -> str:
        return f"{flops[layer] / (ms * 1e6):.1f}" if ms > 0 and layer in flops else "-"

    lines = ["| conv layer | fprop ms | dgrad ms | wgrad ms | bias grad ms | GFLOP/s fprop / dgrad / wgrad | "
             "share of step |", "| :-- | --: | --: | --: | --: | --: | --: |"]
    for layer in convs:
        ms = [ours.get((layer, op), 0.0) for op in CONV_OPS]
        rates = " / ".join(rate(m, layer) for m in ms[:3])
        lines.append(f"| {layer} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[2]:.2f} | {ms[3]:.2f} | {rates} | "
                     f"{100 * sum(ms) / step_ms:.0f}% |")
    total = sum(ours.get((layer, op), 0.0) for layer in convs for op in CONV_OPS)
    lines.append(f"| **all convs** | | | | | | {100 * total / step_ms:.0f}% |")
    return lines


# --- step -----------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """One model and batch: ms per step of each round per side, the ratio, and the raw step times."""

    model: str
    batch: int
    backend: str
    ours_ms: list[float]
    torch_ms: list[float]
    warmup_losses: tuple[list[float], list[float]]  # (mpiasgd's, PyTorch's) loss of each warm-up step
    ours_steps: list[list[float]] = field(default_factory=list)
    torch_steps: list[list[float]] = field(default_factory=list)
    profile: dict = field(default_factory=dict)

    @property
    def ratios(self) -> list[float]:
        return [t / o for o, t in zip(self.ours_ms, self.torch_ms, strict=True)]

    @property
    def ratio(self) -> float:
        """PyTorch's median ms per step over mpiasgd's: mpiasgd's speed as a fraction of PyTorch's."""
        return median(self.torch_ms) / median(self.ours_ms)

    def as_dict(self) -> dict:
        return {"model": self.model, "batch": self.batch, "backend": self.backend, "ours_ms": self.ours_ms,
                "torch_ms": self.torch_ms, "ours_ms_median": median(self.ours_ms),
                "torch_ms_median": median(self.torch_ms), "ratios": self.ratios, "ratio": self.ratio,
                "warmup_losses": {"ours": self.warmup_losses[0], "torch": self.warmup_losses[1]},
                "ours_step_s": self.ours_steps, "torch_step_s": self.torch_steps, "profile": self.profile}


def step_table(results: list[StepResult]) -> list[str]:
    lines = ["| model | batch | backend | mpiasgd ms/step | PyTorch ms/step | ratio | rounds' ratios |",
             "| :-- | --: | :-- | --: | --: | --: | :-- |"]
    for r in results:
        lines.append(f"| {r.model} | {r.batch} | {r.backend} | {median(r.ours_ms):,.1f} | {median(r.torch_ms):,.1f} | "
                     f"{r.ratio:.2f} | {' '.join(f'{q:.2f}' for q in r.ratios)} |")
    return lines


def loss_line(r: StepResult) -> str:
    """The warm-up losses of both sides, compared: the check that they do the same work."""
    ours, theirs = (np.asarray(v, dtype=np.float64) for v in r.warmup_losses)
    diff = np.abs(ours - theirs)
    k = int(np.argmax(diff))
    return (f"same work, {r.model} batch {r.batch} ({r.backend}): losses of the {len(ours)} warm-up steps (the "
            f"first is ln(classes) with a zero-initialised classifier) agree within {diff.max():.1e} (step {k + 1}: "
            f"mpiasgd {ours[k]:.6f}, PyTorch {theirs[k]:.6f}; last: {ours[-1]:.6f} vs {theirs[-1]:.6f})")


def goal_line(name: str, ratios: dict[str, float]) -> str:
    worst = min(ratios, key=ratios.get)
    ok = ratios[worst] >= GOAL
    return (f"goal: {name} >= {GOAL:g} of PyTorch's speed: {'yes' if ok else 'no'} "
            f"(lowest {ratios[worst]:.2f}, {worst})")


def measure_step(args: argparse.Namespace, name: str, batch: int) -> list[StepResult]:
    """Warm-up, then the alternating rounds (and --profile's steps) of `name` at `batch`, one result per
    backend of --backends (each round times every backend, then PyTorch once: every backend's ratio is
    taken against the same PyTorch times); prints each round."""
    import torch
    mine = [Ours.build(name, backend, args.seed) for backend in args.backends]
    theirs = Theirs.build(mine[0].model, args.seed)
    x, y = random_batch(mine[0].model, batch, args.seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    # warm-up: the same weights, batch and updates give the same losses (up to float32 rounding)
    torch_losses = [theirs.step(xt, yt) for _ in range(args.warmup)]
    results = [StepResult(name, batch, ours.model.ops.name, [], [], ([ours.step(x, y) for _ in range(args.warmup)],
                                                                     torch_losses)) for ours in mine]
    for r in range(args.rounds):
        for ours, result in zip(mine, results, strict=True):
            o = timed(ours.step, x, y, args.steps)
            result.ours_steps.append(o)
            result.ours_ms.append(1e3 * sum(o) / len(o))
        t = timed(theirs.step, xt, yt, args.steps)
        for result in results:
            result.torch_steps.append(t)
            result.torch_ms.append(1e3 * sum(t) / len(t))
        print(f"  {name} batch {batch} round {r + 1}/{args.rounds}: " + ", ".join(
            f"mpiasgd {res.backend} {res.ours_ms[-1]:,.1f} ms (ratio {res.ratios[-1]:.2f})" for res in results)
            + f", PyTorch {results[0].torch_ms[-1]:,.1f} ms", flush=True)
    if args.profile:
        for ours, result in zip(mine, results, strict=True):
            result.profile = profile_step(args, ours, theirs, (x, y), (xt, yt))
    return results


def profile_step(args: argparse.Namespace, ours: Ours, theirs: Theirs, batch: tuple, tbatch: tuple) -> dict:
    """--steps profiled steps of each side; prints the tables, returns their numbers (ms, medians)."""
    import warnings

    modules = torch_modules(ours.model, theirs.net)
    mine, other = OursProfile(ours), TorchProfile(theirs, modules)
    mine.install()
    try:
        for _ in range(args.steps):
            mine.step(*batch)
    finally:
        mine.remove()
    other.install()
    try:
        with warnings.catch_warnings():  # "Full backward hook is firing when gradients are computed with
            warnings.simplefilter("ignore", UserWarning)  # respect to module outputs": the first module's
            for _ in range(args.steps):
                other.step(*tbatch)
    finally:
        other.remove()
    ours_ms, torch_ms = medians(mine.steps), medians(other.steps)
    model = ours.model
    print(f"\n{model.name}, batch {tbatch[0].shape[0]}: per layer, medians of {args.steps} profiled steps "
          f"(ms; backend {model.ops.name})\n")
    print("\n".join(profile_lines(ours_ms, torch_ms, modules, model)))
    if mine.convs:
        print(f"\n{model.name}, batch {tbatch[0].shape[0]}: mpiasgd's conv passes (ms, medians; GFLOP/s = 2 x "
              "multiply-adds of the pass / time)\n")
        print("\n".join(conv_lines(ours_ms, mine.convs, mine.flops, ours_ms[("step", "")])))
    print(flush=True)

    def plain(table: dict) -> dict:
        return {f"{layer}:{what}" if what else layer: value for (layer, what), value in sorted(table.items())}

    return {"modules": modules, "ours_ms": plain(ours_ms), "torch_ms": plain(torch_ms), "conv_flops": mine.flops}


def environment(torch: Any) -> dict:
    """What the numbers were measured on: versions, threads, CPU."""
    from threadpoolctl import threadpool_info

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "thread_env": {var: os.environ.get(var) for var in THREAD_VARS},
            "threadpools": [{k: p.get(k) for k in ("internal_api", "prefix", "num_threads", "version")}
                            for p in threadpool_info()]}


def step_main(args: argparse.Namespace) -> int:
    torch = torch_or_exit()
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or inter-op work already ran
        pass
    env = environment(torch)
    threads = {p["prefix"]: p["num_threads"] for p in env["threadpools"]}
    print(f"one thread per side (torch {torch.get_num_threads()}, pools {threads}); lr {LR:g}, momentum "
          f"{MOMENTUM:g}, weight decay {WEIGHT_DECAY:g}; {args.rounds} rounds x {args.steps} steps after "
          f"{args.warmup} warm-up steps each", flush=True)
    results = []
    for name in args.models:
        for batch in args.batches:
            results.extend(measure_step(args, name, batch))
    print("\nOne training step on one thread, mpiasgd (forward_backward + LocalSGD.step) vs "
          f"PyTorch {torch.__version__} (zero_grad, forward, cross_entropy, backward, SGD.step); medians of "
          f"{args.rounds} rounds x {args.steps} steps; ratio = PyTorch ms / mpiasgd ms (of the medians); {env['cpu']}, "
          f"{env['date']}.\n")
    print("\n".join(step_table(results)))
    print()
    for r in results:
        print(loss_line(r))
    for backend in args.backends:
        print(goal_line(f"mpiasgd ({backend})",
                        {f"{r.model} batch {r.batch}": r.ratio for r in results if r.backend == backend}))
    if args.json:
        out = {"command": "step", "config": {k: v for k, v in vars(args).items() if k not in ("json", "command")},
               "constants": {"lr": LR, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY, "goal": GOAL},
               "environment": env, "results": [r.as_dict() for r in results]}
        write_json(args.json, out)
    return 0


def write_json(path: str, out: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
        f.write("\n")


# --- ddp -------------------------------------------------------------------------------------------------------


def window_rate(pushes: np.ndarray, skip: int) -> tuple[int, float]:
    """(images, seconds) of the timed window of a run log's pushes table: the applied rows in time order,
    the images of the rows after the first `skip` over the time from row `skip` (1-based) to the last.
    ValueError if fewer than skip + 1 applied rows."""
    rows = pushes[pushes["applied"] == 1]
    rows = rows[np.argsort(rows["time"], kind="stable")]
    if len(rows) < skip + 1 or skip < 1:
        raise ValueError(f"the run log has {len(rows)} applied pushes: too few for a window after {skip}")
    return int(rows["samples"][skip:].sum()), float(rows["time"][-1] - rows["time"][skip - 1])


@dataclass
class DdpRun:
    """One 2-process run: images/s of the timed window, and what else was measured."""

    name: str
    images: int
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds


def ddp_worker(rank: int, init_file: str, cfg: dict, out_dir: str) -> None:
    """(a spawned PyTorch DDP process) Train cfg["steps"] steps on rank `rank`'s shard; rank 0 writes the
    window's images and seconds (between barriers) to out_dir/ddp.json."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mpiasgd.config import Config
    from mpiasgd.data import MinibatchStream, ShardSampler, load_dataset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=DDP_WORLD)
    try:
        dataset = load_dataset(MODELS[cfg["model"]].dataset, cfg["data_dir"])
        model = build_model(cfg["model"])
        net = torch.nn.parallel.DistributedDataParallel(reference_net(model, cfg["seed"]))
        optimizer = torch_optimizer(model, net.module)
        prefetch = Config().prefetch  # mpiasgd train's default: a background thread prepares minibatches
        sampler = ShardSampler(dataset.num_train, DDP_WORLD, rank, cfg["seed"], dataset.chunk, Config().shuffle_window)
        stream = MinibatchStream(dataset, sampler, DDP_BATCH, cfg["seed"], rank + 1, prefetch=prefetch)
        losses, t0 = [], time.perf_counter()
        for k in range(cfg["steps"]):
            if k == cfg["warmup"]:
                dist.barrier()
                t0 = time.perf_counter()
            x, y, _ = stream.next()  # (B, C, H, W) float32 augmented and normalised, (B,) int64
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        dist.barrier()
        t1 = time.perf_counter()
        stream.close()
        if rank == 0:
            window = cfg["steps"] - cfg["warmup"]
            write_json(os.path.join(out_dir, "ddp.json"), {
                "images": DDP_WORLD * DDP_BATCH * window, "seconds": t1 - t0, "losses": losses,
                "threads": torch.get_num_threads(), "prefetch": prefetch})
    finally:
        dist.destroy_process_group()


def run_ddp(args: argparse.Namespace, name: str) -> DdpRun:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vs_pytorch-ddp-") as tmp:
        cfg = {"model": args.model, "data_dir": args.data_dir, "seed": args.seed, "steps": args.steps,
               "warmup": args.warmup}
        start = time.perf_counter()
        mp.spawn(ddp_worker, args=(os.path.join(tmp, "init"), cfg, tmp), nprocs=DDP_WORLD, join=True)
        with open(os.path.join(tmp, "ddp.json"), encoding="utf-8") as f:
            out = json.load(f)
    losses = out.pop("losses")
    return DdpRun(name, out["images"], out["seconds"],
                  {**out, "wall_s": time.perf_counter() - start, "last_losses": float(np.mean(losses[-20:]))})


def train_command(args: argparse.Namespace, mode: str, run_dir: str, name: str) -> list[str]:
    pushes = args.steps * (DDP_WORLD if mode == "async" else 1)  # async: pushes by both workers together
    return [*launcher(), "-n", str(1 + DDP_WORLD), sys.executable, "-m", "mpiasgd", "train", "--model", args.model,
            *(["--data-dir", args.data_dir] if args.data_dir else []), "--mode", mode, "--backend", args.backend,
            "--threads", "1", "--batch-size", str(DDP_BATCH), "--lr", f"{LR:g}", "--lr-schedule", "constant",
            "--warmup-epochs", "0", "--momentum", f"{MOMENTUM:g}", "--weight-decay", f"{WEIGHT_DECAY:g}",
            "--epochs", "0", "--max-pushes", str(pushes), "--seed", str(args.seed), "--snapshot-interval", "0",
            "--checkpoint-interval", "0", "--no-progress", "--run-dir", run_dir, "--name", name]


def run_mpiasgd(args: argparse.Namespace, mode: str, run_dir: str, name: str, commands: list) -> DdpRun:
    from mpiasgd.runlog import load
    from mpiasgd.tools.report import DEFAULT_TARGET, comparison_row

    cmd = train_command(args, mode, run_dir, name)
    commands.append(shlex.join(cmd))
    done = run(cmd, args.timeout)
    if not done.ok:
        sys.exit(f"vs_pytorch.py: {done.explain(args.timeout)}")
    path = os.path.join(run_dir, name + ".h5")
    log = load(path)
    if log.get("status") != "completed":
        sys.exit(f"vs_pytorch.py: run log {path} has status {log.get('status')!r}, expected 'completed'")
    images, secs = window_rate(log["pushes"], DDP_WORLD * args.warmup)
    applied = log["pushes"][log["pushes"]["applied"] == 1]
    return DdpRun(name, images, secs, {
        "log": path, "whole_run_images_per_s": comparison_row(log, DEFAULT_TARGET)["images_per_s"],
        "train_time_s": float(log["train_time_s"]), "samples": int(log["samples"]), "applied_pushes": len(applied),
        "compute_ms": 1e3 * float(applied["compute_s"].mean()), "wall_s": done.seconds,
        "last_losses": float(applied["loss"][np.argsort(applied["time"])][-20 * DDP_WORLD:].mean())})


def ddp_table(runs: dict[str, list[DdpRun]]) -> list[str]:
    ref = median([r.images_per_s for r in runs["PyTorch DDP"]])
    lines = ["| run | images/s (window) | ms per step | vs DDP | rounds' images/s | images/s (whole run) | "
             "loss (last 20 steps) |", "| :-- | --: | --: | --: | :-- | --: | --: |"]
    for name, rs in runs.items():
        rate = median([r.images_per_s for r in rs])
        whole = [r.extra.get("whole_run_images_per_s") for r in rs]
        lines.append(f"| {name} | {rate:,.0f} | {1e3 * DDP_WORLD * DDP_BATCH / rate:,.1f} | {rate / ref:.2f} | "
                     f"{' '.join(f'{r.images_per_s:,.0f}' for r in rs)} | "
                     f"{'-' if None in whole else f'{median(whole):,.0f}'} | "
                     f"{median([r.extra['last_losses'] for r in rs]):.3f} |")
    return lines


def data_or_exit(args: argparse.Namespace) -> None:
    """Check that the dataset loads; without CIFAR-10 one line saying how to get it, exit status 2."""
    from mpiasgd.data import DataError, default_data_dir, load_dataset

    try:
        load_dataset(MODELS[args.model].dataset, args.data_dir)
    except DataError as e:  # its message names the folder and how to get CIFAR-10
        print(f"vs_pytorch.py: {args.command} needs CIFAR-10: {' '.join(str(e).split())} (in a checkout of this "
              f"project, `python ../shared/tools/cifar10_batches.py` writes it to {default_data_dir()})",
              file=sys.stderr)
        sys.exit(2)


def ddp_main(args: argparse.Namespace) -> int:
    torch = torch_or_exit()
    data_or_exit(args)
    launcher()  # exits naming the script when there is no mpiexec
    commands: list[str] = []
    keep = args.run_dir
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="vs_pytorch-runs-")
    run_dir = keep or tmp.name
    configs: dict[str, Callable[[str], DdpRun]] = {"PyTorch DDP": lambda n: run_ddp(args, n)}
    for mode in args.modes:
        configs[f"mpiasgd {mode}"] = lambda n, mode=mode: run_mpiasgd(args, mode, run_dir, n, commands)
    runs: dict[str, list[DdpRun]] = {name: [] for name in configs}
    print(f"{args.model}: {DDP_WORLD} processes x 1 thread, batch {DDP_BATCH} per worker, {args.steps} steps per "
          f"worker, window after {args.warmup}; {args.rounds} round(s)", flush=True)
    try:
        order = list(configs)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else reversed(order):
                print(f"  round {r + 1}: {name} ...", end=" ", flush=True)
                result = configs[name](f"{name.split()[-1].lower()}-r{r + 1}")
                runs[name].append(result)
                print(f"{result.images_per_s:,.0f} images/s ({result.extra['wall_s']:.0f} s)", flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    env = environment(torch)
    print(f"\n{args.model}: {DDP_WORLD} workers x 1 thread, batch {DDP_BATCH} each, lr {LR:g} constant, momentum "
          f"{MOMENTUM:g}, weight decay {WEIGHT_DECAY:g} (weights), {args.steps} steps per worker, images/s over "
          f"steps {args.warmup + 1}-{args.steps}; PyTorch {torch.__version__} DDP (gloo) vs mpiasgd {args.backend}; "
          f"{env['cpu']}, {os.cpu_count()} cores, {env['date']}.\n")
    print("\n".join(ddp_table(runs)))
    ref = median([r.images_per_s for r in runs["PyTorch DDP"]])
    ratios = {f"{name.split()[-1]}/DDP": median([r.images_per_s for r in rs]) / ref
              for name, rs in runs.items() if name != "PyTorch DDP"}
    print()
    for name, value in ratios.items():
        print(f"{name}: {value:.2f} (goal >= {GOAL:g}: {'yes' if value >= GOAL else 'no'})")
    if commands:
        print("\nCommands:\n" + "\n".join("  " + c for c in commands))
    if args.json:
        out = {"command": "ddp", "config": {k: v for k, v in vars(args).items() if k not in ("json", "command")},
               "constants": {"lr": LR, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY, "goal": GOAL,
                             "world": DDP_WORLD, "batch": DDP_BATCH},
               "environment": env, "ratios": ratios, "commands": commands,
               "runs": {name: [{"images": r.images, "seconds": r.seconds, "images_per_s": r.images_per_s, **r.extra}
                               for r in rs] for name, rs in runs.items()}}
        write_json(args.json, out)
    return 0


# --- race ------------------------------------------------------------------------------------------------------

RACE_GOAL = 1.1  # mpiasgd's time to the ratio's target over DDP's, at most
RACE_TARGETS = (0.60, 0.65, 0.70)  # test top-1 accuracies whose time to reach is measured
RACE_RATIO_AT = 0.65  # the target of the ratio, when among --targets
RACE_WARMUP_EPOCHS = 0.5  # linear warm-up from 0, then cosine to 0 at --epochs (mpiasgd's schedule, both sides)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (np.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def fraction_list(text: str) -> list[float]:
    """argparse type: comma-separated distinct test accuracies, fractions in (0, 1], sorted ascending."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions such as 0.6,0.65, got {text!r}") from None
    if not values or len(set(values)) < len(values) or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected distinct fractions in (0, 1], e.g. 0.6,0.65 for 60 and 65 %; "
                                         f"got {text!r}")
    return sorted(values)


def add_race_parser(sub: Any) -> argparse.ArgumentParser:
    from mpiasgd.argtypes import fraction

    race = sub.add_parser("race", help="time to a test accuracy: mpiasgd sync vs PyTorch DDP, 2 workers x 1 thread",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    race.add_argument("--epochs", type=positive_float, default=10.0, help="epochs of training (both workers "
                      "together); the cosine schedule ends at 0 here")
    race.add_argument("--eval-every", type=positive_float, default=0.25, metavar="EPOCHS",
                      help="epochs between evaluations of the whole test set (the training clock paused)")
    race.add_argument("--targets", type=fraction_list, default=list(RACE_TARGETS), metavar="A1,A2",
                      help="test top-1 accuracies (fractions), comma-separated: the time to each is measured")
    race.add_argument("--ratio-at", type=fraction, default=None, metavar="A",
                      help=f"the target of the ratio mpiasgd time / DDP time (goal <= {RACE_GOAL:g}); one of "
                      f"--targets; None: {RACE_RATIO_AT:g} when among them, else the middle one")
    stop = race.add_mutually_exclusive_group()
    stop.add_argument("--stop-at", type=fraction, default=None, metavar="A",
                      help="stop each run at its first evaluation at or above this accuracy; None: the highest "
                      "of --targets")
    stop.add_argument("--no-stop", action="store_true", help="train all --epochs")
    add_training_options(race, timeout=7200.0)
    return race


def add_training_options(parser: argparse.ArgumentParser, timeout: float) -> None:
    """The options `ddp` and `race` share: mpiasgd's backend, seed, data, run folder, time limit, JSON output."""
    parser.add_argument("--backend", choices=[b for b in BACKENDS if b != "cupy"], default="cpu",
                        help="mpiasgd's workers' ops backend (cpu: what --backend auto runs without a GPU)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights, shards and augmentation")
    parser.add_argument("--data-dir", default=None, help="CIFAR-10 folder; None: $MPIASGD_DATA or ~/.cache/mpiasgd")
    parser.add_argument("--run-dir", default=None, help="keep mpiasgd's run logs here; None: a temporary folder")
    parser.add_argument("--timeout", type=seconds, default=timeout, help="time limit of each run, seconds")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every number to this JSON file")
    parser.add_argument("--model", default="cifar10", choices=("cifar10", "digits"), help=argparse.SUPPRESS)


def check_race(race: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The race's checks across options (one-line errors), and the defaults that follow from --targets:
    `ratio_at` and `stop_at` (None with --no-stop)."""
    targets = args.targets
    if args.eval_every > args.epochs:
        race.error(f"--eval-every {args.eval_every:g} is longer than --epochs {args.epochs:g}: no evaluation during "
                   "training")
    if args.ratio_at is None:
        args.ratio_at = RACE_RATIO_AT if RACE_RATIO_AT in targets else targets[len(targets) // 2]
    elif args.ratio_at not in targets:
        race.error(f"--ratio-at {args.ratio_at:g} is not one of --targets {','.join(f'{t:g}' for t in targets)}")
    if args.no_stop:
        args.stop_at = None
    elif args.stop_at is None:
        args.stop_at = targets[-1]
    elif args.stop_at < targets[-1]:
        race.error(f"--stop-at {args.stop_at:g} is below the highest of --targets ({targets[-1]:g}): the runs would "
                   "stop before they could reach it (use --no-stop to train all --epochs)")


def time_to_target(rows: list[tuple[float, float]], target: float) -> float | None:
    """Training seconds at the first evaluation, in time order, whose test accuracy is at or above `target`;
    `rows` are (training seconds, accuracy) pairs. None if none reached it."""
    for secs, accuracy in sorted(rows, key=lambda row: row[0]):
        if accuracy >= target:
            return float(secs)
    return None


def mpiasgd_evals(periodic: np.ndarray | None) -> list[tuple[float, float]]:
    """(training seconds, test top-1) of each row of a run log's /periodic_evals table, in time order.

    A row's `time` is on rank 0's log clock when the evaluated weights were taken, and that clock does not
    pause for evaluations (the README: "Evaluation takes training time"): every earlier evaluation's
    `seconds` (its slowest evaluator's) is subtracted, leaving the training time."""
    if periodic is None or len(periodic) == 0:
        return []
    rows = periodic[np.argsort(periodic["time"], kind="stable")]
    before = np.concatenate([[0.0], np.cumsum(rows["seconds"], dtype=np.float64)[:-1]])
    return [(float(t), float(a)) for t, a in zip(rows["time"] - before, rows["top1"], strict=True)]


def race_lr(schedule: Any, rule: Any, applied: int, images_per_step: int, num_train: int, secs: float) -> float:
    """The step size of the update after `applied` updates of `images_per_step` images each, as a sync
    worker computes it (mpiasgd/modes/sync.py): `learning_rate` at the epochs done before the update and
    the fraction of the run done by `rule` (a StopRule) at them, `secs` seconds of training."""
    from mpiasgd.optim import fraction_done, learning_rate

    done = applied * images_per_step / num_train
    return learning_rate(schedule, done, fraction_done(rule, done, applied, secs))


@dataclass
class RaceRun:
    """One side of the race: its evaluations as (training seconds, test top-1), in time order (the final one
    included), the images trained on over the training seconds (evaluations excluded), and the rest."""

    name: str
    evals: list[tuple[float, float]]
    images: int
    seconds: float
    final_accuracy: float
    extra: dict = field(default_factory=dict)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else float("nan")

    def time_to(self, target: float) -> float | None:
        return time_to_target(self.evals, target)


def race_command(args: argparse.Namespace, run_dir: str, name: str) -> list[str]:
    """mpiexec ... mpiasgd train: 2 sync workers x 1 thread, the race's schedule, evaluations and stop."""
    return [*launcher(), "-n", str(1 + DDP_WORLD), sys.executable, "-m", "mpiasgd", "train", "--model", args.model,
            *(["--data-dir", args.data_dir] if args.data_dir else []), "--mode", "sync", "--backend", args.backend,
            "--threads", "1", "--batch-size", str(DDP_BATCH), "--lr", f"{LR:g}", "--lr-scaling", "none",
            "--lr-schedule", "cosine", "--warmup-epochs", f"{RACE_WARMUP_EPOCHS:g}", "--momentum", f"{MOMENTUM:g}",
            "--weight-decay", f"{WEIGHT_DECAY:g}", "--epochs", repr(args.epochs), "--max-pushes", "0",
            "--max-time", "0", "--eval-interval", f"{args.eval_every!r}ep",
            *(["--stop-accuracy", repr(args.stop_at)] if args.stop_at else []), "--seed", str(args.seed),
            "--snapshot-interval", "0", "--checkpoint-interval", "0", "--no-progress", "--run-dir", run_dir,
            "--name", name]


def race_setup(cmd: list[str]) -> dict:
    """What the DDP side takes from mpiasgd's command `cmd` as mpiasgd itself resolves it: the schedule, the
    stopping rule (dicts of `Schedule` and `StopRule`), the evaluations' interval in epochs, the stop
    accuracy, the evaluation batch, the seed and the input pipeline's prefetch and shuffle window."""
    from mpiasgd.config import make_parser, resolve
    from mpiasgd.optim import Schedule, StopRule

    cfg = resolve(make_parser().parse_args(cmd[cmd.index("train") + 1:]))
    every, unit = cfg.eval_every()
    if cfg.mode != "sync" or unit != "ep":
        raise ValueError(f"race_setup: expected --mode sync and --eval-interval in epochs, got {cfg.mode}, {unit}")
    return {"model": cfg.model, "data_dir": cfg.data_dir or None, "seed": cfg.seed, "batch": cfg.batch_size,
            "schedule": dataclasses.asdict(Schedule.of(cfg, DDP_WORLD)), "rule": dataclasses.asdict(StopRule.of(cfg)),
            "eval_every": every, "stop_at": cfg.stop_accuracy, "eval_batch": cfg.eval_batch_size,
            "prefetch": cfg.prefetch, "shuffle_window": cfg.shuffle_window}


def torch_evaluate(net: Any, dataset: Any, idx: np.ndarray, batch_size: int) -> tuple[float, float, int]:
    """(a DDP process) `net` in eval mode on the test images `idx`, then summed over the processes
    (all_reduce): (correct, loss sum, images)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    correct, loss_sum = 0, 0.0
    net.eval()
    with torch.no_grad():
        for start in range(0, idx.size, batch_size):
            x, y = dataset.batch("test", idx[start:start + batch_size])
            target = torch.from_numpy(np.asarray(y, dtype=np.int64))
            logits = net(torch.from_numpy(x))
            loss_sum += float(F.cross_entropy(logits, target, reduction="sum"))
            correct += int((logits.argmax(1) == target).sum())
    net.train()
    total = torch.tensor([correct, loss_sum, idx.size], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0]), float(total[1]), int(total[2])


def race_worker(rank: int, init_file: str, cfg: dict, out_dir: str) -> None:
    """(a spawned PyTorch DDP process) Train on rank `rank`'s shard with mpiasgd's step sizes until the stopping
    rule (or cfg["stop_at"]) ends it, evaluating every cfg["eval_every"] epochs and at the end with the clock
    paused on both ranks; rank 0 writes the evaluations and figures to out_dir/race.json."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mpiasgd.data import MinibatchStream, ShardSampler, load_dataset
    from mpiasgd.optim import EvalSchedule, Schedule, StopRule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=DDP_WORLD)
    try:
        dataset = load_dataset(MODELS[cfg["model"]].dataset, cfg["data_dir"])
        model = build_model(cfg["model"])
        net = torch.nn.parallel.DistributedDataParallel(reference_net(model, cfg["seed"]))
        optimizer = torch_optimizer(model, net.module)
        lr_mults = [group["lr"] / LR for group in optimizer.param_groups]
        schedule, rule = Schedule(**cfg["schedule"]), StopRule(**cfg["rule"])
        evals = EvalSchedule(cfg["eval_every"], "ep")
        evals.start(0.0, 0.0)
        sampler = ShardSampler(dataset.num_train, DDP_WORLD, rank, cfg["seed"], dataset.chunk, cfg["shuffle_window"])
        stream = MinibatchStream(dataset, sampler, cfg["batch"], cfg["seed"], rank + 1, prefetch=cfg["prefetch"])
        test_idx = np.array_split(np.arange(dataset.num_test, dtype=np.int64), DDP_WORLD)[rank]  # mpiasgd's slices
        per_step, num_train = DDP_WORLD * cfg["batch"], dataset.num_train
        rows, losses, lrs = [], [], []
        applied, train_s = 0, 0.0
        dist.barrier()
        t0 = time.perf_counter()
        while True:
            x, y, _ = stream.next()  # (B, C, H, W) float32 augmented and normalised, (B,) int64
            lr = race_lr(schedule, rule, applied, per_step, num_train, train_s + time.perf_counter() - t0)
            for group, mult in zip(optimizer.param_groups, lr_mults, strict=True):
                group["lr"] = lr * mult
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            lrs.append(lr)
            applied += 1
            epochs = applied * per_step / num_train
            last = bool(rule.reason(applied * per_step, num_train, applied, train_s + time.perf_counter() - t0))
            if last or evals.due(train_s + time.perf_counter() - t0, epochs):
                dist.barrier()  # the clock stops on both ranks
                train_s += time.perf_counter() - t0
                e0 = time.perf_counter()
                correct, loss_sum, count = torch_evaluate(net.module, dataset, test_idx, cfg["eval_batch"])
                top1 = correct / count
                rows.append({"epoch": epochs, "step": applied, "train_s": train_s, "top1": top1,
                             "loss": loss_sum / count, "seconds": time.perf_counter() - e0, "final": last})
                if rank == 0:
                    print(f"    DDP evaluation at epoch {epochs:.2f}: test top-1 {100 * top1:.2f} % after "
                          f"{train_s:.1f} s of training ({rows[-1]['seconds']:.1f} s)", flush=True)
                if cfg["stop_at"] and top1 >= cfg["stop_at"]:  # the same on both ranks: the allreduced counts
                    last = True
                    rows[-1]["final"] = True
                dist.barrier()
                t0 = time.perf_counter()  # and starts again
            if last:
                break
        stream.close()
        if rank == 0:
            write_json(os.path.join(out_dir, "race.json"), {
                "rows": rows, "images": applied * per_step, "steps": applied, "train_s": train_s,
                "last_losses": float(np.mean(losses[-20:])), "lrs": lrs, "threads": torch.get_num_threads()})
    finally:
        dist.destroy_process_group()


def run_race_ddp(args: argparse.Namespace, setup: dict) -> RaceRun:
    """PyTorch DDP's side: 2 spawned processes (`race_worker`), ended at --timeout."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vs_pytorch-race-") as tmp:
        start = time.perf_counter()
        context = mp.spawn(race_worker, args=(os.path.join(tmp, "init"), setup, tmp), nprocs=DDP_WORLD, join=False)
        while not context.join(timeout=2.0):
            if time.perf_counter() - start > args.timeout:
                for proc in context.processes:
                    if proc.is_alive():
                        proc.terminate()
                sys.exit(f"vs_pytorch.py: PyTorch DDP stopped at the time limit of {args.timeout:.0f} s (--timeout)")
        with open(os.path.join(tmp, "race.json"), encoding="utf-8") as f:
            out = json.load(f)
    rows = out.pop("rows")
    lrs = out.pop("lrs")
    return RaceRun("PyTorch DDP", [(r["train_s"], r["top1"]) for r in rows], out["images"], out["train_s"],
                   rows[-1]["top1"], {**out, "evaluations": rows, "eval_s": sum(r["seconds"] for r in rows),
                                      "lr_first_last": [lrs[0], lrs[-1]], "lr_max": max(lrs),
                                      "wall_s": time.perf_counter() - start})


def run_race_mpiasgd(args: argparse.Namespace, cmd: list[str], path: str) -> RaceRun:
    """mpiasgd's side: run `cmd`, then read its log at `path`: the periodic evaluations and the final one on
    the training clock (evaluation time subtracted, `mpiasgd_evals`); images/s over the applied pushes."""
    from mpiasgd.runlog import load
    from mpiasgd.runlog.summary import final_eval, periodic_evals

    done = run(cmd, args.timeout)
    if not done.ok:
        sys.exit(f"vs_pytorch.py: {done.explain(args.timeout)}")
    log = load(path)
    if log.get("status") != "completed":
        sys.exit(f"vs_pytorch.py: run log {path} has status {log.get('status')!r}, expected 'completed'")
    periodic = periodic_evals(log)
    evals = mpiasgd_evals(periodic)
    eval_s = float(periodic["seconds"].sum()) if periodic is not None else 0.0
    applied = log["pushes"][log["pushes"]["applied"] == 1]
    train_s = float(applied["time"].max()) - eval_s  # the last step's REPORT, less every evaluation
    final = final_eval(log)
    final_acc = float(final["accuracy"]) if final is not None else float("nan")
    if final is not None:  # the final weights' evaluation: the last step's training time
        evals.append((train_s, final_acc))
    rows = [] if periodic is None else [
        {"epoch": float(r["epoch"]), "version": int(r["version_max"]), "log_time": float(r["time"]),
         "train_s": t, "top1": float(r["top1"]), "loss": float(r["loss"]), "seconds": float(r["seconds"])}
        for r, (t, _) in zip(periodic, evals, strict=False)]
    return RaceRun(f"mpiasgd sync ({args.backend})", evals, int(applied["samples"].sum()), train_s, final_acc, {
        "log": path, "evaluations": rows, "eval_s": eval_s, "log_train_time_s": float(log["train_time_s"]),
        "stop_reason": str(log.get("stop_reason", "")), "steps": int(applied["version"].max()) if len(applied) else 0,
        "last_losses": float(applied["loss"][np.argsort(applied["time"])][-20 * DDP_WORLD:].mean()),
        "wall_s": done.seconds})


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def race_table(runs: list[RaceRun], targets: list[float]) -> list[str]:
    """run | time to each target (s of training, '-' when not reached) | final accuracy | images/s."""
    heads = " | ".join(f"time to {100 * t:g} %" for t in targets)
    lines = [f"| run | {heads} | final accuracy | images/s |", "| :-- |" + " --: |" * (len(targets) + 2)]
    for r in runs:
        times = " | ".join(fmt_s(r.time_to(t)) for t in targets)
        lines.append(f"| {r.name} | {times} | {100 * r.final_accuracy:.2f} % | {r.images_per_s:,.0f} |")
    return lines


def race_curves(ddp: RaceRun, ours: RaceRun) -> list[str]:
    """The evaluations side by side (the same steps on both: the same EvalSchedule and stopping rule)."""
    lines = ["| # | DDP: s of training | DDP top-1 | mpiasgd: s of training | mpiasgd top-1 |",
             "| --: | --: | --: | --: | --: |"]
    for k in range(max(len(ddp.evals), len(ours.evals))):
        cells = []
        for r in (ddp, ours):
            cells += ([f"{r.evals[k][0]:,.1f}", f"{100 * r.evals[k][1]:.2f} %"] if k < len(r.evals) else ["", ""])
        lines.append(f"| {k + 1} | {' | '.join(cells)} |")
    return lines


def race_ratio(ours: RaceRun, ddp: RaceRun, target: float) -> float | None:
    """mpiasgd's time to `target` over DDP's; None unless both reached it."""
    mine, theirs = ours.time_to(target), ddp.time_to(target)
    return None if mine is None or theirs is None or theirs <= 0 else mine / theirs


def race_verdict(ratio: float | None, ours: RaceRun, ddp: RaceRun, target: float) -> str:
    label = f"mpiasgd/DDP time to {100 * target:g} %"
    if ratio is None:
        missing = " and ".join(r.name for r in (ddp, ours) if r.time_to(target) is None)
        return f"{label}: - ({missing} did not reach it; goal <= {RACE_GOAL:g} not measured)"
    return f"{label}: {ratio:.2f} (goal <= {RACE_GOAL:g}: {'yes' if ratio <= RACE_GOAL else 'no'})"


def race_main(args: argparse.Namespace) -> int:
    torch = torch_or_exit()
    data_or_exit(args)
    launcher()  # exits naming the script when there is no mpiexec
    keep = args.run_dir
    if keep:
        os.makedirs(keep, exist_ok=True)
    tmp = None if keep else tempfile.TemporaryDirectory(prefix="vs_pytorch-race-runs-")
    run_dir = keep or tmp.name
    name = f"race-sync-{args.backend}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = race_command(args, run_dir, name)
    setup = race_setup(cmd)
    commands = [shlex.join([sys.executable, *sys.argv]) if sys.argv and sys.argv[0].endswith("vs_pytorch.py")
                else "python bench/vs_pytorch.py race ...", shlex.join(cmd)]
    stop = f"stop at {100 * args.stop_at:g} %" if args.stop_at else "no stop"
    print(f"{args.model}: {DDP_WORLD} workers x 1 thread, batch {DDP_BATCH} each, lr {LR:g} cosine over "
          f"{args.epochs:g} epochs after {RACE_WARMUP_EPOCHS:g} of warm-up; the test set every {args.eval_every:g} "
          f"epochs; {stop}", flush=True)
    try:
        print("  PyTorch DDP ...", flush=True)
        ddp = run_race_ddp(args, setup)
        print(f"  PyTorch DDP: {ddp.seconds:.1f} s of training, {len(ddp.evals)} evaluations "
              f"({ddp.extra['wall_s']:.0f} s)", flush=True)
        print(f"  mpiasgd sync ({args.backend}) ...", end=" ", flush=True)
        ours = run_race_mpiasgd(args, cmd, os.path.join(run_dir, name + ".h5"))
        print(f"{ours.seconds:.1f} s of training, {len(ours.evals)} evaluations ({ours.extra['wall_s']:.0f} s)",
              flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    env = environment(torch)
    runs = [ddp, ours]
    print(f"\n{args.model}: time to a test top-1 accuracy (seconds of training, evaluations excluded; '-': not "
          f"reached), {DDP_WORLD} workers x 1 thread, batch {DDP_BATCH} each, lr {LR:g} (0.5-epoch warm-up, cosine "
          f"over {args.epochs:g} epochs), momentum {MOMENTUM:g}, weight decay {WEIGHT_DECAY:g} (weights); the whole "
          f"test set every {args.eval_every:g} epochs and at the end; {stop}; PyTorch {torch.__version__} DDP (gloo) "
          f"vs mpiasgd sync ({args.backend}); {env['cpu']}, {os.cpu_count()} cores, {env['date']}.\n")
    print("\n".join(race_table(runs, args.targets)))
    print("\nEvaluations:\n")
    print("\n".join(race_curves(ddp, ours)))
    ratio = race_ratio(ours, ddp, args.ratio_at)
    print("\n" + race_verdict(ratio, ours, ddp, args.ratio_at))
    print("\nCommands:\n" + "\n".join("  " + c for c in commands))
    if args.json:
        out = {"command": "race", "config": {k: v for k, v in vars(args).items() if k not in ("json", "command")},
               "constants": {"lr": LR, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY, "goal": RACE_GOAL,
                             "warmup_epochs": RACE_WARMUP_EPOCHS, "world": DDP_WORLD, "batch": DDP_BATCH},
               "setup": setup, "environment": env, "ratio": ratio, "ratio_at": args.ratio_at, "commands": commands,
               "runs": {r.name: {"evals": r.evals, "images": r.images, "seconds": r.seconds,
                                 "images_per_s": r.images_per_s, "final_accuracy": r.final_accuracy,
                                 "time_to": {f"{t:g}": r.time_to(t) for t in args.targets}, **r.extra}
                        for r in runs}}
        write_json(args.json, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return {"step": step_main, "ddp": ddp_main, "race": race_main}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
