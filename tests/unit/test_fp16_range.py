"""--wire fp16 and its range [-65504, 65504]: a push beyond it is named as such (not as divergence), with its
largest value and the advice --wire bf16; the server refuses to send weights or buffers beyond it (they would
travel as inf and every worker compute NaN), naming the rank, the worker, the value and the range."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from kit.fakempi import Network
from kit.server import P, make_server, push, reply, serve_one

from mpiasgd.comms.protocol import Flag, Tag
from mpiasgd.comms.shard_cut import ShardCut
from mpiasgd.comms.staging import ShardedStaging, Staging
from mpiasgd.comms.wire import ErrorFeedback, encode_peak, peak
from mpiasgd.config import Config
from mpiasgd.rank0.recorder import TrainingDiverged

HUGE = np.array([1, 2, 7e4, 0, -3, 0], np.float32)  # 70,000: beyond fp16's 65,504 (it rounds to inf from 65,520)


# --- the measure: the largest magnitude a worker encodes -------------------------------------------------------

@pytest.mark.parametrize("values,expected", [
    ([1, -7e4, 3], 7e4), ([0, 0], 0.0), ([1, -np.inf, 3], math.inf), ([1, np.nan, -np.inf], math.nan),
    ([-65504, 65519.99], 65519.99), ([], 0.0)])
def test_peak_is_the_largest_magnitude_nan_first(values, expected):
    x = np.array(values, np.float32)
    got = peak(x)
    fused = encode_peak("fp16", x, np.empty(x.size, np.float16))  # the compiled encoder's own pass
    for value in (got, fused):
        assert (math.isnan(value) and math.isnan(expected)) or value == np.float32(expected)


def test_peak_is_measured_for_fp16_only():
    x = HUGE.copy()
    assert encode_peak("bf16", x, np.empty(P, np.uint16)) == 0.0
    assert encode_peak("fp32", x, np.empty(P, np.float32)) == 0.0


@pytest.mark.parametrize("feedback", [False, True])
def test_a_worker_stamps_the_largest_value_of_its_fp16_push(feedback):
    fb = ErrorFeedback("fp16", P) if feedback else None
    st = Staging(P, "fp16", fb)
    st.grads[...] = HUGE
    st.before_send()
    assert st.push.header["peak"] == 7e4 and np.isinf(st.push.payload[2])
    st.grads[...] = 1.0
    st.before_send()
    assert st.push.header["peak"] == 1.0
    sharded = ShardedStaging(ShardCut.balanced(64, 0, 2), "fp16", ErrorFeedback("fp16", 64) if feedback else None)
    sharded.grads[...] = 1.0
    sharded.grads[40] = -7e4  # in shard 1's slice
    sharded.before_send()  # every shard's push carries the whole push's largest value
    assert [m.header["peak"] for m in sharded.push] == [7e4, 7e4] and sharded.nonfinite


# --- the server: a push beyond the range ----------------------------------------------------------------------

MODES = {"async": ({}, "gradient", 0), "ssp": ({"mode": "ssp", "staleness_bound": 5}, "gradient", 0),
         "nsync": ({"nsync": 2}, "accumulated update", int(Flag.DELTA))}


@pytest.mark.parametrize("mode", MODES)
def test_a_push_beyond_fp16_range_is_named_with_its_value_not_as_divergence(tmp_path, capsys, mode):
    options, what, flags = MODES[mode]
    server, net, _ = make_server(tmp_path, wire="fp16", max_rejects=3, **options)
    before = server.params.copy()
    for step in (1, 2):
        push(net, 1, step=step, version=0, grad=HUGE, wire="fp16", peak=7e4, flags=flags, lr=0.5)
        serve_one(server)
    assert server.rejected[1] == 2 and server.version == 0
    np.testing.assert_array_equal(server.params, before)
    assert tuple(reply(net, 1, "fp16")[:1]) == (Tag.WEIGHTS,)
    warned = [line for line in capsys.readouterr().err.splitlines() if "worker rank 1" in line]
    assert warned == [f"mpiasgd: warning: worker rank 1 pushed a {what} beyond fp16's range at step 1 (its largest "
                      "magnitude 70000; --wire fp16 holds [-65504, 65504]): rejected (not applied); use --wire bf16 "
                      "(float32's range)"]
    push(net, 1, step=3, version=0, grad=HUGE * 2, wire="fp16", peak=1.4e5, flags=flags, lr=0.5)
    with pytest.raises(TrainingDiverged) as stop:
        serve_one(server)
    assert str(stop.value) == (
        f"rank 0: worker rank 1 pushed 3 {what}s in a row beyond fp16's range (steps 1..3; --max-rejects 3; "
        "the largest magnitude 140000; --wire fp16 holds [-65504, 65504]): the values are finite, only too large "
        "for fp16: use --wire bf16 (float32's range)")


def test_a_nan_push_under_fp16_is_still_divergence(tmp_path):
    server, net, _ = make_server(tmp_path, wire="fp16", max_rejects=2)
    push(net, 1, step=1, version=0, grad=np.ones(P, np.float32), wire="fp16")
    serve_one(server)  # one update applied: the NaNs after it are the training's
    bad = HUGE.copy()
    bad[0] = np.nan
    stop = two_rejects(server, net, bad, first_step=2, version=1, wire="fp16", peak=math.nan)
    assert re.fullmatch(r"rank 0: worker rank 1 pushed 2 non-finite gradients in a row \(steps 2..3; --max-rejects "
                        r"2\): training has diverged; lower --lr", stop), stop


def two_rejects(server, net, grad, first_step=1, version=0, **fields) -> str:
    """Push `grad` twice from worker 1 (steps first_step, first_step + 1) to a server with --max-rejects 2;
    the TrainingDiverged message that ends the run."""
    for step in (first_step, first_step + 1):
        push(net, 1, step=step, version=version, grad=grad, **fields)
    serve_one(server)
    with pytest.raises(TrainingDiverged) as stop:
        serve_one(server)
    return str(stop.value)


def test_non_finite_pushes_before_any_update_blame_the_network_not_the_step_size(tmp_path):
    """(trial of issue 36) NaN gradients from the first push on come from the initial weights or the inputs:
    "training has diverged; lower --lr" would send the user after the wrong cause."""
    server, net, _ = make_server(tmp_path, max_rejects=2)
    assert two_rejects(server, net, np.full(P, np.nan, np.float32)) == (
        "rank 0: worker rank 1 pushed 2 non-finite gradients in a row (steps 1..2; --max-rejects 2) before any "
        "update was applied: the network computes non-finite values at its initial weights (its layers, their "
        "initialisation or the scale of its inputs), not because of the step size")


def test_a_run_of_rejects_that_ends_beyond_the_range_names_both(tmp_path):
    """A NaN push, then one beyond fp16's range: the stop names the range (the last cause) and the NaN."""
    server, net, _ = make_server(tmp_path, wire="fp16", max_rejects=2)
    bad = HUGE.copy()
    bad[0] = np.nan
    push(net, 1, step=1, version=0, grad=bad, wire="fp16", peak=math.nan)
    serve_one(server)
    push(net, 1, step=2, version=0, grad=HUGE, wire="fp16", peak=7e4)
    with pytest.raises(TrainingDiverged) as stop:
        serve_one(server)
    assert str(stop.value) == (
        "rank 0: worker rank 1 pushed 2 gradients in a row beyond fp16's range or not finite (steps 1..2; "
        "--max-rejects 2; 1 beyond fp16's range, the largest magnitude 70000; --wire fp16 holds [-65504, 65504]): "
        "use --wire bf16 (float32's range); if the non-finite ones continue, lower --lr")


