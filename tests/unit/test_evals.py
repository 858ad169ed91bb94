"""Evaluation during training (--eval-interval) in-process, and what comes with it: the schedule, the
snapshot interval's auto rule, the TensorBoard event files and logs written by an older version.

Rank 0 is driven with crafted messages (async: which replies ask for an evaluation, how answers are
summed into one row, what a stop does to an open one, what breaks the protocol); a worker answers a
flagged reply with the evaluation of exactly those weights; sync and pipeline runs in threads log
evaluations that equal evaluating the snapshot of the same weights by hand. tests/mpi/test_evals.py:
the same under mpiexec.
"""

from __future__ import annotations

import math

import h5py
import numpy as np
import pytest
from kit.fakempi import Group, Network, rank0
from kit.runs import read_log
from kit.server import P, make_server, push, reply, serve_one
from kit.tensorboard import events, scalars
from kit.threads import run_threads
from kit.worker import receive, reference_grad, send, start_worker

from mpiasgd.comms.protocol import Flag, Message, ProtocolError, Tag
from mpiasgd.config import Config, ConfigError
from mpiasgd.data import ShardSampler
from mpiasgd.model import build_model, evaluate
from mpiasgd.modes.base import WorkerJob
from mpiasgd.modes.pipeline import MODE as PIPELINE
from mpiasgd.modes.pipeline import PipelineUnit
from mpiasgd.modes.sync import SyncWorker
from mpiasgd.optim import EvalSchedule, snapshot_seconds
from mpiasgd.runlog import EVAL_ROW, PUSH_ROW, EvalRow, PushRow, RunLog, WriterLock, load
from mpiasgd.runlog.tensorboard import TensorBoard, tensorboard_dir

B = 16
COMM_TIMEOUT = 5.0


# --- the schedule and the snapshot rule ----------------------------------------------------------------

def test_eval_schedule_in_epochs_and_seconds():
    """Due once the clock reaches the next multiple; a jump past several gives one evaluation; a resumed
    run starts after its last multiple; '' never."""
    epochs = EvalSchedule.of(Config(eval_interval="0.5ep"))
    assert [epochs.due(1e6, e) for e in (0.2, 0.4, 0.5, 0.7, 1.6, 1.7, 2.0)] == [False, False, True, False, True,
                                                                                   False, True]
    seconds = EvalSchedule.of(Config(eval_interval="30s"))
    assert [seconds.due(t, 99.0) for t in (29.9, 30.0, 59.0, 95.0, 119.0, 120.0)] == [False, True, False, True,
                                                                                      False, True]
    resumed = EvalSchedule.of(Config(eval_interval="0.5ep"), seconds=10.0, epochs=1.0)
    assert (resumed.due(0, 1.2), resumed.due(0, 1.5)) == (False, True)
    assert not any(EvalSchedule.of(Config()).due(t, t) for t in (0.0, 1.0, 1e9))
    # epochs as the sync workers count them (steps x images per step / training images): every 15 steps exactly,
    # although 15 * 32 / 1437 is no exact float
    every = 15 * 32 / 1437
    steps = EvalSchedule.of(Config(eval_interval=f"{every!r}ep"))
    assert [k for k in range(1, 91) if steps.due(0.0, k * 32 / 1437)] == [15, 30, 45, 60, 75, 90]


def test_snapshot_interval_auto_follows_the_model_size():
    """-1 (the default): max(5 s, bytes / 1 MB/s); a value >= 0 is taken as given; other negatives refused."""
    assert Config().snapshot_interval == -1.0 and Config().validate()
    assert snapshot_seconds(-1.0, 10_000) == 5.0                     # digits-sized: as before the rule
    assert snapshot_seconds(-1.0, 61_000_000) == pytest.approx(244.0)  # AlexNet: 244 MB every 244 s
    assert (snapshot_seconds(5.0, 61_000_000), snapshot_seconds(0.0, 61_000_000)) == (5.0, 0.0)
    with pytest.raises(ConfigError, match="snapshot_interval"):
        Config(snapshot_interval=-2.0).validate()


# --- async: rank 0 asks, the workers answer ------------------------------------------------------------

def eval_answer(net, w, number, version, samples, correct, correct5, loss, seconds, flags=Flag.EVALUATE):
    net.post(w, 0, Tag.EVAL, Message(0).stamp(Tag.EVAL, w, step=number, version=version, samples=samples,
                                               correct=correct, correct5=correct5, loss=loss, compute_s=seconds,
                                               flags=flags).buf)


