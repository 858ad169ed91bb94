"""`mpiasgd simulate`: the asynchronous protocol with virtual workers on a virtual clock, in-process.

The event order is checked against timings worked out by hand; the update against a serial SGD by hand;
the run log against `mpiasgd report` and `evaluate`; the timing model's sources (a profile, a fit) and
their errors. Every run is a short digits run (batch 16), a second or two.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from kit.runs import read_log

from mpiasgd.data import MinibatchStream, ShardSampler
from mpiasgd.data.loader import open_data
from mpiasgd.model import build_model
from mpiasgd.optim import SGD
from mpiasgd.sim import ComputeDraws, ComputeTime, ProfileError, TimingModel, fit_run_log, load_profile
from mpiasgd.sim.cli import main

B = 16


def simulate(tmp_path, *flags: str, name: str = "run", workers: int = 2):
    """Run `mpiasgd simulate` in-process on digits; returns the log as (attributes, tables, snapshot params)."""
    argv = ["--workers", str(workers), "--model", "digits", "--batch-size", str(B), "--no-progress",
            "--run-dir", str(tmp_path), "--name", name, "--flush-interval", "60", *flags]
    assert main(argv) == 0
    return read_log(tmp_path / f"{name}.h5")


def profile(tmp_path, values: dict, name: str = "timing.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(values))
    return str(path)


def rows(pushes, *columns):
    return [tuple(r[c].item() for c in columns) for r in pushes]


# --- the event order ------------------------------------------------------------------------------------

def test_event_order_matches_a_hand_worked_timing(tmp_path):
    """Worker 1 computes 1.0 s per minibatch, worker 2 3.0 s; 0.1 s per message; the server 0.05 s per push.

    t=0     the initial weights leave; both have them at 0.1
    1.2     w1's push (base 0) arrives; served until 1.25: version 1; reply at w1 1.35, next push 2.35 -> 2.45
    2.5     w1's push 2 (base 1) applied: version 2, staleness 0; reply 2.6 -> push 3.6 -> 3.7
    3.25    w2's push 1 (sent 3.1, arrived 3.2, base 0) applied at version 2: staleness 2, version 3; w2's
            reply 3.35 -> push 6.35 -> 6.45
    3.75    w1's push 3 (base 2) at version 3: staleness 1, version 4; reply 3.85 -> 4.85 -> 4.95
    5.0     w1 push 4 (base 4): staleness 0, v5; 6.25 w1 push 5 (base 5): staleness 0, v6
    6.5     w2 push 2 (base 3) at version 6: staleness 3, v7; its reply 6.6 -> push 9.6 -> 9.7
    7.5     w1 push 6 (base 6, arrived 7.45) at 7: staleness 1, v8 = --max-pushes: STOP to w1
    9.75    w2 push 3 (base 7) drained: not applied, staleness 1; STOP to w2 at 9.75, its EVAL after
            1.8 s of evaluation (180 images x 0.01 s) + 0.1: the run ends at 11.75
    wait_s: the first push's is the initial weights' 0.1, every other 0.1 + 0.05 + 0.1.
    """
    path = profile(tmp_path, {"compute": {"mean_s": 1.0}, "workers": {"2": {"mean_s": 3.0}}, "latency_s": 0.1,
                              "bandwidth": 0, "server_s": 0.05, "eval_s_per_image": 0.01})
    attrs, t, _ = simulate(tmp_path, "--profile", path, "--max-pushes", "8", "--epochs", "0")
    p = t["pushes"]
    assert rows(p, "worker", "step", "base_version", "staleness", "version", "applied") == [
        (1, 1, 0, 0, 1, 1), (1, 2, 1, 0, 2, 1), (2, 1, 0, 2, 3, 1), (1, 3, 2, 1, 4, 1),
        (1, 4, 4, 0, 5, 1), (1, 5, 5, 0, 6, 1), (2, 2, 3, 3, 7, 1), (1, 6, 6, 1, 8, 1), (2, 3, 7, 1, 8, 0)]
    np.testing.assert_allclose(p["time"], [1.25, 2.5, 3.25, 3.75, 5.0, 6.25, 6.5, 7.5, 9.75], atol=1e-9)
    np.testing.assert_allclose(p["compute_s"], [1, 1, 3, 1, 1, 1, 3, 1, 3])
    np.testing.assert_allclose(p["wait_s"], [0.1, 0.25, 0.1, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25], rtol=1e-5)
    assert (p["comm_s"] == 0).all() and (p["data_s"] == 0).all()
    np.testing.assert_allclose(t["updates"]["time"], p["time"][:8], atol=1e-9)
    assert float(attrs["wall_time_s"]) == pytest.approx(11.75)
    assert t["evals"]["time"][-1] == pytest.approx(11.75) and t["evals"]["count"][-1] == 360
    assert attrs["clock"] == "virtual" and json.loads(attrs["simulated"])["server_s"] == 0.05
    assert [r["host"] for r in t["workers"]] == [b"simulated"] * 2 and (t["workers"]["pid"] == 0).all()


def test_equal_workers_take_turns_with_staleness_n_minus_1(tmp_path):
    """Zero latency and server time, equal deterministic workers: all pushes of a round arrive at the same
    time and the lower rank is served first, so the order is round-robin and every push after the first
    round was computed N - 1 updates ago."""
    _, t, _ = simulate(tmp_path, "--compute-s", "1.0", "--max-pushes", "12", "--epochs", "0", workers=3)
    p = t["pushes"][:12]
    assert p["worker"].tolist() == [1, 2, 3] * 4
    assert p["staleness"].tolist() == [0, 1, 2] + [2] * 9
    assert p["time"].tolist() == [1.0] * 3 + [2.0] * 3 + [3.0] * 3 + [4.0] * 3


def test_shards_serve_and_carry_their_slices_in_parallel(tmp_path, capsys):
    """--servers 2: the same pushes in the same order with the same weights as one server, each served in half
    the time (server-bound here: the pushes come twice as fast) and each message's payload split over 2 links;
    the log keeps servers 2 and the start says so."""
    path = profile(tmp_path, {"compute": {"mean_s": 0.001}, "latency_s": 0.0, "bandwidth": 1e6, "server_s": 0.01})
    one, t1, w1 = simulate(tmp_path, "--profile", path, "--max-pushes", "10", "--epochs", "0", name="s1", workers=3)
    two, t2, w2 = simulate(tmp_path, "--profile", path, "--max-pushes", "10", "--epochs", "0", "--servers", "2",
                           name="s2", workers=3)
    assert capsys.readouterr().out.count("; 2 parameter-server shards, timed as working in parallel on their") == 1
    p1, p2 = t1["pushes"][:10], t2["pushes"][:10]
    assert p1["worker"].tolist() == p2["worker"].tolist() and p1["staleness"].tolist() == p2["staleness"].tolist()
    assert np.array_equal(w1, w2)
    payload = 6090 * 4  # digits' weights (no buffers), float32
    one_way = {1: (160 + payload) / 1e6, 2: (160 + payload / 2) / 1e6}  # header + payload (or its half) at 1 MB/s
    gaps = {s: np.diff(t["pushes"]["time"][3:10]) for s, t in ((1, t1), (2, t2))}
    assert np.median(gaps[1]) == pytest.approx(0.01, rel=1e-6)  # the server's time per push bounds the rate
    assert np.median(gaps[2]) == pytest.approx(0.005, rel=1e-6)
    # the first push is logged when served: weights out, compute, the push in, the update (server_s / S)
    assert p1["time"][0] == pytest.approx(one_way[1] + 0.001 + one_way[1] + 0.01, rel=1e-6)
    assert p2["time"][0] == pytest.approx(one_way[2] + 0.001 + one_way[2] + 0.005, rel=1e-6)
    assert json.loads(two["config"])["servers"] == 2 and json.loads(one["config"])["servers"] == 1


def test_a_worker_that_fails_is_dropped_and_the_others_go_on(tmp_path, capsys):
    """--fail 2@2.5: equal workers in turn (as above); worker rank 2 pushes at 1 and 2 s and dies before its
    third; rank 0 drops it (as under ULFM), the other two take turns to the end and end the run."""
    attrs, t, _ = simulate(tmp_path, "--compute-s", "1.0", "--max-pushes", "12", "--epochs", "0", "--fail", "2@2.5",
                           workers=3)
    assert attrs["status"] == "completed"
    p = t["pushes"][:12]  # (the 12 applied; the pushes that arrive after the stop follow)
    assert p["worker"].tolist() == [1, 2, 3, 1, 2, 3, 1, 3, 1, 3, 1, 3]
    assert p["time"].tolist() == [1.0] * 3 + [2.0] * 3 + [3.0] * 2 + [4.0] * 2 + [5.0] * 2
    lost = [(row["time"], row["text"].decode()) for row in t["events"] if row["kind"] == b"worker_lost"]
    assert lost == [(2.5, "worker rank 2 died after step 2 (--fail): dropped, 2 workers go on")]
    assert "workers lost     1 (died; the run went on without them): rank 2 at 2.5 s" in capsys.readouterr().out
    assert attrs["test_count"] == 360  # the survivors evaluated the dead worker's test slice too (LOST)
    from mpiasgd.runlog import load
    from mpiasgd.tools.report import worker_table

    rows = worker_table(load(str(tmp_path / "run.h5")))[1:]  # report's per-worker table marks the dead one
    assert [line.endswith("lost at 2.5 s") for line in rows] == [False, True, False]
    from mpiasgd.tools.watch import final_line

    assert final_line(str(tmp_path / "run.h5"))[0].endswith("; 1 worker lost")  # and watch's last line


def test_a_worker_that_fails_with_two_shards_is_dropped_alike(tmp_path):
    """--servers 2 (timed as two shards; the server's state is one server's): --fail 2@2.5 drops worker 2 as with
    one server, at the same step."""
    attrs, t, _ = simulate(tmp_path, "--compute-s", "1.0", "--max-pushes", "12", "--epochs", "0", "--fail", "2@2.5",
                           "--servers", "2", workers=3)
    assert attrs["status"] == "completed" and attrs["test_count"] == 360
    lost = [row["text"].decode() for row in t["events"] if row["kind"] == b"worker_lost"]
    assert lost == ["worker rank 2 died after step 2 (--fail): dropped, 2 workers go on"]
    p = t["pushes"]
    assert (p["worker"][p["time"] > 2.5] != 2).all() and (p["worker"] == 2).sum() == 2


def test_a_worker_that_joins_pulls_the_current_weights_and_trains(tmp_path):
    """--join 3@2.5: equal workers in turn (as above); workers 1 and 2 train alone until 2.5 s, then worker 3 pulls
    the weights of version 4 and pushes from 3.5 s on, every second, as the others; it evaluates its own test
    slice (360 test images in all). A join after the stop only evaluates."""
    attrs, t, _ = simulate(tmp_path, "--compute-s", "1.0", "--max-pushes", "12", "--epochs", "0", "--join", "3@2.5",
                           workers=3)
    assert attrs["status"] == "completed" and attrs["test_count"] == 360
    p = t["pushes"][:12]
    assert p["worker"].tolist() == [1, 2, 1, 2, 1, 2, 3, 1, 2, 3, 1, 2]
    assert p["time"].tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.5, 4.0, 4.0, 4.5, 5.0, 5.0]
    assert p["base_version"][6] == 4 and p["step"][6] == 1  # its first pull: the version it joined at
    joined = [(row["time"], row["text"].decode()) for row in t["events"] if row["kind"] == b"worker_joined"]
    assert len(joined) == 1 and joined[0][0] == 2.5
    assert joined[0][1].startswith("worker rank 3 joined at version 4 (--join): it reads its shard from epoch ")
    from mpiasgd.runlog import load
    from mpiasgd.tools.report import worker_table

    rows = worker_table(load(str(tmp_path / "run.h5")))[1:]  # report's per-worker table marks the late one
    assert [line.endswith("joined at 2.5 s") for line in rows] == [False, False, True]
    attrs, t, _ = simulate(tmp_path, "--compute-s", "1.0", "--max-pushes", "6", "--epochs", "0", "--join", "3@50",
                           name="late", workers=3)
    assert attrs["status"] == "completed" and attrs["test_count"] == 360 and not (t["pushes"]["worker"] == 3).any()
    assert [row["text"].decode() for row in t["events"] if row["kind"] == b"worker_joined"] == [
        "worker rank 3 joined after the stop (--join): it only evaluates its test slice"]


def test_ssp_goes_on_without_a_worker_that_fails(tmp_path):
    """--mode ssp --staleness-bound 0 (lockstep) with --fail 2@2.5: the dead worker's clock holds no one back; the
    other two go on in lockstep to the end (held forever behind its clock, the protocol would be stuck)."""
    attrs, t, _ = simulate(tmp_path, "--mode", "ssp", "--staleness-bound", "0", "--compute-s", "1.0",
                           "--max-pushes", "12", "--epochs", "0", "--fail", "2@2.5", workers=3)
    assert attrs["status"] == "completed"
    p = t["pushes"][:12]
    assert p["worker"].tolist() == [1, 2, 3, 1, 2, 3, 1, 3, 1, 3, 1, 3]
    assert p["step"].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 5]
    assert attrs["test_count"] == 360


@pytest.mark.parametrize("flags,expected", [
    (["--fail", "4@1"], "entry '4@1': expected W@T, W a worker rank 1..3"),
    (["--fail", "2@-1"], "entry '2@-1'"), (["--fail", "2@1,2@3"], "entry '2@3'"), (["--fail", "2"], "entry '2'"),
    (["--fail", "1@1,2@1,3@1"], "3 of 3 workers die, fewer than --min-workers 1"),
    (["--join", "4@1"], "--join '4@1': entry '4@1': expected W@T, W a worker rank 1..3 named once and T the "
                        "virtual seconds >= 0 at which it joins"),
    (["--join", "1@1,2@1,3@1"], "--join: all 3 workers join after the start"),
    (["--join", "2@1", "--fail", "2@3"], "--join and --fail both name worker rank(s) [2]"),
    (["--join", "2@1", "--warm-start", "5"], "--join with --warm-start"),
    (["--min-workers", "5", "--compute-s", "0.01"], "config key 'min_workers' = 5: more than the job's 3 workers"),
])
def test_bad_failures_are_one_error_naming_the_entry(tmp_path, capsys, flags, expected):
    argv = ["--workers", "3", "--model", "digits", "--run-dir", str(tmp_path), "--no-progress", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


def test_ssp_bound_zero_is_lockstep(tmp_path):
    """ssp with --staleness-bound 0: the faster worker 1 is held until worker 2 has pushed the same step; the
    hold shows as held_s on its next push (first: 1.25 -> 3.25)."""
    path = profile(tmp_path, {"compute": {"mean_s": 1.0}, "workers": {"2": {"mean_s": 3.0}}, "latency_s": 0.1,
                              "bandwidth": 0, "server_s": 0.05})
    _, t, _ = simulate(tmp_path, "--profile", path, "--mode", "ssp", "--staleness-bound", "0", "--max-pushes", "8",
                       "--epochs", "0")
    p = t["pushes"][:8]
    assert p["worker"].tolist() == [1, 2] * 4
    assert p["step"].tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    assert p["held_s"][2] == pytest.approx(2.0)


def test_the_same_seed_gives_the_same_run(tmp_path):
    flags = ("--compute-s", "0.1", "--compute-cv", "0.5", "--latency-s", "0.01", "--server-s", "0.002",
             "--max-pushes", "30", "--epochs", "0")
    _, first, w1 = simulate(tmp_path, *flags, name="a", workers=3)
    _, second, w2 = simulate(tmp_path, *flags, name="b", workers=3)
    assert first["pushes"].tobytes() == second["pushes"].tobytes()
    np.testing.assert_array_equal(w1[-1], w2[-1])
    assert len(set(first["pushes"]["compute_s"].tolist())) > 10  # the draws do vary
    _, other, _ = simulate(tmp_path, *flags, "--seed", "1", name="c", workers=3)
    assert other["pushes"]["compute_s"].tolist() != first["pushes"]["compute_s"].tolist()


# --- the update is the real one ---------------------------------------------------------------------------

def test_one_worker_equals_serial_sgd(tmp_path):
    """One worker, no latency: every push is applied at once by the server's SGD, so the final weights are
    those of serial momentum SGD over the worker's minibatches, computed here by hand."""
    steps = 6
    _, t, snapshots = simulate(tmp_path, "--compute-s", "0.1", "--max-pushes", str(steps), "--epochs", "0",
                               "--lr-schedule", "constant", "--warmup-epochs", "0", "--lr", "0.05", workers=1)
    assert (t["pushes"]["staleness"] == 0).all() and len(t["updates"]) == steps
    digits = open_data("digits")
    model = build_model("digits")
    w, g = model.init_params(0), np.zeros(model.num_params, np.float32)
    sgd = SGD(w, model.decay_mult(), 0.9, 5e-4, lr_scale=model.lr_mult())
    stream = MinibatchStream(digits, ShardSampler(digits.num_train, 1, 0, 0, digits.chunk, 16), B, 0, 1)
    for _ in range(steps):
        model.bind(w, g)
        x, y, _ = stream.next()
        model.forward_backward(x, y, minibatch=stream.cursor)
        w = sgd.step(g, 0.05)
    np.testing.assert_allclose(snapshots[-1], w, rtol=1e-6, atol=1e-7)


