"""Checkpoints in-process: the file (atomic writes, every field kept, corrupt, foreign, missing and
out-of-range files refused), the data cursor a resume continues from, `--resume` as a flag and in a
config file, and what a writer killed with its log open left behind.

The multi-rank checks (exact resumes, signals on any rank, killed ranks) are in tests/mpi/test_checkpoint.py.
"""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest
from kit.checkpoints import make_ckpt
from kit.launch import REPO

from mpiasgd import checkpoint
from mpiasgd.checkpoint import CheckpointError
from mpiasgd.config import ConfigError, make_parser, resolve
from mpiasgd.data import ShardSampler, minibatches

# --- the file --------------------------------------------------------------------------------------

def test_checkpoint_round_trip_keeps_every_field(tmp_path):
    path = str(tmp_path / "x.ckpt.h5")
    ck = make_ckpt()
    assert checkpoint.write(path, ck) > 0
    got = checkpoint.load(path)
    np.testing.assert_array_equal(got.params, ck.params)
    np.testing.assert_array_equal(got.momentum, ck.momentum)
    np.testing.assert_array_equal(got.workers, ck.workers)
    assert (got.version, got.samples, got.elapsed, got.log_time, got.reason) == (7, 320, 12.5, 13.0, "interval")
    assert (got.staleness_sum, got.staleness_max, got.staleness_count) == (9, 3, 7)
    assert got.worker(2)["cursor"] == 4 and got.num_workers == 2 and got.path == path
    assert os.listdir(tmp_path) == ["x.ckpt.h5"]  # no temporary file left behind


def test_a_large_checkpoint_is_written_in_pieces_with_between_after_each(tmp_path):
    """h5py holds its global lock for a whole HDF5 call: the arrays go in pieces of checkpoint.PIECE values, so the
    signal thread closing the run log waits for one piece, and `between` runs after each."""
    path = str(tmp_path / "x.ckpt.h5")
    ck = make_ckpt(P=2 * checkpoint.PIECE + 3)
    calls = []
    checkpoint.write(path, ck, between=lambda: calls.append(1))
    assert len(calls) == 3 + 3 + 1  # three pieces of params, three of momentum, and before the fsync
    got = checkpoint.load(path)
    np.testing.assert_array_equal(got.params, ck.params)
    np.testing.assert_array_equal(got.momentum, ck.momentum)
    calls.clear()
    checkpoint.write(path, make_ckpt(P=0), between=lambda: calls.append(1))
    assert len(calls) == 3 and checkpoint.load(path).params.shape == (0,)


def test_corrupt_foreign_and_missing_checkpoints_are_refused(tmp_path):
    import h5py

    path = str(tmp_path / "x.ckpt.h5")
    checkpoint.write(path, make_ckpt())
    with h5py.File(path, "r+") as f:  # one weight changed behind the CRC's back
        f["params"][3] += 1.0
    with pytest.raises(CheckpointError, match="is corrupt: its contents do not match the CRC-32"):
        checkpoint.load(path)
    checkpoint.write(path, make_ckpt())
    with h5py.File(path, "r+") as f:  # the data cursor of a worker, and an attribute: covered too
        rows = f["workers"][()]
        rows["cursor"][0] += 38
        f["workers"][...] = rows
    with pytest.raises(CheckpointError, match="is corrupt: its contents do not match the CRC-32"):
        checkpoint.load(path)
    checkpoint.write(path, make_ckpt())
    with h5py.File(path, "r+") as f:
        f.attrs["elapsed"] = float("nan")
    with pytest.raises(CheckpointError, match="is corrupt"):
        checkpoint.load(path)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = [1]
    with pytest.raises(CheckpointError, match="is not an mpiasgd checkpoint"):
        checkpoint.load(str(tmp_path / "other.h5"))
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoint.load(str(tmp_path / "text.h5"))
    with pytest.raises(CheckpointError, match=r"not found$"):
        checkpoint.load(str(tmp_path / "missing.h5"))


def test_a_missing_checkpoint_names_the_log_of_its_run_and_an_unfinished_write(tmp_path):
    """A run killed before its first checkpoint leaves its log (and, killed mid-write, a temporary file): --resume
    says so instead of only 'not found'."""
    path = str(tmp_path / "run.ckpt.h5")
    (tmp_path / "run.h5").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"not found: its run log '.*run\.h5' is of a run that wrote no "
                       r"checkpoint .*start it again \(--overwrite\)$"):
        checkpoint.load(path)
    (tmp_path / ".run.ckpt.h5.tmp.4321").write_bytes(b"\0" * 10)
    with pytest.raises(CheckpointError, match=r"not found: '.*\.run\.ckpt\.h5\.tmp\.4321' is a write that did not "
                       r"finish .*; its run log"):
        checkpoint.load(path)


