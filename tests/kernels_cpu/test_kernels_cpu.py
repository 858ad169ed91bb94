"""kernels/*.cu run on the CPU through the CUDA-on-CPU shim (tests/kernels_cpu/cuda_cpu) and compared with numpy_ops.

Plain build: every case of `kernels_cpu.cuda_cpu.cases` (every kernel, through the CUDA backend's wrappers and raw; the
*_nonfinite cases feed NaN and +-inf, which must propagate as in numpy_ops).
Not vacuous: a copy of a kernel with one planted error (an arithmetic slip, a dropped NaN, a padding
rule, a one-pass variance, a wrong Philox key schedule) fails its case; kernels/philox.cuh gives
Random123's known answers.
ThreadSanitizer build (in a subprocess with libtsan preloaded): the small cases must run clean, and
a copy of a kernel with one `__syncthreads()` removed must be reported as a data race (every
barrier of the kernels that have one is planted in turn; each was reported in 5 of 5 trials).
Skipped when g++ (or its libtsan) is missing. Tolerances: `kernels_cpu.cuda_cpu.cases.ATOL/RTOL`.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels_cpu.cuda_cpu import cases, harness
from mpiasgd.ops import numpy_ops
from mpiasgd.ops.cuda.device import HostDevice, LaunchLimits
from mpiasgd.ops.cuda.tiles import CONV_TILES, CONV_TRIAL_TILES, tile_macros, tile_name, tile_shape

pytestmark = pytest.mark.skipif(harness.find_cxx() is None,
                                reason="no g++: the CUDA-on-CPU harness needs a C++17 compiler")

TESTS = Path(__file__).resolve().parents[1]  # tests/, where kernels_cpu.cuda_cpu is imported from
TSAN_TIMEOUT = 300  # seconds for one ThreadSanitizer subprocess
SUBPROCESS_TIMEOUT = 300  # seconds for another harness run in a subprocess


@pytest.fixture(scope="module")
def lib():
    return harness.build()


@pytest.mark.parametrize("case", cases.CASES, ids=[c.name for c in cases.CASES])
def test_kernel_case(lib, case):
    case.run(lib, np.random.default_rng(20240601), False)


def test_every_kernel_has_a_case():
    defined = {sig.name for text_name, text in harness.kernel_sources().items()
               for sig in harness.parse_kernels(text_name, text)}
    covered = {k for c in cases.CASES for k in c.kernels}
    assert defined - covered == set(), f"kernels without a CPU test case: {sorted(defined - covered)}"
    assert covered - defined == set(), f"cases name kernels that do not exist: {sorted(covered - defined)}"


def test_every_cu_file_has_a_header_listing_its_kernels():
    for name, text in harness.kernel_sources().items():
        head = text.split("extern", 1)[0]
        for sig in harness.parse_kernels(name, text):
            assert sig.name in head, f"{name}: header comment does not list kernel {sig.name}"


def test_harness_catches_a_wrong_kernel():
    """A kernel with a planted arithmetic error fails its comparison (the comparison is not vacuous)."""
    sources = harness.kernel_sources()
    bad = sources["conv2d.cu"].replace("acc[i][j] += a[i] * b[j];", "acc[i][j] += a[i] * b[j] * 1.001f;")
    assert bad != sources["conv2d.cu"]
    lib = harness.build(sources={**sources, "conv2d.cu": bad})
    with pytest.raises(AssertionError, match="worst element"):
        cases.conv_wrappers(lib, np.random.default_rng(0), True)


# (file, {code: planted error}, the case that must catch it): one per kernel family added with the
# padded pooling, batch norm, residual, dropout and LRN ops, each an error a tolerance could hide
PLANTED_ERRORS = [
    ("pool.cu", {"(h0 + kernel < n + pad ? h0 + kernel : n + pad) - h0": "(h0 + kernel < n ? h0 + kernel : n) - h0"},
     "avgpool"),  # count_include_pad counting the image only
    ("pool.cu", {"int best_at = i0 * kernel + j0;": "int best_at = 0;"}, "maxpool_pad_ceil"),  # padding wins
    ("pool.cu", {"(hp - kernel) / stride + 1 : 0;": "(hp - kernel) / stride + 2 : 0;"},
     "maxpool_pad_ceil"),  # the backward misses a window
    ("batchnorm.cu", {"    if (l >= HW) {": "    if (l > HW) {"}, "batchnorm"),  # the channel walk's carry
    ("batchnorm.cu", {"    s2 += d * d;": "    s2 += x[i] * x[i];",
                      "(bn_block_sum(part, s2) - sum_d * (sum_d / M)) / M": "bn_block_sum(part, s2) / M - mu * mu"},
     "batchnorm"),  # a one-pass variance, which cancels on the case's offset data
    ("batchnorm.cu", {"mu0 + sum_d / M;": "mu0;", " - sum_d * (sum_d / M)": ""},
     "batchnorm_large_mean"),  # a plain two-pass variance: the first mean's rounding error stays in
    ("batchnorm.cu", {"e = a * invstd * sum_dy_xhat / M;": "e = a * sum_dy_xhat / M;"}, "batchnorm"),
    ("residual.cu", {"dy[((n * K + pad_before + c) * P": "dy[((n * K + c) * P"}, "residual"),
    ("lrn.cu", {"lrn_window(c, C, (size - 1) / 2, size / 2, &lo, &hi);":  # fprop's window: wrong for even sizes
                "lrn_window(c, C, size / 2, (size - 1) / 2, &lo, &hi);"}, "lrn"),
    ("philox.cuh", {"k1 += PHILOX_W1;": "k1 += PHILOX_W0;"}, "dropout"),  # a wrong key schedule
    ("sgd.cu", {"(nesterov ? d + momentum * vi : vi)": "(nesterov ? d + vi : vi)"}, "sgd_nesterov_lr_scale"),
]




def planted(name: str, edits: dict[str, str]) -> dict[str, str]:
    """The kernel sources with each `edits` key replaced by its value in file `name` (each must occur once);
    for a header, in a copy inlined into every .cu file that includes it."""
    sources = harness.kernel_sources()
    text = (harness.KERNELS / name).read_text() if name.endswith(".cuh") else sources[name]
    for old, new in edits.items():
        assert text.count(old) == 1, f"{name}: no single {old!r}"
        text = text.replace(old, new)
    if not name.endswith(".cuh"):
        return {**sources, name: text}
    include = f'#include "{name}"'
    return {f: t.replace(include, text) for f, t in sources.items() if include in t}


@pytest.mark.parametrize("name, edits, case", PLANTED_ERRORS, ids=[f"{e[0]}:{e[2]}" for e in PLANTED_ERRORS])
def test_cases_catch_a_planted_error(name, edits, case):
    """Each case of the newer kernels fails on a kernel with one planted error (not vacuous)."""
    lib = harness.build(sources=planted(name, edits))
    run = next(c.run for c in cases.CASES if c.name == case)
    with pytest.raises(AssertionError), np.errstate(all="ignore"):
        run(lib, np.random.default_rng(0), True)


PHILOX_KAT_KERNEL = """
#include "philox.cuh"
extern "C" __global__ void philox_kat(const int* __restrict__ input, int* __restrict__ out) {
  unsigned int ctr[4] = {(unsigned int)input[0], (unsigned int)input[1], (unsigned int)input[2],
                         (unsigned int)input[3]};
  philox4x32_10(ctr, (unsigned int)input[4], (unsigned int)input[5]);
  for (int w = 0; w < 4; ++w) out[w] = (int)ctr[w];
}
"""

# Random123's kat_vectors for philox4x32_10: (counter, key, result)
PHILOX_KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, want", PHILOX_KATS, ids=["zero", "ones", "pi"])
def test_philox_known_answers(counter, key, want):
    """kernels/philox.cuh (dropout's generator) gives Random123's known answers, and so does numpy_ops'
    philox4x32 (the reference the dropout case compares against bit for bit); counter word 0 of the
    last two needs 2^34 elements, out of the dropout case's reach."""
    lib = harness.build(sources={"kat.cu": PHILOX_KAT_KERNEL})
    out = np.zeros(4, np.int32)
    lib.kernel("philox_kat")((1,), (1,), (np.array([*counter, *key], np.uint32).view(np.int32), out))
    assert [hex(v) for v in out.view(np.uint32)] == [hex(v) for v in want]
    ref = numpy_ops.philox4x32(np.array([counter], np.uint32), key)[0]
    assert [hex(v) for v in ref] == [hex(v) for v in want]


# (file, the NaN-propagating code, a NaN-dropping stand-in, the case that must catch it)
NAN_DROPS = [
    ("relu.cu", "y[i] = (v > 0.0f || v != v) ? v : 0.0f;", "y[i] = fmaxf(v, 0.0f);", "relu_nonfinite"),
    ("relu.cu", "dx[i] = dy[i] * (y[i] > 0.0f ? 1.0f : 0.0f);", "dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;",
     "relu_nonfinite"),
    ("conv2d.cu", "if (relu) t = conv_relu(t);", "if (relu) t = fmaxf(t, 0.0f);", "conv_relu_nonfinite"),
    ("pool.cu", "if (v > best || (v != v && best == best)) {", "if (v > best) {", "maxpool_nonfinite"),
    ("softmax_xent.cu", "if (best_at == K || softmax_above(v, best)) {", "if (v > best) {", "softmax_xent_nonfinite"),
    ("dropout.cu", "y[i] = x[i] * (r[j] >= threshold ? scale : 0.0f);",
     "y[i] = r[j] >= threshold ? x[i] * scale : 0.0f;", "dropout"),
]


@pytest.mark.parametrize("name, fixed, dropping, case", NAN_DROPS, ids=[f"{d[0]}:{d[2]}" for d in NAN_DROPS])
def test_nonfinite_cases_catch_a_kernel_that_drops_nan(name, fixed, dropping, case):
    """The comparisons accept NaN where the reference is NaN, so check they are not vacuous: each kernel
    with its NaN handling replaced by the plain max / select (fmaxf(NaN, 0) = 0, `v > best` skips a NaN)
    fails its non-finite case."""
    sources = harness.kernel_sources()
    assert sources[name].count(fixed) == 1, f"{name}: no single line {fixed!r}"
    lib = harness.build(sources={**sources, name: sources[name].replace(fixed, dropping)})
    run = next(c.run for c in cases.CASES if c.name == case)
    with pytest.raises(AssertionError):
        run(lib, np.random.default_rng(0), True)


ASYNC_COPY_KERNEL = """
extern "C" __global__ void copy_twice(const float* __restrict__ src, float* __restrict__ out, int wait) {
  __shared__ float buf[2][32];
  const int t = threadIdx.x;
  __pipeline_memcpy_async(&buf[0][t], src + t, 4, 0);
  __pipeline_commit();
  __pipeline_memcpy_async(&buf[1][t], src + 32 + t, 4, t % 2 ? 4 : 0);  // odd threads: zero fill
  __pipeline_commit();
  out[t] = buf[0][t];  // before any wait: garbage
  if (wait < 0) return;  // copies left pending
  __pipeline_wait_prior(wait);
  out[32 + t] = buf[0][t];
  out[64 + t] = buf[1][t];
  __pipeline_wait_prior(0);
}
"""


@pytest.mark.parametrize("wait", [1, 0])
def test_harness_async_copies_land_at_their_wait(wait):
    """The harness's model of CUDA's pipeline primitives: a copy's destination holds garbage (NaN) from
    the issue until a __pipeline_wait_prior covers its group, wait_prior(1) lands all groups but the
    newest, a zero fill reads nothing."""
    lib = harness.build(sources={"copy.cu": ASYNC_COPY_KERNEL})
    src = np.arange(64, dtype=np.float32)
    out = np.zeros(96, np.float32)
    lib.kernel("copy_twice")((1, 1, 1), (32, 1, 1), (src, out, np.int32(wait)))
    assert np.isnan(out[:32]).all()
    assert np.array_equal(out[32:64], src[:32])
    second = np.where(np.arange(32) % 2, 0.0, src[32:]).astype(np.float32)
    assert np.isnan(out[64:]).all() if wait == 1 else np.array_equal(out[64:], second)


def test_harness_refuses_copies_pending_at_block_end():
    """A block that ends with copies it never waited for aborts the run, naming the missing wait."""
    code = ("import numpy as np\nfrom kernels_cpu.cuda_cpu import harness\n"
            f"lib = harness.build(sources={{'copy.cu': {ASYNC_COPY_KERNEL!r}}})\n"
            "lib.kernel('copy_twice')((1, 1, 1), (32, 1, 1), (np.zeros(64, np.float32), np.zeros(96, np.float32), "
            "np.int32(-1)))\nprint('finished')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=TESTS, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "finished" not in proc.stdout, proc.stdout + proc.stderr
    assert "asynchronous copies pending at the end of block" in proc.stderr, proc.stderr[-3000:]


# (the one-stage trial tiles are the production tiles with CONV_STAGES=1: that loop runs here in 16x32,
# in test_pipelined_and_one_stage_loops_agree_bit_for_bit and in the one-stage ThreadSanitizer run)
def tile_defines(tile: tuple[int, ...]) -> dict[str, int]:
    """Every conv2d.cu macro of `tile` (tiles.tile_shape), defaults spelled out."""
    bm, bn, tm, tn, bk, stages = tile_shape(tile)
    return {"CONV_BM": bm, "CONV_BN": bn, "CONV_TM": tm, "CONV_TN": tn, "CONV_BK": bk, "CONV_STAGES": stages}


@pytest.mark.parametrize("tile", [(32, 128, 4, 4, 8), (16, 32, 4, 4, 16), (32, 64, 4, 4, 8), (64, 64, 4, 4, 8),
                                  *(t for t in CONV_TRIAL_TILES if tile_shape(t)[5] != 1),
                                  (32, 64, 8, 8, 8), (16, 32, 4, 4, 16, 1), (32, 64, 4, 4, 8, 2), (16, 32, 4, 4, 8, 4)])
@pytest.mark.builds(lambda tile: [(False, tile_defines(tile))])
def test_conv_with_other_tile_shapes(tile):
    """The tile body derives its loader and register-block layout from CONV_BM/CONV_BN/CONV_TM/CONV_TN/
    CONV_BK and its main loop from CONV_STAGES (-D overrides; the default build is the 64x64 tile, 4x4
    per thread, BK 16, 3 stages): each of these, the trial tiles among them, computes every conv shape."""
    lib = harness.build(defines=tile_defines(tile))
    cases.conv_wrappers(lib, np.random.default_rng(1), True)


@pytest.mark.builds(lambda: [(False, {"CONV_BM": 16, "CONV_BN": 32, "CONV_STAGES": s}) for s in (1, 2, 3, 4)])
def test_pipelined_and_one_stage_loops_agree_bit_for_bit():
    """The cp.async pipeline (CONV_STAGES 2-4) changes when a slab reaches shared memory, not the order
    of the sums: on float inputs (rounding everywhere) every pass equals the one-stage loop's bit for bit,
    with the tap table and testing bounds, with and without split-K."""
    rng = np.random.default_rng(5)
    N, C, H, W, K, R, S, st, pad = 2, 5, 9, 7, 6, 3, 3, 1, 1  # KR 45 / 54 / 126: ragged slabs of 16
    x, w, b, dy = cases.f32(rng, N, C, H, W), cases.f32(rng, K, C, R, S), cases.f32(rng, K), cases.f32(rng, N, K, H, W)
    results = {}
    for stages in (1, 2, 3, 4):
        lib = harness.build(defines={"CONV_BM": 16, "CONV_BN": 32, "CONV_STAGES": stages})
        for consts in ({"split_override": 1}, {"split_override": 2}, {"tab_max_taps": 0}):
            ops = cases.cpu_backend(lib, **consts)
            got = (ops.conv2d_fprop(x, w, b, st, pad), ops.conv2d_dgrad(dy, w, x.shape, st, pad),
                   ops.conv2d_wgrad(dy, x, w.shape, st, pad))
            results.setdefault(str(consts), {})[stages] = got
    for consts, by_stages in results.items():
        for stages in (2, 3, 4):
            for name, one, many in zip(("fprop", "dgrad", "wgrad"), by_stages[1], by_stages[stages], strict=True):
                assert np.isfinite(one).all() and np.array_equal(one, many), f"{name} {consts}: {stages} stages != 1"


AUTOTUNE_TEST_TILES = ((64, 64), (32, 128), (64, 64, 4, 4, 16, 1))
AUTOTUNE_SPLITS = {"target_blocks": 8, "min_chunk": 16}  # the tiles split the reductions differently
AUTOTUNE_BUILDS = pytest.mark.builds(lambda: [(False, tile_macros(t)) for t in AUTOTUNE_TEST_TILES])


def _autotune_backend(lib, launches: list, device: HostDevice | None = None, **knobs):
    """cases.cpu_backend (on `device`) under conv_algo "autotune" with AUTOTUNE_TEST_TILES and no plans yet,
    whose kernel lookups append (kernel, tile) to `launches`."""
    return cases.cpu_backend(lib, device, lambda name, tile: launches.append((name, tile)), conv_algo="autotune",
                             candidates=AUTOTUNE_TEST_TILES, **knobs)


def _passes(rng, N, C, H, W, K, R, S, st, pad):
    """Inputs of one conv geometry, the three passes on a backend, and numpy_ops' results."""
    P, Q = (H + 2 * pad - R) // st + 1, (W + 2 * pad - S) // st + 1
    x, w, b, dy = cases.f32(rng, N, C, H, W), cases.f32(rng, K, C, R, S), cases.f32(rng, K), cases.f32(rng, N, K, P, Q)
    calls = {"conv2d_fprop": lambda ops: ops.conv2d_fprop(x, w, b, st, pad),
             "conv2d_dgrad": lambda ops: ops.conv2d_dgrad(dy, w, x.shape, st, pad),
             "conv2d_wgrad": lambda ops: ops.conv2d_wgrad(dy, x, w.shape, st, pad, out=np.full(w.shape, np.nan,
                                                                                                 np.float32))}
    f64 = cases.f64
    refs = {"conv2d_fprop": numpy_ops.conv2d_fprop(f64(x), f64(w), f64(b), st, pad),
            "conv2d_dgrad": numpy_ops.conv2d_dgrad(f64(dy), f64(w), x.shape, st, pad),
            "conv2d_wgrad": numpy_ops.conv2d_wgrad(f64(dy), f64(x), w.shape, st, pad)}
    return calls, refs


def _gemms(launches: list) -> list:
    """The tiles of the GEMM launches (a split pass adds a conv2d_split_reduce launch)."""
    return [tile for name, tile in launches if name != "conv2d_split_reduce"]


@AUTOTUNE_BUILDS
def test_autotune_times_every_tile_in_rounds_then_keeps_the_plan(lib):
    """conv_algo "autotune" on the harness backend, host-clock timing: the first call of a pass runs each
    candidate twice untimed, then AUTOTUNE_REPEATS rounds of AUTOTUNE_CALLS calls per tile, then the chosen
    tile once; a second call of the geometry is one GEMM with the kept tile and the same result; the
    results match numpy_ops; geometries that differ only in N, in stride or in pad get plans of their own."""
    launches = []
    ops = _autotune_backend(lib, launches)
    calls_per_round = [t for t in AUTOTUNE_TEST_TILES for _ in range(ops.planner.calls)]
    rounds = calls_per_round * ops.planner.repeats
    untimed = [t for t in AUTOTUNE_TEST_TILES for _ in range(2)]
    geometry = (2, 3, 9, 8, 5, 3, 3, 1, 1)
    calls, refs = _passes(np.random.default_rng(9), *geometry)
    for i, (op, call) in enumerate(calls.items()):
        launches.clear()
        got = call(ops)
        plan = ops.conv_plans()[i]
        assert (plan.op, plan.geometry) == (op, geometry) and plan.refused == ()
        assert [t for t, _ in plan.times] == list(AUTOTUNE_TEST_TILES) and all(ms > 0 for _, ms in plan.times)
        fastest, ms = min(plan.times, key=lambda item: item[1])
        rule_ms = dict(plan.times)[ops.planner.conv_tile(5)]
        assert plan.tile == (fastest if ms < rule_ms * (1 - ops.planner.margin) else ops.planner.conv_tile(5))
        assert _gemms(launches) == untimed + rounds + [plan.tile], op
        cases.assert_close(got, refs[op], f"autotuned {op}")
        launches.clear()
        assert np.array_equal(call(ops), got) and _gemms(launches) == [plan.tile], op
        assert plan.describe().startswith(f"{op} N2 C3 9x8 K5 3x3 stride 1 pad 1: ")
    for other in ((3, 3, 9, 8, 5, 3, 3, 1, 1), (2, 3, 9, 8, 5, 3, 3, 2, 1), (2, 3, 9, 8, 5, 3, 3, 1, 0)):
        made = len(ops.conv_plans())
        calls, _ = _passes(np.random.default_rng(1), *other)
        calls["conv2d_fprop"](ops)
        assert len(ops.conv_plans()) == made + 1 and ops.conv_plans()[-1].geometry == other


@pytest.mark.parametrize("winner", AUTOTUNE_TEST_TILES, ids=[tile_name(t) for t in AUTOTUNE_TEST_TILES])
@AUTOTUNE_BUILDS
def test_autotune_runs_whichever_tile_wins_correctly(lib, winner):
    """With the timings made up (the winner at half the others' time), the plan keeps the winner and each
    pass gives numpy_ops' result with it, on a geometry the tiles split into different numbers of
    ranges (split-K workspaces resized between candidates, wgrad into a NaN-filled out)."""
    launches = []

    def made_up(fn, calls, launch_ms):
        fn()
        return 0.5 if _gemms(launches)[-1] == winner else 1.0

    ops = _autotune_backend(lib, launches, HostDevice(clock=made_up), repeats=1, **AUTOTUNE_SPLITS)
    geometry = (2, 10, 10, 10, 6, 3, 3, 1, 1)
    splits = {ops.planner.gemm_split(6, 10 * 9, 2 * 10 * 10, t)[0] for t in AUTOTUNE_TEST_TILES}  # wgrad: K x C*R*S
    assert len(splits) > 1, f"the tiles split wgrad alike ({splits}): the case tests no resize"
    calls, refs = _passes(np.random.default_rng(2), *geometry)
    for op, call in calls.items():
        got = call(ops)
        assert ops.conv_plans()[-1].tile == winner and ops.conv_plans()[-1].op == op
        cases.assert_close(got, refs[op], f"{op} with {tile_name(winner)} chosen")


@pytest.mark.parametrize("gain, kept", [(0.02, "heuristic"), (0.05, "faster")])
@AUTOTUNE_BUILDS
def test_autotune_keeps_the_heuristic_tile_unless_another_is_clearly_faster(lib, gain, kept):
    """AUTOTUNE_MARGIN (3 %): a tile 2 % faster than conv_tile's does not replace it, one 5 % faster does."""
    launches = []
    faster = AUTOTUNE_TEST_TILES[2]

    def made_up(fn, calls, launch_ms):
        fn()
        return 1.0 - gain if _gemms(launches)[-1] == faster else 1.0

    ops = _autotune_backend(lib, launches, HostDevice(clock=made_up), repeats=1)
    calls, _ = _passes(np.random.default_rng(2), 2, 3, 6, 6, 4, 3, 3, 1, 1)
    calls["conv2d_fprop"](ops)
    assert ops.conv_plans()[0].tile == (ops.planner.conv_tile(4) if kept == "heuristic" else faster)


@AUTOTUNE_BUILDS
def test_autotune_leaves_out_a_tile_whose_launch_is_refused(lib):
    """With grid y limited to 2 (a stand-in for a layer past the device's grid limits), K = 70 rows need 3
    row tiles of 32: the 32x128 tile is refused and listed, the others are timed, the result is right;
    when every tile is refused, the heuristic tile's error is raised."""
    launches = []
    ops = _autotune_backend(lib, launches, HostDevice(LaunchLimits(max_grid_yz=2)))
    geometry = (1, 2, 5, 5, 70, 3, 3, 1, 1)
    calls, refs = _passes(np.random.default_rng(4), *geometry)
    got = calls["conv2d_fprop"](ops)
    plan = ops.conv_plans()[0]
    assert [t for t, _ in plan.refused] == [(32, 128)] and "grid" in plan.refused[0][1]
    assert [t for t, _ in plan.times] == [(64, 64), (64, 64, 4, 4, 16, 1)] and "32x128 refused" in plan.describe()
    cases.assert_close(got, refs["conv2d_fprop"], "fprop with a refused tile")
    ops = _autotune_backend(lib, launches, HostDevice(LaunchLimits(max_grid_yz=1)))
    calls, _ = _passes(np.random.default_rng(4), 1, 2, 5, 5, 70, 3, 3, 2, 1)
    with pytest.raises(ValueError, match=r"conv2d_fprop: grid \(\d+, 2, 1\) outside the limits"):
        calls["conv2d_fprop"](ops)


def test_start_up_tuning_plans_every_conv_pass_of_the_model(lib, monkeypatch):
    """train.autotune_convs (a cupy worker's start-up under --conv-algo autotune): one forward/backward of
    the digits model on its first batch_size real images makes a plan for each conv pass training runs
    (fprop of both conv layers, wgrad of both, dgrad of the second only), which it returns described;
    for a pipeline unit's module (layers 3.. on activations of their input shape), only its conv's."""
    import mpiasgd.model.registry
    from mpiasgd.config import Config
    from mpiasgd.data import load_dataset
    from mpiasgd.launch import startup as train

    launches = []
    ops = _autotune_backend(lib, launches, repeats=1, calls=1)
    monkeypatch.setattr(mpiasgd.model.registry, "get_backend", lambda name: ops)
    lines = train.autotune_convs(Config(model="digits", batch_size=16, conv_algo="autotune"),
                                 load_dataset("digits"))
    plans = ops.conv_plans()
    assert sorted((p.op, p.geometry[1]) for p in plans) == [("conv2d_dgrad", 16), ("conv2d_fprop", 1),
                                                             ("conv2d_fprop", 16), ("conv2d_wgrad", 1),
                                                             ("conv2d_wgrad", 16)]
    assert all(p.geometry[0] == 16 for p in plans) and lines == [p.describe() for p in plans]
    ops.planner.plans.clear()  # a pipeline unit holding layers 3.. (conv2 onwards): its conv's passes only
    lines = train.autotune_convs(Config(model="digits", batch_size=16, conv_algo="autotune"),
                                 load_dataset("digits"), 3, None)
    assert sorted((p.op, p.geometry[:2]) for p in ops.conv_plans()) == [
        ("conv2d_dgrad", (16, 16)), ("conv2d_fprop", (16, 16)), ("conv2d_wgrad", (16, 16))] and len(lines) == 3


@pytest.mark.parametrize("knobs", [{}, {"tile_override": (32, 128)}, {"split_override": 1}],
                         ids=["heuristic", "tile forced", "split forced"])
def test_without_autotune_a_pass_is_one_launch_with_the_rule_tile(lib, knobs):
    """conv_algo "heuristic" (the default), and "autotune" while a tile or split is forced (bench, tests):
    no timing, no plan; each pass is one launch with `conv_tile`'s tile."""
    rng = np.random.default_rng(3)
    x, w = cases.f32(rng, 2, 3, 6, 6), cases.f32(rng, 4, 3, 3, 3)
    launches = []
    algo = "heuristic" if not knobs else "autotune"
    ops = cases.cpu_backend(lib, record=lambda name, tile: launches.append(tile), conv_algo=algo, **knobs)
    ops.conv2d_fprop(x, w, None, 1, 1)
    assert launches == [ops.planner.conv_tile(4)] and ops.conv_plans() == []


@pytest.mark.parametrize("bm, bn, message", [(60, 64, "As pitch"), (8, 12, "THREADS: a multiple of BK")])
def test_bad_tile_shapes_do_not_compile(bm, bn, message):
    """A tile that would serialise the shared-memory stores or leave B slab rows unloaded is refused by
    the kernel's static_asserts (here through g++; nvcc and NVRTC say the same)."""
    with pytest.raises(RuntimeError, match=message):
        harness.build(defines={"CONV_BM": bm, "CONV_BN": bn},
                      sources={"conv2d.cu": harness.kernel_sources()["conv2d.cu"]})


NEAR_INT32_LIMIT = """
import sys
import numpy as np
from kernels_cpu.cuda_cpu import cases, harness
W, C, H, pad, stride = 2**20, 2047, 1, 2, 2**20  # P = 1, Q = 2: output column 1 sees x[:, 0, W - 2]
try:
    x = np.zeros((1, C, H, W), np.float32)  # 8 GiB of zero pages, left untouched but a few thousand
except MemoryError:
    sys.exit(3)
x[0, C - 1, 0, W - 2], x[0, C - 2, 0, W - 2] = 1.0, 2.0
w = np.ones((1, C, 3, 1), np.float32)
taps = int(sys.argv[2])  # CONV_TAB_MAX_TAPS: 0 makes every pass test bounds instead of using its tap table
ops = cases.cpu_backend(harness.build(), split_override=int(sys.argv[1]), tab_max_taps=taps)
assert (ops.planner.conv_tap_table("conv2d_fprop", 1, C, H, W, 1, 3, 1, 1, 2, stride, pad) is None) == (taps == 0)
print(ops.conv2d_fprop(x, w, None, stride, pad).ravel().tolist())
"""


@pytest.mark.parametrize("splits, taps", [(1, 32), (3, 32), (1, 0), (3, 0)])
def test_conv_fprop_addresses_near_the_int32_limit(splits, taps):
    """An image of 2^31 - 2^20 floats (C*H*W and the padded plane fit an int) whose one window sits at
    the far end: each int part of a B address (column origin, tap offset) must stay in range for an
    in-bounds tap, with the tap table and testing bounds. With -pad in the column part the tap part
    reached 2^31 here and wrapped: a read 8 GiB before x (helper-17), a segfault, hence the subprocess."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", NEAR_INT32_LIMIT, str(splits), str(taps)], capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT, cwd=TESTS, env=env)
    if proc.returncode == 3:
        pytest.skip("no 8 GiB of address space for the image")
    assert proc.returncode == 0 and proc.stdout.split() == ["[0.0,", "3.0]"], (proc.returncode, proc.stdout,
                                                                               proc.stderr[-2000:])


WGRAD_NEAR_INT32_LIMIT = """
import ctypes
import sys
import numpy as np
from kernels_cpu.cuda_cpu import cases, harness
# numpy asks for transparent huge pages for large arrays (madvise): the writes below, one per 495 KB
# channel plane, would then fault in all 8 GiB as 2 MiB pages (7.7 GB resident, 10-20 s); 4 KiB pages
# keep them at a few thousand
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE (Linux, as is the harness)
N, C, H, W, K, R, S, stride, pad = 16, 1024, 2, 61901, 1, 1, 1, 12387, 12387  # N*C*H*W = 2^31 - 119,111,680
P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
try:
    x = np.zeros((N, C, H, W), np.float32)  # 8 GiB of zero pages, a few thousand touched
except MemoryError:
    sys.exit(3)
rng = np.random.default_rng(0)
dy = rng.integers(-3, 4, (N, K, P, Q)).astype(np.float32)
ref = np.zeros(C)
for n in range(N):  # the output pixels whose one tap reads inside the image
    for p in range(P):
        for q in range(Q):
            h, w = p * stride - pad, q * stride - pad
            if 0 <= h < H and 0 <= w < W:
                x[n, :, h, w] = rng.integers(1, 4, C)
                ref += dy[n, 0, p, q] * x[n, :, h, w]
taps = int(sys.argv[1])  # CONV_TAB_MAX_TAPS: 0 makes wgrad test bounds instead of using its tap table
ops = cases.cpu_backend(harness.build(), split_override=1, tab_max_taps=taps)
assert (ops.planner.conv_tap_table("conv2d_wgrad", N, C, H, W, K, R, S, P, Q, stride, pad) is None) == (taps == 0)
dw = ops.conv2d_wgrad(dy, x, (K, C, R, S), stride, pad)
print(int(np.sum(dw.ravel() != ref)), "of", C, "wrong")
"""


@pytest.mark.parametrize("taps", [32, 0])
def test_conv_wgrad_addresses_near_the_int32_limit(taps):
    """x of 2^31 - 1.2e8 floats with pad and stride of 12,387 on a 61,901-wide image: a wgrad table
    row offset n*C*H*W + p*st*W + q*st passed 2^31 for taps inside the image (p*st up to H + pad),
    wrapped, and the kernel read 8 GiB before x (helper-20); the row offset now holds the -pad, so it
    stays below the address it leads to."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", WGRAD_NEAR_INT32_LIMIT, str(taps)], capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT, cwd=TESTS, env=env)
    if proc.returncode == 3:
        pytest.skip("no 8 GiB of address space for x")
    assert proc.returncode == 0 and proc.stdout.split() == ["0", "of", "1024", "wrong"], (
        proc.returncode, proc.stdout, proc.stderr[-2000:])


