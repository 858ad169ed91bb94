"""Run the kernel cases in this process, for the ThreadSanitizer build (which needs libtsan preloaded).

    cd tests && LD_PRELOAD=$(g++ -print-file-name=libtsan.so) python -m cuda_cpu.run_cases --tsan
    python -m cuda_cpu.run_cases --tsan --plant conv2d.cu:"everyone's have" --cases conv_wrappers
    python -m cuda_cpu.run_cases --tsan --define CONV_STAGES=1 --plant conv2d.cu:"slab complete" --cases conv_wrappers

--plant FILE:TEXT removes the `__syncthreads();` on the line containing TEXT from a copy of FILE
(the kernel sources on disk are not touched); the run must then report a data race.
Exit status: 0 when every case passed, 1 when one failed (ThreadSanitizer's exitcode, 66, when it
reported a race).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from cuda_cpu import cases, harness


def plant_missing_sync(sources: dict[str, str], spec: str) -> dict[str, str]:
    """Copy of `sources` with the barrier on the line of `spec` = 'file.cu:text' removed."""
    filename, marker = spec.split(":", 1)
    lines = sources[filename].split("\n")
    hits = [i for i, line in enumerate(lines) if marker in line and "__syncthreads();" in line]
    if len(hits) != 1:
        raise SystemExit(f"--plant {spec}: expected one line with __syncthreads() and {marker!r}, found {len(hits)}")
    lines[hits[0]] = lines[hits[0]].replace("__syncthreads();", "/* barrier removed by --plant */")
    return {**sources, filename: "\n".join(lines)}


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
    sources = harness.kernel_sources()
    if args.plant:
        sources = plant_missing_sync(sources, args.plant)
    defines = {}
    for d in args.define:
        name, _, value = d.partition("=")
        if not name.isidentifier() or not value.lstrip("-").isdigit():
            raise SystemExit(f"--define {d}: expected NAME=INTEGER")
        defines[name] = int(value)
    lib = harness.build(tsan=args.tsan, sources=sources, defines=defines)
    wanted = set(args.cases.split(",")) if args.cases else None
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
