"""`mpiasgd report`: the comparison of several runs, on run logs written row by row with known values.

The logs are built with `RunLog` directly (no MPI), so every number in the table is known: images/s,
staleness mean and p99 over applied pushes only, time to a target accuracy from crafted snapshot
evaluations, and the failures (a missing file, an HDF5 file that is not a run log, a malformed log,
a percentage where a fraction is expected; `report` and `evaluate` refusing foreign files).
tests/mpi/test_report.py checks the table against a real run's log.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpiasgd.cli import main
from mpiasgd.runlog import PUSH_ROW, EvalRow, EventRow, PushRow, RunLog, SnapshotRow, WorkerRow, load
from mpiasgd.tools.report import comparison_row, report, time_to_accuracy

WORKER = WorkerRow(rank=1, host=b"host", pid=1, threads=1, backend=b"numpy", shard_size=100, device=-1,
                   device_name=b"", device_uuid=b"", transfer=b"host", module=-1, replica=-1)
ZERO_PUSH = PushRow(**dict.fromkeys(PushRow.dtype.names, 0))


def push(time: float, staleness: int, samples: int = 32, applied: int = 1) -> PushRow:
    """A push of worker 1 with these fields, zero elsewhere (by name: the table may grow columns)."""
    return dataclasses.replace(ZERO_PUSH, time=time, worker=1, staleness=staleness, samples=samples, applied=applied,
                               rejected=1 - applied)


def write_log(path, config: dict, pushes: list[PushRow], snapshot_times: list[float] = (),
              snapshot_evals: list[tuple[int, float]] = (), final_accuracy: float | None = None,
              train_time: float = 4.0, workers: int = 2, close: bool = True) -> str:
    """A run log with these rows. `snapshot_evals`: (snapshot index, accuracy), written in that order;
    `close=False` leaves it as a killed writer does (status "running", no lock)."""
    attrs = {"config": config, "model": "digits", "mode": config.get("mode", "async"), "num_workers": workers,
             "num_params": 3, "num_train": 1000}
    log = RunLog.create(str(path), attrs, [WORKER] * workers, 3, flush_interval=60.0)
    for row in pushes:
        log.add(row)
    for t in snapshot_times:
        log.add_snapshot(SnapshotRow(time=t, version=0, samples=0, epoch=0.0), np.zeros(3, np.float32))
    for snapshot, accuracy in snapshot_evals:  # evals rows carry their snapshot's time, as `evaluate` writes them
        log.add(EvalRow(time=snapshot_times[snapshot], version=0, epoch=0.0, snapshot=snapshot, loss=1.0,
                        accuracy=accuracy, count=100))
    if final_accuracy is not None:
        log.add(EvalRow(time=train_time, version=0, epoch=0.0, snapshot=-1, loss=1.0, accuracy=final_accuracy,
                        count=100))
    if close:
        log.close("completed", {"train_time_s": train_time})
    else:
        log.flush()
        log.file.close()
    return str(path)


@pytest.fixture
def logs(tmp_path):
    """Three logs: an async run with staleness-aware steps and evaluated snapshots, a sync run without
    snapshot evaluations, and a killed log of an older version (no nsync / staleness_lr in its config)."""
    # 150 applied pushes: staleness 0 x140, 2 x8, 9 x2 (mean 34/150; p99 9: 149 of 150 pushes are needed to
    # cover 99 %, where interpolating percentiles would give 5.57); one unapplied push of staleness 50
    pushes = [push(0.02 * i, s) for i, s in enumerate([0] * 140 + [2] * 8 + [9] * 2)] + [push(3.9, 50, applied=0)]
    a = write_log(tmp_path / "fast.h5", {"mode": "async", "staleness_lr": "inverse", "nsync": 1}, pushes,
                  snapshot_times=[0.0, 1.5, 3.0, 4.0],
                  snapshot_evals=[(3, 0.7), (2, 0.6), (0, 0.1), (1, 0.55)],  # out of order, as evaluate may leave
                  final_accuracy=0.7125)
    b = write_log(tmp_path / "sync.h5", {"mode": "sync", "staleness_lr": "none", "nsync": 2},
                  [push(0.2 * i, 0, samples=64) for i in range(10)], snapshot_times=[0.0, 2.0],
                  final_accuracy=0.5, train_time=2.0, workers=4)
    c = write_log(tmp_path / "old.h5", {"mode": "async"}, [push(0.5, 1), push(1.0, 2)], close=False)
    return a, b, c


def test_time_to_accuracy_is_the_earliest_snapshot_that_reached_it(logs):
    run = load(logs[0])
    assert time_to_accuracy(run, 0.5) == 1.5
    assert time_to_accuracy(run, 0.6) == 3.0      # reached exactly counts
    assert time_to_accuracy(run, 0.65) == 4.0
    assert time_to_accuracy(run, 0.05) == 0.0
    assert time_to_accuracy(run, 0.75) is None    # the final weights (0.7125) are not a snapshot
    assert time_to_accuracy(load(logs[1]), 0.1) is None  # snapshots taken but none evaluated


def test_comparison_rows(logs):
    a, b, c = (comparison_row(load(path), 0.6) for path in logs)
    assert a == {"run": "fast", "status": "completed", "mode": "async", "options": "", "workers": 2, "nsync": 1,
                 "staleness_lr": "inverse", "test_accuracy": 0.7125, "target_accuracy": 0.6, "time_to_target_s": 3.0,
                 "images_per_s": 1200.0, "staleness_mean": pytest.approx(34 / 150), "staleness_p99": 9}
    assert b == {"run": "sync", "status": "completed", "mode": "sync", "options": "", "workers": 4, "nsync": 2,
                 "staleness_lr": "none", "test_accuracy": 0.5, "target_accuracy": 0.6, "time_to_target_s": None,
                 "images_per_s": 320.0, "staleness_mean": 0.0, "staleness_p99": 0}
    # killed, older log: no train_time_s (time of the last push), no final evaluation, defaults for new keys
    assert c == {"run": "old", "status": "killed", "mode": "async", "options": "", "workers": 2, "nsync": 1,
                 "staleness_lr": "none", "test_accuracy": None, "target_accuracy": 0.6, "time_to_target_s": None,
                 "images_per_s": 64.0, "staleness_mean": 1.5, "staleness_p99": 2}


def test_markdown_table(logs):
    assert report(list(logs), 0.6, "markdown") == "\n".join([
        "| run          | mode  | workers | nsync | staleness lr | test acc | time to 60% (s) | images/s "
        "| staleness mean | staleness p99 |",
        "| :----------- | :---- | ------: | ----: | :----------- | -------: | --------------: | -------: "
        "| -------------: | ------------: |",
        "| fast         | async |       2 |     1 | inverse      |   71.25% |             3.0 |    1,200 "
        "|           0.23 |             9 |",
        "| sync         | sync  |       4 |     2 | none         |   50.00% |               - |      320 "
        "|           0.00 |             0 |",
        "| old (killed) | async |       2 |     1 | none         |        - |               - |       64 "
        "|           1.50 |             2 |",
    ])
    # one run is a table too (the benchmark scripts paste it); the target is in the header
    assert report([logs[0]], 0.925, "markdown").splitlines()[0].split(" | ")[6] == "time to 92.5% (s)"


def test_csv_table_has_raw_values(logs):
    rows = list(csv.DictReader(io.StringIO(report(list(logs[:2]), 0.5, "csv"))))
    assert rows[0] == {"run": "fast", "status": "completed", "mode": "async", "options": "", "workers": "2",
                       "nsync": "1",
                       "staleness_lr": "inverse", "test_accuracy": "0.7125", "target_accuracy": "0.5",
                       "time_to_target_s": "1.5", "images_per_s": "1200.0", "staleness_mean": "0.227",
                       "staleness_p99": "9"}
    assert rows[1]["time_to_target_s"] == "" and rows[1]["images_per_s"] == "320.0"


def test_text_report_compares_after_the_runs_and_one_run_reads_as_before(logs):
    one = report([logs[0]])
    assert one.startswith(f"== {logs[0]}\n") and "comparison" not in one and "time to" not in one
    both = report(list(logs[:2]), 0.6)
    assert both.startswith(one)  # each run's own report first, unchanged
    lines = both.splitlines()
    at = lines.index("== comparison of 2 runs")
    assert lines[at + 1].split() == ["run", "mode", "workers", "nsync", "staleness", "lr", "test", "acc", "time",
                                     "to", "60%", "(s)", "images/s", "staleness", "mean", "staleness", "p99"]
    assert lines[at + 2].split() == ["fast", "async", "2", "1", "inverse", "71.25%", "3.0", "1,200", "0.23", "9"]
    assert lines[at + 3].split() == ["sync", "sync", "4", "2", "none", "50.00%", "-", "320", "0.00", "0"]


def test_cli_reads_every_log_before_printing(logs, tmp_path, capsys):
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = [1, 2]
    for bad, expected in [(tmp_path / "missing.h5", f"run log '{tmp_path / 'missing.h5'}' not found"),
                          (tmp_path / "other.h5", f"'{tmp_path / 'other.h5'}' is not an mpiasgd run log")]:
        assert main(["report", logs[0], str(bad), logs[1], "--format", "markdown"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and expected in err and err.count("error") == 1, err
        assert main(["report", logs[0], str(bad)]) == 2  # text: not even the first run's section
        assert capsys.readouterr().out == ""
    assert main(["report", *logs, "--format", "csv", "--target-accuracy", "0.6"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("fast,completed,async,,2,1,inverse,0.7125,0.6,3.0,")


def test_malformed_log_is_named(logs, tmp_path, capsys):
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as f:  # looks like a log, but the pushes table lacks the 'applied' column
        f.attrs["config"] = json.dumps({"mode": "async"})
        f["pushes"] = np.zeros(3, dtype=[(n, PUSH_ROW[n]) for n in ("time", "worker", "staleness", "samples")])
    assert main(["report", logs[0], str(path), "--format", "csv"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"run log '{path}' is malformed" in err and "applied" in err


@pytest.mark.parametrize("value", ["60", "0", "-0.5", "1.5"])
def test_target_accuracy_must_be_a_fraction(logs, value, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["report", logs[0], "--target-accuracy", value])
    assert stop.value.code == 2
    assert f"expected a fraction in (0, 1], e.g. 0.6 for 60 %; got {value}" in capsys.readouterr().err


def test_mode_options_tell_variants_apart():
    from mpiasgd.tools.report import mode_options

    assert mode_options({"mode": "async"}) == ""
    assert mode_options({"mode": "ssp", "staleness_bound": 2}) == "s=2"
    assert mode_options({"mode": "async", "overlap": True, "warm_start": 30.0, "straggler": "2:3"}) == \
        "overlap warm 30s straggler 2:3"
    assert mode_options({"mode": "pipeline", "modules": 3, "shrink": 0.5, "decoupling": "backward",
                         "weight_stashing": True}) == "K=3 beta=0.5 backward stashing"


def test_evaluate_of_a_missing_log_prints_the_error_without_a_table_header(tmp_path, capsys):
    """`mpiasgd evaluate` names the log and the error, and prints no table header above it (helper-23)."""
    missing = str(tmp_path / "none.h5")
    assert main(["evaluate", missing]) == 2
    out, err = capsys.readouterr()
    assert out == f"== {missing}\n" and "snapshot" not in out
    assert err.startswith("mpiasgd evaluate: error: ") and "none.h5" in err


def test_report_shows_the_conv_tiles_each_worker_autotuned(tmp_path):
    """A run under --conv-algo autotune logs one 'autotune' event per GPU worker; the report lists each
    worker's chosen tile per conv pass (the per-tile timings stay in the event); without such events the
    report has no such section."""
    plan = ("conv2d_fprop N128 C3 32x32 K32 5x5 stride 1 pad 2: 32x96/4x4k24 "
            "(64x64 0.0301 ms, 32x128 0.0262 ms, 32x96/4x4k24 0.0201 ms)")
    path = write_log(tmp_path / "tuned.h5", {"mode": "async", "conv_algo": "autotune"}, [push(0.1, 0)], close=False)
    with h5py.File(path, "a") as f:
        ds = f["events"]
        ds.resize((ds.shape[0] + 2,))
        ds[-2] = EventRow(time=0.0, kind=b"autotune", text=f"worker rank 1 on gpu7: conv tiles chosen by timing "
                                                            f"(ms per call of each tile):\n{plan}").row()
        ds[-1] = EventRow(time=0.0, kind=b"start", text="training starts").row()
    text = report([path])
    at = text.splitlines().index("conv tiles chosen by --conv-algo autotune (timings: the log's events):")
    assert text.splitlines()[at + 1:at + 3] == [
        "worker rank 1 on gpu7:", "  conv2d_fprop N128 C3 32x32 K32 5x5 stride 1 pad 2: 32x96/4x4k24"]
    plain = write_log(tmp_path / "plain.h5", {"mode": "async"}, [push(0.1, 0)])
    assert "autotune" not in report([plain])


def test_report_says_the_update_rule_auto_chose_or_the_one_given(tmp_path):
    said = "--update-rule auto: dana-zero with Gap-Aware (3 workers: ...)"
    path = write_log(tmp_path / "auto.h5", {"mode": "async"}, [push(0.1, 0)], close=False)
    with h5py.File(path, "a") as f:
        ds = f["events"]
        ds.resize((ds.shape[0] + 1,))
        ds[-1] = EventRow(time=0.0, kind=b"update_rule", text=said).row()
    assert report([path]).splitlines()[2] == f"update rule: {said}"
    given = write_log(tmp_path / "given.h5", {"mode": "async", "update_rule": "sgd", "gap_aware": True},
                      [push(0.1, 0)])
    assert report([given]).splitlines()[2] == "update rule: --update-rule sgd with Gap-Aware"
    sync = write_log(tmp_path / "sync.h5", {"mode": "sync"}, [push(0.1, 0)])
    assert "update rule" not in report([sync])


@pytest.mark.parametrize("command", ["report", "evaluate", "trace"])
def test_a_directory_or_an_empty_file_is_named_as_such(command, tmp_path, capsys):
    """report, evaluate and trace on a directory say it is one and list the run logs in it; on a 0-byte file
    they say it is empty; neither is "not found"."""
    (tmp_path / "a.h5").write_bytes(b"")
    (tmp_path / "a.ckpt.h5").write_bytes(b"")  # checkpoints are not run logs
    argv = [command, str(tmp_path)] + (["-o", str(tmp_path / "t.json")] if command == "trace" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"'{tmp_path}' is a directory, expected a run log file (runs/NAME.h5); the .h5 files in it: a.h5\n" \
        in err and "not found" not in err, err
    argv[1] = str(tmp_path / "a.h5")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"'{tmp_path / 'a.h5'}' is empty (0 bytes), expected an mpiasgd run log (HDF5)" in err, err


def test_report_refuses_foreign_files(tmp_path):
    import h5py

    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = [1, 2]
    (tmp_path / "text.h5").write_text("hello")
    for name, expected in [("other.h5", "not an mpiasgd run log"), ("text.h5", "not a readable HDF5 file"),
                           ("missing.h5", "not found")]:
        for command in ("report", "evaluate"):
            res = subprocess.run([sys.executable, "-m", "mpiasgd", command, str(tmp_path / name)],
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 2 and expected in res.stderr, (command, name, res.stderr)
            assert "Traceback" not in res.stderr


def test_report_rebuilds_the_network_from_the_stored_definition():
    """`mpiasgd report` lists the network's layers from the log's definition (data), and says so when it cannot
    be built (a tampered attribute) instead of failing or running anything."""
    from mpiasgd.model import build_model
    from mpiasgd.model.spec import to_json
    from mpiasgd.tools.report import network_lines

    text = to_json(build_model("resnet20").spec())
    lines = network_lines({"model_spec": text})
    assert lines[0] == "network (the log's stored definition):" and len(lines) == 1 + 14 + 1
    assert lines[4].split()[0] == "res1" and lines[-1] == "  total 269,722 parameters, 1,376 buffer values"
    assert network_lines({}) == []
    bad = text.replace('"Residual"', '"__import__"', 1)
    assert network_lines({"model_spec": bad})[0].startswith(
        "network: the log's stored definition cannot be built (layers[3]: unknown layer type '__import__'")


def log_with_evaluations(path) -> str:
    """A completed log of 10 pushes (data_s a quarter of compute_s on worker 1, none on worker 2), three
    evaluations during training and a final one."""
    from mpiasgd.runlog import PeriodicEvalRow

    log = RunLog.create(str(path), {"config": {"mode": "async"}, "num_workers": 2, "num_train": 1000}, [WORKER], 3,
                        flush_interval=60.0)
    for i in range(10):
        w = 1 + i % 2
        log.add(dataclasses.replace(push(0.1 * i, 0), worker=w, compute_s=0.4, data_s=0.1 if w == 1 else 0.0,
                                    loss=2.0 - 0.1 * i))
    for t, top1, top5 in ((1.0, 0.4, 0.8), (2.0, 0.65, 0.9), (3.0, 0.62, 0.95)):
        log.add(PeriodicEvalRow(time=t, samples=int(100 * t), epoch=t / 10, version_min=int(10 * t) - 1,
                                version_max=int(10 * t), count=360, loss=1.0 / t, top1=top1, top5=top5, seconds=0.5,
                                snapshot=-1))
    log.add(EvalRow(time=4.0, version=40, epoch=0.4, snapshot=-1, loss=0.2, accuracy=0.7, count=360, top5=0.97))
    log.close("completed", {"train_time_s": 4.0, "test_accuracy": 0.7, "test_top5": 0.97})
    return str(path)


def test_report_prints_the_evaluations_during_training_and_the_data_wait(tmp_path):
    """The evaluations during training are a table (versions, images, top-1, top-5); the final top-5 and the
    workers' data wait (a share of their compute time) are in the summary; time to a target accuracy also
    counts evaluations during training."""
    from mpiasgd.runlog import summary_lines

    path = log_with_evaluations(tmp_path / "ev.h5")
    text = report([path]).splitlines()
    at = text.index("evaluations during training (--eval-interval):")
    assert text[at + 2].split() == ["1.0", "0.10", "9..10", "360", "40.00%", "80.00%", "1.0000", "0.5", "-"]
    assert text[at + 4].split()[4:6] == ["62.00%", "95.00%"]
    lines = summary_lines(path)
    assert "test accuracy    70.00 %  on 360 images (top-5 97.00 %, loss 0.2000)" in lines
    assert ("during training  3 evaluations (--eval-interval); best top-1 65.00 % at epoch 0.20, last 62.00 % at "
            "epoch 0.30") in lines
    assert "data wait        12.5 % of the step (the workers' compute time spent waiting for minibatches)" in lines
    rank1 = next(line for line in text if line.startswith("   1  host"))
    assert rank1.split()[-1] == "25.0%"  # worker 1's own share
    run = load(path)
    assert time_to_accuracy(run, 0.6) == 2.0 and time_to_accuracy(run, 0.7) is None
    from mpiasgd.tools.plots import plot_runs

    plain = write_log(tmp_path / "plain.h5", {"mode": "async"}, [dataclasses.replace(push(0.1, 0), loss=1.0)],
                      final_accuracy=0.5)
    paths = plot_runs([run, load(plain)], str(tmp_path / "plots"))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["accuracy.png", "loss.png", "staleness.png", "time.png"]


def test_an_older_log_reports_without_the_new_columns(tmp_path):
    """A log whose tables lack data_s and top5 (an older version's): no data-wait line, "-" in its column,
    the final accuracy without top-5."""
    from mpiasgd.runlog import summary_lines

    path = write_log(tmp_path / "old.h5", {"mode": "async"}, [push(0.1, 0), push(0.2, 0)], final_accuracy=0.5)
    with h5py.File(path, "r+", libver="latest") as f:
        for name, drop in (("pushes", "data_s"), ("evals", "top5")):
            rows = f[name][()]
            old = np.zeros(len(rows), dtype=[(n, rows.dtype[n]) for n in rows.dtype.names if n != drop])
            for n in old.dtype.names:
                old[n] = rows[n]
            del f[name]
            f.create_dataset(name, data=old, maxshape=(None,), chunks=(1024,))
    lines = summary_lines(path)
    assert "test accuracy    50.00 %  on 100 images (loss 1.0000)" in lines
    assert not any(line.startswith("data wait") for line in lines)
    assert next(line for line in report([path]).splitlines() if line.startswith("   1  host")).split()[-1] == "-"


def test_each_shards_staleness_is_over_the_whole_log_as_the_runs_is(tmp_path):
    """--servers S > 1: the summary's (and `report`'s) line per shard takes each shard's staleness from the
    applied /shard_pushes rows of every segment, less the spans a resume superseded, as the run's staleness line
    takes the pushes' (the attributes of an older resumed log covered only its last segment: here 0); a log
    without those rows falls back on the attributes; a killed log (no summary) gets its versions from the rows."""
    from mpiasgd.runlog import ShardPushRow, summary_lines

    def shard_push(time, shard, staleness, version, applied=1):
        return ShardPushRow(time=time, shard=shard, worker=1, step=version, base_version=version - 1 - staleness,
                            version=version, staleness=staleness, applied=applied)

    path = write_log(tmp_path / "s.h5", {"mode": "async"}, [push(0.1, 1), push(0.2, 3), push(0.8, 7), push(1.2, 0)],
                     final_accuracy=0.5, close=False)
    log = RunLog.reopen(path, [WORKER] * 2, 60.0, None)
    log.file.attrs["servers"] = 2
    log.file.attrs["superseded"] = json.dumps([[0.5, 1.0]])  # the push at 0.8: logged after its checkpoint
    for row in (shard_push(0.1, 0, 1, 1), shard_push(0.2, 0, 3, 2), shard_push(0.8, 0, 7, 3),
                shard_push(1.2, 0, 0, 3), shard_push(1.25, 0, 9, 3, applied=0),
                shard_push(0.1, 1, 2, 1), shard_push(0.2, 1, 4, 2), shard_push(0.8, 1, 8, 3),
                shard_push(1.2, 1, 1, 3)):
        log.add(row)
    log.close("completed", {"shard_versions": [3, 3], "shard_staleness_mean": [0.0, 0.0],
                            "shard_staleness_max": [0, 0]})
    run = load(path)
    assert run["shard_pushes"]["time"].tolist() == [0.1, 0.2, 1.2, 1.25, 0.1, 0.2, 1.2]  # 0.8: superseded
    lines = summary_lines(path, run)
    assert "staleness        mean 1.33, max 3" in lines
    assert ("shards           shard 0: version 3, staleness mean 1.33 max 3; shard 1: version 3, staleness mean "
            "2.33 max 4") in lines
    with h5py.File(path, "r+", libver="latest") as f:  # a log without shard rows: the attributes
        del f["shard_pushes"]
        f.attrs["shard_staleness_mean"], f.attrs["shard_staleness_max"] = [0.5, 1.5], [2, 3]
    assert ("shards           shard 0: version 3, staleness mean 0.50 max 2; shard 1: version 3, staleness mean "
            "1.50 max 3") in summary_lines(path)
    killed = write_log(tmp_path / "k.h5", {"mode": "async"}, [push(0.1, 0)], close=False)
    log = RunLog.reopen(killed, [WORKER] * 2, 60.0, None)
    log.file.attrs["servers"] = 2
    log.add(shard_push(0.1, 0, 0, 1))
    log.add(shard_push(0.1, 1, 2, 4))
    log.flush()
    log.file.close()
    assert ("shards           shard 0: version 1, staleness mean 0.00 max 0; shard 1: version 4, staleness mean "
            "2.00 max 2") in summary_lines(killed)


def test_a_resumes_span_leaves_out_the_shard_rows_its_checkpoint_does_not_hold_by_step(tmp_path):
    """--servers S > 1: a span that records its checkpoint's steps (`RunLog.reopen(resumed_steps=...)`) leaves out
    the /shard_pushes rows logged up to its end whose step the checkpoint does not hold, whatever their time: a
    shard's clock is mapped onto rank 0's, so a row the checkpoint holds may carry a time just after it and one it
    does not a time just before (the time alone dropped the first and kept the second). Rows after the span stay;
    a span without steps (an older log) goes by time; pushes rows always by time."""
    from mpiasgd.runlog import ShardPushRow, open_log
    from mpiasgd.runlog.reader import superseded_spans

    def shard_push(time, shard, worker, step):
        return ShardPushRow(time=time, shard=shard, worker=worker, step=step, base_version=0, version=step,
                            staleness=0, applied=1)

    path = write_log(tmp_path / "s.h5", {"mode": "async"}, [push(0.4, 0), push(0.6, 0)], close=False)
    rows = [shard_push(0.4, 0, 1, 3), shard_push(0.6, 0, 1, 4),  # shard 0: time and step agree
            shard_push(0.51, 1, 1, 3),  # held by the checkpoint (step 3), its time mapped just after 0.5
            shard_push(0.49, 1, 2, 6),  # not held (worker 2 at step 5 there), its time just before 0.5
            shard_push(0.3, 1, 2, 5)]
    log = RunLog.reopen(path, [WORKER] * 2, 60.0, None)
    for row in rows:
        log.add(row)
    log.flush()
    log.file.close()  # (killed after its checkpoint at 0.5)
    log = RunLog.reopen(path, [WORKER] * 2, 60.0, None, resumed_at=0.5, resumed_steps=[(1, 3), (2, 5)])
    log.add(shard_push(0.7, 1, 1, 4))  # the resumed segment's (its clock goes on from the log's last time)
    log.close("completed")
    with open_log(path) as f:
        spans = superseded_spans(f.attrs["superseded"])
    assert spans == [[0.5, 0.6, [[1, 3], [2, 5]]]]
    run = load(path)
    assert run["pushes"]["time"].tolist() == [0.4]
    kept = run["shard_pushes"][["time", "worker", "step"]].tolist()
    assert kept == [(0.4, 1, 3), (0.51, 1, 3), (0.3, 2, 5), (0.7, 1, 4)]
    assert run["superseded_s"] == pytest.approx(0.1)
    by_time = load_with_spans(path, [[0.5, 0.6]])  # an older log's span: by time
    assert by_time["shard_pushes"][["time", "worker", "step"]].tolist() == [
        (0.4, 1, 3), (0.49, 2, 6), (0.3, 2, 5), (0.7, 1, 4)]
    for malformed in ('[[0.5, 0.6, "x"]]', '[[0.5, 0.6, [[1]]]]'):  # steps that are not pairs: by time
        assert superseded_spans(malformed) == [[0.5, 0.6]]
    assert superseded_spans('[[0.5]]') == [] and superseded_spans('{"a": 1}') == []


def load_with_spans(path, spans):
    """`load(path)` after its attribute `superseded` is set to `spans`."""
    with h5py.File(path, "r+", libver="latest") as f:
        f.attrs["superseded"] = json.dumps(spans)
    return load(path)


def test_the_summary_says_the_wire_format_and_the_bytes_every_shard_moved(tmp_path):
    """async/ssp: the wire format and the bytes moved (every shard's, each shard's part with --servers S > 1) in the
    summary `train` prints and `report` shows; no such line where the log has no byte counts (sync)."""
    from mpiasgd.runlog import summary_lines

    path = write_log(tmp_path / "w.h5", {"mode": "async", "wire": "fp16"}, [push(0.1, 0), push(0.2, 1)],
                     close=False)
    log = RunLog.reopen(path, [WORKER] * 2, 60.0, None)
    log.close("completed", {"wire_bytes_pushed": 3_000_000, "wire_bytes_pulled": 4_500_000,
                            "shard_wire_bytes_pushed": [1_000_000, 2_000_000],
                            "shard_wire_bytes_pulled": [1_500_000, 3_000_000]})
    line = "wire             fp16: 3.0 MB pushed (1,500,000 bytes a push), 4.5 MB pulled (shard 0: 1.0 MB pushed, " \
           "1.5 MB pulled; shard 1: 2.0 MB pushed, 3.0 MB pulled)"
    assert line in summary_lines(path)
    assert line in report([path]).splitlines()
    plain = write_log(tmp_path / "s.h5", {"mode": "sync"}, [push(0.1, 0)])
    assert not any(x.startswith("wire") for x in summary_lines(plain))


def test_trace_gives_each_other_shard_a_track_with_the_pushes_it_applied(tmp_path):
    """--servers 2: `mpiasgd trace` adds a track for shard 1 (its rank from shard_processes) with an "apply" instant
    per push that shard applied (its /shard_pushes rows), none for a dropped one; shard 0's stay on rank 0."""
    from mpiasgd.runlog import ShardPushRow
    from mpiasgd.tools.trace import trace

    path = write_log(tmp_path / "t.h5", {"mode": "async"}, [push(0.1, 0), push(0.2, 1)], close=False)
    log = RunLog.reopen(path, [WORKER] * 2, 60.0, None)
    log.file.attrs["servers"] = 2
    log.file.attrs["shard_processes"] = json.dumps([[3, "node7", 4242]])
    for shard, time_s, version, applied in ((0, 0.1, 1, 1), (1, 0.15, 1, 1), (1, 0.25, 2, 1), (1, 0.3, 2, 0)):
        log.add(ShardPushRow(time=time_s, shard=shard, worker=1, step=version, base_version=version - 1,
                             version=version, staleness=0, applied=applied))
    log.close("completed", {})
    events = trace(path)["traceEvents"]
    assert {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}[3] == "rank 3 (parameter-server shard 1)"
    mine = [e for e in events if e["tid"] == 3 and e["ph"] == "i"]
    assert [(e["name"], e["ts"], e["args"]["version"]) for e in mine] == [("apply", 150000.0, 1),
                                                                          ("apply", 250000.0, 2)]
    easgd = write_log(tmp_path / "e.h5", {"mode": "easgd"}, [push(0.1, 0), push(0.2, 1)])
    assert len([e for e in trace(easgd)["traceEvents"] if e["name"] == "apply" and e["tid"] == 0]) == 2


