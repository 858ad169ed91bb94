"""The CUDA backend's argument checks, C scalar casts, launch limits and launch arithmetic, without a GPU.

`mpiasgd.ops.cuda` imports without cupy or a device; its checks are pure functions of array attributes,
so they run here on backends built with numpy arrays or a fake array type (which also lets shapes far
too large to allocate reach the grid checks) and kernels that record or refuse launches. The kernels
themselves run on the CPU in test_kernels_cpu.py.
"""

from __future__ import annotations

import itertools
import re
import sys
import types

import numpy as np
import pytest

import mpiasgd.ops
from kernels_cpu.cuda_cpu import harness
from mpiasgd.ops import (
    BACKENDS,
    BackendUnavailable,
    contract,
    cuda_device_count,
    cuda_probe,
    get_backend,
    numpy_ops,
    protocol,
)
from mpiasgd.ops.cuda import constants, device, planner, runtime, tiles
from mpiasgd.ops.cuda.backend import Blocks, CupyBackend
from mpiasgd.ops.cuda.device import CudaDevice, HostDevice, LaunchLimits
from mpiasgd.ops.cuda.planner import Planner


class FakeArray:
    """Attributes of a device array, no memory: shape, dtype, ndim, size, nbytes, strides, flags.c_contiguous."""

    def __init__(self, shape, dtype=np.float32, contiguous=True):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape, dtype=object))
        self.nbytes = self.size * self.dtype.itemsize
        self.strides = tuple(int(np.prod(self.shape[i + 1:], dtype=object)) * self.dtype.itemsize
                             for i in range(self.ndim))
        self.flags = types.SimpleNamespace(c_contiguous=contiguous)


class Recorder:
    """Kernels that record each launch as (name, grid, block, args, shared_mem, tile) instead of running it."""

    def __init__(self, launches: list) -> None:
        self.launches = launches

    def get(self, name, tile=None):
        return lambda grid, block, args, shared_mem=0: self.launches.append((name, grid, block, args, shared_mem,
                                                                             tile))


class FailOnLaunch:
    """Kernels whose every launch fails the test."""

    def get(self, name, tile=None):
        pytest.fail(f"{name} launched")


@pytest.fixture
def launches():
    return []


@pytest.fixture
def fake_gpu(launches):
    """The CUDA backend on FakeArray with kernels that record launches (into `launches`) instead of running them."""
    fake_xp = types.SimpleNamespace(ndarray=FakeArray, empty=lambda shape, dtype=np.float32: FakeArray(shape, dtype),
                                    asarray=lambda a: FakeArray(np.shape(a), np.asarray(a).dtype),
                                    may_share_memory=lambda a, b: a is b)
    return CupyBackend.on_host(fake_xp, Recorder(launches))


@pytest.fixture
def on_numpy():
    """The CUDA backend on numpy arrays; a launch fails the test."""
    return CupyBackend.on_host(np, FailOnLaunch())


def plan(device=None, **knobs) -> Planner:
    """A fresh planner on numpy arrays and `device` (default: a HostDevice, no wave), with `knobs`."""
    return Planner(np, device or HostDevice(), **knobs)


# ----------------------------------------------------------------------------------------------
# arrays


def test_check_array_accepts_contiguous_float32(on_numpy):
    a = np.zeros((2, 3), np.float32)
    assert on_numpy.check_array("op", "a", a, shape=(2, 3), ndim=2) is a


@pytest.mark.parametrize("make, match", [
    (lambda: np.zeros((2, 3), np.float64), "dtype float32, got float64"),
    (lambda: np.zeros((3, 2), np.float32).T, "C-contiguous"),           # transpose: refused, not misread
    (lambda: np.zeros((4, 3), np.float32)[::2], "C-contiguous"),        # strided slice
    (lambda: np.zeros((2, 4), np.float32), r"shape \(2, 3\), got \(2, 4\)"),
    (lambda: [[0.0] * 3] * 2, "ndarray on this backend, got builtins.list"),
])
def test_check_array_refuses(on_numpy, make, match):
    with pytest.raises(ValueError, match=match):
        on_numpy.check_array("op", "a", make(), shape=(2, 3))


def test_check_array_refuses_host_array_on_the_device_backend(fake_gpu):
    with pytest.raises(ValueError, match=r"got numpy\.ndarray"):
        fake_gpu.check_array("conv2d_fprop", "x", np.zeros((1, 1, 1, 1), np.float32))


def test_check_array_on_attribute_objects(fake_gpu):
    fake_gpu.check_array("op", "a", FakeArray((5,)))
    with pytest.raises(ValueError, match="C-contiguous"):
        fake_gpu.check_array("op", "a", FakeArray((5,), contiguous=False))


def test_wrappers_refuse_a_transposed_input_before_launch(on_numpy):
    x = np.zeros((1, 2, 5, 5), np.float32)
    w = np.zeros((3, 3, 3, 2), np.float32).transpose(0, 3, 1, 2)  # (3, 2, 3, 3), not contiguous
    with pytest.raises(ValueError, match="w must be C-contiguous"):
        on_numpy.conv2d_fprop(x, w, None, 1, 1)
    with pytest.raises(ValueError, match="dy must have dtype float32"):
        on_numpy.relu_bprop(np.zeros(4), np.zeros(4, np.float32))


# ----------------------------------------------------------------------------------------------
# scalars


def test_scalar_casts_give_exact_c_types():
    assert type(contract.c_int32("op", "n", 7)) is np.int32
    assert type(contract.c_int32("op", "n", np.int64(7))) is np.int32
    assert type(contract.c_int64("op", "n", 2**40)) is np.int64
    assert type(contract.c_float32("op", "lr", 0.1)) is np.float32
    assert contract.c_float32("op", "lr", 0.1) == np.float32(0.1)


@pytest.mark.parametrize("cast, value, match", [
    (contract.c_int32, 2**31, "does not fit a 32-bit int"),
    (contract.c_int32, -(2**31) - 1, "does not fit a 32-bit int"),
    (contract.c_int32, 1.0, "must be an integer"),
    (contract.c_int32, True, "must be an integer"),
    (contract.c_int64, 2**63, "does not fit a 64-bit int"),
    (contract.c_float32, float("inf"), "not a finite float32"),
    (contract.c_float32, 1e39, "not a finite float32"),
    (contract.c_float32, "0.1", "must be a real number"),
])
def test_scalar_casts_refuse(cast, value, match):
    with pytest.raises(ValueError, match=match):
        cast("op", "v", value)


# the kernel parameters that take NULL: conv's bias, sgd's lr_scale, batchnorm_stats' running arrays,
# batchnorm_bprop's dx (need_dx False)
OPTIONAL_POINTERS = {"bias", "lr_scale", "running_mean", "running_var", "dx"}


