"""The CUDA backend: the hand-written kernels of `kernels/*.cu` on one GPU through CuPy, NCHW float32.

An object satisfying `mpiasgd.ops.protocol.Backend` (the ground truth it is tested against is the
numpy backend), plus the start-up and tuning calls of a GPU worker:

    ops = get_backend("cupy")                          # CupyBackend.on_gpu(), one per process
    ops.set_conv_algo("autotune"); ops.compile_kernels(autotune=True)
    y = ops.conv2d_fprop(x, w, b, stride, pad)         # x, w, b cupy float32, C-contiguous
    print([plan.describe() for plan in ops.conv_plans()])

What it is made of (each replaceable, so that the same wrappers run without a GPU):
  xp        the array module (cupy; numpy for the CUDA-on-CPU harness of the tests, or a fake)
  kernels   where launches go (`runtime.CudaKernels`: NVRTC modules; the harness in tests)
  device    the device's limits, index, wave and clock (`device.CudaDevice`; `HostDevice`)
  planner   tiles, split-K, tap tables, autotune plans (`planner.Planner`)
  blocks    the block sizes of the kernels other than the conv GEMMs (`Blocks`)

Every wrapper checks each array (`contract.check_array`: this backend's array type, never a host
array whose pointer a kernel would misread; float32, or the integer type of an index array;
C-contiguous; shape), casts every scalar to its C type (`contract.c_int32`, ...), and computes grid,
block and shared memory in plain view; `launch` checks them against the device's limits and the
arguments' C types before anything runs.

Float sums run in a different order than NumPy's BLAS: results agree to float32 rounding, and every
reduction (wgrad over the batch, bias_grad, the batch-norm statistics and gradients, the pooling
backwards) has a fixed order without atomics, so each result is bit-reproducible run to run on one
device (with conv_algo "autotune", for a given choice of tiles, which is itself a measurement).
Importing this module needs neither cupy nor a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpiasgd.ops.contract import (
    argmax_dtype,
    c_float32,
    c_int32,
    c_int64,
    check_bool,
    check_int,
    check_labels,
    check_linear_dgrad,
    check_linear_wgrad,
    check_lrn,
    check_real,
    conv_geometry,
    conv_ints,
    dropout_key,
    label_outside,
    pool_geometry,
    shape4,
)
from mpiasgd.ops.contract import check_array as check_device_array
from mpiasgd.ops.cuda.constants import (
    BATCHNORM_THREADS_MAX,
    BIAS_THREADS_MAX,
    SOFTMAX_THREADS_MAX,
    SPLIT_REDUCE_OUTS,
    SPLIT_REDUCE_THREADS_MAX,
)
from mpiasgd.ops.cuda.device import CudaDevice, Device, Grid, HostDevice
from mpiasgd.ops.cuda.planner import ConvPlan, Planner, autotune_tiles
from mpiasgd.ops.cuda.runtime import KERNEL_FILES, CudaKernels, Kernels, check_args, check_kernel_sources
from mpiasgd.ops.cuda.tiles import CONV_TILES, tile_defines
from mpiasgd.ops.protocol import LossStats

ELEMENTWISE_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 65535  # grid-stride loops cover the rest


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Blocks:
    """Block sizes of the kernels other than the conv GEMMs (whose block is their tile's): production
    values by default; the CPU harness uses smaller ones to run more of each kernel's paths."""

    reduce_threads: int = min(BIAS_THREADS_MAX, SOFTMAX_THREADS_MAX)  # bias_grad, softmax_xent: a power of two
    batchnorm_threads: int = BATCHNORM_THREADS_MAX  # batchnorm_stats, batchnorm_bprop: a power of two
    elementwise_threads: int = ELEMENTWISE_THREADS  # relu, pooling, dropout, lrn, sgd, ...: any
    elementwise_max_blocks: int = ELEMENTWISE_MAX_BLOCKS  # grid-stride loops cover the rest

    def elementwise(self, n: int) -> tuple[Grid, Grid]:
        """Grid-stride launch over n elements: `elementwise_threads` threads per block, at most
        `elementwise_max_blocks` blocks (>= 1 even for n = 0)."""
        blocks = max(1, min(_cdiv(n, self.elementwise_threads), self.elementwise_max_blocks))
        return (blocks, 1, 1), (self.elementwise_threads, 1, 1)


class DeviceWorkspace:
    """Device scratch arrays of one layer, kept between minibatches and reused while shapes match
    (the split-K buffers). The kernels build no im2col matrix, so no columns are kept."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self._arrays: dict = {}
        self.cols_src = None  # interface parity with numpy_ops.Workspace; unused here

    def get(self, key: str, shape: tuple[int, ...], dtype) -> Any:
        """The scratch array named `key`, reallocated (uninitialized) if shape or dtype changed."""
        a = self._arrays.get(key)
        if a is None or tuple(a.shape) != tuple(shape) or a.dtype != dtype:
            a = self.xp.empty(shape, dtype=dtype)
            self._arrays[key] = a
        return a

    @property
    def nbytes(self) -> int:
        """Bytes held by all scratch arrays."""
        return sum(int(a.nbytes) for a in self._arrays.values())

    def arrays(self) -> list:
        """The scratch arrays held now (a CUDA graph that launched on them keeps them: `ops.cuda.graphs`)."""
        return list(self._arrays.values())


class CupyBackend:
    """The ops on `kernels`, arrays of `xp`, launched on `device` with the tiles `planner` picks.

    Build one with `on_gpu()` (what `get_backend("cupy")` keeps), `on_host(...)` (no GPU: the CUDA-on-CPU
    harness, fakes), or `configured(...)` (the same arrays, kernels and device with other planner knobs).
    """

    name = "cupy"

    def __init__(self, xp: Any, kernels: Kernels, device: Device, planner: Planner, blocks: Blocks = Blocks()) -> None:
        self.xp, self.kernels, self.device, self.planner, self.blocks = xp, kernels, device, planner, blocks
        self.ndarray = xp.ndarray if xp is not None else None

    @classmethod
    def on_gpu(cls) -> CupyBackend:
        """The backend on the current CUDA device (cupy imported here). Raises ImportError without cupy
        and FileNotFoundError when a kernel source is missing (`runtime.check_kernel_sources`)."""
        import cupy

        device = CudaDevice(cupy)
        return cls(cupy, CudaKernels(cupy, check_kernel_sources()), device, Planner(cupy, device))

    @classmethod
    def on_host(cls, xp: Any, kernels: Kernels, device: Device | None = None, **knobs) -> CupyBackend:
        """The backend without a GPU: arrays of `xp` (numpy, or a fake array module), launches to `kernels`
        (the CUDA-on-CPU harness of the tests, or a recorder), `device` (default `HostDevice()`); `knobs`
        as `configured`'s."""
        device = HostDevice() if device is None else device
        return cls(xp, kernels, device, Planner(xp, device)).configured(**knobs)

    def configured(self, **knobs) -> CupyBackend:
        """A backend sharing this one's arrays, kernels (compiled modules) and device, with `knobs`
        replacing fields of the planner (`Planner`: tile_override, split_override, conv_algo, ...) or of
        the block sizes (`Blocks`). Its planner starts with no plans or tap tables of its own. Raises
        TypeError naming a knob that is neither."""
        planner_fields = {f.name for f in dataclasses.fields(Planner) if f.init}
        block_fields = {f.name for f in dataclasses.fields(Blocks)}
        unknown = sorted(set(knobs) - planner_fields - block_fields)
        if unknown:
            raise TypeError(f"unknown backend knob(s) {unknown}; expected fields of Planner {sorted(planner_fields)} "
                            f"or of Blocks {sorted(block_fields)}")
        planner = dataclasses.replace(self.planner, **{k: v for k, v in knobs.items() if k in planner_fields})
        blocks = dataclasses.replace(self.blocks, **{k: v for k, v in knobs.items() if k in block_fields})
        return CupyBackend(self.xp, self.kernels, self.device, planner, blocks)

    def __repr__(self) -> str:
        return f"CupyBackend(xp={getattr(self.xp, '__name__', self.xp)!r}, device={self.device!r})"

    # ------------------------------------------------------------------------------------------
    # start-up and the conv algorithm (GPU workers: mpiasgd.launch.startup)

    def compile_kernels(self, autotune: bool = False) -> list[str]:
        """Compile every kernel module this backend launches (each .cu; conv2d.cu once per tile: the
        production tiles, and with `autotune` every tile autotune times on this device), on the current
        device, so that a source that does not compile stops start-up with NVRTC's log instead of a
        worker mid-run; later launches reuse the modules (and CuPy's on-disk cache). Returns the modules
        compiled, as "file [defines]". Raises RuntimeError naming the file and carrying the log."""
        done = []
        conv_tiles = (autotune_tiles(self.device.compute_capability(), self.planner.candidates) if autotune
                      else CONV_TILES)
        for filename in sorted(set(KERNEL_FILES.values())):
            for tile in (conv_tiles if filename == "conv2d.cu" else [None]):
                defines = tile_defines(tile)
                try:
                    self.kernels.compile(filename, defines)
                except Exception as e:  # cupy's CompileException carries NVRTC's log
                    raise RuntimeError(f"kernel {filename} {' '.join(defines)} does not compile: {e}") from e
                done.append(f"{filename} {' '.join(defines)}".strip())
        return done

    def set_conv_algo(self, algo: str) -> None:
        """How conv passes choose their tile: "heuristic" or "autotune" (`Planner.set_conv_algo`).
        Raises ValueError naming the valid algorithms."""
        self.planner.set_conv_algo(algo)

    @property
    def conv_algo(self) -> str:
        """The conv algorithm in use ("heuristic" or "autotune")."""
        return self.planner.conv_algo

    def conv_plans(self) -> list[ConvPlan]:
        """The plans autotune chose on this backend so far, in the order they were made (`ConvPlan.describe`)."""
        return self.planner.conv_plans()

    # ------------------------------------------------------------------------------------------
    # checks and launches

    def check_array(self, op: str, arg: str, a, shape: tuple[int, ...] | None = None, ndim: int | None = None,
                    dtype=np.float32):
        """`a` after `contract.check_array` with this backend's array type. Raises ValueError."""
        return check_device_array(op, arg, a, self.ndarray, shape, ndim, dtype)

    def launch(self, kernel: str, grid: Grid, block: Grid, args: tuple, shared_mem: int = 0,
               tile: tuple[int, ...] | None = None) -> None:
        """Launch `kernel` (of conv2d.cu's module for `tile`) after checking grid, block and shared memory
        (bytes) against the device's limits (ValueError) and that every scalar argument has its C type
        (TypeError)."""
        self.device.limits.check(kernel, grid, block, shared_mem)
        check_args(kernel, args)
        self.kernels.get(kernel, tile)(grid, block, args, shared_mem=shared_mem)

    def _out(self, op: str, out, shape: tuple[int, ...]):
        if out is None:
            return self.xp.empty(shape, dtype=np.float32)
        return self.check_array(op, "out", out, shape=shape)

    # ------------------------------------------------------------------------------------------
    # arrays

    def Workspace(self) -> DeviceWorkspace:
        """A fresh, empty `DeviceWorkspace` on this backend's arrays (the layers' `ops.Workspace()`)."""
        return DeviceWorkspace(self.xp)

    def zeros(self, shape: int | tuple[int, ...], dtype=np.float32):
        """Zero-filled C-contiguous device array (default float32)."""
        return self.xp.zeros(shape, dtype=dtype)

    def empty(self, shape: int | tuple[int, ...], dtype=np.float32):
        """Uninitialized C-contiguous device array (default float32)."""
        return self.xp.empty(shape, dtype=dtype)

    def asarray(self, x, dtype=np.float32):
        """`x` (host or device) as a C-contiguous device array of `dtype` (no copy when it already is one)."""
        return self.xp.ascontiguousarray(self.xp.asarray(x, dtype=dtype))

    def to_numpy(self, x) -> np.ndarray:
        """Host copy of a device array (synchronizes with the stream that produced it)."""
        return self.xp.asnumpy(x) if hasattr(self.xp, "asnumpy") else np.asarray(x)

    def may_share_memory(self, a, b) -> bool:
        """Cheap (bounds-only) test whether two device arrays may overlap in memory."""
        return bool(self.xp.may_share_memory(a, b))

    # ------------------------------------------------------------------------------------------
    # convolution: an implicit GEMM per pass (kernels/conv2d.cu), with the planner's tile and split-K

    def conv2d_fprop(self, x, w, b, stride: int, pad: int, ws: DeviceWorkspace | None = None):
        """Forward convolution, NCHW float32: x (N, C, H, W), w (K, C, R, S), b (K,) or None -> y (N, K, P, Q).

        See `Backend.conv2d_fprop`. Kernel `conv2d_fprop` (bias fused into the epilogue; relu=0), or,
        when the output gives too few blocks (`Planner.gemm_split`), split-K: `conv2d_fprop_partial` into
        a workspace (kept in `ws`), then `conv2d_split_reduce` adds the splits and the bias. The tile: the
        planner's conv_algo (the first call of a geometry under "autotune" runs the pass once per timing).
        Raises ValueError on a bad dtype/contiguity/shape or geometry.
        """
        op = "conv2d_fprop"
        self.check_array(op, "x", x, ndim=4)
        self.check_array(op, "w", w, ndim=4)
        N, C, H, W = x.shape
        K, _, R, S = w.shape
        if b is not None:
            self.check_array(op, "b", b, shape=(K,))
        P, Q = conv_geometry(op, x.shape, w.shape, stride, pad)
        y = self.xp.empty((N, K, P, Q), dtype=np.float32)
        if y.size == 0 or C * R * S == 0:  # an empty batch: nothing to launch; an empty filter: y = b
            y[...] = 0 if b is None else b.reshape(1, K, 1, 1)
            return y
        geometry = conv_ints(op, N, C, H, W, K, R, S, P, Q, stride, pad)
        tab = self.planner.conv_tap_table(op, N, C, H, W, K, R, S, P, Q, stride, pad)

        def run(tile: tuple[int, ...]) -> None:
            splits, chunk = self.planner.gemm_split(K, N * P * Q, C * R * S, tile)  # GEMM (K) x (N*P*Q), KR C*R*S
            grid, block = self.planner.conv_launch(M=K, NG=N * P * Q, splits=splits, tile=tile)
            if splits == 1:
                self.launch(op, grid, block, (x, w, b, y, *geometry, np.int32(0), tab), tile=tile)
            else:
                part = self._split_workspace(ws, "fprop.split", (splits, K, N * P * Q))
                self.launch("conv2d_fprop_partial", grid, block,
                            (x, w, part, *geometry, c_int64(op, "chunk", chunk), tab), tile=tile)
                self.split_reduce(op, part, b, y, splits, N, K, P * Q, tile)

        self.planner.run_conv(op, (N, C, H, W, K, R, S, stride, pad), K, run)
        return y

    def conv2d_dgrad(self, dy, w, x_shape: tuple[int, int, int, int], stride: int, pad: int,
                     ws: DeviceWorkspace | None = None):
        """Input gradient: dy (N, K, P, Q), w (K, C, R, S), x_shape (N, C, H, W) -> dx (N, C, H, W) fresh.

        See `Backend.conv2d_dgrad`. Kernel `conv2d_dgrad` (implicit GEMM (C) x (N*H*W), reduction K*R*S),
        or split-K as in `conv2d_fprop` (`conv2d_dgrad_partial`, `conv2d_split_reduce`).
        """
        op = "conv2d_dgrad"
        self.check_array(op, "dy", dy, ndim=4)
        self.check_array(op, "w", w, ndim=4)
        N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
        K, _, R, S = w.shape
        P, Q = conv_geometry(op, (N, C, H, W), w.shape, stride, pad)
        self.check_array(op, "dy", dy, shape=(N, K, P, Q))
        dx = self.xp.empty((N, C, H, W), dtype=np.float32)
        if dx.size == 0 or K * R * S == 0:  # an empty batch: nothing to launch; an empty filter: no gradient
            dx[...] = 0
            return dx
        geometry = conv_ints(op, N, C, H, W, K, R, S, P, Q, stride, pad)
        tab = self.planner.conv_tap_table(op, N, C, H, W, K, R, S, P, Q, stride, pad)

        def run(tile: tuple[int, ...]) -> None:
            splits, chunk = self.planner.gemm_split(C, N * H * W, K * R * S, tile)  # GEMM (C) x (N*H*W), KR K*R*S
            grid, block = self.planner.conv_launch(M=C, NG=N * H * W, splits=splits, tile=tile)
            if splits == 1:
                self.launch(op, grid, block, (dy, w, dx, *geometry, tab), tile=tile)
            else:
                part = self._split_workspace(ws, "dgrad.split", (splits, C, N * H * W))
                self.launch("conv2d_dgrad_partial", grid, block,
                            (dy, w, part, *geometry, c_int64(op, "chunk", chunk), tab), tile=tile)
                self.split_reduce(op, part, None, dx, splits, N, C, H * W, tile)

        self.planner.run_conv(op, (N, C, H, W, K, R, S, stride, pad), C, run)
        return dx

    def conv2d_wgrad(self, dy, x, w_shape: tuple[int, int, int, int], stride: int, pad: int, out=None,
                     ws: DeviceWorkspace | None = None):
        """Filter gradient: dy (N, K, P, Q), x (N, C, H, W) -> dw (K, C, R, S), into `out` when given.

        No atomics: `conv2d_wgrad_partial` sums `splits` ranges of the N*P*Q reduction (`Planner.gemm_split`)
        into a (splits, K, C*R*S) workspace, `conv2d_split_reduce` adds the ranges in order; with one
        range the partial kernel writes dw directly.
        """
        op = "conv2d_wgrad"
        self.check_array(op, "x", x, ndim=4)
        self.check_array(op, "dy", dy, ndim=4)
        K, C, R, S = shape4(op, "w_shape", w_shape, "(K, C, R, S)")
        N, _, H, W = x.shape
        P, Q = conv_geometry(op, x.shape, (K, C, R, S), stride, pad)
        self.check_array(op, "dy", dy, shape=(N, K, P, Q))
        dw = self._out(op, out, (K, C, R, S))
        if dw.size == 0 or N * P * Q == 0:  # an empty batch (as numpy_ops): a zero gradient, nothing to launch
            dw[...] = 0
            return dw
        geometry = conv_ints(op, N, C, H, W, K, R, S, P, Q, stride, pad)
        tab = self.planner.conv_tap_table(op, N, C, H, W, K, R, S, P, Q, stride, pad)

        def run(tile: tuple[int, ...]) -> None:
            splits, chunk = self.planner.gemm_split(K, C * R * S, N * P * Q, tile)  # GEMM (K) x (C*R*S), KR N*P*Q
            part = dw if splits == 1 else self._split_workspace(ws, "wgrad.split", (splits, K, C * R * S))
            grid, block = self.planner.conv_launch(M=K, NG=C * R * S, splits=splits, tile=tile)
            self.launch("conv2d_wgrad_partial", grid, block,
                        (dy, x, part, *geometry, c_int64(op, "chunk", chunk), tab), tile=tile)
            if splits > 1:
                self.split_reduce(op, part, None, dw, splits, 1, K, C * R * S, tile)

        self.planner.run_conv(op, (N, C, H, W, K, R, S, stride, pad), K, run)
        return dw

    def _split_workspace(self, ws: DeviceWorkspace | None, key: str, shape: tuple[int, int, int]):
        """The (splits, M, NG) split-K buffer: the layer's kept one, or a fresh one without a Workspace."""
        return self.xp.empty(shape, dtype=np.float32) if ws is None else ws.get(key, shape, np.float32)

    def split_reduce(self, op: str, part, bias, out, splits: int, N: int, M: int, L: int, tile: tuple[int, ...],
                     relu: int = 0) -> None:
        """out (N, M, L...) = the splits of `part` (splits, M, N*L) added in order (+ bias (M,)) (then ReLU
        when `relu`): kernel `conv2d_split_reduce`, launched from the module of the partial kernel's `tile`
        (conv2d.cu holds both: no third compilation)."""
        groups = _cdiv(N * M * L, SPLIT_REDUCE_OUTS)
        grid = (max(1, min(groups, self.blocks.elementwise_max_blocks)), 1, 1)
        block = (SPLIT_REDUCE_THREADS_MAX, 1, 1)  # 8 lanes per output
        self.launch("conv2d_split_reduce", grid, block,
                    (part, bias, out, c_int32(op, "splits", splits), c_int32(op, "N", N), c_int32(op, "M", M),
                     c_int64(op, "L", L), np.int32(relu)), tile=tile)

    def bias_grad(self, dy, out=None):
        """db (K,) = dy summed over all axes but 1; dy (N, K, P, Q) or (N, K). Kernel `bias_grad`, one block per k."""
        op = "bias_grad"
        if getattr(dy, "ndim", None) not in (2, 4):
            raise ValueError(f"{op}: dy must be (N, K, P, Q) or (N, K), got {getattr(dy, 'shape', type(dy).__name__)}")
        self.check_array(op, "dy", dy)
        N, K = dy.shape[:2]
        L = int(np.prod(dy.shape[2:], dtype=np.int64))
        db = self._out(op, out, (K,))
        grid, block = (max(K, 1), 1, 1), (self.blocks.reduce_threads, 1, 1)  # one block per output channel
        if K:
            self.launch(op, grid, block, (dy, db, c_int32(op, "N", N), c_int32(op, "K", K), c_int64(op, "L", L)))
        return db

    # ------------------------------------------------------------------------------------------
    # elementwise and pooling

    def relu_fprop(self, x):
        """y = max(x, 0), fresh, any shape; NaN stays NaN, as numpy_ops. Kernel `relu_fprop`."""
        self.check_array("relu_fprop", "x", x)
        y = self.xp.empty(x.shape, dtype=np.float32)
        grid, block = self.blocks.elementwise(x.size)
        self.launch("relu_fprop", grid, block, (x, y, c_int64("relu_fprop", "n", x.size)))
        return y

    def relu_bprop(self, dy, y):
        """dx = dy * (y > 0), as numpy_ops (NaN, not 0, where y <= 0 and dy is NaN or +-inf); y the forward
        output. Kernel `relu_bprop`."""
        self.check_array("relu_bprop", "dy", dy)
        self.check_array("relu_bprop", "y", y, shape=dy.shape)
        dx = self.xp.empty(dy.shape, dtype=np.float32)
        grid, block = self.blocks.elementwise(dy.size)
        self.launch("relu_bprop", grid, block, (dy, y, dx, c_int64("relu_bprop", "n", dy.size)))
        return dx

    def _pool_launch_geometry(self, op: str, x_shape, kernel: int, stride: int, pad: int, ceil_mode: bool):
        """(P, Q) of pooling x_shape on the device (`contract.pool_geometry`: kernel, stride, pad, ceil_mode,
        PyTorch's output size, H*W in an int) and pool.cu's other int extents: a window's padded rows
        and columns (h0 + kernel < H + 2*pad + kernel) and the output plane P*Q."""
        P, Q = pool_geometry(op, x_shape, kernel, stride, pad, ceil_mode)
        H, W = x_shape[2:]
        for what, v in (("H + 2*pad + kernel", H + 2 * pad + kernel), ("W + 2*pad + kernel", W + 2 * pad + kernel),
                        ("P*Q", P * Q)):
            c_int32(op, what, v)
        return P, Q

    def _pool_args(self, op: str, N: int, C: int, H: int, W: int, P: int, Q: int, kernel: int, stride: int,
                   pad: int) -> tuple:
        """pool.cu's geometry arguments: N*C (long long), H, W, P, Q, kernel, stride, pad (int)."""
        i32 = functools.partial(c_int32, op)
        return (c_int64(op, "N*C", N * C), i32("H", H), i32("W", W), i32("P", P), i32("Q", Q), i32("kernel", kernel),
                i32("stride", stride), i32("pad", pad))

    def maxpool_fprop(self, x, kernel: int, stride: int, pad: int = 0, ceil_mode: bool = False):
        """Max pooling: x (N, C, H, W) -> (y (N, C, P, Q), argmax (N, C, P, Q) uint8/int32), padding never
        wins, PyTorch's output size (floor or ceil_mode). See `Backend.maxpool_fprop`. Kernels
        `maxpool_fprop_u8` / `_i32`, one thread per output."""
        op = "maxpool_fprop"
        self.check_array(op, "x", x, ndim=4)
        N, C, H, W = x.shape
        P, Q = self._pool_launch_geometry(op, x.shape, kernel, stride, pad, ceil_mode)
        adt = argmax_dtype(kernel)
        y = self.xp.empty((N, C, P, Q), dtype=np.float32)
        argmax = self.xp.empty((N, C, P, Q), dtype=adt)
        grid, block = self.blocks.elementwise(y.size)  # one thread per output
        kname = "maxpool_fprop_u8" if adt == np.uint8 else "maxpool_fprop_i32"
        self.launch(kname, grid, block, (x, y, argmax, *self._pool_args(op, N, C, H, W, P, Q, kernel, stride, pad)))
        return y, argmax

    def maxpool_bprop(self, dy, argmax, x_shape: tuple[int, int, int, int], kernel: int, stride: int, pad: int = 0,
                      ceil_mode: bool = False):
        """Gradient of `maxpool_fprop`: dx (N, C, H, W), fresh; overlapping windows sum (gather, no atomics).
        An argmax value naming no image pixel of its window (not one `maxpool_fprop` makes) adds nothing."""
        op = "maxpool_bprop"
        N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
        P, Q = self._pool_launch_geometry(op, (N, C, H, W), kernel, stride, pad, ceil_mode)
        adt = argmax_dtype(kernel)
        self.check_array(op, "dy", dy, shape=(N, C, P, Q))
        self.check_array(op, "argmax", argmax, shape=(N, C, P, Q), dtype=adt)
        dx = self.xp.empty((N, C, H, W), dtype=np.float32)
        grid, block = self.blocks.elementwise(dx.size)  # one thread per input element
        kname = "maxpool_bprop_u8" if adt == np.uint8 else "maxpool_bprop_i32"
        self.launch(kname, grid, block, (dy, argmax, dx, *self._pool_args(op, N, C, H, W, P, Q, kernel, stride, pad)))
        return dx

    def avgpool_fprop(self, x, kernel: int, stride: int, pad: int = 0, ceil_mode: bool = False,
                      count_include_pad: bool = True):
        """Average pooling (torch.nn.AvgPool2d): x (N, C, H, W) -> y (N, C, P, Q), fresh. See
        `Backend.avgpool_fprop`. Kernel `avgpool_fprop`, one thread per output."""
        op = "avgpool_fprop"
        self.check_array(op, "x", x, ndim=4)
        N, C, H, W = x.shape
        P, Q = self._pool_launch_geometry(op, x.shape, kernel, stride, pad, ceil_mode)
        check_bool(op, "count_include_pad", count_include_pad)
        y = self.xp.empty((N, C, P, Q), dtype=np.float32)
        grid, block = self.blocks.elementwise(y.size)  # one thread per output
        self.launch(op, grid, block, (x, y, *self._pool_args(op, N, C, H, W, P, Q, kernel, stride, pad),
                                      np.int32(count_include_pad)))
        return y

    def avgpool_bprop(self, dy, x_shape: tuple[int, int, int, int], kernel: int, stride: int, pad: int = 0,
                      ceil_mode: bool = False, count_include_pad: bool = True):
        """Gradient of `avgpool_fprop`: dy (N, C, P, Q) -> dx (N, C, H, W), fresh. Kernel `avgpool_bprop`, one
        thread per input element gathering dy / divisor of its windows (no atomics)."""
        op = "avgpool_bprop"
        N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
        P, Q = self._pool_launch_geometry(op, (N, C, H, W), kernel, stride, pad, ceil_mode)
        check_bool(op, "count_include_pad", count_include_pad)
        self.check_array(op, "dy", dy, shape=(N, C, P, Q))
        dx = self.xp.empty((N, C, H, W), dtype=np.float32)
        grid, block = self.blocks.elementwise(dx.size)  # one thread per input element
        self.launch(op, grid, block, (dy, dx, *self._pool_args(op, N, C, H, W, P, Q, kernel, stride, pad),
                                      np.int32(count_include_pad)))
        return dx

    def global_avgpool_fprop(self, x):
        """Global average pooling: x (N, C, H, W) -> y (N, C), the mean over H and W, fresh. Kernel
        `global_avgpool_fprop`, one thread per (n, c) summing its H*W pixels in order."""
        op = "global_avgpool_fprop"
        self.check_array(op, "x", x, ndim=4)
        N, C, H, W = x.shape
        if H * W == 0:
            raise ValueError(f"{op}: x must have H*W > 0, got shape {tuple(x.shape)}")
        y = self.xp.empty((N, C), dtype=np.float32)
        grid, block = self.blocks.elementwise(N * C)  # one thread per (n, c)
        self.launch(op, grid, block, (x, y, c_int64(op, "N*C", N * C), c_int32(op, "H*W", H * W)))
        return y

    def global_avgpool_bprop(self, dy, x_shape: tuple[int, int, int, int]):
        """Gradient of `global_avgpool_fprop`: dy (N, C) -> dx (N, C, H, W) = dy / (H*W), fresh. Kernel
        `global_avgpool_bprop`, one thread per element."""
        op = "global_avgpool_bprop"
        self.check_array(op, "dy", dy, ndim=2)
        N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
        if H * W == 0:
            raise ValueError(f"{op}: x_shape must have H*W > 0, got {(N, C, H, W)}")
        self.check_array(op, "dy", dy, shape=(N, C))
        dx = self.xp.empty((N, C, H, W), dtype=np.float32)
        grid, block = self.blocks.elementwise(dx.size)
        self.launch(op, grid, block, (dy, dx, c_int64(op, "N*C", N * C), c_int32(op, "H*W", H * W)))
        return dx

    # ------------------------------------------------------------------------------------------
    # batch normalisation (kernels/batchnorm.cu): per-channel reductions, one block per channel, no atomics

    def _channel_vectors(self, op: str, C: int, **vectors) -> None:
        """Check every named argument is a (C,) float32 device array (x's channels)."""
        for arg, a in vectors.items():
            self.check_array(op, arg, a, shape=(C,))

    def _refuse_overlap(self, op: str, written: dict, others: dict) -> None:
        """ValueError naming the first array of `written` (arg -> array, written by the kernel) that may
        overlap another written one or one of `others` (arg -> array, read) in memory."""
        names = list(written)
        for i, arg in enumerate(names):
            for other, b in [*((o, written[o]) for o in names[i + 1:]), *others.items()]:
                if b is not None and self.may_share_memory(written[arg], b):
                    raise ValueError(f"{op}: {arg} overlaps {other} in memory ({arg} is written by the kernel: "
                                     "pass separate buffers)")

    def _bn_block(self, op: str, C: int) -> tuple[Grid, Grid]:
        """The reductions' launch: one block per channel, `Blocks.batchnorm_threads` threads (a power of two
        up to BATCHNORM_THREADS_MAX, the kernels' static shared array: ValueError otherwise)."""
        threads = self.blocks.batchnorm_threads
        if threads < 1 or threads & (threads - 1) or threads > BATCHNORM_THREADS_MAX:
            raise ValueError(f"{op}: batchnorm_threads must be a power of two up to {BATCHNORM_THREADS_MAX} (the "
                             f"kernel's shared array), got {threads}")
        return (C, 1, 1), (threads, 1, 1)

    def batchnorm_stats(self, x, running_mean=None, running_var=None, momentum: float = 0.1):
        """Per-channel batch statistics: x (N, C, H, W) -> (mean (C,), biased var (C,)), fresh; with
        running_mean and running_var ((C,) float32) also their in-place update (torch.nn.BatchNorm2d's).
        See `Backend.batchnorm_stats`. Kernel `batchnorm_stats`: one block per channel, two passes (a first
        mean, then the deviations from it and their squares: the corrected two-pass algorithm, Chan, Golub
        and LeVeque 1983, eq. 1.7), each a fixed-order float32 tree (no atomics: bit-reproducible).
        Raises ValueError also when a running array overlaps the other or x."""
        op = "batchnorm_stats"
        self.check_array(op, "x", x, ndim=4)
        N, C, H, W = x.shape
        M = N * H * W
        if M == 0:
            raise ValueError(f"{op}: x must have N*H*W > 0 values per channel, got shape {tuple(x.shape)}")
        if (running_mean is None) != (running_var is None):
            raise ValueError(f"{op}: running_mean and running_var must be given together, got "
                             f"{type(running_mean).__name__} and {type(running_var).__name__}")
        if running_mean is not None:
            self._channel_vectors(op, C, running_mean=running_mean, running_var=running_var)
            self._refuse_overlap(op, {"running_mean": running_mean, "running_var": running_var}, {"x": x})
        m = check_real(op, "momentum", momentum, 0.0, 1.0)
        mean = self.xp.empty((C,), dtype=np.float32)
        var = self.xp.empty((C,), dtype=np.float32)
        if C:
            grid, block = self._bn_block(op, C)
            self.launch(op, grid, block, (x, mean, var, running_mean, running_var, c_int32(op, "N", N),
                                          c_int32(op, "C", C), c_int32(op, "H*W", H * W),
                                          c_float32(op, "momentum", m),
                                          c_float32(op, "M/(M - 1)", M / (M - 1) if M > 1 else 1.0)))
        return mean, var

    def _bn_eps(self, op: str, eps: float) -> np.float32:
        """eps as a float32 > 0 (`contract.check_real`, then the cast: an eps that rounds to 0 is refused)."""
        eps32 = c_float32(op, "eps", check_real(op, "eps", eps, 0.0, low_open=True))
        if eps32 <= 0:
            raise ValueError(f"{op}: eps = {eps!r} rounds to 0 in float32")
        return eps32

    def batchnorm_fprop(self, x, gamma, beta, mean, var, eps: float):
        """y = (x - mean) / sqrt(var + eps) * gamma + beta per channel, fresh (N, C, H, W). See
        `Backend.batchnorm_fprop`. Kernel `batchnorm_fprop`, elementwise."""
        op = "batchnorm_fprop"
        self.check_array(op, "x", x, ndim=4)
        _, C, H, W = x.shape
        self._channel_vectors(op, C, gamma=gamma, beta=beta, mean=mean, var=var)
        eps32 = self._bn_eps(op, eps)
        y = self.xp.empty(x.shape, dtype=np.float32)
        grid, block = self.blocks.elementwise(x.size)
        self.launch(op, grid, block, (x, gamma, beta, mean, var, y, c_int64(op, "n", x.size), c_int32(op, "C", C),
                                      c_int32(op, "H*W", H * W), eps32))
        return y

    def batchnorm_bprop(self, dy, x, gamma, mean, var, eps: float, dgamma, dbeta, need_dx: bool = True):
        """Gradient of `batchnorm_fprop` with the batch statistics: writes dgamma, dbeta ((C,) float32) and
        returns dx (N, C, H, W), fresh (None when not `need_dx`). See `Backend.batchnorm_bprop`. Kernel
        `batchnorm_bprop`: one block per channel reduces sum dy and sum dy*(x - mean) (fixed-order trees, no
        atomics), then writes its channel's dx. Raises ValueError also when dgamma or dbeta overlaps the
        other or an input."""
        op = "batchnorm_bprop"
        self.check_array(op, "x", x, ndim=4)
        self.check_array(op, "dy", dy, shape=x.shape)
        N, C, H, W = x.shape
        if N * H * W == 0:
            raise ValueError(f"{op}: x must have N*H*W > 0 values per channel, got shape {tuple(x.shape)}")
        self._channel_vectors(op, C, gamma=gamma, mean=mean, var=var)
        eps32 = self._bn_eps(op, eps)
        self._channel_vectors(op, C, dgamma=dgamma, dbeta=dbeta)
        self._refuse_overlap(op, {"dgamma": dgamma, "dbeta": dbeta},
                             {"dy": dy, "x": x, "gamma": gamma, "mean": mean, "var": var})
        check_bool(op, "need_dx", need_dx)
        dx = self.xp.empty(x.shape, dtype=np.float32) if need_dx else None
        if C:
            grid, block = self._bn_block(op, C)
            self.launch(op, grid, block, (dy, x, gamma, mean, var, dgamma, dbeta, dx, c_int32(op, "N", N),
                                          c_int32(op, "C", C), c_int32(op, "H*W", H * W), eps32))
        return dx

    # ------------------------------------------------------------------------------------------
    # residual blocks (kernels/residual.cu), dropout (dropout.cu), local response normalisation (lrn.cu)

    def add(self, a, b, out=None):
        """a + b elementwise (same shape), into `out` when given (it may be `a` or `b` itself, not a part of
        one) and returned; fresh otherwise. Kernel `add`."""
        op = "add"
        self.check_array(op, "a", a)
        self.check_array(op, "b", b, shape=a.shape)
        if out is None:
            out = self.xp.empty(a.shape, dtype=np.float32)
        else:
            self.check_array(op, "out", out, shape=a.shape)
            for arg, v in (("a", a), ("b", b)):  # out = a with b a shifted view of a would read written values
                if v is not out and self.may_share_memory(out, v):
                    raise ValueError(f"{op}: out overlaps {arg} in memory without being it (out may be a or b "
                                     "itself, or a separate buffer)")
        grid, block = self.blocks.elementwise(a.size)
        self.launch(op, grid, block, (a, b, out, c_int64(op, "n", a.size)))
        return out

    def _subsample_geometry(self, op: str, x_shape, stride: int, pad_before: int, pad_after: int) -> tuple:
        """(y shape (N, K, P, Q), the kernels' int arguments) of the option-A shortcut: stride an int >= 1,
        the pads ints >= 0 (`contract.check_int`), and every extent the kernels hold in an int."""
        for arg, v, low in (("stride", stride, 1), ("pad_before", pad_before, 0), ("pad_after", pad_after, 0)):
            check_int(op, arg, v, low)
        N, C, H, W = x_shape
        K, P, Q = pad_before + C + pad_after, -(-H // stride), -(-W // stride)
        i32 = functools.partial(c_int32, op)
        for what, v in (("H*W", H * W), ("K*P*Q", K * P * Q), ("C*H*W", C * H * W)):
            i32(what, v)
        return (N, K, P, Q), (i32("N", N), i32("C", C), i32("H", H), i32("W", W), i32("K", K), i32("P", P),
                              i32("Q", Q), i32("stride", stride), i32("pad_before", pad_before))

    def subsample_pad_fprop(self, x, stride: int, pad_before: int, pad_after: int):
        """The option-A shortcut: x (N, C, H, W) -> y (N, pad_before + C + pad_after, ceil(H/stride),
        ceil(W/stride)), fresh: x[:, :, ::stride, ::stride] between zero channels. Kernel
        `subsample_pad_fprop`, one thread per output."""
        op = "subsample_pad_fprop"
        self.check_array(op, "x", x, ndim=4)
        y_shape, args = self._subsample_geometry(op, x.shape, stride, pad_before, pad_after)
        y = self.xp.empty(y_shape, dtype=np.float32)
        grid, block = self.blocks.elementwise(y.size)
        self.launch(op, grid, block, (x, y, *args))
        return y

    def subsample_pad_bprop(self, dy, x_shape: tuple[int, int, int, int], stride: int, pad_before: int,
                            pad_after: int):
        """Gradient of `subsample_pad_fprop`: dx (N, C, H, W), fresh: dy's channels pad_before.. at the
        sampled pixels, 0 elsewhere. Kernel `subsample_pad_bprop`, one thread per dx element."""
        op = "subsample_pad_bprop"
        self.check_array(op, "dy", dy, ndim=4)
        N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
        expected, args = self._subsample_geometry(op, (N, C, H, W), stride, pad_before, pad_after)
        if tuple(dy.shape) != expected:
            raise ValueError(f"{op}: dy must have shape {expected} for x_shape {(N, C, H, W)}, got {tuple(dy.shape)}")
        dx = self.xp.empty((N, C, H, W), dtype=np.float32)
        grid, block = self.blocks.elementwise(dx.size)
        self.launch(op, grid, block, (dy, dx, *args))
        return dx

    def _dropout(self, op: str, arg: str, a, p: float, seed: int, minibatch: int, layer: int):
        """a * keep / (1 - p), fresh: kernel `dropout` with the key of `contract.dropout_key` (the threshold
        and Philox words the numpy backend uses), 4 elements (one Philox call) per thread."""
        self.check_array(op, arg, a)
        threshold, (layer, mb_lo, mb_hi), (seed_lo, seed_hi) = dropout_key(op, p, seed, minibatch, layer, a.size)
        scale = np.float32(1.0 / (1.0 - float(p)))  # rounded to float32 once, as numpy_ops
        out = self.xp.empty(a.shape, dtype=np.float32)
        grid, block = self.blocks.elementwise(_cdiv(a.size, 4))  # one thread per Philox counter
        self.launch("dropout", grid, block, (a, out, c_int64(op, "n", a.size), np.uint32(threshold), scale,
                                             *(np.uint32(w) for w in (layer, mb_lo, mb_hi, seed_lo, seed_hi))))
        return out

    def dropout_fprop(self, x, p: float, seed: int, minibatch: int, layer: int):
        """Inverted dropout: y = x * keep / (1 - p), fresh, any shape; the mask (Philox4x32-10 of (seed,
        minibatch, layer)) is recomputed, never stored, bit for bit the numpy backend's. See
        `Backend.dropout_fprop`. Kernel `dropout`."""
        return self._dropout("dropout_fprop", "x", x, p, seed, minibatch, layer)

    def dropout_bprop(self, dy, p: float, seed: int, minibatch: int, layer: int):
        """Gradient of `dropout_fprop` with the same key: dx = dy * keep / (1 - p), fresh (kernel `dropout`
        again: the same mask)."""
        return self._dropout("dropout_bprop", "dy", dy, p, seed, minibatch, layer)

    def lrn_fprop(self, x, size: int, alpha: float, beta: float, k: float):
        """Cross-map local response normalisation: x (N, C, H, W) -> (y, scale), both fresh. See
        `Backend.lrn_fprop`. Kernel `lrn_fprop`, one thread per output summing its channel window."""
        op = "lrn_fprop"
        self.check_array(op, "x", x, ndim=4)
        alpha, beta, k = check_lrn(op, size, alpha, beta, k)
        _, C, H, W = x.shape
        y = self.xp.empty(x.shape, dtype=np.float32)
        scale = self.xp.empty(x.shape, dtype=np.float32)
        grid, block = self.blocks.elementwise(x.size)
        self.launch(op, grid, block, (x, y, scale, c_int64(op, "n", x.size), c_int32(op, "C", C),
                                      c_int32(op, "H*W", H * W), c_int32(op, "size", size),
                                      c_float32(op, "alpha/size", alpha / size), c_float32(op, "k", k),
                                      c_float32(op, "beta", -beta)))
        return y, scale

    def lrn_bprop(self, dy, x, y, scale, size: int, alpha: float, beta: float):
        """Gradient of `lrn_fprop`: dx (N, C, H, W), fresh. See `Backend.lrn_bprop`. Kernel `lrn_bprop`, one
        thread per element summing dy*y/scale over the channels whose window holds it."""
        op = "lrn_bprop"
        self.check_array(op, "x", x, ndim=4)
        for arg, a in (("dy", dy), ("y", y), ("scale", scale)):
            self.check_array(op, arg, a, shape=x.shape)
        alpha, beta = check_lrn(op, size, alpha, beta)
        _, C, H, W = x.shape
        dx = self.xp.empty(x.shape, dtype=np.float32)
        grid, block = self.blocks.elementwise(x.size)
        self.launch(op, grid, block, (dy, x, y, scale, dx, c_int64(op, "n", x.size), c_int32(op, "C", C),
                                      c_int32(op, "H*W", H * W), c_int32(op, "size", size),
                                      c_float32(op, "2*alpha*beta/size", -2.0 * alpha * beta / size),
                                      c_float32(op, "beta", -beta)))
        return dx

    # ------------------------------------------------------------------------------------------
    # fully connected (cuBLAS through matmul)

    def linear_fprop(self, x, w, b):
        """y (N, O) = x (N, I) @ w.T + b; w (O, I), b (O,)."""
        op = "linear_fprop"
        self.check_array(op, "x", x, ndim=2)
        self.check_array(op, "w", w, shape=(w.shape[0], x.shape[1]) if getattr(w, "ndim", 0) == 2 else None, ndim=2)
        self.check_array(op, "b", b, shape=(w.shape[0],))
        y = self.xp.matmul(x, w.T)  # (N, O)
        self.xp.add(y, b, out=y)  # (a function call, not `+=`: what a recorded launch sequence can replay)
        return y

    def linear_dgrad(self, dy, w):
        """dx (N, I) = dy (N, O) @ w (O, I)."""
        op = "linear_dgrad"
        self.check_array(op, "dy", dy, ndim=2)
        self.check_array(op, "w", w, ndim=2)
        check_linear_dgrad(op, dy.shape, w.shape)
        return self.xp.matmul(dy, w)

    def linear_wgrad(self, dy, x, out=None):
        """dw (O, I) = dy.T (O, N) @ x (N, I), written into `out` when given (overwritten) and returned."""
        op = "linear_wgrad"
        self.check_array(op, "x", x, ndim=2)
        self.check_array(op, "dy", dy, ndim=2)
        check_linear_wgrad(op, dy.shape, x.shape)
        dw = self._out(op, out, (dy.shape[1], x.shape[1]))
        self.xp.matmul(dy.T, x, out=dw)
        return dw

    # ------------------------------------------------------------------------------------------
    # loss and optimizer

    def softmax_xent(self, logits, labels) -> tuple[float, Any, int]:
        """Softmax cross-entropy, mean over the minibatch: (loss, dlogits (N, K), correct). See
        `Backend.softmax_xent`: `softmax_xent_deferred` with its sums taken at once (a device sync).
        Raises ValueError on a label outside [0, K), naming it and its index.
        """
        stats, dlogits = self.softmax_xent_deferred(logits, labels)
        loss, correct = stats.get()
        return loss, dlogits, correct

    def softmax_xent_deferred(self, logits, labels) -> tuple[LossStats, Any]:
        """(stats, dlogits (N, K)): one kernel computes dlogits, per-row losses and hits; `stats.get()` copies
        the rows to the host (waiting for the kernel), checks the labels and sums them (float64 mean, as
        numpy_ops). labels: integer array (N,) on the device (or host), cast to int32. See
        `Backend.softmax_xent_deferred`."""
        op = "softmax_xent"
        xp = self.xp
        self.check_array(op, "logits", logits, ndim=2)
        N, K = logits.shape
        check_labels(op, labels, N)
        labels = xp.asarray(labels)
        # out-of-range labels become -1 before the int32 cast (so that none wraps into range); the
        # kernel flags them and the check below runs on the host copy it needs anyway (no extra sync)
        # (ufuncs, not operators: each is a call a recorded launch sequence can replay)
        outside = xp.logical_or(xp.less(labels, 0), xp.greater_equal(labels, K))
        labels32 = xp.ascontiguousarray(xp.where(outside, -1, labels), dtype=np.int32)
        dlogits = xp.empty((N, K), dtype=np.float32)
        row_loss = xp.empty((N,), dtype=np.float32)
        row_correct = xp.empty((N,), dtype=np.int32)
        if N == 0:
            return LossStats.ready(0.0, 0), dlogits
        grid, block = (N, 1, 1), (self.blocks.reduce_threads, 1, 1)  # one block per row
        self.launch(op, grid, block, (logits, labels32, dlogits, row_loss, row_correct, c_int32(op, "N", N),
                                      c_int32(op, "K", K), c_float32(op, "scale", 1.0 / N)))
        return self._loss_stats(op, row_loss, row_correct, labels, K), dlogits

    def _loss_stats(self, op: str, row_loss, row_correct, labels, K: int) -> LossStats:
        """The LossStats of `softmax_xent_deferred`'s per-row losses (float32 (N,)) and hits (int32 (N,), -1
        for a label outside [0, K)), `labels` the minibatch's (to name a bad one)."""

        def fetch() -> tuple[float, int]:
            correct = self.to_numpy(row_correct)  # (N,) device sync point
            if correct.min() < 0:
                bad = int(np.flatnonzero(correct < 0)[0])
                raise label_outside(op, int(self.to_numpy(labels[bad:bad + 1])[0]), bad, K)
            return float(self.to_numpy(row_loss).astype(np.float64).mean()), int(correct.sum())

        def copy() -> LossStats:
            return self._loss_stats(op, row_loss.copy(), row_correct.copy(), labels.copy(), K)

        return LossStats(fetch, copy=copy)

    def sgd_momentum(self, params, velocity, grad, decay, momentum: float, lr: float, nesterov: bool = False,
                     lr_scale=None) -> None:
        """In place, d = grad + decay*params, s = lr_scale (1 when None): velocity <- momentum*velocity + d;
        params <- params - (lr*s)*velocity (heavy ball) or params - (lr*s)*(d + momentum*velocity) (nesterov).

        All (P,) float32 C-contiguous; decay = weight_decay * mask (0 on biases), as `mpiasgd.optim.SGD`.
        One kernel (`sgd_momentum`), for workers taking local steps on the device. Raises ValueError
        also for an argument that overlaps params or velocity in memory (both are updated in place), or a
        non-bool nesterov.
        """
        op = "sgd_momentum"
        self.check_array(op, "params", params, ndim=1)
        inputs = [("velocity", velocity), ("grad", grad), ("decay", decay)]
        if lr_scale is not None:
            inputs.append(("lr_scale", lr_scale))
        for arg, a in inputs:
            self.check_array(op, arg, a, shape=params.shape)
            if self.may_share_memory(params, a) or (arg != "velocity" and self.may_share_memory(velocity, a)):
                raise ValueError(f"{op}: {arg} overlaps {'params' if self.may_share_memory(params, a) else 'velocity'} "
                                 "in memory (both are updated in place: pass separate buffers)")
        check_bool(op, "nesterov", nesterov)
        grid, block = self.blocks.elementwise(params.size)
        self.launch(op, grid, block, (params, velocity, grad, decay, lr_scale, c_float32(op, "momentum", momentum),
                                      c_float32(op, "lr", lr), np.int32(nesterov), c_int64(op, "n", params.size)))


def make_backend() -> CupyBackend:
    """The backend on the current GPU (`mpiasgd.ops.get_backend("cupy")` keeps one, after its checks)."""
    return CupyBackend.on_gpu()

