"""The parameter server driven in-process through a fake communicator: crafted, reordered, stale,
duplicate and malformed messages."""

from __future__ import annotations

import numpy as np
import pytest
from kit.server import P, make_server, push, reply, serve_one

from mpiasgd.comms import Backoff, CommTimeout, probe, protocol
from mpiasgd.comms.protocol import HEADER_BYTES, Message, ProtocolError, Tag
from mpiasgd.rank0.loop import WorkerFailed
from mpiasgd.rank0.recorder import TrainingDiverged
from mpiasgd.runlog import open_log


def test_push_applied_in_arrival_order_with_staleness(tmp_path):
    server, net, log = make_server(tmp_path)
    server.start = 0.0
    g1, g2 = np.full(P, 1.0, np.float32), np.full(P, 2.0, np.float32)
    # worker 2's push arrives before worker 1's; both computed from version 0
    push(net, 2, step=1, version=0, grad=g2)
    push(net, 1, step=1, version=0, grad=g1)
    serve_one(server)
    serve_one(server)
    expected = np.arange(P, dtype=np.float32) - 0.5 * g2 - 0.5 * g1
    np.testing.assert_array_equal(server.params, expected)
    assert server.version == 2
    tag, header, payload = reply(net, 1)
    assert tag == Tag.WEIGHTS and header["version"] == 2 and header["step"] == 1
    np.testing.assert_array_equal(payload, expected)
    tag, header, _ = reply(net, 2)
    assert header["version"] == 1
    log.flush()
    with open_log(log.path) as f:
        pushes = f["pushes"][()]
    assert pushes["worker"].tolist() == [2, 1]
    assert pushes["staleness"].tolist() == [0, 1]     # worker 1's gradient was one update old
    assert pushes["version"].tolist() == [1, 2]
    assert (pushes["base_version"] + pushes["staleness"] + 1 == pushes["version"]).all()


def test_very_stale_push_counts_staleness(tmp_path):
    server, net, _ = make_server(tmp_path, num_workers=2)
    for step in range(1, 5):
        push(net, 2, step=step, version=step - 1, grad=np.zeros(P, np.float32))
        serve_one(server)
    push(net, 1, step=1, version=0, grad=np.zeros(P, np.float32))
    serve_one(server)
    assert server.staleness_max == 4 and server.version == 5


def test_duplicate_push_rejected(tmp_path):
    server, net, _ = make_server(tmp_path)
    push(net, 1, step=1, version=0, grad=np.zeros(P, np.float32))
    serve_one(server)
    push(net, 1, step=1, version=0, grad=np.zeros(P, np.float32))
    with pytest.raises(ProtocolError, match="worker rank 1 has step 1, expected 2"):
        serve_one(server)


def test_push_from_future_version_rejected(tmp_path):
    server, net, _ = make_server(tmp_path)
    push(net, 1, step=1, version=7, grad=np.zeros(P, np.float32))
    with pytest.raises(ProtocolError, match="computed from version 7, but the server is at version 0"):
        serve_one(server)


def test_wrong_size_rejected_naming_sizes(tmp_path):
    server, net, _ = make_server(tmp_path)
    push(net, 1, step=1, version=0, grad=np.zeros(P + 3, np.float32))
    with pytest.raises(ProtocolError, match=rf"PUSH message from rank 1 is {HEADER_BYTES + 4 * (P + 3)} bytes, "
                                            rf"expected {HEADER_BYTES + 4 * P}"):
        serve_one(server)


def test_unknown_tag_rejected(tmp_path):
    server, net, _ = make_server(tmp_path)
    net.post(2, 0, 99, np.zeros(8, np.uint8))
    with pytest.raises(ProtocolError, match="rank 0: message from rank 2 has unknown tag 99"):
        serve_one(server)


def test_header_sender_must_match_source(tmp_path):
    server, net, _ = make_server(tmp_path)
    msg = Message(P).stamp(Tag.PUSH, 2, step=1, version=0, samples=1)
    net.post(1, 0, Tag.PUSH, msg.buf)  # arrives from rank 1 but claims to be rank 2
    with pytest.raises(ProtocolError, match="from rank 1 claims sender 2"):
        serve_one(server)