def newer_ops(ops, N, C, H, W) -> None:
    """One call of each op added with padded pooling, batch norm, residual blocks, dropout and LRN, on
    `ops` (arrays of its xp), with its optional arrays both ways where it has some."""
    x, dy2 = ops.empty((N, C, H, W)), ops.empty((N, C))
    vec = [ops.empty((C,)) for _ in range(6)]
    y, argmax = ops.maxpool_fprop(x, 3, 2, 1, True)
    ops.maxpool_bprop(ops.empty(y.shape), argmax, x.shape, 3, 2, 1, True)
    y = ops.avgpool_fprop(x, 3, 2, 1, True, False)
    ops.avgpool_bprop(ops.empty(y.shape), x.shape, 3, 2, 1, True, False)
    ops.global_avgpool_fprop(x)
    ops.global_avgpool_bprop(dy2, x.shape)
    ops.batchnorm_stats(x)
    ops.batchnorm_stats(x, vec[0], vec[1], 0.1)
    ops.batchnorm_fprop(x, *vec[:4], 1e-5)
    ops.batchnorm_bprop(ops.empty(x.shape), x, *vec[:3], 1e-5, vec[4], vec[5])
    ops.batchnorm_bprop(ops.empty(x.shape), x, *vec[:3], 1e-5, vec[4], vec[5], need_dx=False)
    ops.add(x, ops.empty(x.shape))
    y = ops.subsample_pad_fprop(x, 2, 1, 2)
    ops.subsample_pad_bprop(ops.empty(y.shape), x.shape, 2, 1, 2)
    ops.dropout_fprop(x, 0.5, 2**64 - 1, 2**40, 3)
    ops.dropout_bprop(x, 0.5, 2**64 - 1, 2**40, 3)
    y, scale = ops.lrn_fprop(x, 5, 1e-4, 0.75, 2.0)
    ops.lrn_bprop(ops.empty(x.shape), x, y, scale, 5, 1e-4, 0.75)


NEWER_OPS_KERNELS = ["maxpool_fprop_u8", "maxpool_bprop_u8", "avgpool_fprop", "avgpool_bprop", "global_avgpool_fprop",
                     "global_avgpool_bprop", "batchnorm_stats", "batchnorm_stats", "batchnorm_fprop", "batchnorm_bprop",
                     "batchnorm_bprop", "add", "subsample_pad_fprop", "subsample_pad_bprop", "dropout", "dropout",
                     "lrn_fprop", "lrn_bprop"]


def test_every_launched_scalar_has_its_c_type(fake_gpu, launches):
    N, C, H, W, K = 2, 3, 8, 8, 4
    x, w, b = FakeArray((N, C, H, W)), FakeArray((K, C, 3, 3)), FakeArray((K,))
    for splits in (1, 2):  # in place, then split-K
        ops = fake_gpu.configured(split_override=splits)
        ops.conv2d_fprop(x, w, b, 1, 1)
        ops.conv2d_dgrad(FakeArray((N, K, H, W)), w, (N, C, H, W), 1, 1)
        ops.conv2d_wgrad(FakeArray((N, K, H, W)), x, (K, C, 3, 3), 1, 1)
    fake_gpu.maxpool_fprop(x, 3, 2)
    fake_gpu.relu_fprop(x)
    fake_gpu.sgd_momentum(*(FakeArray((10,)) for _ in range(4)), momentum=0.9, lr=0.01)
    fake_gpu.sgd_momentum(*(FakeArray((10,)) for _ in range(4)), momentum=0.9, lr=0.01, nesterov=True,
                          lr_scale=FakeArray((10,)))
    newer_ops(fake_gpu, N, C, H, W)
    names = [launch[0] for launch in launches]
    assert names == ["conv2d_fprop", "conv2d_dgrad", "conv2d_wgrad_partial",
                     "conv2d_fprop_partial", "conv2d_split_reduce", "conv2d_dgrad_partial", "conv2d_split_reduce",
                     "conv2d_wgrad_partial", "conv2d_split_reduce",
                     "maxpool_fprop_u8", "relu_fprop", "sgd_momentum", "sgd_momentum", *NEWER_OPS_KERNELS]
    sigs = {s.name: s for f, t in harness.kernel_sources().items() for s in harness.parse_kernels(f, t)}
    for name, _, _, args, _, _ in launches:
        params = sigs[name].params
        assert len(args) == len(params), name
        for p, a in zip(params, args, strict=True):
            if p.pointer and a is None:  # NULL: only where the kernel takes an optional array
                assert p.name in OPTIONAL_POINTERS, f"{name}: {p.decl} got None"  # (3x3 stride 1: every pass
                # takes a tap table)
            elif p.pointer:
                assert isinstance(a, FakeArray) and a.dtype == p.dtype, f"{name}: {p.decl} got {a!r}"
            else:
                assert type(a) is p.dtype.type, f"{name}: {p.decl} got {type(a).__name__}"


def test_none_reaches_cupy_as_a_null_pointer_value():
    """CuPy turns a None kernel argument into no value at all (cupy issue 9046: the kernel reads a
    garbage pointer), so the launcher hands it an 8-byte zero for every None: a NULL bias or tap table."""
    calls = []
    kernel = runtime.NullSafeKernel(lambda grid, block, args, shared_mem=0: calls.append((grid, block, args,
                                                                                           shared_mem)))
    x = np.zeros(3, np.float32)
    kernel((2, 1, 1), (32, 1, 1), (x, None, np.int32(7), None), shared_mem=0)
    ((grid, block, args, shared_mem),) = calls
    assert (grid, block, shared_mem) == ((2, 1, 1), (32, 1, 1), 0)
    assert args[0] is x and args[2] == 7 and args[2].dtype == np.int32
    for null in (args[1], args[3]):
        assert type(null) is np.uint64 and null == 0 and null.itemsize == 8


def test_launch_refuses_a_python_scalar(fake_gpu, launches):
    with pytest.raises(TypeError, match="no C type"):
        fake_gpu.launch("relu_fprop", (1, 1, 1), (32, 1, 1), (FakeArray((4,)), FakeArray((4,)), 4))
    assert launches == []


# ----------------------------------------------------------------------------------------------
# launch limits and arithmetic


@pytest.mark.parametrize("grid, block, shared, ok", [
    ((2**31 - 1, 65535, 65535), (1024, 1, 1), 48 * 1024, True),
    ((2**31, 1, 1), (256, 1, 1), 0, False),
    ((1, 65536, 1), (256, 1, 1), 0, False),
    ((1, 1, 65536), (256, 1, 1), 0, False),
    ((0, 1, 1), (256, 1, 1), 0, False),
    ((1, 1, 1), (1025, 1, 1), 0, False),
    ((1, 1, 1), (32, 32, 2), 0, False),
    ((1, 1, 1), (1, 1, 65), 0, False),
    ((1, 1, 1), (256, 1, 1), 48 * 1024 + 1, False),
])
def test_check_launch(grid, block, shared, ok):
    if ok:
        LaunchLimits().check("k", grid, block, shared)
    else:
        with pytest.raises(ValueError, match="k: "):
            LaunchLimits().check("k", grid, block, shared)


def test_grid_checked_before_launch(fake_gpu, launches):
    # 2^20 images of 1x1024x1024 with a 1x1 filter: N*P*Q / 128 column tiles (K = 1: 32x128) > 2^31 - 1
    x, w = FakeArray((2**20, 1, 1024, 1024)), FakeArray((1, 1, 1, 1))
    with pytest.raises(ValueError, match=r"conv2d_fprop: grid \(8589934592, 1, 1\) outside the limits"):
        fake_gpu.conv2d_fprop(x, w, None, 1, 0)
    assert launches == []


def test_conv_extents_beyond_int32_refused(fake_gpu, launches):
    x, w = FakeArray((1, 2**16, 8, 8)), FakeArray((1, 2**16, 200, 200))
    with pytest.raises(ValueError, match=r"C\*R\*S = .* does not fit a 32-bit int"):
        fake_gpu.conv2d_fprop(x, w, None, 1, 100)
    assert launches == []


