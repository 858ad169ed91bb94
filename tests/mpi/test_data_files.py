"""Training from an mpiasgd dataset file under `mpiexec`: the same results with and without the prefetch
thread and with the shard in memory, an exact resume, and one start-up error for each kind of bad input.

Every job runs under a timeout (a hang fails the test).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from kit.cifar import write_dataset_file

from mpiasgd import checkpoint

COMMON = ["--model", "cifar10", "--batch-size", "8", "--snapshot-interval", "0", "--flush-interval", "0.2",
          "--no-progress", "--comm-timeout", "60", "--mode", "sync", "--epochs", "0", "--lr", "0.02",
          "--lr-schedule", "constant", "--shuffle-window", "2"]


@pytest.fixture
def cifar_file(tmp_path, tiny_cifar):
    """tests' tiny CIFAR-10 (100 train, 10 test) as a dataset file with chunks of 8 images (13 chunks)."""
    _, arrays = tiny_cifar
    return write_dataset_file(tmp_path / "tiny.h5", *arrays, chunk=8)


def final(tmp_path, name):
    return checkpoint.load(str(tmp_path / "runs" / f"{name}.ckpt.h5"))


def test_file_training_is_exact_with_prefetch_in_memory_and_resumed(mpirun, tmp_path, cifar_file):
    """Sync, 2 workers, 20 steps (3 epochs of each 48-52 image shard): the prefetch thread, the shard kept in
    memory, and 10 steps + resume + 10 give the weights and momentum of the plain run, bit for bit."""
    data = [*COMMON, "--data", str(cifar_file)]
    runs = {"plain": ["--prefetch", "0"], "ahead": ["--prefetch", "3"], "memory": ["--data-in-memory"]}
    for name, extra in runs.items():
        res = mpirun(3, ["train", *data, *extra, "--max-pushes", "20", "--name", name], timeout=120)
        assert res.returncode == 0, res.explain()
        assert "dataset " + str(cifar_file) in res.stdout
    res = mpirun(3, ["train", *data, "--max-pushes", "10", "--name", "split"], timeout=120)
    assert res.returncode == 0, res.explain()
    res = mpirun(3, ["train", "--resume", "runs/split.ckpt.h5", "--max-pushes", "20", "--no-progress"], timeout=120)
    assert res.returncode == 0, res.explain()
    want = final(tmp_path, "plain")
    assert want.version == 20 and want.workers["cursor"].tolist() == [20, 20]
    for name in ("ahead", "memory", "split"):
        got = final(tmp_path, name)
        np.testing.assert_array_equal(got.params, want.params, err_msg=name)
        np.testing.assert_array_equal(got.momentum, want.momentum, err_msg=name)


