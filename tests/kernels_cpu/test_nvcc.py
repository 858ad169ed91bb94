"""Every kernels/*.cu compiles, without register spills, for sm_75, sm_80 and sm_90, with both compilers:

* nvcc: `nvcc -cubin -Xptxas -v` prints per kernel "N bytes spill stores, M bytes spill loads"; any
  nonzero value fails (a spill turns register blocking into local-memory traffic). nvcc 13 has no
  sm_70. Skipped when nvcc is absent (looked up on PATH, then $CUDA_HOME/bin, /usr/local/cuda/bin).
* NVRTC, the runtime compiler that `cupy.RawModule` uses on the GPU (a different front end from
  nvcc's: no host headers, its own defaults). The library comes from the `nvidia-cuda-nvrtc-cu12`
  wheel of the test extra and is found by `cuda.pathfinder`; no GPU or driver is needed. Each file
  is compiled as the CUDA backend hands it to CuPy (`runtime.kernel_source`: its headers inlined) with
  the options CuPy passes (`runtime.NVRTC_OPTIONS` plus CuPy's own), must log no warning, spill nothing,
  and its cubin must define every kernel that the backend launches from it (`runtime.KERNEL_FILES`).

The compiler runs of the selected builds are made at the first of these tests, one per core at a time,
and kept on disk (the user's cache directory, `kit.cache`: ~/.cache/mpiasgd/tests/compilers/, shared by
every clone) under the hash of everything a run depends on: the
compiler (its path and version), the source text with its headers, the options. A compiler is
deterministic, so a kept run is the run it would make again; only successful runs are kept.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kit.cache import cache_dir, touch

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
ARCHS = ["sm_75", "sm_80", "sm_90"]
SOURCES = sorted(KERNELS.glob("*.cu"))


def _builds() -> list[tuple[Path, tuple[str, ...], str]]:
    """(source, -D options, arch): conv2d.cu once per tile variant that the CUDA backend launches, the
    rest once, each for every arch in ARCHS; on sm_75 the tiles autotune runs there (`autotune_tiles(75)`:
    the one-stage trial tiles are the production tiles again)."""
    from mpiasgd.ops.cuda.planner import autotune_tiles
    from mpiasgd.ops.cuda.tiles import CONV_TILES, CONV_TRIAL_TILES, tile_defines

    builds, on_sm75 = [], autotune_tiles(75)
    for src in SOURCES:
        for tile in ((*CONV_TILES, *CONV_TRIAL_TILES) if src.name == "conv2d.cu" else [None]):
            builds += [(src, tile_defines(tile), arch) for arch in ARCHS
                       if arch != "sm_75" or tile is None or tile in on_sm75]
    return builds


BUILDS = _builds()
BUILD_IDS = [src.name + "".join("-" + d.split("=")[1] for d in defines) + "-" + arch for src, defines, arch in BUILDS]


def find_nvcc() -> str | None:
    for candidate in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "bin", "nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = find_nvcc()
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def ptxas_report(text: str) -> dict[str, tuple[int, int, int]]:
    """{kernel: (registers, spill store bytes, spill load bytes)} from `-Xptxas -v` output."""
    report, current, spills = {}, None, (0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = m.group(1)
        elif (m := _SPILL.search(line)) and current:
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := _REGS.search(line)) and current:
            report[current] = (int(m.group(1)), *spills)
            current, spills = None, (0, 0)
    return report


def test_ptxas_report_parser():
    text = ("ptxas info    : Compiling entry function 'k1' for 'sm_80'\n"
            "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem\n")
    assert ptxas_report(text) == {"k1": (255, 8, 4)}


def test_kernel_sources_present():
    assert SOURCES, f"no .cu files in {KERNELS}"


# ----------------------------------------------------------------------------------------------
# compiler runs, kept on disk and made concurrently

CACHE = cache_dir("compilers")


def cached(key: list[str], run: Callable[[], dict]) -> dict:
    """`run()`'s result (a JSON object with "status": the compiler's return code) from the disk cache under
    the hash of `key`, which must name everything the run depends on; a run with status 0 is kept."""
    path = CACHE / (hashlib.sha256("\0".join(key).encode()).hexdigest()[:24] + ".json")
    if path.exists():
        touch(path)  # used: kept by the session's prune
        return json.loads(path.read_text())
    result = run()
    if result["status"] == 0:
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{id(result)}.tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)  # atomic: concurrent sessions agree
    return result


@functools.cache
def nvcc_version() -> str:
    return subprocess.run([NVCC, "--version"], capture_output=True, text=True, timeout=60).stdout


def nvcc_command(source: Path, defines: tuple[str, ...], arch: str, out: str) -> list[str]:
    return [NVCC, "-cubin", f"-arch={arch}", *defines, "-Xptxas", "-v", "-o", out, str(source)]


def run_nvcc(source: Path, defines: tuple[str, ...], arch: str) -> dict:
    """{"status": exit status, "output": stdout + stderr} of nvcc_command (cached; the key holds the
    source with its headers inlined, which is all nvcc reads besides the toolkit's own headers)."""
    from mpiasgd.ops.cuda import runtime

    def run() -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(nvcc_command(source, defines, arch, str(Path(tmp) / "k.cubin")),
                                  capture_output=True, text=True, timeout=300)
        return {"status": proc.returncode, "output": proc.stdout + proc.stderr}

    key = ["nvcc", NVCC, nvcc_version(), source.name, runtime.kernel_source(source.name, KERNELS), *defines, arch]
    return cached(key, run)


@pytest.fixture(scope="module")
def compiled(request) -> dict:
    """{(compiler, source name, defines, arch): result} of every nvcc and NVRTC run the session's selected
    tests need, made at once (one per core at a time; NVRTC's API may be called from several threads)."""
    jobs = {}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module is not request.module or "arch" not in params or "source" not in params:
            continue
        source, defines, arch = params["source"], params["defines"], params["arch"]
        if item.originalname == "test_cubin_without_spills" and NVCC is not None:
            jobs["nvcc", source.name, defines, arch] = functools.partial(run_nvcc, source, defines, arch)
        elif item.originalname == "test_nvrtc_compiles_what_cupy_loads" and NVRTC is not None:
            jobs["nvrtc", source.name, defines, arch] = functools.partial(run_nvrtc, source, defines, arch)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
@pytest.mark.parametrize("source, defines, arch", BUILDS, ids=BUILD_IDS)
def test_cubin_without_spills(source, defines, arch, compiled):
    cmd = nvcc_command(source, defines, arch, "k.cubin")
    result = compiled["nvcc", source.name, defines, arch]
    out = result["output"]
    assert result["status"] == 0, f"{' '.join(cmd)} failed:\n{out}"
    report = ptxas_report(out)
    assert report, f"no ptxas report in:\n{out}"
    spilled = {k: v for k, v in report.items() if v[1] or v[2]}
    assert not spilled, f"{source.name} {arch}: register spills (registers, store B, load B): {spilled}\n{out}"
    for k, (regs, _, _) in sorted(report.items()):
        print(f"{source.name} {arch} {k}: {regs} registers, no spills")


# ----------------------------------------------------------------------------------------------
# NVRTC (what cupy.RawModule compiles with)


def load_nvrtc():
    """ctypes handle of libnvrtc (the test extra's wheel, else a CUDA toolkit's), or None."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        return ctypes.CDLL(load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception:  # ImportError, or the library is not installed anywhere
        return None


NVRTC = load_nvrtc()


@functools.cache
def nvrtc_identity() -> list[str]:
    """What names the loaded NVRTC: its file (path, size, mtime) and nvrtcVersion."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    NVRTC.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    st = os.stat(NVRTC._name)
    return [NVRTC._name, str(st.st_size), str(st.st_mtime_ns), f"{major.value}.{minor.value}"]
# CuPy 14 (cupy/cuda/compiler.py) appends these to RawModule's options when it compiles with NVRTC
CUPY_NVRTC_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")


def nvrtc_compile(source: str, name: str, options: list[str]) -> tuple[int, str, bytes]:
    """(nvrtcResult, program log, cubin or b"") of compiling `source` with `options`."""
    nv = NVRTC
    nv.nvrtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()
    rc = nv.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram: {nv.nvrtcGetErrorString(rc).decode()}"
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = nv.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, log)
        cubin = b""
        if rc == 0:
            nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            nv.nvrtcGetCUBIN(prog, buf)
            cubin = buf.raw
        return rc, log.value.decode(errors="replace"), cubin
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))


