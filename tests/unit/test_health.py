"""Divergence and dead-network detection (mpiasgd.health), in-process: the rules on crafted loss rows,
and the parameter server's warning and --on-divergence stop through the fake communicator.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from kit.server import make_server, push, reply, serve_one

from mpiasgd.comms.protocol import Tag
from mpiasgd.health import LossWatch
from mpiasgd.rank0.recorder import TrainingDiverged

LN10 = math.log(10)


def feed(watch, rows):
    """rows: (epoch, loss, correct, samples); every finding, in order."""
    return [f for row in rows for f in watch.observe(*row)]


def training(epochs=10.0, per_epoch=100, start=LN10, end=0.3, seed=0):
    """A healthy run's rows: the loss falls from ln 10 to `end` with noise, the accuracy rises to 90 %."""
    rng = np.random.default_rng(seed)
    n = int(epochs * per_epoch)
    for i in range(n):
        frac = i / n
        loss = start + (end - start) * frac ** 0.5
        yield i / per_epoch, loss * rng.uniform(0.7, 1.3), int(32 * (0.1 + 0.8 * frac ** 0.5)), 32


def test_a_healthy_run_gives_no_finding():
    watch = LossWatch(10, 2)
    assert feed(watch, training()) == [] and watch.finish() == [] and watch.final_state() == ""


def test_a_spike_is_reported_once_with_its_size_and_cause():
    watch = LossWatch(10, 8)
    rows = [(i / 100, LN10, 3, 32) for i in range(50)]
    assert feed(watch, rows) == []
    found = feed(watch, [(0.5, 12.5, 3, 32), (0.51, 20.0, 3, 32)])
    assert [f.kind for f in found] == ["diverged"]
    assert found[0].text.startswith("training loss spiked to 12.5 at epoch 0.50, 5.4x its running level 2.303: "
                                    "the step size is likely too large for 8 asynchronous workers (staleness adds "
                                    "momentum): lower --lr, lengthen --warmup-epochs, or try --staleness-lr inverse")


def test_a_spike_from_the_first_row_is_judged_against_ln_c():
    """A fresh network's loss is ln C: a first row far above it is a spike (the level needs no history)."""
    assert [f.kind for f in LossWatch(10, 2).observe(0.0, 3.1 * LN10, 1, 32)] == ["diverged"]
    assert LossWatch(10, 2).observe(0.0, 2.9 * LN10, 1, 32) == []  # below SPIKE_FACTOR = 3
    late = LossWatch(10, 2)  # late in training the bound is the level + ln C, not 3x a small level
    feed(late, [(i / 100, 0.05, 32, 32) for i in range(200)])
    assert late.observe(2.0, 0.5, 20, 32) == [] and [f.kind for f in late.observe(2.01, 2.5, 5, 32)] == ["diverged"]


def test_non_finite_losses_are_left_to_the_reject_rule():
    watch = LossWatch(10, 2)
    assert watch.observe(0.1, float("nan"), 0, 32) == [] and watch.observe(0.2, float("inf"), 0, 32) == []
    assert watch.level == pytest.approx(LN10)


def test_a_dead_network_is_named_after_the_first_epoch_then_its_recovery():
    watch = LossWatch(10, 2)
    dead = [(i / 100, LN10 + 0.01, 3 + i % 2, 32) for i in range(300)]  # 10.9 % accuracy, loss ln 10
    found = feed(watch, dead)
    # windows of half an epoch; the ones starting before epoch 1 are not judged
    assert [f.kind for f in found] == ["dead"]
    assert found[0].text.startswith("the network looks dead from epoch 1.0: over epochs 1.0-1.5 the training loss "
                                    "is 2.3126, at ln 10 = 2.3026 (a constant prediction), and the training accuracy "
                                    "10.9 %, at chance (10 %): the step size is likely too large for 2 asynchronous "
                                    "workers")
    assert watch.finish() == []  # dead still: reported once
    assert watch.final_state().startswith("dead from epoch 1.0 to the end (training loss at ln 10 = 2.303, chance")
    # still 12 % accuracy: not alive yet (hysteresis); 40 %: trains again
    assert feed(watch, [(3 + i / 100, 2.2, 4, 32) for i in range(60)]) == []
    found = feed(watch, [(3.6 + i / 100, 1.5, 13, 32) for i in range(120)])
    assert [f.kind for f in found] == ["recovered"] and watch.final_state() == ""
    assert found[0].text.startswith("the network trains again from epoch 3.5 (dead since epoch 1.0)")


def test_the_last_window_is_judged_at_the_end_if_it_covers_half_a_window():
    short = LossWatch(10, 2)
    feed(short, [(1.0 + i / 100, LN10, 3, 32) for i in range(20)])  # 0.2 epochs: too short to judge
    assert short.finish() == [] and short.final_state() == ""
    longer = LossWatch(10, 2)
    feed(longer, [(1.0 + i / 100, LN10, 3, 32) for i in range(30)])
    assert [f.kind for f in longer.finish()] == ["dead"] and longer.final_state().startswith("dead from epoch 1.0")


