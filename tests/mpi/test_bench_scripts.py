"""bench/resnet20_torch.py (its mpiasgd half: --skip-torch; PyTorch is no test dependency) and
bench/decoupling.py end to end, a few minibatches each, on the tiny CIFAR-10 of the tests (resnet20 needs
3x32x32 images: 100 training, 10 test): each script launches its own `mpiexec` jobs, reads their run logs and
prints its table. bench/simulate_validate.py likewise on digits: a real run of 3 workers and its fitted
simulation. Their pure logic: tests/unit/test_bench.py.

Each script's jobs run under its own --timeout (it ends mpiexec and every rank at the limit); the script
itself runs under a timeout of the test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kit import REPO
from kit.cifar import write_dataset_file
from kit.launch import find_launcher, mpi_env

TIMEOUT = 60.0  # seconds per mpiexec job (the scripts' --timeout); a run here takes a few seconds when idle


def run_script(script: str, args: list[str], cwd, jobs: int) -> subprocess.CompletedProcess:
    """`python bench/SCRIPT ARGS` in `cwd`, with the harness's MPI environment (root, oversubscription)."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args, "--timeout", f"{TIMEOUT:g}"],
                          cwd=cwd, env=mpi_env(), capture_output=True, text=True,
                          timeout=jobs * (TIMEOUT + 40) + 60)  # the script's own time limits come first
    assert done.returncode == 0, f"exit {done.returncode}\n--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    return done


def test_resnet20_torch_script_runs_mpiasgd_and_reads_its_log(tmp_path, tiny_cifar):
    data_dir, _ = tiny_cifar
    done = run_script("resnet20_torch.py", ["--skip-torch", "--epochs", "0.5", "--batch-size", "8", "--subset", "3",
                                            "--data-dir", str(data_dir), "--run-dir", "r", "--json", "out.json"],
                      tmp_path, jobs=1)
    assert "SUBSET: 3 minibatches only" in done.stdout
    assert "| mpiasgd | " in done.stdout and "| PyTorch |" not in done.stdout
    assert "mpiasgd within 1 point of PyTorch: not assessed (only one of the two ran)" in done.stdout
    out = json.loads((tmp_path / "out.json").read_text())
    ours = out["results"]["mpiasgd"]
    assert out["subset"] and out["steps"] == ours["steps"] == 3 and ours["images"] == 24
    assert 0 <= ours["test_accuracy"] <= 1 and len(ours["extra"]["losses"]) == 3
    assert "--mode sync" in out["commands"][0] and "--max-pushes 3" in out["commands"][0]


def test_decoupling_script_runs_k1_and_k2_and_prints_the_table(tmp_path, tiny_cifar):
    data_dir, _ = tiny_cifar
    done = run_script("decoupling.py", ["--rows", "K1,K2-b0.5-store", "--epochs", "0.5", "--batch-size", "8",
                                        "--subset", "3", "--data-dir", str(data_dir), "--run-dir", "r",
                                        "--json", "out.json"], tmp_path, jobs=2)
    table = [line for line in done.stdout.splitlines() if line.startswith("| K")]
    assert [line.split(" | ")[0] for line in table] == ["| K1", "| K2-b0.5-store"]
    assert table[0].startswith("| K1 | 1 | 1 | - | - | ")
    assert table[1].startswith("| K2-b0.5-store | 2 | 0.5 | store | 7 | ")
    out = json.loads((tmp_path / "out.json").read_text())
    assert [r["name"] for r in out["rows"]] == ["K1", "K2-b0.5-store"] and out["activations_option"]
    assert all(0 <= r["test_accuracy"] <= 1 and r["epochs"] == 0.24 for r in out["rows"])  # 3 x 8 of 100 images
    assert out["goal"].startswith("K = 2 within 1.5 points of K = 1: ") and out["goal"] in done.stdout
    assert "--pipeline-activations store" in out["commands"][1] and "--cuts 7" in out["commands"][1]


def tiny_file(path, arrays) -> None:
    """The tiny CIFAR-10 as a dataset file with chunks of 8 images (two workers need two chunks)."""
    write_dataset_file(path, *arrays, chunk=8)


def test_data_memory_script_reports_every_rank(tmp_path):
    """A 1,000-image synthetic file written by `mpiasgd data synth`, 5 pushes per run."""
    done = run_script("data_memory.py", ["--count", "1000", "--pushes", "5", "--batch-size", "8",
                                         "--file", str(tmp_path / "s.h5")], tmp_path, jobs=3)
    assert "1,000 images 3x64x64" in done.stdout and "(written in" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "MiB" not in line][2:]
    assert [r.split(" | ")[1] for r in rows] == ["parameter server", "worker", "worker"]
    for r in rows:
        chunks, shard, whole = (float(v.replace(",", "")) for v in r.strip("| ").split(" | ")[2:])
        assert 20 < chunks < 2000 and 20 < shard < 2000 and whole > 20
    assert "every rank under 600 MiB: " in done.stdout


