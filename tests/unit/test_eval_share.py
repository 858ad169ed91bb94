"""--eval-interval whose evaluations take most of the run: rank 0 warns once (stderr and an event "warning"),
with the measured share of the training time, the threshold and what to change."""

from __future__ import annotations

import numpy as np
from kit.runs import read_log
from kit.server import P, make_server, push, reply, serve_one

from mpiasgd.comms.protocol import Flag, Message, Tag
from mpiasgd.rank0.evals import EVAL_SHARE_AFTER_S, EVAL_SHARE_WARN, EvalShare


def answer(net, w, number, version, seconds):
    net.post(w, 0, Tag.EVAL, Message(0).stamp(Tag.EVAL, w, step=number, version=version, samples=50, correct=40,
                                               correct5=45, loss=20.0, compute_s=seconds, flags=Flag.EVALUATE).buf)


def test_a_share_is_judged_only_after_some_training_seconds():
    """Start-up makes the share noise (0.01 s of evaluation at 0.03 s): judged from EVAL_SHARE_AFTER_S on."""
    share = EvalShare("0.02ep")
    assert EVAL_SHARE_AFTER_S == 2.0
    assert share.add(0.01, 0.03) == "" and share.add(0.5, 1.9) == ""
    assert share.add(1.5, 6.0) == ("evaluation during training took 34 % of the training time so far (3 evaluations: "
                                   "2.0 s of 6.0 s; warned above 25 %): evaluate less often with a larger "
                                   "--eval-interval (now 0.02ep)")
    assert share.add(5.0, 7.0) == ""  # once


def test_evaluations_that_take_most_of_the_time_are_warned_about_once(tmp_path, capsys):
    """1 worker, an evaluation every 0.1 epoch (every push of 10 of the 100 images), rank 0's training clock at 10 s
    at each: the first takes 1 s (10 %: quiet), the second 4 s (5 of 10 s, 50 %: the warning), the third 6 s (no
    second warning)."""
    assert EVAL_SHARE_WARN == 0.25
    server, net, log = make_server(tmp_path, num_workers=1, eval_interval="0.1ep", comm_timeout=60.0)
    server.role.begin()
    assert net.take(1)[1] == Tag.WEIGHTS
    server.rec.train_time = lambda: 10.0
    g = np.full(P, 0.1, np.float32)
    step = 0
    for number, seconds in ((1, 1.0), (2, 4.0), (3, 6.0)):
        for _ in range(2):  # the first push passes an epoch multiple (asked), the second's reply carries the flag
            step += 1
            push(net, 1, step=step, version=step - 1, grad=g)
            serve_one(server)
            server.tick()
        tag, header, _ = reply(net, 1)
        assert tag == Tag.WEIGHTS and int(header["flags"]) & Flag.EVALUATE and int(header["epoch"]) == number
        answer(net, 1, number, step, seconds)
        serve_one(server)
    text = ("evaluation during training took 50 % of the training time so far (2 evaluations: 5.0 s of 10.0 s; "
            "warned above 25 %): evaluate less often with a larger --eval-interval (now 0.1ep)")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "evaluation during training took" in line]
    assert warnings == [f"mpiasgd: warning: {text}"]
    log.flush()
    events = read_log(tmp_path / "run.h5")[1]["events"]
    assert [(e["kind"].decode(), e["text"].decode()) for e in events if b"took" in e["text"]] == [("warning", text)]
