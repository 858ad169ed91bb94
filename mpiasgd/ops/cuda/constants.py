"""The constants that the CUDA kernels (kernels/*.cu) and their Python side share: ONE table.

kernels/constants.cuh is generated from `HEADER` below and committed; conv2d.cu, bias.cu,
softmax_xent.cu and batchnorm.cu include it, so each value is written once, here. After editing a
value, regenerate:

    python -m mpiasgd.ops.cuda.constants            # rewrites kernels/constants.cuh
    python -m mpiasgd.ops.cuda.constants --check    # exit 1 when the committed header is stale

(tests/kernels_cpu/test_cupy_wrappers.py fails while the committed header differs from `header_text()`.)
The CUDA launch limits that no .cu file uses (grid size) are here too, as the one list of limits.
Units: counts unless a name says otherwise; bytes for memory.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

# ----------------------------------------------------------------------------------------------
# conv2d.cu's default tile; `-DCONV_BM=...` etc. select a variant (tiles.tile_macros)

CONV_BM = 64  # rows of C (output channels, or C for dgrad) per block
CONV_BN = 64  # columns of C (output pixels, or filter taps for wgrad) per block
CONV_BK = 16  # reduction slab (K-slab); split-K ranges are multiples of it
CONV_TM = 4  # register block: rows per thread (4 or 8)
CONV_TN = 4  # register block: columns per thread (4 or 8)
CONV_STAGES = 3  # shared-memory stages of the main loop: a cp.async pipeline on sm_80+ (always 1 below)

# conv2d.cu, fixed
CONV_BLOCKS_PER_SM = 2  # conv GEMM blocks resident per SM: __launch_bounds__(CONV_THREADS, CONV_BLOCKS_PER_SM)
CONV_TAB_INTS = 4  # ints per tap table entry: {off, bits, a_off, 0} (16 bytes)
CONV_TAB_PAD = 128  # zero entries after a tap table's last: >= 2 * CONV_BK (one slab ahead, and the last)
CONV_TAB_MAX_TAPS = 32  # filters of at most this many taps (R*S) take the tap table: one 32-bit mask
SPLIT_REDUCE_OUTS = 32  # conv2d_split_reduce: consecutive outputs per block
SPLIT_REDUCE_THREADS_MAX = 256  # conv2d_split_reduce: threads per block (8 lanes per output), its launch size

# bias.cu, softmax_xent.cu: block sizes are powers of two up to these (static shared memory of that size)
BIAS_THREADS_MAX = 256
SOFTMAX_THREADS_MAX = 256
# batchnorm.cu: one block per channel (the channel's N*H*W elements), block size a power of two up to this
BATCHNORM_THREADS_MAX = 512

# CUDA's launch limits (every device of compute capability >= 3.0)
MAX_GRID_X = 2**31 - 1  # blocks along x
MAX_GRID_YZ = 65535  # blocks along y and along z
MAX_BLOCK_THREADS = 1024  # threads per block
MAX_STATIC_SHARED = 48 * 1024  # bytes of static shared memory per block


@dataclass(frozen=True)
class Define:
    """One `#define` of kernels/constants.cuh: NAME, its value, a comment; `default`: emitted under
    `#ifndef NAME`, so that a -DNAME=VALUE compiler option replaces it (conv2d.cu's tile variants)."""

    name: str
    value: int
    comment: str
    default: bool = False


# what kernels/constants.cuh defines, in this order (each value is the Python constant of that name)
HEADER = (
    Define("CONV_BM", CONV_BM, "rows of C (output channels) per block", default=True),
    Define("CONV_BN", CONV_BN, "columns of C (output pixels / filter taps) per block", default=True),
    Define("CONV_BK", CONV_BK, "reduction slab (split-K ranges are multiples of it)", default=True),
    Define("CONV_TM", CONV_TM, "register block: rows per thread, 4 or 8", default=True),
    Define("CONV_TN", CONV_TN, "register block: columns per thread, 4 or 8", default=True),
    Define("CONV_STAGES", CONV_STAGES, "shared-memory stages of the main loop (1 below sm_80)", default=True),
    Define("CONV_BLOCKS_PER_SM", CONV_BLOCKS_PER_SM, "conv GEMM blocks per SM asked of the compiler (launch bounds)"),
    Define("CONV_TAB_INTS", CONV_TAB_INTS, "ints per tap table entry {off, bits, a_off, 0}"),
    Define("CONV_TAB_PAD", CONV_TAB_PAD, "zero entries after a tap table's last (>= 2 slabs)"),
    Define("CONV_TAB_MAX_TAPS", CONV_TAB_MAX_TAPS, "filters of at most this many taps take the tap table"),
    Define("SPLIT_REDUCE_OUTS", SPLIT_REDUCE_OUTS, "conv2d_split_reduce: consecutive outputs per block"),
    Define("SPLIT_REDUCE_THREADS_MAX", SPLIT_REDUCE_THREADS_MAX, "conv2d_split_reduce: most threads per block"),
    Define("BIAS_THREADS_MAX", BIAS_THREADS_MAX, "bias_grad: most threads per block (a power of two)"),
    Define("SOFTMAX_THREADS_MAX", SOFTMAX_THREADS_MAX, "softmax_xent: most threads per block (a power of two)"),
    Define("BATCHNORM_THREADS_MAX", BATCHNORM_THREADS_MAX,
           "batchnorm_stats, batchnorm_bprop: most threads per block (a power of two)"),
    Define("MAX_BLOCK_THREADS", MAX_BLOCK_THREADS, "CUDA: threads per block"),
    Define("MAX_STATIC_SHARED", MAX_STATIC_SHARED, "CUDA: bytes of static shared memory per block"),
)

HEADER_NAME = "constants.cuh"
GUARD = "MPIASGD_KERNELS_CONSTANTS_CUH"


def header_text() -> str:
    """The text of kernels/constants.cuh for the `HEADER` table (include guard, one #define per entry)."""
    lines = [f"// kernels/{HEADER_NAME}: constants shared by the kernels and their Python side.",
             "// GENERATED from the table in mpiasgd/ops/cuda/constants.py: edit that table, then run",
             "//     python -m mpiasgd.ops.cuda.constants",
             "// (a test fails while this file differs from what that writes).",
             f"#ifndef {GUARD}", f"#define {GUARD}", ""]
    for d in HEADER:
        if d.default:
            lines += [f"#ifndef {d.name}", f"#define {d.name} {d.value}  // {d.comment} (default; -D{d.name}=...)",
                      "#endif"]
        else:
            lines.append(f"#define {d.name} {d.value}  // {d.comment}")
    lines += ["", f"#endif  // {GUARD}", ""]
    return "\n".join(lines)


def source_header() -> Path:
    """kernels/constants.cuh of the source checkout (the repository root's kernels/ folder)."""
    return Path(__file__).resolve().parents[3] / "kernels" / HEADER_NAME


def main(argv: list[str] | None = None) -> int:
    """Write `header_text()` to kernels/constants.cuh (or --output); with --check only compare.
    Exit status 0, or 1 with --check when the file differs (it names the file and the command)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--check", action="store_true", help="compare only: exit 1 when the file is stale")
    ap.add_argument("--output", type=Path, default=source_header(), help="the header to write (default %(default)s)")
    args = ap.parse_args(argv)
    text = header_text()
    current = args.output.read_text() if args.output.is_file() else None
    if args.check:
        if current != text:
            print(f"{args.output} is stale: run python -m mpiasgd.ops.cuda.constants", file=sys.stderr)
            return 1
        return 0
    if current != text:
        args.output.write_text(text)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