def test_conv_launch_cifar10_conv1():
    grid, block = plan().conv_launch(M=32, NG=128 * 32 * 32)  # cifar10 conv1 fprop at batch 128: 32x128
    assert grid == (1024, 1, 1) and block == (256, 1, 1)
    grid, block = plan().conv_launch(M=64, NG=128 * 7 * 7)  # conv3 (64 channels): 64x64
    assert grid == (98, 1, 1) and block == (256, 1, 1)


@pytest.mark.parametrize("M, tile", [(1, (32, 128)), (32, (32, 128)), (33, (64, 64)), (64, (64, 64)),
                                     (1000, (64, 64))])
def test_conv_tile_by_rows(M, tile):
    assert plan().conv_tile(M) == tile and tile in tiles.CONV_TILES
    assert tiles.conv_threads(tile) == 256


def test_conv_tile_override():
    forced = plan(tile_override=(16, 16))
    assert forced.conv_tile(64) == (16, 16)
    assert forced.conv_launch(M=64, NG=100) == ((7, 4, 1), (16, 1, 1))


def test_each_conv_pass_launches_the_tile_of_its_rows(fake_gpu, launches):
    """fprop and wgrad have K rows, dgrad C rows: each launch names the tile its grid was cut for."""
    ops = fake_gpu.configured(split_override=1)
    N, C, H, W, K = 2, 64, 8, 8, 32
    x, w = FakeArray((N, C, H, W)), FakeArray((K, C, 3, 3))
    ops.conv2d_fprop(x, w, None, 1, 1)
    ops.conv2d_dgrad(FakeArray((N, K, H, W)), w, (N, C, H, W), 1, 1)
    ops.conv2d_wgrad(FakeArray((N, K, H, W)), x, (K, C, 3, 3), 1, 1)
    tiles = {name: (grid, block, tile) for name, grid, block, _, _, tile in launches}
    assert tiles["conv2d_fprop"] == ((1, 1, 1), (256, 1, 1), (32, 128))          # 128 columns
    assert tiles["conv2d_dgrad"] == ((2, 1, 1), (256, 1, 1), (64, 64))           # 128 columns, 64 rows
    assert tiles["conv2d_wgrad_partial"][2] == (32, 128)


def test_tile_defines():
    assert tiles.tile_defines(None) == ()
    assert tiles.tile_defines((32, 128)) == ("-DCONV_BM=32", "-DCONV_BN=128")
    assert tiles.tile_defines((32, 128, 4, 4, 16)) == ("-DCONV_BM=32", "-DCONV_BN=128")  # the defaults
    assert tiles.tile_defines((64, 128, 8, 4, 8)) == ("-DCONV_BM=64", "-DCONV_BN=128", "-DCONV_TM=8",
                                                         "-DCONV_TN=4", "-DCONV_BK=8")
    assert tiles.tile_defines((64, 64, 4, 4, 16, 3)) == ("-DCONV_BM=64", "-DCONV_BN=64")  # 3 stages: the default
    assert tiles.tile_defines((64, 64, 4, 4, 16, 1)) == ("-DCONV_BM=64", "-DCONV_BN=64", "-DCONV_STAGES=1")
    assert tiles.tile_defines((64, 128, 8, 4, 8, 2)) == ("-DCONV_BM=64", "-DCONV_BN=128", "-DCONV_TM=8",
                                                            "-DCONV_TN=4", "-DCONV_BK=8", "-DCONV_STAGES=2")
    with pytest.raises(ValueError, match="conv tile"):
        tiles.tile_shape((64, 64, 4))


@pytest.mark.parametrize("tile, shape, name, threads", [
    ((64, 64), (64, 64, 4, 4, 16, 3), "64x64", 256), ((32, 128, 4, 4, 16), (32, 128, 4, 4, 16, 3), "32x128", 256),
    ((64, 128, 8, 4, 8), (64, 128, 8, 4, 8, 3), "64x128/8x4k8", 256),
    ((32, 256, 4, 8, 8, 3), None, "32x256/4x8k8", 256), ((32, 64, 8, 8, 8, 3), None, "32x64/8x8k8", 32),
    ((64, 64, 4, 4, 16, 1), None, "64x64/s1", 256), ((64, 128, 8, 4, 8, 2), None, "64x128/8x4k8/s2", 256),
    ((32, 96, 4, 4, 24), (32, 96, 4, 4, 24, 3), "32x96/4x4k24", 192)])
def test_tile_shapes(tile, shape, name, threads):
    assert tiles.tile_shape(tile) == (shape or tile)
    assert tiles.tile_name(tile) == name and tiles.conv_threads(tile) == threads