def test_launcher_refuses_wrong_argument_types(lib):
    k = lib.kernel("relu_fprop")
    x = np.zeros(8, np.float32)
    with pytest.raises(TypeError, match="C-contiguous float32"):
        k((1,), (8,), (x[::2], x, np.int64(4)))
    with pytest.raises(TypeError, match="int64 scalar"):
        k((1,), (8,), (x, x, 8))  # a Python int has no C type


# ----------------------------------------------------------------------------------------------
# ThreadSanitizer


def tsan_builds(defines: dict[str, int]) -> list[tuple[bool, dict[str, int]]]:
    """The ThreadSanitizer builds an unplanted run with `defines` loads: the library and its variant for
    each tile of CONV_TILES (HarnessKernels builds them for the conv cases' launches)."""
    return [(True, defines), *((True, {**defines, **tile_macros(t)}) for t in CONV_TILES)]


def run_tsan(*args: str) -> subprocess.CompletedProcess:
    if harness.libtsan() is None:
        pytest.skip("g++ has no ThreadSanitizer runtime (libtsan)")
    env = harness.tsan_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    # the run's unplanted build, compiled here (or waited for, where the session's prebuild is at it): the
    # subprocess then finds every object in the cache but a planted file's, instead of compiling them again;
    # an unplanted run's conv tile variants too (the conv cases launch both CONV_TILES)
    defines = {k: int(v) for k, v in (d.split("=", 1) for flag, d in itertools.pairwise(args) if flag == "--define")}
    for tsan, build_defines in tsan_builds(defines) if "--plant" not in args else [(True, defines)]:
        harness.library(tsan, None, build_defines)
    try:
        return subprocess.run([sys.executable, "-m", "kernels_cpu.cuda_cpu.run_cases", "--tsan", *args], cwd=TESTS,
                              env=env, capture_output=True, text=True, timeout=TSAN_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"ThreadSanitizer run {args} took over {TSAN_TIMEOUT} s\n{e.stdout}\n{e.stderr}")