def test_garbage_bytes_rejected(tmp_path):
    server, net, _ = make_server(tmp_path)
    net.post(1, 0, Tag.PUSH, np.full(protocol.message_bytes(P), 7, np.uint8))
    with pytest.raises(ProtocolError, match="bad magic number"):
        serve_one(server)


def test_message_from_non_worker_rejected(tmp_path):
    server, net, _ = make_server(tmp_path, num_workers=1)
    net.queues[0].append((0, int(Tag.PUSH), bytes(Message(P).buf)))
    with pytest.raises(ProtocolError, match="not a worker"):
        serve_one(server)


def test_stop_after_max_pushes_drains_then_evals(tmp_path):
    server, net, _ = make_server(tmp_path, max_pushes=2)
    push(net, 1, step=1, version=0, grad=np.ones(P, np.float32))
    push(net, 2, step=1, version=0, grad=np.ones(P, np.float32))
    push(net, 1, step=2, version=1, grad=np.ones(P, np.float32))
    for _ in range(2):
        serve_one(server)
    assert reply(net, 1)[0] == Tag.WEIGHTS
    assert reply(net, 2)[0] == Tag.STOP  # the second push reached max_pushes: its reply is STOP
    final = server.params.copy()
    serve_one(server)                    # a push in flight at the stop is drained, not applied
    tag, header, payload = reply(net, 1)
    assert tag == Tag.STOP and header["version"] == 2
    np.testing.assert_array_equal(payload, final)
    np.testing.assert_array_equal(server.params, final)
    # a push after STOP is a protocol error
    push(net, 1, step=3, version=2, grad=np.ones(P, np.float32))
    with pytest.raises(ProtocolError, match="after it was sent STOP"):
        serve_one(server)


def test_eval_before_stop_rejected(tmp_path):
    server, net, _ = make_server(tmp_path)
    net.post(1, 0, Tag.EVAL, Message(0).stamp(Tag.EVAL, 1, samples=5).buf)
    with pytest.raises(ProtocolError, match="EVAL from worker rank 1 before it was sent STOP"):
        serve_one(server)


def test_worker_error_message_raises_worker_failed(tmp_path):
    server, net, _ = make_server(tmp_path)
    net.post(2, 0, Tag.ERROR, protocol.error_message(2, "Traceback: boom").buf)
    with pytest.raises(WorkerFailed, match="worker rank 2 failed") as info:
        serve_one(server)
    assert info.value.rank == 2 and info.value.text == "Traceback: boom"


def test_full_run_with_scripted_workers(tmp_path):
    """server.run() end to end: initial pull, pushes, STOP, EVAL; summary and log agree."""
    import threading

    server, net, log = make_server(tmp_path, max_pushes=6)
    result = {}
    thread = threading.Thread(target=lambda: result.update(summary=server.run()))
    thread.start()
    versions = {1: None, 2: None}
    steps = {1: 0, 2: 0}
    done = set()
    import time
    deadline = time.monotonic() + 10
    while len(done) < 2 and time.monotonic() < deadline:
        for w in (1, 2):
            got = net.take(w)
            if got is None:
                continue
            _, tag, data = got
            msg = Message(P)
            msg.buf[:] = np.frombuffer(data, np.uint8)
            if tag == Tag.STOP:
                net.post(w, 0, Tag.EVAL, Message(0).stamp(Tag.EVAL, w, samples=50, correct=40 + w, loss=5.0).buf)
                done.add(w)
                continue
            versions[w] = int(msg.header["version"])
            steps[w] += 1
            push(net, w, step=steps[w], version=versions[w], grad=np.full(P, 0.1, np.float32))
        time.sleep(0.001)
    thread.join(10)
    assert not thread.is_alive(), "server did not finish"
    summary = result["summary"]
    assert summary["version"] == 6 and summary["test_count"] == 100
    assert summary["test_accuracy"] == pytest.approx((41 + 42) / 100)
    log.close("completed")
    with open_log(log.path) as f:
        pushes = f["pushes"][()]
        evals = f["evals"][()]
        assert f["snapshots/params"].shape == (2, P)  # first and last
    assert pushes["applied"].sum() == 6
    assert evals["snapshot"].tolist() == [-1] and evals["count"].tolist() == [100]