def test_trial_tiles_are_forced_never_chosen():
    """The trial tiles launch one thread per register block over their whole (BM, BN) (256, or 192 for
    32x96); conv_tile never picks one."""
    assert {plan().conv_tile(M) for M in range(1, 300)} == set(tiles.CONV_TILES)
    for tile in tiles.CONV_TRIAL_TILES:
        forced = plan(tile_override=tile)
        assert forced.conv_tile(32) == tile
        threads = 192 if tile[:2] == (32, 96) else 256
        assert forced.conv_launch(M=65, NG=1000) == ((-(-1000 // tile[1]), -(-65 // tile[0]), 1), (threads, 1, 1))


@pytest.mark.parametrize("K, CRS, NPQ", [(32, 75, 131072), (32, 800, 28800), (64, 800, 6272), (1, 1, 1),
                                         (512, 4608, 7), (16, 27, 10**9), (3, 5, 8 * 65535 * 3 + 1)])
def test_gemm_split_covers_the_reduction(K, CRS, NPQ):
    splits, chunk = plan().gemm_split(K, CRS, NPQ)
    assert chunk % constants.CONV_BK == 0 and chunk > 0
    assert (splits - 1) * chunk < NPQ <= splits * chunk  # no empty split, nothing left out
    assert 1 <= splits <= constants.MAX_GRID_YZ
    grid, _ = plan().conv_launch(M=K, NG=CRS, splits=splits)
    LaunchLimits().check("conv2d_wgrad_partial", grid, (256, 1, 1))


def test_gemm_split_fills_the_device_for_small_outputs():
    no_wave = HostDevice(sm_wave=None)  # no GPU: aim at CONV_TARGET_BLOCKS
    splits, chunk = plan(no_wave).gemm_split(32, 800, 128 * 15 * 15)  # cifar10 conv2 wgrad: 7 output tiles
    assert 7 * splits >= planner.CONV_TARGET_BLOCKS * 0.9 and chunk >= planner.CONV_MIN_CHUNK


@pytest.mark.parametrize("M, NG, KR, splits", [
    (32, 128 * 32 * 32, 75, 1),     # cifar10 conv1 fprop: 1024 tiles of 32x128, nothing to split
    (32, 128 * 15 * 15, 800, 3),    # conv2 fprop: 225 tiles -> 3 ranges of 272 (C*R*S = 800)
    (64, 128 * 7 * 7, 800, 3),      # conv3 fprop: 98 tiles of 64x64 -> 3 ranges (>= 256 terms each)
    (32, 128 * 7 * 7, 1600, 6),     # conv3 dgrad: 49 tiles -> 6 ranges of 272 (K*R*S = 1600)
    (128, 128 * 32 * 32, 576, 1),   # 64->128 3x3 on 32x32: 4096 tiles
])
def test_gemm_split_of_fprop_and_dgrad(M, NG, KR, splits):
    no_wave = HostDevice(sm_wave=None)  # no GPU: aim at CONV_TARGET_BLOCKS
    assert plan(no_wave).gemm_split(M, NG, KR)[0] == splits


@pytest.mark.parametrize("M, NG, KR, splits, blocks", [
    (64, 800, 128 * 7 * 7, 20, 260),        # conv3 wgrad: 13 tiles; 24 ranges would take 312 blocks = 2 waves
    (32, 75, 128 * 32 * 32, 256, 256),      # conv1 wgrad: 1 tile -> one wave (261 ranges asked, of whole
                                            # 16-term slabs: 256 of 512 terms; not 512 ranges: two waves)
    (32, 800, 128 * 15 * 15, 75, 525),      # conv2 wgrad: 7 tiles -> 2 full waves
    (64, 128 * 7 * 7, 800, 2, 196),         # conv3 fprop: 98 tiles; 3 ranges (294 blocks) would spill a wave
    (32, 128 * 7 * 7, 1600, 5, 245),        # conv3 dgrad: 49 tiles
    (32, 128 * 15 * 15, 800, 1, 225),       # conv2 fprop: 225 tiles already take one wave: no split
    (128, 128 * 32 * 32, 576, 1, 4096),     # two waves of tiles or more: never split
])
def test_gemm_split_fills_whole_waves(M, NG, KR, splits, blocks):
    """On a GPU of 132 SMs (H100/H200: waves of 264 blocks) split-K picks the ranges that take the
    fewest waves per unit of work."""
    h200 = plan(HostDevice(sm_wave=264))
    s, chunk = h200.gemm_split(M, NG, KR)
    tile = h200.conv_tile(M)
    tiles = -(-NG // tile[1]) * -(-M // tile[0])
    assert (s, tiles * s) == (splits, blocks)
    assert s == 1 or chunk >= planner.CONV_MIN_CHUNK


def test_device_wave_without_a_gpu():
    if cuda_device_count() > 0:
        pytest.skip("a CUDA device is visible")
    try:
        import cupy
    except ImportError:
        cupy = None
    assert CudaDevice(cupy).wave() is None


def test_gemm_split_override():
    forced = plan(split_override=5)
    assert forced.gemm_split(32, 10**6, 800) == (5, 160)
    assert forced.gemm_split(32, 10**6, 32) == (2, 16)  # at least one K-slab (16) per range


def _rows_by_definition(op, N, C, H, W, K, R, S, P, Q, stride, pad):
    """The tap table's rows written out tap by tap (the definition in conv_tap_table's docstring)."""
    rows = []
    if op == "conv2d_wgrad":
        for n, p, q in itertools.product(range(N), range(P), range(Q)):
            bits = sum(1 << (r * S + s) for r in range(R) for s in range(S)
                       if 0 <= p * stride + r - pad < H and 0 <= q * stride + s - pad < W)
            off = n * C * H * W + (p * stride - pad) * W + q * stride - pad if bits else 0
            rows.append((off, bits, n * K * P * Q + p * Q + q))
    else:
        for hi, r, s in itertools.product(range(C if op == "conv2d_fprop" else K), range(R), range(S)):
            if op == "conv2d_fprop":
                rows.append(((hi * H + r - pad) * W + s - pad, 1 << (r * S + s), len(rows)))
            else:
                rows.append(((hi * P - r) * Q - s, 1 << (r * S + s), hi * C * R * S + r * S + s))
    return [(off, bits - (1 << 32) if bits >= 1 << 31 else bits, a_off, 0) for off, bits, a_off in rows]


@pytest.mark.parametrize("op, stride", [("conv2d_fprop", 2), ("conv2d_dgrad", 1), ("conv2d_wgrad", 2)])
@pytest.mark.parametrize("R, S, pad", [(3, 3, 1), (4, 8, 2), (1, 1, 0), (2, 3, 6)])  # 4x8: bit 31; pad 6: rows
                                                                                    # without in-image taps
def test_conv_tap_table_rows(op, stride, R, S, pad, on_numpy):
    N, C, H, W, K = 2, 3, 9, 10, 5
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    table = on_numpy.planner.conv_tap_table(op, N, C, H, W, K, R, S, P, Q, stride, pad)
    rows = _rows_by_definition(op, N, C, H, W, K, R, S, P, Q, stride, pad)
    assert table.dtype == np.int32 and table.shape == (len(rows) + constants.CONV_TAB_PAD, 4)
    assert table[:len(rows)].tolist() == [list(r) for r in rows]
    assert not table[len(rows):].any()  # the rows past the reduction load nothing
    assert on_numpy.planner.conv_tap_table(op, N, C, H, W, K, R, S, P, Q, stride, pad) is table  # built once


@pytest.mark.parametrize("op, N, C, H, W, K, R, S, stride, why", [
    ("conv2d_fprop", 1, 2, 9, 9, 3, 6, 6, 1, "36 taps > 32"),
    ("conv2d_dgrad", 1, 2, 9, 9, 3, 3, 3, 2, "dgrad stride > 1"),
    ("conv2d_wgrad", 2**11, 2**10, 32, 32, 1, 3, 3, 1, "N*C*H*W = 2^31"),
    ("conv2d_wgrad", 2**11, 1, 32, 32, 2**10, 3, 3, 1, "N*K*P*Q = 2^31"),
    ("conv2d_fprop", 1, 2**19 + 1, 3, 3, 1, 3, 3, 1, "C*R*S > 2^22 terms"),
])
def test_conv_tap_table_absent_where_bounds_are_tested(op, N, C, H, W, K, R, S, stride, why, on_numpy):
    P, Q = (H + 2 - R) // stride + 1, (W + 2 - S) // stride + 1
    assert on_numpy.planner.conv_tap_table(op, N, C, H, W, K, R, S, P, Q, stride, 1) is None, why


def test_conv_tap_tables_kept_are_bounded():
    kept = plan(tab_cache=3)
    first = kept.conv_tap_table("conv2d_fprop", 1, 1, 4, 4, 1, 3, 3, 4, 4, 1, 1)
    for C in (2, 3):
        kept.conv_tap_table("conv2d_fprop", 1, C, 4, 4, 1, 3, 3, 4, 4, 1, 1)
    assert kept.conv_tap_table("conv2d_fprop", 1, 1, 4, 4, 1, 3, 3, 4, 4, 1, 1) is first  # used: kept
    kept.conv_tap_table("conv2d_fprop", 1, 4, 4, 4, 1, 3, 3, 4, 4, 1, 1)  # evicts C = 2, the oldest
    assert len(kept.tap_tables) == 3
    assert sorted(key[4] for key in kept.tap_tables) == [1, 3, 4]
    # and by bytes: (9*C + 128) rows of 16 bytes; room for C = 1 (2,192 B) and 4 (2,624 B), not a third
    kept.tab_cache_bytes = 6000  # (the planner is this test's own)
    kept.conv_tap_table("conv2d_fprop", 1, 5, 4, 4, 1, 3, 3, 4, 4, 1, 1)  # 2,768 B: evicts C = 3 and 1
    assert sorted(key[4] for key in kept.tap_tables) == [4, 5]


@pytest.mark.parametrize("n, blocks", [(0, 1), (1, 1), (256, 1), (257, 2), (10**12, 65535)])
def test_elementwise_launch(n, blocks):
    assert Blocks().elementwise(n) == ((blocks, 1, 1), (256, 1, 1))


# ----------------------------------------------------------------------------------------------
# registry and sources


def test_registry_lists_cupy_and_reports_a_missing_device():
    assert BACKENDS["cupy"] == "mpiasgd.ops.cuda.backend"
    with pytest.raises(ValueError, match="valid backends: numpy, cpu, cupy"):
        get_backend("tpu")
    if cuda_device_count() > 0:
        pytest.skip("a CUDA device is visible")
    with pytest.raises(BackendUnavailable, match=r"(no usable CUDA device \(|needs cupy)"):
        get_backend("cupy")


def fake_cuda(monkeypatch, count=1, error: str | None = None, nvrtc_error: str | None = None):
    """cupy and cupy_backends' NVRTC replaced by stand-ins: `count` devices, or getDeviceCount raising
    `error`; NVRTC's getVersion raising `nvrtc_error`."""
    def device_count():
        if error:
            raise RuntimeError(error)
        return count

    def nvrtc_version():
        if nvrtc_error:
            raise OSError(nvrtc_error)
        return (12, 9)

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=device_count)))
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.nvrtc = types.SimpleNamespace(getVersion=nvrtc_version)
    for name, module in (("cupy", cupy), ("cupy_backends", types.ModuleType("cupy_backends")),
                         ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                         ("cupy_backends.cuda.libs", libs)):
        monkeypatch.setitem(sys.modules, name, module)


def test_probe_names_the_cuda_error(monkeypatch):
    """A GPU node whose driver is too old for this cupy says so, rather than "no device"; a machine
    without any driver gets the same CUDA error and is told there is no driver (helper-21)."""
    monkeypatch.setattr(mpiasgd.ops, "cuda_driver_loadable", lambda: True)
    fake_cuda(monkeypatch, error="cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA "
                                 "runtime version")
    assert cuda_probe() == (0, "CUDA failed: cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                               "for CUDA runtime version")
    with pytest.raises(BackendUnavailable, match=r"no usable CUDA device \(CUDA failed: cudaErrorInsufficientDriver"):
        get_backend("cupy")
    fake_cuda(monkeypatch, error="cudaErrorNoDevice: no CUDA-capable device is detected")
    assert cuda_probe() == (0, "the driver reports no CUDA device")
    monkeypatch.setattr(mpiasgd.ops, "cuda_driver_loadable", lambda: False)
    fake_cuda(monkeypatch, error="cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA "
                                 "runtime version")
    assert cuda_probe() == (0, "no CUDA driver here (libcuda.so.1 cannot be loaded): no GPU, or its driver is not "
                               "installed")


def test_missing_nvrtc_is_named_at_backend_load(monkeypatch):
    fake_cuda(monkeypatch, count=1, nvrtc_error='Failure finding "libnvrtc.so.13 or libnvrtc.so.12"')
    with pytest.raises(BackendUnavailable, match=r"NVRTC, the CUDA runtime compiler that builds kernels/\*.cu, "
                                                  r"cannot be loaded \(OSError: Failure finding .*cupy-cuda12x\[ctk\]"):
        get_backend("cupy")


def test_kernel_folder_from_the_environment_must_hold_every_source(monkeypatch, tmp_path):
    fake_cuda(monkeypatch, count=1)
    monkeypatch.setenv("MPIASGD_KERNELS", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"\$MPIASGD_KERNELS = '.*nowhere' holds no conv2d.cu"):
        runtime.kernel_dir()
    (tmp_path / "conv2d.cu").write_text(harness.kernel_sources()["conv2d.cu"])
    monkeypatch.setenv("MPIASGD_KERNELS", str(tmp_path))
    lacking = [f for f in sorted(set(runtime.KERNEL_FILES.values())) if f != "conv2d.cu"] + list(runtime.HEADERS)
    assert {"batchnorm.cu", "sgd.cu", "constants.cuh", "philox.cuh"} <= set(lacking)  # (a kernel file is a .cu)
    with pytest.raises(BackendUnavailable, match=r"kernel folder '.*' lacks " + re.escape(", ".join(lacking))):
        get_backend("cupy")


def test_every_wrapped_kernel_exists_in_its_file():
    sources = harness.kernel_sources()
    assert runtime.kernel_dir() == harness.KERNELS
    defined = {s.name: f for f, t in sources.items() for s in harness.parse_kernels(f, t)}
    assert runtime.KERNEL_FILES == defined


def test_tile_constants_match_the_sources():
    """The constants shared with the kernels live in the generated header (the .cu files include it)."""
    text = harness.kernel_headers()[constants.HEADER_NAME]
    for name in ("CONV_BM", "CONV_BN", "CONV_BK"):
        assert f"#define {name} {getattr(constants, name)} " in text, name
    assert "#define CONV_TM 4 " in text and "#define CONV_TN 4 " in text
    assert tiles.conv_threads((constants.CONV_BM, constants.CONV_BN)) == 256
    assert (constants.CONV_BM, constants.CONV_BN) in tiles.CONV_TILES
    for f, macro in (("bias.cu", "BIAS_THREADS_MAX"), ("softmax_xent.cu", "SOFTMAX_THREADS_MAX")):
        assert f"#define {macro} {Blocks().reduce_threads}" in text
        assert f'#include "{constants.HEADER_NAME}"' in harness.kernel_sources()[f]


def test_the_committed_header_is_generated_from_the_constants_table():
    """kernels/constants.cuh is what `python -m mpiasgd.ops.cuda.constants` writes (else: run it), and no
    .cu file defines a name of the table itself (a second copy that could drift; an #undef first marks an
    intended override, as conv2d.cu's one stage below sm_80)."""
    path = harness.KERNELS / constants.HEADER_NAME
    assert path.read_text() == constants.header_text(), f"{path} is stale: run python -m mpiasgd.ops.cuda.constants"
    assert constants.main(["--check", "--output", str(path)]) == 0
    for name, text in harness.kernel_sources().items():
        redefined = [d.name for d in constants.HEADER
                     if f"#define {d.name} " in text and f"#undef {d.name}" not in text]
        assert not redefined, f"{name} defines {redefined}, which {constants.HEADER_NAME} holds"
        used = [d.name for d in constants.HEADER if d.name in text]
        assert not used or f'#include "{constants.HEADER_NAME}"' in text, f"{name} uses {used} without the header"


def test_a_stale_header_is_named_by_the_check(tmp_path, capsys):
    stale = tmp_path / constants.HEADER_NAME
    stale.write_text(constants.header_text().replace("#define CONV_BK 16", "#define CONV_BK 8"))
    assert constants.main(["--check", "--output", str(stale)]) == 1
    assert "is stale: run python -m mpiasgd.ops.cuda.constants" in capsys.readouterr().err
    assert constants.main(["--output", str(stale)]) == 0 and stale.read_text() == constants.header_text()


def test_nvrtc_gets_the_header_inlined_with_the_file_s_line_numbers():
    """CuPy's disk cache keys on the source text: the header is inlined, not found through -I, and a
    #line directive keeps compiler messages on the .cu file's own lines."""
    text = runtime.kernel_source("bias.cu", harness.KERNELS)
    original = harness.kernel_sources()["bias.cu"].split("\n")
    at = original.index(next(line for line in original if line.startswith('#include "constants.cuh"')))
    assert "#include" not in text and constants.header_text().rstrip() in text
    assert f'#line {at + 2} "bias.cu"' in text
    after = text.split(f'#line {at + 2} "bias.cu"\n', 1)[1].split("\n")
    assert after == original[at + 1:]


def test_public_names_match_numpy_backend(on_numpy):
    """Both backends provide every name of the protocol (mpiasgd.ops.protocol.Backend)."""
    public = protocol.members()
    assert "conv2d_fprop" in public and "Workspace" in public and "ndarray" in public
    for backend in (on_numpy, get_backend("numpy")):
        missing = [n for n in public if not hasattr(backend, n)]
        assert not missing, f"{backend!r} lacks {missing}"
        assert isinstance(backend, protocol.Backend)
    assert get_backend("numpy").conv2d_fprop is numpy_ops.conv2d_fprop


def test_empty_batch_launches_nothing_and_matches_numpy(on_numpy):
    """N = 0 (as numpy_ops): empty y and dx, a zero dw, and no launch (a grid of 0 blocks is invalid)."""
    x, w, b = np.zeros((0, 3, 8, 8), np.float32), np.ones((4, 3, 3, 3), np.float32), np.ones(4, np.float32)
    dy = np.zeros((0, 4, 8, 8), np.float32)
    assert on_numpy.conv2d_fprop(x, w, b, 1, 1).shape == (0, 4, 8, 8)
    assert on_numpy.conv2d_dgrad(dy, w, x.shape, 1, 1).shape == (0, 3, 8, 8)
    dw = np.full((4, 3, 3, 3), np.nan, np.float32)
    on_numpy.conv2d_wgrad(dy, x, w.shape, 1, 1, out=dw)
    np.testing.assert_array_equal(dw, 0)


def test_padded_extent_beyond_int32_refused(fake_gpu, launches):
    x, w = FakeArray((1, 1, 8, 8)), FakeArray((1, 1, 3, 3))
    with pytest.raises(ValueError, match=r"H \+ 2\*pad = .* does not fit a 32-bit int"):
        fake_gpu.conv2d_fprop(x, w, None, 1, 2**30)
    assert launches == []


def test_padded_plane_beyond_int32_refused(fake_gpu, launches):
    """A column's origin in the kernels is an int offset into the padded plane: (H + 2*pad)*(W + 2*pad)
    >= 2^31 is refused even where H, W, C*H*W and (stride 4) K*P*Q fit."""
    x, w = FakeArray((1, 1, 4, 4)), FakeArray((1, 1, 3, 3))
    with pytest.raises(ValueError, match=r"\(H \+ 2\*pad\)\*\(W \+ 2\*pad\) = .* does not fit a 32-bit int"):
        fake_gpu.conv2d_fprop(x, w, None, 4, 2**15)
    assert launches == []


def test_gemm_split_keeps_a_block_range_within_int32():
    """The kernels count a block's reduction terms in an int: no range passes CONV_MAX_CHUNK (2^30),
    even when one range is asked for."""
    splits, chunk = plan(split_override=1).gemm_split(8, 8, 3 * 2**30 + 5)
    assert chunk <= planner.CONV_MAX_CHUNK and splits * chunk >= 3 * 2**30 + 5 and splits == 3 + 1


def test_image_beyond_int32_refused(fake_gpu, launches):
    """Offsets within one image are 32-bit in the kernels: C*H*W >= 2^31 is refused before launch."""
    x, w = FakeArray((1, 2**11, 2**10, 2**10)), FakeArray((1, 2**11, 1, 1))
    with pytest.raises(ValueError, match=r"C\*H\*W = 2147483648 does not fit a 32-bit int"):
        fake_gpu.conv2d_fprop(x, w, None, 1, 0)
    assert launches == []


def test_pool_plane_beyond_int32_refused(fake_gpu, launches):
    """pool.cu indexes within one (n, c) plane with an int: a 50,000 x 50,000 plane is refused, not launched."""
    with pytest.raises(ValueError, match=r"maxpool_fprop: H\*W = 2500000000 does not fit a 32-bit int"):
        fake_gpu.maxpool_fprop(FakeArray((1, 1, 50000, 50000)), 2, 2)
    assert launches == []


@pytest.mark.parametrize("bad", [None, (2, 3, 8), (2, 3, 8.5, 8), (2, 3, True, 8), (2, -3, 8, 8), "2388"])
def test_shape_arguments_must_be_four_integers(on_numpy, bad):
    dy, w = np.zeros((2, 4, 8, 8), np.float32), np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(ValueError, match=r"conv2d_dgrad: x_shape must be 4 integers >= 0 \(N, C, H, W\), got "):
        on_numpy.conv2d_dgrad(dy, w, bad, 1, 1)
    with pytest.raises(ValueError, match=r"conv2d_wgrad: w_shape must be 4 integers >= 0 \(K, C, R, S\)"):
        on_numpy.conv2d_wgrad(dy, np.zeros((2, 3, 8, 8), np.float32), bad, 1, 1)
    with pytest.raises(ValueError, match=r"maxpool_bprop: x_shape must be 4 integers"):
        on_numpy.maxpool_bprop(np.zeros((2, 3, 4, 4), np.float32), np.zeros((2, 3, 4, 4), np.uint8), bad, 2, 2)


def test_empty_filter_gives_the_bias_or_zeros(on_numpy):
    """A 0x0 or 0xS filter (as numpy_ops): y is the bias, dx is zero, nothing is launched."""
    x, b = np.ones((2, 3, 5, 5), np.float32), np.arange(4, dtype=np.float32)
    for w_shape in ((4, 3, 0, 0), (4, 3, 0, 3)):
        w = np.zeros(w_shape, np.float32)
        y = on_numpy.conv2d_fprop(x, w, b, 1, 1)
        np.testing.assert_array_equal(y, np.broadcast_to(b.reshape(1, 4, 1, 1), y.shape))
        P, Q = y.shape[2:]
        dx = on_numpy.conv2d_dgrad(np.ones((2, 4, P, Q), np.float32), w, x.shape, 1, 1)
        np.testing.assert_array_equal(dx, 0)


def test_sgd_refuses_aliased_buffers(on_numpy):
    p, g, d = (np.zeros(8, np.float32) for _ in range(3))
    with pytest.raises(ValueError, match="sgd_momentum: velocity overlaps params in memory"):
        on_numpy.sgd_momentum(p, p, g, d, momentum=0.9, lr=0.1)
    v = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="sgd_momentum: grad overlaps velocity in memory"):
        on_numpy.sgd_momentum(p, v, v, d, momentum=0.9, lr=0.1)


def test_set_conv_algo_refuses_an_unknown_algorithm(on_numpy):
    on_numpy.set_conv_algo("autotune")
    assert on_numpy.conv_algo == "autotune"
    with pytest.raises(ValueError, match=r"unknown conv algorithm 'fast'; expected one of heuristic, autotune"):
        on_numpy.set_conv_algo("fast")
    assert on_numpy.conv_algo == "autotune"


def test_a_conv_algo_set_by_hand_to_a_bad_value_is_named_at_the_launch():
    by_hand = plan()
    by_hand.conv_algo = "Autotune"
    with pytest.raises(ValueError, match=r"conv2d_fprop: planner.conv_algo = 'Autotune'; expected one of"):
        by_hand.run_conv("conv2d_fprop", (1,) * 9, 8, lambda tile: None)


def test_autotune_tiles_leave_out_one_stage_duplicates_below_sm80():
    """Below sm_80 conv2d.cu forces one stage: 64x64/s1 is then 64x64, and is timed once."""
    every = list(planner.AUTOTUNE_TILES)
    assert planner.autotune_tiles(90) == every and planner.autotune_tiles(None) == every
    assert planner.autotune_tiles(80) == every  # sm_80 has cp.async: the one-stage tiles are other kernels
    one_stage = [t for t in every if tiles.tile_shape(t)[5] == 1]
    assert one_stage and planner.autotune_tiles(75) == [t for t in every if t not in one_stage]
    assert set(tiles.CONV_TILES) <= set(planner.autotune_tiles(75))


@pytest.mark.parametrize("autotune", [False, True])
def test_compile_kernels_builds_every_tile_it_will_launch(autotune):
    """Start-up compiles each .cu once, conv2d.cu once per production tile, and with autotune once per
    tile autotune times on the device (here sm_90: all of them)."""
    built = []

    class Modules:
        def compile(self, filename, defines):
            built.append((filename, defines))

    ops = CupyBackend.on_host(np, Modules(), HostDevice(capability=90))
    done = ops.compile_kernels(autotune=autotune)
    launched = planner.AUTOTUNE_TILES if autotune else tiles.CONV_TILES
    conv = [defines for name, defines in built if name == "conv2d.cu"]
    assert conv == [tiles.tile_defines(t) for t in launched] and len(set(conv)) == len(launched)
    others = sorted(name for name, _ in built if name != "conv2d.cu")
    assert others == sorted(set(runtime.KERNEL_FILES.values()) - {"conv2d.cu"}) and len(done) == len(built)


def test_a_timing_that_fell_behind_its_spin_is_taken_again_behind_a_longer_spin():
    """autotune's GPU timing with a stand-in CUDA: when the start event has already passed by the time the
    last call is queued (the host was slower than the spin), the sample is retaken behind a spin twice as
    long, at most AUTOTUNE_LATE_RETRIES times; the sample kept is the last one, per call."""
    from types import SimpleNamespace

    spins, done_answers, made = [], iter([True, True, False]), []

    class Event:
        def __init__(self):
            self.id = len(made)  # start, stop of the first sample: 0, 1; of the third: 4, 5
            made.append(self)

        def record(self):
            pass

        @property
        def done(self):
            return next(done_answers)

        def synchronize(self):
            pass

    fake = SimpleNamespace(cuda=SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: 10.0 * b.id + a.id))
    gpu = CudaDevice(fake, spin_kernel=lambda grid, block, args: spins.append(int(args[0])))
    calls = []
    ms = gpu.time_calls(lambda: calls.append(1), planner.AUTOTUNE_CALLS, launch_ms=0.3)
    assert ms == 54.0 / planner.AUTOTUNE_CALLS and len(calls) == 3 * planner.AUTOTUNE_CALLS  # the third's events
    first = int(1e6 * max(device.AUTOTUNE_SPIN_MS, 2 * 0.3 * planner.AUTOTUNE_CALLS))  # 2.4 ms: the launches'
    assert spins == [first, 2 * first, 4 * first]
    done_answers = iter([True] * 9)
    spins.clear()
    gpu.time_calls(lambda: None, planner.AUTOTUNE_CALLS, launch_ms=0.0)  # late every time: gives up after the retries
    assert len(spins) == 1 + device.AUTOTUNE_LATE_RETRIES and spins[0] == int(1e6 * device.AUTOTUNE_SPIN_MS)