@pytest.mark.builds(lambda: tsan_builds({}))
def test_tsan_clean():
    proc = run_tsan("--full")
    out = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-20000:]}"
    assert "ThreadSanitizer" not in proc.stderr, f"ThreadSanitizer reported:\n{out}"
    assert proc.returncode == 0, out
    assert proc.stdout.count(": ok") == len(cases.CASES), out


@pytest.mark.parametrize("args, message", [
    (["--cases", "conv_wrapper"], "no case conv_wrapper"),
    (["--define", "CONV_STAGE=1"], "no kernel file uses the macro CONV_STAGE"),
    (["--repeat", "0"], "expected an integer >= 1"),
    (["--plant", "conv2d.cu"], "expected FILE:TEXT"),
    (["--plant", "nosuch.cu:x"], "no kernel file 'nosuch.cu'"),
    (["--plant", "conv2d.cu:slab complete"], "one-stage main loop, which this build (CONV_STAGES=3) does not run"),
    (["--define", "CONV_STAGES=1", "--plant", "conv2d.cu:everyone's have"], "cp.async pipeline"),
])
def test_run_cases_refuses_arguments_that_would_pass_vacuously(args, message, capsys):
    """A typo in a case or macro name, or a barrier planted in a loop the build does not run, would
    run nothing and pass (helper-23): each is an error (exit 2) naming what was expected."""
    from kernels_cpu.cuda_cpu import run_cases

    with pytest.raises(SystemExit) as e:
        run_cases.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


