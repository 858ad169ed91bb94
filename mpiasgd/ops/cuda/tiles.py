"""Conv tiles: what kernels/conv2d.cu is compiled for (BM x BN outputs per block, TM x TN per thread, a
K-slab BK, STAGES shared-memory stages), the -D options that select one, and its name.

A tile is given as (BM, BN) (register block 4x4, K-slab CONV_BK, CONV_STAGES stages), as
(BM, BN, TM, TN, BK) or in full (BM, BN, TM, TN, BK, STAGES). conv2d.cu is compiled once per tile
launched (`runtime.CudaKernels`); the planner picks one per conv pass (`planner.Planner`).
"""

from __future__ import annotations

from mpiasgd.ops.cuda.constants import CONV_BK, CONV_STAGES, CONV_TM, CONV_TN

# (BM, BN) tile variants that conv2d.cu is compiled for, 256 threads each (16x16 or 8x32 threads
# owning 4x4 outputs): 64x64, and 32x128 for GEMMs of at most 32 rows (the cifar10 model's 32-channel
# layers), which a 64-row tile would half idle. The heuristic (`Planner.conv_tile`) picks among these.
CONV_TILES = ((64, 64), (32, 128))
# Trial tiles (BM, BN, TM, TN, BK[, STAGES]): larger register blocks (8x4, 4x8 outputs per thread, 256
# threads) with a K-slab of 8 (16 would spill), a higher FFMA share of the main loop (dev/sass_mix.py)
# but fewer, wider blocks; the production tiles with one shared-memory stage (register prefetch, two
# barriers per slab: the main loop before the cp.async pipeline, and what sm_75 runs, where these two
# are the production tiles again); and 32x96 (192 threads, K-slab 24) for narrow GEMMs such as cifar10's
# conv1 wgrad (32 x 75 columns: 78 % of a 96-wide tile is used, 59 % of a 128-wide one). Never chosen by
# the heuristic; conv_algo "autotune" times them with the production tiles and may keep one (so they are
# product, not lab, data); bench/kernels.py --tiles and tests/gpu force them, so that a GPU run says
# whether they should replace or join a production tile.
CONV_TRIAL_TILES = ((64, 128, 8, 4, 8), (32, 256, 4, 8, 8), (64, 64, 4, 4, 16, 1), (32, 128, 4, 4, 16, 1),
                    (32, 96, 4, 4, 24))


def tile_shape(tile: tuple[int, ...]) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, TM, TN, BK, STAGES) of a tile given as (BM, BN) (register block 4x4, K-slab CONV_BK,
    CONV_STAGES shared-memory stages), (BM, BN, TM, TN, BK) or in full. Raises ValueError for another length."""
    if len(tile) not in (2, 5, 6):
        raise ValueError(f"conv tile {tile!r}: expected (BM, BN), (BM, BN, TM, TN, BK) or (BM, BN, TM, TN, BK, STAGES)")
    defaults = (CONV_TM, CONV_TN, CONV_BK, CONV_STAGES)  # TM, TN, BK, STAGES
    return tuple(int(v) for v in (*tile, *defaults[len(tile) - 2:]))


def tile_macros(tile: tuple[int, ...] | None) -> dict[str, int]:
    """The conv2d.cu macros that select `tile` (see `tile_shape`): CONV_BM, CONV_BN, and CONV_TM,
    CONV_TN, CONV_BK only where the register block or K-slab differ from the defaults, CONV_STAGES only
    where the stages do; {} for the other files (tile None)."""
    if tile is None:
        return {}
    bm, bn, tm, tn, bk, stages = tile_shape(tile)
    extra = {} if (tm, tn, bk) == (CONV_TM, CONV_TN, CONV_BK) else {"CONV_TM": tm, "CONV_TN": tn, "CONV_BK": bk}
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


def conv_threads(tile: tuple[int, ...]) -> int:
    """Threads per block of `tile`: one per TM x TN register block (`tile_shape`)."""
    bm, bn, tm, tn, _, _ = tile_shape(tile)
    return (bm // tm) * (bn // tn)
