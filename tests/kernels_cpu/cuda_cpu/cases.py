"""Kernel test cases run through the CUDA-on-CPU harness, shared by pytest and the TSAN subprocess.

Each case runs one op family two ways and compares with the NumPy backend (`numpy_ops`, evaluated in
float64 so that the reference is exact to well below float32 rounding):

  * through the CUDA backend itself (`mpiasgd.ops.cuda.backend.CupyBackend`), built with numpy as its
    array module and the harness as its kernels (`cpu_backend`): the wrappers' checks, casts and launch
    arithmetic run exactly as on a GPU;
  * straight to the raw kernel where the wrapper does not reach a path (fused ReLU epilogue, chosen
    wgrad splits, small and capped grids, small blocks).

Tolerance, stated once: |got - ref| <= ATOL + RTOL * |ref| elementwise (float32 kernels vs float64
reference; sums of up to ~600 O(1) terms); where the reference is NaN or +-inf the kernel must give
the same (NaN propagates as in NumPy: the *_nonfinite cases). A failure names the worst element.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mpiasgd.ops import numpy_ops
from mpiasgd.ops.contract import argmax_dtype, pool_output_size
from mpiasgd.ops.cuda.backend import CupyBackend
from mpiasgd.ops.cuda.constants import BATCHNORM_THREADS_MAX, CONV_BK, CONV_BM, CONV_BN, CONV_STAGES
from mpiasgd.ops.cuda.device import HostDevice
from mpiasgd.ops.cuda.tiles import tile_macros

ATOL, RTOL = 1e-4, 1e-4

# (N, C, H, W, K, R, S, stride, pad), each picked for a path:
CONV_SHAPES = [
    (2, 3, 7, 9, 5, 3, 3, 1, 1),    # odd H/W, pad 1; N*P*Q = 126: a partial column tile
    (3, 4, 8, 8, 70, 3, 3, 2, 1),   # K = 70: two row tiles (fprop/wgrad), stride 2
    (2, 5, 11, 10, 6, 5, 5, 2, 2),  # 5x5, stride 2, pad 2
    (2, 70, 5, 6, 3, 3, 3, 1, 1),   # C = 70: two dgrad row tiles; C*R*S = 630: many K-slabs
    (2, 2, 10, 10, 3, 2, 2, 3, 0),  # stride 3 > kernel: dx rows and columns no window reaches
    (1, 2, 6, 5, 3, 1, 1, 1, 0),    # 1x1
    (2, 3, 9, 8, 4, 3, 2, 1, 2),    # R != S, pad >= S
    (2, 2, 9, 10, 3, 4, 8, 1, 2),   # R*S = 32: tap bit 31 of the tap table path
    (2, 3, 8, 7, 4, 6, 6, 1, 2),    # R*S = 36 > 32: fprop and unit-stride dgrad test bounds per load
    (1, 2, 11, 9, 3, 7, 5, 2, 3),   # R*S = 35, stride 2
]

POOL_SHAPES = [  # (N, C, H, W, kernel, stride)
    (2, 3, 8, 8, 2, 2), (2, 3, 9, 11, 3, 2), (1, 2, 7, 6, 3, 1), (2, 1, 17, 18, 17, 1)]  # 17*17 > 256: int32


def assert_close(got, ref, what: str, atol: float = ATOL, rtol: float = RTOL) -> None:
    """Elementwise |got - ref| <= atol + rtol*|ref| where ref is finite, and got == ref where it is not
    (NaN where NaN, the same infinity); on failure report the worst element."""
    got, ref = np.atleast_1d(np.asarray(got, dtype=np.float64)), np.atleast_1d(np.asarray(ref, dtype=np.float64))
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != expected {ref.shape}"
    if got.size == 0:
        return
    with np.errstate(invalid="ignore"):  # inf - inf where both are infinite: judged below
        excess = np.abs(got - ref) - (atol + rtol * np.abs(ref))
    nonfinite = ~np.isfinite(ref)
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    excess[nonfinite] = np.where(same[nonfinite], -np.inf, np.inf)
    excess[np.isnan(excess)] = np.inf
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    why = ("a non-finite value must match exactly" if nonfinite[worst] else
           f"|diff| {abs(got[worst] - ref[worst]):.3g} > atol + rtol*|ref| = {atol + rtol * abs(ref[worst]):.3g}")
    assert excess[worst] <= 0, (
        f"{what}: worst element {tuple(int(i) for i in worst)}: got {got[worst]:.8g}, expected {ref[worst]:.8g} "
        f"({why})")


class HarnessKernels:
    """The CUDA backend's kernel source on the harness: a launch for a conv tile runs `lib.variant` built
    with that tile's -D options (tiles.tile_macros), as the GPU backend compiles one module per tile.
    `record(kernel, tile)`, when given, is called at every launch (tests that count launches)."""

    def __init__(self, lib, record: Callable[[str, tuple | None], object] | None = None) -> None:
        self.lib, self.record = lib, record

    def get(self, name: str, tile: tuple[int, ...] | None = None):
        if self.record is not None:
            self.record(name, tile)
        if tile is None:
            return self.lib.kernel(name)
        return self.lib.variant(tile_macros(tile)).kernel(name)

    def compile(self, filename: str, defines: tuple[str, ...] = ()) -> None:
        """Nothing to do: the harness library is built already (g++, `harness.build`)."""


def cpu_backend(lib, device: HostDevice | None = None, record: Callable | None = None, **knobs) -> CupyBackend:
    """The CUDA backend with numpy arrays and the harness kernels (`HarnessKernels`), on `device`
    (default `HostDevice()`), with planner and block-size `knobs` (`CupyBackend.configured`).

    A library built with tile macros (`lib.defines`, e.g. CONV_BM=16, CONV_BK=8, or a whole trial tile
    with CONV_TM/CONV_TN) forces that tile on every conv launch (`tile_override`).
    """
    d = lib.defines
    if {"CONV_TM", "CONV_TN", "CONV_STAGES"} & set(d):  # a register block other than 4x4 or other stages
        tile = (d.get("CONV_BM", CONV_BM), d.get("CONV_BN", CONV_BN), d.get("CONV_TM", 4),
                d.get("CONV_TN", 4), d.get("CONV_BK", CONV_BK), d.get("CONV_STAGES", CONV_STAGES))
        knobs = {"tile_override": tile, **knobs}
    elif "CONV_BM" in d or "CONV_BN" in d:
        tile = (d.get("CONV_BM", CONV_BM), d.get("CONV_BN", CONV_BN))
        knobs = {"tile_override": tile, **knobs}
    return CupyBackend.on_host(np, HarnessKernels(lib, record), device, **knobs)


def f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def f64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64)


def _i32(*v: int) -> tuple:
    return tuple(np.int32(x) for x in v)


# ----------------------------------------------------------------------------------------------
# cases: fn(lib, rng, small) -> None, asserting. `small`: blocks of <= 64 threads only where the
# kernel allows (a quick run); otherwise production block sizes as well. conv always uses its tiles.


# split-K settings of conv_wrappers: none (fprop/dgrad write in place, wgrad writes dw directly),
# and small targets that split every pass's reduction, with a ragged last range
CONV_SPLITS = {"one split": {"split_override": 1},
               "split-K": {"target_blocks": 4, "min_chunk": 8}}


def conv_wrappers(lib, rng, small: bool) -> None:
    """fprop (with and without bias), dgrad, wgrad through the CUDA backend vs numpy_ops, every conv shape,
    without and with split-K (`CONV_SPLITS`)."""
    for shape in CONV_SHAPES:
        N, C, H, W, K, R, S, st, pad = shape
        x, w, b = f32(rng, N, C, H, W), f32(rng, K, C, R, S), f32(rng, K)
        P, Q = (H + 2 * pad - R) // st + 1, (W + 2 * pad - S) // st + 1
        dy = f32(rng, N, K, P, Q)
        for how, knobs in CONV_SPLITS.items():
            ops = cpu_backend(lib, **knobs)
            ws = ops.Workspace()
            y = ops.conv2d_fprop(x, w, b, st, pad, ws=ws)
            y0 = ops.conv2d_fprop(x, w, None, st, pad)
            dx = ops.conv2d_dgrad(dy, w, x.shape, st, pad, ws=ws)
            dw = np.full((K, C, R, S), np.nan, np.float32)
            ops.conv2d_wgrad(dy, x, (K, C, R, S), st, pad, out=dw, ws=ws)
            what = f"{shape} {how}"
            assert_close(y, numpy_ops.conv2d_fprop(f64(x), f64(w), f64(b), st, pad), f"conv2d_fprop {what}")
            assert_close(y0, numpy_ops.conv2d_fprop(f64(x), f64(w), None, st, pad), f"conv2d_fprop no bias {what}")
            assert_close(dx, numpy_ops.conv2d_dgrad(f64(dy), f64(w), x.shape, st, pad), f"conv2d_dgrad {what}")
            assert_close(dw, numpy_ops.conv2d_wgrad(f64(dy), f64(x), (K, C, R, S), st, pad), f"conv2d_wgrad {what}")
            conv_exact_on_integers(lib, rng, shape, knobs, what)


def conv_exact_on_integers(lib, rng, shape, knobs, what: str) -> None:
    """Small-integer inputs make every product and partial sum an integer below 2^24, so float32
    arithmetic is exact in any order: the kernels must equal the float64 reference bit for bit, and a
    tap dropped or counted twice (a split boundary, a digit carry, a padding test) cannot hide inside
    a rounding tolerance."""
    N, C, H, W, K, R, S, st, pad = shape
    P, Q = (H + 2 * pad - R) // st + 1, (W + 2 * pad - S) // st + 1
    x, w, b, dy = (rng.integers(-3, 4, size=sz).astype(np.float32)
                   for sz in ((N, C, H, W), (K, C, R, S), (K,), (N, K, P, Q)))
    ops = cpu_backend(lib, **knobs)
    y = ops.conv2d_fprop(x, w, b, st, pad)
    dx = ops.conv2d_dgrad(dy, w, x.shape, st, pad)
    dw = ops.conv2d_wgrad(dy, x, (K, C, R, S), st, pad)
    for got, ref, name in ((y, numpy_ops.conv2d_fprop(f64(x), f64(w), f64(b), st, pad), "fprop"),
                           (dx, numpy_ops.conv2d_dgrad(f64(dy), f64(w), x.shape, st, pad), "dgrad"),
                           (dw, numpy_ops.conv2d_wgrad(f64(dy), f64(x), (K, C, R, S), st, pad), "wgrad")):
        assert np.array_equal(got, ref), f"conv2d_{name} {what}: not exact on integers, {np.sum(got != ref)} " \
                                         f"elements differ, worst by {np.max(np.abs(got - ref))}"


def conv_fprop_relu_epilogue(lib, rng, small: bool) -> None:
    """conv2d_fprop with the fused bias + ReLU epilogue (relu=1), raw launch."""
    N, C, H, W, K, R, S, st, pad = CONV_SHAPES[1]
    x, w, b = f32(rng, N, C, H, W), f32(rng, K, C, R, S), f32(rng, K)
    P, Q = (H + 2 * pad - R) // st + 1, (W + 2 * pad - S) // st + 1
    ref = np.maximum(numpy_ops.conv2d_fprop(f64(x), f64(w), f64(b), st, pad), 0)
    ops = cpu_backend(lib)  # K = 70: the 64x64 tile (unless the library forces another)
    tile = ops.planner.conv_tile(K)
    grid, block = ops.planner.conv_launch(M=K, NG=N * P * Q, tile=tile)
    fprop = ops.kernels.get("conv2d_fprop", tile)
    tab = ops.planner.conv_tap_table("conv2d_fprop", N, C, H, W, K, R, S, P, Q, st, pad)
    assert tab is not None
    # P*Q = 16: each thread's 4 columns are consecutive, so rows go out as float4 stores where the
    # address is 16-byte aligned; an output 4 bytes off that alignment must take the scalar stores
    buf = np.full(N * K * P * Q + 8, np.nan, np.float32)
    first = (-buf.ctypes.data % 16) // 4  # index of the first 16-byte aligned element
    for offset, table in ((first, tab), (first + 1, tab), (first, None)):  # None: the bounds-testing path
        y = buf[offset:offset + N * K * P * Q].reshape(N, K, P, Q)
        y[...] = np.nan
        fprop(grid, block, (x, w, b, y, *_i32(N, C, H, W, K, R, S, P, Q, st, pad, 1), table))
        assert_close(y, ref, f"conv2d_fprop relu epilogue (output address {y.ctypes.data % 16} mod 16, "
                             f"tap table {table is not None})")


def conv_wgrad_splits(lib, rng, small: bool) -> None:
    """conv2d_wgrad_partial + conv2d_split_reduce with chosen chunks (1 split, ragged splits, one slab
    per split), with the tap table and testing bounds: each matches the reference and each is
    bit-identical when run again."""
    N, C, H, W, K, R, S, st, pad = CONV_SHAPES[2]
    x = f32(rng, N, C, H, W)
    P, Q = (H + 2 * pad - R) // st + 1, (W + 2 * pad - S) // st + 1
    dy = f32(rng, N, K, P, Q)
    ref = numpy_ops.conv2d_wgrad(f64(dy), f64(x), (K, C, R, S), st, pad)
    NPQ, CRS = N * P * Q, C * R * S
    ops = cpu_backend(lib)
    tab = ops.planner.conv_tap_table("conv2d_wgrad", N, C, H, W, K, R, S, P, Q, st, pad)
    assert tab is not None
    for chunk, table in itertools.product([NPQ + 8 - NPQ % 8, 24, 8], [tab, None]):
        splits = -(-NPQ // chunk)
        results = []
        for _ in range(2):
            part = np.full((splits, K, CRS), np.nan, np.float32)
            dw = np.full((K, C, R, S), np.nan, np.float32)
            ops = cpu_backend(lib)  # K = 6: the 32x128 tile (unless the library forces another)
            tile = ops.planner.conv_tile(K)
            grid, block = ops.planner.conv_launch(M=K, NG=CRS, splits=splits, tile=tile)
            partial = ops.kernels.get("conv2d_wgrad_partial", tile)
            partial(grid, block, (dy, x, part, *_i32(N, C, H, W, K, R, S, P, Q, st, pad), np.int64(chunk), table))
            lib.kernel("conv2d_split_reduce")((3,), (32,), (part, None, dw, *_i32(splits, 1, K), np.int64(CRS),
                                                            np.int32(0)))
            results.append(dw)
        what = f"conv2d_wgrad chunk {chunk} ({splits} splits, tap table {table is not None})"
        assert_close(results[0], ref, what)
        assert np.array_equal(results[0], results[1]), f"{what}: not bit-reproducible"


def conv_split_reduce(lib, rng, small: bool) -> None:
    """conv2d_split_reduce on a crafted workspace: the splits added into NCHW, + bias, ReLU (the
    split-K epilogue of fprop), with 1, 2 and 8 lanes per output, one block striding over 3 groups
    of outputs and several blocks; bit-identical when run again with the same launch."""
    splits, N, M, L = 11, 2, 5, 7
    part = f32(rng, splits, M, N * L)
    bias = f32(rng, M)
    ref = part.astype(np.float64).sum(0).reshape(M, N, L).transpose(1, 0, 2)
    for threads in (32, 64) if small else (32, 64, 256):
        for blocks in (1, 2):
            for b, relu in ((None, 0), (bias, 0), (bias, 1)):
                want = ref + (0 if b is None else f64(b)[None, :, None])
                runs = []
                for _ in range(2):
                    out = np.full((N, M, L), np.nan, np.float32)
                    lib.kernel("conv2d_split_reduce")((blocks,), (threads,), (part, b, out, *_i32(splits, N, M),
                                                                             np.int64(L), np.int32(relu)))
                    runs.append(out)
                what = f"conv2d_split_reduce {threads} threads {blocks} blocks bias {b is not None} relu {relu}"
                assert_close(runs[0], np.maximum(want, 0) if relu else want, what)
                assert np.array_equal(runs[0], runs[1]), f"{what}: not bit-reproducible"


def conv_relu_nonfinite(lib, rng, small: bool) -> None:
    """NaN and +-inf in x through the fused bias + ReLU of conv2d_fprop (relu=1, tap table and testing
    bounds) and of split-K (conv2d_fprop_partial, then conv2d_split_reduce with bias and relu=1), and
    in a crafted split-K workspace (relu 0 and 1): an output that sums a NaN (or both infinities) is NaN
    after the ReLU, +inf stays +inf, -inf becomes 0, as numpy_ops.relu_fprop(numpy_ops.conv2d_fprop(..))."""
    N, C, H, W, K, R, S, st, pad = CONV_SHAPES[1]  # K = 70: two row tiles; C*R*S = 36: three ranges of 16
    x, w, b = f32(rng, N, C, H, W), f32(rng, K, C, R, S), f32(rng, K)
    x[0, 1, 3, 4] = np.nan
    x[1, 0, 2, 2] = x[1, 3, 2, 3] = np.inf  # in windows together: +inf, -inf or inf - inf = NaN by w's signs
    x[1, 2, 6, 5] = -np.inf
    P, Q = (H + 2 * pad - R) // st + 1, (W + 2 * pad - S) // st + 1
    with np.errstate(invalid="ignore"):
        pre = numpy_ops.conv2d_fprop(f64(x), f64(w), f64(b), st, pad)
    assert np.isnan(pre).any() and np.isposinf(pre).any() and np.isneginf(pre).any()  # not vacuous
    ref = numpy_ops.relu_fprop(pre)
    chunk = 16
    splits = -(-C * R * S // chunk)
    ops = cpu_backend(lib)
    tile = ops.planner.conv_tile(K)
    tab = ops.planner.conv_tap_table("conv2d_fprop", N, C, H, W, K, R, S, P, Q, st, pad)
    fprop, partial = ops.kernels.get("conv2d_fprop", tile), ops.kernels.get("conv2d_fprop_partial", tile)
    grid, block = ops.planner.conv_launch(M=K, NG=N * P * Q, tile=tile)
    split_grid, _ = ops.planner.conv_launch(M=K, NG=N * P * Q, splits=splits, tile=tile)
    for table in (tab, None):
        y = np.full((N, K, P, Q), -1.0, np.float32)
        fprop(grid, block, (x, w, b, y, *_i32(N, C, H, W, K, R, S, P, Q, st, pad, 1), table))
        assert_close(y, ref, f"conv2d_fprop relu epilogue, non-finite x (tap table {table is not None})")
        part = np.full((splits, K, N * P * Q), np.nan, np.float32)
        partial(split_grid, block, (x, w, part, *_i32(N, C, H, W, K, R, S, P, Q, st, pad), np.int64(chunk), table))
        y = np.full((N, K, P, Q), -1.0, np.float32)
        lib.kernel("conv2d_split_reduce")((4,), (64,), (part, b, y, *_i32(splits, N, K), np.int64(P * Q),
                                                        np.int32(1)))
        assert_close(y, ref, f"conv2d_fprop split-K {splits} + split_reduce relu, non-finite x "
                             f"(tap table {table is not None})")
    splits, N, M, L = 11, 2, 5, 7
    part = f32(rng, splits, M, N * L)
    part[3, 1, 2] = np.nan
    part[0, 2, 5], part[6, 2, 5] = np.inf, -np.inf  # inf - inf: NaN
    part[1, 3, 4] = -np.inf  # ReLU: 0
    part[2, 4, 1] = np.inf
    bias = f32(rng, M)
    with np.errstate(invalid="ignore"):
        want = part.astype(np.float64).sum(0).reshape(M, N, L).transpose(1, 0, 2) + f64(bias)[None, :, None]
    for threads in (32, 64) if small else (32, 64, 256):
        for relu in (0, 1):
            out = np.zeros((N, M, L), np.float32)
            lib.kernel("conv2d_split_reduce")((2,), (threads,), (part, bias, out, *_i32(splits, N, M), np.int64(L),
                                                                 np.int32(relu)))
            assert_close(out, np.maximum(want, 0) if relu else want,
                         f"conv2d_split_reduce non-finite workspace, {threads} threads, relu {relu}")


def bias_grad(lib, rng, small: bool) -> None:
    """bias_grad on (N, K, P, Q) and (N, K) with 256- and 32-thread blocks (L below and above the block)."""
    for threads in (32,) if small else (256, 32):
        for shape in [(3, 5, 7, 9), (4, 3), (2, 65, 1, 1)]:
            dy = f32(rng, *shape)
            ops = cpu_backend(lib, reduce_threads=threads)
            db = ops.bias_grad(dy, out=np.full(shape[1], np.nan, np.float32))
            assert_close(db, numpy_ops.bias_grad(f64(dy)), f"bias_grad {shape} block {threads}")


def relu(lib, rng, small: bool) -> None:
    """relu_fprop and relu_bprop, odd sizes, with exact zeros; a capped grid exercises the grid-stride loop."""
    for threads, max_blocks in [(64, 2)] if small else [(256, 65535), (64, 2), (32, 1)]:
        x = f32(rng, 3, 5, 7, 11)
        x.reshape(-1)[::7] = 0.0
        dy = f32(rng, *x.shape)
        ops = cpu_backend(lib, elementwise_threads=threads, elementwise_max_blocks=max_blocks)
        y = ops.relu_fprop(x)
        dx = ops.relu_bprop(dy, y)
        assert np.array_equal(y, numpy_ops.relu_fprop(x)), "relu_fprop"
        assert np.array_equal(dx, numpy_ops.relu_bprop(dy, numpy_ops.relu_fprop(x))), "relu_bprop"


def relu_nonfinite(lib, rng, small: bool) -> None:
    """relu_fprop and relu_bprop on NaN, +-inf and signed zeros, in x and in dy, equal to numpy_ops and to
    the definition: y = NaN where x is NaN, else max(x, 0); dx = dy * (y > 0), so 0 where y is NaN or
    <= 0 and dy finite, but NaN where dy is NaN or +-inf there (0 * inf), dy where y > 0."""
    x = f32(rng, 3, 5, 7, 11)
    flat = x.reshape(-1)
    flat[0::13], flat[1::13], flat[2::13], flat[3::13], flat[4::13] = np.nan, np.inf, -np.inf, 0.0, -0.0
    dy = f32(rng, *x.shape)
    dflat = dy.reshape(-1)
    dflat[0::11], dflat[1::11], dflat[2::11] = np.nan, np.inf, -np.inf
    y_def = np.where(np.isnan(x), np.nan, np.where(x > 0, x, 0)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        dx_def = np.where(y_def > 0, dy, np.where(np.isfinite(dy), 0, np.nan)).astype(np.float32)
        y_ref = numpy_ops.relu_fprop(x)
        dx_ref = numpy_ops.relu_bprop(dy, y_ref)
    assert np.array_equal(y_ref, y_def, equal_nan=True) and np.array_equal(dx_ref, dx_def, equal_nan=True)
    for threads, max_blocks in [(64, 2)] if small else [(256, 65535), (64, 2)]:
        ops = cpu_backend(lib, elementwise_threads=threads, elementwise_max_blocks=max_blocks)
        y = ops.relu_fprop(x)
        dx = ops.relu_bprop(dy, y_ref)
        for got, ref, name in ((y, y_ref, "relu_fprop"), (dx, dx_ref, "relu_bprop")):
            bad = ~((got == ref) | (np.isnan(got) & np.isnan(ref)))
            assert not bad.any(), (f"{name} non-finite: {int(bad.sum())} elements differ, the first at flat index "
                                   f"{int(np.flatnonzero(bad)[0])}: got {got.reshape(-1)[bad.reshape(-1)][0]}, "
                                   f"expected {ref.reshape(-1)[bad.reshape(-1)][0]}")


def maxpool(lib, rng, small: bool) -> None:
    """maxpool_fprop (y and the argmax, uint8 and int32) and maxpool_bprop (overlapping windows sum),
    including ties (values rounded to a coarse grid)."""
    for N, C, H, W, k, st in POOL_SHAPES:
        x = np.round(f32(rng, N, C, H, W) * 2) / 2  # many ties: the first maximum must win
        ops = cpu_backend(lib, elementwise_threads=64)
        y, am = ops.maxpool_fprop(x, k, st)
        dy = f32(rng, *y.shape)
        dx = ops.maxpool_bprop(dy, am, x.shape, k, st)
        y_ref, am_ref = numpy_ops.maxpool_fprop(x, k, st)
        assert am.dtype == am_ref.dtype, f"maxpool argmax dtype {am.dtype} != {am_ref.dtype}"
        assert np.array_equal(y, y_ref), f"maxpool_fprop {(N, C, H, W, k, st)}"
        assert np.array_equal(am, am_ref), f"maxpool_fprop argmax {(N, C, H, W, k, st)}"
        dx_ref = numpy_ops.maxpool_bprop(f64(dy), am_ref, x.shape, k, st)
        assert_close(dx, dx_ref, f"maxpool_bprop {(N, C, H, W, k, st)}")


def maxpool_window(x: np.ndarray, kernel: int, stride: int, n: int, c: int, p: int, q: int) -> np.ndarray:
    """Window (n, c, p, q) of x, flattened in row-major (scan) order."""
    return x[n, c, p * stride:p * stride + kernel, q * stride:q * stride + kernel].reshape(-1)


def maxpool_scan(x: np.ndarray, kernel: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Max pooling by a plain scan of each window in row-major order (the definition the kernels and
    numpy_ops must meet): the first NaN, else the first maximum; (y, argmax offset i*kernel + j)."""
    N, C, H, W = x.shape
    P, Q = (H - kernel) // stride + 1, (W - kernel) // stride + 1
    y, argmax = np.empty((N, C, P, Q), x.dtype), np.empty((N, C, P, Q), np.int64)
    for n, c, p, q in itertools.product(range(N), range(C), range(P), range(Q)):
        win = maxpool_window(x, kernel, stride, n, c, p, q)
        nan = np.flatnonzero(np.isnan(win))
        argmax[n, c, p, q] = nan[0] if nan.size else int(np.argmax(win))  # np.argmax: the first maximum
        y[n, c, p, q] = win[argmax[n, c, p, q]]
    return y, argmax