# --- the server: replies beyond the range ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_weights_beyond_fp16_range_stop_the_run_before_a_reply_carries_inf(tmp_path, mode):
    server, net, _ = make_server(tmp_path, wire="fp16", lr=2.0, **MODES[mode][0])
    server.start_workers()
    push(net, 1, step=1, version=0, grad=np.array([0, 0, 0, -6e4, 0, 0], np.float32), wire="fp16", peak=6e4)
    with pytest.raises(TrainingDiverged) as stop:  # w[3] = 3 + 2 * 60,000: the reply would carry inf
        serve_one(server)
    assert str(stop.value) == (
        "rank 0: WEIGHTS reply to worker rank 1 (step 1, version 1): a weight of magnitude 120003 is beyond fp16's "
        "range [-65504, 65504] (--wire fp16): it would travel as inf and the worker compute NaN; use --wire bf16 "
        "(float32's range) or lower --lr")
    tag, header, payload = reply(net, 1, "fp16")  # the last reply is still the initial weights: no inf went out
    assert tag == Tag.WEIGHTS and header["step"] == 0 and np.isfinite(payload.astype(np.float32)).all()


def test_initial_weights_beyond_fp16_range_are_refused(tmp_path):
    server, _, _ = make_server(tmp_path, wire="fp16")
    server.params[0] = -1e5
    with pytest.raises(TrainingDiverged, match=r"^rank 0: initial WEIGHTS to worker rank 1 \(step 0, version 0\): "
                                               r"a weight of magnitude 100000 is beyond fp16's range") as stop:
        server.start_workers()
    assert str(stop.value).endswith("use --wire bf16 (float32's range)")  # no step size has acted yet


