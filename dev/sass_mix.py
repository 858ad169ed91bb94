"""Static instruction mix of the conv kernels' main loop, from their machine code (no GPU needed).

For each implicit-GEMM conv kernel (fprop, dgrad, wgrad_partial), each tile variant that the CUDA
backend launches (mpiasgd.ops.cuda.tiles) and each architecture, compile kernels/conv2d.cu with nvcc
to a cubin, disassemble it with nvdisasm, find the loops with the most FFMA (the K-slab loop: BK x 4
x 4 FFMA per thread, once per instantiation: conv2d_fprop and conv2d_wgrad_partial have two, with
the tap table and testing bounds for filters of more than 32 taps; conv2d_dgrad three, those two for
stride 1 and one for stride > 1) and print each one's length in instructions and the share that is
FFMA. One warp scheduler issues one instruction per cycle, so the FFMA share bounds the fraction of
FP32 peak the loop can reach (memory stalls and occupancy come on top); it is a proxy to compare
kernel versions on a machine without a GPU, not a GPU measurement.

    python dev/sass_mix.py                         # this checkout
    python dev/sass_mix.py --against HEAD~1        # side by side with another git revision

Needs nvcc (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin) and nvdisasm (PATH, or the pip wheel
`nvidia-cuda-nvdisasm`). Exit status 2, with one line saying which, when either is missing.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpiasgd.ops.cuda.constants import CONV_BM, CONV_BN, HEADER_NAME  # noqa: E402  (after the path set-up)
from mpiasgd.ops.cuda.tiles import CONV_TILES, CONV_TRIAL_TILES, tile_defines, tile_name  # noqa: E402

# rows of the table: (kernel, which of its hot loops, shortest first, label). The hot loops of each
# kernel, in this order by length: LOOPS of them in this checkout, fewer in older revisions (one
# instantiation per kernel before the tap table; dgrad's strided one is always the longest).
ROWS = (("conv2d_fprop", 0, "tap table"), ("conv2d_fprop", 1, "R*S > 32"),
        ("conv2d_dgrad", 0, "stride 1, tap table"), ("conv2d_dgrad", 1, "stride 1, R*S > 32"),
        ("conv2d_dgrad", -1, "stride > 1"), ("conv2d_wgrad_partial", 0, "tap table"),
        ("conv2d_wgrad_partial", 1, "R*S > 32"))
LOOPS = {"conv2d_fprop": 2, "conv2d_dgrad": 3, "conv2d_wgrad_partial": 2}
KERNELS = tuple(dict.fromkeys(k for k, _, _ in ROWS))  # the kernels measured, in table order
ARCHS = ("sm_80", "sm_90")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"BRA\s+(?:`\(\.L_x_(\d+)\)|\.L_x_(\d+))")
_LABEL = re.compile(r"^\.L_x_(\d+):")


def find_tool(name: str) -> str | None:
    """`name` on PATH, in a CUDA toolkit, or in an nvidia-* pip wheel's bin folder."""
    places = [shutil.which(name), os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "bin", name),
              f"/usr/local/cuda/bin/{name}"]
    places += glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "bin", name))
    return next((p for p in places if p and os.path.isfile(p) and os.access(p, os.X_OK)), None)


