"""The pure logic of the benchmark scripts (bench/), on crafted numbers; the scripts themselves run MPI
jobs for minutes and are not part of the test suite.

bench/nsync.py: the trailing mean of the training loss over the latest pushes holding at least a
window of images, and the time at which it first reaches a target.

dev/sass_mix.py (the kernel lab): finding the conv kernels' main loops in disassembled machine code.

bench/resnet20_torch.py and bench/decoupling.py: their options as mpiasgd's own parser reads them, the
work the PyTorch side is given (minibatches, augmentation, step sizes: against a real sync worker run
in-process; initial weights under PyTorch's names, param groups, BatchNorm settings), FDG's cuts, and
their tables and goal lines (no PyTorch: the script imports it only to train).

bench/server.py: the order of its runs (each sharded run right after the one-server run it is set against) and
the sharding goal's figure, the busiest shard's CPU per push over the one server's, round by round.

bench/kernels.py: the conv layers it times (from the cifar10 model), the implicit GEMM shape and
FLOP count of each pass, the FP32 peak from (compute capability, SMs, clock), the error and ratio
columns of its table and the goal lines; and its exit status 2 on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import their siblings
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "dev"))  # the kernel lab's scripts

import decoupling  # bench/decoupling.py
import resnet20_torch as r20  # bench/resnet20_torch.py
from nsync import time_to_loss, trailing_mean
from sass_mix import LOOPS, function_bodies, hot_loops, pick

from kernels import (  # bench/kernels.py, not the kernels/ folder of .cu files
    ConvLayer,
    PassResult,
    Timing,
    bench_layers,
    format_row,
    fp32_lanes_per_sm,
    fp32_peak_flops,
    gemm_flops,
    goal_lines,
    implicit_gemm,
    kernel_resources,
    layer_lines,
    relative_error,
    tflops,
    tuned_lines,
)
from mpiasgd.config import make_parser, resolve
from mpiasgd.model import build_model
from mpiasgd.ops import cuda_device_count
from mpiasgd.optim import Schedule, StopRule, fraction_done, learning_rate

REPO = Path(__file__).resolve().parents[2]


def test_trailing_mean_waits_for_a_full_window_then_slides():
    loss = np.array([4.0, 3.0, 2.0, 1.0, 0.0])
    samples = np.array([10, 10, 10, 10, 10])
    curve = trailing_mean(loss, samples, window=20)
    assert np.isnan(curve[0])                            # 10 images < 20: undefined
    np.testing.assert_allclose(curve[1:], [3.5, 2.5, 1.5, 0.5])  # the latest two pushes each time


def test_trailing_mean_weights_by_images_and_takes_the_shortest_sufficient_window():
    loss = np.array([1.0, 2.0, 5.0])
    samples = np.array([30, 10, 30])
    curve = trailing_mean(loss, samples, window=35)
    # push 1: pushes 0..1 (40 >= 35); push 2: pushes 1..2 (40 >= 35), not 0..2
    np.testing.assert_allclose(curve, [np.nan, (30 * 1 + 10 * 2) / 40, (10 * 2 + 30 * 5) / 40])


def test_a_push_larger_than_the_window_is_its_own_mean():
    """nsync 100: one push holds more images than an epoch."""
    loss = np.array([0.9, 0.4, 0.2])
    samples = np.array([3200, 3200, 3200])
    np.testing.assert_allclose(trailing_mean(loss, samples, window=1437), loss)


def test_time_to_loss_is_the_first_push_at_or_below_the_target():
    times = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    loss = np.array([0.0, 2.0, 0.5, 0.3, 0.1])  # push 0 alone is below, but before a full window
    samples = np.full(5, 10)
    # trailing means over 20 images: nan, 1.0, 1.25, 0.4, 0.2
    assert time_to_loss(times, loss, samples, target=0.4, window=20) == pytest.approx(0.4)
    assert time_to_loss(times, loss, samples, target=0.2, window=20) == pytest.approx(0.5)
    assert time_to_loss(times, loss, samples, target=0.1, window=20) == math.inf


def test_time_to_loss_of_no_pushes_is_never():
    empty = np.array([])
    assert time_to_loss(empty, empty, np.array([], dtype=np.int64), target=1.0, window=10) == math.inf


# ----------------------------------------------------------------------------------------------
# bench/kernels.py


def test_kernel_bench_layers_are_the_cifar10_convs_and_one_larger_layer():
    layers = {layer.name: layer for layer in bench_layers(128)}
    assert list(layers) == ["conv1", "conv2", "conv3", "large"]
    expected = {  # x (N, C, H, W), w (K, C, R, S), stride, pad, y (N, K, P, Q): 32 -> pool -> 15 -> pool -> 7
        "conv1": ((128, 3, 32, 32), (32, 3, 5, 5), 1, 2, (128, 32, 32, 32)),
        "conv2": ((128, 32, 15, 15), (32, 32, 5, 5), 1, 2, (128, 32, 15, 15)),
        "conv3": ((128, 32, 7, 7), (64, 32, 5, 5), 1, 2, (128, 64, 7, 7)),
        "large": ((128, 64, 32, 32), (128, 64, 3, 3), 1, 1, (128, 128, 32, 32)),
    }
    for name, (x, w, stride, pad, y) in expected.items():
        layer = layers[name]
        assert (layer.x_shape, layer.w_shape, layer.stride, layer.pad, layer.dy_shape) == (x, w, stride, pad, y)
    assert [layer.in_model for layer in layers.values()] == [True, True, True, False]
    assert [layer.needs_dgrad for layer in layers.values()] == [False, True, True, True]  # conv1: the input layer
    assert bench_layers(7)[1].x_shape == (7, 32, 15, 15)


def test_implicit_gemm_shapes_and_flops_of_each_pass():
    conv2 = ConvLayer("conv2", (128, 32, 15, 15), (32, 32, 5, 5), 1, 2, True, True)
    assert implicit_gemm("fprop", conv2) == (32, 128 * 15 * 15, 32 * 25)  # K x N*P*Q x C*R*S
    assert implicit_gemm("dgrad", conv2) == (32, 128 * 15 * 15, 32 * 25)  # C x N*H*W x K*R*S
    assert implicit_gemm("wgrad", conv2) == (32, 32 * 25, 128 * 15 * 15)  # K x C*R*S x N*P*Q
    conv3 = ConvLayer("conv3", (128, 32, 7, 7), (64, 32, 5, 5), 1, 2, True, True)
    assert implicit_gemm("fprop", conv3) == (64, 6272, 800)
    assert implicit_gemm("dgrad", conv3) == (32, 6272, 1600)
    assert implicit_gemm("wgrad", conv3) == (64, 800, 6272)
    strided = ConvLayer("s2", (2, 3, 8, 8), (4, 3, 3, 3), 2, 1, False, True)  # P = Q = (8 + 2 - 3)//2 + 1 = 4
    assert implicit_gemm("fprop", strided) == (4, 2 * 4 * 4, 27)
    assert implicit_gemm("dgrad", strided) == (3, 2 * 8 * 8, 36)
    with pytest.raises(ValueError, match="unknown pass 'bprop'"):
        implicit_gemm("bprop", strided)
    assert gemm_flops(32, 28800, 800) == 2 * 32 * 28800 * 800 == 1_474_560_000
    assert tflops(1.5e9, 0.1) == pytest.approx(15.0)  # 1.5 GFLOP in 0.1 ms


def test_fp32_peak_from_compute_capability_sms_and_clock():
    assert fp32_peak_flops(9, 0, 132, 1_980_000) == pytest.approx(66.9e12, rel=1e-3)  # H200 / H100 SXM
    assert fp32_peak_flops(8, 0, 108, 1_410_000) == pytest.approx(19.49e12, rel=1e-3)  # A100: 64 lanes per SM
    assert fp32_peak_flops(7, 0, 80, 1_530_000) == pytest.approx(15.67e12, rel=1e-3)  # V100
    assert fp32_peak_flops(8, 6, 82, 1_695_000) == pytest.approx(35.6e12, rel=1e-3)  # RTX 3090: 128 lanes
    assert [fp32_lanes_per_sm(*cc) for cc in [(7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0)]] == \
        [64, 64, 128, 128, 128, 128]
    assert fp32_lanes_per_sm(6, 1) is None and fp32_peak_flops(6, 1, 28, 1_582_000) is None  # not in the table
    assert fp32_peak_flops(9, 0, 132, 0) is None  # no clock known


def test_relative_error_is_scaled_by_the_largest_reference_value():
    ref = np.array([[4.0, -8.0], [2.0, 0.0]], dtype=np.float32)
    ours = ref + np.array([[0.0, 0.0], [0.004, 0.0]], dtype=np.float32)
    assert relative_error(ours, ref) == pytest.approx(0.004 / 8.0, rel=1e-4)
    assert relative_error(ref, ref) == 0.0
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_error(np.ones(3), np.zeros(3)) == math.inf


def _result(layer, pass_name, ours_ms, cudnn_ms=None, in_model=True, error=None, late=0, error64=None,
            cudnn_error64=None):
    cudnn = None if cudnn_ms is None else Timing(cudnn_ms, cudnn_ms)
    return PassResult(layer, in_model, pass_name, (32, 28800, 800), Timing(ours_ms, ours_ms * 0.9, late), cudnn,
                      0.01, error, error64=error64, cudnn_error64=cudnn_error64)


def test_table_row_gives_throughput_ratio_tflops_and_fraction_of_peak():
    r = _result("conv2", "fprop", 0.1, cudnn_ms=0.08, error=3e-7, error64=2e-7, cudnn_error64=1e-7)
    assert r.ratio == pytest.approx(0.8)  # cuDNN ms / ours ms: ours at 80 % of cuDNN's throughput
    row = format_row(r, peak_flops=66.9e12)
    cols = row.split()
    assert cols[:7] == ["conv2", "fprop", "32", "x", "28800", "x", "800"]
    assert "0.1000 (0.0900)" in row and "0.0800 (0.0800)" in row
    assert cols[-6:] == ["0.80", "14.75", "22.0", "0.0100", "3.0e-07", "2.0e-07|1.0e-07"]  # 1.47456 GFLOP / 0.1 ms
    flagged = format_row(_result("conv3", "wgrad", 0.05, cudnn_ms=0.1, error=2e-4, late=3), peak_flops=None)
    assert flagged.split()[-2:] == ["2.0e-04", "-|-!~"]  # no float64 reference: above 1e-4 against cuDNN flags ours
    assert flagged.split()[-6:-3] == ["2.00", "29.49", "-"]  # ours twice as fast; no peak known
    theirs = _result("conv2", "wgrad", 0.1, cudnn_ms=0.05, error=7.9e-3, error64=9.7e-7, cudnn_error64=7.9e-3)
    assert not theirs.flagged and format_row(theirs, None).split()[-2:] == ["7.9e-03", "9.7e-07|7.9e-03"]
    ours = _result("conv2", "wgrad", 0.1, cudnn_ms=0.05, error=7.9e-3, error64=7.9e-3, cudnn_error64=9.7e-7)
    assert ours.flagged and format_row(ours, None).split()[-1] == "7.9e-03|9.7e-07!"  # ours is the one off
    no_ref = format_row(_result("conv1", "fprop", 0.1), peak_flops=66.9e12)
    assert no_ref.split()[-6:] == ["-", "14.75", "22.0", "0.0100", "-", "-|-"]


def test_kernel_resources_lists_every_tile_and_gemm_kernel():
    """One line per conv tile variant (production and trial), with each GEMM kernel's registers, shared
    memory, local memory and resident blocks per SM as the driver reports them for that kernel."""
    from types import SimpleNamespace

    from mpiasgd.ops.cuda.tiles import CONV_TILES, CONV_TRIAL_TILES, conv_threads, tile_name

    tiles = (*CONV_TILES, *CONV_TRIAL_TILES)
    names = ("conv2d_fprop", "conv2d_dgrad", "conv2d_wgrad_partial")
    ptr = {(name, tile_name(tile)): 1000 * i + j
           for i, tile in enumerate(tiles) for j, name in enumerate(names)}
    kernels = SimpleNamespace(get=lambda name, tile: SimpleNamespace(fn=SimpleNamespace(  # as runtime.CudaKernels
        kernel=SimpleNamespace(ptr=ptr[name, tile_name(tile)]), num_regs=100 + names.index(name),
        shared_size_bytes=29 * 1024, local_size_bytes=0)))
    asked = []

    class Driver:  # cupy_backends.cuda.api.driver's occupancy call
        @staticmethod
        def occupancyMaxActiveBlocksPerMultiprocessor(p, threads, dynamic):
            asked.append((p, threads, dynamic))
            return 2

    lines = kernel_resources(kernels, Driver)
    assert len(lines) == len(tiles)
    assert lines[0].split()[:3] == ["64x64", "256", "threads:"]
    assert "fprop 100 regs 29.0 KiB local 0 B 2 blocks/SM,  dgrad 101 regs" in lines[0]
    assert lines[-1].startswith("  32x96/4x4k24    192 threads:") and "wgrad 102 regs" in lines[-1]
    assert {(p, t) for p, t, _ in asked} == {(ptr[n, tile_name(t)], conv_threads(t))
                                             for t in tiles for n in names}


def test_layer_lines_mark_the_dgrad_training_never_runs():
    conv1 = bench_layers(128)[0]
    rows = [_result("conv1", "fprop", 0.1), _result("conv1", "wgrad", 0.1)]
    lines = layer_lines(conv1, rows, None)
    assert len(lines) == 3
    assert lines[0].startswith("conv1  fprop") and lines[2].startswith("conv1  wgrad")
    assert lines[1].startswith("conv1  dgrad (not timed")


def test_goal_lines_give_the_lowest_ratio_on_the_cifar10_layers():
    results = [
        _result("conv1", "fprop", 0.10, 0.09), _result("conv2", "fprop", 0.10, 0.12),
        _result("conv3", "fprop", 0.10, 0.085),
        _result("large", "fprop", 0.10, 0.02, in_model=False),  # not a cifar10 layer: does not count
        _result("conv2", "dgrad", 0.10, 0.079), _result("conv3", "dgrad", 0.10, 0.2),
        _result("conv1", "wgrad", 0.10, 0.09), _result("conv2", "wgrad", 0.10), _result("conv3", "wgrad", 0.10, 0.1),
    ]
    fprop, dgrad, wgrad = goal_lines(results)
    assert fprop == "fprop: lowest ours/cuDNN 0.85 (conv3) over conv1, conv2, conv3: goal >= 0.80 met"
    assert dgrad == "dgrad: lowest ours/cuDNN 0.79 (conv2) over conv2, conv3: goal >= 0.80 NOT met"
    assert wgrad == "wgrad: goal ours/cuDNN >= 0.80 not assessed: no cuDNN time for conv2"
    assert goal_lines([_result("large", "fprop", 0.1, 0.1, in_model=False)]) == []


def _tuned(r, tuned_ms, tile):
    return dataclasses.replace(r, tuned=Timing(tuned_ms, tuned_ms * 0.95), tuned_tile=tile)


def test_autotune_rows_and_goal_lines_use_the_autotuned_times():
    results = [_tuned(_result("conv1", "fprop", 0.10, 0.09), 0.08, "32x96/4x4k24"),
               _tuned(_result("conv2", "fprop", 0.10, 0.12), 0.10, "32x128"),
               _tuned(_result("large", "fprop", 0.10, 0.02, in_model=False), 0.05, "64x128/8x4k8"),
               _result("conv2", "wgrad", 0.10, 0.09), _tuned(_result("conv3", "wgrad", 0.10), 0.09, "64x64")]
    assert results[0].tuned_ratio == pytest.approx(0.09 / 0.08) and results[4].tuned_ratio is None
    lines = tuned_lines(results)
    assert len(lines) == 4  # conv2 wgrad was not autotuned
    assert lines[0].split() == ["conv1", "fprop", "32x96/4x4k24", "0.0800", "(0.0760)", "0.1000", "1.25", "1.12"]
    assert lines[3].split()[-2:] == ["1.11", "-"]  # no cuDNN time
    fprop, wgrad = goal_lines(results, tuned=True)
    assert fprop == "autotune fprop: lowest ours autotuned/cuDNN 1.12 (conv1) over conv1, conv2: goal >= 0.80 met"
    assert wgrad == ("autotune wgrad: goal ours autotuned/cuDNN >= 0.80 not assessed: no cuDNN or autotuned time "
                     "for conv2, conv3")
    assert goal_lines(results)[0] == "fprop: lowest ours/cuDNN 0.90 (conv1) over conv1, conv2: goal >= 0.80 met"


@pytest.mark.skipif(cuda_device_count() > 0, reason="a CUDA device is visible: bench/kernels.py would time it")
def test_kernel_bench_without_a_gpu_exits_2_with_one_line():
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "bench/kernels.py", "--runs", "2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("bench/kernels.py: no CUDA device visible (") and line.endswith("): nothing to time")


SASS = """\
\t.text.conv2d_dgrad:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   FFMA R2, R3, R4, R2 ;
        /*0020*/                   FFMA R5, R3, R4, R5 ;
        /*0030*/              @!P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0040*/                   FFMA R2, R3, R4, R2 ;
        /*0050*/                   IMAD R6, R7, R8, RZ ;
        /*0060*/                   LDS.128 R8, [R9] ;
        /*0070*/                   FFMA R5, R3, R4, R5 ;
        /*0080*/                   BRA `(.L_x_2) ;
        /*0090*/                   FFMA R5, R3, R4, R5 ;
        /*00a0*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*00b0*/                   EXIT ;
\t.text.conv2d_fprop:
        /*0000*/                   EXIT ;
"""


def test_sass_mix_finds_the_loops_with_the_most_ffma_shortest_first():
    """dev/sass_mix.py: the hot loops are the backward branches' bodies holding the most FFMA (both
    of dgrad's, shortest first); a forward branch is no loop, a kernel without FFMA has none."""
    bodies = function_bodies(SASS)
    assert set(bodies) == {"conv2d_dgrad", "conv2d_fprop"}
    loops = hot_loops(bodies["conv2d_dgrad"])
    assert [(n, ffma) for n, ffma, _ in loops] == [(3, 2), (5, 2)]
    assert loops[1][2] == {"FFMA": 2, "IMAD": 1, "LDS": 1, "BRA": 1}
    assert hot_loops(bodies["conv2d_fprop"]) == []


def test_sass_mix_picks_rows_by_instantiation():
    """A row of the table takes its loop by position among the kernel's hot loops, shortest first: the
    first (production) and last (dgrad's strided) always, a middle one only where the revision has
    every instantiation of this checkout (an older dgrad's [unit, strided] shows n/a for the
    bounds-testing unit-stride row, not its strided loop)."""
    assert LOOPS["conv2d_dgrad"] == 3
    new, old = [(350, 256), (385, 256), (538, 256)], [(382, 256), (535, 256)]
    assert [pick("conv2d_dgrad", new, w) for w in (0, 1, -1)] == new
    assert [pick("conv2d_dgrad", old, w) for w in (0, 1, -1)] == [old[0], None, old[1]]
    assert pick("conv2d_fprop", [(372, 256)], 1) is None and pick("conv2d_fprop", [], 0) is None


# ----------------------------------------------------------------------------------------------
# bench/resnet20_torch.py (mpiasgd against PyTorch on the same work) and bench/decoupling.py (the
# decoupling table): their options as mpiasgd parses them, the work PyTorch is given (minibatches,
# augmentation, step sizes, initial weights, param groups) against what a sync worker really does, and
# the tables and goal lines. No PyTorch here: the scripts import it only to train.


def _mpiasgd_config(options: list[str]):
    """The validated Config `mpiasgd train OPTIONS` would run with (parsed in-process, no ranks)."""
    return resolve(make_parser().parse_args(options))


def test_resnet20_torch_options_parse_and_refuse_nonsense(capsys):
    args = r20.parse([])
    assert (args.epochs, args.batch_size, args.lr, args.momentum, args.weight_decay, args.warmup_epochs,
            args.lr_schedule, args.seed, args.subset) == (10.0, 128, 0.1, 0.9, 5e-4, 0.0, "cosine", 0, None)
    assert args.run_dir.startswith(os.path.join("runs", "resnet20-torch-")) and not args.nesterov
    assert r20.parse(["--epochs", "0.05", "--subset", "4", "--lr-milestones", "5,8"]).lr_milestones == (5.0, 8.0)
    for bad in (["--epochs", "0"], ["--skip-torch", "--skip-mpiasgd"], ["--nesterov", "--momentum", "0"],
                ["--subset", "0"], ["--lr-milestones", "5,x"]):
        with pytest.raises(SystemExit):
            r20.parse(bad)
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [[], ["--subset", "7"], ["--warmup-epochs", "0.01", "--nesterov"],
                                   ["--lr-schedule", "step", "--lr-milestones", "0.02,0.04"]])
def test_resnet20_torch_mpiasgd_run_and_torch_plan_take_the_same_steps(extra):
    """The train flags the script passes resolve (mpiasgd's own parser) to a 1-worker sync run of resnet20 on
    numpy, and its stop rule and schedule give the step sizes the PyTorch side is planned with."""
    args = r20.parse(["--epochs", "0.05", "--run-dir", "/tmp/x", *extra])
    cfg = _mpiasgd_config(r20.train_options(args))
    assert (cfg.model, cfg.mode, cfg.backend, cfg.batch_size, cfg.seed) == ("resnet20", "sync", "numpy", 128, 0)
    assert (cfg.momentum, cfg.nesterov, cfg.weight_decay) == (args.momentum, args.nesterov, args.weight_decay)
    assert cfg.max_pushes == (args.subset or 0) and cfg.max_time == 0 and (cfg.run_dir, cfg.name) == ("/tmp/x",
                                                                                                       "mpiasgd")
    plan = r20.sync_plan(args, 50_000)
    # the worker's rule, judged as SyncWorker.train does (after each step, on steps x batch images)
    rule, schedule = StopRule.of(cfg), Schedule.of(cfg)
    steps = next(k for k in range(1, 10_000) if rule.reason(k * 128, 50_000, k, 0.0))
    assert plan.steps == steps == (args.subset or 20)  # 0.05 x 50,000 / 128 = 19.5 -> 20 steps
    expected = [learning_rate(schedule, k * 128 / 50_000, fraction_done(rule, k * 128 / 50_000, k, 0.0))
                for k in range(steps)]
    assert list(plan.lrs) == expected
    if not extra:  # cosine from 0.1, no warm-up: the first step at the peak, then down towards 0
        assert plan.lrs[0] == 0.1 and all(a > b > 0 for a, b in zip(plan.lrs, plan.lrs[1:], strict=False))


def test_resnet20_torch_plan_with_warmup_starts_at_zero():
    plan = r20.sync_plan(r20.parse(["--epochs", "2", "--warmup-epochs", "1"]), 1280)  # 10 steps an epoch
    assert plan.steps == 20 and plan.epochs == 2.0
    assert plan.lrs[:3] == (0.0, pytest.approx(0.01), pytest.approx(0.02)) and plan.lrs[10] == pytest.approx(0.05)


def test_resnet20_torch_reproduces_what_a_sync_worker_draws_and_steps_with(tmp_path, tiny_cifar):
    """The real SyncWorker (1 worker, its shard from the sync mode's own layout, as start-up builds it) and
    rank 0's loop run in threads on the fake communicator: every minibatch it trains on (images after
    augmentation, labels) is the one `sync_stream` yields, and every step size rank 0 logs is `sync_plan`'s,
    across an epoch boundary of the shard and with warm-up, cosine and a fractional epoch count."""
    import threading

    from kit.fakempi import Group, Network, rank0

    from mpiasgd.config import Config
    from mpiasgd.data import ShardSampler, load_dataset
    from mpiasgd.modes.base import WorkerJob
    from mpiasgd.modes.registry import load
    from mpiasgd.runlog import RunLog

    data_dir, _ = tiny_cifar
    dataset = load_dataset("cifar10", str(data_dir))  # 100 training images, augmented
    args = r20.parse(["--epochs", "1.5", "--batch-size", "8", "--warmup-epochs", "0.3", "--seed", "5"])
    cfg = Config(model="cifar10", mode="sync", batch_size=8, seed=5, epochs=1.5, lr=args.lr,
                 warmup_epochs=0.3, lr_schedule="cosine", momentum=0.9, weight_decay=5e-4, snapshot_interval=0,
                 progress=False, comm_timeout=5.0)
    num_train = dataset.train_y.size
    model = build_model("cifar10")
    layout = load("sync").layout(cfg, model, 1, num_train)
    sampler = ShardSampler(num_train, layout.shards, layout.shard[1], cfg.seed)  # as launch.startup.setup
    net, group = Network(2), Group(1)
    log = RunLog.create(str(tmp_path / "run.h5"), {"config": cfg.to_json()}, [], model.num_params,
                        flush_interval=60)
    server = rank0(net.comm(0), cfg, model.init_params(cfg.seed), model.decay_mask(), 1, num_train, log)
    worker = load("sync").worker(WorkerJob(net.comm(1), cfg, model, dataset, sampler, 1,
                                           np.arange(dataset.test_y.size, dtype=np.int64), comms=group.comm(0)))
    seen = []
    train_step = model.forward_backward_deferred  # (what a worker's step calls)

    def spy(x, y, minibatch=None):
        seen.append((x.copy(), y.copy()))
        return train_step(x, y, minibatch)

    model.forward_backward_deferred = spy
    errors = []

    def call(fn):
        try:
            fn()
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=call, args=(fn,), daemon=True) for fn in (server.run, worker.run)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    log.close("completed", {})

    plan = r20.sync_plan(args, num_train)
    assert plan.steps == len(seen) == 19  # 150 images / 8 -> 18.75 -> 19 steps, the shard reshuffled twice
    stream = r20.sync_stream(dataset, 8, 5)
    for k, (x, y) in enumerate(seen):
        ex, ey, _ = stream.next()
        np.testing.assert_array_equal(x, ex, err_msg=f"step {k}")
        np.testing.assert_array_equal(y, ey, err_msg=f"step {k}")
    from mpiasgd.runlog import load as load_log

    pushes = load_log(str(tmp_path / "run.h5"))["pushes"]
    np.testing.assert_allclose(pushes["lr"][np.argsort(pushes["step"])], plan.lrs, rtol=1e-6)  # float32 column
    assert plan.lrs[0] == 0.0 and max(plan.lrs) < args.lr


def test_resnet20_torch_initial_state_is_init_params_under_torch_names():
    from mpiasgd.model.export import torch_names

    model = build_model("resnet20")
    state = r20.initial_state(model, seed=3)
    assert set(state) == set(torch_names(model.spec()).values())
    assert state["layer2.0.conv1.weight"].shape == (32, 16, 3, 3) and state["linear.weight"].shape == (10, 64)
    flat = np.concatenate([state[torch_names(model.spec())[name]].ravel() for name, _, _ in model.layout()])
    np.testing.assert_array_equal(flat, model.init_params(3))
    assert (state["bn1.running_var"] == 1).all() and (state["layer3.2.bn2.running_mean"] == 0).all()
    assert all(v.dtype == np.float32 for v in state.values())


def test_resnet20_torch_param_groups_follow_the_multipliers():
    resnet = r20.param_groups(build_model("resnet20"))
    assert list(resnet) == [(1.0, 1.0)]  # FDG: weight decay on every parameter, BatchNorm's and the bias too
    assert len(resnet[1.0, 1.0]) == len(build_model("resnet20").layout())
    digits = r20.param_groups(build_model("digits"))
    assert digits == {(1.0, 1.0): ["conv1.weight", "conv2.weight", "fc1.weight"],
                      (0.0, 1.0): ["conv1.bias", "conv2.bias", "fc1.bias"]}
    assert r20.batchnorm_settings(build_model("resnet20")) == (1e-5, 0.1)
    with pytest.raises(ValueError, match="one BatchNorm"):
        r20.batchnorm_settings(build_model("digits"))


def _r20_result(name, accuracy, seconds, steps=10):
    return r20.Result(name, accuracy, seconds, steps, steps * 128, 50_000)


def test_resnet20_torch_table_loss_line_and_verdict():
    ours, ref = _r20_result("mpiasgd", 0.9112, 300.0), _r20_result("PyTorch", 0.9050, 100.0)
    assert ours.ms_per_step == 30_000 and ours.images_per_s == pytest.approx(1280 / 300)
    assert ours.s_per_epoch == pytest.approx(300 * 50_000 / 1280)
    lines = r20.table_lines([ours, ref])
    assert lines[2].startswith("| mpiasgd | 91.12% | 11,719 | 30,000 | 4.3 | 1.00 |")
    assert lines[3].endswith("| 0.33 |")
    diff, goal = r20.verdict(ours, ref)
    assert diff == pytest.approx(0.62) and goal == "mpiasgd within 1 point of PyTorch: yes (+0.62 points)"
    assert r20.verdict(_r20_result("mpiasgd", 0.89, 1.0), ref)[1].endswith("no (-1.50 points)")
    assert r20.verdict(ours, None) == (None, "mpiasgd within 1 point of PyTorch: not assessed (only one of the two "
                                             "ran)")
    line = r20.loss_line([2.3026, 2.30, 2.0], [2.3026, 2.31, 2.0001])
    assert line.startswith("training loss per step, |mpiasgd - PyTorch| over 3 steps: max 1.00e-02 (step 2: "
                           "2.30000 vs 2.31000)")
    assert r20.loss_line([], [1.0]) == "training loss per step: no steps to compare"


def test_decoupling_rows_and_fdg_cuts():
    assert decoupling.row_list("all") == list(decoupling.ROWS) and len(decoupling.ROWS) == 11
    assert decoupling.row_list(" K1, K2-b0.5-store") == ["K1", "K2-b0.5-store"]
    for bad in ("K4", "K1,K1", ""):
        with pytest.raises(Exception, match="expected distinct names"):
            decoupling.row_list(bad)
    names = build_model("resnet20").names  # conv1 bn1 relu1 res1..res9 gap1 fc1
    # FDG's DG_models.py: K=2 cuts after layer2[:1] (our res4), K=3 at the stage boundaries
    assert [decoupling.fdg_cuts(names, k) for k in (1, 2, 3)] == ["", "7", "6,9"]
    assert names[7] == "res5" and names[6] == "res4" and names[9] == "res7"
    args = decoupling.parse([])
    assert (args.epochs, args.batch_size, args.lr, args.weight_decay, args.warmup_epochs, args.rows) == (
        10.0, 128, 0.1, 5e-4, 0.0, list(decoupling.ROWS))


@pytest.mark.parametrize("row", ["K1", "K2-b1-recompute", "K2-b0.5-store", "K3-b0.5-store"])
def test_decoupling_commands_resolve_to_the_row(row):
    """Each row's train flags, parsed by mpiasgd's own parser, give the row's pipeline: K modules at FDG's
    cuts, beta, the activation semantics, one replica (1 + K ranks), the shared workload."""
    args = decoupling.parse(["--epochs", "0.05", "--subset", "3", "--run-dir", "/tmp/d"])
    spec = decoupling.ROWS[row]
    cuts = decoupling.fdg_cuts(build_model("resnet20").names, spec.modules)
    cmd = decoupling.train_command(["mpiexec"], spec, args, cuts, activations_flag=True)
    assert cmd[:3] == ["mpiexec", "-n", str(1 + spec.modules)] and cmd[4:7] == ["-m", "mpiasgd", "train"]
    cfg = _mpiasgd_config(cmd[7:])
    assert (cfg.model, cfg.mode, cfg.modules, cfg.cuts, cfg.shrink, cfg.decoupling) == (
        "resnet20", "pipeline", spec.modules, cuts, spec.beta, "full")
    assert cfg.pipeline_activations == (spec.activations or "recompute")
    assert (cfg.epochs, cfg.max_pushes, cfg.batch_size, cfg.lr, cfg.weight_decay, cfg.name) == (
        0.05, 3, 128, 0.1, 5e-4, row)
    without = decoupling.train_command(["mpiexec"], spec, args, cuts, activations_flag=False)
    assert "--pipeline-activations" not in without


def test_decoupling_finds_the_activations_option_in_the_train_help():
    assert decoupling.has_activations_option(make_parser().format_help())
    assert not decoupling.has_activations_option("usage: mpiasgd train [--shrink SHRINK]")


def _decoupling_row(name, accuracy=None, note=""):
    spec = decoupling.ROWS[name]
    return decoupling.RowResult(name, spec.modules, spec.beta, spec.activations, "", accuracy,
                                None if accuracy is None else 600.0, None if accuracy is None else 83.3, 10.0, note)


def test_decoupling_table_and_goal_line():
    row = _decoupling_row
    rows = [row("K1", 0.9000), row("K2-b1-recompute", 0.8900), row("K2-b1-store", 0.8840),
            row("K2-b0.5-store", note="skipped: no --pipeline-activations"), row("K3-b0.5-recompute", 0.86)]
    lines = decoupling.table_lines(rows)
    assert lines[2] == "| K1 | 1 | 1 | - | - | 90.00% | 600 | 83.3 | - |"
    assert lines[3].endswith("| 89.00% | 600 | 83.3 | -1.00 |") and lines[4].endswith("| -1.60 |")
    assert lines[5] == "| K2-b0.5-store | 2 | 0.5 | store | - | skipped: no --pipeline-activations | | | |"
    assert lines[6].endswith("| -4.00 |")
    assert decoupling.goal_line(rows) == ("K = 2 within 1.5 points of K = 1: no (worst K = 2 row: K2-b1-store, "
                                          "-1.60 points; 2 K = 2 rows)")
    assert decoupling.goal_line(rows[:2]).startswith("K = 2 within 1.5 points of K = 1: yes (worst K = 2 row: "
                                                     "K2-b1-recompute, -1.00 points; 1 K = 2 row)")
    better = [row("K1", 0.80), row("K2-b1-store", 0.85)]  # above K = 1 is within
    assert ": yes (" in decoupling.goal_line(better)
    assert decoupling.goal_line(rows[1:]) == "K = 2 within 1.5 points of K = 1: not assessed (no K = 1 row ran)"
    assert decoupling.goal_line([row("K1", 0.9), row("K3-b0.5-store", 0.9)]).endswith("(no K = 2 row ran)")
    assert decoupling.table_lines([row("K1", note="FAILED (see stderr)")])[2].endswith("| FAILED (see stderr) | | | |")


def test_payoff_grid_marks_each_variants_best_and_an_edge_of_its_grid():
    """bench/asgd_payoff.py: step sizes per variant parse; the summary gives each variant's best with its gap to
    sync, flagging a best at the end of its grid."""
    from asgd_payoff import grid_table, step_sizes

    assert step_sizes("sync=0.02:0.04,0.01:0.02") == {"sync": [0.02, 0.04], "*": [0.01, 0.02]}
    rows = [{"variant": v, "lr": lr, "accuracy": acc, "time_s": 300.0, "staleness": s}
            for v, lr, acc, s in (("sync", 0.02, 0.74, 0.0), ("sync", 0.04, 0.76, 0.0), ("sync", 0.08, 0.75, 0.0),
                                  ("async", 0.005, 0.70, 1.0), ("async", 0.01, 0.72, 1.0))]
    table = grid_table(rows, "head")
    assert "| sync | 0.04 | **76.00 %** | 300.0 | 0.00 |" in table
    assert "| sync | 0.04 | 76.00 % | +0.00 |" in table
    assert "| async | 0.01 (edge of the grid) | 72.00 % | -4.00 |" in table


def test_speedup_table_gives_each_cell_its_time_and_the_speedup_over_one_worker(tmp_path):
    """bench/simulate_speedup.py: the step-size rule halves past 2 workers; a cell is the time to target (3
    significant digits) with the speed-up over N = 1, nsync 1, cold; a run that never got there says so; N = 1
    has no warm start."""
    import argparse

    from simulate_speedup import seconds3, simulations, step_size, table

    args = argparse.Namespace(lr=0.02, lr_rule="halve", nsync=[1, 10], starts=["cold", "warm"], workers=[1, 2, 4],
                              model="cifar10", batch_size=64, options="", profile=str(tmp_path / "p.json"),
                              target_accuracy=0.6, epochs=10.0, eval_interval="0.25ep", run_dir=str(tmp_path),
                              extra=[])
    (tmp_path / "p.json").write_text('{"compute": {"mean_s": 0.001}, "latency_s": 0, "bandwidth": 0, "server_s": 0, '
                                     '"note": "ESTIMATE: x"}')
    from mpiasgd.sim import load_profile

    args.timing = load_profile(args.profile)
    assert [step_size(args, n) for n in (1, 2, 4, 8)] == [0.02, 0.02, 0.01, 0.005]
    rows = {(1, 1, "cold"): {"time": 10.0, "accuracy": 0.61, "staleness": 0.0, "epochs": 2.0},
            (2, 1, "cold"): {"time": 4.0, "accuracy": 0.61, "staleness": 1.0, "epochs": 2.5},
            (2, 10, "warm"): {"time": None, "accuracy": 0.41, "staleness": 3.0, "epochs": 10.0}}
    text = table(rows, args, 0.5)
    assert "| 1 | 10.0 s (1.00x), s=0.0, 2.00 ep | - | failed | - |" in text
    assert "| 2 | 4.00 s (2.50x), s=1.0, 2.50 ep | failed | failed | not reached (41.0 % after 10.0 ep) |" in text
    # a round of nsync 1000 by 8 workers (512,000 images) is longer than 10 epochs of CIFAR-10: marked, never run
    wide = argparse.Namespace(**{**vars(args), "nsync": [1000], "workers": [1, 8], "starts": ["cold"]})
    assert "| 8 | - (one round is longer than the run) |" in table({}, wide, 0.5)
    assert [key for key, _ in simulations(wide, 0.5)] == [(1, 1000, "cold")]
    assert [seconds3(t) for t in (0.0234, 0.0171, 4.0, 12.345, 99.94, 99.96, 1234.4)] == [
        "0.0234", "0.0171", "4.00", "12.3", "99.9", "100", "1234"]


def _speedup_argv(profile: Path, runs: Path) -> list[str]:
    """bench/simulate_speedup.py on digits: two short simulations (N = 1, 2; nsync 1; cold), a few seconds."""
    return ["--model", "digits", "--workers", "1,2", "--nsync", "1", "--starts", "cold", "--epochs", "1",
            "--eval-interval", "0.5ep", "--target-accuracy", "0.3", "--lr", "0.05", "--jobs", "1", "--profile",
            str(profile), "--run-dir", str(runs), "--timeout", "120"]


@pytest.fixture(scope="module")
def speedup_run(tmp_path_factory):
    """One run of bench/simulate_speedup.py (`_speedup_argv`), shared by the tests of --reuse: its folder, argv,
    output and the table's two rows. A test that changes the logs works on a copy (`_speedup_copy`)."""
    import contextlib
    import io

    import simulate_speedup

    folder = tmp_path_factory.mktemp("speedup")
    profile = folder / "p.json"
    profile.write_text('{"compute": {"mean_s": 0.01}, "latency_s": 0.0001, "bandwidth": 0, "server_s": 0.001}')
    argv = _speedup_argv(profile, folder / "runs")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = simulate_speedup.main(argv)
    assert status == 0, out.getvalue()
    rows = [line for line in out.getvalue().splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    return {"folder": folder, "argv": argv, "out": out.getvalue(), "rows": rows}


def _speedup_copy(speedup_run, tmp_path) -> list[str]:
    """argv of `speedup_run` over a copy of its run logs in tmp_path/runs (the copy may be changed)."""
    import shutil

    shutil.copytree(speedup_run["folder"] / "runs", tmp_path / "runs")
    return _speedup_argv(speedup_run["folder"] / "p.json", tmp_path / "runs")


def _rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]


def test_speedup_script_runs_simulations_and_reuses_their_logs(speedup_run, capsys):
    """bench/simulate_speedup.py end to end on digits (two short simulations): the table has both rows; run
    again with --reuse it takes both complete logs and prints the same table; with another step size, --reuse
    stops, naming the log that holds other settings."""
    import simulate_speedup

    argv, rows = speedup_run["argv"], speedup_run["rows"]
    assert len(rows) == 2 and all(" s (" in row and "x), s=" in row for row in rows), speedup_run["out"]
    assert rows[0].split("|")[2].strip().split(" s (")[1].startswith("1.00x")  # N = 1 is its own baseline
    assert simulate_speedup.main([*argv, "--reuse"]) == 0
    again = capsys.readouterr().out
    assert again.count("reused (its log is complete)") == 2
    assert _rows(again) == rows
    with pytest.raises(SystemExit, match=r"n1-nsync1-cold\.h5' is of other settings .*'lr'"):
        simulate_speedup.main([*("0.02" if a == "0.05" else a for a in argv), "--reuse"])


def test_speedup_reuse_compares_the_options_the_workers_and_the_timing_model(speedup_run, tmp_path, capsys):
    """--reuse compares the whole config the command resolves to (--options included), the number of workers
    and the timing model with the log's, naming each key that differs with (the log's value, the wanted one);
    keys that change nothing computed (--flush-interval, --eval-batch-size) do not count."""
    import shutil

    import simulate_speedup

    argv = speedup_run["argv"]
    with pytest.raises(SystemExit) as stop:
        simulate_speedup.main([*argv, "--reuse", "--options=--momentum 0.0 --seed 7"])
    message = str(stop.value)
    assert message.startswith("simulate_speedup.py: --reuse: run log '") and "\n" not in message
    assert "n1-nsync1-cold.h5' is of other settings" in message
    assert "'momentum': (0.9, 0.0)" in message and "'seed': (0, 7)" in message
    assert "'lr'" not in message and "'workers'" not in message  # only what differs
    profile = tmp_path / "p2.json"
    profile.write_text('{"compute": {"mean_s": 0.01}, "latency_s": 0.0002, "bandwidth": 0, "server_s": 0.001}')
    with pytest.raises(SystemExit, match=r"'timing latency_s': \(0\.0001, 0\.0002\)\}"):
        simulate_speedup.main([*(str(profile) if a.endswith("p.json") else a for a in argv), "--reuse"])
    copy = _speedup_copy(speedup_run, tmp_path)  # the log of 2 workers under the name of 1 (same lr: 0.05)
    shutil.copy(tmp_path / "runs" / "n2-nsync1-cold.h5", tmp_path / "runs" / "n1-nsync1-cold.h5")
    with pytest.raises(SystemExit, match=r"is of other settings \{'workers': \(2, 1\)\}"):
        simulate_speedup.main([*copy, "--reuse"])
    capsys.readouterr()
    assert simulate_speedup.main([*argv, "--reuse", "--options=--flush-interval 5 --eval-batch-size 100"]) == 0
    again = capsys.readouterr().out
    assert again.count("reused (its log is complete)") == 2 and _rows(again) == speedup_run["rows"]


def test_speedup_reuse_runs_an_unreadable_log_again_and_refuses_a_directory(speedup_run, tmp_path, capsys):
    """--reuse over a truncated, empty or foreign file of a simulation's name says it is unreadable, moves it to
    NAME.h5.unreadable and simulates it again (the same row as the first run); a directory of that name stops the
    script with one line."""
    import simulate_speedup

    argv = _speedup_copy(speedup_run, tmp_path)
    log = tmp_path / "runs" / "n2-nsync1-cold.h5"
    data = log.read_bytes()
    log.write_bytes(data[: len(data) // 2])
    assert simulate_speedup.main([*argv, "--reuse"]) == 0
    out = capsys.readouterr().out
    assert f"--reuse: run log '{log}' is unreadable (" in out
    assert "is truncated" in out and f"); moved to '{log}.unreadable', the simulation runs again\n" in out
    assert (tmp_path / "runs" / "n2-nsync1-cold.h5.unreadable").read_bytes() == data[: len(data) // 2]
    assert "(1, 1, 'cold'): reused (its log is complete)" in out and "(2, 1, 'cold'): reused" not in out
    assert _rows(out) == speedup_run["rows"]  # simulated again, the same as the first time
    assert simulate_speedup.load(str(log))["status"] == "completed"
    from mpiasgd.sim import load_profile

    cfg, timing = simulate_speedup.settings(["python", "-m", "mpiasgd", "simulate", "--workers", "1", "--profile",
                                             str(speedup_run["folder"] / "p.json"), "--model", "digits"])
    (tmp_path / "empty.h5").write_bytes(b"")
    (tmp_path / "text.h5").write_text("not a run log")
    for name in ("empty.h5", "text.h5"):
        assert simulate_speedup.reusable(str(tmp_path / name), cfg, 1, timing) is False
        line = capsys.readouterr().out
        assert line.count("\n") == 1 and f"'{tmp_path / name}' is unreadable (" in line, line
        assert not (tmp_path / name).exists() and (tmp_path / f"{name}.unreadable").exists()
    assert timing.latency_s == load_profile(str(speedup_run["folder"] / "p.json")).latency_s == 0.0001
    (tmp_path / "runs" / "n1-nsync1-cold.h5").unlink()
    (tmp_path / "runs" / "n1-nsync1-cold.h5").mkdir()
    with pytest.raises(SystemExit) as stop:
        simulate_speedup.main([*argv, "--reuse"])
    assert str(stop.value) == (f"simulate_speedup.py: --reuse: '{tmp_path / 'runs' / 'n1-nsync1-cold.h5'}' is a "
                               "directory, expected a run log file (or none); remove it or use another --run-dir")


def _speedup_error(argv: list[str], capsys) -> str:
    """The one line of error of bench/simulate_speedup.py ARGV (exit status 2, nothing run)."""
    import simulate_speedup

    with pytest.raises(SystemExit) as stop:
        simulate_speedup.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: simulate_speedup.py") and err[-1].startswith("simulate_speedup.py: error: ")
    return err[-1].removeprefix("simulate_speedup.py: error: ")


@pytest.mark.parametrize(("options", "expected"), [
    ("--workers 3", "--options: --workers is set by this script for every simulation (use this script's --workers)"),
    ("--workers=3", "--options: --workers is set by this script for every simulation (use this script's --workers)"),
    ("--work 3", "--options: --workers is set by this script for every simulation (use this script's --workers)"),
    ("--seed 1 --lr=0.1", "--options: --lr is set by this script for every simulation (use this script's --lr and "
                          "--lr-rule)"),
    ("--stop-accuracy 0.5", "--options: --stop-accuracy is set by this script for every simulation (use this "
                            "script's --target-accuracy)"),
    ("--progress", "--options: --progress/--no-progress is set by this script for every simulation (the script sets "
                   "--no-progress)"),
    ("--threads 4", "--options: --threads is set by this script for every simulation (the script sets 1 (one BLAS "
                    "thread per simulation; --jobs of them at once))"),
    ("--async-momentum=fixed", "--options: --async-momentum is set by this script for every simulation (the script "
                               "sets 'workers' at nsync 1 and leaves the default otherwise)"),
    ("--warm-start 5", "--options: --warm-start is set by this script for every simulation (use this script's "
                       "--warm-start and --starts)"),
    ("--bogus 1", "--options '--bogus 1': unrecognized arguments: --bogus 1"),
    ("--momentum 2", "simulation n1-nsync1-cold: config key 'momentum' = 2.0: expected 0 <= momentum < 1"),
])
def test_speedup_options_may_not_set_what_the_script_sets(tmp_path, capsys, options, expected):
    """--options giving a flag the script sets (any form: --flag value, --flag=value, a prefix) is refused up
    front naming it and the script's flag to use; an unknown flag or a bad value too (read as `mpiasgd simulate`
    reads it), before any simulation runs."""
    profile = tmp_path / "p.json"
    profile.write_text('{"compute": {"mean_s": 0.01}, "latency_s": 0.0001, "bandwidth": 0, "server_s": 0.001}')
    assert _speedup_error([*_speedup_argv(profile, tmp_path / "runs"), f"--options={options}"], capsys) == expected
    assert list((tmp_path / "runs").glob("*")) == []  # no log: nothing ran


def test_speedup_refuses_a_missing_or_invalid_profile(tmp_path, capsys):
    """--profile is loaded up front: a missing file or one that is not a timing profile is one line."""
    missing = tmp_path / "nope.json"
    argv = _speedup_argv(missing, tmp_path / "runs")
    assert _speedup_error(argv, capsys) == f"--profile: timing profile '{missing}' not found"
    missing.write_text("{")
    assert _speedup_error(argv, capsys).startswith(f"--profile: timing profile '{missing}': not valid JSON")


@pytest.mark.parametrize(("extra", "expected"), [
    (["--workers", "1,2,1"], "argument --workers: expected distinct integers, got '1,2,1' (1 more than once)"),
    (["--nsync", "10,10"], "argument --nsync: expected distinct integers, got '10,10' (10 more than once)"),
    (["--starts", "cold,cold"], "argument --starts: expected cold and/or warm, each once, got 'cold,cold'"),
    (["--jobs", "0"], "argument --jobs: expected an integer >= 1, got '0'"),
    (["--workers", "1", "--starts", "warm"], "no simulations: --workers 1 with --starts warm (a warm start needs "
                                             "N >= 2)"),
    (["--plot", "/nonexistent-folder/x.png"], "--plot '/nonexistent-folder/x.png': folder '/nonexistent-folder' "
                                              "does not exist"),
])
def test_speedup_refuses_duplicates_no_jobs_an_empty_sweep_and_an_unwritable_plot(tmp_path, capsys, extra, expected):
    """Duplicate N or nsync, --jobs < 1, a sweep of no simulations, a plot that cannot be written: one line, before
    anything runs."""
    profile = tmp_path / "p.json"
    profile.write_text('{"compute": {"mean_s": 0.01}, "latency_s": 0.0001, "bandwidth": 0, "server_s": 0.001}')
    assert _speedup_error([*_speedup_argv(profile, tmp_path / "runs"), *extra], capsys) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("a", "expected comma-separated integers >= 0, e.g. 0,1,2; got 'a'"),
    ("", "expected at least one integer, each >= 0, e.g. 0,1,2; got ''"),
    ("0,-1", "expected at least one integer, each >= 0, e.g. 0,1,2; got '0,-1'"),
    ("0,1,0", "expected distinct integers, got '0,1,0' (0 more than once)"),
])
def test_validate_seeds_are_distinct_integers(capsys, text, expected):
    """bench/simulate_validate.py --seeds: at least one integer >= 0, none twice; else one line, exit status 2."""
    import simulate_validate

    assert simulate_validate.parse(["--seeds", "3, 1"]).seeds == [3, 1]
    assert simulate_validate.parse([]).seeds == [0, 1, 2]
    with pytest.raises(SystemExit) as stop:
        simulate_validate.parse(["--seeds", text])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"simulate_validate.py: error: argument --seeds: {expected}"


def test_validate_workers_sets_the_ranks_and_the_simulated_workers(capsys, monkeypatch):
    """bench/simulate_validate.py --workers N (default 2, at least 2): the real run under `mpiexec -n N+1`, its
    simulations with `simulate --workers N`; below 2 or not an integer, one line and exit status 2."""
    import simulate_validate

    assert simulate_validate.parse([]).workers == 2
    for text in ("1", "x"):
        with pytest.raises(SystemExit) as stop:
            simulate_validate.parse(["--workers", text])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == f"simulate_validate.py: error: argument --workers: expected an integer >= 2, got {text!r}"
    steps = []
    monkeypatch.setattr(simulate_validate, "launcher", lambda: ["mpiexec"])
    monkeypatch.setattr(simulate_validate, "run_steps", lambda label, s, limit, commands: steps.extend(s) or False)
    for n in (2, 4):
        steps.clear()
        assert simulate_validate.main(["--workers", str(n), "--seeds", "0", "--run-dir", "r"]) == 1
        real, draw, replay = (cmd for _, cmd in steps)
        assert real[:3] == ["mpiexec", "-n", str(n + 1)] and "train" in real
        for cmd in (draw, replay):
            assert cmd[cmd.index("simulate") + 1:cmd.index("simulate") + 3] == ["--workers", str(n)]


def test_validate_staleness_shares_run_from_0_to_n_then_above_n(monkeypatch):
    """bench/simulate_validate.py's staleness: of the applied pushes only, the share of 0, 1, ..., N and > N
    (0 / 1 / 2 / >= 3 at N = 2, as before --workers), p99 the smallest value 99 % of them do not exceed."""
    import simulate_validate

    applied = [4, 0, 1, 3, 3, 5, 9, 3]  # and a rejected push of staleness 7
    pushes = {"staleness": np.array([*applied, 7]), "applied": np.array([1] * len(applied) + [0], dtype=np.int8)}
    monkeypatch.setattr(simulate_validate, "load", lambda path: {"pushes": pushes})
    monkeypatch.setattr(simulate_validate, "final_eval", lambda r: {"accuracy": 0.5})
    four = simulate_validate.staleness("x.h5", 4)
    assert four["share"] == [1 / 8, 1 / 8, 0, 3 / 8, 1 / 8, 2 / 8]
    assert four["mean"] == 3.5 and four["p99"] == 9 and four["pushes"] == 8 and four["accuracy"] == 0.5
    assert simulate_validate.staleness("x.h5", 2)["share"] == [1 / 8, 1 / 8, 0, 6 / 8]


def test_server_bench_pairs_each_sharded_run_with_a_one_server_run_and_takes_the_busiest_shard():
    """bench/server.py: a sharded run follows the one-server run of as many workers (same round, next run); the
    goal's figure is, per round, the busiest shard's CPU seconds per push over the one server's."""
    import argparse

    from server import base_label, runs, shard_ratios

    args = argparse.Namespace(workers=[1, 2, 3], servers=2, sharded_workers=[2], update_rule="auto")
    plan = runs(args)
    labels = [label for label, *_ in plan]
    assert "  2 workers, numpy update (NumpySGD, --update-rule sgd)" in labels  # the numpy row runs A-SGD's rule
    i = labels.index("  S = 2 shards, 2 workers")
    assert labels[i - 1] == base_label(2) == "server, 2 workers" and plan[i][1:3] == (2, {"servers": 2})
    assert sum(1 for _, _, overrides, _ in plan if overrides.get("servers")) == 1
    assert not any(o.get("servers") for _, _, o, _ in runs(argparse.Namespace(**{**vars(args), "servers": 1})))
    sharded = [{"shards": [{"cpu_s": 3.0}, {"cpu_s": 2.5}]}, {"shards": [{"cpu_s": 2.0}, {"cpu_s": 2.6}]}]
    single = [{"cpu_s": 5.0}, {"cpu_s": 4.0}]
    assert shard_ratios(sharded, single) == pytest.approx([0.6, 0.65])  # shard 0 busiest, then shard 1


def test_the_gpu_check_dry_run_starts_every_step_without_a_device():
    """`bash bench/gpu_check.sh --dry-run` (the brief: device time is never spent on a typo or an install): the
    imports, tests/gpu's collection and bench/kernels.py's arguments of every step, checked on the CPU."""
    res = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHON": sys.executable}, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "imports: mpiasgd, mpi4py" in out and " tests collected" in out and "error" not in out.lower(), out
    assert "dry run: 4 layer(s)" in out and "and every tile: 64x64, 32x128" in out, out
    assert "dry run: --ops would time the non-conv kernels" in out and "dry run exit status: 0" in out, out


def test_a_typo_in_a_gpu_scripts_arguments_fails_its_dry_run():
    res = subprocess.run([sys.executable, str(REPO / "bench" / "kernels.py"), "--layers", "conv9", "--dry-run"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 2 and "invalid choice: 'conv9'" in res.stderr, res.stderr
    res = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-rn"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert res.returncode == 2 and "takes no arguments but --dry-run (got: --dry-rn)" in res.stderr, res.stderr


def test_asgd_scaling_dry_run_picks_the_best_step_size_runs_the_seeds_and_reuses(tmp_path, capsys):
    """bench/asgd_scaling.py --dry-run (digits, N = 1, 2, two variants, two step sizes, 2 seeds): the grid at seed 0,
    the other seed at each cell's best step size, the reference (sgd, N = 1) at speed-up 1; a second invocation with
    --reuse runs nothing again and gives the same summary; --results records every cell, as it ran or from its
    log, and a third invocation with --reuse, those records and an empty --run-dir takes every cell from them and
    prints the same table (the other records of the file kept); a record of other settings stops it naming the
    cell; --no-run tabulates what is recorded and runs nothing; bad arguments are refused before anything runs."""
    import json

    import asgd_scaling

    logs, records = tmp_path / "logs", tmp_path / "records.json"
    argv = ["--dry-run", "--lrs", "0.02,0.08", "--timeout", "120"]
    assert asgd_scaling.main([*argv, "--run-dir", str(logs), "--results", str(records)]) == 0
    first = json.loads((logs / "asgd_scaling.json").read_text())
    out = capsys.readouterr().out
    assert len(first["commands"]) == 2 * 2 * 2 + 2 * 2  # the grid (variants x N x step sizes), then seed 1 at the best
    cells = first["summary"]["cells"]
    assert set(cells) == {"sgd N=1", "sgd N=2", "lookahead N=1", "lookahead N=2"}
    for key, cell in cells.items():
        variant, n = key.split(" N=")
        assert cell["lr"] in (0.02, 0.08) and len(cell["accuracy"]) == 2
        grid = {lr: asgd_scaling.load(str(logs / f"{variant}-n{n}-lr{lr:g}-s0.h5")) for lr in (0.02, 0.08)}
        accuracy = {lr: asgd_scaling.final_eval(r)["accuracy"] for lr, r in grid.items()}
        assert accuracy[cell["lr"]] == max(accuracy.values())  # the best of the grid
        assert (logs / f"{variant}-n{n}-lr{cell['lr']:g}-s1.h5").is_file()
    assert cells["sgd N=1"]["speedup"] == pytest.approx(1.0) and 0.5 < first["summary"]["target"] < 1
    assert "| 1 | " in out and "| 2 | " in out
    assert "`lookahead` (`--update-rule sgd --staleness-lr none --lookahead -1`)" in out
    table = out.split(" s of this machine\n\n", 1)[1]

    ran = json.loads(records.read_text())  # a record per cell that ran, of what its log holds
    assert len(ran) == 12 and ran.keys() == {c.split(" --name ")[1].split()[0] for c in first["commands"]}
    r = asgd_scaling.load(str(logs / "lookahead-n2-lr0.08-s0.h5"))
    record = ran["lookahead-n2-lr0.08-s0"]
    assert record["accuracy"] == float(asgd_scaling.final_eval(r)["accuracy"]) and 0.5 < record["accuracy"] <= 1
    assert record["train_time_s"] == float(r["train_time_s"]) > 0 and 0.9 < record["epochs"] <= 1.01
    assert [e[2] for e in record["evals"]] == r["periodic_evals"]["top1"].tolist() and len(record["evals"]) >= 1
    assert all(0 < t <= record["train_time_s"] and 0 < ep <= record["epochs"] for t, ep, _ in record["evals"])
    signature = record["signature"]
    assert signature["workers"] == 2 and signature["config"]["lr"] == 0.08 and signature["config"]["lookahead"] == -1
    assert "run_dir" not in signature["config"] and signature["timing"]["server_s"] > 0
    assert record["command"].endswith("--lookahead -1") and record["date"].endswith("+00:00")

    from_logs = tmp_path / "from_logs.json"  # --reuse: every log is reused, and recorded as it was read
    kept = {"accuracy": 0.5, "note": "a cell of another grid"}  # the records of cells this grid has not: kept
    from_logs.write_text(json.dumps({"other-n1-lr1-s0": kept}))
    assert asgd_scaling.main([*argv, "--run-dir", str(logs), "--reuse", "--results", str(from_logs)]) == 0
    again = json.loads((logs / "asgd_scaling.json").read_text())
    assert capsys.readouterr().out.count(": reused") == 12
    assert again["summary"] == first["summary"]
    merged = json.loads(from_logs.read_text())
    assert merged.pop("other-n1-lr1-s0") == kept and merged.keys() == ran.keys()
    for cell, record in merged.items():
        assert {k: v for k, v in record.items() if k != "date"} == {k: v for k, v in ran[cell].items() if k != "date"}

    empty = tmp_path / "empty"  # no logs at all: every cell from its record
    assert asgd_scaling.main([*argv, "--run-dir", str(empty), "--reuse", "--results", str(records)]) == 0
    out = capsys.readouterr().out
    assert out.count(": recorded") == 12 and ": reused" not in out and not list(empty.glob("*.h5"))
    third = json.loads((empty / "asgd_scaling.json").read_text())
    assert third["summary"] == first["summary"] and out.split(" s of this machine\n\n", 1)[1] == table
    assert [c["accuracy"] for c in third["summary"]["cells"].values()] == [c["accuracy"] for c in cells.values()]

    partial = tmp_path / "partial"  # --no-run: the recorded cells in the table, N = 4 (never run) marked, nothing run
    assert asgd_scaling.main([*argv, "--workers", "1,2,4", "--run-dir", str(partial), "--reuse", "--no-run",
                              "--results", str(records)]) == 0
    out = capsys.readouterr().out
    assert out.count(": recorded") == 12 and not list(partial.glob("*.h5"))
    assert "| 4 | - (not run (--no-run)) | - (not run (--no-run)) |" in out
    fourth = json.loads((partial / "asgd_scaling.json").read_text())["summary"]["cells"]
    assert {k: v for k, v in fourth.items() if "N=4" not in k} == third["summary"]["cells"]
    with pytest.raises(SystemExit) as e:
        asgd_scaling.main([*argv, "--no-run", "--run-dir", str(partial)])
    assert e.value.code == 2 and "--no-run takes the cells recorded or logged already" in capsys.readouterr().err

    ran["sgd-n2-lr0.02-s0"]["signature"]["config"]["momentum"] = 0.5  # a record of other settings
    records.write_text(json.dumps(ran))
    with pytest.raises(SystemExit) as e:
        asgd_scaling.main([*argv, "--run-dir", str(empty), "--reuse", "--results", str(records)])
    assert str(records) in str(e.value) and "sgd-n2-lr0.02-s0 is recorded of other settings" in str(e.value)
    assert "'momentum': (0.5, 0.9)" in str(e.value) and not list(empty.glob("*.h5"))
    for bad, message in ((["--workers", "2,4"], "must start with 1"),
                         (["--variants", "sgd,bogus"], "expected distinct"),
                         (["--lrs", "0.1,-1"], "expected distinct finite numbers > 0")):
        with pytest.raises(SystemExit) as e:
            asgd_scaling.main([*bad, "--run-dir", str(tmp_path / "bad")])
        assert e.value.code == 2 and message in capsys.readouterr().err