def test_a_shard_names_itself_when_its_slice_leaves_the_range():
    """--servers 2: shard 1 (rank 3, its ShardRecorder) holds a weight beyond fp16's range in its slice."""
    from mpiasgd.modes.registry import load
    from mpiasgd.rank0.loop import Rank0
    from mpiasgd.rank0.shard_hub import HubLink
    from mpiasgd.rank0.shard_recorder import ShardRecorder

    cfg = Config(lr=1.0, momentum=0.0, epochs=0, max_pushes=100, snapshot_interval=0, progress=False,
                 comm_timeout=60.0, servers=2, wire="fp16")
    cut = ShardCut.balanced(64, 0, 2)
    rank = cut.rank(1, 2)
    params = np.zeros(64, np.float32)
    params[cut.slice(1)[0]] = 65530.0
    shard = Rank0(Network(2 + 2).comm(rank), cfg, ShardRecorder(cfg, range(1, 3), 100, 1, rank),
                  lambda r0: load("async").rank0(r0, params, np.ones(64, np.float32), None, None, None),
                  make_link=HubLink)
    with pytest.raises(TrainingDiverged) as stop:
        shard.role.start_workers()
    assert str(stop.value) == (
        f"rank {rank} (parameter-server shard 1): initial WEIGHTS to worker rank 1 (step 0, version 0): a weight of "
        "magnitude 65530 is beyond fp16's range [-65504, 65504] (--wire fp16): it would travel as inf and the worker "
        "compute NaN; use --wire bf16 (float32's range)")  # (initial weights: not the step size's doing)


def test_a_flagged_sharded_push_beyond_the_range_is_named_on_every_shard(tmp_path, capsys):
    """--servers 2: the shard whose slice is finite sees flag NONFINITE and the largest value: the same cause."""
    server, net, _ = make_server(tmp_path, wire="fp16", max_rejects=1)
    push(net, 1, step=1, version=0, grad=np.ones(P, np.float32), wire="fp16", peak=7e4, flags=int(Flag.NONFINITE))
    with pytest.raises(TrainingDiverged, match=r"pushed 1 gradient in a row beyond fp16's range .*the largest "
                                               r"magnitude 70000"):
        serve_one(server)


def test_a_run_whose_final_loss_is_not_finite_says_so_in_its_health_line(tmp_path):
    """(trial of issue 36) --max-rejects set high, every push rejected: the run completes, and its summary's
    health line (train's end, report) names the non-finite loss instead of staying empty."""
    server, net, _ = make_server(tmp_path, max_rejects=1000)
    for step in (1, 2, 3):
        push(net, 1, step=step, version=0, grad=np.full(P, np.nan, np.float32))
        serve_one(server)
    summary = server.rec.summary({1: (math.nan, 0, 50, 0), 2: (math.nan, 0, 50, 0)}, "")
    assert summary["health"] == (
        "non-finite: the final weights compute a non-finite test loss (nan); 3 pushes were rejected as non-finite, "
        "before any update was applied: the network computes non-finite values at its initial weights (its layers, "
        "their initialisation or the scale of its inputs), not because of the step size")
    healthy = server.rec.summary({1: (40.0, 30, 50, 45), 2: (40.0, 30, 50, 45)}, "")
    assert healthy["health"] == ""