def test_run_times_out_naming_silent_workers(tmp_path):
    server, net, _ = make_server(tmp_path, comm_timeout=0.3)
    push(net, 1, step=1, version=0, grad=np.zeros(P, np.float32))   # worker 2 never says anything
    # the worker silent longest is named first
    with pytest.raises(CommTimeout, match=r"rank 0: worker rank 2 has sent nothing for 0\.\d s \(--comm-timeout "
                                          r"0\.3 s\): hung or very slow; silent longer than that: rank 2 \(0\.\d s\)"):
        server.run()


def test_probe_times_out_naming_what(tmp_path):
    server, _, _ = make_server(tmp_path)
    with pytest.raises(CommTimeout, match="rank 0: no message from any worker after 0 s"):
        probe(server.comm, 0, 0.05, "message from any worker", Backoff())


@pytest.mark.parametrize("rule,factors", [("none", [1, 1, 1, 1]), ("inverse", [1, 1, 1 / 2, 1 / 3]),
                                          ("sqrt", [1, 1, 2 ** -0.5, 3 ** -0.5])])
def test_staleness_aware_step(tmp_path, rule, factors):
    """Crafted versions give staleness 0, 1, 2, 3; the step is lr * factor(staleness) exactly."""
    server, net, log = make_server(tmp_path, num_workers=4, staleness_lr=rule)
    g = np.full(P, 1.0, np.float32)
    expected = server.params.astype(np.float64)
    for w, base in zip((1, 2, 3, 4), (0, 0, 0, 0), strict=True):  # all from version 0: staleness 0,1,2,3
        push(net, w, step=1, version=base, grad=g)
        serve_one(server)
    for f in factors:
        expected -= 0.5 * f * 1.0
    np.testing.assert_allclose(server.params, expected, rtol=1e-6)
    log.flush()
    with open_log(log.path) as fh:
        pushes = fh["pushes"][()]
    assert pushes["staleness"].tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(pushes["lr"], [0.5 * f for f in factors], rtol=1e-6)


def test_non_finite_pushes_rejected_counted_then_stop(tmp_path):
    server, net, log = make_server(tmp_path, max_rejects=3)
    before = server.params.copy()
    bad = np.ones(P, np.float32)
    bad[2] = np.nan
    push(net, 1, step=1, version=0, grad=bad)
    serve_one(server)
    np.testing.assert_array_equal(server.params, before)           # not applied
    tag, header, payload = reply(net, 1)
    assert tag == Tag.WEIGHTS and header["version"] == 0           # the worker gets the current weights
    np.testing.assert_array_equal(payload, before)
    push(net, 1, step=2, version=0, grad=np.full(P, np.inf, np.float32))
    serve_one(server)
    push(net, 1, step=3, version=0, grad=np.ones(P, np.float32))   # a finite push resets the run of rejects
    serve_one(server)
    assert server.version == 1 and server.rejected == {1: 2, 2: 0} and server.rejects_in_row[1] == 0
    log.flush()
    with open_log(log.path) as fh:
        pushes = fh["pushes"][()]
    assert pushes["rejected"].tolist() == [1, 1, 0] and pushes["applied"].tolist() == [0, 0, 1]
    for step in (4, 5):
        push(net, 1, step=step, version=1, grad=bad)
        serve_one(server)
    push(net, 1, step=6, version=1, grad=bad)
    with pytest.raises(TrainingDiverged, match=r"worker rank 1 pushed 3 non-finite gradients in a row \(steps 4..6"):
        serve_one(server)


def test_huge_but_finite_gradient_is_applied(tmp_path):
    server, net, _ = make_server(tmp_path)
    g = np.full(P, 1e30, np.float32)  # its squared norm overflows float32, the values do not
    push(net, 1, step=1, version=0, grad=g)
    serve_one(server)
    assert server.version == 1 and server.rejected[1] == 0


