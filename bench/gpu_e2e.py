#!/usr/bin/env python3
"""GPU A-SGD end to end on one GPU (issue 38): step time against PyTorch, alexnet_1gpu_64 under async against
one worker alone, each hop of a push and pull against its floor, and resnet20's time to 85 % against PyTorch.

    python bench/gpu_e2e.py --dry-run                          # no GPU: every part on the cpu backend, tiny sizes,
                                                               #   ~50 s on 2 idle cores (CI: tests/mpi)
    python bench/gpu_e2e.py --data .gpudata/cifar10            # one GPU, all four parts: ~7 min on an H100
    python bench/gpu_e2e.py --only step,alexnet,hops           # parts 1-3 (~4 min); --only race: part 4 (~3.5 min)
    OUT=/tmp/o python bench/gpu_e2e.py ...                     # also $OUT/gpu_e2e.json and $OUT/gpu_e2e.md

Parts (`--only step|alexnet|hops|race`, comma-separated):

  step     median ms of one training step (forward, loss, backward, the local SGD update) at batch --batch on
           one fixed random batch, after warm-up, each step between two CUDA events and synchronised (the host
           time of launching counts: a launch-bound step shows as such), for `cifar10` and `resnet20`:
             ours eager      `Model.forward_backward` + `LocalSGD.step` in this process (bench/vs_pytorch.py's
                             `Ours`: the weights of `init_params(--seed)`)
             ours graphs     the same with forward and backward replayed from a CUDA graph (`StepGraphs`,
                             `--cuda-graphs`: the batch copied into the graph's input buffers each step), the
                             update one eager kernel after it; checked to give the eager step's loss first
                             (cupy backend only: "needs the cupy backend" otherwise)
             ours, train     `mpiexec -n 2 ... train --mode sync` for --cli-steps steps on a synthetic 32x32
                             file: median of the run log's compute_s (forward + backward) and of the interval
                             between applied steps (the whole step as trained: the allreduce, the update);
                             with `--cuda-graphs on` and `off` (auto and off on the CPU, where auto resolves to
                             eager launches)
             PyTorch eager   bench/torch_models.py's network of the same spec with the same initial weights
                             (bench/vs_pytorch.py's `reference_net`, `torch_optimizer`: SGD momentum 0.9, weight
                             decay 5e-4 x decay_mult, lr 0.02), FP32: cudnn.benchmark on, TF32 off
             PyTorch graphs  the same step captured once with torch.cuda.graph (static input, loss, gradients,
                             optimizer state) and replayed; on the CPU (dry run) the same static-buffer step
                             runs eagerly ("emulated")
           ratios: ours ms / PyTorch ms (goal with graphs: <= 1.0 of eager); "ours graphs" is the in-process
           graphed step.
  alexnet  `alexnet_1gpu_64` at batch 128 on `synthetic64`: one worker training alone (sync, N = 1: the ceiling)
           against one async worker at nsync 1 and 4, S = 1 and 2 servers, fp32 and bf16 on the wire, --overlap on
           and off (each factor alone and all three together, 10 runs; --alexnet-all: all 16; --server-threads T for
           every server rank's update); each an mpiexec job
           of --alexnet-seconds of training (--max-time). images/s from the run
           log's summary (`mpiasgd report`'s) and over its steady window (the applied pushes after the first
           fifth), its ratio to the ceiling, and the worker's share of time waiting. The ceiling's compute alone
           (batch / median compute_s: forward + backward, no exchange, no sync-mode digest of the weights) is
           the issue's "one GPU alone"; steady images/s is also given over it. A combination the Config
           refuses (a combination a later Config forbids) is recorded as "refused" with the reason.
  hops     one push and pull of alexnet_1gpu_64's parameter count, hop by hop, in a 2-rank job of this script
           (rank 1 the worker, rank 0 the server): device->host (the worker's `PinnedStaging.before_send`), the
           push over MPI (Irecv on rank 0 completed by `mpiasgd.comms.waits.wait`, as the server does), the
           server's finite check and update (`finite_square`, `SGD.step` out of place into the reply), the reply
           over MPI, host->device (`after_receive`); median ms of --hops-rounds, against each hop's floor: its
           bytes at the bandwidth this job measures for it (raw pinned copies; raw blocking MPI Send/Recv of the
           same bytes; a STREAM-like copy on rank 0, bench/server.py's `Roofline`, for the check's 4P and the
           update's 20P bytes). On the CPU (dry run) the device copies are host copies (numpy `Transfers`).
  race     CIFAR-10 `resnet20`, one worker, sync: training time to --race-target test accuracy (evaluations
           excluded, every --race-eval-every epochs) of `mpiexec -n 2 ... train --mode sync --stop-accuracy`
           against PyTorch in one process on the same device, with the same initial weights, minibatches and
           augmentation (the stream worker rank 1 draws), step sizes (mpiasgd's `Schedule` and `StopRule` of the
           command, bench/vs_pytorch.py's `race_setup` / `race_lr`) and evaluations (`EvalSchedule`). --data: a
           folder with CIFAR-10 in an official layout (/work/shared/tools/cifar10_batches.py writes it); the dry
           run writes a tiny learnable one and aims at 5 %.

A part that fails is reported with its error and the others still run; exit status 1 then, 2 without a usable
GPU for --backend cupy, else 0. Run as root? OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM) are set here if unset. The device
command (carrying .whl and the data): docs/gpus.md, "The end-to-end check".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [p for p in (HERE, REPO) if p not in sys.path]  # bench/ helpers, mpiasgd from the checkout

from launch import launcher, run  # noqa: E402  (bench/launch.py)
from trainrun import name_list  # noqa: E402

from mpiasgd.config import ConfigError, make_parser, resolve  # noqa: E402

PARTS = ("step", "alexnet", "hops", "race")
STEP_GOAL = 1.0    # ours with CUDA graphs / PyTorch eager, ms per step
ASYNC_GOAL = {1: 0.5, 4: 0.9}  # async images/s over the ceiling's, by nsync
HOP_GOAL = 2.0     # each hop's ms over its floor's
RACE_GOAL = 1.1    # ours / PyTorch, time to the target
RAW_TAG = 901      # (hops job) tags of this script's own messages: none of the protocol's
UPDATE_BYTES = 20  # bytes per parameter an SGD update with momentum moves (bench/server.py's roofline)
CHECK_BYTES = 4    # the finite check reads the gradient once


@dataclass(frozen=True)
class Sizes:
    """What each part runs: the GPU run's sizes, or the dry run's (tiny, seconds on 2 cores)."""

    step_models: tuple[str, ...] = ("cifar10", "resnet20")
    cli_models: tuple[str, ...] = ("cifar10", "resnet20")  # of these, also `train` runs (part 1)
    batch: int = 128          # images per step (parts 1, 2, 4)
    warmup: int = 10          # untimed steps per side (part 1)
    steps: int = 50           # timed steps per side (part 1)
    cli_steps: int = 60       # steps of each `train` run of part 1
    alexnet_model: str = "alexnet_1gpu_64"
    alexnet_dataset: str = "synthetic64"
    alexnet_seconds: float = 4.0   # training time of each part-2 run (--max-time)
    alexnet_runs: tuple = ()       # (nsync, servers, wire, overlap) of the async runs; () = `alexnet_runs`'s
    hops_params: int = 0           # 0: alexnet_model's parameter count
    hops_rounds: int = 7
    race_model: str = "resnet20"
    race_epochs: float = 15.0
    race_eval_every: float = 1.0
    race_target: float = 0.85
    race_lr: float = 0.1
    race_timeout: float = 300.0    # seconds per side


GPU = Sizes()
DRY = Sizes(cli_models=("cifar10",), batch=8, warmup=1, steps=2, cli_steps=6,
            alexnet_model="digits", alexnet_dataset="digits", alexnet_seconds=0.5,
            alexnet_runs=((4, 1, "bf16", True), (1, 2, "fp32", False), (1, 2, "fp32", True)),
            hops_params=1 << 16, hops_rounds=3, race_epochs=1.0, race_eval_every=0.5, race_target=0.05,
            race_timeout=120.0)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_e2e.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the cpu backend, tiny sizes (CI)")
    parser.add_argument("--only", type=name_list(list(PARTS)), default=list(PARTS), metavar="P1,P2",
                        help="parts to run: " + ", ".join(PARTS))
    parser.add_argument("--backend", default=None, choices=("cupy", "cpu", "numpy"),
                        help="our workers' backend (default: cupy; cpu with --dry-run)")
    parser.add_argument("--data", default=None, metavar="DIR", help="CIFAR-10 in an official layout (race; "
                        "the dry run writes a tiny one)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and the random batch")
    parser.add_argument("--alexnet-seconds", type=float, default=None, help="training time of each alexnet run "
                        f"(default {GPU.alexnet_seconds:g}; dry run {DRY.alexnet_seconds:g})")
    parser.add_argument("--alexnet-all", action="store_true", help="alexnet: all 16 combinations of nsync, S, wire "
                        "and overlap (default: each factor alone and all together, 10 runs)")
    parser.add_argument("--server-threads", type=int, default=1, help="alexnet: --server-threads of every async "
                        "run (each server rank's update on that many threads; the sweep after the parts times them)")
    parser.add_argument("--race-epochs", type=float, default=None, help="race: the cosine schedule's length, "
                        f"epochs (default {GPU.race_epochs:g})")
    parser.add_argument("--race-target", type=float, default=None, help=f"race: test accuracy to reach (default "
                        f"{GPU.race_target:g}; dry run {DRY.race_target:g})")
    parser.add_argument("--timeout", type=float, default=240.0, help="time limit of each mpiexec job but the "
                        "race's, seconds")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep run logs and files here (default: a "
                        "temporary folder)")
    parser.add_argument("--hops-rank", action="store_true", help=argparse.SUPPRESS)  # a rank of the hops job
    parser.add_argument("--hops-params", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--hops-rounds", type=int, default=GPU.hops_rounds, help=argparse.SUPPRESS)
    parser.add_argument("--hops-json", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.backend = args.backend or ("cpu" if args.dry_run else "cupy")
    base = DRY if args.dry_run else GPU
    args.sizes = dataclasses.replace(base, **{k: v for k, v in (
        ("alexnet_seconds", args.alexnet_seconds), ("race_epochs", args.race_epochs),
        ("race_target", args.race_target)) if v is not None})
    if "race" in args.only and not args.dry_run and not args.hops_rank and not args.data:
        parser.error("--only race (or all parts) needs --data DIR: CIFAR-10 (python /work/shared/tools/"
                     "cifar10_batches.py DIR writes it)")
    return args


# --- the device: timers and transfers -------------------------------------------------------------------------


class Clock:
    """Milliseconds of one step: between two CUDA events on the current stream, synchronised on the second
    (cupy, torch), or perf_counter (CPU)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "cupy" | "torch" | "cpu"

    def time(self, fn: Callable[[], Any]) -> float:
        if self.kind == "cupy":
            import cupy

            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(cupy.cuda.get_elapsed_time(start, end))
        if self.kind == "torch":
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)


