"""A run log a killed writer left marked open for writing (superblock flags), and a truncated run log.

Rank 0 killed inside `RunLog.close`'s non-SWMR reopen leaves the superblock's consistency flags at 0x01:
HDF5 then refuses every open. `runlog.clear_stale_flags` clears them as `h5clear -s` does (checksum:
`runlog.lookup3`); readers and --resume use it. A truncated file fails at once with a one-line error,
never inside HDF5's SWMR-read retry loop.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpiasgd.runlog import (
    PushRow,
    RunLog,
    SnapshotRow,
    TruncatedLogError,
    WriterLock,
    clear_stale_flags,
    load,
    lookup3,
    open_log,
    superblock_flags,
)


def finished_log(path: str) -> None:
    lock = WriterLock(path)
    lock.acquire()
    log = RunLog.create(path, {"config": '{"model": "digits"}', "model": "digits", "mode": "async"}, [], 4,
                        flush_interval=60, lock=lock)
    log.add(PushRow(time=1.0, worker=1, step=1, base_version=0, version=1, staleness=0, loss=1.0, correct=0,
                    samples=16, epoch=0, compute_s=0.1, comm_s=0.0, wait_s=0.0, applied=1, lr=0.1, rejected=0,
                    held_s=0.0, digest=0))
    log.add_snapshot(SnapshotRow(time=1.0, version=1, samples=16, epoch=0.0), np.ones(4, np.float32))
    log.close("completed", {"test_accuracy": 0.5})


def killed_while_open(path: str) -> None:
    """Open `path` 'r+' (not SWMR) in a child, write an attribute, SIGKILL the child: what a rank 0 killed
    inside `RunLog.close` leaves."""
    code = ("import h5py, os, signal, sys; f = h5py.File(sys.argv[1], 'r+', libver='latest'); "
            "f.attrs['status'] = 'completed'; f.flush(); os.kill(os.getpid(), signal.SIGKILL)")
    res = subprocess.run([sys.executable, "-c", code, path], timeout=60)
    assert res.returncode == -9


def test_lookup3_known_vectors_and_the_checksums_of_real_files(tmp_path):
    assert lookup3(b"") == 0xDEADBEEF
    assert lookup3(b"Four score and seven years ago") == 0x17770551
    assert lookup3(b"Four score and seven years ago", 1) == 0xCD628161  # lookup3.c's driver
    for k in range(3):
        path = str(tmp_path / f"f{k}.h5")
        with h5py.File(path, "w", libver="latest") as f:
            f.create_dataset("x", data=np.arange(10 ** k))
        head = open(path, "rb").read(48)
        assert lookup3(head[:44]) == int.from_bytes(head[44:48], "little")


def test_log_of_a_writer_killed_with_the_file_open_is_read_and_resumed(tmp_path):
    path = str(tmp_path / "x.h5")
    finished_log(path)
    killed_while_open(path)
    assert superblock_flags(path) == 0x01
    with pytest.raises(OSError, match="not already open for SWMR writing"):  # what every reader got before
        h5py.File(path, "r", libver="latest", swmr=True)
    saved = str(tmp_path / "saved.h5")
    shutil.copy(path, saved)

    run = load(path)  # report, trace, watch: open_log's read path clears the flags
    assert run["status"] == "completed" and superblock_flags(path) == 0
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        assert f["pushes"].shape == (1,)

    shutil.copy(saved, path)  # evaluate: open_log(path, "r+")
    with open_log(path, "r+") as f:
        f.attrs["evaluated"] = "now"

    shutil.copy(saved, path)  # --resume: the new job holds the lock, then reopens
    lock = WriterLock(path)
    lock.acquire()
    log = RunLog.reopen(path, [], 60, lock)
    log.close("completed")
    with open_log(path) as f:
        assert f["pushes"].shape == (1,) and f.attrs["status"] == "completed"


def test_flags_of_a_live_writer_or_an_unknown_checksum_are_left_alone(tmp_path):
    path = str(tmp_path / "x.h5")
    finished_log(path)
    killed_while_open(path)
    before = open(path, "rb").read()
    lock = WriterLock(path)
    lock.acquire()  # a live writer
    assert clear_stale_flags(path) is False and open(path, "rb").read() == before
    lock.release()
    with open(path, "r+b") as fh:  # a checksum lookup3 does not reproduce: not ours to touch
        fh.seek(44)
        fh.write(b"\0\0\0\0")
    before = open(path, "rb").read()
    assert clear_stale_flags(path) is False and open(path, "rb").read() == before


def test_truncated_log_fails_at_once_naming_both_sizes(tmp_path):
    path = str(tmp_path / "x.h5")
    finished_log(path)
    size = os.path.getsize(path)
    cut = str(tmp_path / "tr.h5")
    with open(path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(2000))
    with pytest.raises(TruncatedLogError, match=rf"^'{cut}' is truncated \(2000 bytes, the file says {size}\)"):
        open_log(cut)
    res = subprocess.run([sys.executable, "-m", "mpiasgd", "report", cut], capture_output=True, text=True,
                         timeout=60)  # hung for minutes in HDF5's SWMR retry loop before
    assert res.returncode != 0 and f"'{cut}' is truncated (2000 bytes, the file says {size})" in res.stderr
    assert "Traceback" not in res.stderr