def test_staleness_rule_scales_the_stale_gradient_not_the_velocity(tmp_path):
    """--staleness-lr inverse with momentum 0.9 and weight decay: each push's gradient enters the velocity
    scaled by 1/max(1, staleness); the velocity from earlier pushes keeps its step (hand computation over
    five pushes of staleness 0, 1, 2, 2, 3)."""
    server, net, log = make_server(tmp_path, num_workers=3, staleness_lr="inverse", momentum=0.9,
                                   weight_decay=0.1)
    w, v = server.params.astype(np.float64), np.zeros(P)
    pushes = [(1, 1, 0), (2, 1, 0), (3, 1, 0), (1, 2, 1), (2, 2, 1)]  # (worker, step, base version)
    for k, (worker, step, base) in enumerate(pushes):
        g = np.linspace(-1, 1, P).astype(np.float32) * (k + 1)
        staleness = k - base
        push(net, worker, step=step, version=base, grad=g)
        serve_one(server)
        v = 0.9 * v + g / max(1, staleness) + 0.1 * w  # make_server's mask decays every parameter
        w = w - 0.5 * v
        np.testing.assert_allclose(server.params, w, rtol=1e-5, atol=1e-5)
    log.flush()
    with open_log(log.path) as fh:
        rows = fh["pushes"][()]
    assert rows["staleness"].tolist() == [0, 1, 2, 2, 3]
    np.testing.assert_allclose(rows["lr"], [0.5, 0.5, 0.25, 0.25, 0.5 / 3], rtol=1e-6)


@pytest.mark.parametrize("adaptive", [0.0, 0.9])
def test_delay_compensation_by_hand(tmp_path, adaptive):
    """--dc-lambda 2 (and DC-ASGD-a, --dc-adaptive 0.9) with --staleness-lr inverse, momentum 0.9 and weight
    decay: every push's gradient g is corrected to g + lambda_t g g (w - w_pulled), w_pulled the weights of
    the worker's last reply, before the staleness factor scales it into the velocity (hand computation over
    six pushes of three workers; the replies carry the weights each worker computes its next push on)."""
    lam = 2.0
    server, net, log = make_server(tmp_path, num_workers=3, staleness_lr="inverse", momentum=0.9, weight_decay=0.1,
                                   dc_lambda=lam, dc_adaptive=adaptive)
    server.start_workers()  # every worker pulls the initial weights (version 0)
    w, v, ms = server.params.astype(np.float64), np.zeros(P), np.zeros(P)
    pulled = {k: w.copy() for k in (1, 2, 3)}
    rng = np.random.default_rng(3)
    pushes = [(1, 1, 0), (2, 1, 0), (3, 1, 0), (1, 2, 1), (2, 2, 2), (1, 3, 4)]  # (worker, step, base version)
    for k, (worker, step, base) in enumerate(pushes):
        g = rng.standard_normal(P).astype(np.float32)
        push(net, worker, step=step, version=base, grad=g)
        serve_one(server)
        g64 = g.astype(np.float64)
        if adaptive:
            ms = adaptive * ms + (1 - adaptive) * g64 * g64
            scale = lam / np.sqrt(ms + 1e-7)
        else:
            scale = lam
        corrected = g64 + scale * g64 * g64 * (w - pulled[worker])
        v = 0.9 * v + corrected / max(1, k - base) + 0.1 * w
        w = w - 0.5 * v
        np.testing.assert_allclose(server.params, w, rtol=1e-5, atol=1e-5)
        tag, header, payload = reply(net, worker)
        assert tag == Tag.WEIGHTS and header["version"] == k + 1
        pulled[worker] = payload.astype(np.float64)
    assert any((w != p).any() for p in pulled.values())  # a correction was not zero
    log.flush()
    with open_log(log.path) as fh:
        assert fh["pushes"]["staleness"].tolist() == [0, 1, 2, 2, 2, 1]


def test_delay_compensation_is_exactly_plain_sgd_when_nothing_is_stale(tmp_path):
    """One worker: every push has staleness 0, w - w_pulled = 0, and the weights equal a run without it bit
    for bit."""
    runs = []
    for lam in (0.0, 5.0):
        server, net, _ = make_server(tmp_path / str(lam), num_workers=1, momentum=0.9, dc_lambda=lam)
        server.start_workers()
        for step in range(1, 5):
            push(net, 1, step=step, version=step - 1, grad=np.linspace(-2, 3, P).astype(np.float32) * step)
            serve_one(server)
        runs.append(server.params.copy())
    np.testing.assert_array_equal(runs[0], runs[1])


