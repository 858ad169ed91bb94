"""Training modes under `mpiexec`: sync (allreduce), ssp (staleness bound), overlap, warm start, a hung
worker, a 16-bit wire. Each job runs under a timeout; the checks read its run log (tests/unit/test_modes.py:
in-process).
"""

from __future__ import annotations

import numpy as np
import pytest
from kit.runs import FAST, B, read_log
from kit.worker import worker_pair

from mpiasgd.comms.protocol import message_bytes
from mpiasgd.config import Config
from mpiasgd.model import build_model
from mpiasgd.ops import numpy_ops
from mpiasgd.optim import learning_rate

# --- sync ----------------------------------------------------------------------------------------------

def test_sync_weights_equal_single_process_reference(mpirun, tmp_path, digits):
    """3 ranks, 8 sync steps: the logged final weights are those of averaging the 2 workers' gradients by hand."""
    steps, seed = 8, 5
    res = mpirun(3, ["train", *FAST, "--mode", "sync", "--seed", str(seed), "--epochs", "0", "--max-pushes",
                     str(steps), "--snapshot-interval", "0", "--name", "sync"], timeout=90)
    assert res.returncode == 0, res.explain()
    attrs, t, params = read_log(tmp_path / "runs" / "sync.h5")
    assert attrs["status"] == "completed" and attrs["mode"] == "sync"

    cfg = Config(model="digits", mode="sync", batch_size=B, seed=seed, epochs=0, max_pushes=steps)
    model = build_model("digits")
    w = model.init_params(seed)
    np.testing.assert_array_equal(params[0], w)  # the first snapshot: the initial weights
    workers = worker_pair(cfg, digits, w)
    velocity = np.zeros_like(w)
    decay = (cfg.weight_decay * model.decay_mask()).astype(np.float32)
    for k in range(steps):
        for worker in workers:
            worker.gradient()
        mean = workers[0].model.grads + workers[1].model.grads  # what the allreduce (MPI.SUM) gives
        mean *= np.float32(1 / 2)
        lr = learning_rate(cfg, k * B * 2 / digits.train_y.size, k / steps)
        numpy_ops.sgd_momentum(w, velocity, mean, decay, cfg.momentum, lr)
    np.testing.assert_allclose(params[-1], w, rtol=1e-5, atol=1e-7)
    assert not np.array_equal(params[-1], params[0])
    # one row per worker per step, staleness 0, every step applied; one update per step
    p = t["pushes"]
    rows = sorted(zip(p["worker"].tolist(), p["step"].tolist(), strict=True))
    assert rows == [(w_, s) for w_ in (1, 2) for s in range(1, steps + 1)]
    assert (p["staleness"] == 0).all() and p["applied"].all()
    assert t["updates"]["version"].tolist() == list(range(1, steps + 1))
    assert attrs["version"] == steps and attrs["samples"] == steps * B * 2
    assert [e["kind"] for e in t["events"]].count(b"stop") == 1


def test_sync_skips_a_non_finite_step_together(mpirun, tmp_path):
    """Worker 2's gradient is NaN in its 3rd step only: both workers skip step 3, the run completes."""
    res = mpirun(3, ["nan1", "2", *FAST, "--mode", "sync", "--epochs", "0", "--max-pushes", "6",
                     "--name", "skip"], timeout=90, script="fault.py")
    assert res.returncode == 0, res.explain()  # the replicas' final checksums agreed, or the run would fail
    attrs, t, params = read_log(tmp_path / "runs" / "skip.h5")
    p = t["pushes"]
    step3 = p[p["step"] == 3]
    assert sorted(step3["worker"].tolist()) == [1, 2] and not step3["applied"].any()
    assert step3["rejected"][step3["worker"] == 2].tolist() == [1]
    assert step3["rejected"][step3["worker"] == 1].tolist() == [0]
    assert p["applied"][p["step"] != 3].all() and p["step"].max() == 7  # 6 applied steps took 7
    skips = [e["text"].decode() for e in t["events"] if e["kind"] == b"skip"]
    assert skips == ["step 3 skipped by every worker: worker rank 2 computed a non-finite gradient"]
    assert t["updates"]["version"].tolist() == list(range(1, 7)) and np.isfinite(params).all()
    assert attrs["rejected"] == 1


