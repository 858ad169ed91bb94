"""--gap-aware (Gap-Aware, Barkai et al. 2020): each weight's pushed gradient divided by its gap max(1, |w - w_pulled|
/ C), C a bias-corrected running mean of one update's step; against a hand computation in float64, on its own and
in the parameter server with A-SGD's update and with DANA-Zero's (DANA-GA), and the settings it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from kit.server import make_server, push, reply, serve_one

from mpiasgd.comms.protocol import Tag
from mpiasgd.config import Config, ConfigError
from mpiasgd.optim import GapAware
from mpiasgd.optim.delay import GAP_DECAY


class HandGap:
    """Gap-Aware in float64, as the module docstring of `mpiasgd.optim.delay` writes it."""

    def __init__(self, size):
        self.c, self.t = np.zeros(size), 0

    def penalize(self, g, w, pulled):
        if not self.t:
            return g
        c = self.c / (1 - GAP_DECAY ** self.t)
        gap = np.where(c > 0, np.abs(w - pulled) / np.where(c > 0, c, 1), 1)
        return g / np.maximum(1, gap)

    def observe(self, v, lr):
        self.c = GAP_DECAY * self.c + (1 - GAP_DECAY) * np.abs(lr * v)
        self.t += 1


def test_the_penalty_against_a_hand_computation():
    rng = np.random.default_rng(0)
    P = 37
    gap, hand = GapAware(P), HandGap(P)
    g = rng.standard_normal(P).astype(np.float32)
    w, pulled = rng.standard_normal(P).astype(np.float32), rng.standard_normal(P).astype(np.float32)
    first = gap.penalize(g.copy(), w, pulled)
    np.testing.assert_array_equal(first, g)  # C unknown before the first update: nothing penalized
    for lr in (0.1, 0.05, 0.2):
        v = rng.standard_normal(P).astype(np.float32)
        v[:3] = 0  # weights that never moved: C = 0, their gap is 1
        gap.observe(v, lr)
        hand.observe(v.astype(np.float64), lr)
    np.testing.assert_allclose(gap.mean_step, hand.c, rtol=1e-5)
    got = gap.penalize(g.copy(), w, pulled)
    want = hand.penalize(g.astype(np.float64), w.astype(np.float64), pulled.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_array_equal(got[:3], g[:3])
    assert np.all(np.abs(got) <= np.abs(g)) and np.any(np.abs(got) < 0.5 * np.abs(g))  # it only ever shrinks
    scale = np.linspace(0.5, 2, P).astype(np.float32)  # lr multipliers scale the step
    before = gap.mean_step.copy()
    gap.observe(np.ones(P, np.float32), 0.1, scale)
    np.testing.assert_allclose(gap.mean_step, GAP_DECAY * before + (1 - GAP_DECAY) * 0.1 * scale, rtol=1e-6)
    with pytest.raises(ValueError, match="grad must be a C-contiguous float32 array of shape"):
        gap.penalize(np.zeros(P), w, pulled)


@pytest.mark.parametrize("given", ["sgd", "dana-zero", "auto"])
def test_the_server_penalizes_each_push_by_its_gap_against_a_hand_computation(tmp_path, given, capsys):
    """Worker 2's pushes are stale by one or two updates: their gradients are divided by the gap. With A-SGD the
    replies are the master weights; with DANA-Zero (DANA-GA) the look-ahead weights, which the gap is measured
    from. The velocity folded into C is the server's momentum (sgd) or the pushing worker's (DANA-Zero). auto,
    the default, is DANA-GA with 2 workers, and says so."""
    lr, m, wd = 0.5, 0.9, 0.1
    flags = {"update_rule": given} if given == "auto" else {"update_rule": given, "gap_aware": True}
    server, net, _ = make_server(tmp_path, momentum=m, weight_decay=wd, lr=lr, **flags)
    server.role.warm_up()  # (the compiled loops loaded before the clocks start: changes nothing)
    server.role.begin()  # the first weights, which the first pushes are computed on
    said = capsys.readouterr().out
    assert ("--update-rule auto: dana-zero with Gap-Aware (2 workers: " in said) == (given == "auto")
    rule = "sgd" if given == "sgd" else "dana-zero"
    rng = np.random.default_rng(5)
    w = np.arange(6, dtype=np.float64)
    pulled = {1: w.copy(), 2: w.copy()}
    v = {1: np.zeros(6), 2: np.zeros(6)}  # sgd: v[0] is the server's only momentum
    hand = HandGap(6)
    steps, versions = {1: 0, 2: 0}, {1: 0, 2: 0}
    penalized = 0
    for worker in (1, 1, 2, 1, 2, 2, 1):
        g = rng.standard_normal(6).astype(np.float32)
        steps[worker] += 1
        push(net, worker, step=steps[worker], version=versions[worker], grad=g)
        serve_one(server)
        d = hand.penalize(g.astype(np.float64), w, pulled[worker])
        penalized += not np.allclose(d, g)
        key = worker if rule == "dana-zero" else 1
        v[key] = m * v[key] + (d + wd * w)
        w = w - lr * v[key]
        hand.observe(v[key], lr)
        tag, header, payload = reply(net, worker)
        assert tag == Tag.WEIGHTS
        versions[worker] = int(header["version"])
        np.testing.assert_allclose(server.params if rule == "dana-zero" else payload, w, rtol=1e-5, atol=1e-6)
        pulled[worker] = w - lr * m * (v[1] + v[2]) if rule == "dana-zero" else w.copy()
        np.testing.assert_allclose(payload, pulled[worker], rtol=1e-5, atol=1e-6)
    assert penalized >= 3  # (the stale pushes were penalized: the test checks the gap, not only the update)


def test_one_worker_is_not_penalized(tmp_path):
    """One worker pulls the weights its push is applied to: every gap is 0, and the run is plain SGD bit for bit."""
    runs = []
    for gap_aware in (False, True):
        server, net, _ = make_server(tmp_path / str(gap_aware), num_workers=1, gap_aware=gap_aware, momentum=0.9,
                                     weight_decay=0.01)
        server.role.begin()
        rng = np.random.default_rng(1)
        for step in range(1, 6):
            push(net, 1, step=step, version=step - 1, grad=rng.standard_normal(6).astype(np.float32))
            serve_one(server)
        runs.append(reply(net, 1)[2])
    np.testing.assert_array_equal(runs[0], runs[1])


@pytest.mark.parametrize("overrides,message", [
    ({"nsync": 2}, "gap_aware.*False with nsync > 1"),
    ({"overlap": True}, "gap_aware.*False with --overlap"),
    ({"dc_lambda": 0.1}, "gap_aware.*False with --dc-lambda"),
    ({"mode": "easgd"}, "gap_aware"),
])
def test_settings_it_cannot_take_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Config(gap_aware=True, **overrides).validate()


@pytest.mark.parametrize("decay,lr_scale,in_place", [(False, False, True), (True, True, False), (True, False, True)])
def test_dana_ga_in_one_pass_is_the_three_passes_bit_for_bit(decay, lr_scale, in_place):
    """DANA-GA's fused loop (`dana_ga_step`) against Gap-Aware's penalty, DANA-Zero's update and Gap-Aware's C
    update run one after the other, over pushes of 3 workers, C unknown at the first."""
    from mpiasgd.optim.rules import DanaZero, GapPenalized, Push

    rng = np.random.default_rng(7)
    P, m = 1001, np.float32(0.9)
    w0 = rng.standard_normal(P).astype(np.float32)
    dec = (rng.random(P) * 1e-3).astype(np.float32) if decay else None
    scale = (rng.random(P) + 0.5).astype(np.float32) if lr_scale else None
    fused = DanaZero(w0.copy(), dec, float(m), [1, 2, 3], scale)
    fused_gap = GapAware(P)
    rule = GapPenalized(fused, fused_gap, lambda push: fused.velocities[push.worker], scale)
    ref = DanaZero(w0.copy(), dec, float(m), [1, 2, 3], scale)
    ref_gap = GapAware(P)
    outs = [np.empty(P, np.float32), np.empty(P, np.float32)]
    penalized = 0
    for k, worker in enumerate((1, 2, 3, 1, 1, 3, 2)):
        g = rng.standard_normal(P).astype(np.float32)
        pulled = (ref.params + 0.1 * rng.standard_normal(P)).astype(np.float32)
        lr = 0.05
        out_f = fused.params if in_place else outs[k % 2]
        rule.apply(Push(g.copy(), 0.0, 1, pulled=pulled.copy(), worker=worker), lr, out_f)
        g_ref = ref_gap.penalize(g.copy(), ref.params, pulled)
        penalized += int((g_ref != g).sum())
        ref.apply(Push(g_ref, float(g_ref.dot(g_ref)), 1, pulled=pulled, worker=worker), lr,
                  ref.params if in_place else np.empty(P, np.float32))
        ref_gap.observe(ref.velocities[worker], lr, scale)
        assert np.array_equal(fused.params, ref.params) and np.array_equal(fused.total, ref.total)
        assert np.array_equal(fused.velocities[worker], ref.velocities[worker])
        assert np.array_equal(fused_gap.mean_step, ref_gap.mean_step) and fused_gap.updates == ref_gap.updates
    assert 0 < np.abs(fused.params - w0).max() and penalized > P  # (it moved, and the gaps penalized)