def started_server(tmp_path, **overrides):
    """make_server's rank 0 (2 workers, 100 training images, 10 per push) with the initial weights sent."""
    server, net, log = make_server(tmp_path, **overrides)
    server.role.begin()
    for w in (1, 2):
        assert net.take(w)[1] == Tag.WEIGHTS
    return server, net, log


def test_async_rank0_asks_each_running_worker_once_and_logs_the_sum(tmp_path):
    """--eval-interval 0.3ep: after the 3rd push the evaluation is due; each worker's next reply (not the one
    already sent) carries flag EVALUATE and number 1; one row sums both answers, with the versions each
    worker got, the images trained on at them (their mean) and the slowest worker's seconds."""
    server, net, log = started_server(tmp_path, eval_interval="0.3ep")
    g = np.full(P, 0.1, np.float32)
    for w, step, version in ((1, 1, 0), (2, 1, 0), (1, 2, 1)):
        push(net, w, step, version, g)
        serve_one(server)
        server.tick()
        tag, header, _ = reply(net, w)
        assert tag == Tag.WEIGHTS and not int(header["flags"]) & Flag.EVALUATE
    push(net, 2, step=2, version=2, grad=g)  # epoch 0.4 after it: the next evaluation is not due before 0.6
    serve_one(server)
    server.tick()
    tag, header, payload = reply(net, 2)
    assert tag == Tag.WEIGHTS and int(header["flags"]) & Flag.EVALUATE and int(header["epoch"]) == 1
    assert int(header["version"]) == 4
    np.testing.assert_array_equal(payload, server.params)
    eval_answer(net, 2, 1, 4, samples=50, correct=40, correct5=48, loss=20.0, seconds=0.5)
    serve_one(server)
    push(net, 1, step=3, version=3, grad=g)
    serve_one(server)
    tag, header, _ = reply(net, 1)
    assert int(header["flags"]) & Flag.EVALUATE and (int(header["epoch"]), int(header["version"])) == (1, 5)
    push(net, 2, step=3, version=4, grad=g)  # worker 2 was told already: a plain reply
    serve_one(server)
    assert not int(reply(net, 2)[1]["flags"]) & Flag.EVALUATE
    eval_answer(net, 1, 1, 5, samples=50, correct=45, correct5=50, loss=10.0, seconds=1.0)
    serve_one(server)
    log.flush()
    rows = read_log(tmp_path / "run.h5")[1]["periodic_evals"]
    assert len(rows) == 1
    row = rows[0]
    assert (row["version_min"], row["version_max"], row["count"], row["snapshot"]) == (4, 5, 100, -1)
    assert (row["top1"], row["top5"], row["loss"]) == (pytest.approx(0.85), pytest.approx(0.98), pytest.approx(0.3))
    assert (row["samples"], row["epoch"], row["seconds"]) == (45, pytest.approx(0.45), pytest.approx(1.0))
    with pytest.raises(ProtocolError, match="EVAL \\(evaluation during training\\) number 1 from worker rank 1: it "
                                            "was not asked for it"):
        eval_answer(net, 1, 1, 5, samples=50, correct=45, correct5=50, loss=10.0, seconds=1.0)
        serve_one(server)


@pytest.mark.parametrize("correct,stops", [(40, False), (45, True)])
def test_stop_accuracy_ends_the_run_at_the_first_evaluation_that_reaches_it(tmp_path, correct, stops):
    """--stop-accuracy 0.85: an evaluation of 80 % leaves the run going; one of 90 % stops it (reason logged) and
    the next reply is STOP. The other rules (max_pushes 100) are far off."""
    server, net, _ = started_server(tmp_path, eval_interval="0.1ep", stop_accuracy=0.85)
    g = np.full(P, 0.1, np.float32)
    push(net, 1, step=1, version=0, grad=g)  # epoch 0.1: the evaluation is due
    serve_one(server)
    server.tick()
    push(net, 2, step=1, version=0, grad=g)
    serve_one(server)
    assert int(reply(net, 2)[1]["flags"]) & Flag.EVALUATE
    eval_answer(net, 2, 1, 2, samples=50, correct=correct, correct5=50, loss=10.0, seconds=0.5)
    serve_one(server)
    push(net, 1, step=2, version=1, grad=g)
    serve_one(server)
    assert int(reply(net, 1)[1]["flags"]) & Flag.EVALUATE
    eval_answer(net, 1, 1, 3, samples=50, correct=correct, correct5=50, loss=10.0, seconds=0.5)
    serve_one(server)
    assert server.rec.stop_reason.startswith("stop_accuracy: test top-1 ") == stops, server.rec.stop_reason
    push(net, 2, step=2, version=2, grad=g)
    serve_one(server)
    assert reply(net, 2)[0] == (Tag.STOP if stops else Tag.WEIGHTS)
    if stops:
        assert server.rec.stop_reason == "stop_accuracy: test top-1 90.00 % >= 85 % at epoch 0.25"