# ----------------------------------------------------------------------------------------------
# the newer ops: padded pooling, batch norm, residual blocks, dropout, LRN, sgd's nesterov and lr_scale


def _a(*shape):
    return np.zeros(shape, np.float32)


# (op, arguments): each breaks a check of mpiasgd.ops.contract that both backends share (pool geometry,
# bools, reals, ints, dropout's key, LRN's parameters), so both must refuse it with the same message
SHARED_REFUSALS = [
    ("maxpool_fprop", lambda: (_a(1, 1, 8, 8), 3, 2, 2)),                    # pad > kernel//2
    ("maxpool_fprop", lambda: (_a(1, 1, 8, 8), 3, 2, 1, 1)),                 # ceil_mode not a bool
    ("maxpool_fprop", lambda: (_a(1, 1, 2, 8), 5, 1, 1)),                    # kernel larger than the padded input
    ("maxpool_bprop", lambda: (_a(1, 1, 3, 3), np.zeros((1, 1, 3, 3), np.uint8), (1, 1, 5, 5), 2, 2, 2)),
    ("avgpool_fprop", lambda: (_a(1, 1, 8, 8), 3, 2, 1, False, 1)),          # count_include_pad not a bool
    ("avgpool_bprop", lambda: (_a(1, 1, 4, 4), (1, 1, 8, 8), 3, 2, 3)),
    ("batchnorm_stats", lambda: (_a(2, 3, 4, 4), _a(3), _a(3), 1.5)),        # momentum outside [0, 1]
    ("batchnorm_fprop", lambda: (_a(2, 3, 4, 4), _a(3), _a(3), _a(3), _a(3), 0.0)),  # eps <= 0
    ("batchnorm_bprop", lambda: (_a(2, 3, 4, 4), _a(2, 3, 4, 4), _a(3), _a(3), _a(3), float("nan"), _a(3), _a(3))),
    ("batchnorm_bprop", lambda: (_a(2, 3, 4, 4), _a(2, 3, 4, 4), _a(3), _a(3), _a(3), 1e-5, _a(3), _a(3), 1)),
    ("subsample_pad_fprop", lambda: (_a(1, 2, 4, 4), 0, 1, 1)),             # stride < 1
    ("subsample_pad_fprop", lambda: (_a(1, 2, 4, 4), 2, -1, 1)),            # a pad < 0
    ("subsample_pad_bprop", lambda: (_a(1, 4, 2, 2), (1, 2, 4, 4), 2, 1, True)),
    ("dropout_fprop", lambda: (_a(10), 1.0, 0, 0, 0)),                       # p outside [0, 1)
    ("dropout_fprop", lambda: (_a(10), -0.1, 0, 0, 0)),
    ("dropout_fprop", lambda: (_a(10), 0.5, -1, 0, 0)),                      # seed < 0
    ("dropout_fprop", lambda: (_a(10), 0.5, 2**64, 0, 0)),                   # seed >= 2^64
    ("dropout_bprop", lambda: (_a(10), 0.5, 0, True, 0)),                    # minibatch a bool
    ("dropout_bprop", lambda: (_a(10), 0.5, 0, 0, 2**32)),                   # layer >= 2^32
    ("lrn_fprop", lambda: (_a(1, 4, 2, 2), 0, 1e-4, 0.75, 2.0)),             # size < 1
    ("lrn_fprop", lambda: (_a(1, 4, 2, 2), 5, -1e-4, 0.75, 2.0)),            # alpha < 0
    ("lrn_fprop", lambda: (_a(1, 4, 2, 2), 5, 1e-4, float("inf"), 2.0)),     # beta not finite
    ("lrn_fprop", lambda: (_a(1, 4, 2, 2), 5, 1e-4, 0.75, 0.0)),             # k <= 0
    ("lrn_bprop", lambda: (_a(1, 4, 2, 2), _a(1, 4, 2, 2), _a(1, 4, 2, 2), _a(1, 4, 2, 2), 5, float("nan"), 0.75)),
    ("sgd_momentum", lambda: (_a(4), _a(4), _a(4), _a(4), 0.9, 0.1, 1)),    # nesterov not a bool
]


