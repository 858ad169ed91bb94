"""CuPy backend of `mpiasgd.ops`: the hand-written CUDA C kernels of `kernels/*.cu` on one GPU, NCHW float32.

Same public names and signatures as `mpiasgd.ops.numpy_ops` (the ground truth these kernels are
tested against), plus `sgd_momentum` (the optimizer step as one kernel, for workers doing local steps):

    ops = get_backend("cupy")
    y = ops.conv2d_fprop(x, w, b, stride, pad)        # x, w, b cupy float32, C-contiguous

Each `.cu` file is compiled once per process into a `cupy.RawModule` (NVRTC; the compiled-kernel
cache on disk is CuPy's), on first use of one of its kernels. Every wrapper

  * checks each array: on this backend (a cupy.ndarray, never a host array whose pointer the
    kernel would misread), dtype float32 (argmax/labels: their integer type), C-contiguous (a view
    or transpose is refused, not silently misread: pass `ascontiguousarray` yourself), shape;
  * casts every scalar to its C type: `np.int32` for int, `np.int64` for long long, `np.float32`
    for float, after checking it fits;
  * computes grid, block and shared memory in plain view and checks them against the CUDA limits
    (grid x <= 2^31-1, y and z <= 65,535, block <= 1,024 threads) before the launch.

The checks and the launch arithmetic are pure functions of shapes/attributes (`check_array`,
`c_int32`, `check_launch`, `conv_launch`, `gemm_split`, ...), tested without a GPU; with `xp` set to
numpy and `get_kernel` to the CUDA-on-CPU harness, the whole backend runs on the CPU (tests do).

Each conv pass runs with the tile `conv_algo` picks: "heuristic" (`conv_tile`, the default) or
"autotune" (timed once per pass and geometry, `set_conv_algo`, `conv_plans`).

Importing this module needs neither cupy nor a GPU; `mpiasgd.ops.get_backend("cupy")` does.
Float sums run in a different order than NumPy's BLAS: results agree to float32 rounding, and
every reduction (wgrad over the batch, bias_grad, maxpool_bprop) has a fixed order without
atomics, so each result is bit-reproducible run to run on one device (with conv_algo "autotune",
for a given choice of tiles, which is itself a measurement).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpiasgd.ops.numpy_ops import shape4  # (shared checks of shape arguments)

try:  # importable without cupy: get_backend("cupy") reports its absence
    import cupy
except ImportError:  # pragma: no cover - depends on the installation
    cupy = None

name = "cupy"
xp = cupy  # array module of this backend (tests substitute numpy to run the kernels on the CPU)
ndarray = cupy.ndarray if cupy is not None else None

# ----------------------------------------------------------------------------------------------
# launch limits and tile constants (must match the #defines in kernels/*.cu)

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
MAX_BLOCK_THREADS = 1024
MAX_STATIC_SHARED = 48 * 1024  # bytes

CONV_BM, CONV_BN, CONV_BK = 64, 64, 16  # kernels/conv2d.cu defaults (-DCONV_BM/-DCONV_BN select a variant)
CONV_STAGES = 3  # conv2d.cu's default shared-memory stages: a cp.async pipeline on sm_80+ (1 below sm_80)
# (BM, BN) tile variants that conv2d.cu is compiled for, 256 threads each (16x16 or 8x32 threads
# owning 4x4 outputs): 64x64, and 32x128 for GEMMs of at most 32 rows (the cifar10 model's 32-channel
# layers), which a 64-row tile would half idle
CONV_TILES = ((64, 64), (32, 128))
# Trial tiles (BM, BN, TM, TN, BK[, STAGES]): larger register blocks (8x4, 4x8 outputs per thread, 256
# threads) with a K-slab of 8 (16 would spill), a higher FFMA share of the main loop (bench/sass_mix.py)
# but fewer, wider blocks; the production tiles with one shared-memory stage (register prefetch, two
# barriers per slab: the main loop before the cp.async pipeline, and what sm_75 runs, where these two
# are the production tiles again); and 32x96 (192 threads, K-slab 24) for narrow GEMMs such as cifar10's
# conv1 wgrad (32 x 75 columns: 78 % of a 96-wide tile is used, 59 % of a 128-wide one). Never chosen by
# conv_tile (the heuristic); conv_algo "autotune" times them with the production tiles and may keep one;
# bench/kernels.py --tiles and tests/gpu force them, so that a GPU run says whether they should replace
# or join a production tile.
CONV_TRIAL_TILES = ((64, 128, 8, 4, 8), (32, 256, 4, 8, 8), (64, 64, 4, 4, 16, 1), (32, 128, 4, 4, 16, 1),
                    (32, 96, 4, 4, 24))
conv_tile_override: tuple[int, ...] | None = None  # a tile forced on every conv launch (bench, tests)
conv_split_override: int | None = None  # split-K ranges forced on every conv GEMM (bench, tests)
CONV_TARGET_BLOCKS = 512  # split-K aims at about this many blocks when the device's wave is unknown
CONV_MIN_CHUNK = 256  # ... and each range of the reduction keeps at least this many terms
CONV_MAX_CHUNK = 2**30  # ... and at most this many: the kernels count a block's terms in an int
CONV_BLOCKS_PER_SM = 2  # conv GEMM blocks resident per SM: __launch_bounds__(CONV_THREADS, 2) in conv2d.cu
REDUCE_THREADS = 256  # bias_grad, softmax_xent: power of two <= 256 (BIAS/SOFTMAX_THREADS_MAX)
ELEMENTWISE_THREADS = 256
ELEMENTWISE_MAX_BLOCKS = 65535  # grid-stride loops cover the rest
SPLIT_REDUCE_OUTS, SPLIT_REDUCE_THREADS = 32, 256  # conv2d_split_reduce: 32 outputs x 8 lanes over the splits
CONV_TAB_INTS = 4  # ints per tap table entry: {off, bit, a_off, 0} (conv2d.cu, CONV_TABLE)
CONV_TAB_PAD = 128  # zero entries after the last: >= 2 * CONV_BK (static_assert in conv2d.cu)
CONV_TAB_MAX_TAPS = 32  # the table path takes filters of R*S <= 32 taps (a column's taps are one 32-bit mask)
CONV_TAB_MAX_ROWS = 2**22  # ... and reductions of <= 4M terms (a 64 MiB table); longer ones test bounds per load
CONV_TAB_CACHE = 64  # tables kept per process (one per layer geometry and pass) ...
CONV_TAB_CACHE_BYTES = 256 * 2**20  # ... holding at most this many bytes of device memory in all

_KERNEL_FILES = {  # kernel -> file under kernels/
    "conv2d_fprop": "conv2d.cu", "conv2d_dgrad": "conv2d.cu", "conv2d_fprop_partial": "conv2d.cu",
    "conv2d_dgrad_partial": "conv2d.cu", "conv2d_wgrad_partial": "conv2d.cu", "conv2d_split_reduce": "conv2d.cu",
    "bias_grad": "bias.cu", "relu_fprop": "relu.cu", "relu_bprop": "relu.cu",
    "maxpool_fprop_u8": "pool.cu", "maxpool_fprop_i32": "pool.cu", "maxpool_bprop_u8": "pool.cu",
    "maxpool_bprop_i32": "pool.cu", "softmax_xent": "softmax_xent.cu", "sgd_momentum": "sgd.cu",
}


# ----------------------------------------------------------------------------------------------
# kernel loading (once per process per file)


def kernel_dir() -> Path:
    """Folder holding the .cu files: $MPIASGD_KERNELS when set (it must exist and hold conv2d.cu), else
    `mpiasgd/kernels` (installed package), else `kernels/` of the source checkout. Raises
    FileNotFoundError naming the folder(s) tried."""
    here = Path(__file__).resolve()
    if os.environ.get("MPIASGD_KERNELS"):
        d = Path(os.environ["MPIASGD_KERNELS"])
        if not (d / "conv2d.cu").is_file():
            raise FileNotFoundError(f"$MPIASGD_KERNELS = {str(d)!r} holds no conv2d.cu (it must be a folder with "
                                    f"every kernel source: {', '.join(sorted(set(_KERNEL_FILES.values())))})")
        return d
    candidates = [here.parents[1] / "kernels", here.parents[2] / "kernels"]
    for d in candidates:
        if (d / "conv2d.cu").is_file():
            return d
    raise FileNotFoundError(f"CUDA kernel sources not found in any of {[str(d) for d in candidates]}")


def check_kernel_sources() -> Path:
    """The kernel folder, after checking it holds every .cu file the backend launches from.
    Raises FileNotFoundError naming the folder and the missing files (at start-up, not mid-run)."""
    d = kernel_dir()
    missing = sorted(f for f in set(_KERNEL_FILES.values()) if not (d / f).is_file())
    if missing:
        raise FileNotFoundError(f"kernel folder {str(d)!r} lacks {', '.join(missing)}")
    return d


def compile_kernels(autotune: bool = False) -> list[str]:
    """Compile every kernel module this backend launches (each .cu; conv2d.cu once per tile: the
    production tiles, and with `autotune` every tile autotune times on this device), on the current
    device, so that a source that does not compile stops start-up with NVRTC's log instead of a
    worker mid-run; later launches reuse the modules (and CuPy's on-disk cache). Returns the modules
    compiled, as "file [defines]". Raises RuntimeError naming the file and carrying the log."""
    done = []
    conv_tiles = autotune_tiles(_compute_capability()) if autotune else CONV_TILES
    for filename in sorted(set(_KERNEL_FILES.values())):
        for tile in (conv_tiles if filename == "conv2d.cu" else [None]):
            defines = tile_defines(tile)
            try:
                _module(filename, defines).compile()
            except Exception as e:  # cupy's CompileException carries NVRTC's log
                raise RuntimeError(f"kernel {filename} {' '.join(defines)} does not compile: {e}") from e
            done.append(f"{filename} {' '.join(defines)}".strip())
    return done


NVRTC_OPTIONS = ("--std=c++14",)  # CuPy adds -ftz=true, -arch=sm_XX of the device, --device-as-default-execution-space


def tile_shape(tile: tuple[int, ...]) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, TM, TN, BK, STAGES) of a tile given as (BM, BN) (register block 4x4, K-slab CONV_BK,
    CONV_STAGES shared-memory stages), (BM, BN, TM, TN, BK) or in full."""
    if len(tile) not in (2, 5, 6):
        raise ValueError(f"conv tile {tile!r}: expected (BM, BN), (BM, BN, TM, TN, BK) or (BM, BN, TM, TN, BK, STAGES)")
    defaults = (4, 4, CONV_BK, CONV_STAGES)  # TM, TN, BK, STAGES
    return tuple(int(v) for v in (*tile, *defaults[len(tile) - 2:]))


def tile_macros(tile: tuple[int, ...] | None) -> dict[str, int]:
    """The conv2d.cu macros that select `tile` (see `tile_shape`): CONV_BM, CONV_BN, and CONV_TM,
    CONV_TN, CONV_BK only where the register block or K-slab differ from the defaults, CONV_STAGES only
    where the stages do; {} for the other files (tile None)."""
    if tile is None:
        return {}
    bm, bn, tm, tn, bk, stages = tile_shape(tile)
    extra = {} if (tm, tn, bk) == (4, 4, CONV_BK) else {"CONV_TM": tm, "CONV_TN": tn, "CONV_BK": bk}
    if stages != CONV_STAGES:
        extra["CONV_STAGES"] = stages
    return {"CONV_BM": bm, "CONV_BN": bn, **extra}


def tile_defines(tile: tuple[int, ...] | None) -> tuple[str, ...]:
    """`tile_macros` as -D options for the compiler; () for the other files (tile None)."""
    return tuple(f"-D{name}={value}" for name, value in tile_macros(tile).items())


def tile_name(tile: tuple[int, ...]) -> str:
    """'64x64', for a non-default register block or K-slab '64x128/8x4k8', for non-default stages
    '64x64/s1' or '64x128/8x4k8/s1'."""
    bm, bn, tm, tn, bk, stages = tile_shape(tile)
    macros = tile_macros(tile)
    name = f"{bm}x{bn}/{tm}x{tn}k{bk}" if "CONV_TM" in macros else f"{bm}x{bn}"
    return name + (f"/s{stages}" if "CONV_STAGES" in macros else "")


@functools.cache
def _module(filename: str, defines: tuple[str, ...] = ()):
    """The cupy.RawModule of one .cu file (and tile variant), compiled on first use (once per process)."""
    if cupy is None:
        raise RuntimeError("the cupy backend needs cupy (pip install cupy-cuda12x)")
    source = (kernel_dir() / filename).read_text()
    return cupy.RawModule(code=source, options=NVRTC_OPTIONS + defines)


NULL = np.uint64(0)  # a NULL pointer kernel argument for CuPy: an 8-byte zero value


class NullSafeKernel:
    """A cupy.RawKernel called as `(grid, block, args, shared_mem=0)` whose None arguments become NULL
    pointers. CuPy itself hands the driver no argument value for None (a NULL pointer *to* the value),
    and the kernel then sees a garbage pointer, 0xffffffff in the report (cupy issue 9046), where an
    optional bias or tap table must read as NULL; an 8-byte zero (`NULL`) is a NULL pointer."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        self.fn(grid, block, tuple(NULL if a is None else a for a in args), shared_mem=shared_mem)


@functools.cache
def _cupy_kernel(kernel: str, tile: tuple[int, ...] | None = None) -> NullSafeKernel:
    """The cupy.RawKernel of `kernel` (and conv tile), looked up once per process."""
    return NullSafeKernel(_module(_KERNEL_FILES[kernel], tile_defines(tile)).get_function(kernel))


get_kernel = _cupy_kernel  # (kernel name, conv tile or None) -> callable (grid, block, args, shared_mem=0)


# ----------------------------------------------------------------------------------------------
# argument checks and C scalar casts (pure: numpy arrays or any object with the same attributes)


def check_array(op: str, arg: str, a, shape: tuple[int, ...] | None = None, ndim: int | None = None,
                dtype=np.float32):
    """Return `a` if it is a C-contiguous array of this backend with `dtype` and `shape`/`ndim`.

    Raises ValueError naming op and argument otherwise; a non-contiguous view (transpose, slice) is
    refused because the kernels index it as dense row-major memory.
    """
    nd_type = xp.ndarray if xp is not None else None
    if nd_type is None or not isinstance(a, nd_type):
        raise ValueError(f"{op}: {arg} must be a {getattr(nd_type, '__module__', 'cupy')}.ndarray on this "
                         f"backend, got {type(a).__module__}.{type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise ValueError(f"{op}: {arg} must have dtype {np.dtype(dtype)}, got {a.dtype}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{op}: {arg} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{op}: {arg} must have {ndim} dimensions, got shape {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{op}: {arg} must be C-contiguous (a view or transpose would be misread by the "
                         f"kernel; pass an ascontiguousarray copy), got strides {a.strides} for shape "
                         f"{tuple(a.shape)}")
    return a


def _c_int(op: str, arg: str, value, ctype):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{op}: {arg} must be an integer, got {value!r}")
    info = np.iinfo(ctype)
    if not info.min <= int(value) <= info.max:
        raise ValueError(f"{op}: {arg} = {value} does not fit a {info.bits}-bit int")
    return ctype(value)


def c_int32(op: str, arg: str, value) -> np.int32:
    """`value` as np.int32 (a C int); ValueError if it is not an integer or does not fit."""
    return _c_int(op, arg, value, np.int32)


def c_int64(op: str, arg: str, value) -> np.int64:
    """`value` as np.int64 (a C long long); ValueError if it is not an integer or does not fit."""
    return _c_int(op, arg, value, np.int64)


def c_float32(op: str, arg: str, value) -> np.float32:
    """`value` as np.float32 (a C float); ValueError if it is not a finite real number."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{op}: {arg} must be a real number, got {value!r}")
    f = np.float32(value) if abs(float(value)) <= float(np.finfo(np.float32).max) else np.float32(np.inf)
    if not np.isfinite(f):
        raise ValueError(f"{op}: {arg} = {value} is not a finite float32")
    return f