def test_stop_accuracy_needs_evaluations():
    with pytest.raises(ConfigError, match=r"'stop_accuracy' = 0.5: expected 0 without --eval-interval"):
        Config(stop_accuracy=0.5).validate()
    with pytest.raises(ConfigError, match=r"'stop_accuracy' = 1.5: expected a fraction 0..1"):
        Config(stop_accuracy=1.5, eval_interval="1ep").validate()


def test_async_answers_are_checked(tmp_path):
    """An answer to an evaluation the worker was not asked for, or a second one, is a ProtocolError."""
    server, net, _ = started_server(tmp_path, eval_interval="0.1ep")
    eval_answer(net, 1, 1, 0, samples=50, correct=1, correct5=1, loss=1.0, seconds=0.1)
    with pytest.raises(ProtocolError, match="number 1 from worker rank 1: it was not asked for it"):
        serve_one(server)
    push(net, 1, 1, 0, np.zeros(P, np.float32))
    serve_one(server)
    server.tick()  # due: both are asked
    push(net, 1, 2, 1, np.zeros(P, np.float32))
    serve_one(server)
    assert int(reply(net, 1)[1]["epoch"]) == 1
    eval_answer(net, 1, 1, 2, samples=50, correct=1, correct5=1, loss=1.0, seconds=0.1)
    serve_one(server)
    eval_answer(net, 1, 1, 2, samples=50, correct=1, correct5=1, loss=1.0, seconds=0.1)
    with pytest.raises(ProtocolError, match="number 1 from worker rank 1: it answered it already"):
        serve_one(server)


def test_a_stop_before_the_flagged_reply_drops_the_evaluation(tmp_path):
    """The run stops (max_pushes) after the evaluation was asked for but before any flagged reply went out:
    the workers get STOP instead, the evaluation is not logged, an event says why."""
    server, net, log = started_server(tmp_path, eval_interval="0.3ep", max_pushes=4)
    g = np.zeros(P, np.float32)
    for w, step, version in ((1, 1, 0), (2, 1, 0), (1, 2, 1)):
        push(net, w, step, version, g)
        serve_one(server)
        server.tick()
    push(net, 1, 3, 3, g)  # the 4th update: the stopping rule; its reply is STOP
    push(net, 2, 2, 2, g)  # drained: STOP
    for w in (1, 2):
        serve_one(server)
        assert reply(net, w)[0] == Tag.STOP
    log.flush()
    _, t, _ = read_log(tmp_path / "run.h5")
    assert len(t["periodic_evals"]) == 0
    texts = [e["text"].decode() for e in t["events"] if e["kind"] == b"evaluation"]
    assert texts == ["evaluation 1 during training not logged: worker rank 1 was stopped before it evaluated"]


def test_an_abandoned_answer_drops_the_evaluation(tmp_path):
    """A worker that a signal reached mid-evaluation answers with flag PREEMPT: no row, an event."""
    server, net, log = started_server(tmp_path, eval_interval="0.1ep")
    push(net, 1, 1, 0, np.zeros(P, np.float32))
    serve_one(server)
    server.tick()
    for w, version in ((1, 1), (2, 0)):
        push(net, w, 2 if w == 1 else 1, version, np.zeros(P, np.float32))
        serve_one(server)
    eval_answer(net, 1, 1, 1, samples=50, correct=5, correct5=9, loss=1.0, seconds=0.1)
    eval_answer(net, 2, 1, 2, samples=0, correct=0, correct5=0, loss=0.0, seconds=0.1,
                flags=Flag.EVALUATE | Flag.PREEMPT)
    serve_one(server)
    serve_one(server)
    log.flush()
    _, t, _ = read_log(tmp_path / "run.h5")
    assert len(t["periodic_evals"]) == 0
    assert [e["text"].decode() for e in t["events"] if e["kind"] == b"evaluation"] == [
        "evaluation 1 during training not logged: worker rank 2 abandoned it (a signal, or the run ended)"]