def test_a_straggler_pushes_a_third_as_often(tmp_path):
    _, t, _ = simulate(tmp_path, "--compute-s", "0.1", "--straggler", "2:3", "--max-pushes", "40", "--epochs", "0")
    p = t["pushes"][t["pushes"]["applied"] == 1]
    ones, twos = (p["worker"] == 1).sum(), (p["worker"] == 2).sum()
    assert twos / ones == pytest.approx(1 / 3, abs=0.05)
    np.testing.assert_allclose(p["compute_s"][p["worker"] == 2], 0.3, rtol=1e-6)


def test_warm_start_trains_worker_1_alone_first(tmp_path):
    _, t, _ = simulate(tmp_path, "--compute-s", "0.1", "--warm-start", "1.0", "--max-pushes", "30", "--epochs", "0")
    p = t["pushes"]
    assert set(p["worker"][p["time"] < 1.0].tolist()) == {1} and (p["time"] < 1.0).sum() >= 9
    assert p["time"][p["worker"] == 2].min() == pytest.approx(1.1)  # its weights left at 1.0, 0.1 s of compute
    assert b"warm_start_end" in t["events"]["kind"].tolist()


def test_nsync_pushes_accumulated_updates_that_the_server_applies(tmp_path):
    _, t, snapshots = simulate(tmp_path, "--compute-s", "0.1", "--nsync", "2", "--max-pushes", "10", "--epochs", "0")
    p = t["pushes"][t["pushes"]["applied"] == 1]
    assert len(p) == 10 and (p["samples"] == 2 * B).all()
    np.testing.assert_allclose(p["compute_s"], 0.2)
    assert (p["lr"] > 0).all() and len(t["updates"]) == 10
    assert not np.array_equal(snapshots[0], snapshots[-1])


