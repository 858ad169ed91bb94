#!/usr/bin/env python3
"""mpiasgd's CPU workers against PyTorch on the same work: one training step on one thread (`step`), and
2-process training throughput against PyTorch DDP (`ddp`). The goal: mpiasgd at >= 0.9 of PyTorch's speed.

    python bench/vs_pytorch.py                                        # = step: cifar10 and resnet20, batch 64 and 128;
                                                                      #   ~3 min on 2 cores
    python bench/vs_pytorch.py step --rounds 1 --steps 2 --batches 64 # a smoke run, ~15 s
    python bench/vs_pytorch.py step --profile --json step.json        # + per-layer fprop/bprop tables, conv passes
    python bench/vs_pytorch.py ddp                                    # DDP vs mpiasgd sync and async, 200 steps each;
                                                                      #   ~4 min (CIFAR-10 needed)
    python bench/vs_pytorch.py ddp --steps 20 --warmup 5              # a smoke run, ~1 min

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

Needs PyTorch (pip install -e '.[bench]'; exits 2 with one line otherwise) and, for `ddp`, mpiexec beside
this Python or on PATH. Run as root? Set OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
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

from mpiasgd.cli import positive  # noqa: E402
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
    sub = parser.add_subparsers(dest="command", metavar="{step,ddp}", help="step (the default) | ddp")
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
    ddp.add_argument("--backend", choices=[b for b in BACKENDS if b != "cupy"], default="cpu",
                     help="mpiasgd's workers' ops backend (cpu: what --backend auto runs without a GPU)")
    ddp.add_argument("--seed", type=int, default=0, help="initial weights, shards and augmentation")
    ddp.add_argument("--data-dir", default=None, help="CIFAR-10 folder (default: $MPIASGD_DATA or ~/.cache/mpiasgd)")
    ddp.add_argument("--run-dir", default=None, help="keep mpiasgd's run logs here (default: a temporary folder)")
    ddp.add_argument("--timeout", type=seconds, default=1800.0, help="time limit of each run, seconds")
    ddp.add_argument("--json", default=None, metavar="PATH", help="also write every number to this JSON file")
    ddp.add_argument("--model", default="cifar10", choices=("cifar10", "digits"), help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("step", "ddp", "-h", "--help"):
        argv = ["step", *argv]  # step is the default subcommand
    args = parser.parse_args(argv)
    which = step if args.command == "step" else ddp
    least = 2 if args.command == "step" else 1  # step: the first warm-up loss is ln(classes) on both sides
    if args.warmup < least:
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
        for method, what, mark in (("forward", "fprop", "loss_f0"), ("backward", "bprop", "loss_b1")):
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
        print(f"vs_pytorch.py: ddp needs CIFAR-10: {' '.join(str(e).split())} (in a checkout of this project, "
              f"`python ../shared/tools/cifar10_batches.py` writes it to {default_data_dir()})", file=sys.stderr)
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


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return step_main(args) if args.command == "step" else ddp_main(args)


if __name__ == "__main__":
    sys.exit(main())