def test_async_worker_evaluates_the_flagged_weights_before_computing_on_them(digits):
    """A reply with flag EVALUATE (number 7): the worker evaluates exactly those weights on its 20 test images,
    sends EVAL (step 7, version 5, top-1, top-5, summed loss, seconds), then pushes the gradient of the
    same weights, unchanged by the evaluation."""
    net, sampler, thread, outcome = start_worker(digits)
    model = build_model("digits")
    p0 = model.init_params(0)
    send(net, Tag.WEIGHTS, p0, version=0, step=0)
    receive(net, Tag.PUSH, model.num_params)
    p5 = p0 + np.float32(0.01)
    flagged = Message(p5.size).stamp(Tag.WEIGHTS, 0, version=5, step=1, flags=Flag.EVALUATE, epoch=7)
    flagged.payload[:] = p5
    net.post(0, 1, Tag.WEIGHTS, flagged.buf)
    result = receive(net, Tag.EVAL, 0)
    push2 = receive(net, Tag.PUSH, model.num_params)
    send(net, Tag.STOP, p5, version=6, step=2)
    final = receive(net, Tag.EVAL, 0)
    thread.join(5)
    assert not thread.is_alive() and "error" not in outcome
    ref = build_model("digits")
    w = p5.copy()
    ref.bind(w, np.zeros_like(w))
    loss_sum, correct, count, correct5 = evaluate(ref, digits, np.arange(20, dtype=np.int64), 256)
    h = result.header
    assert int(h["flags"]) == Flag.EVALUATE and (h["step"], h["version"]) == (7, 5)
    assert (h["samples"], h["correct"], h["correct5"]) == (count, correct, correct5) == (20, correct, correct5)
    assert float(h["loss"]) == pytest.approx(loss_sum, rel=1e-6) and float(h["compute_s"]) > 0
    g2, _ = reference_grad(p5, digits, sampler.indices(0)[B:2 * B])
    np.testing.assert_array_equal(push2.payload, g2)
    assert (push2.header["step"], push2.header["version"]) == (2, 5)
    assert not int(final.header["flags"]) & Flag.EVALUATE and final.header["samples"] == 20


# --- sync and pipeline in threads: every evaluation equals its snapshot evaluated by hand ---------------

def by_hand(digits, params: np.ndarray) -> tuple[float, int, int, int]:
    model = build_model("digits")
    model.bind(params.copy(), np.zeros_like(params))
    return evaluate(model, digits, np.arange(digits.test_y.size, dtype=np.int64), 256)


def check_rows_equal_their_snapshots(digits, rows, snapshots, meta):
    for row in rows:
        loss_sum, correct, count, correct5 = by_hand(digits, snapshots[row["snapshot"]])
        assert row["count"] == count == digits.test_y.size
        assert (row["top1"], row["top5"]) == (correct / count, correct5 / count)
        assert row["loss"] == pytest.approx(loss_sum / count, rel=1e-5)
        assert 0 <= row["top1"] <= row["top5"] <= 1
        assert row["version_min"] == row["version_max"] == meta["version"][row["snapshot"]]