def test_input_pipeline_script_compares_the_file_with_memory(tmp_path, tiny_cifar):
    data_dir, arrays = tiny_cifar
    tiny_file(tmp_path / "t.h5", arrays)
    done = run_script("input_pipeline.py", ["--file", str(tmp_path / "t.h5"), "--data-dir", str(data_dir),
                                            "--batch-size", "8", "--seconds", "2", "--rounds", "1"], tmp_path, jobs=3)
    table = {line.split(" | ")[0][2:]: line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert {"memory", "memory+prefetch", "file"} <= set(table)
    assert table["memory"].split(" | ")[2] == "1.000"
    assert "file within 5 % of memory: " in done.stdout and "--data " + str(tmp_path / "t.h5") in done.stdout


def test_data_accuracy_script_trains_both_sources_and_plots(tmp_path, tiny_cifar):
    data_dir, arrays = tiny_cifar
    tiny_file(tmp_path / "t.h5", arrays)
    done = run_script("data_accuracy.py", ["--file", str(tmp_path / "t.h5"), "--data-dir", str(data_dir),
                                           "--batch-size", "8", "--epochs", "1", "--seeds", "1", "--run-dir", "r"],
                      tmp_path, jobs=2)
    assert "| official | " in done.stdout and "| file | " in done.stdout
    assert "within run-to-run noise: " in done.stdout
    assert (tmp_path / "r" / "plots" / "accuracy.png").stat().st_size > 1000


def test_simulate_validate_script_runs_n_workers_and_their_simulation(tmp_path):
    """bench/simulate_validate.py --workers 3 on digits, half an epoch of minibatches of 32 (about 22 pushes):
    the real run under mpiexec -n 4, its simulation fitted to its log, the table with the shares of 0 to 3
    and > 3."""
    done = run_script("simulate_validate.py", ["--model", "digits", "--workers", "3", "--epochs", "0.5",
                                               "--batch-size", "32", "--seeds", "0", "--fits", "draw",
                                               "--run-dir", "r"], tmp_path, jobs=2)
    assert "1 server + 3 workers" in done.stdout and "| shares 0 / 1 / 2 / 3 / >=4 |" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 0 | ")]
    assert [r.split(" | ")[1] for r in rows] == ["real", "simulated (draw)"]
    assert all(len(r.split(" | ")[5].split(" / ")) == 5 for r in rows)
    assert " -n 4 " in done.stdout and "simulate --workers 3 --fit r/real-0.h5" in done.stdout


def test_server_script_times_the_server_with_each_update_rule(tmp_path):
    """bench/server.py's mpiexec job (it starts its own) on 4,096 values: the one-server rows and their per-push
    split, with DANA-GA (the default rule from 2 workers) and with A-SGD's; the numpy row is A-SGD's update."""
    for rule in ("auto", "sgd"):
        done = subprocess.run([sys.executable, str(REPO / "bench" / "server.py"), "--params", "4096", "--workers",
                               "1,2", "--sharded-workers", "2", "--pushes", "60", "--rounds", "1", "--exchanges",
                               "20", "--update-rule", rule], cwd=tmp_path, env=mpi_env(), capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        numpy = "NumpySGD" + ("" if rule == "sgd" else ", --update-rule sgd")
        rows: dict[str, str] = {}  # (the first table's: the second names its rows alike)
        for line in done.stdout.splitlines():
            if "|" in line and line.lstrip().startswith(("server, ", "2 workers, ")):
                rows.setdefault(line.strip().split("  ")[0], line)
        for label in ("server, 1 worker", "server, 2 workers", f"2 workers, numpy update ({numpy})"):
            split = [float(v) for v in rows[label].split("|")[1].split()]  # receive check update send other idle
            assert len(split) == 6 and split[2] > 0, rows[label]


def test_elastic_script_kills_a_worker_and_checks_its_run(tmp_path):
    """bench/elastic.py --dry-run: an undisturbed ULFM job and one whose worker is SIGKILLed mid-run; both complete
    and pass the script's checks (the death logged, the pushes intact, the test split covered)."""
    launcher = find_launcher()
    if launcher is None or "Open MPI" not in subprocess.run([launcher, "--version"], capture_output=True,
                                                            text=True).stdout:
        pytest.skip("ULFM needs Open MPI's mpiexec (--with-ft ulfm)")
    done = run_script("elastic.py", ["--dry-run"], tmp_path, jobs=2)
    out = done.stdout
    assert "undisturbed seed 0: " in out and "run  1 (seed 100): killed [" in out and ": completed, test " in out
    assert "| 1 | 1 | 0 | 1 of 1 | " in out and "every job that started completed and passed its checks (2)" in out, out


def test_elastic_script_brings_a_killed_worker_back_with_an_attach(tmp_path):
    """bench/elastic.py --dry-run --attach: the killed worker's rank is brought back by `mpiasgd attach` once its
    loss is logged; it joins and pushes, and the run passes the script's checks."""
    launcher = find_launcher()
    if launcher is None or "Open MPI" not in subprocess.run([launcher, "--version"], capture_output=True,
                                                            text=True).stdout:
        pytest.skip("ULFM needs Open MPI's mpiexec (--with-ft ulfm)")
    done = run_script("elastic.py", ["--dry-run", "--attach"], tmp_path, jobs=2)
    out = done.stdout
    assert "every job that started completed and passed its checks (2)" in out, out
    assert "--attach: 1 worker brought back by `mpiasgd attach` joined " in out, out
