"""Damaged and edited run logs: `mpiasgd evaluate | report | export` give one error line naming the file and
what was expected (exit status 2, no traceback), and reading a log runs no code.

Each log is a small one written with `RunLog` (a BatchNorm network on the digits dataset), then edited with
h5py or bit-flipped, as the defects a new-user trial found (a flipped byte, a deleted group, a broken config
attribute, a stored network with an unknown layer type or a NaN argument, a network whose input shape is not
the dataset's, an export target that is not a regular file, NaN layer buffers, a huge network name).
"""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from mpiasgd.cli import main
from mpiasgd.model import build_model
from mpiasgd.model.layers import LAYER_TYPES, BatchNorm2d, Conv2d, Flatten, Linear, ReLU
from mpiasgd.model.spec import model_spec, to_json
from mpiasgd.runlog import RunLog, SnapshotRow, WorkerRow, WriterLock

WORKER = WorkerRow(rank=1, host=b"host", pid=1, threads=1, backend=b"numpy", shard_size=100, device=-1,
                   device_name=b"", device_uuid=b"", transfer=b"host", module=-1, replica=-1)
CONFIG = {"model": "bn", "dataset": "digits", "data_dir": "", "augment": ""}  # the digits: (1, 8, 8) images


def network(name: str = "bn", side: int = 8) -> dict:
    """conv, BatchNorm (8 buffer values), ReLU, linear on (1, side, side) images."""
    return model_spec(name, (1, side, side), [Conv2d(1, 4, 3, pad=1), BatchNorm2d(4), ReLU(), Flatten(),
                                              Linear(4 * side * side, 10)])


def write_log(path, spec: dict | None = None, snapshots: int = 2) -> str:
    """A closed run log of the network `spec` (default `network()`) with `snapshots` weight snapshots."""
    spec = spec or network()
    model = build_model(spec)
    attrs = {"config": CONFIG, "model": spec["name"], "mode": "async", "num_workers": 1,
             "num_params": model.num_params, "model_spec": to_json(spec)}
    log = RunLog.create(str(path), attrs, [WORKER], model.num_params, flush_interval=60.0,
                        num_buffers=model.num_buffers)
    rng = np.random.default_rng(0)
    buffers = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.float32)  # running mean 0, running variance 1
    for i in range(snapshots):
        params = (0.1 * rng.standard_normal(model.num_params)).astype(np.float32)
        log.add_snapshot(SnapshotRow(time=float(i), version=i, samples=0, epoch=0.0), params, buffers)
    log.close("completed", {})
    return str(path)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


def test_a_bit_flipped_log_is_named_as_damaged(tmp_path, capsys):
    """A flipped byte in the root group's object header: HDF5 opens the file, then fails its checksum."""
    log = write_log(tmp_path / "flip.h5")
    with h5py.File(log, "r") as f:
        header = h5py.h5o.get_info(f.id).addr  # the root group's object header (version 2: checksummed)
    data = bytearray((tmp_path / "flip.h5").read_bytes())
    data[header + 12] ^= 0xFF
    (tmp_path / "flip.h5").write_bytes(bytes(data))
    for command in ("report", "evaluate", "export"):
        status, _, err = run([command, log], capsys)
        assert status == 2
        assert err.startswith(f"mpiasgd {command}: error: run log '{log}': the file is damaged, HDF5 cannot read "
                              f"it (") and "incorrect metadata checksum" in err, err
        assert err.count("\n") == 1 and err.endswith(")\n"), err
    assert not (tmp_path / "flip.npz").exists()


def test_a_log_without_snapshots_names_what_is_missing(tmp_path, capsys):
    log = write_log(tmp_path / "nosnap.h5")
    with h5py.File(log, "r+") as f:
        del f["snapshots"]
    expected = (f"run log '{log}' has no /snapshots group (every run log mpiasgd writes has one: the file was "
                f"edited or is damaged)\n")
    for command in ("evaluate", "export"):
        status, _, err = run([command, log], capsys)
        assert (status, err) == (2, f"mpiasgd {command}: error: {expected}")


def test_a_config_attribute_that_is_not_json_is_named(tmp_path, capsys):
    log = write_log(tmp_path / "cfg.h5")
    with h5py.File(log, "r+") as f:
        f.attrs["config"] = "{not json"
    expected = (f"run log '{log}': its config attribute is not valid JSON (Expecting property name enclosed in "
                f"double quotes: line 1 column 2 (char 1))\n")
    for command in ("evaluate", "report"):
        status, _, err = run([command, log], capsys)
        assert (status, err) == (2, f"mpiasgd {command}: error: {expected}")
    with h5py.File(log, "r+") as f:
        f.attrs["config"] = "[1, 2]"
    status, _, err = run(["evaluate", log], capsys)
    assert (status, err) == (2, f"mpiasgd evaluate: error: run log '{log}': its config attribute holds a JSON array, "
                                'expected an object ({"model": ...})\n')


@pytest.mark.parametrize("edit", ["unknown", "nan"])
def test_a_stored_network_that_cannot_be_built_names_the_log(edit, tmp_path, capsys):
    """An unknown layer type or a NaN argument: refused when built (data only, nothing imported or run)."""
    spec = network()
    if edit == "unknown":
        spec["layers"][0]["type"] = "Lambda"
        why = f"layers[0]: unknown layer type 'Lambda'; known: {', '.join(LAYER_TYPES)}"
    else:
        spec["layers"][0]["lr_mult"] = float("nan")
        why = "layers[0] (Conv2d): Conv2d: lr_mult must be a finite number >= 0, got nan"
    log = write_log(tmp_path / "net.h5")
    with h5py.File(log, "r+") as f:
        f.attrs["model_spec"] = json.dumps(spec)  # NaN as JSON's non-standard token, as a forged file may hold it
    for command in ("evaluate", "export"):
        status, _, err = run([command, log], capsys)
        assert (status, err) == (2, f"mpiasgd {command}: error: run log '{log}': its network definition: {why}\n")
    assert not (tmp_path / "net.npz").exists()