def host_transfers() -> Any:
    """`mpiasgd.comms.staging.Transfers` whose "device" is host memory: the dry run's copies are host copies."""
    from mpiasgd.comms.staging import Transfers

    return Transfers(empty=lambda n: np.empty(n, np.float32), empty_bytes=lambda n: np.empty(n, np.uint8),
                     pinned=lambda n: np.empty(n, np.uint8), to_device=np.copyto, to_host=np.copyto,
                     synchronize=lambda: None)


def torch_or_none() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b > 0 else a / b


def train_job(args: argparse.Namespace, workers_and_servers: int, options: list[str], name: str, run_dir: str,
              limit: float) -> tuple[dict | None, str, list[str]]:
    """`mpiexec -n N python -m mpiasgd train OPTIONS` into run_dir/NAME.h5: (loaded log or None, why not, command).
    A Config the parser refuses is not launched: (None, "refused: ...")."""
    from mpiasgd.runlog import load

    full = [*options, "--no-progress", "--snapshot-interval", "0", "--checkpoint-interval", "0", "--name", name,
            "--run-dir", run_dir]
    cmd = [*launcher(), "-n", str(workers_and_servers), sys.executable, "-m", "mpiasgd", "train", *full]
    try:
        resolve(make_parser().parse_args(full))
    except ConfigError as e:
        return None, f"refused: {e}", cmd
    done = run(cmd, limit)
    if not done.ok:
        return None, "failed: " + done.explain(limit)[-1500:], cmd
    log = load(os.path.join(run_dir, name + ".h5"))
    if log.get("status") != "completed":
        return None, f"failed: log status {log.get('status')!r}\n{done.stderr[-1500:]}", cmd
    return log, "", cmd


