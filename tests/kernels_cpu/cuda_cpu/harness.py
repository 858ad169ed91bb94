"""Build kernels/*.cu with g++ through the CUDA-on-CPU shim (cuda_cpu.h) and launch them via ctypes.

    lib = build()                       # or build(tsan=True), build(sources={"relu.cu": text})
    lib.kernel("relu_fprop")((blocks,), (threads,), (x, y, np.int64(n)))   # cupy.RawKernel's call form

Every `extern "C" __global__` entry point is found by parsing the sources; for each one a C++
trampoline `cpu_launch_<name>(grid, block, params...)` is generated that runs the kernel over the
grid on the shim's thread pool. Arguments are checked against the parsed parameter types before
the call: a pointer parameter needs a C-contiguous numpy array of the matching dtype, a scalar
parameter a numpy scalar of exactly the C type (np.int32 for int, np.int64 for long long,
np.float32 for float), the same rule the CuPy wrappers follow.

The .cu files include kernels/*.cuh (constants.cuh: generated from mpiasgd/ops/cuda/constants.py), found
through -I kernels/ also for a planted copy of a source. Builds are cached in the user's cache directory
(`kit.cache`: ~/.cache/mpiasgd/tests/cuda-cpu/, shared by every clone; objects per source text, headers,
shim, compiler and flags; libraries). `prebuild(specs)` compiles builds ahead in the background, one g++
per core at a time; a build asked for while its objects are being compiled waits for that compile
instead of starting its own.
A ThreadSanitizer build (`tsan=True`) can only be loaded into a process started with libtsan
preloaded (`tsan_env()`); tests run it in a subprocess (`python -m kernels_cpu.cuda_cpu.run_cases`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from kit.cache import cache_dir, touch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
KERNELS = REPO / "kernels"
SHIM = HERE / "cuda_cpu.h"

# Several builds (tile overrides, planted bugs) are loaded into one process: hidden visibility and no
# GNU-unique symbols keep each library's template instances, `__shared__` statics and shim state its
# own (otherwise the dynamic linker binds them process-wide to the first library loaded).
CXXFLAGS = ["-std=c++17", "-fPIC", "-pthread", "-fvisibility=hidden", "-fno-gnu-unique", "-Wall",
            "-Wno-unknown-pragmas", "-Wno-unused-variable"]
PLAIN_FLAGS = ["-O2"]
TSAN_FLAGS = ["-O1", "-g", "-fsanitize=thread"]

_KERNEL_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)', re.S)

# C parameter type -> (ctypes type, numpy dtype); pointers map to the dtype of the array they take
_SCALARS = {"int": (ctypes.c_int32, np.int32), "long long": (ctypes.c_int64, np.int64),
            "float": (ctypes.c_float, np.float32), "unsigned int": (ctypes.c_uint32, np.uint32)}
_POINTEES = {"float": np.float32, "int": np.int32, "unsigned char": np.uint8, "long long": np.int64}


def find_cxx() -> str | None:
    """g++ on PATH (or $CXX), else None."""
    return os.environ.get("CXX") or shutil.which("g++")


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str        # base C type without const/restrict/pointer, e.g. "float"
    pointer: bool
    decl: str         # the declaration as written (copied into the trampoline)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(_POINTEES[self.ctype] if self.pointer else _SCALARS[self.ctype][1])


@dataclass(frozen=True)
class KernelSig:
    name: str
    params: tuple[Param, ...]
    source: str       # file name under kernels/


def parse_params(text: str) -> tuple[Param, ...]:
    params = []
    for decl in (d.strip() for d in text.split(",")):
        m = re.fullmatch(r"(.*?)(\w+)", decl, re.S)
        if not m:
            raise ValueError(f"cannot parse kernel parameter {decl!r}")
        type_text, name = m.groups()
        pointer = "*" in type_text
        words = [w for w in re.split(r"[\s*]+", type_text) if w and w not in ("const", "__restrict__")]
        ctype = " ".join(words)
        table = _POINTEES if pointer else _SCALARS
        if ctype not in table:
            raise ValueError(f"kernel parameter {decl!r}: type {ctype!r} not supported by the harness")
        params.append(Param(name, ctype, pointer, decl))
    return tuple(params)


def parse_kernels(name: str, text: str) -> list[KernelSig]:
    """The `extern "C" __global__` entry points of one .cu source, in file order."""
    return [KernelSig(m.group(1), parse_params(m.group(2)), name) for m in _KERNEL_RE.finditer(text)]


def kernel_sources() -> dict[str, str]:
    """{file name: text} of every kernels/*.cu."""
    return {p.name: p.read_text() for p in sorted(KERNELS.glob("*.cu"))}


def kernel_headers() -> dict[str, str]:
    """{file name: text} of every kernels/*.cuh (what the sources include; part of every build's key)."""
    return {p.name: p.read_text() for p in sorted(KERNELS.glob("*.cuh"))}


def _trampolines(src_path: Path, sigs: list[KernelSig]) -> str:
    lines = [f'#include "{SHIM}"', f'#include "{src_path}"', ""]
    for sig in sigs:
        decls = ", ".join(p.decl for p in sig.params)
        names = ", ".join(p.name for p in sig.params)
        lines += [
            f'extern "C" __attribute__((visibility("default"))) void cpu_launch_{sig.name}('
            f"unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, {decls}) {{",
            f"  cudacpu::launch(dim3(gx, gy, gz), dim3(bx, by, bz), [=] {{ {sig.name}({names}); }});",
            "}", ""]
    return "\n".join(lines)


class KernelLib:
    """A loaded harness library; `kernel(name)` returns a launcher with cupy.RawKernel's call form."""

    def __init__(self, path: Path, sigs: dict[str, KernelSig], defines: Mapping[str, int], tsan: bool = False,
                 sources: Mapping[str, str] | None = None) -> None:
        self.path = path
        self.sigs = sigs
        self.defines = dict(defines)  # -D macros the kernels were built with (tile overrides)
        self.tsan = tsan
        self.sources = None if sources is None else dict(sources)
        self._dll = ctypes.CDLL(str(path))
        self._variants: dict[tuple, KernelLib] = {}

    def variant(self, defines: Mapping[str, int]) -> KernelLib:
        """This library rebuilt with `defines` added (same sources, same ThreadSanitizer setting): the
        conv tile variants that the CUDA backend launches. Built once per library and define set."""
        merged = {**self.defines, **defines}
        if merged == self.defines:
            return self
        key = tuple(sorted(merged.items()))
        if key not in self._variants:
            self._variants[key] = build(self.tsan, self.sources, merged)
        return self._variants[key]

    def kernel(self, name: str) -> Launcher:
        if name not in self.sigs:
            raise KeyError(f"no kernel {name!r} in {sorted(self.sigs)}")
        return Launcher(self.sigs[name], getattr(self._dll, f"cpu_launch_{name}"))


class Launcher:
    """Callable `(grid, block, args, shared_mem=0)` like cupy.RawKernel, running on the CPU shim."""

    def __init__(self, sig: KernelSig, fn) -> None:
        self.sig = sig
        self._fn = fn
        fn.restype = None
        fn.argtypes = [ctypes.c_uint] * 6 + [
            ctypes.c_void_p if p.pointer else _SCALARS[p.ctype][0] for p in sig.params]

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        sig = self.sig
        if shared_mem:
            raise ValueError(f"{sig.name}: the kernels use static shared memory only, got shared_mem={shared_mem}")
        if len(args) != len(sig.params):
            raise TypeError(f"{sig.name}: expected {len(sig.params)} arguments, got {len(args)}")
        grid, block = (*grid, 1, 1)[:3], (*block, 1, 1)[:3]
        c_args = []
        for p, a in zip(sig.params, args, strict=True):
            if p.pointer:
                if a is None:
                    c_args.append(None)
                    continue
                if not isinstance(a, np.ndarray) or a.dtype != p.dtype or not a.flags.c_contiguous:
                    raise TypeError(f"{sig.name}: {p.decl} needs a C-contiguous {p.dtype} array, got "
                                    f"{type(a).__name__} {getattr(a, 'dtype', '')} "
                                    f"{'' if not isinstance(a, np.ndarray) else a.flags.c_contiguous}")
                c_args.append(a.ctypes.data)
            else:
                if not isinstance(a, np.generic) or a.dtype != p.dtype:
                    raise TypeError(f"{sig.name}: {p.decl} needs a {p.dtype} scalar, got {type(a).__name__}")
                c_args.append(a.item())
        self._fn(*(int(v) for v in grid), *(int(v) for v in block), *c_args)


CACHE = cache_dir("cuda-cpu")


class _Compiles:
    """The compiles of this process: each output path is made by one g++ run at a time (a second asker waits
    for the first one's result), and at most one g++ per core runs at once, whoever asks."""

    def __init__(self, cores: int) -> None:
        self._lock = threading.Lock()
        self._running: dict[Path, Future] = {}
        self.cores = threading.BoundedSemaphore(cores)

    def once(self, out: Path, make: Callable[[], None]) -> Path:
        """`out` after `make()` wrote it, unless it exists; concurrent askers of the same `out` share one run."""
        with self._lock:
            if out.exists():
                touch(out.parent)
                return out
            running = self._running.get(out)
            if running is None:
                running = self._running[out] = Future()
                mine = True
            else:
                mine = False
        if not mine:
            return running.result()
        try:
            with self.cores:
                make()
            running.set_result(out)
        except BaseException as e:
            running.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._running[out]
        return out


_COMPILES = _Compiles(os.cpu_count() or 1)


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _object(cxx: str, flags: list[str], name: str, text: str, defines: Mapping[str, int] | None = None) -> Path:
    """The object file of one .cu under the shim, compiled with `flags` and -D `defines` once per (shim,
    headers, compiler, flags, text, what the defines change in the text: `define_effect`)."""
    headers = [part for item in kernel_headers().items() for part in item]
    effect = define_effect(cxx, flags, text, defines or {})
    d = _mkdir(CACHE / "obj" / _digest(SHIM.read_text(), *headers, cxx, *CXXFLAGS, *flags, name, text,
                                       *([] if effect is None else [effect])))
    if effect is not None:
        flags = flags + [f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
    obj = d / (name + ".o")

    def make() -> None:
        cu, tramp = d / name, d / (name + ".cpp")
        cu.write_text(text)  # same content whoever writes it; the path shows in ThreadSanitizer reports
        tramp.write_text(_trampolines(cu, parse_kernels(name, text)))
        tmp = d / f"{name}.{os.getpid()}.{threading.get_ident()}.o"
        cmd = [cxx, *CXXFLAGS, *flags, f"-I{KERNELS}", "-c", str(tramp), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed on {name}:\n{' '.join(cmd)}\n{proc.stderr}")
        os.replace(tmp, obj)  # atomic: another process building the same key agrees

    return _COMPILES.once(obj, make)


def define_effect(cxx: str, flags: list[str], text: str, defines: Mapping[str, int]) -> str | None:
    """What `defines` change in the source `text` (compiled with `flags`), as the part of its object's cache
    key that stands for them: None where they change nothing (a tile macro given to a file that never reads
    it: the plain build's object serves), else the source as g++ preprocesses it with them (two sets that
    make the same text, such as a default spelled out, share one object), else (a source that does not
    preprocess alone) the -D options themselves. A macro named in the shim always counts."""
    if not defines:
        return None
    key = tuple(sorted(defines.items()))
    spelled = "defines:" + " ".join(f"-D{k}={v}" for k, v in key)
    names = re.compile(r"\b(" + "|".join(map(re.escape, defines)) + r")\b")
    if names.search(SHIM.read_text()):
        return spelled
    if not names.search(text) and not any(names.search(h) for h in kernel_headers().values()):
        return None
    plain, defined = _preprocessed(cxx, tuple(flags), text, ()), _preprocessed(cxx, tuple(flags), text, key)
    if plain is None or defined is None:
        return spelled
    return None if plain == defined else "preprocessed:" + defined


@functools.lru_cache(maxsize=4096)
def _preprocessed(cxx: str, flags: tuple[str, ...], text: str, defines: tuple[tuple[str, int], ...]) -> str | None:
    """`text` through g++'s preprocessor (no line markers; its #include "x.cuh" found in kernels/), or None
    where g++ refuses it."""
    cmd = [cxx, *CXXFLAGS, *flags, *(f"-D{k}={v}" for k, v in defines), f"-I{KERNELS}", "-E", "-P", "-x", "c++",
           "-"]
    proc = subprocess.run(cmd, input=text, capture_output=True, text=True, cwd=KERNELS)
    return proc.stdout if proc.returncode == 0 else None


def build(tsan: bool = False, sources: Mapping[str, str] | None = None,
          defines: Mapping[str, int] | None = None) -> KernelLib:
    """Compile `sources` ({file name: CUDA text}; default: every kernels/*.cu) into one shared library and
    load it (a ThreadSanitizer build only into a process started with `tsan_env()`).

    `defines` are passed as -DNAME=VALUE (the tile overrides a kernel allows, e.g. CONV_BM).
    Each .cu is its own translation unit (its macros stay private). Raises RuntimeError with
    g++'s output when a source does not compile under the shim.
    """
    sources = dict(kernel_sources() if sources is None else sources)
    lib_path, sigs = library(tsan, sources, defines)
    return KernelLib(lib_path, sigs, dict(defines or {}), tsan, sources)


def library(tsan: bool = False, sources: Mapping[str, str] | None = None,
            defines: Mapping[str, int] | None = None) -> tuple[Path, dict[str, KernelSig]]:
    """`build`'s shared library compiled (or found in the cache) but not loaded: (its path, its kernels by
    name). Raises as `build` does."""
    cxx = find_cxx()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found")
    sources = dict(kernel_sources() if sources is None else sources)
    defines = dict(defines or {})
    flags = (TSAN_FLAGS if tsan else PLAIN_FLAGS) + [f"-D{k}={v}" for k, v in sorted(defines.items())]
    sigs: dict[str, KernelSig] = {}
    for name, text in sources.items():
        for sig in parse_kernels(name, text):
            if sig.name in sigs:
                raise ValueError(f"kernel {sig.name} defined in both {sigs[sig.name].source} and {name}")
            sigs[sig.name] = sig
    base = TSAN_FLAGS if tsan else PLAIN_FLAGS
    # one cached object per (source, flags, what the defines change): a planted variant recompiles only the
    # file it changes, and a tile variant only conv2d.cu (the others are the plain build's objects)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objs = list(pool.map(lambda item: _object(cxx, base, *item, defines), sorted(sources.items())))
    lib_path = CACHE / "lib" / _digest(*map(str, objs), *flags) / ("kernels_tsan.so" if tsan else "kernels.so")

    def link() -> None:
        _mkdir(lib_path.parent)
        tmp_lib = lib_path.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, *CXXFLAGS, *flags, "-shared", *map(str, objs), "-o", str(tmp_lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ link failed:\n{' '.join(cmd)}\n{proc.stderr}")
        os.replace(tmp_lib, lib_path)  # atomic: concurrent builds of the same key agree

    return _COMPILES.once(lib_path, link), sigs


def prebuild(specs: Iterable[tuple[bool, Mapping[str, int]]]) -> ThreadPoolExecutor:
    """Start compiling each (tsan, defines) build of every kernels/*.cu in the background, in the order given,
    and return the pool doing it (its threads end with the work; `shutdown(cancel_futures=True)` drops the
    rest). A compile that fails is left for the test that asks for that build to report."""
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="prebuild")
    for tsan, defines in specs:
        pool.submit(library, tsan, None, defines)
    return pool


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def libtsan() -> str | None:
    """Path of the g++ ThreadSanitizer runtime, or None if this g++ has none."""
    cxx = find_cxx()
    if cxx is None:
        return None
    path = subprocess.run([cxx, "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def tsan_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a Python subprocess that loads a ThreadSanitizer build."""
    env = dict(os.environ if base is None else base)
    lib = libtsan()
    if lib is None:
        raise RuntimeError("g++ has no libtsan")
    env["LD_PRELOAD"] = lib
    # exitcode: a report fails the run; history_size: keep enough per-thread history that a race
    # between barrier phases far apart in time is still seen
    env["TSAN_OPTIONS"] = "exitcode=66 halt_on_error=0 report_signal_unsafe=0 history_size=4"
    return env