def test_sync_evaluations_equal_their_snapshots_and_reach_tensorboard(tmp_path, digits):
    """2 sync workers, 12 steps, an evaluation every 4 steps (in epochs): rows at steps 4 and 8 (not at the last:
    the final evaluation is that one), each the sum of both workers' slices and equal to evaluating the
    snapshot the first worker sent of the same step; TensorBoard has the same figures at the same images."""
    num_train, nworkers = digits.train_y.size, 2
    every = 4 * B * nworkers / num_train
    cfg = Config(model="digits", mode="sync", batch_size=B, seed=5, epochs=0, max_pushes=12, snapshot_interval=0,
                 progress=False, comm_timeout=COMM_TIMEOUT, eval_interval=f"{every!r}ep", flush_interval=600.0)
    model = build_model("digits")
    net, group = Network(1 + nworkers), Group(nworkers)
    log = RunLog.create(str(tmp_path / "run.h5"), {"config": cfg.to_json()}, [], model.num_params, flush_interval=60)
    server = rank0(net.comm(0), cfg, model.init_params(cfg.seed), model.decay_mask(), nworkers, num_train, log)
    server.rec.tensorboard = TensorBoard(tensorboard_dir(log.path))
    slices = np.array_split(np.arange(digits.test_y.size, dtype=np.int64), nworkers)
    loops = {"rank 0": server.run}
    for w in range(1, nworkers + 1):
        sampler = ShardSampler(num_train, nworkers, w - 1, cfg.seed)
        loops[f"worker rank {w}"] = SyncWorker(WorkerJob(net.comm(w), cfg, build_model("digits"), digits, sampler, w,
                                                         slices[w - 1], comms=group.comm(w - 1))).run
    threads = run_threads(loops)
    server.rec.close_tensorboard()
    log.close("completed", threads[0].result)
    _, t, snapshots = read_log(tmp_path / "run.h5")
    rows = t["periodic_evals"]
    assert rows["version_min"].tolist() == [4, 8] and rows["snapshot"].tolist() == [1, 2]
    assert rows["samples"].tolist() == [4 * B * nworkers, 8 * B * nworkers]
    assert len(snapshots) == 4  # the initial weights, the two evaluated steps, the final weights
    check_rows_equal_their_snapshots(digits, rows, snapshots, t["snapshots/meta"])
    tb = scalars(tensorboard_dir(log.path))
    assert [s for s, _ in tb["eval/top1"]] == rows["samples"].tolist()
    np.testing.assert_allclose([v for _, v in tb["eval/top1"]], rows["top1"], rtol=1e-6)
    np.testing.assert_allclose([v for _, v in tb["eval/top5"]], rows["top5"], rtol=1e-6)
    final = t["evals"][-1]
    assert tb["test/top1"] == [(12 * B * nworkers, pytest.approx(final["accuracy"], rel=1e-6))]
    assert tb["test/top5"][0][1] == pytest.approx(final["top5"], rel=1e-6) and final["top5"] >= final["accuracy"]
    p = t["pushes"]  # the one training point at the end: the mean of every REPORT's loss, the step size used last
    (step, loss), = tb["train/loss"]
    assert step == 12 * B * nworkers and loss == pytest.approx(float(p["loss"].mean()), rel=1e-5)
    assert tb["train/lr"][0][1] == pytest.approx(float(t["updates"]["lr"][-1]), rel=1e-6)


def test_pipeline_rank0_evaluates_the_snapshots_module_0_flags(tmp_path, digits):
    """2 modules, 1 replica, 12 minibatches, an evaluation every 4 (in epochs): module 0 flags the snapshots
    after minibatches 4 and 8 are started, rank 0 evaluates each assembled snapshot on the whole test set."""
    num_train = digits.train_y.size
    cfg = Config(model="digits", mode="pipeline", modules=2, cuts="4", batch_size=B, seed=4, lr=0.05,
                 warmup_epochs=0.0, epochs=0, max_pushes=12, snapshot_interval=0, progress=False,
                 comm_timeout=COMM_TIMEOUT, eval_interval=f"{4 * B / num_train!r}ep")
    model = build_model("digits")
    layout = PIPELINE.layout(cfg, model, 2, num_train)
    net = Network(3)
    log = RunLog.create(str(tmp_path / "run.h5"), {"config": cfg.to_json()}, [], model.num_params, flush_interval=60)
    server = rank0(net.comm(0), cfg, model.init_params(cfg.seed), model.decay_mask(), 2, num_train, log,
                   model=build_model("digits"), dataset=digits, layout=layout)
    units = {}
    pipe, datas = Group(2), [Group(1), Group(1)]
    for w in (1, 2):
        k, n = layout.place[w]
        sampler = ShardSampler(num_train, layout.shards, layout.shard[w], cfg.seed)
        job = WorkerJob(net.comm(w), cfg, build_model("digits"), digits, sampler, w,
                        comms=(pipe.comm(k), datas[k].comm(n)), layout=layout)
        units[f"unit rank {w}"] = PipelineUnit(job).run
    threads = run_threads({"rank 0": server.run, **units})
    log.close("completed", threads[0].result)
    _, t, snapshots = read_log(tmp_path / "run.h5")
    rows = t["periodic_evals"]
    assert len(rows) == 2 and rows["snapshot"].tolist() == [1, 2] and len(snapshots) == 4
    assert (np.diff(rows["samples"]) > 0).all()
    check_rows_equal_their_snapshots(digits, rows, snapshots, t["snapshots/meta"])


