"""Every kernels/*.cu compiles with nvcc to a cubin for sm_75, sm_80 and sm_90 without register spills.

`nvcc -cubin -Xptxas -v` prints per kernel "N bytes spill stores, M bytes spill loads"; any nonzero
value fails (a spill turns register blocking into local-memory traffic). nvcc 13 has no sm_70.
Skipped when nvcc is absent (looked up on PATH, then $CUDA_HOME/bin, /usr/local/cuda/bin).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
ARCHS = ["sm_75", "sm_80", "sm_90"]
SOURCES = sorted(KERNELS.glob("*.cu"))


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


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_cubin_without_spills(source, arch, tmp_path):
    cmd = [NVCC, "-cubin", f"-arch={arch}", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out}"
    report = ptxas_report(out)
    assert report, f"no ptxas report in:\n{out}"
    spilled = {k: v for k, v in report.items() if v[1] or v[2]}
    assert not spilled, f"{source.name} {arch}: register spills (registers, store B, load B): {spilled}\n{out}"
    for k, (regs, _, _) in sorted(report.items()):
        print(f"{source.name} {arch} {k}: {regs} registers, no spills")