@pytest.mark.parametrize("op, make", SHARED_REFUSALS, ids=[f"{op}-{i}" for i, (op, _) in enumerate(SHARED_REFUSALS)])
def test_newer_ops_refuse_as_the_numpy_backend_does(on_numpy, op, make):
    """A check the contract shares: the CUDA backend raises numpy's ValueError, message for message, and
    launches nothing (`on_numpy` fails the test at a launch)."""
    with pytest.raises(ValueError) as host:
        getattr(get_backend("numpy"), op)(*make())
    with pytest.raises(ValueError) as device:
        getattr(on_numpy, op)(*make())
    assert str(device.value) == str(host.value) and str(host.value).startswith(f"{op}: ")


@pytest.mark.parametrize("call, match", [
    (lambda ops: ops.batchnorm_stats(_a(2, 3, 4, 4), _a(3)), "batchnorm_stats: running_mean and running_var must be"),
    (lambda ops: ops.batchnorm_stats(_a(0, 3, 4, 4)), r"batchnorm_stats: x must have N\*H\*W > 0"),
    (lambda ops: ops.batchnorm_bprop(_a(2, 3, 4, 4), _a(2, 3, 4, 4), _a(3), _a(3), _a(3), 1e-5, _a(2), _a(3)),
     r"batchnorm_bprop: dgamma must have shape \(3,\)"),
    (lambda ops: ops.batchnorm_fprop(_a(2, 3, 4, 4), _a(3), _a(3), _a(3), _a(3), 1e-50),
     "batchnorm_fprop: eps = 1e-50 rounds to 0 in float32"),
    (lambda ops: ops.global_avgpool_fprop(_a(2, 3, 0, 4)), r"global_avgpool_fprop: x must have H\*W > 0"),
    (lambda ops: ops.global_avgpool_bprop(_a(2, 3), (2, 3, 4, 0)), r"global_avgpool_bprop: x_shape must have H\*W > 0"),
    (lambda ops: ops.global_avgpool_bprop(_a(2, 4), (2, 3, 4, 4)),
     r"global_avgpool_bprop: dy must have shape \(2, 3\)"),
    (lambda ops: ops.add(_a(2, 3), _a(3, 2)), r"add: b must have shape \(2, 3\)"),
    (lambda ops: ops.subsample_pad_bprop(_a(1, 4, 2, 2), (1, 2, 4, 4), 2, 1, 2),
     r"subsample_pad_bprop: dy must have shape \(1, 5, 2, 2\) for x_shape \(1, 2, 4, 4\)"),
    (lambda ops: ops.lrn_bprop(_a(1, 4, 2, 2), _a(1, 4, 2, 2), _a(1, 4, 2, 3), _a(1, 4, 2, 2), 5, 1e-4, 0.75),
     r"lrn_bprop: y must have shape \(1, 4, 2, 2\)"),
    (lambda ops: ops.maxpool_bprop(_a(1, 1, 4, 4), np.zeros((1, 1, 4, 4), np.int32), (1, 1, 8, 8), 3, 2, 1),
     "maxpool_bprop: argmax must have dtype uint8"),
    (lambda ops: ops.dropout_fprop(np.zeros(4), 0.5, 0, 0, 0), "dropout_fprop: x must have dtype float32"),
])
def test_newer_ops_refuse_bad_arrays_before_launch(on_numpy, call, match):
    with pytest.raises(ValueError, match=match):
        call(on_numpy)


