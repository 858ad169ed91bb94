"""The harness's build cache: in the user's cache directory (shared by every clone and TMPDIR), one g++ run
per output however many threads ask for it, and entries unused for a month pruned."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kit import cache

from kernels_cpu.cuda_cpu import harness

pytestmark = pytest.mark.skipif(harness.find_cxx() is None,
                                reason="no g++: the CUDA-on-CPU harness needs a C++17 compiler")

TESTS = Path(__file__).resolve().parents[1]
TINY = 'extern "C" __global__ void twice(float* x, int n) { if (threadIdx.x < n) x[threadIdx.x] *= 2.0f; }\n'


def build_in_a_clone(home: Path, tmpdir: Path) -> str:
    """The path of the tiny kernel's library as a fresh process with this HOME and TMPDIR builds it (no
    XDG_CACHE_HOME or MPIASGD_TEST_CACHE), after checking that it computes."""
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "MPIASGD_TEST_CACHE")}
    env.update(HOME=str(home), TMPDIR=str(tmpdir), PYTHONPATH=os.pathsep.join([str(TESTS), str(TESTS.parent)]))
    code = ("import numpy as np\nfrom kernels_cpu.cuda_cpu import harness\n"
            f"lib = harness.build(sources={{'tiny.cu': {TINY!r}}})\n"
            "x = np.arange(4, dtype=np.float32)\nlib.kernel('twice')((1,), (4,), (x, np.int32(4)))\n"
            "assert x.tolist() == [0, 2, 4, 6], x\nprint(lib.path)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_builds_live_in_the_users_cache_directory_whatever_the_tmpdir(tmp_path):
    """Two processes with other TMPDIRs (two clones, two CI runs) find one build under ~/.cache/mpiasgd/tests."""
    home = tmp_path / "home"
    home.mkdir()
    first = build_in_a_clone(home, tmp_path / "t1")
    built = Path(first).stat().st_mtime_ns
    second = build_in_a_clone(home, tmp_path / "t2")
    assert first == second and Path(first).is_relative_to(home / ".cache" / "mpiasgd" / "tests" / "cuda-cpu")
    assert Path(second).stat().st_mtime_ns == built, "the second process linked the library again"


def test_threads_asking_for_one_build_share_one_compile(tmp_path):
    """Four threads asking for the same new build at once: one g++ compile and one link, and all get it. (In a
    process of its own, with a cache of its own and a g++ that logs its runs: the session's prebuild threads
    compile in this one.)"""
    log = tmp_path / "runs.log"
    cxx = tmp_path / "logging-g++"
    cxx.write_text(f'#!/bin/sh\necho "$*" >> {log}\nsleep 0.3\nexec {harness.find_cxx()} "$@"\n')
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "MPIASGD_TEST_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    code = ("import threading\nfrom kernels_cpu.cuda_cpu import harness\ngot = []\n"
            f"ask = lambda: got.append(harness.library(sources={{'tiny.cu': {TINY!r}}})[0])\n"
            "threads = [threading.Thread(target=ask) for _ in range(4)]\n"
            "[t.start() for t in threads]\n[t.join(60) for t in threads]\n"
            "assert len(got) == 4 and len(set(got)) == 1 and got[0].exists(), got\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs = log.read_text().splitlines()
    assert len(runs) == 2, f"g++ ran {len(runs)} times (one compile and one link expected): {runs}"


def test_prune_removes_what_a_month_has_not_used(tmp_path):
    old, fresh = tmp_path / "old", tmp_path / "fresh"
    (old / "sub").mkdir(parents=True)
    fresh.mkdir()
    month = time.time() - 31 * 86400
    os.utime(old, (month, month))
    assert cache.prune(tmp_path) == 1
    assert not old.exists() and fresh.exists()
    cache.touch(fresh)
    assert cache.prune(tmp_path, days=0.0001) == 0