def test_a_gradient_that_delay_compensation_makes_non_finite_is_rejected(tmp_path):
    """A finite gradient whose correction overflows float32 (lambda g g (w - w_pulled) > 3.4e38) is rejected like a
    non-finite push, and the error names --dc-lambda."""
    server, net, _ = make_server(tmp_path, num_workers=2, dc_lambda=1e6, max_rejects=1)
    server.start_workers()
    push(net, 1, step=1, version=0, grad=np.ones(P, np.float32))
    serve_one(server)  # version 1: worker 2's weights are now 0.5 behind
    before = server.params.copy()
    push(net, 2, step=1, version=0, grad=np.full(P, 1e17, np.float32))
    with pytest.raises(TrainingDiverged, match=r"non-finite gradients in a row .*delay compensation made finite "
                                               r"gradients non-finite: lower --dc-lambda \(or --lr\)"):
        serve_one(server)
    np.testing.assert_array_equal(server.params, before)


@pytest.mark.parametrize("rule,workers,expected", [("fixed", 4, 0.9), ("workers", 1, 0.9), ("workers", 2, 0.4),
                                                   ("workers", 4, 0.15), ("workers", 10, 0.0)])
def test_async_momentum_rule(tmp_path, rule, workers, expected):
    """--async-momentum workers: the server's momentum is max(0, 0.9 - (1 - 1/N)), and its steps use it."""
    server, net, _ = make_server(tmp_path, num_workers=workers, momentum=0.9, async_momentum=rule, update_rule="sgd")
    assert float(server.optimizer.momentum) == pytest.approx(expected)
    w, v = server.params.astype(np.float64), np.zeros(P)
    for step in (1, 2, 3):
        g = np.full(P, float(step), np.float32)
        push(net, 1, step=step, version=step - 1, grad=g)
        serve_one(server)
        v = expected * v + g
        w = w - 0.5 * v
    np.testing.assert_allclose(server.params, w, rtol=1e-6)


def test_a_pause_of_rank0_itself_is_not_worker_silence(tmp_path, monkeypatch, capsys):
    """Rank 0 stopped (SIGSTOP) for 20 s, then continued: its next tick takes the gap off every worker's
    silence and logs one "pause" event, not a stall warning; a worker silent for --stall-warning and
    then --comm-timeout while rank 0 runs is still warned about and named."""
    import time

    from mpiasgd.rank0 import loop as server_module

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    server, _, log = make_server(tmp_path, stall_warning=1.0, comm_timeout=5.0, checkpoint_interval=0)
    server.start = 0.0
    server.start_workers()

    def run_until(t):  # rank 0's loop ticking every 0.1 s
        while clock[0] < t - 1e-9:
            clock[0] = round(clock[0] + 0.1, 6)
            server.tick()

    run_until(0.5)
    clock[0] = 0.5 + 20.0  # SIGSTOP ... SIGCONT
    server.tick()
    run_until(21.0)
    assert "has sent nothing" not in capsys.readouterr().err
    assert server.last_seen[1] == pytest.approx(20.0, abs=0.11)  # its silence: the 0.5 s before the pause
    run_until(22.0)  # now both workers really are silent for more than --stall-warning
    err = capsys.readouterr().err
    assert "worker rank 1 has sent nothing for 1." in err and "worker rank 2 has sent nothing for 1." in err
    with pytest.raises(server_module.CommTimeout, match=r"worker rank [12] has sent nothing for 5\.\d s"):
        run_until(30.0)
    log.flush()
    with open_log(log.path) as f:
        events = f["events"][()]
    pauses = [e["text"].decode() for e in events if e["kind"] == b"pause"]
    assert len(pauses) == 1 and pauses[0].startswith("rank 0 was paused for 20.0 s"), pauses
    assert server_module.PAUSE_GAP < 20.0


class SilentComm:
    """A communicator whose Improbe finds a message only from poll `arrives_at` on (a fake MPI.Message)."""

    def __init__(self, arrives_at: int) -> None:
        self.polls, self.arrives_at = 0, arrives_at

    def Improbe(self, source, tag, status):
        self.polls += 1
        return object() if self.polls >= self.arrives_at else None