def check_launch(kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int = 0) -> None:
    """ValueError unless grid/block/shared memory are within the CUDA limits (checked before launch)."""
    gx, gy, gz = grid
    bx, by, bz = block
    if min(gx, gy, gz) < 1 or gx > MAX_GRID_X or gy > MAX_GRID_YZ or gz > MAX_GRID_YZ:
        raise ValueError(f"{kernel}: grid {grid} outside the limits (1..{MAX_GRID_X}, 1..{MAX_GRID_YZ}, "
                         f"1..{MAX_GRID_YZ})")
    if min(bx, by, bz) < 1 or bx * by * bz > MAX_BLOCK_THREADS or bz > 64:
        raise ValueError(f"{kernel}: block {block} outside the limits (<= {MAX_BLOCK_THREADS} threads, z <= 64)")
    if not 0 <= shared_mem <= MAX_STATIC_SHARED:
        raise ValueError(f"{kernel}: shared memory {shared_mem} B outside 0..{MAX_STATIC_SHARED}")


def _launch(kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple,
            shared_mem: int = 0, tile: tuple[int, ...] | None = None) -> None:
    check_launch(kernel, grid, block, shared_mem)
    for a in args:  # every scalar already has its C type; a Python int/float here is a bug
        if not (a is None or isinstance(a, (np.int32, np.int64, np.float32)) or hasattr(a, "dtype")):
            raise TypeError(f"{kernel}: argument {a!r} has no C type (use np.int32/np.int64/np.float32)")
    get_kernel(kernel, tile)(grid, block, args, shared_mem=shared_mem)