@pytest.mark.parametrize("case,expected", [
    ("truncated", r"error \(ranks 0, 1, 2\): .*cut\.h5: not a readable HDF5 file"),
    ("missing", r"dataset file .*none\.h5 does not exist"),
    ("crop", r"model 'cifar10' takes inputs \(3, 32, 32\), dataset '.*tiny\.h5' gives \(3, 24, 24\) "
             r"\(its \(3, 32, 32\) images after --augment inner-crop=24\): choose a network for these images"),
    ("chunks", r"more workers \(2\) than chunks \(1 of 100 images in the file\)"),
    ("augment", r"error: config key 'augment' = 'crop=3': .*item 'crop=3' is unknown; valid items: pad-crop=P"),
])
def test_bad_data_gives_one_startup_error(mpirun, tmp_path, cifar_file, tiny_cifar, case, expected):
    raw = cifar_file.read_bytes()
    (tmp_path / "cut.h5").write_bytes(raw[: len(raw) // 3])
    _, arrays = tiny_cifar
    write_dataset_file(tmp_path / "one.h5", *arrays)  # the default chunk: one chunk
    data = {"truncated": ["--data", "cut.h5"], "missing": ["--data", "none.h5"],
            "crop": ["--data", str(cifar_file), "--augment", "inner-crop=24"],
            "chunks": ["--data", "one.h5"], "augment": ["--data", str(cifar_file), "--augment", "crop=3"]}[case]
    res = mpirun(3, ["train", *COMMON, "--max-pushes", "2", *data], timeout=60)
    assert res.returncode == 2, res.explain()
    assert re.search(expected, res.stderr), res.explain()
    assert "Traceback" not in res.stderr


def test_resume_follows_a_moved_file_and_refuses_another(mpirun, tmp_path, cifar_file, tiny_cifar):
    """The config keeps the file's absolute path; a moved file is passed anew and the run continues exactly;
    a different file at the old path (another dataset, rewritten) is refused."""
    data = [*COMMON, "--data", "tiny.h5"]  # relative: stored as an absolute path
    res = mpirun(3, ["train", *data, "--max-pushes", "20", "--name", "whole"], timeout=120)
    assert res.returncode == 0, res.explain()
    res = mpirun(3, ["train", *data, "--max-pushes", "10", "--name", "moved"], timeout=120)
    assert res.returncode == 0, res.explain()
    (tmp_path / "elsewhere").mkdir()
    cifar_file.rename(tmp_path / "elsewhere" / "tiny.h5")
    res = mpirun(3, ["train", "--resume", "runs/moved.ckpt.h5", "--max-pushes", "20", "--no-progress"], timeout=60)
    assert res.returncode == 2 and f"dataset file {cifar_file} does not exist" in res.stderr, res.explain()
    assert "if it moved, pass --data NEWPATH" in res.stderr
    res = mpirun(3, ["train", "--resume", "runs/moved.ckpt.h5", "--max-pushes", "20", "--no-progress", "--data",
                     "elsewhere/tiny.h5"], timeout=120)
    assert res.returncode == 0, res.explain()
    np.testing.assert_array_equal(final(tmp_path, "moved").params, final(tmp_path, "whole").params)
    _, (train_x, train_y, test_x, test_y) = tiny_cifar
    write_dataset_file(cifar_file, train_x[::-1], train_y[::-1], test_x, test_y, chunk=8)  # rewritten
    res = mpirun(3, ["train", "--resume", "runs/whole.ckpt.h5", "--max-pushes", "30", "--no-progress", "--data",
                     str(cifar_file)], timeout=60)
    assert res.returncode == 2, res.explain()
    assert re.search(r"--resume: the run in '.*whole\.h5' trained on a dataset file \{.*\}; '.*tiny\.h5' is another",
                     res.stderr), res.explain()


def test_a_file_truncated_during_training_stops_the_run_naming_it(tmp_path, cifar_file):
    """HDF5 would read zeros past the new end: the worker's next chunk read finds the file changed instead."""
    from kit.launch import start_mpi, stop_group
    from kit.runs import FAST, read_log, wait_for_pushes

    proc = start_mpi(3, ["train", *FAST, "--model", "cifar10", "--batch-size", "8", "--data", str(cifar_file),
                         "--shuffle-window", "1", "--epochs", "0", "--max-time", "120", "--name", "cut"], tmp_path)
    try:
        wait_for_pushes(tmp_path / "runs" / "cut.h5", proc, timeout=60)
        with open(cifar_file, "r+b") as f:
            f.truncate(cifar_file.stat().st_size // 2)
        _, err = proc.communicate(timeout=90)
    finally:
        stop_group(proc)
    assert proc.returncode not in (0, None), err
    assert f"{cifar_file}: the dataset file changed while the run reads it" in err, err
    attrs, _, _ = read_log(tmp_path / "runs" / "cut.h5")
    assert attrs["status"] == "failed"


def test_a_file_replaced_during_training_is_one_line_per_worker(tmp_path, cifar_file, tiny_cifar):
    """The file is rewritten in place by `data convert` (os.replace: a new inode, the same size): every worker
    that meets it says so in one line naming the file, its rank and what changed; no traceback; rank 0 closes
    the log as failed and the job ends."""
    from kit.launch import start_mpi, stop_group
    from kit.runs import FAST, read_log, wait_for_pushes

    proc = start_mpi(3, ["train", *FAST, "--model", "cifar10", "--batch-size", "8", "--data", str(cifar_file),
                         "--shuffle-window", "1", "--epochs", "0", "--max-time", "120", "--name", "swap"], tmp_path)
    try:
        wait_for_pushes(tmp_path / "runs" / "swap.h5", proc, timeout=60)
        before = cifar_file.stat()
        _, (train_x, train_y, test_x, test_y) = tiny_cifar
        write_dataset_file(cifar_file, train_x[::-1], train_y[::-1], test_x, test_y, chunk=8)  # another inode
        assert cifar_file.stat().st_size == before.st_size
        _, err = proc.communicate(timeout=90)
    finally:
        stop_group(proc)
    assert proc.returncode not in (0, None), err
    assert "Traceback" not in err, err
    cause = (rf"{re.escape(str(cifar_file))}: the dataset file changed while the run reads it \(replaced by another "
             r"file: inode \d+ -> \d+; modified [-\d: .]+ -> [-\d: .]+ UTC(; another conversion: created \S+ -> "
             r"\S+)?\); rerun, or --resume, once it is complete")
    # (stripped: Open MPI's MPI_ABORT banner, written by another process, may leave a space before the next line)
    lines = [line.strip() for line in err.splitlines() if "the dataset file changed" in line]
    workers = [line for line in lines if re.fullmatch(rf"mpiasgd: error: rank [12] on \S+: {cause}", line)]
    rank0 = [line for line in lines if re.fullmatch(rf"mpiasgd: worker rank [12] on \S+ failed: {cause}; run log "
                                                     r"'runs/swap\.h5' closed with status 'failed'\.", line)]
    assert workers and len(rank0) == 1 and len(workers) + len(rank0) == len(lines), err
    assert "size" not in lines[0], err
    attrs, _, _ = read_log(tmp_path / "runs" / "swap.h5")
    assert attrs["status"] == "failed"