# --- the run log ----------------------------------------------------------------------------------------

def test_report_and_evaluate_read_the_log(tmp_path):
    from mpiasgd.tools.evaluate import evaluate_snapshots
    from mpiasgd.tools.report import report

    _, t, _ = simulate(tmp_path, "--compute-s", "0.05", "--latency-s", "0.001", "--epochs", "1", "--eval-interval",
                       "0.5s", "--snapshot-interval", "0.5", workers=4)
    path = str(tmp_path / "run.h5")
    assert len(t["periodic_evals"]) >= 2 and (t["periodic_evals"]["count"] == 360).all()
    text = report([path])
    assert "mode async, 4 workers" in text and "test accuracy" in text
    assert "simulated        by `mpiasgd simulate`: every time below is virtual seconds" in text
    assert "stopped by       epochs: 1.00 >= 1" in text
    assert "async (simulated)" in report([path, path])  # the comparison table marks it
    evaluated = evaluate_snapshots(path, batch_size=256)
    assert len(evaluated) == len(t["snapshots/meta"]) >= 3
    np.testing.assert_allclose(evaluated["time"], t["snapshots/meta"]["time"])


def test_no_mpi_is_initialised(tmp_path):
    code = ("import sys; from mpiasgd.cli import main; status = main(sys.argv[1:]); from mpi4py import MPI; "
            "print('mpi initialised', MPI.Is_initialized()); sys.exit(status)")
    res = subprocess.run([sys.executable, "-c", code, "simulate", "--workers", "2", "--model", "digits",
                          "--max-pushes", "4", "--epochs", "0", "--compute-s", "0.1", "--no-progress",
                          "--run-dir", str(tmp_path), "--name", "x"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "mpi initialised False" in res.stdout and "status: completed" in res.stdout


# --- the timing model -----------------------------------------------------------------------------------

def test_a_timing_model_round_trips_through_json(tmp_path):
    model = TimingModel(ComputeTime(0.2, 0.1, startup_s=0.4), latency_s=0.01, bandwidth=1e9, server_s=0.003,
                        workers={3: ComputeTime(samples=(0.5, 0.6), startup_s=1.5)}, stragglers={3: 2.5},
                        batch_size=32, note="x")
    assert TimingModel.from_json(model.to_json()) == model
    path = tmp_path / "t.json"
    from mpiasgd.sim import save_profile

    save_profile(model.resolved(32), str(path))
    assert load_profile(str(path)) == model.resolved(32)
    assert model.transfer_s(1000) == pytest.approx(0.01 + 1e-6)


@pytest.mark.parametrize(("values", "key"), [
    ({"compute": {"mean_s": 0.1}, "bandwidth": 0, "server_s": 0}, "latency_s"),
    ({"compute": {"mean_s": 0.1}, "latency_s": 0, "bandwidth": 0, "server_s": -1}, "server_s"),
    ({"compute": {"mean_s": -0.1}, "latency_s": 0, "bandwidth": 0, "server_s": 0}, "compute.mean_s"),
    ({"compute": {"samples": [0.1, "x"]}, "latency_s": 0, "bandwidth": 0, "server_s": 0}, "compute.samples[1]"),
    ({"compute": {"mean_s": 0.1}, "latency_s": 0, "bandwidth": 0, "server_s": 0, "lag": 1}, "lag"),
    ({"compute": {"mean_s": 0.1}, "latency_s": 10**300, "bandwidth": 0, "server_s": 0}, "latency_s"),
    ({"compute": {"mean_s": 1e300}, "latency_s": 0, "bandwidth": 0, "server_s": 0}, "compute.mean_s"),
    ({"compute": {"mean_s": 1e-9}, "latency_s": 0, "bandwidth": 0, "server_s": 0}, "compute.mean_s"),
    ({"compute": {"mean_s": 0.1}, "latency_s": 0, "bandwidth": 1e-300, "server_s": 0}, "bandwidth"),
    ({"compute": {"mean_s": 0.1}, "latency_s": 0, "bandwidth": 0, "server_s": 0, "workers": {"\u00b2": {}}},
     "workers"),
    ({"compute": {"mean_s": 0.1, "startup_s": -1}, "latency_s": 0, "bandwidth": 0, "server_s": 0},
     "compute.startup_s"),
    ({"compute": {"mean_s": 0.1}, "latency_s": 0, "bandwidth": 0, "server_s": 0, "stragglers": {"2": 0.5}},
     "stragglers.2"),
    ({"compute": {"mean_s": 0.1}, "latency_s": 0, "bandwidth": 0, "server_s": 0, "stragglers": {"0": 2}},
     "stragglers"),
])
def test_a_bad_profile_is_one_error_naming_the_file_and_the_key(tmp_path, capsys, values, key):
    path = profile(tmp_path, values)
    assert main(["--workers", "2", "--profile", path, "--run-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and path in err and f"'{key}'" in err, err
    assert not list(tmp_path.glob("*.h5"))


@pytest.mark.parametrize("text", ['{"compute": {"mean_s": NaN}}', "[" * 100_000,
                                  '{"latency_s": 1, "latency_s": 2, "compute": {"mean_s": 1}}'])
def test_a_profile_that_is_not_json_is_named(tmp_path, text):
    """NaN, nesting deeper than the parser goes, a key given twice: one error naming the file."""
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=r"t\.json.*not valid JSON"):
        load_profile(str(path))


def test_save_profile_never_replaces_a_run_log_or_an_existing_file_unasked(tmp_path, capsys):
    """--save-profile onto the --fit log, onto another run log, or onto an existing file without --overwrite: one
    error, the file untouched, no run."""
    simulate(tmp_path, "--compute-s", "0.01", "--max-pushes", "6", "--epochs", "0", name="measured")
    log = tmp_path / "measured.h5"
    before = log.read_bytes()
    other = tmp_path / "other.json"
    other.write_text("{}")
    for target, extra, says in ((log, [], "is the run log --fit reads"), (log, ["--overwrite"], "is the run log"),
                                (other, [], "exists: give another file, or --overwrite")):
        argv = ["--workers", "2", "--model", "digits", "--fit", str(log), "--save-profile", str(target),
                "--run-dir", str(tmp_path), "--name", "again", "--no-progress", *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
    assert log.read_bytes() == before and other.read_text() == "{}" and not (tmp_path / "again.h5").exists()


def test_save_profile_is_written_only_once_the_run_starts_and_never_onto_its_own_log(tmp_path, capsys):
    """--save-profile with a bad option: refused before the profile is written (the corrected command can then
    write it); onto this run's own log or checkpoint path: one error, nothing written."""
    target = tmp_path / "t.json"
    argv = ["--workers", "2", "--model", "digits", "--compute-s", "0.01", "--max-pushes", "4", "--epochs", "0",
            "--run-dir", str(tmp_path), "--name", "r", "--no-progress", "--save-profile", str(target)]
    assert main([*argv, "--nsync", "100000", "--epochs", "1"]) == 2  # a round longer than the run
    assert "nsync" in capsys.readouterr().err and not target.exists()
    for own in ("r.h5", "r.ckpt.h5"):
        assert main([*argv[:-1], str(tmp_path / own)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "is this run's own log or checkpoint" in err, err
        assert not (tmp_path / "r.ckpt.h5").exists()
    assert main(argv) == 0
    assert json.loads(target.read_text())["compute"]["mean_s"] == 0.01


def test_overwrite_replaces_a_truncated_log_at_once(tmp_path):
    """A run log cut short (a copy, a full disk) under the run's name: --overwrite replaces it within seconds
    (start-up reads it holding the writer lock, never in HDF5's SWMR mode, which retries a truncated file for
    minutes), and the new log is complete. `train` starts up through the same code."""
    from mpiasgd.runlog import load

    simulate(tmp_path, "--compute-s", "0.01", "--max-pushes", "6", "--epochs", "0", name="cut")
    log = tmp_path / "cut.h5"
    pushes = len(load(str(log))["pushes"])
    log.write_bytes(log.read_bytes()[:5000])
    res = subprocess.run([sys.executable, "-m", "mpiasgd", "simulate", "--workers", "2", "--model", "digits",
                          "--compute-s", "0.01", "--max-pushes", "6", "--epochs", "0", "--no-progress", "--run-dir",
                          str(tmp_path), "--name", "cut", "--overwrite"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    run = load(str(log))
    assert run["status"] == "completed" and len(run["pushes"]) == pushes >= 6


def test_sigterm_closes_the_log_and_exits_143(tmp_path):
    """SIGTERM mid-simulation: one line, exit status 143, the log closed 'failed' and readable, no lock left."""
    import signal
    import time

    from mpiasgd.runlog import load

    proc = subprocess.Popen([sys.executable, "-m", "mpiasgd", "simulate", "--workers", "4", "--model", "digits",
                             "--epochs", "100000", "--compute-s", "0.01", "--no-progress", "--run-dir", str(tmp_path),
                             "--name", "long", "--flush-interval", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        log = tmp_path / "long.h5"
        deadline = time.monotonic() + 60

        def training() -> bool:  # the log has more than 20 pushes flushed
            try:
                pushes = load(str(log))["pushes"] if log.exists() else None
            except ValueError:  # (being created: HDF5's file lock, before the writer turns SWMR on)
                return False
            return pushes is not None and len(pushes) > 20

        while not training():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, (out, err)
    assert "terminated (SIGTERM)" in err and len(err.strip().splitlines()) == 1, err
    assert load(str(log))["status"] == "failed" and not (tmp_path / "long.h5.lock").exists()
    from mpiasgd.runlog.reader import open_log

    with open_log(str(log)) as f:  # the event says why, without a traceback: the user stopped it
        kinds, texts = f["events"]["kind"], f["events"]["text"]
        events = [(kind.decode(), text.decode()) for kind, text in zip(kinds, texts, strict=True)]
    assert ("failed", "terminated (SIGTERM)") in events, events


@pytest.mark.parametrize(("flags", "says"), [
    (["--overlap"], "--overlap is not modelled"),
    (["--mode", "sync"], "--mode sync is not simulated"),
    (["--mode", "easgd"], "--mode easgd is not simulated"),
    ([], "no timing model"),
])
def test_what_is_not_simulated_is_one_clear_error(tmp_path, capsys, flags, says):
    timing = [] if says == "no timing model" else ["--compute-s", "0.1"]
    assert main(["--workers", "2", *timing, *flags, "--run-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_fit_refuses_a_file_that_is_not_a_run_log(tmp_path, capsys):
    bad = tmp_path / "notes.h5"
    bad.write_text("not hdf5")
    assert main(["--workers", "2", "--fit", str(bad), "--run-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--fit '{bad}'" in err and "not" in err, err


def test_fit_recovers_the_timing_a_simulation_ran_with(tmp_path):
    """Simulate 4 workers with a known model, fit a model from that log: compute mean, latency and server
    time within 10 %; then simulate from the fit and its saved profile."""
    simulate(tmp_path, "--compute-s", "0.02", "--compute-cv", "0.3", "--latency-s", "0.01", "--server-s", "0.004",
             "--epochs", "2", name="known", workers=4)
    fitted = fit_run_log(str(tmp_path / "known.h5"))
    assert fitted.compute.mean == pytest.approx(0.02, rel=0.1)
    assert fitted.latency_s == pytest.approx(0.01, rel=0.1)
    assert fitted.server_s == pytest.approx(0.004, rel=0.1)
    assert sorted(fitted.workers) == [1, 2, 3, 4] and fitted.batch_size == B
    saved = str(tmp_path / "fit.json")
    _, t, _ = simulate(tmp_path, "--fit", str(tmp_path / "known.h5"), "--save-profile", saved, "--max-pushes", "20",
                       "--epochs", "0", name="refit", workers=8)
    assert len(t["pushes"]) >= 20 and load_profile(saved).latency_s == pytest.approx(fitted.latency_s)


def test_fit_replay_replays_each_workers_measured_compute_times_in_order(tmp_path):
    """--fit-replay: worker w's pushes in the new simulation carry the compute times of worker w's pushes in the
    fitted log, in the same order (cycling past its end); a worker the log lacks replays the pooled trace."""
    simulate(tmp_path, "--compute-s", "0.02", "--compute-cv", "0.5", "--latency-s", "0.001", "--max-pushes", "12",
             "--epochs", "0", name="measured")
    _, t, _ = simulate(tmp_path, "--fit", str(tmp_path / "measured.h5"), "--fit-replay", "--max-pushes", "30",
                       "--epochs", "0", name="replayed", workers=3)
    _, measured, _ = read_log(tmp_path / "measured.h5")
    for w in (1, 2):
        trace = measured["pushes"]["compute_s"][measured["pushes"]["worker"] == w].tolist()
        got = t["pushes"]["compute_s"][t["pushes"]["worker"] == w].tolist()
        assert len(got) > len(trace) >= 3
        assert got == pytest.approx([trace[i % len(trace)] for i in range(len(got))], rel=1e-6)
    # the pooled trace: worker 1's times, then worker 2's; worker 3 takes it in order from an offset of its own
    p = measured["pushes"]
    pooled = [x for w in (1, 2) for x in p["compute_s"][(p["worker"] == w) & (p["samples"] > 0)].tolist()]
    third = t["pushes"]["compute_s"][t["pushes"]["worker"] == 3].tolist()
    assert len(third) >= 3 and any(
        third == pytest.approx([pooled[(k + i) % len(pooled)] for i in range(len(third))], rel=1e-6)
        for k in range(len(pooled)))
    with pytest.raises(ProfileError, match="--fit-replay needs --fit"):
        from mpiasgd.sim.cli import make_parser, timing_from

        timing_from(make_parser().parse_args(["--compute-s", "0.1", "--fit-replay"]))


# --- issue 36: a fit reproduces its run (the straggler, the start-up); the backend resolves as train's ----

def pushes_per_worker(pushes, workers=(1, 2)):
    return [int((pushes["worker"] == w).sum()) for w in workers]


def p99(pushes):
    stale = pushes["staleness"][pushes["applied"] == 1]
    return int(np.percentile(stale, 99, method="inverted_cdf"))


def test_fit_keeps_the_straggler_of_the_run_it_fits_and_says_so(tmp_path, capsys):
    """A run with --straggler 2:3 fitted without any flag: worker 2 stays 3x slower (push counts within 5 %,
    staleness p99 within one push), the log's config says straggler 2:3, and one line says what the fit
    took from the log. --straggler 2:1 replaces the run's factor (equal workers); 2:3 repeated changes nothing."""
    simulate(tmp_path, "--compute-s", "0.02", "--compute-cv", "0.2", "--straggler", "2:3", "--max-pushes", "120",
             "--epochs", "0", name="measured")
    _, measured, _ = read_log(tmp_path / "measured.h5")
    capsys.readouterr()
    attrs, t, _ = simulate(tmp_path, "--fit", str(tmp_path / "measured.h5"), "--max-pushes", "120", "--epochs", "0",
                           name="fitted")
    out = capsys.readouterr().out
    real, fitted = pushes_per_worker(measured["pushes"]), pushes_per_worker(t["pushes"])
    assert real[0] > 2.5 * real[1]
    assert fitted == pytest.approx(real, rel=0.05) and abs(p99(t["pushes"]) - p99(measured["pushes"])) <= 1
    assert json.loads(attrs["config"])["straggler"] == "2:3"
    said = [line for line in out.splitlines() if line.startswith("mpiasgd simulate: --fit")]
    assert len(said) == 1 and "2:3" in said[0] and "worker 2" in said[0], out
    _, same, _ = simulate(tmp_path, "--fit", str(tmp_path / "measured.h5"), "--straggler", "2:3", "--max-pushes",
                          "120", "--epochs", "0", name="repeated")
    assert same["pushes"]["compute_s"].tolist() == pytest.approx(t["pushes"]["compute_s"].tolist(), rel=1e-9)
    capsys.readouterr()
    _, even, _ = simulate(tmp_path, "--fit", str(tmp_path / "measured.h5"), "--straggler", "2:1", "--max-pushes",
                          "120", "--epochs", "0", name="even")
    ones, twos = pushes_per_worker(even["pushes"])
    assert twos / ones == pytest.approx(1, abs=0.15)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("mpiasgd simulate: --fit")]
    assert "--straggler 2:3 replaced by this run's --straggler 2:1" in said[0]


def test_fit_takes_a_workers_start_up_once_and_never_draws_it_again(tmp_path):
    """A worker's first push carries its start-up (first touch, compiled kernels, the first chunk read): the
    fit gives it to that worker's first minibatch once; the draws after it come from the other pushes only
    (drawn again at random, a 10x start-up would land in mid-run as a slow spell the real run never had)."""
    import h5py

    simulate(tmp_path, "--compute-s", "0.02", "--compute-cv", "0.1", "--max-pushes", "40", "--epochs", "0",
             name="measured")
    with h5py.File(tmp_path / "measured.h5", "r+") as f:  # a start-up of 0.5 s on each worker's first push
        pushes = f["pushes"][()]
        for w in (1, 2):
            first = np.flatnonzero(pushes["worker"] == w)[0]
            pushes["compute_s"][first] = 0.5
        f["pushes"][...] = pushes
    fitted = fit_run_log(str(tmp_path / "measured.h5"))
    for w in (1, 2):
        assert max(fitted.workers[w].samples) < 0.1
        assert ComputeDraws(fitted.workers[w], np.random.default_rng(0)).next() == pytest.approx(0.5, rel=0.2)
    _, t, _ = simulate(tmp_path, "--fit", str(tmp_path / "measured.h5"), "--max-pushes", "200", "--epochs", "0",
                       name="fitted")
    for w in (1, 2):
        times = t["pushes"]["compute_s"][t["pushes"]["worker"] == w]
        assert times[0] == pytest.approx(0.5, rel=0.2) and (times[1:] < 0.1).all()


def test_fit_line_shows_no_start_up_for_a_worker_whose_first_push_was_not_slower(tmp_path):
    """The --fit line as the docs show it (issue 36: it showed a start-up for every worker): worker 1's first push
    no slower than its others has none; worker 2's, 0.3 s slower than its typical one, has one."""
    import h5py

    from mpiasgd.config import Config
    from mpiasgd.sim.cli import fit_line

    simulate(tmp_path, "--compute-s", "0.02", "--compute-cv", "0.1", "--max-pushes", "40", "--epochs", "0",
             name="measured")
    with h5py.File(tmp_path / "measured.h5", "r+") as f:
        pushes = f["pushes"][()]
        ones, twos = (np.flatnonzero(pushes["worker"] == w) for w in (1, 2))
        pushes["compute_s"][ones[0]] = pushes["compute_s"][ones[1:]].min()  # no start-up
        typical = float(np.median(pushes["compute_s"][twos[1:]]))
        pushes["compute_s"][twos[0]] = typical + 0.3
        f["pushes"][...] = pushes
    fitted = fit_run_log(str(tmp_path / "measured.h5"))
    assert fitted.workers[1].startup_s == 0 and fitted.workers[2].startup_s == pytest.approx(0.3)
    line = fit_line(str(tmp_path / "measured.h5"), fitted, Config(), 2)
    assert f"worker 1 {fitted.workers[1].mean:.3g} s, worker 2 {fitted.workers[2].mean:.3g} s (start-up +0.3 s " \
           "once);" in line, line


def test_fit_takes_each_measured_time_once_a_pass(tmp_path):
    """A fitted worker's compute times are its measured ones in a random order, each once, pass after pass
    (drawn with replacement, a simulation's count of slow minibatches, and with it the push counts and the
    staleness p99, would be random): worker 2's pushes in the simulation carry, pass by pass, exactly the
    times worker 2's pushes carried in the fitted log (after its first, the start-up)."""
    simulate(tmp_path, "--compute-s", "0.02", "--compute-cv", "1.0", "--straggler", "2:3", "--max-pushes", "60",
             "--epochs", "0", name="measured")
    _, measured, _ = read_log(tmp_path / "measured.h5")
    _, t, _ = simulate(tmp_path, "--fit", str(tmp_path / "measured.h5"), "--max-pushes", "150", "--epochs", "0",
                       name="fitted")
    fitted = fit_run_log(str(tmp_path / "measured.h5"))
    for w, factor in ((1, 1), (2, 3)):
        real = measured["pushes"]["compute_s"][measured["pushes"]["worker"] == w][1:]
        got = t["pushes"]["compute_s"][t["pushes"]["worker"] == w].copy()
        got[0] -= fitted.workers[w].startup_s * factor  # the first pass's first time, with the start-up
        assert len(got) >= len(real) >= 10
        np.testing.assert_allclose(sorted(got[:len(real)]), sorted(real), rtol=1e-6)
        assert not np.allclose(got[:len(real)], real)  # in another order
    draws = ComputeDraws(ComputeTime(samples=(1.0, 2.0, 3.0, 4.0)), np.random.default_rng(0))
    passes = [[draws.next() for _ in range(4)] for _ in range(3)]
    assert all(sorted(p) == [1.0, 2.0, 3.0, 4.0] for p in passes) and len({tuple(p) for p in passes}) > 1


def test_backend_auto_resolves_as_trains_and_is_said(tmp_path, capsys):
    """--backend auto (the default) computes on the cpu backend, as `train` does on a node without a GPU; the
    log's workers say so and a start line names it. --backend numpy keeps the reference."""
    _, t, _ = simulate(tmp_path, "--compute-s", "0.01", "--max-pushes", "4", "--epochs", "0", name="auto")
    out = capsys.readouterr().out
    assert [r["backend"] for r in t["workers"]] == [b"cpu"] * 2
    assert any("backend cpu" in line and "auto" in line for line in out.splitlines()), out
    _, t, _ = simulate(tmp_path, "--compute-s", "0.01", "--max-pushes", "4", "--epochs", "0", "--backend", "numpy",
                       name="numpy")
    assert [r["backend"] for r in t["workers"]] == [b"numpy"] * 2


def test_fit_of_another_network_warns_naming_both(tmp_path, capsys):
    """--fit of a run of another network (or --profile saved from such a fit) says, as a batch-size mismatch
    does, that the compute times are the other network's, naming both (issue 36); the same network under
    another name (the digits definition copied into a JSON file) is no mismatch."""
    simulate(tmp_path, "--compute-s", "0.02", "--max-pushes", "8", "--epochs", "0", name="measured")
    fitted = str(tmp_path / "measured.h5")
    other = tmp_path / "linear.json"  # the digits images through one linear layer: another network
    other.write_text(json.dumps({"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 10}]}))
    same = tmp_path / "copy.json"
    same.write_text(json.dumps(build_model("digits").spec()))
    capsys.readouterr()

    def warnings(*flags: str, name: str) -> list[str]:
        simulate(tmp_path, *flags, "--dataset", "digits", "--max-pushes", "4", "--epochs", "0", name=name)
        return [line for line in capsys.readouterr().err.splitlines() if "warning" in line]

    said = warnings("--fit", fitted, "--model", str(other), "--save-profile", str(tmp_path / "p.json"), name="other")
    assert len(said) == 1 and said[0].startswith(
        "mpiasgd simulate: warning: the timing model's compute times were measured on network 'digits' (fitted from "
        f"run log '{fitted}' (") and said[0].endswith(
        f"this run simulates network '{other}' (--model): its compute times are the other network's, not this one's")
    assert warnings("--fit", fitted, "--model", str(same), name="same") == []
    assert warnings("--fit", fitted, name="digits") == []
    said = warnings("--profile", str(tmp_path / "p.json"), "--model", str(other), name="profiled")
    assert len(said) == 1 and "measured on network 'digits'" in said[0]