def test_nvrtc_reports_a_compile_error():
    """The harness can fail: a kernel with an undeclared name is refused, and the log says where."""
    if NVRTC is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12, the test extra)")
    rc, log, cubin = nvrtc_compile('extern "C" __global__ void k(float* y) { y[0] = undeclared; }',
                                   "bad.cu", ["-arch=sm_80"])
    assert rc != 0 and "undeclared" in log and cubin == b""


def nvrtc_options(defines: tuple[str, ...], arch: str) -> list[str]:
    from mpiasgd.ops.cuda import runtime

    return [*runtime.NVRTC_OPTIONS, *defines, *CUPY_NVRTC_OPTIONS, f"-arch={arch}", "--ptxas-options=-v"]


def run_nvrtc(source: Path, defines: tuple[str, ...], arch: str) -> dict:
    """{"status", "log", "cubin" (base64)} of nvrtc_compile on the text the CUDA backend hands CuPy (cached)."""
    from mpiasgd.ops.cuda import runtime

    text, options = runtime.kernel_source(source.name, KERNELS), nvrtc_options(defines, arch)

    def run() -> dict:
        rc, log, cubin = nvrtc_compile(text, source.name, options)
        return {"status": rc, "log": log, "cubin": base64.b64encode(cubin).decode()}

    return cached(["nvrtc", *nvrtc_identity(), source.name, text, *options], run)


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12, the test extra)")
@pytest.mark.parametrize("source, defines, arch", BUILDS, ids=BUILD_IDS)
def test_nvrtc_compiles_what_cupy_loads(source, defines, arch, compiled):
    from mpiasgd.ops.cuda import runtime

    options = nvrtc_options(defines, arch)
    result = compiled["nvrtc", source.name, defines, arch]
    rc, log, cubin = result["status"], result["log"], base64.b64decode(result["cubin"])
    assert rc == 0, f"NVRTC {' '.join(options)} failed on {source.name}:\n{log}"
    assert "warning" not in log.lower(), f"NVRTC warnings for {source.name} {arch}:\n{log}"
    report = ptxas_report(log)
    launched = sorted(k for k, f in runtime.KERNEL_FILES.items() if f == source.name)
    assert launched, f"the CUDA backend launches no kernel from {source.name}"
    assert set(launched) <= set(report), \
        f"{source.name} {arch}: ptxas compiled {sorted(report)}, the CUDA backend needs {launched}"
    for k in launched:  # an extern "C" kernel's name is a NUL-terminated entry of the cubin's string table
        assert b"\0" + k.encode() + b"\0" in cubin, f"{source.name} {arch}: no symbol {k} in the cubin"
    spilled = {k: v for k, v in report.items() if v[1] or v[2]}
    assert not spilled, f"{source.name} {arch}: register spills (registers, store B, load B): {spilled}\n{log}"


@pytest.mark.skipif(NVRTC is None, reason="libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12, the test extra)")
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_nvrtc_compiles_the_autotune_spin_kernel(arch):
    """device.SPIN_SOURCE (autotune's timing aid, compiled by CuPy on the GPU) compiles, names its
    kernel, and reads the global timer (a clock of fixed rate, whatever the SM clock)."""
    from mpiasgd.ops.cuda import device, runtime

    options = [*runtime.NVRTC_OPTIONS, *CUPY_NVRTC_OPTIONS, f"-arch={arch}"]
    rc, log, cubin = nvrtc_compile(device.SPIN_SOURCE, "spin.cu", options)
    assert rc == 0 and "warning" not in log.lower(), log
    assert b"\0autotune_spin\0" in cubin and "%globaltimer" in device.SPIN_SOURCE