@pytest.mark.parametrize("field,value,expected", [
    ("elapsed", float("nan"), "elapsed = nan"), ("samples", -100, "samples = -100"),
    ("version", -5, "version = -5"), ("cursor", -1, "negative worker cursors"), ("rank", 1, "worker ranks [1, 1]"),
    ("params", np.full(10, np.nan, np.float32), "non-finite weights or momentum"),
])
def test_out_of_range_values_are_refused_even_with_a_valid_crc(tmp_path, field, value, expected):
    path = str(tmp_path / "x.ckpt.h5")
    ck = make_ckpt()
    if field in ("cursor", "rank"):
        ck.workers[field][1] = value
    else:
        setattr(ck, field, value)
    checkpoint.write(path, ck)
    with pytest.raises(CheckpointError, match=f"is corrupt: {re.escape(expected)}"):
        checkpoint.load(path)


def test_shard_versions_round_trip_and_are_checked(tmp_path):
    """--servers S > 1: every shard's version is kept (shard 0's is `version`), under the CRC; one server's
    checkpoint has none (its file is as before)."""
    import h5py

    path = str(tmp_path / "x.ckpt.h5")
    checkpoint.write(path, make_ckpt())
    with h5py.File(path) as f:
        assert "shard_versions" not in f
    assert checkpoint.load(path).shard_versions.tolist() == []
    ck = make_ckpt()
    ck.shard_versions = np.array([7, 9], np.int64)
    checkpoint.write(path, ck)
    assert checkpoint.load(path).shard_versions.tolist() == [7, 9]
    with h5py.File(path, "r+") as f:
        f["shard_versions"][1] = 10
    with pytest.raises(CheckpointError, match="do not match the CRC-32"):
        checkpoint.load(path)
    ck.shard_versions = np.array([6, 9], np.int64)
    checkpoint.write(path, ck)
    with pytest.raises(CheckpointError, match=r"shard_versions\[0\] = 6, but version = 7"):
        checkpoint.load(path)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "x.ckpt.h5")
    checkpoint.write(path, make_ckpt(seed=1, version=1))

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "replace", no_rename)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.write(path, make_ckpt(seed=2, version=2))
    monkeypatch.undo()
    assert checkpoint.load(path).version == 1
    np.testing.assert_array_equal(checkpoint.load(path).params, make_ckpt(seed=1).params)
    assert os.listdir(tmp_path) == ["x.ckpt.h5"]


@pytest.mark.parametrize("start", [0, 1, 3, 6, 7, 13, 40])
def test_minibatches_from_a_cursor_continue_the_uninterrupted_stream(start):
    sampler = ShardSampler(101, 3, 1, seed=5)  # a shard of 34 images: batches of 5 straddle epochs
    straight = minibatches(sampler, 5)
    for _ in range(start):
        next(straight)
    resumed = minibatches(sampler, 5, start)
    for _ in range(20):
        (e1, i1), (e2, i2) = next(straight), next(resumed)
        assert e1 == e2
        np.testing.assert_array_equal(i1, i2)


def test_resume_takes_the_checkpoint_config_and_refuses_fixed_keys(tmp_path):
    from mpiasgd.config import Config

    path = str(tmp_path / "x.ckpt.h5")
    ck = make_ckpt()
    ck.config = Config(model="digits", lr=0.07, epochs=3.0, name="x").to_json()
    checkpoint.write(path, ck)
    cfg = resolve(make_parser().parse_args(["--resume", path, "--epochs", "6"]))
    assert (cfg.lr, cfg.epochs, cfg.name, cfg.resume) == (0.07, 6.0, "x", path)
    with pytest.raises(ConfigError, match="config key 'seed' = 3: a resumed run keeps 0"):
        resolve(make_parser().parse_args(["--resume", path, "--seed", "3"]))
    with pytest.raises(ConfigError, match=r"--resume: checkpoint '.*missing.h5' not found"):
        resolve(make_parser().parse_args(["--resume", str(tmp_path / "missing.h5")]))


def test_resume_given_a_run_log_or_a_dataset_says_what_it_is_and_names_the_checkpoint(tmp_path):
    """`train --resume runs/x.h5` with the run log (or a dataset file) says what the file is and which file to
    give, not "format attribute None" (issue 36); the log's checkpoint is named when it is beside it. Real files
    of each kind, written by the run log's writer, the checkpoint's and the dataset's format attribute."""
    import h5py

    from mpiasgd.config import Config
    from mpiasgd.data.h5data import FORMAT as DATA_FORMAT
    from mpiasgd.runlog import RunLog

    log = str(tmp_path / "x.h5")
    RunLog.create(log, {"config": Config(name="night").to_json()}, [], 3, flush_interval=60.0).close("completed", {})
    with pytest.raises(ConfigError) as e:
        resolve(make_parser().parse_args(["--resume", log]))
    assert str(e.value) == (f"--resume: '{log}' is the run log of run 'night', not a checkpoint: its run's checkpoint "
                            f"would be '{tmp_path / 'x.ckpt.h5'}', which does not exist (a run writes it every "
                            "--checkpoint-interval seconds and at its end)")
    checkpoint.write(str(tmp_path / "x.ckpt.h5"), make_ckpt())
    with pytest.raises(ConfigError) as e:
        resolve(make_parser().parse_args(["--resume", log]))
    assert str(e.value) == (f"--resume: '{log}' is the run log of run 'night', not a checkpoint: its checkpoint is "
                            f"'{tmp_path / 'x.ckpt.h5'}'")
    with pytest.raises(CheckpointError, match="is the run log of run 'night', not a checkpoint: its checkpoint is"):
        checkpoint.load(log)  # (as launch reads it)
    data = str(tmp_path / "c10.h5")
    with h5py.File(data, "w") as f:
        f.attrs["format"] = DATA_FORMAT
    with pytest.raises(ConfigError) as e:
        resolve(make_parser().parse_args(["--resume", data]))
    assert str(e.value) == (f"--resume: '{data}' is a dataset file (made by `mpiasgd data`), not a "
                            "checkpoint: a run's checkpoint is the NAME.ckpt.h5 beside its run log NAME.h5")


