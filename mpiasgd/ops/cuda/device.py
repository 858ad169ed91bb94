"""The device a CUDA backend launches on: its launch limits, its index, compute capability and wave of
conv blocks, and a clock for autotune's timings.

`CudaDevice` is the current GPU as cupy sees it (a worker selects it before the first launch);
`HostDevice` stands in without a GPU (the CUDA-on-CPU harness and tests): no index, no wave, the host
clock. Both check launches against `LaunchLimits` before anything runs. Importing this module needs
neither cupy nor a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from mpiasgd.ops.cuda.constants import (
    CONV_BLOCKS_PER_SM,
    MAX_BLOCK_THREADS,
    MAX_GRID_X,
    MAX_GRID_YZ,
    MAX_STATIC_SHARED,
)
from mpiasgd.ops.cuda.runtime import NVRTC_OPTIONS

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class LaunchLimits:
    """CUDA's launch limits (`constants`); the CPU harness may narrow them to stand in for a layer past
    the device's grid (tests)."""

    max_grid_x: int = MAX_GRID_X  # blocks along x
    max_grid_yz: int = MAX_GRID_YZ  # blocks along y and along z (split-K ranges are grid z)
    max_block_threads: int = MAX_BLOCK_THREADS  # threads per block
    max_static_shared: int = MAX_STATIC_SHARED  # bytes of static shared memory per block

    def check(self, kernel: str, grid: Grid, block: Grid, shared_mem: int = 0) -> None:
        """ValueError naming `kernel` unless grid, block and shared memory (bytes) are within the limits."""
        gx, gy, gz = grid
        bx, by, bz = block
        if min(gx, gy, gz) < 1 or gx > self.max_grid_x or gy > self.max_grid_yz or gz > self.max_grid_yz:
            raise ValueError(f"{kernel}: grid {grid} outside the limits (1..{self.max_grid_x}, 1..{self.max_grid_yz}, "
                             f"1..{self.max_grid_yz})")
        if min(bx, by, bz) < 1 or bx * by * bz > self.max_block_threads or bz > 64:
            raise ValueError(f"{kernel}: block {block} outside the limits (<= {self.max_block_threads} threads, "
                             "z <= 64)")
        if not 0 <= shared_mem <= self.max_static_shared:
            raise ValueError(f"{kernel}: shared memory {shared_mem} B outside 0..{self.max_static_shared}")


class Device(Protocol):
    """What the planner and the wrappers ask of the device they launch on."""

    limits: LaunchLimits

    def index(self) -> int | None:
        """Device index (what a plan or tap table is valid for); None without a GPU."""

    def compute_capability(self) -> int | None:
        """Compute capability as an int (90 for sm_90); None: unknown (any)."""

    def wave(self) -> int | None:
        """Conv GEMM blocks the device runs at once; None: unknown."""

    def time_calls(self, fn: Callable[[], None], calls: int, launch_ms: float) -> float:
        """Milliseconds per call of `fn` over `calls` back-to-back calls (`launch_ms`: one call's host time)."""


# A one-thread kernel that waits `ns` nanoseconds of the GPU's global timer: queued before the
# timed calls, it holds the stream while the host launches them, so the events time the GPU's work
# and not the host's launch overhead (a wrapper's launch takes about as long as a small layer's kernel).
SPIN_SOURCE = r"""
extern "C" __global__ void autotune_spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""
AUTOTUNE_SPIN_MS = 1.0  # at least; longer when launching the timed calls takes the host longer
AUTOTUNE_LATE_RETRIES = 3  # samples taken again when the host fell behind the spin


class CudaDevice:
    """The current CUDA device through `cupy` (the module; None or a stand-in in tests).

    `spin_kernel`: the launcher of SPIN_SOURCE's kernel, compiled on the first timing when None."""

    def __init__(self, cupy: Any, limits: LaunchLimits = LaunchLimits(), spin_kernel: Callable | None = None) -> None:
        self.cupy, self.limits = cupy, limits
        self._spin = spin_kernel
        self._sm_counts: dict[int, int] = {}  # device index -> SMs, asked once

    def index(self) -> int:
        """The current device's index (cupy.cuda.runtime.getDevice())."""
        return int(self.cupy.cuda.runtime.getDevice())

    def compute_capability(self) -> int:
        """The current device's compute capability as an int (90 for sm_90)."""
        return int(self.cupy.cuda.Device().compute_capability)

    def wave(self) -> int | None:
        """Conv GEMM blocks the current GPU runs at once: its SMs x CONV_BLOCKS_PER_SM (264 on an H200).
        None where no device answers (no cupy, no driver, no device: launches fail anyway, and say so)."""
        try:
            device = self.index()
            if device not in self._sm_counts:
                props = self.cupy.cuda.runtime.getDeviceProperties(device)
                self._sm_counts[device] = int(props["multiProcessorCount"])
            return self._sm_counts[device] * CONV_BLOCKS_PER_SM
        except Exception:  # cupy's CUDARuntimeError, or no cupy at all
            return None

    def time_calls(self, fn: Callable[[], None], calls: int, launch_ms: float) -> float:
        """Ms per call of `fn` over `calls` back-to-back calls: CUDA events on the current stream recorded
        behind a spin kernel that outlasts the host's launches (`SPIN_SOURCE`; `launch_ms`: the host time
        one call took), so the interval holds GPU time only; a sample whose start event had already passed
        when the last call was queued (the host was slower than the spin: a GC pause, another process) may
        hold idle time, and is taken again behind a spin twice as long (at most AUTOTUNE_LATE_RETRIES times)."""
        cuda = self.cupy.cuda
        spin_ms = max(AUTOTUNE_SPIN_MS, 2 * launch_ms * calls)
        for _ in range(1 + AUTOTUNE_LATE_RETRIES):
            start, stop = cuda.Event(), cuda.Event()
            self._spin_kernel()((1,), (1,), (np.uint64(int(spin_ms * 1e6)),))
            start.record()
            for _ in range(calls):
                fn()
            late = start.done  # the spin ended before the last launch: the GPU may have waited for the host
            stop.record()
            stop.synchronize()
            if not late:
                break
            spin_ms *= 2
        return cuda.get_elapsed_time(start, stop) / calls

    def _spin_kernel(self) -> Callable:
        if self._spin is None:
            self._spin = self.cupy.RawKernel(SPIN_SOURCE, "autotune_spin", options=NVRTC_OPTIONS)
        return self._spin


@dataclass(frozen=True)
class HostDevice:
    """No GPU: the backend's arrays are host arrays (the CUDA-on-CPU harness, fakes in tests).

    Times with the host clock unless `clock` (a stand-in with `time_calls`' signature) is given."""

    limits: LaunchLimits = LaunchLimits()
    capability: int | None = None  # compute capability to report (None: any)
    sm_wave: int | None = None  # blocks per wave to report (None: unknown, split-K aims at CONV_TARGET_BLOCKS)
    clock: Callable[[Callable[[], None], int, float], float] | None = field(default=None, compare=False)

    def index(self) -> None:
        """None: plans and tap tables made here hold for this host backend only."""
        return None

    def compute_capability(self) -> int | None:
        """`capability` (None: any device)."""
        return self.capability

    def wave(self) -> int | None:
        """`sm_wave` (None: unknown)."""
        return self.sm_wave

    def time_calls(self, fn: Callable[[], None], calls: int, launch_ms: float) -> float:
        """Ms per call of `fn` over `calls` calls by the host clock (or `clock`'s answer)."""
        if self.clock is not None:
            return self.clock(fn, calls, launch_ms)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e3 / calls