ONE_STAGE = ("--define", "CONV_STAGES=1")  # conv2d.cu's one-stage main loop (the default build runs the pipeline)


@pytest.mark.builds(lambda: tsan_builds({"CONV_STAGES": 1}))
def test_tsan_clean_with_one_stage():
    """The one-stage main loop of conv2d.cu (sm_75's, and the CONV_STAGES=1 trial tiles') is race-free too."""
    proc = run_tsan("--full", *ONE_STAGE, "--cases", "conv_wrappers,conv_wgrad_splits")
    out = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-20000:]}"
    assert "ThreadSanitizer" not in proc.stderr, f"ThreadSanitizer reported:\n{out}"
    assert proc.returncode == 0 and proc.stdout.count(": ok") == 2, out


@pytest.mark.parametrize("plant, case, defines", [
    ("conv2d.cu:everyone's have", "conv_wrappers", ()),  # cp.async pipeline: both ways over the stages
    ("conv2d.cu:every thread is done reading", "conv_wrappers", ONE_STAGE),  # write-after-read on the next K-slab
    ("conv2d.cu:slab complete", "conv_wrappers", ONE_STAGE),                 # read-after-write within a slab
    ("conv2d.cu:every lane's sum stored", "conv_split_reduce", ()),   # lane 0 adds sums not yet stored
    ("conv2d.cu:before the next group overwrites", "conv_split_reduce", ()),  # a lane's next sum lands first
    ("bias.cu:all partial sums stored", "bias_grad", ()),             # the tree reads partial sums not yet stored
    ("bias.cu:this tree level done", "bias_grad", ()),                # tree levels overlap
    ("softmax_xent.cu:before it is reused for the sum", "softmax_xent", ()),  # max reread after the sum began
    ("batchnorm.cu:all partial sums stored", "batchnorm", ()),        # the tree reads partial sums not yet stored
    ("batchnorm.cu:this tree level done", "batchnorm", ()),           # tree levels overlap
    ("batchnorm.cu:before part is reused", "batchnorm", ()),          # the next sum overwrites the total being read
])
def test_tsan_catches_missing_syncthreads(plant, case, defines):
    proc = run_tsan(*defines, "--plant", plant, "--cases", case, "--repeat", "2")
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr, (
        f"no race reported with the barrier removed ({plant}):\n{proc.stdout}\n{proc.stderr[-5000:]}")
    assert proc.returncode != 0