def test_written_arrays_must_not_overlap_an_input(on_numpy):
    """Arrays the kernels write in place (batch-norm running statistics and gradients, add's out, sgd's
    params and velocity) are refused when they may overlap another argument: one thread's write would
    change what another reads."""
    x, buf = _a(2, 3, 4, 4), _a(6)
    with pytest.raises(ValueError, match="batchnorm_stats: running_mean overlaps running_var in memory"):
        on_numpy.batchnorm_stats(x, buf[:3], buf[:3])
    with pytest.raises(ValueError, match="batchnorm_bprop: dgamma overlaps dbeta in memory"):
        on_numpy.batchnorm_bprop(x, x, _a(3), _a(3), _a(3), 1e-5, buf[:3], buf[:3])
    gamma = _a(3)
    with pytest.raises(ValueError, match="batchnorm_bprop: dbeta overlaps gamma in memory"):
        on_numpy.batchnorm_bprop(x, x, gamma, _a(3), _a(3), 1e-5, _a(3), gamma)
    shifted = _a(9)
    with pytest.raises(ValueError, match="add: out overlaps a in memory without being it"):
        on_numpy.add(shifted[:8], _a(8), out=shifted[1:])  # out[i] = a[i + 1] + ... would read a written a
    with pytest.raises(ValueError, match="add: out overlaps b in memory without being it"):
        tail = shifted[1:]
        on_numpy.add(tail, shifted[:8], out=tail)  # in place into a, b a shifted view of it
    p = _a(8)
    with pytest.raises(ValueError, match="sgd_momentum: lr_scale overlaps params in memory"):
        on_numpy.sgd_momentum(p, _a(8), _a(8), _a(8), 0.9, 0.1, lr_scale=p)