def applied_rows(log: dict) -> np.ndarray:
    rows = log["pushes"]
    rows = rows[rows["applied"] == 1]
    return rows[np.argsort(rows["time"], kind="stable")]


# --- part 1: step time ------------------------------------------------------------------------------------------


def ours_eager(name: str, backend: str, seed: int, x: np.ndarray, y: np.ndarray, s: Sizes) -> dict:
    """Our step in this process: median ms, and the first step's loss (the same-work check)."""
    from vs_pytorch import LR, Ours  # bench/vs_pytorch.py

    ours = Ours.build(name, backend, seed)
    ops = ours.model.ops
    xd, yd = ops.asarray(x), ops.asarray(y, y.dtype)  # the batch on the device once: the step alone is timed

    def step() -> None:
        ours.model.forward_backward(xd, yd)
        ours.local.step(LR)

    first, _ = ours.model.forward_backward(xd, yd)
    ours.local.step(LR)
    for _ in range(s.warmup - 1):
        step()
    clock = Clock("cupy" if backend == "cupy" else "cpu")
    ms = [clock.time(step) for _ in range(s.steps)]
    return {"ms": median(ms), "min_ms": min(ms), "first_loss": float(first), "params": ours.model.num_params}


def ours_graphs(name: str, backend: str, seed: int, x: np.ndarray, y: np.ndarray, s: Sizes) -> dict:
    """Our step with forward and backward replayed from a CUDA graph (cupy): median ms, the first loss (which
    must be the eager step's), the graphs made and replayed."""
    if backend != "cupy":
        return {"ms": None, "why": "needs the cupy backend"}
    import cupy
    from vs_pytorch import LR, Ours

    from mpiasgd.ops.cuda.graphs import CupyGraphs, StepGraphs

    ours = Ours.build(name, backend, seed)
    graphs = StepGraphs(ours.model, CupyGraphs(cupy), "on")

    def step() -> Any:
        stats = graphs.step(x, y, 0)
        ours.local.step(LR)
        return stats

    first = step().get()[0]
    for _ in range(max(3, s.warmup - 1)):  # warm-up, capture, the checked replay at least
        step()
    clock = Clock("cupy")
    ms = [clock.time(step) for _ in range(s.steps)]
    return {"ms": median(ms), "min_ms": min(ms), "first_loss": float(first), "captured": graphs.captured,
            "replays": graphs.replays}


def torch_steps(name: str, seed: int, x: np.ndarray, y: np.ndarray, s: Sizes, torch: Any) -> dict:
    """PyTorch eager and with CUDA graphs (emulated on the CPU): median ms each, the first loss."""
    import torch.nn.functional as F
    from vs_pytorch import reference_net, torch_optimizer

    from mpiasgd.model import build_model

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)  # the dry run: one thread, as our cpu backend's single process
    if cuda:  # FP32 against FP32: cuDNN's best algorithm, no TF32
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    clock = Clock("torch" if cuda else "cpu")
    model = build_model(name)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    for variant in ("eager", "graphs"):
        net = reference_net(model, seed).to(device)
        opt = torch_optimizer(model, net)
        xs, ys = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)  # static input buffers

        def step(net: Any = net, opt: Any = opt, xs: Any = xs, ys: Any = ys, eager: bool = variant == "eager") -> Any:
            opt.zero_grad(set_to_none=eager)  # graphs: the captured gradients stay where the graph wrote them
            loss = F.cross_entropy(net(xs), ys)
            loss.backward()
            opt.step()
            return loss

        first = float(step())
        if variant == "graphs" and cuda:
            side = torch.cuda.Stream()  # warm-up on a side stream before capture, as torch.cuda.graphs asks
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run_step: Callable[[], Any] = graph.replay
        else:
            run_step = step
        for _ in range(s.warmup - 1):
            run_step()
        ms = [clock.time(run_step) for _ in range(s.steps)]
        out[variant] = {"ms": median(ms), "min_ms": min(ms), "first_loss": first}
    out["graphs"]["emulated"] = not cuda
    return out


