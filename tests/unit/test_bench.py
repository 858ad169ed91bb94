"""The pure logic of the benchmark scripts (bench/), on crafted numbers; the scripts themselves run MPI
jobs for minutes and are not part of the test suite.

bench/nsync.py: the trailing mean of the training loss over the latest pushes holding at least a
window of images, and the time at which it first reaches a target.

dev/sass_mix.py (the kernel lab): finding the conv kernels' main loops in disassembled machine code.

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
from mpiasgd.ops import cuda_device_count

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


def _result(layer, pass_name, ours_ms, cudnn_ms=None, in_model=True, error=None, late=0):
    cudnn = None if cudnn_ms is None else Timing(cudnn_ms, cudnn_ms)
    return PassResult(layer, in_model, pass_name, (32, 28800, 800), Timing(ours_ms, ours_ms * 0.9, late), cudnn,
                      0.01, error)


def test_table_row_gives_throughput_ratio_tflops_and_fraction_of_peak():
    r = _result("conv2", "fprop", 0.1, cudnn_ms=0.08, error=3e-7)
    assert r.ratio == pytest.approx(0.8)  # cuDNN ms / ours ms: ours at 80 % of cuDNN's throughput
    row = format_row(r, peak_flops=66.9e12)
    cols = row.split()
    assert cols[:7] == ["conv2", "fprop", "32", "x", "28800", "x", "800"]
    assert "0.1000 (0.0900)" in row and "0.0800 (0.0800)" in row
    assert cols[-5:] == ["0.80", "14.75", "22.0", "0.0100", "3.0e-07"]  # 1.47456 GFLOP / 0.1 ms; 14.75 / 66.9
    flagged = format_row(_result("conv3", "wgrad", 0.05, cudnn_ms=0.1, error=2e-4, late=3), peak_flops=None)
    assert flagged.endswith("2.0e-04!~")  # above 1e-4: flagged; some samples may hold launch time
    assert flagged.split()[-5:-2] == ["2.00", "29.49", "-"]  # ours twice as fast; no peak known
    no_ref = format_row(_result("conv1", "fprop", 0.1), peak_flops=66.9e12)
    assert no_ref.split()[-5:] == ["-", "14.75", "22.0", "0.0100", "-"]


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