def test_a_network_whose_input_is_not_the_datasets_images_is_named(tmp_path, capsys):
    """A network for 16x16 images pointed at the digits (8x8): both shapes named, before any forward pass."""
    log = write_log(tmp_path / "shape.h5", network(side=16))
    status, out, err = run(["evaluate", log], capsys)
    assert (status, out) == (2, f"== {log}\n")
    assert err == (f"mpiasgd evaluate: error: run log '{log}': its network takes images of shape (1, 16, 16) "
                   f"(C, H, W), the dataset 'digits' gives (1, 8, 8); evaluate on the data the run trained on\n")


def test_export_to_a_target_that_is_not_a_regular_file_says_only_that(tmp_path, capsys):
    log = write_log(tmp_path / "r.h5")
    status, _, err = run(["export", log, "-o", "/dev/null"], capsys)
    assert (status, err) == (2, "mpiasgd export: error: output '/dev/null' exists and is not a regular file; "
                                "choose another -o (export replaces only a file)\n")
    if os.path.isfile("/proc/self/mem"):  # Linux: stat calls it a regular file, but /proc takes no new file
        status, _, err = run(["export", log, "-o", "/proc/self/mem"], capsys)
        assert (status, err) == (2, "mpiasgd export: error: output '/proc/self/mem': no file can be created in "
                                    "'/proc/self'; choose another -o\n")


def test_evaluate_warns_of_a_snapshot_that_is_not_finite(tmp_path, capsys):
    """NaN BatchNorm statistics in the last snapshot, NaN weights in the first: one warning line each, the rows
    still printed and stored, exit status 0."""
    log = write_log(tmp_path / "nan.h5")
    with h5py.File(log, "r+") as f:
        f["snapshots/buffers"][1] = np.full(8, np.nan, np.float32)
        params = f["snapshots/params"][0]
        params[:3] = [np.nan, np.inf, -np.inf]
        f["snapshots/params"][0] = params
        size = params.size
    status, out, err = run(["evaluate", log], capsys)
    assert status == 0 and out.endswith(f"2 snapshots evaluated and stored in {log}\n")
    assert err.splitlines() == [
        f"mpiasgd evaluate: warning: snapshot 0 of run log '{log}': 3 of {size:,} weights are not finite (NaN or "
        f"inf): its row is that of a broken network",
        f"mpiasgd evaluate: warning: snapshot 1 of run log '{log}': 8 of 8 layer buffer values (BatchNorm running "
        f"statistics) are not finite (NaN or inf): its row is that of a broken network"]
    status, _, err = run(["evaluate", write_log(tmp_path / "fine.h5")], capsys)
    assert (status, err) == (0, "")


def test_export_cuts_a_huge_network_name_in_its_messages(tmp_path, capsys):
    name = "x" * 200_000
    log = write_log(tmp_path / "long.h5", network(name))
    status, out, err = run(["export", log, "-o", str(tmp_path / "long.npz")], capsys)
    assert (status, err) == (0, "")
    assert out == (f"snapshot 1 of 2 of run log '{log}', network '{'x' * 60}'...: written to "
                   f"'{tmp_path / 'long.npz'}'\n")
    with h5py.File(log, "r+") as f:  # a snapshot that does not fit the network: the error cuts it too
        f.attrs["model_spec"] = to_json(network(name, side=16))
    status, _, err = run(["export", log, "-o", str(tmp_path / "bad.npz")], capsys)
    assert status == 2 and err.startswith(f"mpiasgd export: error: snapshot 1 of 2 of run log '{log}' does not fit "
                                          f"its network '{'x' * 60}'...: params must be a float vector of shape (")
    assert len(err) < 400, len(err)


def test_a_read_of_a_live_log_that_catches_a_flush_half_way_is_read_again(tmp_path, monkeypatch):
    """A row whose events text is not written yet ("bad heap index": SWMR does not order the global heap) is a
    read of a live log to try again, not damage; the same failure in a log no one writes is named at once."""
    from mpiasgd.runlog import load, reader

    spec = network()
    model = build_model(spec)
    attrs = {"config": CONFIG, "model": spec["name"], "mode": "async", "num_workers": 1,
             "num_params": model.num_params, "model_spec": to_json(spec)}
    path = str(tmp_path / "live.h5")
    lock = WriterLock(path)
    lock.acquire()  # as rank 0 does: the log has a live writer
    log = RunLog.create(path, attrs, [WORKER], model.num_params, flush_interval=0.0, num_buffers=model.num_buffers,
                        lock=lock)
    calls, failures = [], [2]

    def flaky(rows, name):  # the first two reads of the events table fail as HDF5 does mid-flush
        calls.append(name)
        if name == "events" and failures[0]:
            failures[0] -= 1
            raise OSError("Can't synchronously read data (bad heap index, heap object = {800, 16})")
        return reader_upgrade(rows, name)

    reader_upgrade = reader.upgrade
    monkeypatch.setattr(reader, "upgrade", flaky)
    try:
        run = load(path)  # the writer is alive: read three times
        assert run["status"] == "running" and calls.count("events") == 3 and failures[0] == 0
    finally:
        log.close("completed", {})
    failures[0], calls[:] = 1, []
    with pytest.raises(reader.DamagedLogError, match="bad heap index"):
        load(path)  # closed: no writer, so the failure is damage at the first read
    assert calls.count("events") == 1