# --- TensorBoard ---------------------------------------------------------------------------------------------

def test_tensorboard_scalars_read_back_and_a_resume_purges(tmp_path):
    """Scalars are read back at their steps (a non-finite value is left out); a second writer in the same folder
    (a resumed run) starts with purge_step, which TensorBoard uses to hide the replaced points."""
    logdir = tmp_path / "run.tb"
    tb = TensorBoard(str(logdir))
    tb.scalars({"eval/top1": 0.5, "eval/loss": float("nan")}, 100)
    tb.scalars({"eval/top1": 0.75}, 200)
    tb.close()
    resumed = TensorBoard(str(logdir), purge_step=150)
    resumed.scalars({"eval/top1": 0.7}, 150)
    resumed.close()
    assert scalars(logdir) == {"eval/top1": [(100, 0.5), (200, 0.75), (150, pytest.approx(0.7))]}
    starts = [e.step for e in events(logdir) if e.HasField("session_log")]
    assert starts == [150]


def test_tensorboard_failures_warn_once_and_never_raise(tmp_path):
    """A folder that cannot be made (a file is in the way): one warning, every later call does nothing."""
    (tmp_path / "run.tb").write_text("a file, not a folder")
    warnings = []
    tb = TensorBoard(str(tmp_path / "run.tb" / "inner"), warn=warnings.append)
    tb.scalars({"x": 1.0}, 1)
    tb.flush()
    tb.close()
    assert len(warnings) == 1 and "cannot be written" in warnings[0] and not tb.on


def test_tensorboard_dir_sits_beside_the_log():
    assert tensorboard_dir("runs/c10.h5") == "runs/c10.tb"


# --- logs written before the new columns -------------------------------------------------------------------

def old_dtype(dtype: np.dtype, drop: str) -> np.dtype:
    return np.dtype([(n, dtype[n]) for n in dtype.names if n != drop])


def test_a_log_of_an_older_version_is_read_and_resumed_with_the_new_columns(tmp_path):
    """pushes without data_s and evals without top5 (and no /periodic_evals): `load` gives nan for them; a resume
    (`RunLog.reopen`) rewrites the tables with the columns, keeps the old rows and appends new ones."""
    path = str(tmp_path / "old.h5")
    log = RunLog.create(path, {"config": Config().to_json()}, [], 3, flush_interval=60)
    log.close("completed")
    old_push = np.zeros(2, old_dtype(PUSH_ROW, "data_s"))
    old_push["time"], old_push["loss"] = [1.0, 2.0], [2.5, 2.0]
    old_eval = np.zeros(1, old_dtype(EVAL_ROW, "top5"))
    old_eval["accuracy"], old_eval["snapshot"] = 0.5, -1
    with h5py.File(path, "r+", libver="latest") as f:
        for name, rows in (("pushes", old_push), ("evals", old_eval)):
            del f[name]
            f.create_dataset(name, data=rows, maxshape=(None,), chunks=(1024,))
        del f["periodic_evals"]
    run = load(path)
    assert np.isnan(run["pushes"]["data_s"]).all() and run["pushes"]["loss"].tolist() == [2.5, 2.0]
    assert np.isnan(run["evals"]["top5"]).all() and run["periodic_evals"] is None
    lock = WriterLock(path)
    lock.acquire()
    log = RunLog.reopen(path, [], 60, lock)
    zero = dict.fromkeys(PushRow.dtype.names, 0)
    log.add(PushRow(**{**zero, "time": 3.0, "loss": 1.0, "data_s": 0.25}))
    log.add(EvalRow(time=3.0, version=1, epoch=1.0, snapshot=-1, loss=0.1, accuracy=0.9, count=10, top5=1.0))
    log.close("completed")
    run = load(path)
    assert run["pushes"]["loss"].tolist() == [2.5, 2.0, 1.0]
    assert np.isnan(run["pushes"]["data_s"][:2]).all() and run["pushes"]["data_s"][2] == 0.25
    assert run["evals"]["accuracy"].tolist() == [0.5, 0.9] and run["evals"]["top5"][1] == 1.0
    assert run["periodic_evals"] is not None and len(run["periodic_evals"]) == 0
    assert math.isnan(EvalRow(time=0, version=0, epoch=0, snapshot=0, loss=0, accuracy=0, count=0).top5)
