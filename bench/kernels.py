"""Our convolution kernels (kernels/conv2d.cu) against cuDNN, pass by pass, on one GPU; with --ops, our
other kernels (pooling, batch norm, residual shortcut, dropout, LRN, sgd) against PyTorch's.

    python3 bench/kernels.py [--batch 128] [--runs 50] [--warmup 10] [--layers conv1 conv3 large] [--no-torch]
    python3 bench/kernels.py --ops [--runs 30] [--warmup 5] [--no-torch]

Run from the repository root with it on PYTHONPATH (bash bench/gpu_check.sh does both). Layers: the
conv layers of the cifar10 model (conv1..conv3, shapes taken from `mpiasgd.model` at --batch) and one
larger layer, `large`: 64 -> 128 channels, 3x3, pad 1, on 32x32. NCHW float32 throughout. For each
layer and pass (fprop with bias, dgrad, wgrad) one row:

  M x N x K      the implicit GEMM of the pass, as in kernels/conv2d.cu: fprop K x N*P*Q x C*R*S,
                 dgrad C x N*H*W x K*R*S, wgrad K x C*R*S x N*P*Q
  ours ms        our kernel(s) through the CUDA backend (`mpiasgd.ops.get_backend("cupy")`), milliseconds per
                 call: median (min)
  cuDNN ms       the same pass in cuDNN through PyTorch: F.conv2d (with bias) for fprop,
                 aten.convolution_backward with output_mask (input) / (weight) for dgrad / wgrad;
                 cudnn.benchmark on (its best algorithm, chosen during warm-up), TF32 off (FP32 vs FP32)
  ours/cuDNN     THROUGHPUT ratio = cuDNN ms / ours ms: 1.00 = as fast as cuDNN, 0.50 = half its speed
                 (goal: >= 0.80 for every pass of the cifar10 layers)
  TFLOP/s        2*M*N*K / our median time, and the % of the device's FP32 peak
                 (SMs x FP32 lanes per SM x 2 x peak SM clock)
  cuBLAS ms      cupy.matmul of an (M, K) by (K, N) float32 matrix: the same GEMM without the im2col
                 indexing, a lower bound for any GEMM-based convolution
  err            max |ours - cuDNN| / max |cuDNN| on the same inputs
  f64 ours|cuDNN each one's max |y - y64| / max |y64| against the numpy reference in float64 on the same
                 inputs ("!" where ours is above 1e-4): says which side an err comes from (cuDNN's
                 Winograd and FFT algorithms round differently from a direct convolution)

conv1's dgrad is not timed: training never computes the first layer's input gradient. The table
is ours with conv_algo "heuristic" (the default tiles); an autotune table follows: each pass again
with conv_algo "autotune" (its first call times every tile variant and keeps the fastest, as
--conv-algo autotune does in training), its tile, ms, speed-up over the heuristic tiles and
ratio to cuDNN, and a second set of goal lines.

--ops: one row per op and shape (resnet20's CIFAR activations at batch 128: batch norm's training
forward (statistics + y) and backward, the option-A shortcut, the residual add, dropout, global
average pooling; AlexNet's 96x55x55 and 256x27x27 at batch 32: LRN forward and backward, max and
average pooling 3/2 ceil_mode forward and backward; sgd_momentum (nesterov, lr_scale) on 272,474
parameters), ours against PyTorch's (their native kernels, or autograd for LRN's backward), with the
throughput ratio ours/torch, our GB/s of the op's least memory traffic and the error against torch.

Timing: every call (ours, cuDNN, cuBLAS) runs on one CUDA stream, shared by CuPy and PyTorch (an
external stream for torch), between two CUDA events recorded on that stream (CuPy's events for all
three: one stream, one clock), after --warmup untimed calls. Before each timed call a one-thread
spin kernel keeps the GPU busy for ~1 ms, so the events and the call queue up behind it and the
event interval holds the GPU work only, not the host time of launching it (a Python wrapper's
launch time is comparable to a small layer's kernel time).
A "~" marks a row where some call took longer to launch than the spin: its samples may hold host time.

Exit status: 0 after a measurement, goal met or not; 2 without a CUDA device (or cupy); 1 on an error.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mpiasgd.argtypes import positive  # argparse type: an integer >= 1
from mpiasgd.model import build_model
from mpiasgd.ops import cuda_probe
from mpiasgd.ops.cuda.constants import CONV_BLOCKS_PER_SM
from mpiasgd.ops.cuda.tiles import CONV_TILES, CONV_TRIAL_TILES, conv_threads, tile_name

PASSES = ("fprop", "dgrad", "wgrad")
GOAL = 0.80  # throughput ours/cuDNN, every pass of every cifar10 conv layer
ERROR_FLAG = 1e-4  # ours' relative error above this is flagged (against float64; against cuDNN without it)
SPIN_MS = 1.0  # GPU busy time queued before each timed call
LARGE = "large"  # the extra layer: 64 -> 128 channels, 3x3, pad 1, 32x32


# ----------------------------------------------------------------------------------------------
# shapes and arithmetic (pure)


@dataclass(frozen=True)
class ConvLayer:
    """One convolution to time: x (N, C, H, W), w (K, C, R, S), square stride and zero padding."""

    name: str  # "conv1".."conv3" (cifar10 model) or "large"
    x_shape: tuple[int, int, int, int]  # (N, C, H, W)
    w_shape: tuple[int, int, int, int]  # (K, C, R, S)
    stride: int
    pad: int
    in_model: bool  # a layer of the cifar10 model: counts toward the goal
    needs_dgrad: bool  # False on the model's first layer: training never computes its dgrad

    @property
    def out_hw(self) -> tuple[int, int]:
        """(P, Q) = ((H + 2*pad - R) // stride + 1, (W + 2*pad - S) // stride + 1)."""
        _, _, H, W = self.x_shape
        _, _, R, S = self.w_shape
        return (H + 2 * self.pad - R) // self.stride + 1, (W + 2 * self.pad - S) // self.stride + 1

    @property
    def dy_shape(self) -> tuple[int, int, int, int]:
        """(N, K, P, Q): the shape of y and dy."""
        return (self.x_shape[0], self.w_shape[0], *self.out_hw)

    def describe(self) -> str:
        where = "cifar10 model" if self.in_model else "extra"
        return (f"{self.name:<6} x {self.x_shape!s:<18} w {self.w_shape!s:<16} stride {self.stride} pad {self.pad}"
                f"  -> y {self.dy_shape}  ({where})")


def model_conv_layers(model: str, batch: int) -> list[ConvLayer]:
    """The conv layers of registered model `model` at minibatch `batch`, with their input shapes
    (from the model's own shape arithmetic, no arrays allocated)."""
    m = build_model(model)  # numpy backend: layer list and shapes only
    layers, in_shape = [], m.input_shape
    for layer, name, out_shape in zip(m.layers, m.names, m.shapes, strict=True):
        if layer.kind == "conv":
            w_shape = dict(layer.param_shapes())["weight"]
            layers.append(ConvLayer(name, (batch, *in_shape), tuple(w_shape), layer.stride, layer.pad,
                                    in_model=True, needs_dgrad=layer.needs_dgrad))
        in_shape = out_shape
    return layers


def bench_layers(batch: int) -> list[ConvLayer]:
    """conv1..conv3 of the cifar10 model and the larger layer `large`, all at minibatch `batch`."""
    large = ConvLayer(LARGE, (batch, 64, 32, 32), (128, 64, 3, 3), 1, 1, in_model=False, needs_dgrad=True)
    return [*model_conv_layers("cifar10", batch), large]


def implicit_gemm(pass_name: str, layer: ConvLayer) -> tuple[int, int, int]:
    """(M, N, K) of the pass's implicit GEMM C (M, N) = A (M, K) B (K, N), as kernels/conv2d.cu maps it."""
    N, C, H, W = layer.x_shape
    K, _, R, S = layer.w_shape
    P, Q = layer.out_hw
    if pass_name == "fprop":
        return K, N * P * Q, C * R * S
    if pass_name == "dgrad":
        return C, N * H * W, K * R * S
    if pass_name == "wgrad":
        return K, C * R * S, N * P * Q
    raise ValueError(f"unknown pass {pass_name!r}; expected one of {', '.join(PASSES)}")


def gemm_flops(m: int, n: int, k: int) -> float:
    """2*M*N*K: one multiply and one add per term (the bias of fprop is not counted)."""
    return 2.0 * m * n * k


def fp32_lanes_per_sm(major: int, minor: int) -> int | None:
    """FP32 FMA lanes per SM of compute capability major.minor; None when not in this table."""
    if major == 7 or (major, minor) == (8, 0):  # Volta, Turing, A100
        return 64
    if (major == 8 and minor in (6, 7, 9)) or (major, minor) == (9, 0) or major in (10, 12):
        return 128  # GA10x, Orin, Ada, Hopper, Blackwell
    return None


def fp32_peak_flops(major: int, minor: int, sms: int, clock_khz: int) -> float | None:
    """FP32 peak, FLOP/s = SMs x FP32 lanes per SM x 2 (an FMA is 2 FLOP) x peak SM clock (kHz);
    None when the lanes per SM of this compute capability are unknown or the clock is not known (0)."""
    lanes = fp32_lanes_per_sm(major, minor)
    if lanes is None or clock_khz <= 0 or sms <= 0:
        return None
    return sms * lanes * 2.0 * clock_khz * 1e3


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| / max |ref| (0 when both are all zero, inf when only ref is)."""
    diff = float(np.max(np.abs(ours.astype(np.float64) - ref.astype(np.float64)), initial=0.0))
    scale = float(np.max(np.abs(ref), initial=0.0))
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


# ----------------------------------------------------------------------------------------------
# results and their table (pure)


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over the timed runs."""

    median_ms: float
    min_ms: float
    late: int = 0  # calls that took longer to launch than the spin: their samples may hold host time


@dataclass(frozen=True)
class PassResult:
    """One row of the table: a layer's pass, ours against cuDNN (None: not measured)."""

    layer: str
    in_model: bool
    pass_name: str
    gemm: tuple[int, int, int]  # (M, N, K)
    ours: Timing
    cudnn: Timing | None = None
    cublas_ms: float | None = None
    error: float | None = None  # max |ours - cuDNN| / max |cuDNN|
    cudnn_kernels: str = ""  # the GPU kernels cuDNN ran for the pass (torch profiler), "" when unknown
    tuned: Timing | None = None  # ours with conv_algo "autotune" (the tile it chose: tuned_tile)
    tuned_tile: str = ""
    error64: float | None = None  # max |ours - float64 reference| / max |reference|
    cudnn_error64: float | None = None  # the same for cuDNN's result

    @property
    def flagged(self) -> bool:
        """Ours is off: its error against the float64 reference (against cuDNN when that was not computed)
        is above ERROR_FLAG."""
        error = self.error if self.error64 is None else self.error64
        return error is not None and error > ERROR_FLAG

    @property
    def ratio(self) -> float | None:
        """Throughput ours/cuDNN = cuDNN ms / ours ms (> 1: ours is faster)."""
        if self.cudnn is None:
            return None
        return throughput_ratio(self.ours.median_ms, self.cudnn.median_ms)

    @property
    def tuned_ratio(self) -> float | None:
        """Throughput of ours autotuned / cuDNN's (None: either not measured)."""
        if self.cudnn is None or self.tuned is None:
            return None
        return throughput_ratio(self.tuned.median_ms, self.cudnn.median_ms)


def throughput_ratio(ours_ms: float, ref_ms: float) -> float:
    """Our throughput relative to a reference's, from the two times: ref_ms / ours_ms."""
    return ref_ms / ours_ms


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of `flops` done in `ms` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


HEADER = (f"{'layer':<6} {'pass':<5} {'M x N x K':>20} {'ours ms (min)':>19} {'cuDNN ms (min)':>19} "
          f"{'ours/cuDNN':>10} {'TFLOP/s':>8} {'% peak':>6} {'cuBLAS ms':>9} {'err':>8} {'f64 ours|cuDNN':>18}")


def _ms(t: Timing | None) -> str:
    return "-" if t is None else f"{t.median_ms:.4f} ({t.min_ms:.4f})"


def format_row(r: PassResult, peak_flops: float | None) -> str:
    """The table row of one result (HEADER's columns); peak_flops None prints '-' for % peak."""
    m, n, k = r.gemm
    rate = tflops(gemm_flops(m, n, k), r.ours.median_ms)
    ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
    peak = "-" if peak_flops is None else f"{100 * rate * 1e12 / peak_flops:.1f}"
    cublas = "-" if r.cublas_ms is None else f"{r.cublas_ms:.4f}"
    err = "-" if r.error is None else f"{r.error:.1e}"
    f64 = "|".join("-" if e is None else f"{e:.1e}" for e in (r.error64, r.cudnn_error64)) + ("!" if r.flagged else " ")
    late = "~" if r.ours.late or (r.cudnn is not None and r.cudnn.late) else " "
    return (f"{r.layer:<6} {r.pass_name:<5} {f'{m} x {n} x {k}':>20} {_ms(r.ours):>19} {_ms(r.cudnn):>19} "
            f"{ratio:>10} {rate:>8.2f} {peak:>6} {cublas:>9} {err:>8} {f64:>19}{late}")


def layer_lines(layer: ConvLayer, rows: list[PassResult], peak_flops: float | None) -> list[str]:
    """The table rows of one layer in pass order, with a line in place of a dgrad that is not timed."""
    lines = [format_row(r, peak_flops) for r in rows]
    if not layer.needs_dgrad:
        at = sum(r.pass_name == "fprop" for r in rows)
        lines.insert(at, f"{layer.name:<6} dgrad (not timed: training never computes the first layer's dgrad)")
    return lines


def goal_lines(results: list[PassResult], goal: float = GOAL, tuned: bool = False) -> list[str]:
    """Per pass kind, the lowest throughput ours/cuDNN over the cifar10 layers and whether it meets `goal`;
    `tuned`: ours with conv_algo "autotune" (`PassResult.tuned_ratio`), lines prefixed "autotune"."""
    lines = []
    what, prefix = ("ours autotuned/cuDNN", "autotune ") if tuned else ("ours/cuDNN", "")
    for pass_name in PASSES:
        rows = [r for r in results if r.pass_name == pass_name and r.in_model]
        if not rows:
            continue
        ratio = {id(r): r.tuned_ratio if tuned else r.ratio for r in rows}
        missing = [r.layer for r in rows if ratio[id(r)] is None]
        if missing:
            lines.append(f"{prefix}{pass_name}: goal {what} >= {goal:.2f} not assessed: no "
                         f"{'cuDNN or autotuned' if tuned else 'cuDNN'} time for {', '.join(missing)}")
            continue
        low = min(rows, key=lambda r: ratio[id(r)])
        verdict = "met" if ratio[id(low)] >= goal else "NOT met"
        lines.append(f"{prefix}{pass_name}: lowest {what} {ratio[id(low)]:.2f} ({low.layer}) over "
                     f"{', '.join(r.layer for r in rows)}: goal >= {goal:.2f} {verdict}")
    return lines


TUNED_HEADER = (f"{'layer':<6} {'pass':<5} {'tile chosen':<16} {'autotuned ms (min)':>19} {'heuristic ms':>12} "
                f"{'tuned/heur.':>11} {'tuned/cuDNN':>11}")


def tuned_lines(results: list[PassResult]) -> list[str]:
    """The autotune table: per pass the tile conv_algo "autotune" chose, its ms (median (min)), the
    heuristic tiles' median ms, the speed-up over them (heuristic ms / autotuned ms) and the
    throughput against cuDNN; rows without an autotuned time are left out."""
    lines = []
    for r in results:
        if r.tuned is None:
            continue
        ratio = "-" if r.tuned_ratio is None else f"{r.tuned_ratio:.2f}"
        lines.append(f"{r.layer:<6} {r.pass_name:<5} {r.tuned_tile:<16} {_ms(r.tuned):>19} "
                     f"{r.ours.median_ms:>12.4f} {r.ours.median_ms / r.tuned.median_ms:>11.2f} {ratio:>11}")
    return lines


# ----------------------------------------------------------------------------------------------
# the device (cupy) and the reference (torch)


def no_device_reason() -> str | None:
    """Why nothing can be timed here (no cupy, no driver, no device: `cuda_probe`'s words), or None
    when a device is visible."""
    count, why = cuda_probe()
    return None if count else why


def peak_clock_khz(cupy, dev: int, props: dict) -> tuple[int, str]:
    """Peak SM clock of device `dev` in kHz and where it came from; (0, "unknown") when nothing says.
    cudaDeviceProp.clockRate is gone in CUDA 13, so the attribute is asked first."""
    rt = cupy.cuda.runtime
    try:
        khz = int(rt.deviceGetAttribute(rt.cudaDevAttrClockRate, dev))
    except Exception:  # an attribute this runtime does not know
        khz = 0
    if khz > 0:
        return khz, "cudaDevAttrClockRate"
    khz = int(props.get("clockRate", 0) or 0)
    if khz > 0:
        return khz, "cudaDeviceProp.clockRate"
    try:  # nvidia-smi numbers devices its own way: select by PCI bus id
        bus = rt.deviceGetPCIBusId(dev)
        out = subprocess.run(["nvidia-smi", "-i", bus, "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return int(float(out.split()[0]) * 1000), "nvidia-smi clocks.max.sm"
    except Exception:  # no nvidia-smi, no bus id, an answer that is not a number: the peak stays unknown
        return 0, "unknown"


def load_torch(dev: int) -> tuple[object | None, str]:
    """(torch, description) with cuDNN set up for the comparison on device `dev`, or (None, why not)."""
    try:
        import torch
    except ImportError as e:
        return None, f"not available (torch not importable: {e})"
    if not torch.cuda.is_available():
        return None, f"not available (torch {torch.__version__} sees no CUDA device)"
    if not torch.backends.cudnn.is_available():
        return None, f"not available (torch {torch.__version__} has no cuDNN)"
    torch.cuda.set_device(dev)
    torch.backends.cudnn.enabled = True
    torch.backends.cudnn.benchmark = True  # cuDNN times its algorithms on the first call of a shape, keeps the best
    return torch, (f"torch {torch.__version__} (CUDA {torch.version.cuda}), cuDNN {torch.backends.cudnn.version()}; "
                   f"cudnn.benchmark {torch.backends.cudnn.benchmark}, {disable_tf32(torch)}")


def disable_tf32(torch) -> str:
    """Turn TF32 off in cuDNN convolutions and cuBLAS matmuls (FP32 against FP32); the settings read back."""
    with warnings.catch_warnings():  # torch >= 2.9 prefers fp32_precision = "ieee" and warns on the legacy setters
        warnings.simplefilter("ignore")
        try:
            torch.backends.cudnn.allow_tf32 = False  # no TF32 tensor-core math in cuDNN ...
            torch.backends.cuda.matmul.allow_tf32 = False  # ... nor in cuBLAS
        except (AttributeError, RuntimeError):  # a torch without the legacy setters: the new ones
            torch.backends.cudnn.conv.fp32_precision = "ieee"
            torch.backends.cuda.matmul.fp32_precision = "ieee"
        settings = []
        for what, get in (("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
                          ("cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                          ("cudnn.conv.fp32_precision", lambda: torch.backends.cudnn.conv.fp32_precision)):
            try:
                settings.append(f"{what} {get()}")
            except (AttributeError, RuntimeError):  # not in this torch, or unreadable after mixed APIs
                settings.append(f"{what} ?")
    return ", ".join(settings)


def same_device_note(cupy, torch, dev: int) -> str:
    """Check that torch's cuda:dev is cupy's device dev (a cupy array handed over by DLPack lands there)."""
    try:
        t = torch.from_dlpack(cupy.zeros(1, dtype=np.float32))
    except Exception as e:  # an old DLPack pairing: say so, the names below still show both
        return f"unchecked ({type(e).__name__}: {e})"
    if t.device.index != dev:
        raise RuntimeError(f"cupy device {dev} is torch cuda:{t.device.index}: the comparison would span two GPUs")
    return f"yes (a cupy array of device {dev} is torch cuda:{dev}: {torch.cuda.get_device_name(dev)})"


def torch_conv_backend(torch, x, w, b, layer: ConvLayer) -> str:
    """The convolution backend torch dispatches these tensors to (expect 'Cudnn'), or '?' if it won't say."""
    try:
        backend = torch._C._select_conv_backend(x, w, b, [layer.stride] * 2, [layer.pad] * 2, [1, 1], False,
                                                [0, 0], 1, None)
    except Exception:  # a private function: absent or changed in this torch version
        return "?"
    return str(backend).rsplit(".", 1)[-1]


def cudnn_calls(torch, layer: ConvLayer, x, w, b, dy) -> dict[str, Callable[[], object]]:
    """pass -> a call of the same pass in cuDNN (through torch); each returns its output tensor."""
    stride, pad = [layer.stride] * 2, [layer.pad] * 2
    try:  # what autograd calls: cuDNN's dgrad and wgrad, separately by output_mask
        backward = torch.ops.aten.convolution_backward
    except (AttributeError, RuntimeError):
        backward = None
    if backward is not None:
        def dgrad():
            return backward(dy, x, w, None, stride, pad, [1, 1], False, [0, 0], 1, [True, False, False])[0]

        def wgrad():
            return backward(dy, x, w, None, stride, pad, [1, 1], False, [0, 0], 1, [False, True, False])[1]
    else:
        def dgrad():
            return torch.nn.grad.conv2d_input(x.shape, w, dy, stride, pad)

        def wgrad():
            return torch.nn.grad.conv2d_weight(x, w.shape, dy, stride, pad)

    return {"fprop": lambda: torch.nn.functional.conv2d(x, w, b, stride, pad), "dgrad": dgrad, "wgrad": wgrad}


# spins one thread until `cycles` SM clock cycles have passed: the GPU stays busy while the host queues work
SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}
"""


class Timer:
    """CUDA-event timing of calls on one stream, each queued behind a ~SPIN_MS spin kernel."""

    def __init__(self, cupy, stream, clock_khz: int) -> None:
        self.cupy, self.stream = cupy, stream
        self.cycles = int(SPIN_MS * (clock_khz if clock_khz > 0 else 2_000_000))
        self.spin_ms = SPIN_MS  # measured by calibrate()
        self._kernel = None

    def spin(self) -> None:
        if self._kernel is None:
            self._kernel = self.cupy.RawKernel(SPIN_SOURCE, "spin")
        self._kernel((1,), (1,), (np.int64(self.cycles),))  # on the current stream (self.stream)

    def calibrate(self) -> float:
        """The spin's length on this GPU, ms (the longest launch it can hide): the least of 5 spins."""
        start, stop = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        lengths = []
        for _ in range(5):
            start.record(self.stream)
            self.spin()
            stop.record(self.stream)
            stop.synchronize()
            lengths.append(self.cupy.cuda.get_elapsed_time(start, stop))
        self.spin_ms = min(lengths)
        return self.spin_ms

    def time(self, fn: Callable[[], object], runs: int, warmup: int) -> Timing:
        """Median and min of `runs` event-timed calls of `fn` after `warmup` untimed ones, ms per call."""
        cupy, stream = self.cupy, self.stream
        for _ in range(warmup):
            fn()
        stream.synchronize()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        samples, late = [], 0
        for _ in range(runs):
            self.spin()  # the events and the call queue behind it: the interval holds GPU time only
            t0 = time.perf_counter()
            start.record(stream)
            fn()
            stop.record(stream)
            late += (time.perf_counter() - t0) * 1e3 > self.spin_ms
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop))
        return Timing(statistics.median(samples), min(samples), late)


# ----------------------------------------------------------------------------------------------
# one layer


def time_cublas(cupy, timer: Timer, m: int, n: int, k: int, runs: int, warmup: int) -> float:
    """Median ms of cuBLAS's float32 GEMM (M, K) @ (K, N) -> (M, N) (cupy.matmul into a kept output)."""
    a = cupy.random.standard_normal((m, k), dtype=np.float32)
    b = cupy.random.standard_normal((k, n), dtype=np.float32)
    c = cupy.empty((m, n), np.float32)
    return timer.time(lambda: cupy.matmul(a, b, out=c), runs, warmup).median_ms


def cuda_kernel_names(torch, fn: Callable[[], object]) -> str:
    """The GPU kernels one call of `fn` runs, by name, from torch's profiler: which algorithm cuDNN
    picked (implicit GEMM, FFT or Winograd do different amounts of work for one convolution).
    "unknown (...)" when the profiler cannot say."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = []
        for e in prof.events():
            if str(getattr(e, "device_type", "")).endswith("CUDA") and e.name not in names:
                names.append(e.name)
        return "; ".join(names) if names else "unknown (no GPU kernel recorded)"
    except Exception as e:  # the profiler is an aid to reading the table, never a reason to stop
        return f"unknown ({type(e).__name__}: {e})"[:200]


def layer_inputs(layer: ConvLayer, seed: int = 0) -> dict[str, np.ndarray]:
    """Host float32 x (N,C,H,W), w (K,C,R,S) scaled by 1/sqrt(fan-in), b (K,), dy (N,K,P,Q) of `layer`."""
    rng = np.random.default_rng(seed)
    fan_in = layer.w_shape[1] * layer.w_shape[2] * layer.w_shape[3]
    return {"x": rng.standard_normal(layer.x_shape, dtype=np.float32),
            "w": rng.standard_normal(layer.w_shape, dtype=np.float32) * np.float32(1 / math.sqrt(fan_in)),
            "b": rng.standard_normal(layer.w_shape[0], dtype=np.float32),
            "dy": rng.standard_normal(layer.dy_shape, dtype=np.float32)}


def our_calls(layer: ConvLayer, ops, cupy, host: dict[str, np.ndarray]) -> dict[str, Callable[[], object]]:
    """{pass: call of our kernels} on device copies of `host` (device arrays are taken as they are); wgrad
    writes into one kept dw with a kept workspace, as Conv2d.backward does."""
    x, w, b, dy = (cupy.asarray(host[k]) for k in ("x", "w", "b", "dy"))
    dw, ws = cupy.empty(layer.w_shape, np.float32), ops.Workspace()
    s, p = layer.stride, layer.pad
    return {"fprop": lambda: ops.conv2d_fprop(x, w, b, s, p),
            "dgrad": lambda: ops.conv2d_dgrad(dy, w, layer.x_shape, s, p),
            "wgrad": lambda: ops.conv2d_wgrad(dy, x, layer.w_shape, s, p, out=dw, ws=ws)}


def float64_calls(layer: ConvLayer, host: dict[str, np.ndarray]) -> dict[str, Callable[[], np.ndarray]]:
    """{pass: call of the numpy reference (mpiasgd.ops.numpy_ops) on float64 copies of `host`}: the values
    both ours and cuDNN are measured against (`PassResult.error64`, `cudnn_error64`)."""
    from mpiasgd.ops.numpy_ops import NumpyBackend

    npo = NumpyBackend()
    x, w, b, dy = (host[k].astype(np.float64) for k in ("x", "w", "b", "dy"))
    s, p = layer.stride, layer.pad
    return {"fprop": lambda: npo.conv2d_fprop(x, w, b, s, p),
            "dgrad": lambda: npo.conv2d_dgrad(dy, w, layer.x_shape, s, p),
            "wgrad": lambda: npo.conv2d_wgrad(dy, x, layer.w_shape, s, p)}


def measure_layer(layer: ConvLayer, ops, cupy, torch, timer: Timer, runs: int, warmup: int,
                  seed: int = 0) -> tuple[list[PassResult], str]:
    """Check and time every pass of `layer` (ours, cuDNN when torch is given, cuBLAS); also the conv
    backend torch dispatches the layer to ("-" without torch)."""
    host = layer_inputs(layer, seed)
    ours = our_calls(layer, ops, cupy, host)
    exact = float64_calls(layer, host)
    ref, backend = None, "-"
    if torch is not None:  # the same values, copied to the same device
        t = {k: torch.from_numpy(v).to(torch.device("cuda", torch.cuda.current_device())) for k, v in host.items()}
        ref = cudnn_calls(torch, layer, t["x"], t["w"], t["b"], t["dy"])
        backend = torch_conv_backend(torch, t["x"], t["w"], t["b"], layer)
    timer.stream.synchronize()
    results = []
    for pass_name in PASSES:
        if pass_name == "dgrad" and not layer.needs_dgrad:
            continue
        error = cudnn_error64 = None
        y64 = exact[pass_name]()
        y = cupy.asnumpy(ours[pass_name]())
        error64 = relative_error(y, y64)
        if ref is not None:  # the first cuDNN call of a shape also runs cuDNN's algorithm search
            y_cudnn = ref[pass_name]().cpu().numpy()
            error, cudnn_error64 = relative_error(y, y_cudnn), relative_error(y_cudnn, y64)
        m, n, k = implicit_gemm(pass_name, layer)
        mine = timer.time(ours[pass_name], runs, warmup)
        theirs = None if ref is None else timer.time(ref[pass_name], runs, warmup)
        cublas = time_cublas(cupy, timer, m, n, k, runs, warmup)
        kernels = "" if ref is None else cuda_kernel_names(torch, ref[pass_name])
        try:  # a failure here must not cost the heuristic row its numbers
            tuned, tile = time_autotuned(ops, ours[pass_name], timer, runs, warmup)
        except Exception:
            print(f"!! {layer.name} {pass_name}: autotune failed\n{traceback.format_exc()}", flush=True)
            tuned, tile = None, AUTOTUNE_FAILED
        results.append(PassResult(layer.name, layer.in_model, pass_name, (m, n, k), mine, theirs, cublas, error,
                                  kernels, tuned, tile, error64, cudnn_error64))
    return results, backend


def time_autotuned(ops, call: Callable[[], object], timer: Timer, runs: int, warmup: int) -> tuple[Timing, str]:
    """Time `call` (one conv pass of ours) under conv_algo "autotune": its first call times every tile
    and keeps the fastest (`CupyBackend.conv_plans`), the timed calls run that one. Returns the timing and
    the tile's name; conv_algo is restored."""
    saved, made = ops.conv_algo, len(ops.conv_plans())
    ops.set_conv_algo("autotune")
    try:
        call()
        plans = ops.conv_plans()
        if len(plans) != made + 1:
            raise RuntimeError(f"autotune made {len(plans) - made} plans for one pass, expected 1")
        return timer.time(call, runs, warmup), tile_name(plans[-1].tile)
    finally:
        ops.set_conv_algo(saved)


AUTOTUNE_FAILED = "failed"  # PassResult.tuned_tile of a pass whose autotuned timing raised

GEMM_KERNELS = ("conv2d_fprop", "conv2d_dgrad", "conv2d_wgrad_partial")


def kernel_resources(kernels, driver) -> list[str]:
    """Per conv tile variant (production and trial) and GEMM kernel, as the driver reports them for
    the compiled code: registers per thread, static shared memory per block (KB), local memory per
    thread (bytes: spills), and the blocks of the tile's size the occupancy API lets reside per SM
    (conv2d.cu's launch bounds ask for CONV_BLOCKS_PER_SM). `kernels`: the backend's (`ops.kernels`,
    runtime.CudaKernels) or a stand-in; `driver`: cupy_backends.cuda.api.driver or a stand-in."""
    lines = []
    for tile in (*CONV_TILES, *CONV_TRIAL_TILES):
        cells = []
        for name in GEMM_KERNELS:
            raw = kernels.get(name, tile).fn  # a cupy.RawKernel; .kernel: its CUDA function
            blocks = driver.occupancyMaxActiveBlocksPerMultiprocessor(raw.kernel.ptr, conv_threads(tile), 0)
            cells.append(f"{name.removeprefix('conv2d_').removesuffix('_partial')} {raw.num_regs} regs "
                         f"{raw.shared_size_bytes / 1024:.1f} KiB local {raw.local_size_bytes} B {blocks} blocks/SM")
        lines.append(f"  {tile_name(tile):<14} {conv_threads(tile):>4} threads: " + ",  ".join(cells))
    return lines


def tile_sweep(layer: ConvLayer, ops, cupy, timer: Timer, runs: int, warmup: int, seed: int = 0) -> list[str]:
    """Lines giving the median ms of each pass of `layer` with every conv tile variant forced (a backend
    `ops.configured(tile_override=...)`; its split-K ranges `gemm_split` in brackets), the trial tiles
    (`CONV_TRIAL_TILES`: larger register blocks, one shared-memory stage, 32x96) included, the one
    `conv_tile` chooses marked with *, and the chosen tile without split-K where it splits: the data
    to tune both choices on a GPU."""
    # copied to the device once: our_calls takes device arrays as they are
    inputs = {k: cupy.asarray(v) for k, v in layer_inputs(layer, seed).items()}
    lines = []
    for pass_name in PASSES:
        if pass_name == "dgrad" and not layer.needs_dgrad:
            continue
        m, n, k = implicit_gemm(pass_name, layer)
        chosen, cells = ops.planner.conv_tile(m), []
        variants = [(tile, None) for tile in (*CONV_TILES, *CONV_TRIAL_TILES)]
        if ops.planner.gemm_split(m, n, k, chosen)[0] > 1:
            variants.append((chosen, 1))
        for tile, split in variants:
            forced = ops.configured(tile_override=tile, split_override=split)  # same kernels, its own planner
            splits = forced.planner.gemm_split(m, n, k, tile)[0]
            ms = timer.time(our_calls(layer, forced, cupy, inputs)[pass_name], runs, warmup).median_ms
            mark = "*" if tile == chosen and split is None else " "
            cells.append(f"{tile_name(tile)}[{splits}]{mark} {ms:8.4f} ms")
        lines.append(f"  tiles {layer.name:<8} {pass_name:<6} M={m:<5} " + "   ".join(cells))
    return lines


# ----------------------------------------------------------------------------------------------
# the other kernels (--ops): pooling, batch norm, residual shortcut, dropout, LRN, sgd against PyTorch

RESNET20_SHAPES = ((128, 16, 32, 32), (128, 64, 8, 8))  # resnet20 CIFAR activations at batch 128
ALEXNET_SHAPES = ((32, 96, 55, 55), (32, 256, 27, 27))  # AlexNet's conv1 / conv2 outputs at batch 32
SGD_PARAMS = 272_474  # resnet20's parameters


@dataclass(frozen=True)
class OpResult:
    """One row of the --ops table: our kernel(s) for one op on one shape against PyTorch's (None: not
    measured)."""

    op: str
    shape: str
    nbytes: int  # the least memory traffic of the op: every input read once, every output written once
    ours: Timing
    torch: Timing | None = None
    error: float | None = None  # max |ours - torch| / max |torch|; None where the outputs differ by design

    @property
    def ratio(self) -> float | None:
        """Throughput ours/torch = torch ms / ours ms (> 1: ours is faster)."""
        return None if self.torch is None else throughput_ratio(self.ours.median_ms, self.torch.median_ms)


OPS_HEADER = (f"{'op':<36} {'shape':<18} {'ours ms (min)':>19} {'torch ms (min)':>19} {'ours/torch':>10} "
              f"{'ours GB/s':>9} {'err':>9}")


def format_op_row(r: OpResult) -> str:
    """The --ops table row of one result (OPS_HEADER's columns): GB/s = the least traffic / ours median."""
    ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
    err = "-" if r.error is None else f"{r.error:.1e}" + ("!" if r.error > ERROR_FLAG else " ")
    late = "~" if r.ours.late or (r.torch is not None and r.torch.late) else " "
    return (f"{r.op:<36} {r.shape:<18} {_ms(r.ours):>19} {_ms(r.torch):>19} {ratio:>10} "
            f"{r.nbytes / (r.ours.median_ms * 1e-3) / 1e9:>9.1f} {err:>9}{late}")


@dataclass(frozen=True)
class OpCase:
    """One op to time: our call and PyTorch's (each returns the array compared, or None), the least bytes."""

    op: str
    shape: tuple[int, ...]
    nbytes: int
    ours: Callable[[], object]
    torch: Callable[[], object] | None
    comparable: bool = True  # False: the outputs differ by design (dropout's generators, sgd's state)


class _Inputs:
    """Float32 standard-normal arrays, the same values as a cupy array and (with torch) a torch tensor."""

    def __init__(self, cupy, torch, seed: int) -> None:
        self.cupy, self.torch, self.rng = cupy, torch, np.random.default_rng(seed)

    def pair(self, shape: tuple[int, ...]):
        host = self.rng.standard_normal(shape, dtype=np.float32)
        return self.cupy.asarray(host), (None if self.torch is None else self.torch.from_numpy(host).cuda())


def _batchnorm_cases(ops, torch, inputs: _Inputs, shape: tuple[int, int, int, int]) -> list[OpCase]:
    """Training-mode batch norm: statistics (with the running update) and y; the backward."""
    C, n, eps = shape[1], math.prod(shape), 1e-5
    (x, xt), (dy, dyt), (g, gt), (b, bt) = (inputs.pair(s) for s in (shape, shape, (C,), (C,)))
    rm, rv = ops.zeros(C), ops.asarray(np.ones(C))
    mean, var = ops.batchnorm_stats(x)
    dgamma, dbeta = ops.empty(C), ops.empty(C)

    def fprop():
        return ops.batchnorm_fprop(x, g, b, *ops.batchnorm_stats(x, rm, rv, 0.1), eps)

    def bprop():
        return ops.batchnorm_bprop(dy, x, g, mean, var, eps, dgamma, dbeta)

    if torch is None:
        return [OpCase("batchnorm train fprop (stats+y)", shape, 8 * n, fprop, None),
                OpCase("batchnorm bprop (dx, dgamma, dbeta)", shape, 12 * n, bprop, None)]
    rmt, rvt = torch.zeros(C, device="cuda"), torch.ones(C, device="cuda")
    _, save_mean, save_invstd = torch.ops.aten.native_batch_norm(xt, gt, bt, None, None, True, 0.1, eps)
    return [OpCase("batchnorm train fprop (stats+y)", shape, 8 * n, fprop,
                   lambda: torch.nn.functional.batch_norm(xt, rmt, rvt, gt, bt, training=True, momentum=0.1, eps=eps)),
            OpCase("batchnorm bprop (dx, dgamma, dbeta)", shape, 12 * n, bprop,
                   lambda: torch.ops.aten.native_batch_norm_backward(dyt, xt, gt, None, None, save_mean, save_invstd,
                                                                     True, eps, [True, True, True])[0])]


def _shortcut_cases(ops, torch, inputs: _Inputs, shape: tuple[int, int, int, int]) -> list[OpCase]:
    """resnet20's first-stage shortcut into the second (option A), a residual add, dropout p 0.5."""
    C, n = shape[1], math.prod(shape)
    (x, xt), (b, bt) = inputs.pair(shape), inputs.pair(shape)
    out = ops.empty(shape)
    y_size = math.prod(ops.subsample_pad_fprop(x, 2, C // 2, C // 2).shape)
    outt = None if torch is None else torch.empty_like(xt)
    F = None if torch is None else torch.nn.functional
    return [OpCase("subsample_pad fprop (option A)", shape, 4 * (n // 4 + y_size),
                   lambda: ops.subsample_pad_fprop(x, 2, C // 2, C // 2),
                   None if torch is None else lambda: F.pad(xt[:, :, ::2, ::2], (0, 0, 0, 0, C // 2, C // 2))),
            OpCase("add", shape, 12 * n, lambda: ops.add(x, b, out=out),
                   None if torch is None else lambda: torch.add(xt, bt, out=outt)),
            OpCase("dropout p 0.5", shape, 8 * n, lambda: ops.dropout_fprop(x, 0.5, 1, 2, 3),
                   None if torch is None else lambda: F.dropout(xt, 0.5, training=True), comparable=False)]


def _global_pool_cases(ops, torch, inputs: _Inputs, shape: tuple[int, int, int, int]) -> list[OpCase]:
    x, xt = inputs.pair(shape)
    return [OpCase("global_avgpool fprop", shape, 4 * (math.prod(shape) + shape[0] * shape[1]),
                   lambda: ops.global_avgpool_fprop(x), None if torch is None else lambda: xt.mean(dim=(2, 3)))]


def _alexnet_cases(ops, torch, inputs: _Inputs, shape: tuple[int, int, int, int]) -> list[OpCase]:
    """AlexNet's response normalisation (size 5, alpha 1e-4, beta 0.75, k 2) and pooling 3/2 ceil_mode."""
    n = math.prod(shape)
    (x, xt), (dy, dyt) = inputs.pair(shape), inputs.pair(shape)
    y, scale = ops.lrn_fprop(x, 5, 1e-4, 0.75, 2.0)
    m, argmax = ops.maxpool_fprop(x, 3, 2, 0, True)
    g, gt = inputs.pair(tuple(m.shape))
    pooled = math.prod(m.shape)
    ours = [("lrn fprop (size 5)", 12 * n, lambda: ops.lrn_fprop(x, 5, 1e-4, 0.75, 2.0)[0]),
            ("lrn bprop", 20 * n, lambda: ops.lrn_bprop(dy, x, y, scale, 5, 1e-4, 0.75)),
            ("maxpool fprop 3/2 ceil", 4 * n + 5 * pooled, lambda: ops.maxpool_fprop(x, 3, 2, 0, True)[0]),
            ("maxpool bprop 3/2 ceil", 5 * pooled + 4 * n, lambda: ops.maxpool_bprop(g, argmax, shape, 3, 2, 0, True)),
            ("avgpool fprop 3/2 ceil", 4 * (n + pooled), lambda: ops.avgpool_fprop(x, 3, 2, 0, True)),
            ("avgpool bprop 3/2 ceil", 4 * (n + pooled), lambda: ops.avgpool_bprop(g, shape, 3, 2, 0, True))]
    if torch is None:
        return [OpCase(op, shape, nbytes, call, None) for op, nbytes, call in ours]
    F, aten = torch.nn.functional, torch.ops.aten
    xg = xt.clone().requires_grad_(True)
    yt = F.local_response_norm(xg, 5, 1e-4, 0.75, 2.0)  # its graph, kept for the timed backwards
    idx = F.max_pool2d(xt, 3, 2, 0, ceil_mode=True, return_indices=True)[1]
    theirs = [lambda: F.local_response_norm(xt, 5, 1e-4, 0.75, 2.0),
              lambda: torch.autograd.grad(yt, xg, dyt, retain_graph=True)[0],
              lambda: F.max_pool2d(xt, 3, 2, 0, ceil_mode=True, return_indices=True)[0],
              lambda: aten.max_pool2d_with_indices_backward(gt, xt, [3, 3], [2, 2], [0, 0], [1, 1], True, idx),
              lambda: F.avg_pool2d(xt, 3, 2, 0, ceil_mode=True),
              lambda: aten.avg_pool2d_backward(gt, xt, [3, 3], [2, 2], [0, 0], True, True, None)]
    return [OpCase(op, shape, nbytes, call, ref) for (op, nbytes, call), ref in zip(ours, theirs, strict=True)]


def _sgd_cases(ops, torch, inputs: _Inputs) -> list[OpCase]:
    """One sgd_momentum step (nesterov, lr_scale) on resnet20's parameter count; torch.optim.SGD's step
    (nesterov, foreach; no lr_scale) with the same sizes."""
    n = SGD_PARAMS
    (p, pt), (v, _), (g, gt), (s, _) = (inputs.pair((n,)) for _ in range(4))
    decay = ops.asarray(np.full(n, 5e-4))
    opt = None
    if torch is not None:
        pt.grad = gt
        opt = torch.optim.SGD([pt], lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, foreach=True)
    return [OpCase("sgd_momentum nesterov lr_scale", (n,), 28 * n,
                   lambda: ops.sgd_momentum(p, v, g, decay, 0.9, 0.1, nesterov=True, lr_scale=s),
                   None if torch is None else lambda: opt.step(), comparable=False)]


def op_cases(ops, cupy, torch, seed: int = 0) -> list[OpCase]:
    """The ops --ops times, on resnet20's and AlexNet's shapes, with the same inputs on both sides (`torch`
    None: ours only). PyTorch's side: F.batch_norm and aten.native_batch_norm_backward, F.pad of a
    strided view, torch.add, F.dropout, a mean, F.local_response_norm and its autograd backward, max and
    average pooling with their aten backwards, torch.optim.SGD (foreach)."""
    inputs = _Inputs(cupy, torch, seed)
    first, last = RESNET20_SHAPES
    cases = [*_batchnorm_cases(ops, torch, inputs, first), *_batchnorm_cases(ops, torch, inputs, last),
             *_shortcut_cases(ops, torch, inputs, first), *_global_pool_cases(ops, torch, inputs, last)]
    for shape in ALEXNET_SHAPES:
        cases += _alexnet_cases(ops, torch, inputs, shape)
    return cases + _sgd_cases(ops, torch, inputs)


def measure_ops(cases: list[OpCase], cupy, timer: Timer, runs: int, warmup: int) -> tuple[list[OpResult], list[str]]:
    """Check (one call each side) and time every case; (results, the ops that failed, reported on stdout)."""
    results, failed = [], []
    for case in cases:
        shape = "x".join(map(str, case.shape))
        try:
            error = None
            if case.torch is not None and case.comparable:
                error = relative_error(cupy.asnumpy(case.ours()), case.torch().detach().cpu().numpy())
            mine = timer.time(case.ours, runs, warmup)
            theirs = None if case.torch is None else timer.time(case.torch, runs, warmup)
        except Exception:  # report and go on: one op's failure must not hide the rest
            failed.append(f"{case.op} {shape}")
            print(f"!! {case.op} {shape}: failed\n{traceback.format_exc()}", flush=True)
            continue
        results.append(OpResult(case.op, shape, case.nbytes, mine, theirs, error))
        print(format_op_row(results[-1]), flush=True)
    return results, failed


# ----------------------------------------------------------------------------------------------
# main


def parse(argv: list[str] | None) -> argparse.Namespace:
    names = [layer.name for layer in bench_layers(1)]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch", type=positive, default=128, help="minibatch N of every layer, images")
    parser.add_argument("--runs", type=positive, default=50, help="timed calls per pass and library (median, min)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before timing (cuDNN's search too)")
    parser.add_argument("--layers", nargs="+", choices=names, default=names, metavar="LAYER",
                        help=f"which layers, of: {' '.join(names)}")
    parser.add_argument("--no-torch", action="store_true", help="time ours (and cuBLAS) only, no cuDNN")
    parser.add_argument("--tiles", action="store_true",
                        help="also time every conv tile variant of ours on every pass (* marks conv_tile's choice)")
    parser.add_argument("--ops", action="store_true",
                        help="instead of the conv layers, time the other kernels (pooling, batch norm, residual "
                             "shortcut, dropout, LRN, sgd) against PyTorch's on resnet20 and AlexNet shapes")
    parser.add_argument("--dry-run", action="store_true",
                        help="no device needed: check the arguments and imports, print what would be timed, exit 0 "
                             "(CI runs it, so that GPU time is not spent on a typo)")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"argument --warmup: expected an integer >= 0, got {args.warmup}")
    return args


def device_lines(cupy, dev: int) -> tuple[list[str], float | None, int]:
    """Header lines about device `dev`, its FP32 peak FLOP/s (None: unknown) and peak SM clock (kHz, 0: unknown)."""
    props = cupy.cuda.runtime.getDeviceProperties(dev)
    major, minor, sms = int(props["major"]), int(props["minor"]), int(props["multiProcessorCount"])
    clock_khz, clock_from = peak_clock_khz(cupy, dev, props)
    peak = fp32_peak_flops(major, minor, sms, clock_khz)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    if peak is None:
        peak_text = f"unknown (FP32 lanes per SM of {major}.{minor} not in the table, or no clock)"
    else:
        peak_text = (f"{peak / 1e12:.1f} TFLOP/s = {sms} SMs x {fp32_lanes_per_sm(major, minor)} lanes x 2 x "
                     f"{clock_khz / 1e6:.3f} GHz")
    rt = cupy.cuda.runtime
    return [f"device {dev}: {name}, compute capability {major}.{minor}, {sms} SMs, peak SM clock "
            f"{clock_khz / 1e6:.3f} GHz ({clock_from})",
            f"FP32 peak: {peak_text}",
            f"cupy {cupy.__version__}, CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}; "
            f"cuBLAS column: cupy.matmul with CUPY_TF32={os.environ.get('CUPY_TF32', '0')} (0: FP32, no TF32)"], \
        peak, clock_khz


def run_ops(args: argparse.Namespace, ops, cupy, torch, stream, on_torch_stream, clock_khz: int) -> int:
    """--ops: the table of the non-conv kernels against PyTorch (`op_cases`), timed as the conv passes are.
    Exit status 0 after the measurement, 1 when an op failed."""
    with stream, on_torch_stream:  # every launch below, cupy's and torch's, goes to `stream`
        timer = Timer(cupy, stream, clock_khz)
        timer.calibrate()
        print(f"timing: median (min) of {args.runs} calls after {args.warmup} warm-up call(s), CUDA events on one "
              f"stream, each call queued behind a {timer.spin_ms:.2f} ms spin kernel; ms per call")
        print("ours/torch = torch ms / ours ms (throughput); GB/s = the op's least memory traffic (each input read "
              f"once, each output written once) / ours ms; err = max|ours - torch| / max|torch| (! above "
              f"{ERROR_FLAG:g}; - where the outputs differ by design: dropout's generators, optimizer state)\n")
        print(OPS_HEADER, flush=True)
        results, failed = measure_ops(op_cases(ops, cupy, torch), cupy, timer, args.runs, args.warmup)
    if any(r.ours.late or (r.torch is not None and r.torch.late) for r in results):
        print(f"~: some calls took longer than the {timer.spin_ms:.2f} ms spin to launch: their samples may "
              "hold host time")
    flagged = [f"{r.op} {r.shape}" for r in results if r.error is not None and r.error > ERROR_FLAG]
    if flagged:
        print(f"!! ours differs from torch by more than {ERROR_FLAG:g} of max |torch|: {', '.join(flagged)}")
    if failed:
        print(f"!! failed: {', '.join(failed)}")
        return 1
    return 0


def dry_run(args: argparse.Namespace) -> int:
    """--dry-run: what a run with these arguments would time, from what needs no device; exit status 0."""
    if args.ops:
        print(f"dry run: --ops would time the non-conv kernels against PyTorch, {args.runs} calls after "
              f"{args.warmup} warm-up call(s) each (the cases are built on the device)")
        return 0
    layers = [layer for layer in bench_layers(args.batch) if layer.name in args.layers]
    against = "nothing (--no-torch)" if args.no_torch else "cuDNN through PyTorch"
    print(f"dry run: {len(layers)} layer(s), each pass of each (fprop, dgrad, wgrad), {args.runs} calls after "
          f"{args.warmup} warm-up call(s) each, against {against}:")
    for layer in layers:
        print("  " + layer.describe())
    if args.tiles:
        print("  and every tile: " + ", ".join(tile_name(t) for t in (*CONV_TILES, *CONV_TRIAL_TILES)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:
        return dry_run(args)
    why = no_device_reason()
    if why is not None:
        print(f"bench/kernels.py: no CUDA device visible ({why}): nothing to time", file=sys.stderr)
        return 2
    import cupy

    from mpiasgd.ops import get_backend

    ops = get_backend("cupy")
    dev = cupy.cuda.Device().id
    lines, peak, clock_khz = device_lines(cupy, dev)
    print("\n".join(lines))
    print(f"split-K: waves of {ops.device.wave()} blocks (SMs x {CONV_BLOCKS_PER_SM}), see Planner.gemm_split")
    torch, torch_note = (None, "not available (--no-torch)") if args.no_torch else load_torch(dev)
    print(f"cuDNN reference: {torch_note}")
    stream = cupy.cuda.Stream(non_blocking=True)  # one stream for cupy and torch: one queue, one kind of event
    on_torch_stream = contextlib.nullcontext()
    if torch is not None:
        print(f"same device for cupy and torch: {same_device_note(cupy, torch, dev)}")
        on_torch_stream = torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", dev)))
    if args.ops:
        return run_ops(args, ops, cupy, torch, stream, on_torch_stream, clock_khz)
    layers = [layer for layer in bench_layers(args.batch) if layer.name in args.layers]
    print(f"layers (NCHW float32, batch {args.batch}):")
    for layer in layers:
        print("  " + layer.describe())

    results, failed, backends = [], [], {}
    with stream, on_torch_stream:  # every launch below, cupy's and torch's, goes to `stream`
        timer = Timer(cupy, stream, clock_khz)
        timer.calibrate()
        print(f"timing: median (min) of {args.runs} calls after {args.warmup} warm-up call(s), CUDA events on one "
              f"stream, each call queued behind a {timer.spin_ms:.2f} ms spin kernel; ms per call")
        print(f"ours/cuDNN = cuDNN ms / ours ms (throughput; goal >= {GOAL:.2f}); TFLOP/s = 2*M*N*K / ours ms; "
              f"err = max|ours - cuDNN| / max|cuDNN| (! above {ERROR_FLAG:g})\n")
        print(HEADER, flush=True)
        for layer in layers:
            try:
                rows, backends[layer.name] = measure_layer(layer, ops, cupy, torch, timer, args.runs, args.warmup)
            except Exception:  # report and go on with the next layer: one failure must not hide the rest
                failed.append(layer.name)
                print(f"!! {layer.name}: failed\n{traceback.format_exc()}", flush=True)
                continue
            print("\n".join(layer_lines(layer, rows, peak)), flush=True)
            results.extend(rows)

        if args.tiles:
            print("\nconv GEMM kernels as compiled for this device (driver attributes, occupancy API):")
            try:
                from cupy_backends.cuda.api import driver
                print("\n".join(kernel_resources(ops.kernels, driver)), flush=True)
            except Exception:  # a diagnostic: its failure must not stop the sweep
                print(f"!! kernel resources: failed\n{traceback.format_exc()}", flush=True)
            print("\nours with each tile variant forced (median ms; [split-K ranges]; * = what the heuristic picks):")
            for layer in layers:
                try:
                    print("\n".join(tile_sweep(layer, ops, cupy, timer, args.runs, args.warmup)), flush=True)
                except Exception:
                    failed.append(f"{layer.name} (tiles)")
                    print(f"!! {layer.name} tile sweep: failed\n{traceback.format_exc()}", flush=True)

    print()
    if any(r.cudnn_kernels for r in results):
        print("cuDNN's kernels (torch profiler; FFT or Winograd ones do fewer FLOPs than a direct convolution):")
        for r in results:
            if r.cudnn_kernels:
                print(f"  {r.layer:<8} {r.pass_name:<6} {r.cudnn_kernels}")
    if torch is not None and backends:
        print("torch conv backend: " + ", ".join(f"{k} {v}" for k, v in backends.items()) + " (Cudnn expected)")
    if any(r.ours.late or (r.cudnn is not None and r.cudnn.late) for r in results):
        print(f"~: some calls took longer than the {timer.spin_ms:.2f} ms spin to launch: their samples may "
              "hold host time")
    flagged = [f"{r.layer} {r.pass_name}" for r in results if r.flagged]
    if flagged:
        print(f"!! ours differs from the float64 reference by more than {ERROR_FLAG:g} of its max: "
              f"{', '.join(flagged)}")
    off = [f"{r.layer} {r.pass_name} ({r.cudnn_error64:.1e})" for r in results
           if r.cudnn_error64 is not None and r.cudnn_error64 > ERROR_FLAG]
    if off:
        print(f"cuDNN differs from the float64 reference by more than {ERROR_FLAG:g} of its max (its algorithm's "
              f"rounding, see its kernels below): {', '.join(off)}")
    if any(r.tuned is not None for r in results):
        print("\nautotune (--conv-algo autotune: each pass times every tile on its first call, keeps the fastest; "
              "heuristic: the table above):")
        print("\n".join([TUNED_HEADER, *tuned_lines(results)]))
        plans = {p.describe() for p in ops.conv_plans()}
        print("autotune's timings (ms per call, as the first call measured them):\n  " + "\n  ".join(sorted(plans)))
    if torch is None:
        print(f"cuDNN {torch_note}: ours only, the goal (ours/cuDNN >= {GOAL:.2f}) is not assessed")
    else:
        print("\n".join(goal_lines(results) + goal_lines(results, tuned=True)))
    failed += [f"{r.layer} {r.pass_name} (autotune)" for r in results if r.tuned_tile == AUTOTUNE_FAILED]
    if failed:
        print(f"!! failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