def serve_rows(server, net, rows, samples=10):
    """Push (worker, loss, correct) rows of `samples` images each; serves each."""
    for w, loss, correct in rows:
        push(net, w, step=server.last_step[w] + 1, version=server.version, grad=np.zeros(6, np.float32),
             loss=loss, correct=correct, samples=samples)
        serve_one(server)


def test_a_spike_warns_and_the_run_trains_on_even_with_stop(tmp_path, capsys):
    """A spike alone is a warning under both settings: runs often recover from one."""
    for setting in ("warn", "stop"):
        server, net, log = make_server(tmp_path / setting, on_divergence=setting)
        server.health = LossWatch(10, 2)
        serve_rows(server, net, [(1, LN10, 1), (2, 40.0, 1)], samples=32)
        assert "mpiasgd: warning: training loss spiked to 40" in capsys.readouterr().err
        assert reply(net, 2)[0] == Tag.WEIGHTS and server.stop_reason == "" and server.diverged == ""
        log.flush()
        assert [e["kind"] for e in log.file["events"][()]] == [b"diverged"]


def test_on_divergence_stop_ends_the_run_when_the_network_is_dead(tmp_path):
    """A dead network (loss ln 10, 10 % accuracy over epochs 1.0-1.5 of a 100-image training set) with
    --on-divergence stop: the push that completes the window is answered with STOP, the reason says why."""
    server, net, log = make_server(tmp_path, on_divergence="stop")
    server.health = LossWatch(10, 2)
    serve_rows(server, net, [(1 + k % 2, LN10, 1) for k in range(14)])  # epochs 0 .. 1.4
    assert server.stop_reason == "" and reply(net, 2)[0] == Tag.WEIGHTS
    serve_rows(server, net, [(1, LN10, 1)])  # epoch 1.5: the window 1.0-1.5 is complete
    assert reply(net, 1)[0] == Tag.STOP and server.stop_reason == "diverged (dead; --on-divergence stop)"
    assert server.diverged.startswith("the network looks dead from epoch 1.0: over epochs 1.0-1.5 the training "
                                      "loss is 2.3026")
    log.flush()
    assert [e["kind"] for e in log.file["events"][()]] == [b"dead", b"stop"]
    before = server.version
    push(net, 2, step=8, version=server.version, grad=np.zeros(6, np.float32), loss=LN10)  # drained, not applied
    serve_one(server)
    assert reply(net, 2)[0] == Tag.STOP and server.version == before


def test_small_batches_are_judged_over_32_images():
    """Batch size 1: one hard image costs ln 10 above a low level, which is no spike; 32 images averaged
    are judged as one minibatch of 32 would be (a false alarm the new-user test found)."""
    watch = LossWatch(10, 2)
    feed(watch, [(i / 1000, 1.0, 1, 1) for i in range(320)])
    assert feed(watch, [(0.4, 3.45, 0, 1)] + [(0.4, 1.0, 1, 1)] * 31) == []
    found = feed(watch, [(0.5, 12.0, 0, 1)] * 32)
    assert [f.kind for f in found] == ["diverged"] and "spiked to 12 at epoch 0.50" in found[0].text


def test_the_advice_fits_the_mode():
    assert "3 asynchronous workers (staleness adds momentum)" in LossWatch(10, 3).cause
    assert LossWatch(10, 1, asynchronous=False).cause == ("the step size (or the weight decay) is likely too "
                                                          "large: lower --lr or --weight-decay")


def test_a_loss_far_above_ln_c_from_the_first_minibatches_blames_the_network_not_the_step_size(tmp_path):
    """(trial of issue 36) A network whose initial outputs are huge (loss 4.5e30 at once): the finding and a later
    --max-rejects stop name the initial outputs, not the step size, which had not acted yet."""
    watch = LossWatch(10, 2)
    found = watch.observe(0.0, 4.5e30, 3, 32)
    assert [f.kind for f in found] == ["diverged"] and found[0].text == watch.at_start == (
        "the training loss was 4.5e+30 from the first minibatches, over 1000x ln 10 = 2.303 (a network that knows "
        "nothing): its initial outputs are far too large (its layers' initialisation or the scale of its inputs), "
        "not the step size")
    later = LossWatch(10, 2)
    feed(later, [(i / 100, LN10, 3, 32) for i in range(50)])
    assert "step size is likely too large" in feed(later, [(0.5, 40.0, 3, 32)])[0].text and not later.at_start
    server, net, _ = make_server(tmp_path, max_rejects=2)
    server.health = watch
    server.counter.version = 3  # updates were applied (the huge gradients, finite): "diverged", but not the lr's doing
    for step in (1, 2):
        push(net, 1, step=step, version=3, grad=np.full(6, np.nan, np.float32))
    serve_one(server)
    with pytest.raises(TrainingDiverged, match=r"training has diverged; the training loss was 4\.5e\+30 from"):
        serve_one(server)