def test_resume_in_a_config_file_works_as_the_flag(tmp_path):
    """`resume = PATH` in a --config TOML file takes the checkpoint's config as the defaults, as the flag
    does (helper-23: it was merged over the built-in defaults, so a cifar10 checkpoint read as 'digits')."""
    from mpiasgd.config import Config

    path = str(tmp_path / "c.ckpt.h5")
    ck = make_ckpt()
    ck.config = Config(model="cifar10", lr=0.07, max_time=15.0, name="c").to_json()
    checkpoint.write(path, ck)
    toml = tmp_path / "more.toml"
    toml.write_text(f'resume = "{path}"\nmax_time = 18.0\nmodel = "cifar10"\n')
    cfg = resolve(make_parser().parse_args(["--config", str(toml)]))
    assert (cfg.model, cfg.lr, cfg.max_time, cfg.name, cfg.resume) == ("cifar10", 0.07, 18.0, "c", path)
    toml.write_text(f'resume = "{path}"\nmodel = "digits"\n')
    with pytest.raises(ConfigError, match="config key 'model' = 'digits': a resumed run keeps 'cifar10'"):
        resolve(make_parser().parse_args(["--config", str(toml)]))
    toml.write_text(f'resume = "{tmp_path / "missing.h5"}"\n')
    with pytest.raises(ConfigError, match=r"config key 'resume' in '.*more.toml': checkpoint '.*missing.h5' not found"):
        resolve(make_parser().parse_args(["--config", str(toml), "--name", "tt"]))
    cfg = resolve(make_parser().parse_args(["--config", str(toml), "--resume", path]))  # the flag wins
    assert (cfg.model, cfg.resume) == ("cifar10", path)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_what_a_dead_writer_left_is_named_and_its_temporaries_removed(tmp_path):
    """train.left_behind, with the lock held: a log a killed writer left with status 'running', its pid in
    the lock file, temporary checkpoint files of dead processes (removed) and of a live one (kept)."""
    import sys

    from mpiasgd.launch.startup import left_behind
    from mpiasgd.runlog import RunLog, WriterLock

    runs = tmp_path / "runs"
    runs.mkdir()
    path = str(runs / "d.h5")
    killed = subprocess.run([sys.executable, "-c", "import os, sys\nfrom mpiasgd.runlog import RunLog, WriterLock\n"
                             "lock = WriterLock(sys.argv[1]); lock.acquire()\n"
                             "RunLog.create(sys.argv[1], {}, [], 3, 60, lock).flush()\n"
                             "print(os.getpid(), flush=True); os._exit(0)  # killed: nothing closed", path],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert killed.returncode == 0, killed.stderr
    writer = int(killed.stdout)
    dead, other = runs / f".d.ckpt.h5.tmp.{writer}", runs / f".d.ckpt.h5.tmp.{dead_pid()}"
    live = runs / f".d.ckpt.h5.tmp.{os.getppid()}"  # a live process (this one's own pid would count as no writer)
    for torn in (dead, other):
        torn.write_bytes(b"torn")
    live.write_bytes(b"being written")
    lock = WriterLock(path)
    lock.acquire()  # the dead writer's flock went with it
    text = left_behind(path, lock)
    assert text.startswith(f"a job that died writing run log '{path}' (rank 0 was pid {writer}) left it with "
                           "status 'running' (readable up to its last flush) and the temporary checkpoint files "), text
    assert str(dead) in text and str(other) in text and "(of processes that no longer exist: removed)" in text, text
    assert not dead.exists() and not other.exists() and live.exists()
    assert left_behind(path, lock) == f"a job that died writing run log '{path}' (rank 0 was pid {writer}) left it " \
                                      "with status 'running' (readable up to its last flush)"
    lock.release()
    RunLog.reopen(path, [], 60, lock).close("completed")  # recovered and closed: nothing left behind
    lock.acquire()
    assert lock.dead_pid == 0 and left_behind(path, lock) == ""
    lock.release()