# ----------------------------------------------------------------------------------------------
# launch arithmetic (pure)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def conv_tile(M: int) -> tuple[int, ...]:
    """(BM, BN) tile of a conv GEMM with M rows: 32x128 when M <= 32, else 64x64 (`CONV_TILES`);
    `conv_tile_override` when set."""
    if conv_tile_override is not None:
        return conv_tile_override
    return (32, 128) if M <= 32 else (64, 64)


def conv_threads(tile: tuple[int, ...]) -> int:
    """Threads per block of `tile`: one per TM x TN register block (`tile_shape`)."""
    bm, bn, tm, tn, _, _ = tile_shape(tile)
    return (bm // tm) * (bn // tn)


def conv_launch(M: int, NG: int, splits: int = 1,
                tile: tuple[int, ...] | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Grid and block of an implicit-GEMM conv kernel: C (M, NG) in BM x BN tiles (`tile`, default
    `conv_tile(M)`), `splits` along z."""
    tile = tile or conv_tile(M)
    bm, bn = tile[:2]
    grid = (_cdiv(NG, bn), _cdiv(M, bm), splits)  # (column tiles, row tiles, batch splits)
    block = (conv_threads(tile), 1, 1)
    return grid, block


@functools.cache
def _sm_count(device: int) -> int:
    return int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])


def device_wave() -> int | None:
    """Conv GEMM blocks the current GPU runs at once: its SMs x CONV_BLOCKS_PER_SM (264 on an H200).
    None when the backend runs on no GPU (no cupy, no device, or the CPU harness's numpy arrays)."""
    if not _on_gpu():
        return None
    try:
        return _sm_count(cupy.cuda.runtime.getDevice()) * CONV_BLOCKS_PER_SM
    except Exception:  # no driver or no device: the backend cannot launch anyway, and says so there
        return None


@functools.cache
def _fewest_waves(tiles: int, most: int, wave: int) -> int:
    """The s in 1..most minimising ceil(tiles * s / wave) / s, the smallest among equals. Past
    s = 2 * wave the ratio only approaches tiles / wave (reached at s = wave / tiles), so the search
    stops there."""
    return min(range(1, min(most, 2 * wave) + 1), key=lambda s: (_cdiv(tiles * s, wave) / s, s))


def gemm_split(M: int, NG: int, KR: int, tile: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(splits, chunk) of a conv GEMM's reduction: KR cut into `splits` ranges of `chunk` terms (split-K).

    chunk is a multiple of the K-slab CONV_BK; splits = ceil(KR / chunk), so no range is empty, and
    every range keeps >= CONV_MIN_CHUNK terms; at most 65,535 ranges, and at most CONV_MAX_CHUNK (2^30)
    terms each (the kernels count them in an int). The output (M, NG) in `tile`s (default
    `conv_tile(M)`) often gives too few blocks to fill the GPU: wgrad's (K, C*R*S) is a few dozen
    tiles, fprop and dgrad of small late layers fewer than one per SM. With s ranges the GEMM
    takes about ceil(tiles * s / wave) waves of blocks each 1/s as long, so s minimises
    ceil(tiles * s / wave) / s (the fewest ranges among equals: each costs workspace traffic), wave =
    `device_wave()`; an output of two waves or more is not split. Without a known wave the grid
    aims at about CONV_TARGET_BLOCKS blocks. `conv_split_override` forces a number of ranges
    (benchmarks, tests), still at least one K-slab each.
    """
    bm, bn = (tile or conv_tile(M))[:2]
    tiles = _cdiv(NG, bn) * _cdiv(M, bm)
    most = max(1, min(KR // CONV_MIN_CHUNK, MAX_GRID_YZ))
    wave = device_wave()
    if conv_split_override is not None:
        want = conv_split_override
    elif wave is None:
        want = min(_cdiv(CONV_TARGET_BLOCKS, tiles), most)
    elif tiles >= 2 * wave:
        want = 1
    else:
        want = _fewest_waves(tiles, most, wave)
    want = max(1, min(want, _cdiv(KR, CONV_BK), MAX_GRID_YZ), _cdiv(KR, CONV_MAX_CHUNK))
    chunk = _cdiv(_cdiv(KR, want), CONV_BK) * CONV_BK
    return _cdiv(KR, chunk), chunk


# ----------------------------------------------------------------------------------------------
# conv algorithm: the tile each conv pass runs with (heuristic rules, or timed once per geometry)

CONV_ALGOS = ("heuristic", "autotune")
conv_algo = "heuristic"  # set with set_conv_algo (the worker: from --conv-algo)
AUTOTUNE_TILES = (*CONV_TILES, *CONV_TRIAL_TILES)  # the tiles autotune times, each with its gemm_split ranges
AUTOTUNE_REPEATS, AUTOTUNE_CALLS = 3, 4  # a candidate's time: median of 3 rounds' timings of 4 calls each
AUTOTUNE_MARGIN = 0.03  # another tile replaces the heuristic's only when it is faster by more than this


@dataclass(frozen=True)
class ConvPlan:
    """How a conv pass of one geometry runs under `conv_algo` "autotune" (`_autotune`): the tile chosen,
    and the median ms per call every candidate tile took (`autotune_tiles` on this device, and the
    heuristic's tile), in the order timed."""

    op: str
    geometry: tuple[int, ...]  # N, C, H, W, K, R, S, stride, pad
    tile: tuple[int, ...]
    times: tuple[tuple[tuple[int, ...], float], ...]
    refused: tuple[tuple[tuple[int, ...], str], ...] = ()  # tiles whose launch was refused, and why

    def describe(self) -> str:
        """e.g. 'conv2d_wgrad N128 C3 32x32 K32 5x5 stride 1 pad 2: 32x96/4x4k24 (32x128 0.0213 ms, ...)'."""
        N, C, H, W, K, R, S, stride, pad = self.geometry
        timed = ", ".join([*(f"{tile_name(t)} {ms:.4g} ms" for t, ms in self.times),
                           *(f"{tile_name(t)} refused" for t, _ in self.refused)])
        return (f"{self.op} N{N} C{C} {H}x{W} K{K} {R}x{S} stride {stride} pad {pad}: {tile_name(self.tile)} "
                f"({timed})")


_conv_plans: dict[tuple, ConvPlan] = {}  # (array module, device, op, geometry) -> plan


def set_conv_algo(algo: str) -> None:
    """How conv passes choose their tile (`CONV_ALGOS`):

      "heuristic"  `conv_tile` (fixed rules: 32x128 for GEMMs of <= 32 rows, else 64x64); results are
                   bit-reproducible run to run.
      "autotune"   the first call of each pass and geometry (the batch size N included; per
                   device) times every tile of `autotune_tiles` on its own inputs, each with the
                   split-K ranges `gemm_split` gives it, and keeps the fastest for the process
                   (`conv_plans`), as cudnn.benchmark does; the heuristic's tile stays unless another
                   is faster by more than AUTOTUNE_MARGIN (`_autotune`). That call costs the timing
                   runs (and, without `compile_kernels(autotune=True)` at start-up, compiling every
                   tile variant). Where another tile wins, its split-K ranges can differ from the
                   heuristic's, and results then differ from the heuristic's in float32 rounding;
                   the choice itself is a measurement and can differ between runs and devices.

    Raises ValueError naming the valid algorithms.
    """
    global conv_algo
    if algo not in CONV_ALGOS:
        raise ValueError(f"unknown conv algorithm {algo!r}; expected one of {', '.join(CONV_ALGOS)}")
    conv_algo = algo


def conv_plans() -> list[ConvPlan]:
    """The plans autotune chose in this process so far, in the order they were made."""
    return list(_conv_plans.values())


def autotune_tiles(compute_capability: int | None) -> list[tuple[int, ...]]:
    """`AUTOTUNE_TILES` as distinct kernels on a device of `compute_capability` (e.g. 90; None: any):
    below sm_80 conv2d.cu forces one shared-memory stage, so a one-stage tile that differs from
    another only in its stages is the same kernel there and is left out."""
    tiles, seen = [], set()
    for tile in AUTOTUNE_TILES:
        shape = tile_shape(tile)
        runs_as = shape[:5] + ((1,) if compute_capability is not None and compute_capability < 80 else shape[5:])
        if runs_as not in seen:
            seen.add(runs_as)
            tiles.append(tile)
    return tiles


def _on_gpu() -> bool:
    """Whether this backend runs on a GPU (not on the CPU harness's numpy arrays)."""
    return cupy is not None and xp is cupy


def _device_key() -> tuple:
    """(array module, device index): what a plan or tap table is valid for (the CPU harness: numpy, None)."""
    return id(xp), cupy.cuda.runtime.getDevice() if _on_gpu() else None


def _compute_capability() -> int | None:
    """The current device's compute capability as an int (90 for sm_90); None on the CPU harness."""
    return int(cupy.cuda.Device().compute_capability) if _on_gpu() else None


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


@functools.cache
def _spin_kernel():
    return cupy.RawKernel(SPIN_SOURCE, "autotune_spin", options=NVRTC_OPTIONS)


def _time_calls(fn: Callable[[], None], launch_ms: float) -> float:
    """Ms per call of `fn` over AUTOTUNE_CALLS back-to-back calls: on a GPU, CUDA events on the current
    stream recorded behind a spin kernel that outlasts the host's launches (`SPIN_SOURCE`; `launch_ms`:
    the host time one call took), so the interval holds GPU time only; a sample whose start event had
    already passed when the last call was queued (the host was slower than the spin: a GC pause,
    another process) may hold idle time, and is taken again behind a spin twice as long (at most
    AUTOTUNE_LATE_RETRIES times). On the CPU harness: the host clock."""
    if _on_gpu():
        spin_ms = max(AUTOTUNE_SPIN_MS, 2 * launch_ms * AUTOTUNE_CALLS)
        for _ in range(1 + AUTOTUNE_LATE_RETRIES):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            _spin_kernel()((1,), (1,), (np.uint64(int(spin_ms * 1e6)),))
            start.record()
            for _ in range(AUTOTUNE_CALLS):
                fn()
            late = start.done  # the spin ended before the last launch: the GPU may have waited for the host
            stop.record()
            stop.synchronize()
            if not late:
                break
            spin_ms *= 2
        return cupy.cuda.get_elapsed_time(start, stop) / AUTOTUNE_CALLS
    t0 = time.perf_counter()
    for _ in range(AUTOTUNE_CALLS):
        fn()
    return (time.perf_counter() - t0) * 1e3 / AUTOTUNE_CALLS


def _autotune(op: str, geometry: tuple[int, ...], M: int, run: Callable[[tuple[int, ...]], None]) -> ConvPlan:
    """The plan of one conv pass: `run(tile)` timed for every tile of `autotune_tiles` (and `conv_tile`'s).

    Each tile runs twice untimed (the first call loads, or compiles, its module; the second gives the
    host's launch time), then AUTOTUNE_REPEATS rounds time every tile once per round (`_time_calls`),
    so that a drift (clocks ramping up, another process on the GPU) spreads over all of them; a
    tile's time is its median. The fastest wins unless the heuristic's tile is within AUTOTUNE_MARGIN
    of it: then that one is kept (the same results as without autotune, when nothing is gained). A
    tile whose launch is refused (ValueError: a grid past the device limits, ...) is left out and
    listed in the plan; when every tile is refused, the heuristic's error is raised.
    """
    rule = conv_tile(M)
    tiles = autotune_tiles(_compute_capability())
    tiles = tiles if rule in tiles else [rule, *tiles]
    launch_ms, refused = {}, []
    for tile in tiles:
        try:
            run(tile)
        except ValueError as e:
            refused.append((tile, str(e)))
            continue
        t0 = time.perf_counter()
        run(tile)
        launch_ms[tile] = (time.perf_counter() - t0) * 1e3
    if not launch_ms:
        run(rule)  # raises the heuristic tile's error
    samples = {tile: [] for tile in launch_ms}
    for _ in range(AUTOTUNE_REPEATS):
        for tile in samples:
            samples[tile].append(_time_calls(lambda tile=tile: run(tile), launch_ms[tile]))
    times = tuple((tile, statistics.median(ms)) for tile, ms in samples.items())
    best, best_ms = min(times, key=lambda item: item[1])  # the first of equals: AUTOTUNE_TILES' order
    if rule in samples and dict(times)[rule] * (1 - AUTOTUNE_MARGIN) <= best_ms:
        best = rule
    return ConvPlan(op, tuple(int(v) for v in geometry), best, times, tuple(refused))


def _conv_run(op: str, geometry: tuple[int, ...], M: int, run: Callable[[tuple[int, ...]], None]) -> None:
    """Run a conv pass, `run(tile)`, with the tile `conv_algo` picks for a GEMM of M rows: `conv_tile`
    ("heuristic", or whenever `conv_tile_override` or `conv_split_override` forces a launch), else
    the plan of (device, op, geometry), made on first use (`_autotune`). The last run is always with
    the chosen tile, so its output is the pass's result."""
    if conv_algo == "heuristic" or conv_tile_override is not None or conv_split_override is not None:
        run(conv_tile(M))
        return
    if conv_algo != "autotune":
        raise ValueError(f"{op}: cupy_ops.conv_algo = {conv_algo!r}; expected one of {', '.join(CONV_ALGOS)} "
                         "(use set_conv_algo)")
    key = (*_device_key(), op, *geometry)
    plan = _conv_plans.get(key)
    if plan is None:
        plan = _conv_plans[key] = _autotune(op, geometry, M, run)
    run(plan.tile)


def elementwise_launch(n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Grid-stride launch over n elements: 256 threads, at most 65,535 blocks (>= 1 even for n = 0)."""
    blocks = max(1, min(_cdiv(n, ELEMENTWISE_THREADS), ELEMENTWISE_MAX_BLOCKS))
    return (blocks, 1, 1), (ELEMENTWISE_THREADS, 1, 1)


def conv_geometry(op: str, x_shape, w_shape, stride: int, pad: int) -> tuple[int, int]:
    """Output size (P, Q); ValueError on a channel mismatch, stride < 1, pad < 0, a filter larger than the
    padded input, or an extent the kernels' 32-bit indices within one image or filter cannot hold
    (C*H*W, K*P*Q, K*C*R*S, the padded plane (H + 2*pad)*(W + 2*pad), ...: up to 2^31 - 1 elements)."""
    c_int32(op, "stride", stride)
    c_int32(op, "pad", pad)
    if stride < 1 or pad < 0:
        raise ValueError(f"{op}: stride must be >= 1 and pad >= 0, got stride {stride}, pad {pad}")
    N, C, H, W = (int(v) for v in x_shape)
    K, Cw, R, S = (int(v) for v in w_shape)
    if Cw != C:
        raise ValueError(f"{op}: w must have shape (K, C={C}, R, S) to match x channels, "
                         f"got w {tuple(w_shape)} for x {tuple(x_shape)}")
    if H + 2 * pad < R or W + 2 * pad < S:
        raise ValueError(f"{op}: filter {R}x{S} larger than padded input {H + 2 * pad}x{W + 2 * pad}")
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    # per-image extents C*H*W and K*P*Q bound H*W and P*Q too (C, K >= 1 wherever a kernel is launched)
    for what, v in (("H + 2*pad", H + 2 * pad), ("W + 2*pad", W + 2 * pad), ("C*R*S", C * R * S),
                    ("K*R*S", K * R * S), ("N", N), ("K", K),
                    ("(P-1)*stride", (P - 1) * stride), ("(Q-1)*stride", (Q - 1) * stride),
                    ("C*H*W", C * H * W), ("K*P*Q", K * P * Q), ("K*C*R*S", K * C * R * S),
                    ("(H + 2*pad)*(W + 2*pad)", (H + 2 * pad) * (W + 2 * pad))):
        c_int32(op, what, v)
    return P, Q


_tap_tables: dict[tuple, object] = {}  # (array module, device, pass, geometry) -> table, oldest first


def conv_tap_table(op: str, N: int, C: int, H: int, W: int, K: int, R: int, S: int, P: int, Q: int, stride: int,
                   pad: int):
    """The tap table of a conv pass (kernels/conv2d.cu, CONV_TABLE), or None where the kernel tests
    bounds per load instead: an int32 array on this backend's device, (KR + CONV_TAB_PAD, 4), whose row
    for reduction index kk is {off, bits, a_off, 0}, then CONV_TAB_PAD zero rows. Bit r*S + s stands
    for filter tap (r, s):

        conv2d_fprop, kk = (c, r, s):  off = (c*H + r - pad)*W + s - pad, bits = the tap's bit, a_off = kk
        conv2d_dgrad, kk = (k, r, s):  off = (k*P - r)*Q - s, bits = the tap's bit, a_off = k*C*R*S + r*S + s
        conv2d_wgrad, kk = (n, p, q):  off = n*C*H*W + (p*st - pad)*W + q*st - pad, bits = the taps reading
                                       inside the image at output pixel (p, q) (off = 0 where there are
                                       none), a_off = n*K*P*Q + p*Q + q

    (off: the B element's offset from a column's origin, or for wgrad the row's origin in x, to which
    the column adds c*H*W + r*W + s; a_off: the A element's offset from row 0). None for a filter of
    more than CONV_TAB_MAX_TAPS taps, dgrad with stride > 1, a reduction of more than
    CONV_TAB_MAX_ROWS terms, or (wgrad) N*C*H*W or N*K*P*Q past int32, or any offset past int32
    (`conv_geometry`'s checks rule that out for the rest). Built on the host once per geometry and
    device and kept: the last CONV_TAB_CACHE tables, at most CONV_TAB_CACHE_BYTES in all.
    """
    KR = {"conv2d_fprop": C * R * S, "conv2d_dgrad": K * R * S, "conv2d_wgrad": N * P * Q}[op]
    if (R * S > CONV_TAB_MAX_TAPS or KR > CONV_TAB_MAX_ROWS or (op == "conv2d_dgrad" and stride != 1)
            or (op == "conv2d_wgrad" and max(N * C * H * W, N * K * P * Q) > 2**31 - 1)):
        return None
    key = (*_device_key(), op, N if op == "conv2d_wgrad" else 0, C, H, W, K, R, S, P, Q, stride, pad)
    table = _tap_tables.pop(key, None)
    if table is None:
        rows = _tap_rows(op, KR, C, H, W, K, R, S, P, Q, stride, pad)
        if rows[:, [0, 2]].min() < -2**31 or rows[:, [0, 2]].max() > 2**31 - 1:
            return None  # (not reached for geometries conv_geometry accepts; kept as the kernels' guard)
        table = xp.asarray(rows.astype(np.int32))
        while _tap_tables and (len(_tap_tables) >= CONV_TAB_CACHE or
                               sum(t.nbytes for t in _tap_tables.values()) + table.nbytes > CONV_TAB_CACHE_BYTES):
            _tap_tables.pop(next(iter(_tap_tables)))
    _tap_tables[key] = table  # most recently used last
    return table


def _tap_rows(op: str, KR: int, C: int, H: int, W: int, K: int, R: int, S: int, P: int, Q: int, stride: int,
              pad: int) -> np.ndarray:
    """The rows of `conv_tap_table` as int64 (KR + CONV_TAB_PAD, 4), bits as their int32 bit pattern."""
    kk = np.arange(KR, dtype=np.int64)
    rows = np.zeros((KR + CONV_TAB_PAD, CONV_TAB_INTS), dtype=np.int64)
    if op == "conv2d_wgrad":
        n, pq = kk // (P * Q), kk % (P * Q)
        h0, w0 = np.arange(P, dtype=np.int64) * stride - pad, np.arange(Q, dtype=np.int64) * stride - pad
        # the taps inside the image at each output pixel: bit r*S + s where 0 <= h0 + r < H, 0 <= w0 + s < W
        s_bits = sum(((w0 + s >= 0) & (w0 + s < W)).astype(np.int64) << s for s in range(S))  # (Q,)
        r_in = [(h0 + r >= 0) & (h0 + r < H) for r in range(R)]  # (P,) each
        bits = sum(np.where(r_in[r][:, None], s_bits[None, :] << (r * S), 0) for r in range(R)).reshape(P * Q)
        rows[:KR, 1] = bits[pq]
        rows[:KR, 0] = np.where(rows[:KR, 1] != 0, n * (C * H * W) + h0[pq // Q] * W + w0[pq % Q], 0)
        rows[:KR, 2] = n * (K * P * Q) + pq
    else:
        hi, rs = kk // (R * S), kk % (R * S)
        r, s = rs // S, rs % S
        if op == "conv2d_fprop":
            rows[:KR, 0] = (hi * H + r - pad) * W + s - pad
            rows[:KR, 2] = kk
        else:
            rows[:KR, 0] = (hi * P - r) * Q - s
            rows[:KR, 2] = hi * (C * R * S) + rs
        rows[:KR, 1] = np.int64(1) << rs
    rows[:, 1] = rows[:, 1].astype(np.uint32).view(np.int32)  # bit 31 as a negative int
    return rows


# ----------------------------------------------------------------------------------------------
# array helpers


def zeros(shape: int | tuple[int, ...], dtype=np.float32):
    """Zero-filled C-contiguous device array (default float32)."""
    return xp.zeros(shape, dtype=dtype)


def empty(shape: int | tuple[int, ...], dtype=np.float32):
    """Uninitialized C-contiguous device array (default float32)."""
    return xp.empty(shape, dtype=dtype)


def asarray(x, dtype=np.float32):
    """`x` (host or device) as a C-contiguous device array of `dtype` (no copy when it already is one)."""
    return xp.ascontiguousarray(xp.asarray(x, dtype=dtype))


def to_numpy(x) -> np.ndarray:
    """Host copy of a device array (synchronizes with the stream that produced it)."""
    return xp.asnumpy(x) if hasattr(xp, "asnumpy") else np.asarray(x)


def may_share_memory(a, b) -> bool:
    """Cheap (bounds-only) test whether two device arrays may overlap in memory."""
    return bool(xp.may_share_memory(a, b))


class Workspace:
    """Device scratch arrays of one layer, kept between minibatches and reused while shapes match
    (the wgrad split buffer). The kernels build no im2col matrix, so no columns are kept."""

    def __init__(self) -> None:
        self._arrays: dict = {}
        self.cols_src = None  # interface parity with numpy_ops.Workspace; unused here

    def get(self, key: str, shape: tuple[int, ...], dtype):
        """The scratch array named `key`, reallocated (uninitialized) if shape or dtype changed."""
        a = self._arrays.get(key)
        if a is None or tuple(a.shape) != tuple(shape) or a.dtype != dtype:
            a = xp.empty(shape, dtype=dtype)
            self._arrays[key] = a
        return a

    @property
    def nbytes(self) -> int:
        """Bytes held by all scratch arrays."""
        return sum(int(a.nbytes) for a in self._arrays.values())


def _out(op: str, out, shape: tuple[int, ...]):
    if out is None:
        return xp.empty(shape, dtype=np.float32)
    return check_array(op, "out", out, shape=shape)


# ----------------------------------------------------------------------------------------------
# convolution


def conv2d_fprop(x, w, b, stride: int, pad: int, ws: Workspace | None = None):
    """Forward convolution, NCHW float32: x (N, C, H, W), w (K, C, R, S), b (K,) or None -> y (N, K, P, Q).

    See `numpy_ops.conv2d_fprop`. Kernel `conv2d_fprop` (bias fused into the epilogue; relu=0), or,
    when the output gives too few blocks (`gemm_split`), split-K: `conv2d_fprop_partial` into a
    workspace (kept in `ws`), then `conv2d_split_reduce` adds the splits and the bias. The tile:
    `conv_algo` (the first call of a geometry under "autotune" runs the pass once per timing).
    Raises ValueError on a bad dtype/contiguity/shape or geometry.
    """
    op = "conv2d_fprop"
    check_array(op, "x", x, ndim=4)
    check_array(op, "w", w, ndim=4)
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    if b is not None:
        check_array(op, "b", b, shape=(K,))
    P, Q = conv_geometry(op, x.shape, w.shape, stride, pad)
    y = xp.empty((N, K, P, Q), dtype=np.float32)
    if y.size == 0 or C * R * S == 0:  # an empty batch: nothing to launch; an empty filter: y = b
        y[...] = 0 if b is None else b.reshape(1, K, 1, 1)
        return y
    geometry = _conv_ints(op, N, C, H, W, K, R, S, P, Q, stride, pad)
    tab = conv_tap_table(op, N, C, H, W, K, R, S, P, Q, stride, pad)

    def run(tile: tuple[int, ...]) -> None:
        splits, chunk = gemm_split(K, N * P * Q, C * R * S, tile)  # GEMM (K) x (N*P*Q), reduction C*R*S
        grid, block = conv_launch(M=K, NG=N * P * Q, splits=splits, tile=tile)
        if splits == 1:
            _launch(op, grid, block, (x, w, b, y, *geometry, np.int32(0), tab), tile=tile)
        else:
            part = _split_workspace(ws, "fprop.split", (splits, K, N * P * Q))
            _launch("conv2d_fprop_partial", grid, block,
                    (x, w, part, *geometry, c_int64(op, "chunk", chunk), tab), tile=tile)
            _split_reduce(op, part, b, y, splits, N, K, P * Q, tile)

    _conv_run(op, (N, C, H, W, K, R, S, stride, pad), K, run)
    return y


def _conv_ints(op: str, *values: int) -> tuple[np.int32, ...]:
    """N, C, H, W, K, R, S, P, Q, stride, pad as the kernels' int arguments."""
    names = ("N", "C", "H", "W", "K", "R", "S", "P", "Q", "stride", "pad")
    return tuple(c_int32(op, name, v) for name, v in zip(names, values, strict=True))


def _split_workspace(ws: Workspace | None, key: str, shape: tuple[int, int, int]):
    """The (splits, M, NG) split-K buffer: the layer's kept one, or a fresh one without a Workspace."""
    return xp.empty(shape, dtype=np.float32) if ws is None else ws.get(key, shape, np.float32)


def _split_reduce(op: str, part, bias, out, splits: int, N: int, M: int, L: int, tile: tuple[int, ...],
                  relu: int = 0) -> None:
    """out (N, M, L...) = the splits of `part` (splits, M, N*L) added in order (+ bias) (ReLU); launched
    from the module of the partial kernel's `tile` (conv2d.cu holds both: no third compilation)."""
    groups = _cdiv(N * M * L, SPLIT_REDUCE_OUTS)
    grid, block = (max(1, min(groups, ELEMENTWISE_MAX_BLOCKS)), 1, 1), (SPLIT_REDUCE_THREADS, 1, 1)
    _launch("conv2d_split_reduce", grid, block, (part, bias, out, c_int32(op, "splits", splits), c_int32(op, "N", N),
                                                 c_int32(op, "M", M), c_int64(op, "L", L), np.int32(relu)), tile=tile)


def conv2d_dgrad(dy, w, x_shape: tuple[int, int, int, int], stride: int, pad: int, ws: Workspace | None = None):
    """Input gradient: dy (N, K, P, Q), w (K, C, R, S), x_shape (N, C, H, W) -> dx (N, C, H, W) fresh.

    See `numpy_ops.conv2d_dgrad`. Kernel `conv2d_dgrad` (implicit GEMM (C) x (N*H*W), reduction K*R*S),
    or split-K as in `conv2d_fprop` (`conv2d_dgrad_partial`, `conv2d_split_reduce`).
    """
    op = "conv2d_dgrad"
    check_array(op, "dy", dy, ndim=4)
    check_array(op, "w", w, ndim=4)
    N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
    K, _, R, S = w.shape
    P, Q = conv_geometry(op, (N, C, H, W), w.shape, stride, pad)
    check_array(op, "dy", dy, shape=(N, K, P, Q))
    dx = xp.empty((N, C, H, W), dtype=np.float32)
    if dx.size == 0 or K * R * S == 0:  # an empty batch: nothing to launch; an empty filter: no gradient
        dx[...] = 0
        return dx
    geometry = _conv_ints(op, N, C, H, W, K, R, S, P, Q, stride, pad)
    tab = conv_tap_table(op, N, C, H, W, K, R, S, P, Q, stride, pad)

    def run(tile: tuple[int, ...]) -> None:
        splits, chunk = gemm_split(C, N * H * W, K * R * S, tile)  # GEMM (C) x (N*H*W), reduction K*R*S
        grid, block = conv_launch(M=C, NG=N * H * W, splits=splits, tile=tile)
        if splits == 1:
            _launch(op, grid, block, (dy, w, dx, *geometry, tab), tile=tile)
        else:
            part = _split_workspace(ws, "dgrad.split", (splits, C, N * H * W))
            _launch("conv2d_dgrad_partial", grid, block,
                    (dy, w, part, *geometry, c_int64(op, "chunk", chunk), tab), tile=tile)
            _split_reduce(op, part, None, dx, splits, N, C, H * W, tile)

    _conv_run(op, (N, C, H, W, K, R, S, stride, pad), C, run)
    return dx


def conv2d_wgrad(dy, x, w_shape: tuple[int, int, int, int], stride: int, pad: int, out=None,
                 ws: Workspace | None = None):
    """Filter gradient: dy (N, K, P, Q), x (N, C, H, W) -> dw (K, C, R, S), into `out` when given.

    No atomics: `conv2d_wgrad_partial` sums `splits` ranges of the N*P*Q reduction (`gemm_split`)
    into a (splits, K, C*R*S) workspace, `conv2d_split_reduce` adds the ranges in order; with one
    range the partial kernel writes dw directly.
    """
    op = "conv2d_wgrad"
    check_array(op, "x", x, ndim=4)
    check_array(op, "dy", dy, ndim=4)
    K, C, R, S = shape4(op, "w_shape", w_shape, "(K, C, R, S)")
    N, _, H, W = x.shape
    P, Q = conv_geometry(op, x.shape, (K, C, R, S), stride, pad)
    check_array(op, "dy", dy, shape=(N, K, P, Q))
    dw = _out(op, out, (K, C, R, S))
    if dw.size == 0 or N * P * Q == 0:  # an empty batch (as numpy_ops): a zero gradient, nothing to launch
        dw[...] = 0
        return dw
    geometry = _conv_ints(op, N, C, H, W, K, R, S, P, Q, stride, pad)
    tab = conv_tap_table(op, N, C, H, W, K, R, S, P, Q, stride, pad)

    def run(tile: tuple[int, ...]) -> None:
        splits, chunk = gemm_split(K, C * R * S, N * P * Q, tile)  # GEMM (K) x (C*R*S), reduction N*P*Q
        part = dw if splits == 1 else _split_workspace(ws, "wgrad.split", (splits, K, C * R * S))
        grid, block = conv_launch(M=K, NG=C * R * S, splits=splits, tile=tile)
        _launch("conv2d_wgrad_partial", grid, block,
                (dy, x, part, *geometry, c_int64(op, "chunk", chunk), tab), tile=tile)
        if splits > 1:
            _split_reduce(op, part, None, dw, splits, 1, K, C * R * S, tile)

    _conv_run(op, (N, C, H, W, K, R, S, stride, pad), K, run)
    return dw


def bias_grad(dy, out=None):
    """db (K,) = dy summed over all axes but 1; dy (N, K, P, Q) or (N, K). Kernel `bias_grad`, one block per k."""
    op = "bias_grad"
    if getattr(dy, "ndim", None) not in (2, 4):
        raise ValueError(f"{op}: dy must be (N, K, P, Q) or (N, K), got {getattr(dy, 'shape', type(dy).__name__)}")
    check_array(op, "dy", dy)
    N, K = dy.shape[:2]
    L = int(np.prod(dy.shape[2:], dtype=np.int64))
    db = _out(op, out, (K,))
    grid, block = (max(K, 1), 1, 1), (REDUCE_THREADS, 1, 1)  # one block per output channel
    if K:
        _launch(op, grid, block, (dy, db, c_int32(op, "N", N), c_int32(op, "K", K), c_int64(op, "L", L)))
    return db


# ----------------------------------------------------------------------------------------------
# elementwise and pooling


def relu_fprop(x):
    """y = max(x, 0), fresh, any shape; NaN stays NaN, as numpy_ops. Kernel `relu_fprop`."""
    check_array("relu_fprop", "x", x)
    y = xp.empty(x.shape, dtype=np.float32)
    grid, block = elementwise_launch(x.size)
    _launch("relu_fprop", grid, block, (x, y, c_int64("relu_fprop", "n", x.size)))
    return y


def relu_bprop(dy, y):
    """dx = dy * (y > 0), as numpy_ops (NaN, not 0, where y <= 0 and dy is NaN or +-inf); y the forward
    output. Kernel `relu_bprop`."""
    check_array("relu_bprop", "dy", dy)
    check_array("relu_bprop", "y", y, shape=dy.shape)
    dx = xp.empty(dy.shape, dtype=np.float32)
    grid, block = elementwise_launch(dy.size)
    _launch("relu_bprop", grid, block, (dy, y, dx, c_int64("relu_bprop", "n", dy.size)))
    return dx


def _pool_geometry(op: str, x_shape, kernel: int, stride: int) -> tuple[int, int]:
    c_int32(op, "kernel", kernel)
    c_int32(op, "stride", stride)
    if kernel < 1 or stride < 1:
        raise ValueError(f"{op}: kernel and stride must be >= 1, got {kernel}, {stride}")
    H, W = x_shape[2:]
    if H < kernel or W < kernel:
        raise ValueError(f"{op}: kernel {kernel} larger than input {H}x{W}")
    P, Q = (H - kernel) // stride + 1, (W - kernel) // stride + 1
    c_int32(op, "H*W", H * W)  # the kernels index within one (n, c) plane with an int
    c_int32(op, "kernel*kernel", kernel * kernel)
    return P, Q


def _argmax_dtype(kernel: int):
    return np.uint8 if kernel * kernel <= 256 else np.int32  # as numpy_ops


def maxpool_fprop(x, kernel: int, stride: int):
    """Max pooling: x (N, C, H, W) -> (y (N, C, P, Q), argmax (N, C, P, Q) uint8/int32). See numpy_ops."""
    op = "maxpool_fprop"
    check_array(op, "x", x, ndim=4)
    N, C, H, W = x.shape
    P, Q = _pool_geometry(op, x.shape, kernel, stride)
    adt = _argmax_dtype(kernel)
    y = xp.empty((N, C, P, Q), dtype=np.float32)
    argmax = xp.empty((N, C, P, Q), dtype=adt)
    grid, block = elementwise_launch(y.size)  # one thread per output
    kname = "maxpool_fprop_u8" if adt == np.uint8 else "maxpool_fprop_i32"
    i32 = functools.partial(c_int32, op)
    _launch(kname, grid, block, (x, y, argmax, c_int64(op, "N*C", N * C), i32("H", H), i32("W", W), i32("P", P),
                                 i32("Q", Q), i32("kernel", kernel), i32("stride", stride)))
    return y, argmax


def maxpool_bprop(dy, argmax, x_shape: tuple[int, int, int, int], kernel: int, stride: int):
    """Gradient of `maxpool_fprop`: dx (N, C, H, W), fresh; overlapping windows sum (gather, no atomics)."""
    op = "maxpool_bprop"
    N, C, H, W = shape4(op, "x_shape", x_shape, "(N, C, H, W)")
    P, Q = _pool_geometry(op, (N, C, H, W), kernel, stride)
    adt = _argmax_dtype(kernel)
    check_array(op, "dy", dy, shape=(N, C, P, Q))
    check_array(op, "argmax", argmax, shape=(N, C, P, Q), dtype=adt)
    dx = xp.empty((N, C, H, W), dtype=np.float32)
    grid, block = elementwise_launch(dx.size)  # one thread per input element
    kname = "maxpool_bprop_u8" if adt == np.uint8 else "maxpool_bprop_i32"
    i32 = functools.partial(c_int32, op)
    _launch(kname, grid, block, (dy, argmax, dx, c_int64(op, "N*C", N * C), i32("H", H), i32("W", W),
                                 i32("P", P), i32("Q", Q), i32("kernel", kernel), i32("stride", stride)))
    return dx


# ----------------------------------------------------------------------------------------------
# fully connected (cuBLAS through matmul)


def linear_fprop(x, w, b):
    """y (N, O) = x (N, I) @ w.T + b; w (O, I), b (O,)."""
    op = "linear_fprop"
    check_array(op, "x", x, ndim=2)
    check_array(op, "w", w, shape=(w.shape[0], x.shape[1]) if getattr(w, "ndim", 0) == 2 else None, ndim=2)
    check_array(op, "b", b, shape=(w.shape[0],))
    y = xp.matmul(x, w.T)  # (N, O)
    y += b
    return y


def linear_dgrad(dy, w):
    """dx (N, I) = dy (N, O) @ w (O, I)."""
    op = "linear_dgrad"
    check_array(op, "dy", dy, ndim=2)
    check_array(op, "w", w, ndim=2)
    if w.shape[0] != dy.shape[1]:
        raise ValueError(f"{op}: w must have shape ({dy.shape[1]}, I), got {tuple(w.shape)}")
    return xp.matmul(dy, w)


def linear_wgrad(dy, x, out=None):
    """dw (O, I) = dy.T (O, N) @ x (N, I), written into `out` when given (overwritten) and returned."""
    op = "linear_wgrad"
    check_array(op, "x", x, ndim=2)
    check_array(op, "dy", dy, ndim=2)
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: dy must have shape ({x.shape[0]}, O), got {tuple(dy.shape)}")
    dw = _out(op, out, (dy.shape[1], x.shape[1]))
    xp.matmul(dy.T, x, out=dw)
    return dw


# ----------------------------------------------------------------------------------------------
# loss and optimizer


def softmax_xent(logits, labels) -> tuple[float, object, int]:
    """Softmax cross-entropy, mean over the minibatch: (loss, dlogits (N, K), correct). See numpy_ops.

    One kernel computes dlogits, per-row losses and hits; their sums are taken here (a device sync).
    labels: integer array (N,) on the device (or host), cast to int32. Raises ValueError on a label
    outside [0, K), naming it and its index.
    """
    op = "softmax_xent"
    check_array(op, "logits", logits, ndim=2)
    N, K = logits.shape
    if getattr(labels, "shape", None) != (N,) or np.dtype(labels.dtype).kind not in "iu":
        raise ValueError(f"{op}: labels must be an integer array of shape ({N},), got "
                         f"{getattr(labels, 'shape', type(labels).__name__)} {getattr(labels, 'dtype', '')}")
    labels = xp.asarray(labels)
    # out-of-range labels become -1 before the int32 cast (so that none wraps into range); the
    # kernel flags them and the check below runs on the host copy it needs anyway (no extra sync)
    labels32 = xp.ascontiguousarray(xp.where((labels < 0) | (labels >= K), -1, labels), dtype=np.int32)
    dlogits = xp.empty((N, K), dtype=np.float32)
    row_loss = xp.empty((N,), dtype=np.float32)
    row_correct = xp.empty((N,), dtype=np.int32)
    if N == 0:
        return 0.0, dlogits, 0
    grid, block = (N, 1, 1), (REDUCE_THREADS, 1, 1)  # one block per row
    _launch(op, grid, block, (logits, labels32, dlogits, row_loss, row_correct, c_int32(op, "N", N),
                              c_int32(op, "K", K), c_float32(op, "scale", 1.0 / N)))
    correct = to_numpy(row_correct)  # (N,) device sync point
    if correct.min() < 0:
        bad = int(np.flatnonzero(correct < 0)[0])
        raise ValueError(f"{op}: label {int(to_numpy(labels[bad:bad + 1])[0])} at index {bad} is outside [0, {K})")
    loss = float(to_numpy(row_loss).astype(np.float64).mean())
    return loss, dlogits, int(correct.sum())


def sgd_momentum(params, velocity, grad, decay, momentum: float, lr: float) -> None:
    """In place: velocity <- momentum*velocity + (grad + decay*params); params <- params - lr*velocity.

    All (P,) float32 C-contiguous; decay = weight_decay * mask (0 on biases), as `mpiasgd.optim.SGD`.
    One kernel (`sgd_momentum`), for workers taking local steps on the device.
    """
    op = "sgd_momentum"
    check_array(op, "params", params, ndim=1)
    for arg, a in (("velocity", velocity), ("grad", grad), ("decay", decay)):
        check_array(op, arg, a, shape=params.shape)
        if may_share_memory(params, a) or (arg != "velocity" and may_share_memory(velocity, a)):
            raise ValueError(f"{op}: {arg} overlaps {'params' if may_share_memory(params, a) else 'velocity'} "
                             "in memory (both are updated in place: pass separate buffers)")
    grid, block = elementwise_launch(params.size)
    _launch(op, grid, block, (params, velocity, grad, decay, c_float32(op, "momentum", momentum),
                              c_float32(op, "lr", lr), c_int64(op, "n", params.size)))