def maxpool_nonfinite(lib, rng, small: bool) -> None:
    """maxpool_fprop / maxpool_bprop (uint8 and int32 argmax) with NaN and +-inf among tied values: a
    window holding a NaN gives NaN and its gradient goes to the first NaN of its row-major scan (an
    overlapping NaN gets the sum); +inf and -inf are ordinary maxima (a window of -inf: offset 0). Both
    the kernels and numpy_ops must equal `maxpool_scan`."""
    for N, C, H, W, k, st in POOL_SHAPES:
        x = np.round(f32(rng, N, C, H, W) * 2) / 2
        flat = x.reshape(-1)
        pick = rng.permutation(flat.size)
        flat[pick[:flat.size // 10]] = np.nan
        flat[pick[flat.size // 10:flat.size // 6]] = np.inf
        flat[pick[flat.size // 6:flat.size // 4]] = -np.inf
        x[0, 0] = -np.inf  # every window -inf
        x[-1, -1] = np.round(f32(rng, H, W) * 2) / 2  # finite, then one +inf and a NaN after it
        x[-1, -1, k - 1, k - 1], x[-1, -1, 0, k - 1] = np.nan, np.inf
        y_def, am_def = maxpool_scan(x, k, st)
        what = f"maxpool non-finite {(N, C, H, W, k, st)}"
        assert np.isnan(y_def).any() and (~np.isnan(y_def)).any(), what
        ops = cpu_backend(lib, elementwise_threads=64)
        y, am = ops.maxpool_fprop(x, k, st)
        dy = f32(rng, *y.shape)
        dx = ops.maxpool_bprop(dy, am, x.shape, k, st)
        y_ref, am_ref = numpy_ops.maxpool_fprop(x, k, st)
        for name, got_y, got_am in (("numpy_ops", y_ref, am_ref), ("kernel", y, am)):
            assert np.array_equal(got_y, y_def, equal_nan=True), f"{what}: {name} y"
            wrong = [tuple(int(i) for i in at) for at in np.argwhere(got_am != am_def)]
            assert not wrong, (f"{what}: {name} argmax at {wrong[0]} is {got_am[wrong[0]]}, expected "
                               f"{am_def[wrong[0]]} (window {maxpool_window(x, k, st, *wrong[0]).tolist()})")
        assert_close(dx, numpy_ops.maxpool_bprop(f64(dy), am_def.astype(am.dtype), x.shape, k, st), f"{what}: bprop")


def softmax_xent(lib, rng, small: bool) -> None:
    """loss, dlogits and correct count; K below and above the block; a tied row; int64 labels;
    a label out of range raises ValueError naming it and its index."""
    for threads in (32,) if small else (256, 32):
        for N, K in [(7, 10), (3, 300)]:
            logits = f32(rng, N, K) * 3
            logits[0, :] = 1.0  # all tied: argmax is 0
            labels = rng.integers(0, K, N).astype(np.int64)
            ops = cpu_backend(lib, reduce_threads=threads)
            loss, d, correct = ops.softmax_xent(logits, labels)
            loss_ref, d_ref, correct_ref = numpy_ops.softmax_xent(f64(logits), labels)
            assert_close(loss, loss_ref, f"softmax_xent loss {(N, K)} block {threads}", atol=1e-5, rtol=1e-5)
            assert_close(d, d_ref, f"softmax_xent dlogits {(N, K)} block {threads}", atol=1e-6, rtol=1e-5)
            assert correct == correct_ref, f"softmax_xent correct {correct} != {correct_ref}"
            stats, d2 = ops.softmax_xent_deferred(logits, labels)  # the same bits, read later
            assert stats.get() == (loss, correct) and np.array_equal(d2, d), "softmax_xent_deferred differs"
    bad = np.array([1, 2, 10, -1], dtype=np.int64)
    ops = cpu_backend(lib, reduce_threads=32)
    for deferred in (False, True):
        try:
            if deferred:
                stats, _ = ops.softmax_xent_deferred(f32(rng, 4, 10), bad)
                stats.get()  # (the kernel's flags are read here)
            else:
                ops.softmax_xent(f32(rng, 4, 10), bad)
        except ValueError as e:
            assert "label 10 at index 2" in str(e), str(e)
        else:
            raise AssertionError(f"softmax_xent{'_deferred' if deferred else ''} accepted label 10 of 10 classes")


def softmax_xent_nonfinite(lib, rng, small: bool) -> None:
    """softmax_xent on rows holding NaN or +-inf, as numpy_ops (max, then argmax, propagating NaN): such a
    row's dlogits are all NaN (and so is the mean loss), and its argmax for the correct count is the
    first NaN (two NaNs in different threads' subsets: the reduction keeps the lower index), else the
    first maximum, +inf included; a row of -inf has argmax 0."""
    for threads in (32,) if small else (256, 32):
        for N, K in [(6, 10), (5, 300)]:
            logits = f32(rng, N, K) * 3
            labels = rng.integers(0, K, N).astype(np.int64)
            first, second = {10: (2, 6), 300: (43, 290)}[K]  # K = 300: threads 43 and 34 of 256, 11 and 2 of 32
            logits[0, [second, first]] = np.nan
            labels[0] = first  # a hit: the first NaN is the argmax
            logits[1, 3], labels[1] = np.inf, 3  # a hit
            logits[2, :], labels[2] = -np.inf, 0  # a hit: argmax 0
            logits[3, [1, K - 1]], labels[3] = np.nan, K - 1  # a miss: argmax 1
            ops = cpu_backend(lib, reduce_threads=threads)
            loss, d, correct = ops.softmax_xent(logits, labels)
            with np.errstate(invalid="ignore"):
                loss_ref, d_ref, correct_ref = numpy_ops.softmax_xent(f64(logits), labels)
            what = f"softmax_xent non-finite {(N, K)} block {threads}"
            assert np.isnan(loss) and np.isnan(loss_ref), f"{what}: loss {loss}, numpy_ops {loss_ref}"
            assert np.isnan(d_ref[:4]).all() and np.isfinite(d_ref[4:]).all(), what
            assert_close(d, d_ref, f"{what} dlogits", atol=1e-6, rtol=1e-5)
            hits = 3 + int(np.sum(np.argmax(logits[4:], axis=1) == labels[4:]))  # rows 0-2 hit, row 3 misses
            assert correct == correct_ref == hits, f"{what}: correct {correct}, numpy_ops {correct_ref}, want {hits}"


def sgd(lib, rng, small: bool) -> None:
    """sgd_momentum vs mpiasgd.optim.SGD over three steps (decay 0 on 'biases')."""
    from mpiasgd.optim import SGD

    n = 1001
    w0 = f32(rng, n)
    mask = (rng.random(n) < 0.8).astype(np.float32)
    ref = SGD(w0.copy(), mask, momentum=0.9, weight_decay=5e-4)
    w, v = w0.copy(), np.zeros(n, np.float32)
    ops = cpu_backend(lib, elementwise_threads=64, elementwise_max_blocks=3)
    for step in range(3):
        g = f32(rng, n)
        ref.step(g, 0.05)
        ops.sgd_momentum(w, v, g, ref.decay, 0.9, 0.05)
        assert_close(w, ref.params, f"sgd_momentum params, step {step}", atol=1e-6, rtol=1e-6)
        assert_close(v, ref.velocity, f"sgd_momentum velocity, step {step}", atol=1e-6, rtol=1e-6)


# (N, C, H, W, kernel, stride, pad, ceil_mode), each valid under contract.pool_output_size:
POOL_PAD_SHAPES = [
    (2, 3, 8, 8, 3, 2, 1, False),   # resnet/torchvision-style 3/2 pad 1
    (2, 2, 9, 11, 3, 2, 1, True),   # ceil: the last window runs past the bottom/right padding
    (1, 2, 7, 6, 3, 3, 0, True),    # cuda-convnet's size (ceil, pad 0): the last window clipped to 1 pixel
    (1, 2, 5, 5, 2, 2, 1, True),    # ceil that drops a window starting in the bottom padding
    (2, 1, 10, 9, 4, 3, 2, True),   # even kernel, pad = kernel//2
    (1, 2, 5, 5, 5, 1, 2, False),   # every window clipped on some side
    (1, 1, 17, 18, 17, 2, 8, True),  # 17*17 > 256: int32 argmax, with padding
]


def pool_window(x: np.ndarray, kernel: int, stride: int, pad: int, n: int, c: int, p: int, q: int):
    """The image pixels of window (n, c, p, q) of x in row-major order, and each one's offset i*kernel + j in
    the unclipped window whose origin is (p*stride - pad, q*stride - pad)."""
    H, W = x.shape[2:]
    h0, w0 = p * stride - pad, q * stride - pad
    rows, cols = range(max(h0, 0), min(h0 + kernel, H)), range(max(w0, 0), min(w0 + kernel, W))
    values = np.array([x[n, c, h, w] for h in rows for w in cols])
    offsets = np.array([(h - h0) * kernel + (w - w0) for h in rows for w in cols])
    return values, offsets


def maxpool_scan_padded(x: np.ndarray, kernel: int, stride: int, pad: int, ceil_mode: bool):
    """Max pooling with padding by a plain scan of each window's image pixels (padding never wins), the
    definition: the first NaN, else the first maximum; (y, argmax offset in the unclipped window)."""
    N, C = x.shape[:2]
    P, Q = pool_output_size("maxpool_scan_padded", x.shape, kernel, stride, pad, ceil_mode)
    y, argmax = np.empty((N, C, P, Q), x.dtype), np.empty((N, C, P, Q), np.int64)
    for n, c, p, q in itertools.product(range(N), range(C), range(P), range(Q)):
        values, offsets = pool_window(x, kernel, stride, pad, n, c, p, q)
        nan = np.flatnonzero(np.isnan(values))
        at = nan[0] if nan.size else int(np.argmax(values))
        y[n, c, p, q], argmax[n, c, p, q] = values[at], offsets[at]
    return y, argmax


def maxpool_pad_ceil(lib, rng, small: bool) -> None:
    """maxpool_fprop / maxpool_bprop with padding and ceil_mode (uint8 and int32 argmax): ties, NaN, +-inf,
    and windows whose image pixels are all -inf (the argmax is then the first image pixel: padding never
    wins); y and argmax equal numpy_ops and the plain scan, dx numpy_ops' scatter-add."""
    for shape in POOL_PAD_SHAPES:
        N, C, H, W, k, st, pad, ceil = shape
        x = np.round(f32(rng, N, C, H, W) * 2) / 2  # many ties: the first maximum must win
        flat = x.reshape(-1)
        pick = rng.permutation(flat.size)
        flat[pick[:flat.size // 20]] = np.nan
        flat[pick[flat.size // 20:flat.size // 10]] = np.inf
        x[0, 0, :, :] = -np.inf  # every window of this plane -inf: clipped ones point at their first pixel
        x[0, 0, H // 2, W // 2] = np.nan
        what = f"maxpool pad/ceil {shape}"
        ops = cpu_backend(lib, elementwise_threads=64)
        y, am = ops.maxpool_fprop(x, k, st, pad, ceil)
        y_def, am_def = maxpool_scan_padded(x, k, st, pad, ceil)
        y_ref, am_ref = numpy_ops.maxpool_fprop(x, k, st, pad, ceil)
        assert am.dtype == am_ref.dtype == argmax_dtype(k), f"{what}: argmax dtype {am.dtype}"
        for name, got_y, got_am in (("numpy_ops", y_ref, am_ref), ("kernel", y, am)):
            assert np.array_equal(got_y, y_def, equal_nan=True), f"{what}: {name} y"
            wrong = [tuple(int(i) for i in at) for at in np.argwhere(got_am != am_def)]
            assert not wrong, f"{what}: {name} argmax at {wrong[0]} is {got_am[wrong[0]]}, expected {am_def[wrong[0]]}"
        dy = f32(rng, *y.shape)
        dx = ops.maxpool_bprop(dy, am, x.shape, k, st, pad, ceil)
        assert_close(dx, numpy_ops.maxpool_bprop(f64(dy), am_ref, x.shape, k, st, pad, ceil), f"{what}: bprop")
        x = np.round(f32(rng, N, C, H, W) * 2) / 2  # finite: the backward of a plain forward
        y, am = ops.maxpool_fprop(x, k, st, pad, ceil)
        dx = ops.maxpool_bprop(dy, am, x.shape, k, st, pad, ceil)
        assert_close(dx, numpy_ops.maxpool_bprop(f64(dy), am, x.shape, k, st, pad, ceil), f"{what}: finite bprop")


def avgpool(lib, rng, small: bool) -> None:
    """avgpool_fprop / avgpool_bprop (count_include_pad both ways) vs numpy_ops in float64 on the padded and
    ceil_mode shapes and the unpadded ones, and global_avgpool_fprop / _bprop; a capped grid in the
    grid-stride loops."""
    shapes = [*POOL_PAD_SHAPES, *((*s, 0, False) for s in POOL_SHAPES)]
    for (N, C, H, W, k, st, pad, ceil), include in itertools.product(shapes, (True, False)):
        x = f32(rng, N, C, H, W)
        ops = cpu_backend(lib, elementwise_threads=64, elementwise_max_blocks=2)
        y = ops.avgpool_fprop(x, k, st, pad, ceil, include)
        dy = f32(rng, *y.shape)
        dx = ops.avgpool_bprop(dy, x.shape, k, st, pad, ceil, include)
        what = f"avgpool {(N, C, H, W, k, st, pad, ceil)} count_include_pad {include}"
        assert_close(y, numpy_ops.avgpool_fprop(f64(x), k, st, pad, ceil, include), f"{what}: fprop")
        assert_close(dx, numpy_ops.avgpool_bprop(f64(dy), x.shape, k, st, pad, ceil, include), f"{what}: bprop")
    for N, C, H, W in [(2, 3, 4, 4), (3, 5, 7, 9), (1, 1, 1, 1), (2, 70, 3, 1)]:
        x = f32(rng, N, C, H, W)
        dy = f32(rng, N, C)
        ops = cpu_backend(lib, elementwise_threads=32, elementwise_max_blocks=2)
        assert_close(ops.global_avgpool_fprop(x), numpy_ops.global_avgpool_fprop(f64(x)), f"global_avgpool {x.shape}")
        dx = ops.global_avgpool_bprop(dy, x.shape)
        assert np.array_equal(dx, numpy_ops.global_avgpool_bprop(dy, x.shape)), f"global_avgpool_bprop {x.shape}"


# (N, C, H, W): H*W below, above and not dividing the block (32, 64, 512 threads: one carry per step,
# whole images per step), M = 1 (the unbiased running variance is var), a channel with fewer elements
# than the block
BN_SHAPES = [(2, 3, 5, 7), (3, 2, 4, 4), (4, 5, 9, 9), (1, 2, 1, 1), (5, 3, 1, 3), (2, 4, 16, 17)]


def batchnorm(lib, rng, small: bool) -> None:
    """batchnorm_stats (with and without the running update), batchnorm_fprop and batchnorm_bprop (with and
    without dx) vs numpy_ops in float64, on data with a large offset (|mean| >> std: the two-pass variance
    must not cancel: a one-pass E[x^2] - E[x]^2 fails here); blocks of 32 and 64 threads (and the
    production 512 on two shapes with `small` False); every reduction is bit-identical when run again."""
    runs = [(threads, shape) for threads in (32, 64) for shape in BN_SHAPES]
    if not small:
        runs += [(BATCHNORM_THREADS_MAX, shape) for shape in BN_SHAPES[2:4]]
    for threads, shape in runs:
        C = shape[1]
        x = f32(rng, *shape) * 0.5 + 100.0 * f32(rng, 1, C, 1, 1)  # (N, C, H, W), per-channel offsets
        dy, gamma, beta = f32(rng, *shape), f32(rng, C), f32(rng, C)
        rm, rv = f32(rng, C), np.abs(f32(rng, C)) + 0.5
        ops = cpu_backend(lib, batchnorm_threads=threads)
        what = f"batchnorm {shape} block {threads}"
        mean, var = ops.batchnorm_stats(x)
        rm_got, rv_got = rm.copy(), rv.copy()
        mean2, var2 = ops.batchnorm_stats(x, rm_got, rv_got, 0.3)
        rm_ref, rv_ref = f64(rm), f64(rv)
        mean_ref, var_ref = numpy_ops.batchnorm_stats(f64(x), rm_ref, rv_ref, 0.3)
        assert_close(mean, mean_ref, f"{what}: mean")
        assert_close(var, var_ref, f"{what}: var")
        assert np.array_equal(mean, mean2) and np.array_equal(var, var2), f"{what}: stats not bit-reproducible"
        assert_close(rm_got, rm_ref, f"{what}: running_mean")
        assert_close(rv_got, rv_ref, f"{what}: running_var")
        y = ops.batchnorm_fprop(x, gamma, beta, mean, var, 1e-5)
        assert_close(y, numpy_ops.batchnorm_fprop(f64(x), f64(gamma), f64(beta), f64(mean), f64(var), 1e-5),
                     f"{what}: fprop")
        dgamma, dbeta = np.full(C, np.nan, np.float32), np.full(C, np.nan, np.float32)
        dx = ops.batchnorm_bprop(dy, x, gamma, mean, var, 1e-5, dgamma, dbeta)
        dgamma_ref, dbeta_ref = np.empty(C), np.empty(C)
        dx_ref = numpy_ops.batchnorm_bprop(f64(dy), f64(x), f64(gamma), f64(mean), f64(var), 1e-5, dgamma_ref,
                                           dbeta_ref)
        assert_close(dgamma, dgamma_ref, f"{what}: dgamma")
        assert_close(dbeta, dbeta_ref, f"{what}: dbeta")
        assert_close(dx, dx_ref, f"{what}: dx")
        again = np.full(C, np.nan, np.float32), np.full(C, np.nan, np.float32)
        assert ops.batchnorm_bprop(dy, x, gamma, mean, var, 1e-5, *again, need_dx=False) is None
        assert np.array_equal(again[0], dgamma) and np.array_equal(again[1], dbeta), \
            f"{what}: bprop sums not bit-reproducible (or differ without dx)"


def batchnorm_large_mean(lib, rng, small: bool) -> None:
    """batchnorm_stats and batchnorm_bprop on a channel whose mean dwarfs its spread (x = 1e4 + 0.01 N(0,1),
    float32 spacing 1e-3 there): the variance to float32's accuracy against float64 (a plain two-pass
    variance from the rounded first-pass mean is off by 2-5e-4 relative here), the mean within two float32
    ulps, and dx of the stats-then-bprop chain no further from float64 than NumPy's float32 path (x 1.1)."""
    for threads, shape in [(64, (8, 2, 16, 16))] + ([] if small else [(BATCHNORM_THREADS_MAX, (16, 3, 8, 8))]):
        what = f"batchnorm large mean {shape} block {threads}"
        x = (1e4 + 0.01 * rng.standard_normal(shape)).astype(np.float32)  # (N, C, H, W)
        dy, gamma = f32(rng, *shape), np.ones(shape[1], np.float32)
        mean_ref, var_ref = numpy_ops.batchnorm_stats(f64(x))  # float64: exact to well below float32
        ops = cpu_backend(lib, batchnorm_threads=threads)
        mean, var = ops.batchnorm_stats(x)
        assert_close(mean, mean_ref, f"{what}: mean", atol=0.0, rtol=2.4e-7)
        assert_close(var, var_ref, f"{what}: var", atol=0.0, rtol=1e-6)
        C = shape[1]
        dx_ref = numpy_ops.batchnorm_bprop(f64(dy), f64(x), f64(gamma), mean_ref, var_ref, 1e-9, np.empty(C),
                                           np.empty(C))
        dx = ops.batchnorm_bprop(dy, x, gamma, mean, var, 1e-9, np.empty(C, np.float32), np.empty(C, np.float32))
        mean32, var32 = numpy_ops.batchnorm_stats(x)
        dx32 = numpy_ops.batchnorm_bprop(dy, x, gamma, mean32, var32, 1e-9, np.empty(C, np.float32),
                                         np.empty(C, np.float32))
        err, err32 = np.abs(dx - dx_ref).max(), np.abs(dx32 - dx_ref).max()
        assert err <= 1.1 * err32 + 1e-7, f"{what}: dx max error {err:.3g}, NumPy float32's {err32:.3g}"


def residual(lib, rng, small: bool) -> None:
    """add (fresh, into a, into b, into a third array) and subsample_pad_fprop / _bprop (strides 1-3,
    odd sizes, pads on either side or none): copies and one float32 add, so equal to numpy_ops exactly."""
    a, b = f32(rng, 3, 5, 7, 3), f32(rng, 3, 5, 7, 3)
    ops = cpu_backend(lib, elementwise_threads=64, elementwise_max_blocks=2)
    want = numpy_ops.add(a, b)
    assert np.array_equal(ops.add(a, b), want), "add"
    for into in ("a", "b", "third"):
        aa, bb, third = a.copy(), b.copy(), np.full(a.shape, np.nan, np.float32)
        out = {"a": aa, "b": bb, "third": third}[into]
        assert ops.add(aa, bb, out=out) is out and np.array_equal(out, want), f"add into {into}"
    for shape, stride, before, after in [((2, 3, 8, 8), 2, 2, 3), ((2, 3, 7, 9), 2, 0, 0), ((1, 4, 9, 10), 3, 1, 0),
                                          ((2, 2, 5, 5), 1, 0, 2)]:
        x = f32(rng, *shape)
        y = ops.subsample_pad_fprop(x, stride, before, after)
        what = f"subsample_pad {shape} stride {stride} pads {before}, {after}"
        assert np.array_equal(y, numpy_ops.subsample_pad_fprop(x, stride, before, after)), f"{what}: fprop"
        dy = f32(rng, *y.shape)
        dx = ops.subsample_pad_bprop(dy, shape, stride, before, after)
        assert np.array_equal(dx, numpy_ops.subsample_pad_bprop(dy, shape, stride, before, after)), f"{what}: bprop"


# Random123's known answers of Philox4x32-10 (kat_vectors): counter 0, key 0
PHILOX_KAT_ZERO = (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)


def dropout(lib, rng, small: bool) -> None:
    """dropout_fprop / dropout_bprop (kernel `dropout`) equal numpy_ops bit for bit: the mask for several
    keys (seed and minibatch past 2^32, layers), p from 0 to 0.99, sizes that are not multiples of 4, a
    capped grid; NaN and inf in x (a dropped one gives NaN: a multiply); the forward and backward keep
    the same elements. Then Random123's known answer through the op itself: with key 0 and counter 0
    (seed, minibatch, layer 0: elements 0..3), threshold t = word keeps the element and t = word + 1
    drops it, so each of the 4 words must be exactly the known one."""
    x = f32(rng, 3, 5, 7, 11)  # 1155 elements: 288 counters and a partial one
    x.reshape(-1)[::17] = np.nan
    x.reshape(-1)[5::17] = np.inf
    dy = f32(rng, *x.shape)
    ops = cpu_backend(lib, elementwise_threads=64, elementwise_max_blocks=3)
    keys = [(0, 0, 0), (1234, 7, 3), (2**64 - 1, 2**40 + 5, 2**32 - 1), (2**33 + 9, 2**64 - 1, 1)]
    for (seed, minibatch, layer), p in itertools.product(keys, (0.0, 0.5, 0.1, 0.99)):
        what = f"dropout p {p} seed {seed} minibatch {minibatch} layer {layer}"
        with np.errstate(invalid="ignore"):
            y, y_ref = ops.dropout_fprop(x, p, seed, minibatch, layer), numpy_ops.dropout_fprop(x, p, seed, minibatch,
                                                                                                layer)
        assert np.array_equal(y, y_ref, equal_nan=True), f"{what}: fprop differs from numpy_ops"
        dx = ops.dropout_bprop(dy, p, seed, minibatch, layer)
        assert np.array_equal(dx, numpy_ops.dropout_bprop(dy, p, seed, minibatch, layer)), f"{what}: bprop"
        finite = np.isfinite(x)
        assert np.array_equal((y != 0)[finite], (dx != 0)[finite]), f"{what}: forward and backward masks differ"
    for shape in [(1,), (6,), (4, 3)]:  # a partial counter only, one and a half, three whole
        a = f32(rng, *shape)
        assert np.array_equal(ops.dropout_fprop(a, 0.3, 5, 6, 7), numpy_ops.dropout_fprop(a, 0.3, 5, 6, 7)), shape
    ones = np.ones(4, np.float32)
    for word_at, word in enumerate(PHILOX_KAT_ZERO):
        kept = ops.dropout_fprop(ones, word / 2**32, 0, 0, 0)
        dropped = ops.dropout_fprop(ones, (word + 1) / 2**32, 0, 0, 0)
        assert kept[word_at] != 0 and dropped[word_at] == 0, (
            f"Philox4x32-10 word {word_at} of counter 0, key 0 is not {word:#010x}: kept at t = word: "
            f"{kept[word_at] != 0}, dropped at t = word + 1: {dropped[word_at] == 0}")


def lrn(lib, rng, small: bool) -> None:
    """lrn_fprop / lrn_bprop vs numpy_ops in float64: odd and even window sizes, size 1, a window wider
    than C (every channel), AlexNet's parameters (k 2, alpha 1e-4, beta 0.75) and strong ones (alpha
    1, beta 0.5, k 1) so that the normalisation is far from the identity."""
    for (N, C, H, W), size, alpha, beta, k in [((2, 7, 3, 5), 5, 1e-4, 0.75, 2.0), ((2, 7, 3, 5), 5, 1.0, 0.5, 1.0),
                                               ((1, 6, 4, 3), 4, 2.0, 0.75, 1.5), ((2, 3, 2, 2), 1, 0.7, 1.3, 1.0),
                                               ((1, 5, 3, 3), 9, 1.0, 0.75, 0.5)]:
        x = f32(rng, N, C, H, W)
        dy = f32(rng, N, C, H, W)
        ops = cpu_backend(lib, elementwise_threads=64, elementwise_max_blocks=2)
        y, scale = ops.lrn_fprop(x, size, alpha, beta, k)
        y_ref, scale_ref = numpy_ops.lrn_fprop(f64(x), size, alpha, beta, k)
        what = f"lrn {(N, C, H, W)} size {size} alpha {alpha} beta {beta} k {k}"
        assert_close(scale, scale_ref, f"{what}: scale")
        assert_close(y, y_ref, f"{what}: y")
        dx = ops.lrn_bprop(dy, x, y, scale, size, alpha, beta)
        assert_close(dx, numpy_ops.lrn_bprop(f64(dy), f64(x), y_ref, scale_ref, size, alpha, beta), f"{what}: dx")


def sgd_nesterov_lr_scale(lib, rng, small: bool) -> None:
    """sgd_momentum's four forms (heavy ball or nesterov, lr_scale or none) vs numpy_ops.sgd_momentum in
    float64 over three steps, with decay 0 on 'biases' and per-element learning-rate multipliers."""
    n = 1001
    w0, mask = f32(rng, n), (rng.random(n) < 0.8).astype(np.float32)
    decay = (5e-4 * mask).astype(np.float32)
    lr_scale = rng.choice([0.0, 0.5, 1.0, 2.0], n).astype(np.float32)
    ops = cpu_backend(lib, elementwise_threads=64, elementwise_max_blocks=3)
    for nesterov, scale in itertools.product((False, True), (None, lr_scale)):
        w, v = w0.copy(), np.zeros(n, np.float32)
        w_ref, v_ref = f64(w0), np.zeros(n)
        for step in range(3):
            g = f32(rng, n)
            ops.sgd_momentum(w, v, g, decay, 0.9, 0.05, nesterov=nesterov, lr_scale=scale)
            numpy_ops.sgd_momentum(w_ref, v_ref, f64(g), f64(decay), 0.9, 0.05, nesterov=nesterov,
                                   lr_scale=None if scale is None else f64(scale))
            what = f"sgd_momentum nesterov {nesterov} lr_scale {scale is not None}, step {step}"
            assert_close(w, w_ref, f"{what}: params", atol=1e-6, rtol=1e-6)
            assert_close(v, v_ref, f"{what}: velocity", atol=1e-6, rtol=1e-6)


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable
    kernels: tuple[str, ...]  # the kernels it launches (a test checks every kernel is covered)


CASES = [
    Case("conv_wrappers", conv_wrappers,
         ("conv2d_fprop", "conv2d_dgrad", "conv2d_fprop_partial", "conv2d_dgrad_partial", "conv2d_wgrad_partial",
          "conv2d_split_reduce")),
    Case("conv_fprop_relu_epilogue", conv_fprop_relu_epilogue, ("conv2d_fprop",)),
    Case("conv_wgrad_splits", conv_wgrad_splits, ("conv2d_wgrad_partial", "conv2d_split_reduce")),
    Case("conv_split_reduce", conv_split_reduce, ("conv2d_split_reduce",)),
    Case("conv_relu_nonfinite", conv_relu_nonfinite, ("conv2d_fprop", "conv2d_fprop_partial", "conv2d_split_reduce")),
    Case("bias_grad", bias_grad, ("bias_grad",)),
    Case("relu", relu, ("relu_fprop", "relu_bprop")),
    Case("relu_nonfinite", relu_nonfinite, ("relu_fprop", "relu_bprop")),
    Case("maxpool", maxpool, ("maxpool_fprop_u8", "maxpool_fprop_i32", "maxpool_bprop_u8", "maxpool_bprop_i32")),
    Case("maxpool_nonfinite", maxpool_nonfinite,
         ("maxpool_fprop_u8", "maxpool_fprop_i32", "maxpool_bprop_u8", "maxpool_bprop_i32")),
    Case("softmax_xent", softmax_xent, ("softmax_xent",)),
    Case("softmax_xent_nonfinite", softmax_xent_nonfinite, ("softmax_xent",)),
    Case("sgd", sgd, ("sgd_momentum",)),
    Case("maxpool_pad_ceil", maxpool_pad_ceil,
         ("maxpool_fprop_u8", "maxpool_fprop_i32", "maxpool_bprop_u8", "maxpool_bprop_i32")),
    Case("avgpool", avgpool, ("avgpool_fprop", "avgpool_bprop", "global_avgpool_fprop", "global_avgpool_bprop")),
    Case("batchnorm", batchnorm, ("batchnorm_stats", "batchnorm_fprop", "batchnorm_bprop")),
    Case("batchnorm_large_mean", batchnorm_large_mean, ("batchnorm_stats", "batchnorm_bprop")),
    Case("residual", residual, ("add", "subsample_pad_fprop", "subsample_pad_bprop")),
    Case("dropout", dropout, ("dropout",)),
    Case("lrn", lrn, ("lrn_fprop", "lrn_bprop")),
    Case("sgd_nesterov_lr_scale", sgd_nesterov_lr_scale, ("sgd_momentum",)),
]