def test_a_failed_run_says_its_cause_and_the_checkpoint_left(tmp_path):
    """A run that failed (a worker died): the report names the cause, the first line of its last 'preempt' or
    'failed' event, and the checkpoint beside the log when there is one."""
    attrs = {"config": {"mode": "async"}, "model": "digits", "mode": "async", "num_workers": 2, "num_params": 3,
             "num_train": 1000}
    path = str(tmp_path / "k.h5")
    log = RunLog.create(path, attrs, [WORKER] * 2, 3, flush_interval=60.0)
    log.add(push(0.1, 0))
    log.add(EventRow(time=0.2, kind=b"preempt", text="worker rank 2 on vm died (exit code 137): checkpoint "
                                                     "'runs/k.ckpt.h5' written at version 1\ndetails"))
    log.close("failed", {"train_time_s": 0.2})
    text = report([path])
    assert "failed           worker rank 2 on vm died (exit code 137): checkpoint 'runs/k.ckpt.h5' written at " \
           "version 1" in text.splitlines()
    assert "checkpoint       " not in text  # none beside the log
    (tmp_path / "k.ckpt.h5").write_bytes(b"x")
    assert f"checkpoint       {tmp_path / 'k.ckpt.h5'}  (continue with '--resume {tmp_path / 'k.ckpt.h5'}')" in \
        report([path]).splitlines()