def test_a_pause_of_this_process_does_not_time_out_a_wait(monkeypatch):
    """The defect: rank 0 stopped for 11 s with --comm-timeout 8, continued; the first poll after the pause
    found nothing yet and the probe timed out ("no message after 8 s") though every worker had just sent.
    A gap of more than PAUSE_GAP between two polls is not counted; real silence still times out."""
    import time

    from mpiasgd import comms

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: clock.__setitem__(0, clock[0] + max(s, 1e-3)))

    def paused_once():  # the process is stopped for 11 s inside its first idle call
        if clock[0] < 1:
            clock[0] += 11.0

    comm = SilentComm(arrives_at=3)
    message, _ = probe(comm, 0, 8.0, "message from any worker", Backoff(), idle=paused_once)
    assert message is not None and comm.polls == 3 and clock[0] > 11
    clock[0] = 0.0
    with pytest.raises(CommTimeout, match="rank 0: no message from any worker after 8 s"):
        probe(SilentComm(arrives_at=10**9), 0, 8.0, "message from any worker", Backoff())
    assert 8.0 < clock[0] < 8.1

    class Request:  # completes on its 3rd Test; the process is stopped for 11 s after the 1st
        tests = 0

        def Test(self, status=None):
            self.tests += 1
            if self.tests == 2:
                clock[0] += 11.0
            return self.tests >= 3

    clock[0] = 0.0
    assert comms.wait(Request(), "WEIGHTS from rank 0", 1, 8.0) > 11


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_lookahead_replies_by_hand(tmp_path, wire):
    """--lookahead 1 with momentum 0.9 and weight decay: the master weights follow plain SGD with momentum exactly,
    and every reply carries w - lr * 0.9 * v (bf16: encoded), the point one momentum-only update ahead."""
    from mpiasgd.comms.wire import decode

    server, net, _ = make_server(tmp_path, momentum=0.9, weight_decay=0.1, lookahead=1.0, wire=wire)
    assert server.lookahead is not None and server.lookahead.factor == pytest.approx(0.9)
    server.start_workers()
    w, v = server.params.astype(np.float64), np.zeros(P)
    rng = np.random.default_rng(5)
    for worker, step, base in [(1, 1, 0), (2, 1, 0), (1, 2, 1), (2, 2, 2)]:
        g = rng.standard_normal(P).astype(np.float32)
        push(net, worker, step=step, version=base, grad=g, wire=wire)
        serve_one(server)
        if wire != "fp32":
            g = decode(wire, encode_for_test(wire, g), np.empty(P, np.float32))
        v = 0.9 * v + g + 0.1 * w
        w = w - 0.5 * v
        np.testing.assert_allclose(server.params, w, rtol=1e-5, atol=1e-5)
        tag, header, payload = reply(net, worker, wire=wire)
        assert header["version"] == server.rec.version
        got = payload if wire == "fp32" else decode(wire, payload, np.empty(P, np.float32))
        bound = 1e-5 if wire == "fp32" else 2.0 ** -8
        np.testing.assert_allclose(got, w - 0.5 * 0.9 * v, rtol=bound, atol=1e-5)
        assert tag == Tag.WEIGHTS and not np.allclose(got, w, rtol=1e-3)  # it is not the master weights


def encode_for_test(wire, values):
    from mpiasgd.comms.wire import encode, wire_dtype

    out = np.empty(values.size, wire_dtype(wire))
    return encode(wire, values, out)


def test_lookahead_auto_is_the_other_workers_and_off_without_momentum(tmp_path):
    server, _, _ = make_server(tmp_path / "a", num_workers=3, momentum=0.9, lookahead=-1.0)
    assert server.lookahead.factor == pytest.approx(0.9 + 0.81)
    server, _, _ = make_server(tmp_path / "b", num_workers=2, momentum=0.9, lookahead=-1.0, async_momentum="workers")
    assert server.lookahead.factor == pytest.approx(0.4)  # the lowered momentum 0.9 - 0.5
    server, _, _ = make_server(tmp_path / "c", num_workers=1, momentum=0.9, lookahead=-1.0)
    assert server.lookahead is None  # one worker: nothing is stale


@pytest.mark.parametrize("num_workers,steps", [(1, 1), (2, 3), (3, 5)])
def test_lookahead_auto_with_overlap_is_one_more_round(tmp_path, capsys, num_workers, steps):
    """--overlap --lookahead -1: a push is computed on the reply before the last, so the reply looks 2N - 1
    updates ahead (the staleness measured with N equal workers), not N."""
    server, _, _ = make_server(tmp_path, num_workers=num_workers, momentum=0.9, lookahead=-1.0, overlap=True)
    assert server.lookahead_k == steps
    assert server.lookahead.factor == pytest.approx(sum(0.9 ** k for k in range(1, steps + 1)))
    server.r0.role.begin()
    workers = f"{num_workers} worker{'s' * (num_workers != 1)}"
    assert (f"the replies look {steps} update{'s' * (steps != 1)} ahead (--lookahead -1, {workers})"
            in capsys.readouterr().out)