def test_overlap_run_has_exactly_one_step_of_extra_staleness(mpirun, tmp_path):
    """One worker: without overlap every push has staleness 0; with it, every push after the first has 1."""
    res = mpirun(2, ["train", *FAST, "--overlap", "--epochs", "0", "--max-pushes", "60", "--name", "ov"],
                 timeout=60)
    assert res.returncode == 0, res.explain()
    _, t, _ = read_log(tmp_path / "runs" / "ov.h5")
    applied = t["pushes"][t["pushes"]["applied"] == 1]
    assert applied["staleness"].tolist() == [0] + [1] * 59


def test_overlap_staleness_is_what_lookahead_auto_looks_ahead(mpirun, tmp_path):
    """2 workers with --overlap: each update ages every other push whose weights are fixed, the other worker's
    two and the worker's own previous one, so the mean staleness is 2N - 1 = 3 (whatever the workers' speeds),
    and `--lookahead -1` looks that far ahead, not N = 2."""
    res = mpirun(3, ["train", *FAST, "--overlap", "--momentum", "0.9", "--lookahead", "-1", "--epochs", "0",
                     "--max-pushes", "300", "--name", "ovla"], timeout=90)
    assert res.returncode == 0, res.explain()
    _, t, _ = read_log(tmp_path / "runs" / "ovla.h5")
    applied = t["pushes"][t["pushes"]["applied"] == 1]
    steady = applied["staleness"][8:]  # past the start, where the first pushes find fewer before them
    assert abs(steady.mean() - 3) < 0.3, steady.mean()
    events = [e["text"].decode() for e in t["events"] if e["kind"] == b"lookahead"]
    assert len(events) == 1 and events[0].startswith("the replies look 3 updates ahead (--lookahead -1, 2 workers)")


# --- ssp -------------------------------------------------------------------------------------------------

def max_lead_before_stop(pushes):
    """For each applied push (w, step c) in arrival order: c - 1 - (fewest pushes of any other worker so far)."""
    workers = sorted(set(pushes["worker"].tolist()))
    clocks = dict.fromkeys(workers, 0)
    lead = 0
    for row in pushes[pushes["applied"] == 1]:
        w, c = int(row["worker"]), int(row["step"])
        lead = max(lead, c - 1 - min(clocks[o] for o in workers if o != w))
        clocks[w] = c
    return lead


@pytest.mark.parametrize("mode,bound", [("ssp", 1), ("ssp", 0), ("async", None)])
def test_ssp_never_lets_a_worker_pass_the_bound(mpirun, tmp_path, mode, bound):
    """3 workers, worker 3 four times slower: ssp keeps every lead within the bound; async does not."""
    flags = ["--mode", mode] + (["--staleness-bound", str(bound)] if bound is not None else [])
    res = mpirun(4, ["train", *FAST, *flags, "--straggler", "3:4", "--epochs", "0", "--max-pushes", "240",
                     "--name", "ssp"], timeout=90)
    assert res.returncode == 0, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "ssp.h5")
    lead = max_lead_before_stop(t["pushes"])
    if mode == "ssp":
        assert lead <= bound, lead
        assert attrs["held_s"] > 0 and t["pushes"]["held_s"].max() > 0  # the fast workers were held
    else:
        assert lead > 3, lead  # the check can fail: unbounded, the fast workers run ahead
        assert attrs["held_s"] == 0


# --- warm start ----------------------------------------------------------------------------------------------

def test_warm_start_lets_worker_1_train_alone_first(mpirun, tmp_path):
    res = mpirun(3, ["train", *FAST, "--warm-start", "1.5", "--epochs", "0", "--max-time", "3",
                     "--name", "warm"], timeout=60)
    assert res.returncode == 0, res.explain()
    _, t, _ = read_log(tmp_path / "runs" / "warm.h5")
    p = t["pushes"]
    first2 = p["time"][p["worker"] == 2].min()
    assert p["time"][p["worker"] == 1].min() < 1.0 and 1.5 <= first2 < 2.5
    assert (p["worker"][p["time"] < 1.5] == 1).all() and (p["time"] < 1.5).sum() > 10
    kinds = [e["kind"] for e in t["events"]]
    assert b"warm_start" in kinds and b"warm_start_end" in kinds


