"""How each conv pass runs: its tile, its split-K ranges, its tap table, and (conv_algo "autotune") the
plan timed once per geometry. All of it is the state of one `Planner` object, held by the backend.

    planner = Planner(cupy, CudaDevice(cupy))
    tile = planner.conv_tile(M)                               # the heuristic: 32x128 or 64x64
    splits, chunk = planner.gemm_split(M, NG, KR, tile)       # split-K of the reduction KR
    grid, block = planner.conv_launch(M, NG, splits, tile)
    planner.run_conv(op, geometry, M, run)                    # run(tile) with the tile conv_algo picks

A conv pass is an implicit GEMM C (M, NG) = A (M, KR) @ B (KR, NG) (kernels/conv2d.cu): fprop
(K) x (N*P*Q) reducing C*R*S, dgrad (C) x (N*H*W) reducing K*R*S, wgrad (K) x (C*R*S) reducing N*P*Q.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpiasgd.ops.cuda.constants import CONV_BK, CONV_TAB_INTS, CONV_TAB_MAX_TAPS, CONV_TAB_PAD
from mpiasgd.ops.cuda.device import Device, Grid
from mpiasgd.ops.cuda.tiles import CONV_TILES, CONV_TRIAL_TILES, conv_threads, tile_name, tile_shape

CONV_TARGET_BLOCKS = 512  # split-K aims at about this many blocks when the device's wave is unknown
CONV_MIN_CHUNK = 256  # ... and each range of the reduction keeps at least this many terms
CONV_MAX_CHUNK = 2**30  # ... and at most this many: the kernels count a block's terms in an int
CONV_TAB_MAX_ROWS = 2**22  # the table path takes reductions of <= 4M terms (a 64 MiB table); longer ones test bounds
CONV_TAB_CACHE = 64  # tables kept per planner (one per layer geometry and pass) ...
CONV_TAB_CACHE_BYTES = 256 * 2**20  # ... holding at most this many bytes of device memory in all

CONV_ALGOS = ("heuristic", "autotune")  # (mpiasgd.config repeats it: the config must not import the backend)
AUTOTUNE_TILES = (*CONV_TILES, *CONV_TRIAL_TILES)  # the tiles autotune times, each with its gemm_split ranges
AUTOTUNE_REPEATS, AUTOTUNE_CALLS = 3, 4  # a candidate's time: median of 3 rounds' timings of 4 calls each
AUTOTUNE_MARGIN = 0.03  # another tile replaces the heuristic's only when it is faster by more than this


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ConvPlan:
    """How a conv pass of one geometry runs under conv_algo "autotune" (`Planner.autotune`): the tile
    chosen, and the median ms per call every candidate tile took (`autotune_tiles` on this device, and the
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


def autotune_tiles(compute_capability: int | None, tiles: tuple[tuple[int, ...], ...] = AUTOTUNE_TILES
                   ) -> list[tuple[int, ...]]:
    """`tiles` (default AUTOTUNE_TILES) as distinct kernels on a device of `compute_capability` (e.g. 90;
    None: any): below sm_80 conv2d.cu forces one shared-memory stage, so a one-stage tile that differs
    from another only in its stages is the same kernel there and is left out."""
    kept, seen = [], set()
    for tile in tiles:
        shape = tile_shape(tile)
        runs_as = shape[:5] + ((1,) if compute_capability is not None and compute_capability < 80 else shape[5:])
        if runs_as not in seen:
            seen.add(runs_as)
            kept.append(tile)
    return kept


@functools.cache
def _fewest_waves(tiles: int, most: int, wave: int) -> int:
    """The s in 1..most minimising ceil(tiles * s / wave) / s, the smallest among equals. Past
    s = 2 * wave the ratio only approaches tiles / wave (reached at s = wave / tiles), so the search
    stops there. (A pure function: memoised.)"""
    return min(range(1, min(most, 2 * wave) + 1), key=lambda s: (_cdiv(tiles * s, wave) / s, s))


@dataclass(eq=False)
class Planner:
    """Tiles, split-K, tap tables and autotune plans of the conv passes on one device.

    The fields after `device` are knobs, each with the production default: the CPU harness, tests and
    bench/kernels.py --tiles set them on planners of their own (`CupyBackend.configured`). `plans` and
    `tap_tables` are the state a planner builds as passes run.
    """

    xp: Any  # array module the tap tables live in (cupy; numpy on the CPU harness)
    device: Device
    conv_algo: str = "heuristic"  # CONV_ALGOS; set_conv_algo (a worker: --conv-algo)
    tile_override: tuple[int, ...] | None = None  # a tile forced on every conv launch (bench, tests)
    split_override: int | None = None  # split-K ranges forced on every conv GEMM (bench, tests)
    target_blocks: int = CONV_TARGET_BLOCKS  # blocks split-K aims at when the device's wave is unknown
    min_chunk: int = CONV_MIN_CHUNK  # terms each split-K range keeps at least
    candidates: tuple[tuple[int, ...], ...] = AUTOTUNE_TILES  # the tiles autotune times
    repeats: int = AUTOTUNE_REPEATS  # autotune: rounds of timings per tile (the median is kept)
    calls: int = AUTOTUNE_CALLS  # autotune: calls per timing
    margin: float = AUTOTUNE_MARGIN  # autotune: how much faster (fraction) another tile must be
    tab_max_taps: int = CONV_TAB_MAX_TAPS  # filters of more taps test bounds per load (0: never a table)
    tab_cache: int = CONV_TAB_CACHE  # tap tables kept ...
    tab_cache_bytes: int = CONV_TAB_CACHE_BYTES  # ... and their bytes in all
    plans: dict[tuple, ConvPlan] = field(default_factory=dict, init=False, repr=False)  # autotune's, by key
    tap_tables: dict[tuple, Any] = field(default_factory=dict, init=False, repr=False)  # oldest first

    # ------------------------------------------------------------------------------------------
    # tiles and launch arithmetic

    def conv_tile(self, M: int) -> tuple[int, ...]:
        """(BM, BN) tile of a conv GEMM with M rows: 32x128 when M <= 32, else 64x64 (`CONV_TILES`);
        `tile_override` when set."""
        if self.tile_override is not None:
            return self.tile_override
        return (32, 128) if M <= 32 else (64, 64)

    def conv_launch(self, M: int, NG: int, splits: int = 1, tile: tuple[int, ...] | None = None) -> tuple[Grid, Grid]:
        """Grid and block of an implicit-GEMM conv kernel: C (M, NG) in BM x BN tiles (`tile`, default
        `conv_tile(M)`), `splits` along z."""
        tile = tile or self.conv_tile(M)
        bm, bn = tile[:2]
        grid = (_cdiv(NG, bn), _cdiv(M, bm), splits)  # (column tiles, row tiles, batch splits)
        block = (conv_threads(tile), 1, 1)
        return grid, block

    def gemm_split(self, M: int, NG: int, KR: int, tile: tuple[int, ...] | None = None) -> tuple[int, int]:
        """(splits, chunk) of a conv GEMM's reduction: KR cut into `splits` ranges of `chunk` terms (split-K).

        chunk is a multiple of the K-slab CONV_BK; splits = ceil(KR / chunk), so no range is empty, and
        every range keeps >= `min_chunk` terms; at most max_grid_yz (65,535) ranges, and at most
        CONV_MAX_CHUNK (2^30) terms each (the kernels count them in an int). The output (M, NG) in `tile`s
        (default `conv_tile(M)`) often gives too few blocks to fill the GPU: wgrad's (K, C*R*S) is a few
        dozen tiles, fprop and dgrad of small late layers fewer than one per SM. With s ranges the GEMM
        takes about ceil(tiles * s / wave) waves of blocks each 1/s as long, so s minimises
        ceil(tiles * s / wave) / s (the fewest ranges among equals: each costs workspace traffic), wave =
        the device's (`Device.wave`); an output of two waves or more is not split. Without a known wave
        the grid aims at about `target_blocks` blocks. `split_override` forces a number of ranges
        (benchmarks, tests), still at least one K-slab each.
        """
        max_yz = self.device.limits.max_grid_yz
        bm, bn = (tile or self.conv_tile(M))[:2]
        tiles = _cdiv(NG, bn) * _cdiv(M, bm)
        most = max(1, min(KR // self.min_chunk, max_yz))
        wave = self.device.wave()
        if self.split_override is not None:
            want = self.split_override
        elif wave is None:
            want = min(_cdiv(self.target_blocks, tiles), most)
        elif tiles >= 2 * wave:
            want = 1
        else:
            want = _fewest_waves(tiles, most, wave)
        want = max(1, min(want, _cdiv(KR, CONV_BK), max_yz), _cdiv(KR, CONV_MAX_CHUNK))
        chunk = _cdiv(_cdiv(KR, want), CONV_BK) * CONV_BK
        return _cdiv(KR, chunk), chunk

    # ------------------------------------------------------------------------------------------
    # conv algorithm: the tile each conv pass runs with (heuristic rules, or timed once per geometry)

    def set_conv_algo(self, algo: str) -> None:
        """How conv passes choose their tile (`CONV_ALGOS`):

          "heuristic"  `conv_tile` (fixed rules: 32x128 for GEMMs of <= 32 rows, else 64x64); results are
                       bit-reproducible run to run.
          "autotune"   the first call of each pass and geometry (the batch size N included; per
                       device) times every tile of `autotune_tiles` on its own inputs, each with the
                       split-K ranges `gemm_split` gives it, and keeps the fastest for the life of this
                       planner (`conv_plans`), as cudnn.benchmark does; the heuristic's tile stays unless
                       another is faster by more than `margin` (`autotune`). That call costs the timing
                       runs (and, without `compile_kernels(autotune=True)` at start-up, compiling every
                       tile variant). Where another tile wins, its split-K ranges can differ from the
                       heuristic's, and results then differ from the heuristic's in float32 rounding;
                       the choice itself is a measurement and can differ between runs and devices.

        Raises ValueError naming the valid algorithms.
        """
        if algo not in CONV_ALGOS:
            raise ValueError(f"unknown conv algorithm {algo!r}; expected one of {', '.join(CONV_ALGOS)}")
        self.conv_algo = algo

    def conv_plans(self) -> list[ConvPlan]:
        """The plans autotune chose so far, in the order they were made."""
        return list(self.plans.values())

    def device_key(self) -> tuple:
        """(array module, device index): what a plan or tap table is valid for (the CPU harness: numpy, None)."""
        return id(self.xp), self.device.index()

    def run_conv(self, op: str, geometry: tuple[int, ...], M: int, run: Callable[[tuple[int, ...]], None]) -> None:
        """Run a conv pass, `run(tile)`, with the tile `conv_algo` picks for a GEMM of M rows: `conv_tile`
        ("heuristic", or whenever `tile_override` or `split_override` forces a launch), else the plan of
        (device, op, geometry), made on first use (`autotune`). The last run is always with the chosen
        tile, so its output is the pass's result. Raises ValueError for a conv_algo set to another value."""
        if self.conv_algo == "heuristic" or self.tile_override is not None or self.split_override is not None:
            run(self.conv_tile(M))
            return
        if self.conv_algo != "autotune":
            raise ValueError(f"{op}: planner.conv_algo = {self.conv_algo!r}; expected one of {', '.join(CONV_ALGOS)} "
                             "(use set_conv_algo)")
        key = (*self.device_key(), op, *geometry)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self.autotune(op, geometry, M, run)
        run(plan.tile)

    def autotune(self, op: str, geometry: tuple[int, ...], M: int, run: Callable[[tuple[int, ...]], None]) -> ConvPlan:
        """The plan of one conv pass: `run(tile)` timed for every tile of `autotune_tiles` (and `conv_tile`'s).

        Each tile runs twice untimed (the first call loads, or compiles, its module; the second gives the
        host's launch time), then `repeats` rounds time every tile once per round (`Device.time_calls`,
        `calls` calls), so that a drift (clocks ramping up, another process on the GPU) spreads over all
        of them; a tile's time is its median. The fastest wins unless the heuristic's tile is within
        `margin` of it: then that one is kept (the same results as without autotune, when nothing is
        gained). A tile whose launch is refused (ValueError: a grid past the device limits, ...) is left
        out and listed in the plan; when every tile is refused, the heuristic's error is raised.
        """
        rule = self.conv_tile(M)
        tiles = autotune_tiles(self.device.compute_capability(), self.candidates)
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
        for _ in range(self.repeats):
            for tile in samples:
                samples[tile].append(self.device.time_calls(lambda tile=tile: run(tile), self.calls, launch_ms[tile]))
        times = tuple((tile, statistics.median(ms)) for tile, ms in samples.items())
        best, best_ms = min(times, key=lambda item: item[1])  # the first of equals: the candidates' order
        if rule in samples and dict(times)[rule] * (1 - self.margin) <= best_ms:
            best = rule
        return ConvPlan(op, tuple(int(v) for v in geometry), best, times, tuple(refused))

    # ------------------------------------------------------------------------------------------
    # tap tables

    def conv_tap_table(self, op: str, N: int, C: int, H: int, W: int, K: int, R: int, S: int, P: int, Q: int,
                       stride: int, pad: int) -> Any:
        """The tap table of a conv pass (kernels/conv2d.cu, CONV_TABLE), or None where the kernel tests
        bounds per load instead: an int32 array on this planner's device, (KR + CONV_TAB_PAD, 4), whose row
        for reduction index kk is {off, bits, a_off, 0}, then CONV_TAB_PAD zero rows. Bit r*S + s stands
        for filter tap (r, s):

            conv2d_fprop, kk = (c, r, s):  off = (c*H + r - pad)*W + s - pad, bits = the tap's bit, a_off = kk
            conv2d_dgrad, kk = (k, r, s):  off = (k*P - r)*Q - s, bits = the tap's bit, a_off = k*C*R*S + r*S + s
            conv2d_wgrad, kk = (n, p, q):  off = n*C*H*W + (p*st - pad)*W + q*st - pad, bits = the taps reading
                                           inside the image at output pixel (p, q) (off = 0 where there are
                                           none), a_off = n*K*P*Q + p*Q + q

        (off: the B element's offset from a column's origin, or for wgrad the row's origin in x, to which
        the column adds c*H*W + r*W + s; a_off: the A element's offset from row 0). None for a filter of
        more than `tab_max_taps` taps, dgrad with stride > 1, a reduction of more than CONV_TAB_MAX_ROWS
        terms, or (wgrad) N*C*H*W or N*K*P*Q past int32, or any offset past int32 (`contract.conv_geometry`'s
        checks rule that out for the rest). Built on the host once per geometry and device and kept: the
        last `tab_cache` tables, at most `tab_cache_bytes` in all.
        """
        KR = {"conv2d_fprop": C * R * S, "conv2d_dgrad": K * R * S, "conv2d_wgrad": N * P * Q}[op]
        if (R * S > self.tab_max_taps or KR > CONV_TAB_MAX_ROWS or (op == "conv2d_dgrad" and stride != 1)
                or (op == "conv2d_wgrad" and max(N * C * H * W, N * K * P * Q) > 2**31 - 1)):
            return None
        key = (*self.device_key(), op, N if op == "conv2d_wgrad" else 0, C, H, W, K, R, S, P, Q, stride, pad)
        tables = self.tap_tables
        table = tables.pop(key, None)
        if table is None:
            rows = _tap_rows(op, KR, C, H, W, K, R, S, P, Q, stride, pad)
            if rows[:, [0, 2]].min() < -2**31 or rows[:, [0, 2]].max() > 2**31 - 1:
                return None  # (not reached for geometries conv_geometry accepts; kept as the kernels' guard)
            table = self.xp.asarray(rows.astype(np.int32))
            while tables and (len(tables) >= self.tab_cache or
                              sum(t.nbytes for t in tables.values()) + table.nbytes > self.tab_cache_bytes):
                tables.pop(next(iter(tables)))
        tables[key] = table  # most recently used last
        return table


def _tap_rows(op: str, KR: int, C: int, H: int, W: int, K: int, R: int, S: int, P: int, Q: int, stride: int,
              pad: int) -> np.ndarray:
    """The rows of `Planner.conv_tap_table` as int64 (KR + CONV_TAB_PAD, 4), bits as their int32 bit pattern."""
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