def test_a_replaced_worker_keeps_its_line_and_its_row_names_the_replacement(tmp_path):
    """(--respawn) Worker rank 2 dies at 1.0 s and a replacement takes its rank at 3.0 s: the /workers row of rank 2
    names the replacement's pid (written in place at a flush), the summary says the loss and the replacement, the
    per-worker table keeps one line for rank 2 ("replaced at 3.0 s"), and a rank the table lacks breaks the log."""
    from mpiasgd.runlog import RunLogError, summary_lines

    path = str(tmp_path / "re.h5")
    workers = [dataclasses.replace(WORKER, rank=r, pid=100 + r) for r in (1, 2)]
    log = RunLog.create(path, {"config": {"mode": "async"}, "num_workers": 2, "num_train": 1000}, workers, 3,
                        flush_interval=60.0)
    for i in range(10):
        log.add(dataclasses.replace(push(0.5 * i, 0), worker=1 + i % 2))
    log.add(EventRow(time=1.0, kind=b"worker_lost", text="worker rank 2 on host died after step 1 (ULFM reported "
                                                         "it): dropped, 1 worker goes on"))
    log.add(EventRow(time=3.0, kind=b"worker_joined", text="worker rank 2 is back: a replacement on host (pid 7) "
                                                           "started 2.0 s after the death was seen; it continues "
                                                           "from step 1, 2 workers train"))
    log.replace_worker(dataclasses.replace(WORKER, rank=2, pid=7, host=b"other"))
    log.close("completed", {"train_time_s": 5.0})
    run = load(path)
    assert [(int(r["rank"]), int(r["pid"]), r["host"]) for r in run["workers"]] == [(1, 101, b"host"), (2, 7, b"other")]
    assert ("workers lost     1 (died; the run went on, 1 replaced by --respawn): rank 2 at 1.0 s (replaced at "
            "3.0 s)") in summary_lines(path, run)
    rank2 = [line for line in report([path]).splitlines() if line.startswith("   2  ")]
    assert len(rank2) == 1 and rank2[0].endswith("  replaced at 3.0 s") and "lost at" not in rank2[0]

    attached = str(tmp_path / "at.h5")  # (--attach) the same, brought back by `mpiasgd attach`
    log = RunLog.create(attached, {"config": {"mode": "async"}, "num_workers": 2, "num_train": 1000}, workers, 3,
                        flush_interval=60.0)
    log.add(EventRow(time=1.0, kind=b"worker_lost", text="worker rank 2 on host died after step 1 (ULFM reported "
                                                         "it): dropped, 1 worker goes on"))
    log.add(EventRow(time=2.0, kind=b"respawn_failed", text="MPI_Comm_spawn of a replacement for worker rank 2 on "
                                                            "host 'x' failed: MPI_ERR_UNKNOWN"))
    log.add(EventRow(time=4.0, kind=b"worker_joined", text="worker rank 2 is back: a replacement on host (pid 7) "
                                                           "started 1.5 s after an attach from 10.0.0.7:5 asked; it "
                                                           "continues from step 1, 2 workers train"))
    log.close("completed", {"train_time_s": 5.0})
    assert ("workers lost     1 (died; the run went on, 1 replaced by mpiasgd attach; 1 replacement did not start "
            "(events respawn_failed)): rank 2 at 1.0 s (replaced at 4.0 s)") in summary_lines(attached)

    broken = RunLog.create(str(tmp_path / "b.h5"), {"config": {"mode": "async"}}, workers, 3, flush_interval=60.0)
    broken.replace_worker(dataclasses.replace(WORKER, rank=5))
    with pytest.raises(RunLogError, match="no row of worker rank 5 in /workers"):
        broken.flush()
    broken.abandon()