@pytest.mark.parametrize("mode", [["--mode", "async"], ["--mode", "ssp", "--staleness-bound", "1"]])
def test_a_hung_worker_is_named_while_the_others_train(mpirun, tmp_path, mode):
    """Worker 2 hangs in its 20th minibatch: rank 0 warns after --stall-warning and ends the run after
    --comm-timeout, naming rank 2, although worker 1 keeps pushing (async) or waits on a held reply (ssp)."""
    res = mpirun(3, ["hang", "2", *FAST, *mode, "--epochs", "0", "--max-time", "60", "--comm-timeout", "3",
                     "--stall-warning", "1", "--name", "hung"], timeout=60, script="fault.py")
    assert res.returncode != 0 and res.seconds < 30, res.explain()
    assert "rank 0: worker rank 2 has sent nothing for" in res.stderr, res.explain()
    assert "rank 1 failed" not in res.stderr, res.explain()
    assert "mpiasgd: warning: worker rank 2 has sent nothing for" in res.stderr, res.explain()
    assert "warning: worker rank 1" not in res.stderr, res.explain()
    attrs, t, _ = read_log(tmp_path / "runs" / "hung.h5")
    assert attrs["status"] == "failed"
    warnings = [e for e in t["events"] if e["kind"] == b"warning"]
    assert len(warnings) == 1 and warnings[0]["text"].decode().startswith("worker rank 2 has sent nothing for 1.")
    failed = next(e for e in t["events"] if e["kind"] == b"failed")
    assert warnings[0]["time"] < failed["time"]
    text = failed["text"].decode()  # one traceback, the stall's (helper-23: the probe's timeout came twice)
    assert text.count("comms.CommTimeout:") == 1 and "During handling of the above exception" not in text, text
    p = t["pushes"]
    assert (p["worker"] == 2).sum() == 19 and (p["worker"] == 1).sum() >= 19


@pytest.mark.parametrize("mode", [["--mode", "async"], ["--mode", "sync"]])
def test_a_final_evaluation_longer_than_the_comm_timeout_completes(mpirun, tmp_path, mode):
    """Worker 2's final evaluation takes 6 s, twice --comm-timeout: its ALIVE messages (one per evaluation
    batch once comm_timeout / 4 has passed) keep rank 0 from taking it for hung; the run completes."""
    res = mpirun(3, ["longeval", "2", *FAST, *mode, "--epochs", "0", "--max-pushes", "20", "--comm-timeout", "3",
                     "--stall-warning", "0", "--name", "ev"], timeout=90, script="fault.py")
    assert res.returncode == 0, res.explain()
    assert "has sent nothing" not in res.stderr, res.explain()
    attrs, _, _ = read_log(tmp_path / "runs" / "ev.h5")
    assert attrs["status"] == "completed" and attrs["test_count"] == 360  # every worker evaluated its slice


@pytest.mark.parametrize("wire,flags", [("bf16", []), ("fp16", ["--wire-error-feedback"])])
def test_a_16_bit_wire_run_completes_and_counts_its_bytes_exactly(mpirun, tmp_path, wire, flags):
    """2 workers, --wire bf16 (fp16 with error feedback), 20 pushes: the run completes; its config says the
    format; rank 0 counted every push at the 16-bit message size (160-byte header + 2 bytes a value) and
    every reply plus each worker's initial weights at the same size."""
    import json

    res = mpirun(3, ["train", *FAST, "--wire", wire, *flags, "--epochs", "0", "--max-pushes", "20",
                     "--name", wire], timeout=90)
    assert res.returncode == 0, res.explain()
    attrs, t, params = read_log(tmp_path / "runs" / f"{wire}.h5")
    cfg = json.loads(attrs["config"])
    assert attrs["status"] == "completed" and (cfg["wire"], cfg["wire_error_feedback"]) == (wire, bool(flags))
    model = build_model("digits")
    nbytes = message_bytes(model.num_params + model.num_buffers, wire)
    assert nbytes == 160 + 2 * model.num_params
    pushes = len(t["pushes"])  # every push rank 0 received has a row: 20 applied, then one drained per worker
    assert pushes >= 20 and attrs["version"] == 20 and t["pushes"]["applied"].sum() == 20
    assert int(attrs["wire_bytes_pushed"]) == pushes * nbytes
    assert int(attrs["wire_bytes_pulled"]) == (pushes + 2) * nbytes
    assert np.isfinite(params).all() and not np.array_equal(params[-1], params[0])
    assert attrs["test_count"] == 360