def function_bodies(sass: str) -> dict[str, list[str]]:
    """{kernel: its lines} from nvdisasm's text (a `.text.NAME:` section per kernel)."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        if m := re.match(r"\s*\.text\.(\w+):", line):
            current = m.group(1)
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    return bodies


def hot_loops(lines: list[str]) -> list[tuple[int, int, dict[str, int]]]:
    """[(instructions, FFMA, {opcode: count})] of the backward-branch loops holding the most FFMA, shortest
    first (conv2d_dgrad has two: its unit-stride and its strided instantiation)."""
    label_at: dict[str, int] = {}  # label -> index of the next instruction
    insns: list[str] = []
    for line in lines:
        if m := _LABEL.match(line.strip()):
            label_at[m.group(1)] = len(insns)
        elif m := _INSN.search(line):
            insns.append(m.group(2).strip())
    loops: dict[tuple[int, int], tuple[int, int, dict[str, int]]] = {}
    for i, insn in enumerate(insns):
        m = _BRANCH.search(insn)
        if not m:
            continue
        start = label_at.get(m.group(1) or m.group(2))
        if start is None or start > i:
            continue  # forward branch
        body = insns[start:i + 1]
        ops: dict[str, int] = {}
        for b in body:
            words = b.split()
            op = words[1] if words[0].startswith("@") else words[0]
            op = op.split(".")[0]
            ops[op] = ops.get(op, 0) + 1
        loops[(start, i)] = (len(body), ops.get("FFMA", 0), ops)
    most = max((v[1] for v in loops.values()), default=0)
    return sorted(v for v in loops.values() if most and v[1] == most)


def pick(kernel: str, loops: list, which: int):
    """Row `which` of ROWS from a revision's hot loops of `kernel` (shortest first), or None. The first
    and the last are always the production and the strided loop; a middle one exists only where the
    revision has all of LOOPS[kernel] (an older one shows n/a there, not another loop)."""
    if not loops or (which not in (0, -1) and len(loops) != LOOPS[kernel]):
        return None
    return loops[which]


class ToolError(RuntimeError):
    """A tool (nvcc, nvdisasm, git) failed; the message holds its command and output."""


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        out = (proc.stderr or proc.stdout).strip()
        raise ToolError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{out}")
    return proc.stdout


def tiles_of(source: str, header: str | None = None) -> list[tuple[int, ...]]:
    """The tile variants a conv2d.cu text (and the constants.cuh it includes, None for a revision
    before it) can be compiled for: every one of CONV_TILES when its tile macros take -D overrides,
    and the trial tiles when its register block does too; else only its built-in tile (an older
    revision), which is shown as 64x64 (the default of both)."""
    header = header or ""
    if "#ifndef CONV_BM" not in source + header:
        return [(CONV_BM, CONV_BN)]
    return [*CONV_TILES, *(CONV_TRIAL_TILES if "#ifndef CONV_TM" in source + header else ())]


def mix(source: str, header: str | None, nvcc: str, nvdisasm: str, tile: tuple[int, ...],
        arch: str) -> dict[str, list[tuple[int, int]]]:
    """{kernel: [(loop instructions, loop FFMA)] of its hot loops, shortest first} of conv2d.cu text
    `source` (with `header` as the constants.cuh beside it; None: a revision without one) for one tile
    and arch."""
    with tempfile.TemporaryDirectory() as d:
        cu, cubin = Path(d) / "conv2d.cu", Path(d) / "conv2d.cubin"
        cu.write_text(source)
        if header is not None:
            (Path(d) / HEADER_NAME).write_text(header)
        _run([nvcc, "-cubin", f"-arch={arch}", *tile_defines(tile), "-o", str(cubin), str(cu)])
        sass = _run([nvdisasm, "-c", str(cubin)])
    bodies = function_bodies(sass)
    return {k: [loop[:2] for loop in hot_loops(bodies[k])] for k in KERNELS if k in bodies}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", metavar="REV", help="also measure kernels/conv2d.cu of this git revision")
    ap.add_argument("--archs", default=",".join(ARCHS), help="comma-separated sm_XX list (default %(default)s)")
    args = ap.parse_args(argv)
    nvcc, nvdisasm = find_tool("nvcc"), find_tool("nvdisasm")
    if nvcc is None or nvdisasm is None:
        print(f"dev/sass_mix.py: needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm); "
              f"nvcc {nvcc or 'missing'}, nvdisasm {nvdisasm or 'missing'}", file=sys.stderr)
        return 2
    archs = [a.strip() for a in args.archs.split(",")]
    bad = [a for a in archs if not re.fullmatch(r"sm_\d+", a)]
    if bad:
        print(f"dev/sass_mix.py: --archs: expected sm_XX names (e.g. sm_80,sm_90), got {bad}", file=sys.stderr)
        return 2
    kernels = ROOT / "kernels"
    versions = {"this checkout": ((kernels / "conv2d.cu").read_text(), (kernels / HEADER_NAME).read_text())}
    try:
        if args.against:
            source = _run(["git", "-C", str(ROOT), "show", f"{args.against}:kernels/conv2d.cu"])
            header = None
            if f'#include "{HEADER_NAME}"' in source:  # (revisions before the generated header have none)
                header = _run(["git", "-C", str(ROOT), "show", f"{args.against}:kernels/{HEADER_NAME}"])
            versions[args.against] = (source, header)
        return _table(versions, archs, nvcc, nvdisasm)
    except ToolError as e:
        print(f"dev/sass_mix.py: {e}", file=sys.stderr)
        return 1


def _table(versions: dict[str, tuple[str, str | None]], archs: list[str], nvcc: str, nvdisasm: str) -> int:
    print(f"{'kernel':<36} {'tile':>13} {'arch':>6} " + " ".join(f"{v[:22]:>24}" for v in versions)
          + ("   FFMA share ratio" if len(versions) > 1 else ""))
    for arch in archs:
        for tile in (*CONV_TILES, *CONV_TRIAL_TILES):
            results = [mix(src, header, nvcc, nvdisasm, tile, arch) if tile in tiles_of(src, header) else None
                       for src, header in versions.values()]
            for k, which, label in ROWS:
                cells, shares = [], []
                for r in results:
                    loop = None if r is None else pick(k, r.get(k, []), which)
                    if loop is None:  # a revision without this tile variant, kernel or instantiation
                        cells.append("n/a")
                        shares.append(None)
                        continue
                    n, ffma = loop
                    shares.append(ffma / n if n else 0.0)
                    cells.append(f"{n:4d} insns, {shares[-1]:5.1%} FFMA")
                ratio = f"   {shares[0] / shares[1]:.2f}" if len(shares) > 1 and shares[0] and shares[1] else ""
                name = f"{k} ({label})" if label else k
                print(f"{name:<36} {tile_name(tile):>13} {arch:>6} " + " ".join(f"{c:>24}" for c in cells)
                      + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