def test_a_training_step_queues_every_kernel_without_waiting_for_the_device(lib, monkeypatch):
    """Model.forward_backward_deferred on the CUDA backend (harness kernels): the forward, the loss and the
    backward are launched with no device-to-host copy in between (nothing waits for the GPU inside a
    step); `get()` then makes the one copy of the loss and hits, with the values and gradients that
    forward_backward gives, bit for bit."""
    import mpiasgd.model.registry
    from mpiasgd.model import build_model

    events = []
    ops = cases.cpu_backend(lib, record=lambda name, tile: events.append(name))
    to_numpy = ops.to_numpy
    monkeypatch.setattr(ops, "to_numpy", lambda a: (events.append("to_host"), to_numpy(a))[1])
    monkeypatch.setattr(mpiasgd.model.registry, "get_backend", lambda name: ops)
    rng = np.random.default_rng(7)
    results = []
    for deferred in (True, False):
        model = build_model("digits", "cupy")
        params, grads = model.init_params(3), np.zeros(model.num_params, np.float32)
        model.bind(params, grads)
        if not results:  # (the same minibatch for both)
            x, y = rng.standard_normal((8, *model.input_shape)).astype(np.float32), rng.integers(0, 10, 8)
        events.clear()
        if deferred:
            stats = model.forward_backward_deferred(x, y, minibatch=1)
            queued = list(events)
            assert "to_host" not in queued and queued.index("softmax_xent") < len(queued) - 1  # backward follows
            values = stats.get()
            assert events[len(queued):] == ["to_host", "to_host"]  # the rows' hits and losses, once
            assert stats.get() == values and events[len(queued) + 2:] == []
        else:
            values = model.forward_backward(x, y, minibatch=1)
        results.append((values, grads.copy()))
    (deferred_values, deferred_grads), (eager_values, eager_grads) = results
    assert deferred_values == eager_values and np.isfinite(deferred_values[0])
    assert np.array_equal(deferred_grads, eager_grads) and np.abs(eager_grads).max() > 0