@pytest.mark.parametrize("call, match", [
    (lambda ops: ops.global_avgpool_fprop(FakeArray((1, 1, 50000, 50000))), r"H\*W = 2500000000 does not fit"),
    (lambda ops: ops.batchnorm_stats(FakeArray((1, 1, 50000, 50000))), r"H\*W = 2500000000 does not fit"),
    (lambda ops: ops.batchnorm_fprop(FakeArray((1, 1, 50000, 50000)), *(FakeArray((1,)) for _ in range(4)), 1e-5),
     r"H\*W = 2500000000 does not fit"),
    (lambda ops: ops.lrn_fprop(FakeArray((1, 1, 50000, 50000)), 5, 1e-4, 0.75, 2.0), r"H\*W = 2500000000 does not"),
    (lambda ops: ops.avgpool_fprop(FakeArray((1, 1, 50000, 50000)), 2, 2), r"H\*W = 2500000000 does not fit"),
    (lambda ops: ops.subsample_pad_fprop(FakeArray((1, 1, 50000, 50000)), 1, 0, 0), r"H\*W = 2500000000 does not"),
    (lambda ops: ops.dropout_fprop(FakeArray((2**35,)), 0.5, 0, 0, 0), "more than the 2\\^34"),
    (lambda ops: ops.maxpool_fprop(FakeArray((1, 1, 1, 2**31 - 3)), 3, 1, 1), r"W \+ 2\*pad \+ kernel = .* does"),
])
def test_newer_ops_refuse_extents_their_ints_cannot_hold(fake_gpu, launches, call, match):
    """The kernels index within a plane with ints: an extent past 2^31 - 1 is refused before launch."""
    with pytest.raises(ValueError, match=match):
        call(fake_gpu)
    assert launches == []


@pytest.mark.parametrize("threads", [0, 48, 1024])
def test_batchnorm_block_must_fit_the_shared_array(fake_gpu, launches, threads):
    """batchnorm.cu's trees need a power-of-two block no larger than its static array (BATCHNORM_THREADS_MAX)."""
    ops = fake_gpu.configured(batchnorm_threads=threads)
    with pytest.raises(ValueError, match="batchnorm_stats: batchnorm_threads must be a power of two up to 512"):
        ops.batchnorm_stats(FakeArray((2, 3, 4, 4)))
    assert launches == []


def test_launch_takes_numpy_uint32_for_unsigned_int(fake_gpu, launches):
    """dropout's key words are C unsigned ints: np.uint32 passes check_args, a Python int does not."""
    x = FakeArray((4,))
    fake_gpu.launch("dropout", (1, 1, 1), (32, 1, 1), (x, x, np.int64(4), np.uint32(7), np.float32(2.0),
                                                        *(np.uint32(0) for _ in range(5))))
    with pytest.raises(TypeError, match="no C type"):
        fake_gpu.launch("dropout", (1, 1, 1), (32, 1, 1), (x, x, np.int64(4), 7, np.float32(2.0),
                                                            *(np.uint32(0) for _ in range(5))))
    assert len(launches) == 1