def test_lookahead_stop_and_first_weights_are_the_master_weights(tmp_path, capsys):
    """--lookahead: the weights a worker evaluates (STOP) and its first ones are the master weights, not the
    look-ahead point; what the option resolved to is printed and logged once."""
    server, net, log = make_server(tmp_path, momentum=0.9, lookahead=-1.0, max_pushes=3)
    server.r0.role.begin()
    assert "the replies look 1 update ahead (--lookahead -1, 2 workers): w - lr * 0.9 * v" in capsys.readouterr().out
    for worker in (1, 2):
        tag, _, payload = reply(net, worker)
        assert tag == Tag.WEIGHTS
        np.testing.assert_array_equal(payload, server.params)
    rng = np.random.default_rng(8)
    for worker, step, base in [(1, 1, 0), (2, 1, 0), (1, 2, 1)]:
        push(net, worker, step=step, version=base, grad=rng.standard_normal(P).astype(np.float32))
        serve_one(server)
    tag, _, payload = reply(net, 2)
    assert tag == Tag.WEIGHTS and not np.array_equal(payload, server.params)  # a look-ahead reply
    tag, _, payload = reply(net, 1)
    assert tag == Tag.STOP  # the third push reached --max-pushes
    np.testing.assert_array_equal(payload, server.params)
    log.flush()
    with open_log(log.path) as fh:
        kinds = [k.decode() if isinstance(k, bytes) else k for k in fh["events"]["kind"]]
    assert kinds.count("lookahead") == 1


def test_lookahead_off_is_said(tmp_path, capsys):
    server, _, _ = make_server(tmp_path, num_workers=1, momentum=0.9, lookahead=-1.0)
    server.r0.role.begin()
    assert "--lookahead -1 is off: with 1 worker nothing is stale" in capsys.readouterr().out
    server, _, _ = make_server(tmp_path / "b", num_workers=10, momentum=0.9, lookahead=2.0, async_momentum="workers")
    server.r0.role.begin()
    assert "--lookahead 2 is off: the server's momentum is 0" in capsys.readouterr().out


def test_progress_bar_shows_no_loss_before_the_first_push(tmp_path):
    server, net, _ = make_server(tmp_path)

    class Bar:  # what the recorder uses of tqdm
        n, total, text = 0, 100, ""

        def set_postfix_str(self, text, refresh):
            self.text = text

    server.rec.progress = bar = Bar()
    server.rec.show_progress(force=True)
    assert bar.text == "epoch 0.00 loss - staleness 0.00"
    push(net, 1, step=1, version=0, grad=np.ones(P, np.float32), loss=2.5)
    serve_one(server)
    server.rec.show_progress(force=True)
    assert bar.text.startswith("epoch ") and " loss 2.500 staleness 0.00" in bar.text


def test_a_pause_of_rank0_is_not_training_time_and_a_push_after_it_does_not_end_the_run(tmp_path, monkeypatch):
    """(trial of issue 36) Rank 0 stopped for 12.5 s of a --max-time 12 run: the push that waited through the pause
    is handled before any tick, and must neither find the training clock past 12 s nor leave the pause unlogged."""
    import time

    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    server, net, log = make_server(tmp_path, max_pushes=0, max_time=12.0, checkpoint_interval=0)
    server.rec.start = 0.0
    server.start_workers()
    for t in (0.1, 0.2, 0.3):
        clock[0] = t
        server.tick()
    clock[0] = 12.8  # SIGSTOP at 0.3 s ... SIGCONT at 12.8 s: the push waited in the queue
    push(net, 1, step=1, version=0, grad=np.ones(P, np.float32))
    serve_one(server)
    assert not server.rec.stop_reason and server.rec.version == 1
    assert server.rec.train_time() == pytest.approx(0.3)  # 0.3 s trained; the 12.5 s pause is not training
    log.flush()
    with open_log(log.path) as f:
        pauses = [e["text"].decode() for e in f["events"][()] if e["kind"] == b"pause"]
    assert pauses == ["rank 0 was paused for 12.5 s (its loop did not run: the process was stopped, starved or "
                      "busy); not counted as the workers' silence nor as training time"]