def step_cli(args: argparse.Namespace, name: str, data: str, run_dir: str) -> dict:
    """Our step as `train --mode sync` runs it (one worker), with --cuda-graphs on (auto on the CPU, where on is
    refused) and off: per setting the median compute_s and the median interval between applied steps, in ms."""
    s = args.sizes
    out: dict[str, Any] = {"graphs": "built"}
    for setting in ("on" if args.backend == "cupy" else "auto", "off"):
        options = ["--model", name, "--data", data, "--mode", "sync", "--backend", args.backend,
                   "--batch-size", str(s.batch), "--epochs", "0", "--max-pushes", str(s.cli_steps), "--lr", "0.02",
                   "--lr-schedule", "constant", "--warmup-epochs", "0", "--seed", str(args.seed),
                   "--cuda-graphs", setting]
        label = f"graphs {setting}"
        log, why, cmd = train_job(args, 2, options, f"step-{name}-{setting}", run_dir, args.timeout)
        if log is None:
            out[label] = {"error": why, "command": shlex.join(cmd)}
            continue
        rows = applied_rows(log)[max(1, s.cli_steps // 5):]  # the first steps: allocation, first launches
        out[label] = {"compute_ms": 1e3 * float(np.median(rows["compute_s"])),
                      "step_ms": 1e3 * float(np.median(np.diff(rows["time"]))), "steps": len(rows),
                      "command": shlex.join(cmd)}
    return out


def part_step(args: argparse.Namespace, tmp: str) -> dict:
    from mpiasgd.data.convert import synth

    s = args.sizes
    torch = torch_or_none()
    data = synth(os.path.join(tmp, "s32.h5"), count=4 * s.batch, size=32, classes=10, test_count=s.batch,
                 seed=args.seed, progress=False)
    rng = np.random.default_rng(args.seed)
    out: dict[str, Any] = {"batch": s.batch, "torch": torch.__version__ if torch else "not installed"}
    for name in s.step_models:
        x = rng.standard_normal((s.batch, 3, 32, 32), dtype=np.float32)  # (N, C, H, W)
        y = rng.integers(0, 10, s.batch).astype(np.int64)
        row: dict[str, Any] = {"ours_eager": ours_eager(name, args.backend, args.seed, x, y, s),
                               "ours_graphs": ours_graphs(name, args.backend, args.seed, x, y, s),
                               "ours_train": step_cli(args, name, data, tmp) if name in s.cli_models else {}}
        if torch is not None:
            theirs = torch_steps(name, args.seed, x, y, s, torch)
            row["torch"] = theirs
            row["first_loss_diff"] = abs(row["ours_eager"]["first_loss"] - theirs["eager"]["first_loss"])
            mine = row["ours_eager"]["ms"]
            graphed = row["ours_graphs"]["ms"]
            row["ratios"] = {"ours_eager/torch_eager": ratio(mine, theirs["eager"]["ms"]),
                             "ours_eager/torch_graphs": ratio(mine, theirs["graphs"]["ms"]),
                             "ours_graphs/torch_eager": ratio(graphed, theirs["eager"]["ms"]),
                             "ours_graphs/torch_graphs": ratio(graphed, theirs["graphs"]["ms"])}
        out[name] = row
        print(f"  step {name}: ours {row['ours_eager']['ms']:.3f} ms"
              + (f", PyTorch eager {row['torch']['eager']['ms']:.3f} ms, graphs {row['torch']['graphs']['ms']:.3f} ms"
                 if torch else ", PyTorch not installed"), flush=True)
    return out


# --- part 2: alexnet_1gpu_64, one worker alone against async ----------------------------------------------------


def alexnet_runs(s: Sizes, full: bool = False) -> list[tuple[int, int, str, bool]]:
    """(nsync, servers, wire, overlap) of every async run, in the table's order: the dry run's, or all 16
    combinations (`full`), or by default one factor at a time: for nsync 1 and 4, S = 1 fp32 without overlap,
    then bf16, overlap, S = 2 each alone, then all three (10 runs: 16 do not fit the part's 3 minutes)."""
    if s.alexnet_runs:
        return list(s.alexnet_runs)
    if full:
        return [(n, srv, w, o) for n in (1, 4) for srv in (1, 2) for w in ("fp32", "bf16") for o in (False, True)]
    return [run for n in (1, 4) for run in ((n, 1, "fp32", False), (n, 1, "bf16", False), (n, 1, "fp32", True),
                                             (n, 2, "fp32", False), (n, 2, "bf16", True))]


def throughput(log: dict) -> dict:
    """images/s of the run log's summary and of its steady window (the applied pushes after the first fifth),
    and the workers' share of time waiting (bench/servers_table.py's)."""
    from servers_table import wait_share  # bench/servers_table.py

    from mpiasgd.tools.report import DEFAULT_TARGET, comparison_row

    rows = applied_rows(log)
    kept = rows[len(rows) // 5:]
    span = float(kept["time"][-1] - kept["time"][0]) if len(kept) > 1 else 0.0
    return {"images_per_s": float(comparison_row(log, DEFAULT_TARGET)["images_per_s"]),
            "steady_images_per_s": float(kept["samples"][1:].sum()) / span if span > 0 else None,
            "compute_images_per_s": float(np.median(kept["samples"] / kept["compute_s"])),  # no exchange at all
            "pushes": len(rows), "wait_share": wait_share(log)}


def part_alexnet(args: argparse.Namespace, tmp: str) -> dict:
    s = args.sizes
    common = ["--model", s.alexnet_model, "--dataset", s.alexnet_dataset, "--backend", args.backend,
              "--batch-size", str(s.batch), "--epochs", "0", "--max-time", f"{s.alexnet_seconds:g}", "--lr", "0.01",
              "--seed", str(args.seed)]
    limit = args.timeout
    log, why, cmd = train_job(args, 2, [*common, "--mode", "sync"], "alexnet-ceiling", tmp, limit)
    if log is None:
        raise RuntimeError(f"the ceiling run (sync, one worker) failed: {why}")
    ceiling = {**throughput(log), "command": shlex.join(cmd)}
    print(f"  alexnet ceiling: {ceiling['images_per_s']:,.0f} images/s", flush=True)
    rows = []
    for nsync, servers, wire, overlap in alexnet_runs(s, args.alexnet_all):
        label = f"nsync {nsync}, S = {servers}, {wire}, overlap {'on' if overlap else 'off'}"
        options = [*common, "--mode", "async", "--nsync", str(nsync), "--servers", str(servers), "--wire", wire,
                   "--server-threads", str(args.server_threads), *(["--overlap"] if overlap else [])]
        log, why, cmd = train_job(args, 1 + servers, options, f"alexnet-n{nsync}-s{servers}-{wire}-o{int(overlap)}",
                                  tmp, limit)
        row: dict[str, Any] = {"label": label, "nsync": nsync, "servers": servers, "wire": wire, "overlap": overlap,
                               "command": shlex.join(cmd)}
        if log is None:
            row["status"] = why.split(":")[0]
            row["why"] = why
        else:
            row.update(status="ran", **throughput(log))
            row["ratio"] = ratio(row["images_per_s"], ceiling["images_per_s"])
            row["steady_ratio"] = ratio(row["steady_images_per_s"], ceiling["steady_images_per_s"])
            row["compute_ratio"] = ratio(row["steady_images_per_s"], ceiling["compute_images_per_s"])
        rows.append(row)
        print(f"  alexnet {label}: " + (f"{row['images_per_s']:,.0f} images/s ({row['ratio']:.2f} of the ceiling)"
                                        if log is not None else row["status"]), flush=True)
    return {"model": s.alexnet_model, "dataset": s.alexnet_dataset, "batch": s.batch, "seconds": s.alexnet_seconds,
            "ceiling": ceiling, "runs": rows}


# --- part 3: the hops of one push and pull ----------------------------------------------------------------------


def hops_rank(args: argparse.Namespace) -> int:
    """(a rank of the hops job) rank 1 the worker, rank 0 the server; rank 0 writes --hops-json."""
    from mpi4py import MPI

    from mpiasgd.comms.protocol import Message
    from mpiasgd.comms.staging import PinnedStaging, cupy_transfers
    from mpiasgd.comms.waits import wait
    from mpiasgd.optim import SGD
    from mpiasgd.optim.sgd import finite_square

    comm = MPI.COMM_WORLD
    rank, P, rounds = comm.Get_rank(), args.hops_params, args.hops_rounds
    nbytes = 4 * P
    times: dict[str, list[float]] = {}

    def keep(key: str, seconds: float) -> None:
        times.setdefault(key, []).append(1e3 * seconds)

    def timed(fn: Callable[[], Any]) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    if rank == 1:  # (the worker)
        if args.backend == "cupy":
            from mpiasgd.device import use_device

            use_device(0, rank, MPI.Get_processor_name())
            dev = cupy_transfers()
        else:
            dev = host_transfers()
        staging = PinnedStaging(P, dev, "fp32")
        staging.grads[...] = 1e-3  # (device) a gradient
        raw_dev, raw_host = dev.empty(P), dev.pinned(nbytes).view(np.float32)
    else:  # (the server)
        from server import Roofline, layer_mask  # bench/server.py

        inbox, reply = Message(P), Message(P)
        weights = np.random.default_rng(0).standard_normal(P, dtype=np.float32)
        opt = SGD(weights, layer_mask(P), 0.9, 5e-4)
        roof = Roofline(P)
        roof.first_step()  # numba's loops loaded before any clock runs
    raw = np.ones(nbytes, np.uint8)
    copies: list[float] = []
    for r in range(rounds + 1):  # round 0: warm-up (first touch, first copies), not kept
        def note(key: str, seconds: float, r: int = r) -> None:
            if r:
                keep(key, seconds)

        comm.Barrier()
        if rank == 1:
            note("d2h", timed(lambda: (staging.before_send(), dev.synchronize())))
            note("d2h raw", timed(lambda: (dev.to_host(raw_host, raw_dev), dev.synchronize())))
            comm.Barrier()
            wait(comm.Isend(staging.send_buf, 0, RAW_TAG), "the push's send", rank, 60.0)
            comm.Barrier()
            comm.Send(raw, 0, RAW_TAG + 1)
            comm.Barrier()
            note("reply", timed(lambda: wait(comm.Irecv(staging.recv_buf, 0, RAW_TAG + 2), "the reply", rank, 60.0)))
            comm.Barrier()
            note("mpi raw 1", timed(lambda: comm.Recv(raw, 0, RAW_TAG + 3)))
            note("h2d", timed(lambda: (staging.after_receive(), dev.synchronize())))
            note("h2d raw", timed(lambda: (dev.to_device(raw_dev, raw_host), dev.synchronize())))
        else:
            comm.Barrier()
            note("push", timed(lambda: wait(comm.Irecv(inbox.buf, 1, RAW_TAG), "the push", rank, 60.0)))
            comm.Barrier()
            note("mpi raw 0", timed(lambda: comm.Recv(raw, 1, RAW_TAG + 1)))
            note("check", timed(lambda: finite_square(inbox.payload)))
            note("update", timed(lambda: opt.step(inbox.payload, 0.01, out=reply.payload)))
            comm.Barrier()
            wait(comm.Isend(reply.buf, 1, RAW_TAG + 2), "the reply's send", rank, 60.0)
            comm.Barrier()
            comm.Send(raw, 1, RAW_TAG + 3)
            if r:
                copies.append(roof.copy_bandwidth(1))  # bytes/s read + written (STREAM's count)
    worker = comm.gather(times if rank == 1 else None, root=0)
    if rank == 0:
        both = {**times, **worker[1]}
        copy_gbs = median(copies) / 1e9
        mpi = [*both.pop("mpi raw 0"), *both.pop("mpi raw 1")]
        floors = {"d2h": min(both.pop("d2h raw")), "h2d": min(both.pop("h2d raw")), "push": min(mpi),
                  "reply": min(mpi), "check": CHECK_BYTES * P / (copy_gbs * 1e9) * 1e3,
                  "update": UPDATE_BYTES * P / (copy_gbs * 1e9) * 1e3}
        order = ("d2h", "push", "check", "update", "reply", "h2d")
        hops = {k: {"ms": median(both[k]), "min_ms": min(both[k]), "floor_ms": floors[k],
                    "bytes": {"check": CHECK_BYTES * P, "update": UPDATE_BYTES * P}.get(k, nbytes)} for k in order}
        for hop in hops.values():
            hop["ratio"] = ratio(hop["ms"], hop["floor_ms"])
            hop["floor_gb_per_s"] = hop["bytes"] / (hop["floor_ms"] * 1e6)
        total = sum(h["ms"] for h in hops.values())
        floor = sum(h["floor_ms"] for h in hops.values())
        with open(args.hops_json, "w", encoding="utf-8") as f:
            json.dump({"params": P, "bytes": nbytes, "rounds": rounds, "copy_gb_per_s": copy_gbs, "hops": hops,
                       "total_ms": total, "total_floor_ms": floor, "total_ratio": ratio(total, floor)}, f)
    return 0


def part_hops(args: argparse.Namespace, tmp: str) -> dict:
    from mpiasgd.model import build_model

    s = args.sizes
    P = s.hops_params or build_model(s.alexnet_model).num_params
    path = os.path.join(tmp, "hops.json")
    cmd = [*launcher(), "-n", "2", sys.executable, os.path.abspath(__file__), "--hops-rank", "--backend",
           args.backend, "--hops-params", str(P), "--hops-rounds", str(s.hops_rounds), "--hops-json", path]
    done = run(cmd, args.timeout)
    if not done.ok:
        raise RuntimeError(done.explain(args.timeout))
    with open(path, encoding="utf-8") as f:
        out = json.load(f)
    out["model"] = s.alexnet_model
    out["command"] = shlex.join(cmd)
    print(f"  hops: one push and pull {out['total_ms']:.2f} ms against a floor of {out['total_floor_ms']:.2f} ms",
          flush=True)
    return out


# --- part 4: the race to 85 % -----------------------------------------------------------------------------------


def tiny_cifar(folder: str, seed: int) -> str:
    """A learnable CIFAR-10 in the official binary layout (class templates plus noise): 5 x 16 train, 40 test."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, size=(10, 3072)).astype(np.float32)
    bn = os.path.join(folder, "cifar-10-batches-bin")
    os.makedirs(bn, exist_ok=True)
    for name, n in [*((f"data_batch_{i}", 16) for i in range(1, 6)), ("test_batch", 40)]:
        y = rng.permutation(np.arange(n) % 10).astype(np.uint8)
        x = np.clip(templates[y] + rng.normal(0, 40, (n, 3072)), 0, 255).astype(np.uint8)
        np.concatenate([y[:, None], x], axis=1).tofile(os.path.join(bn, name + ".bin"))
    return folder


def race_command(args: argparse.Namespace, data: str, run_dir: str) -> list[str]:
    """mpiexec ... train: resnet20, one sync worker, cosine over --race-epochs, evaluations and the stop."""
    from vs_pytorch import MOMENTUM, WEIGHT_DECAY

    s = args.sizes
    return [*launcher(), "-n", "2", sys.executable, "-m", "mpiasgd", "train", "--model", s.race_model,
            "--data-dir", data, "--mode", "sync", "--backend", args.backend, "--batch-size", str(s.batch),
            "--lr", f"{s.race_lr:g}", "--lr-scaling", "none", "--lr-schedule", "cosine", "--warmup-epochs", "0.5",
            "--momentum", f"{MOMENTUM:g}", "--weight-decay", f"{WEIGHT_DECAY:g}", "--epochs", repr(s.race_epochs),
            "--max-pushes", "0", "--max-time", "0", "--eval-interval", f"{s.race_eval_every!r}ep",
            "--stop-accuracy", repr(s.race_target), "--seed", str(args.seed), "--snapshot-interval", "0",
            "--checkpoint-interval", "0", "--no-progress", "--run-dir", run_dir, "--name", "race"]


def torch_race(setup: dict, torch: Any, limit: float) -> Any:
    """PyTorch in this process on the device, on mpiasgd's work (bench/vs_pytorch.py's `race_worker` with one
    process: the same stream, schedule, evaluations and stop); a `RaceRun`."""
    import torch.nn.functional as F
    from vs_pytorch import LR, RaceRun, race_lr, reference_net, torch_optimizer

    from mpiasgd.data import MinibatchStream, ShardSampler, load_dataset
    from mpiasgd.model import MODELS, build_model
    from mpiasgd.optim import EvalSchedule, Schedule, StopRule

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dataset = load_dataset(MODELS[setup["model"]].dataset, setup["data_dir"])
    model = build_model(setup["model"])
    net = reference_net(model, setup["seed"]).to(device)
    optimizer = torch_optimizer(model, net)
    mults = [group["lr"] / LR for group in optimizer.param_groups]
    schedule, rule = Schedule(**setup["schedule"]), StopRule(**setup["rule"])
    evals = EvalSchedule(setup["eval_every"], "ep")
    evals.start(0.0, 0.0)
    sampler = ShardSampler(dataset.num_train, 1, 0, setup["seed"], dataset.chunk, setup["shuffle_window"])
    stream = MinibatchStream(dataset, sampler, setup["batch"], setup["seed"], 1, prefetch=setup["prefetch"])

    def evaluate() -> float:
        correct = 0
        net.eval()
        with torch.no_grad():
            for start in range(0, dataset.num_test, setup["eval_batch"]):
                idx = np.arange(start, min(start + setup["eval_batch"], dataset.num_test))
                x, y = dataset.batch("test", idx)
                correct += int((net(torch.from_numpy(x).to(device)).argmax(1).cpu().numpy() == y).sum())
        net.train()
        return correct / dataset.num_test

    rows: list[tuple[float, float]] = []
    applied, train_s, per_step = 0, 0.0, setup["batch"]
    wall = time.perf_counter()
    t0 = time.perf_counter()
    try:
        while True:
            x, y, _ = stream.next()  # (B, 3, 32, 32) float32 augmented and normalised, (B,) int64
            lr = race_lr(schedule, rule, applied, per_step, dataset.num_train, train_s + time.perf_counter() - t0)
            for group, mult in zip(optimizer.param_groups, mults, strict=True):
                group["lr"] = lr * mult
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(torch.from_numpy(x).to(device)), torch.from_numpy(y).to(device))
            loss.backward()
            optimizer.step()
            applied += 1
            epochs = applied * per_step / dataset.num_train
            last = bool(rule.reason(applied * per_step, dataset.num_train, applied, train_s + time.perf_counter() - t0))
            if last or evals.due(train_s + time.perf_counter() - t0, epochs):
                sync()  # the clock stops with the device's work done
                train_s += time.perf_counter() - t0
                rows.append((train_s, evaluate()))
                last = last or rows[-1][1] >= setup["stop_at"] or time.perf_counter() - wall > limit
                t0 = time.perf_counter()
            if last:
                break
    finally:
        stream.close()
    return RaceRun(f"PyTorch ({device.type})", rows, applied * per_step, train_s, rows[-1][1],
                   {"steps": applied, "wall_s": time.perf_counter() - wall, "torch": torch.__version__})


def part_race(args: argparse.Namespace, tmp: str) -> dict:
    from vs_pytorch import RaceRun, race_setup, run_race_mpiasgd

    s = args.sizes
    data = args.data or tiny_cifar(os.path.join(tmp, "cifar10"), args.seed)
    cmd = race_command(args, data, tmp)
    setup = race_setup(cmd)
    out: dict[str, Any] = {"model": s.race_model, "target": s.race_target, "epochs": s.race_epochs,
                           "batch": s.batch, "lr": s.race_lr, "command": shlex.join(cmd), "runs": {}}
    runs: list[RaceRun] = []
    try:
        ours = run_race_mpiasgd(argparse.Namespace(timeout=s.race_timeout, backend=args.backend), cmd,
                                os.path.join(tmp, "race.h5"))
        runs.append(ours)
    except SystemExit as e:  # vs_pytorch's reader exits with the reason
        out["runs"]["mpiasgd"] = {"error": str(e)[-1500:]}
    torch = torch_or_none()
    if torch is None:
        out["runs"]["PyTorch"] = {"error": "torch not installed"}
    else:
        runs.append(torch_race(setup, torch, s.race_timeout))
    for r in runs:
        out["runs"][r.name] = {"time_to_target_s": r.time_to(s.race_target), "evals": r.evals,
                               "final_accuracy": r.final_accuracy, "train_s": r.seconds,
                               "images_per_s": r.images_per_s}
        print(f"  race {r.name}: time to {100 * s.race_target:g} %: "
              + (f"{r.time_to(s.race_target):.1f} s" if r.time_to(s.race_target) is not None else "not reached")
              + f" (final {100 * r.final_accuracy:.2f} %)", flush=True)
    if len(runs) == 2:
        out["ratio"] = ratio(runs[0].time_to(s.race_target), runs[1].time_to(s.race_target))
    return out


# --- output -----------------------------------------------------------------------------------------------------


def fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def markdown(result: dict) -> str:
    """The tables of every part that ran."""
    meta, parts = result["meta"], result["parts"]
    dry = " (DRY RUN: tiny sizes, CPU)" if meta["dry_run"] else ""
    lines = [f"# gpu_e2e: {meta['device']}, backend {meta['backend']}{dry}",
             "", f"{meta['date']}, commit {meta['commit']}, `{meta['command']}`", ""]
    for name, part in parts.items():
        lines += [f"## {name} ({result['wall_s'].get(name, 0):.0f} s)", ""]
        if "error" in part:
            lines += ["```", part["error"], "```", ""]
            continue
        if name == "step":
            lines += [f"ms per step at batch {part['batch']} (median); ratios ours / PyTorch "
                      f"(goal with graphs <= {STEP_GOAL:g}); PyTorch {part['torch']}", "",
                      "| network | ours eager | ours graphs | ours train: compute / step | train's --cuda-graphs | "
                      "PyTorch eager | PyTorch graphs | ours eager / PyTorch eager | ours eager / PyTorch graphs | "
                      "ours graphs / PyTorch eager | ours graphs / PyTorch graphs |",
                      "| :-- | --: | --: | --: | :-- | --: | --: | --: | --: | --: | --: |"]
            for net, row in part.items():
                if not isinstance(row, dict):
                    continue
                train = row["ours_train"]
                cells = [f"{k}: {fmt(v.get('compute_ms'))} / {fmt(v.get('step_ms'))}" for k, v in train.items()
                         if isinstance(v, dict)]
                theirs, ratios = row.get("torch"), row.get("ratios", {})
                graphed = row["ours_graphs"]
                lines.append(f"| {net} | {fmt(row['ours_eager']['ms'])} | "
                             f"{fmt(graphed['ms']) if graphed['ms'] is not None else graphed['why']} | "
                             f"{'; '.join(cells) or '-'} | "
                             f"{train.get('graphs', '-')} | "
                             f"{fmt(theirs and theirs['eager']['ms'])} | {fmt(theirs and theirs['graphs']['ms'])}"
                             f"{' (emulated)' if theirs and theirs['graphs'].get('emulated') else ''} | "
                             f"{fmt(ratios.get('ours_eager/torch_eager'), '.2f')} | "
                             f"{fmt(ratios.get('ours_eager/torch_graphs'), '.2f')} | "
                             f"{fmt(ratios.get('ours_graphs/torch_eager'), '.2f')} | "
                             f"{fmt(ratios.get('ours_graphs/torch_graphs'), '.2f')} |")
        elif name == "alexnet":
            c = part["ceiling"]
            lines += [f"{part['model']}, batch {part['batch']}, {part['dataset']}, {part['seconds']:g} s each; "
                      f"ceiling (sync, one worker): {c['images_per_s']:,.0f} images/s (steady "
                      f"{fmt(c['steady_images_per_s'], ',.0f')}; its compute alone, forward + backward: "
                      f"{fmt(c['compute_images_per_s'], ',.0f')}); goals: nsync 1 >= {ASYNC_GOAL[1]:g}, nsync 4 >= "
                      f"{ASYNC_GOAL[4]:g}", "",
                      "| async run | images/s | / ceiling | steady / ceiling | steady / compute alone | waiting |",
                      "| :-- | --: | --: | --: | --: | --: |"]
            for r in part["runs"]:
                if r["status"] != "ran":
                    lines.append(f"| {r['label']} | {r['status']} | | | | |")
                else:
                    lines.append(f"| {r['label']} | {r['images_per_s']:,.0f} | {fmt(r['ratio'], '.2f')} | "
                                 f"{fmt(r['steady_ratio'], '.2f')} | {fmt(r['compute_ratio'], '.2f')} | "
                                 f"{fmt(100 * r['wait_share'], '.0f')} % |")
        elif name == "hops":
            lines += [f"{part['model']}: {part['params']:,} parameters, {part['bytes'] / 1e6:,.1f} MB each way; "
                      f"median of {part['rounds']} rounds; goal: each hop within {HOP_GOAL:g}x its floor", "",
                      "| hop | ms | floor ms | floor GB/s | ms / floor |", "| :-- | --: | --: | --: | --: |"]
            for hop, h in part["hops"].items():
                lines.append(f"| {hop} | {h['ms']:.3f} | {h['floor_ms']:.3f} | {h['floor_gb_per_s']:.1f} | "
                             f"{fmt(h['ratio'], '.2f')} |")
            lines.append(f"| one push and pull | {part['total_ms']:.3f} | {part['total_floor_ms']:.3f} | | "
                         f"{fmt(part['total_ratio'], '.2f')} |")
        elif name == "race":
            lines += [f"{part['model']}, batch {part['batch']}, lr {part['lr']:g} cosine over {part['epochs']:g} "
                      f"epochs: training time to {100 * part['target']:g} % (goal ours / PyTorch <= {RACE_GOAL:g}): "
                      f"{fmt(part.get('ratio'), '.2f')}", "", "| run | time to target, s | final accuracy | images/s |",
                      "| :-- | --: | --: | --: |"]
            for who, r in part["runs"].items():
                lines.append(f"| {who} | error: {r['error'][:200]} | | |" if "error" in r else
                             f"| {who} | {fmt(r['time_to_target_s'], '.1f')} | {100 * r['final_accuracy']:.2f} % | "
                             f"{r['images_per_s']:,.0f} |")
        lines.append("")
    return "\n".join(lines)


def finite(value: Any) -> Any:
    """`value` with every non-finite float (a ratio of nothing, a share of no time) as None: strict JSON."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer | np.bool_):
        return value.item()
    return value


def device_name(backend: str) -> str:
    if backend != "cupy":
        return f"cpu ({os.cpu_count()} cores)"
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


def commit() -> str:
    done = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for var in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        os.environ.setdefault(var, "1")
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])
    if args.hops_rank:
        return hops_rank(args)
    if args.backend == "cupy":
        from mpiasgd.ops import cuda_probe

        count, why = cuda_probe()
        if not count:
            print(f"gpu_e2e.py: --backend cupy needs a usable GPU: {why} (no GPU here? --dry-run)", file=sys.stderr)
            return 2
    started = time.perf_counter()
    tmp_holder = None if args.keep else tempfile.TemporaryDirectory(prefix="gpu_e2e-")
    tmp = args.keep or tmp_holder.name
    os.makedirs(tmp, exist_ok=True)
    result: dict[str, Any] = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit(), "device": device_name(args.backend),
                 "backend": args.backend, "dry_run": args.dry_run, "sizes": dataclasses.asdict(args.sizes),
                 "command": shlex.join(["python", "bench/gpu_e2e.py", *(sys.argv[1:] if argv is None else argv)])},
        "parts": {}, "wall_s": {}}
    failed = False
    runners = {"step": part_step, "alexnet": part_alexnet, "hops": part_hops, "race": part_race}
    try:
        for name in args.only:
            print(f"== {name}", flush=True)
            t = time.perf_counter()
            try:
                result["parts"][name] = runners[name](args, tmp)
            except Exception as e:  # one part's failure is reported; the next part still runs
                failed = True
                result["parts"][name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
                print(f"  {name} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            result["wall_s"][name] = time.perf_counter() - t
    finally:
        if tmp_holder is not None:
            tmp_holder.cleanup()
    result["wall_s"]["total"] = time.perf_counter() - started
    text = markdown(result)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_e2e.json"), "w", encoding="utf-8") as f:
            json.dump(finite(result), f, indent=2, allow_nan=False, default=str)
        with open(os.path.join(out, "gpu_e2e.md"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    print(f"gpu_e2e: {result['wall_s']['total']:.0f} s" + (f"; written to {out}/gpu_e2e.json and .md" if out else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
