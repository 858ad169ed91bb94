"""Run the kernel cases in this process, plain or in the ThreadSanitizer build (which needs libtsan
preloaded: with --tsan this re-executes itself with LD_PRELOAD and TSAN_OPTIONS set, as the tests do).

    cd tests && python -m kernels_cpu.cuda_cpu.run_cases --tsan    # or: python tests/kernels_cpu/cuda_cpu/run_cases.py
    python -m kernels_cpu.cuda_cpu.run_cases --tsan --plant conv2d.cu:"everyone's have" --cases conv_wrappers
    python -m kernels_cpu.cuda_cpu.run_cases --tsan --define CONV_STAGES=1 --plant conv2d.cu:"slab complete" \
        --cases conv_wrappers

--plant FILE:TEXT removes the `__syncthreads();` on the line containing TEXT from a copy of FILE
(the kernel sources on disk are not touched); the run must then report a data race. conv2d.cu's
one-stage main loop (register prefetch) runs only with --define CONV_STAGES=1, its cp.async pipeline
only without: a barrier planted in the loop the build does not run is refused (it could report nothing).
Exit status: 0 when every case passed, 1 when one failed (ThreadSanitizer's exitcode, 66, when it
reported a race), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

PATHS = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[3])]  # tests/, the repository
if __package__ in (None, ""):  # run as a script: kernels_cpu.cuda_cpu and mpiasgd importable from anywhere
    sys.path[:0] = PATHS

from kernels_cpu.cuda_cpu import cases, harness  # noqa: E402  (after the path set-up)

ONE_STAGE_LOOP = "if (CONV_STAGES == 1) {"  # conv2d.cu: the one-stage loop, then `} else {` the pipeline


def plant_missing_sync(sources: dict[str, str], spec: str, stages: int) -> dict[str, str]:
    """Copy of `sources` with the barrier on the line of `spec` = 'file.cu:text' removed; ValueError
    for a spec that names no single barrier line, or one in a conv2d.cu main loop that a build with
    `stages` (CONV_STAGES) does not run."""
    filename, sep, marker = spec.partition(":")
    if not sep or not marker:
        raise ValueError(f"--plant {spec!r}: expected FILE:TEXT, e.g. conv2d.cu:\"everyone's have\"")
    if filename not in sources:
        raise ValueError(f"--plant {spec!r}: no kernel file {filename!r}; the files: {', '.join(sorted(sources))}")
    lines = sources[filename].split("\n")
    hits = [i for i, line in enumerate(lines) if marker in line and "__syncthreads();" in line]
    if len(hits) != 1:
        raise ValueError(f"--plant {spec}: expected one line with __syncthreads() and {marker!r}, found {len(hits)}")
    if filename == "conv2d.cu":
        begin = next(i for i, line in enumerate(lines) if ONE_STAGE_LOOP in line)
        indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
        middle = next(i for i in range(begin, len(lines)) if lines[i] == indent + "} else {")
        end = next(i for i in range(middle, len(lines)) if lines[i] == indent + "}")
        if begin < hits[0] < middle and stages != 1:
            raise ValueError(f"--plant {spec}: that barrier is in conv2d.cu's one-stage main loop, which this build "
                             f"(CONV_STAGES={stages}) does not run: add --define CONV_STAGES=1")
        if middle < hits[0] < end and stages == 1:
            raise ValueError(f"--plant {spec}: that barrier is in conv2d.cu's cp.async pipeline, which a build with "
                             "CONV_STAGES=1 does not run: drop --define CONV_STAGES=1")
    lines[hits[0]] = lines[hits[0]].replace("__syncthreads();", "/* barrier removed by --plant */")
    return {**sources, filename: "\n".join(lines)}


def tsan_loaded() -> bool:
    """Whether the ThreadSanitizer runtime is mapped into this process (it must be preloaded)."""
    try:
        with open("/proc/self/maps") as f:
            return "libtsan" in f.read()
    except OSError:
        return "libtsan" in os.environ.get("LD_PRELOAD", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tsan", action="store_true", help="use the ThreadSanitizer build (needs libtsan preloaded)")
    ap.add_argument("--plant", metavar="FILE:TEXT", help="remove the __syncthreads() on the line containing TEXT")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a macro for every kernel (-DNAME=VALUE: e.g. CONV_STAGES=1 for conv2d.cu's one-stage loop)")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--full", action="store_true", help="production block sizes too (default: <= 64 threads)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each case this many times (ThreadSanitizer keeps a few accesses per word, so a "
                         "race it missed once may show the next time)")
    args = ap.parse_args(argv)
    if args.tsan and not tsan_loaded():  # re-execute with the runtime preloaded (and the tests' TSAN_OPTIONS)
        if os.environ.get("CUDA_CPU_TSAN_REEXEC"):
            ap.error("--tsan: libtsan is still not loaded after setting LD_PRELOAD")
        try:
            env = harness.tsan_env()
        except RuntimeError as e:
            ap.error(f"--tsan: {e}")
        env["CUDA_CPU_TSAN_REEXEC"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([*PATHS, env.get("PYTHONPATH", "")])
        os.execve(sys.executable, [sys.executable, "-m", "kernels_cpu.cuda_cpu.run_cases",
                                   *(sys.argv[1:] if argv is None else argv)], env)
    if args.repeat < 1:
        ap.error(f"--repeat: expected an integer >= 1, got {args.repeat}")
    names = [case.name for case in cases.CASES]
    wanted = set(args.cases.split(",")) if args.cases else None
    if wanted is not None and wanted - set(names):
        ap.error(f"--cases: no case {', '.join(sorted(wanted - set(names)))}; the cases: {', '.join(names)}")
    sources = harness.kernel_sources()
    defines = {}
    for d in args.define:
        name, _, value = d.partition("=")
        if not name.isidentifier() or not value.lstrip("-").isdigit():
            ap.error(f"--define {d}: expected NAME=INTEGER")
        if not any(re.search(rf"\b{name}\b", text) for text in sources.values()):
            ap.error(f"--define {d}: no kernel file uses the macro {name}")
        defines[name] = int(value)
    if args.plant:
        from mpiasgd.ops.cuda.constants import CONV_STAGES

        try:
            sources = plant_missing_sync(sources, args.plant, defines.get("CONV_STAGES", CONV_STAGES))
        except ValueError as e:
            ap.error(str(e))
    lib = harness.build(tsan=args.tsan, sources=sources, defines=defines)
    failed = 0
    for case in cases.CASES:
        if wanted is not None and case.name not in wanted:
            continue
        start = time.monotonic()
        status = "ok"
        for i in range(args.repeat):
            try:
                case.run(lib, np.random.default_rng(1234 + i), not args.full)
            except AssertionError as e:  # keep going: a planted race must run to its report
                status = f"FAILED: {e}"
        failed += status != "ok"
        print(f"{case.name}: {status} ({time.monotonic() - start:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
