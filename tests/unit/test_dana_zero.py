"""--update-rule dana-zero (DANA-Zero, Hakimi et al. 2019): a momentum per worker on the server, the replies one
step ahead along their sum; against a hand computation, and the settings it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from kit.server import make_server, push, reply, serve_one

from mpiasgd.comms.protocol import Tag
from mpiasgd.config import Config, ConfigError
from mpiasgd.optim.rules import DanaZero, Push


def test_updates_and_replies_against_a_hand_computation(tmp_path, capsys):
    lr, m, wd = 0.5, 0.9, 0.1
    server, net, _ = make_server(tmp_path, update_rule="dana-zero", momentum=m, weight_decay=wd, lr=lr)
    server.role.begin()  # the start lines, and the first weights
    for worker in (1, 2):
        net.take(worker)  # the first weights
    said = capsys.readouterr().out
    assert "DANA-Zero: a momentum per worker (2)" in said and "--update-rule auto" not in said
    rng = np.random.default_rng(3)
    w = np.arange(6, dtype=np.float64)  # make_server's initial weights
    v = {1: np.zeros(6), 2: np.zeros(6)}
    steps, versions = {1: 0, 2: 0}, {1: 0, 2: 0}
    for worker in (1, 2, 1, 1, 2):
        g = rng.standard_normal(6).astype(np.float32)
        steps[worker] += 1
        push(net, worker, step=steps[worker], version=versions[worker], grad=g)
        serve_one(server)
        v[worker] = m * v[worker] + (g + wd * w)  # v_i <- m v_i + g + wd w
        w = w - lr * v[worker]                    # w <- w - lr v_i
        tag, header, payload = reply(net, worker)
        versions[worker] = int(header["version"])
        assert tag == Tag.WEIGHTS
        np.testing.assert_allclose(server.params, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(payload, w - lr * m * (v[1] + v[2]), rtol=1e-5, atol=1e-6)  # the look-ahead
    np.testing.assert_allclose(server.velocity(), v[1] + v[2], rtol=1e-5, atol=1e-6)  # what a checkpoint keeps


@pytest.mark.parametrize("workers,overrides,expected", [
    (1, {}, ("sgd", False, "1 worker: nothing is stale")),
    (2, {}, ("dana-zero", True, "2 workers: a momentum per worker, replies one step ahead, and each gradient "
                                "divided by its gap (DANA-GA)")),
    (4, {"overlap": True}, ("dana-zero", False, "4 workers: a momentum per worker and replies one step ahead; "
                                                "without Gap-Aware, which --overlap rules out")),
    (8, {"lookahead": -1.0}, ("sgd", False, "--lookahead -1 rules out dana-zero, which needs lookahead 0 (its "
                                            "replies look ahead already)")),
    (8, {"nsync": 4}, ("sgd", False, "--nsync 4 rules out dana-zero, which needs nsync 1 (it takes gradients)")),
    (8, {"momentum": 0.0, "gap_aware": True}, ("sgd", True, "--momentum 0 rules out dana-zero, which needs momentum "
                                                            "in (0, 1) (a momentum per worker)")),
    (8, {"nesterov": True}, ("sgd", False, "--nesterov rules out dana-zero, which needs nesterov False (its "
                                           "look-ahead is Nesterov's point already)")),
    (8, {"async_momentum": "workers"}, ("sgd", False, "--async-momentum workers rules out dana-zero, which needs "
                                                      "async-momentum 'fixed'")),
    (8, {"update_rule": "sgd"}, ("sgd", False, "as given")),
    (8, {"update_rule": "dana-zero"}, ("dana-zero", False, "as given")),
])
def test_auto_is_dana_ga_from_two_workers_unless_an_option_rules_it_out(workers, overrides, expected):
    from mpiasgd.modes.asgd import resolve_update_rule

    cfg = Config(**overrides)
    assert cfg.update_rule == overrides.get("update_rule", "auto")
    assert resolve_update_rule(cfg, workers) == expected


@pytest.mark.parametrize("overrides,expected", [
    ({}, "none"), ({"nsync": 4}, "inverse"), ({"nsync": 4, "staleness_lr": "none"}, "none"),
    ({"staleness_lr": "sqrt"}, "sqrt"),
])
def test_staleness_lr_auto_averages_nsync_updates_and_leaves_gradients(overrides, expected):
    """--staleness-lr auto (the default): 1/staleness for nsync updates (N workers' updates average), 1 for
    gradients (DANA-Zero, the default rule from 2 workers, takes them as they are)."""
    from mpiasgd.modes.asgd import resolve_staleness_lr

    assert resolve_staleness_lr(Config(**overrides)) == expected


def test_one_worker_is_momentum_sgd_with_the_gradient_taken_ahead():
    """N = 1: the update is heavy-ball momentum SGD, and the point the next gradient is taken at is w - lr m v."""
    w = np.ones(4, np.float32)
    rule = DanaZero(w.copy(), None, 0.5, [1])
    g = np.array([1, -2, 3, 0], np.float32)
    out = np.empty(4, np.float32)
    rule.apply(Push(g.copy(), float(g @ g), 0, worker=1), 0.1, out)
    rule.apply(Push(g.copy(), float(g @ g), 0, worker=1), 0.1, out)
    v = 0.5 * g + g
    np.testing.assert_allclose(out, w - 0.1 * g - 0.1 * v, rtol=1e-6)
    np.testing.assert_allclose(rule.total, v, rtol=1e-6)


def test_a_resume_says_what_it_did_with_the_state_a_checkpoint_does_not_keep(tmp_path, capsys):
    """The default rule with 2 workers (DANA-GA) resumed: each worker's momentum is the checkpoint's sum / 2, and the
    start says so (and that Gap-Aware's mean step starts again)."""
    from mpiasgd import checkpoint

    server, _, _ = make_server(tmp_path, update_rule="auto", momentum=0.9)
    workers = np.array([(1, 3, 0), (2, 2, 0)], dtype=[("rank", "i8"), ("step", "i8"), ("cursor", "i8")])
    ckpt = checkpoint.Checkpoint(params=np.ones(6, np.float32), momentum=np.array([2, 4, 6, 8, 0, -2], np.float32),
                                 workers=workers, version=5, samples=50, elapsed=1.0, log_time=1.0, config="",
                                 log="", mode="async", model="")
    server.role.restore(ckpt)
    assert all(np.array_equal(v, [1, 2, 3, 4, 0, -1]) for v in server.role.dana.velocities.values())
    said = capsys.readouterr().out
    assert ("resumed DANA-Zero: the checkpoint keeps the sum of the workers' momenta; each of the 2 workers starts "
            "from the sum / 2 (not bit-identical to an uninterrupted run); Gap-Aware's mean step starts again") in said


def test_a_resume_splits_the_sum_of_the_momenta_among_the_workers():
    rule = DanaZero(np.zeros(3, np.float32), None, 0.9, [1, 2, 3, 4])
    rule.restore(np.array([4, 8, -4], np.float32))
    assert all(np.array_equal(v, [1, 2, -1]) for v in rule.velocities.values())
    assert np.array_equal(rule.total, [4, 8, -4])


@pytest.mark.parametrize("overrides,message", [
    ({"update_rule": "dana"}, "update_rule.*one of"),
    ({"update_rule": "dana-zero", "nsync": 2}, "nsync.*1 with --update-rule dana-zero"),
    ({"update_rule": "dana-zero", "lookahead": -1}, "lookahead.*0 with --update-rule dana-zero"),
    ({"update_rule": "dana-zero", "momentum": 0.0}, r"momentum.*in \(0, 1\) with --update-rule dana-zero"),
    ({"update_rule": "dana-zero", "async_momentum": "workers"}, "async_momentum.*'fixed' with"),
    ({"update_rule": "dana-zero", "nesterov": True}, "nesterov.*False with --update-rule dana-zero"),
    ({"update_rule": "dana-zero", "mode": "easgd"}, "update_rule"),
])
def test_settings_it_cannot_take_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Config(**overrides).validate()


def test_auto_says_what_it_chose_for_one_worker_too(tmp_path, capsys):
    server, net, log = make_server(tmp_path, num_workers=1, momentum=0.9)
    server.role.begin()
    net.take(1)
    assert "mpiasgd: --update-rule auto: sgd (1 worker: nothing is stale)" in capsys.readouterr().out
    log.flush()
    events = [e["text"].decode() for e in log.file["events"][()] if e["kind"] == b"update_rule"]
    assert events == ["--update-rule auto: sgd (1 worker: nothing is stale)"]


def test_no_gap_aware_under_auto_is_refused_naming_the_rule_to_give():
    from mpiasgd.config import make_parser, resolve

    with pytest.raises(ConfigError, match=r"--no-gap-aware with --update-rule auto: .*give --update-rule dana-zero"):
        resolve(make_parser().parse_args(["--no-gap-aware"]))
    cfg = resolve(make_parser().parse_args(["--no-gap-aware", "--update-rule", "dana-zero"]))
    assert (cfg.update_rule, cfg.gap_aware) == ("dana-zero", False)
