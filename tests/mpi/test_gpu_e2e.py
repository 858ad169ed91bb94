"""bench/gpu_e2e.py --dry-run end to end: every part of the prepared GPU script on the cpu backend at tiny sizes,
so that device time is never lost to a typo. The script launches its own mpiexec jobs (part 1's `train` run, part
2's runs, part 3's 2-rank hops job, part 4's race), each under its --timeout; the script runs under the test's.
PyTorch is no test dependency: without it the PyTorch sides say "not installed" and the rest is checked.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

from kit import REPO
from kit.launch import mpi_env

JOB_TIMEOUT = 120.0  # seconds per mpiexec job (the script's --timeout)
HAS_TORCH = importlib.util.find_spec("torch") is not None


def positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


def test_gpu_e2e_dry_run_writes_every_part(tmp_path):
    """Through the device call's wrapper (bench/gpu_e2e.sh --dry-run: the script, then the threaded update's sweep)."""
    env = {**mpi_env(), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_e2e.sh"), "--dry-run", "--timeout", f"{JOB_TIMEOUT:g}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    result = json.loads((tmp_path / "out" / "gpu_e2e.json").read_text())
    text = (tmp_path / "out" / "gpu_e2e.md").read_text()
    assert result["meta"]["dry_run"] and result["meta"]["backend"] == "cpu"
    parts = result["parts"]
    assert list(parts) == ["step", "alexnet", "hops", "race"]
    assert not [name for name, part in parts.items() if "error" in part]
    assert all(f"## {name} (" in text for name in parts)

    step = parts["step"]
    for net in ("cifar10", "resnet20"):
        row = step[net]
        assert positive(row["ours_eager"]["ms"]) and row["ours_eager"]["min_ms"] <= row["ours_eager"]["ms"]
        if HAS_TORCH:
            torch = row["torch"]
            assert positive(torch["eager"]["ms"]) and positive(torch["graphs"]["ms"]) and torch["graphs"]["emulated"]
            assert close(row["ratios"]["ours_eager/torch_eager"], row["ours_eager"]["ms"] / torch["eager"]["ms"])
            assert close(row["ratios"]["ours_eager/torch_graphs"], row["ours_eager"]["ms"] / torch["graphs"]["ms"])
            assert row["first_loss_diff"] < 1e-3  # the same weights and batch: both start at ln(10)
        else:
            assert step["torch"] == "not installed" and "torch" not in row
    train = step["cifar10"]["ours_train"]
    runs = [v for v in train.values() if isinstance(v, dict)]
    assert runs and all(positive(r["compute_ms"]) and positive(r["step_ms"]) for r in runs)
    assert train["graphs"] == "built" and "--mode sync" in runs[0]["command"]
    assert list(train) == ["graphs", "graphs auto", "graphs off"]
    assert "--cuda-graphs auto" in train["graphs auto"]["command"]
    assert step["cifar10"]["ours_graphs"] == {"ms": None, "why": "needs the cupy backend"}
    assert "| needs the cupy backend |" in text

    alexnet = parts["alexnet"]
    ceiling = alexnet["ceiling"]["images_per_s"]
    assert positive(ceiling) and "--mode sync" in alexnet["ceiling"]["command"]
    runs = {(r["nsync"], r["servers"], r["wire"], r["overlap"]): r for r in alexnet["runs"]}
    assert list(runs) == [(4, 1, "bf16", True), (1, 2, "fp32", False), (1, 2, "fp32", True)]
    assert [r["status"] for r in runs.values()] == ["ran"] * 3  # (--overlap with --servers 2 included)
    for r in runs.values():
        if r["status"] == "ran":
            assert positive(r["images_per_s"]) and close(r["ratio"], r["images_per_s"] / ceiling)
            assert 0 <= r["wait_share"] <= 1 and r["pushes"] > 0 and positive(r["compute_ratio"])

    hops = parts["hops"]
    assert list(hops["hops"]) == ["d2h", "push", "check", "update", "reply", "h2d"]
    assert hops["params"] == 1 << 16 and hops["bytes"] == 4 << 16
    for hop in hops["hops"].values():
        assert positive(hop["ms"]) and positive(hop["floor_ms"]) and close(hop["ratio"], hop["ms"] / hop["floor_ms"])
    assert close(hops["total_ms"], sum(h["ms"] for h in hops["hops"].values()))
    assert close(hops["total_ratio"], hops["total_ms"] / hops["total_floor_ms"])

    race = parts["race"]
    ours = race["runs"]["mpiasgd sync (cpu)"]
    assert positive(ours["time_to_target_s"]) and positive(ours["images_per_s"]) and ours["evals"]
    if HAS_TORCH:
        theirs = race["runs"]["PyTorch (cpu)"]
        assert positive(theirs["time_to_target_s"]) and theirs["evals"]
        assert close(race["ratio"], ours["time_to_target_s"] / theirs["time_to_target_s"])
    assert positive(result["wall_s"]["total"])
