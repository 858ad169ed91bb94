"""Rank 0 of the pipeline mode (see `mpiasgd.modes.pipeline`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mpiasgd import signals
from mpiasgd.comms import Flag, Message, ProtocolError, Tag
from mpiasgd.model import evaluate
from mpiasgd.modes.base import EvaluationAbandoned, initial_buffers
from mpiasgd.modes.sync import Replicas
from mpiasgd.rank0.role import Role


class PipelineMonitor(Role):
    """(server only, pipeline mode) Sends each unit its module's initial weights, logs every REPORT
    (pushes table: one row per unit per iteration, staleness = the module's delay), assembles the
    snapshots replica 0 sends into whole-model snapshots, and at the end evaluates the final
    weights on the test set itself (numpy). Never updates weights.

    `bounds` are the module cuts; `model` (numpy) and `dataset` are used for the final evaluation.
    Checkpoints: replica 0's units send their module's weights and velocity after every drain
    (CHECKPOINT); once all K have arrived for the same drain, rank 0 writes the file. A signal
    (here, or flagged in a unit's REPORT) becomes a STOP with flag PREEMPT to every module 0.

    Evaluation during training (--eval-interval): a unit holds one module only, so rank 0 evaluates the
    whole model itself, numpy, on the whole test set: module 0 of replica 0 judges the interval on the
    replicas' clock (seconds) or the minibatches started (epochs) and flags its next SNAPSHOT EVALUATE;
    once every module's piece of that snapshot has arrived, rank 0 logs the snapshot and evaluates it
    (its row's `snapshot`). Meanwhile rank 0 serves no messages (the units run on; their REPORTs queue);
    that time is not counted as the units' silence (`Rank0.excuse`).

    Layer buffers (running statistics): each module owns its layers' slice of the model's buffer
    vector; the initial WEIGHTS carry it after the weights (rank 0's: initial, or the checkpoint's),
    SNAPSHOT payloads are [weights | buffers] and CHECKPOINT payloads [weights | velocity | buffers]
    of the module, and rank 0 assembles the whole-model `buffers` from them for the snapshots, the
    checkpoints and the final evaluation.
    """

    checkpoints_here = False

    def __init__(self, r0: Any, params: np.ndarray, model: Any, dataset: Any, bounds: list[int]) -> None:
        super().__init__(r0, params, initial_buffers(model))
        self.model, self.dataset, self.bounds = model, dataset, bounds
        self.K = len(bounds) - 1
        self.N = len(self.workers) // self.K
        self.replicas = Replicas()
        self.ranges = [model.param_range(bounds[k], bounds[k + 1]) for k in range(self.K)]
        self.branges = [model.buffer_range(bounds[k], bounds[k + 1]) for k in range(self.K)]
        self.inbox = {w: Message(self.size_of(w) + self.bsize_of(w)) for w in self.workers}
        self.pieces: dict[tuple, set] = {}      # snapshot (segment, iteration) -> modules received
        self.to_evaluate: set[tuple] = set()    # snapshots (segment, iteration) module 0 flagged EVALUATE
        self.ended: set[int] = set()
        self.final: set[int] = set()
        self.ckpt_params, self.ckpt_momentum = np.zeros_like(params), np.zeros_like(params)
        self.ckpt_buffers = self.buffers.copy()
        self.ckpt_pieces: dict[int, dict] = {}  # minibatches done at a drain -> {module: its steps}
        self.ckpt_inboxes: dict[int, Message] = {}
        self.final_checkpoint = False

    def module_of(self, w: int) -> int:
        return (w - 1) % self.K

    def size_of(self, w: int) -> int:
        start, stop = self.ranges[self.module_of(w)]
        return stop - start

    def bsize_of(self, w: int) -> int:
        start, stop = self.branges[self.module_of(w)]
        return stop - start

    def handlers(self) -> dict:
        return {Tag.REPORT: self.on_report, Tag.SNAPSHOT: self.on_snapshot, Tag.CHECKPOINT: self.on_checkpoint}

    def buffer_for(self, tag: Tag, source: int) -> Message:
        if tag == Tag.CHECKPOINT:  # the module's weights, velocity and buffers
            if source not in self.ckpt_inboxes:
                self.ckpt_inboxes[source] = Message(2 * self.size_of(source) + self.bsize_of(source))
            return self.ckpt_inboxes[source]
        return self.inbox[source] if tag == Tag.SNAPSHOT else None

    def begin(self) -> None:
        """Each unit's module slices of the weights and buffers; on a resume flagged RESUME (iterations,
        minibatches and seconds done), followed by the slice of the velocity (CHECKPOINT)."""
        ck = self.rec.resumed
        for w in self.workers:
            start, stop = self.ranges[self.module_of(w)]
            bstart, bstop = self.branges[self.module_of(w)]
            out = Message(stop - start + bstop - bstart)
            out.payload[:stop - start] = self.params[start:stop]
            out.payload[stop - start:] = self.buffers[bstart:bstop]
            if ck is None:
                out.stamp(Tag.WEIGHTS, 0, version=0)
            else:
                out.stamp(Tag.WEIGHTS, 0, version=self.counter.version, step=self.last_step[w], cursor=self.cursor[w],
                          elapsed=ck.elapsed, flags=Flag.RESUME)
                self.send_state(w, ck.momentum[start:stop])
            self.out[w].take(0)
            self.post(w, out, Tag.WEIGHTS)

    def on_preempt(self) -> None:
        """Module 0 of every replica hears of it (STOP, flag PREEMPT) and ends the segment there."""
        self.stop_workers()

    def stop_workers(self) -> None:
        """A STOP to module 0 of every replica (flag PREEMPT on a signal; without it the run ends with the
        final evaluation, as at the stopping rule)."""
        for w in self.workers:
            if self.module_of(w) == 0:
                self.send_stop(w)

    def on_checkpoint(self, w: int, msg: Message) -> None:
        if w > self.K:
            raise ProtocolError(f"rank 0: CHECKPOINT from unit rank {w}; only replica 0 (ranks 1..{self.K}) "
                                f"sends them")
        h, k = msg.header, self.module_of(w)
        start, stop = self.ranges[k]
        bstart, bstop = self.branges[k]
        P = stop - start
        total = int(h["version"])
        self.ckpt_params[start:stop] = msg.payload[:P]
        self.ckpt_momentum[start:stop] = msg.payload[P:2 * P]
        self.ckpt_buffers[bstart:bstop] = msg.payload[2 * P:]
        got = self.ckpt_pieces.setdefault(total, {})
        got[k] = int(h["step"])
        if len(got) < self.K:
            return
        del self.ckpt_pieces[total]
        flags = int(h["flags"])
        reason = "preempt" if flags & Flag.PREEMPT else "end" if flags & Flag.FINAL else "interval"
        steps = {u: (got[self.module_of(u)], total) for u in self.workers}
        ckpt = self.rec.checkpoint(self.ckpt_params, self.ckpt_momentum, reason, steps, float(h["elapsed"]),
                                   self.ckpt_buffers)
        ckpt.version, ckpt.samples = total, total * self.cfg.batch_size * self.N
        self.rec.write_checkpoint(ckpt)
        self.final_checkpoint = bool(flags & Flag.FINAL)

    def done(self) -> bool:
        return len(self.ended) == len(self.workers) and len(self.final) == self.K and self.final_checkpoint

    def waiting_for(self) -> list[int]:
        return [w for w in self.workers if w not in self.ended]

    def on_report(self, w: int, msg: Message) -> None:
        rec = self.rec
        h = msg.header
        t, version, flags = int(h["step"]), int(h["version"]), int(h["flags"])
        if w in self.ended:
            raise ProtocolError(f"rank 0: REPORT iteration {t} from unit rank {w} after its last iteration")
        if t != self.last_step[w]:
            raise ProtocolError(f"rank 0: REPORT from unit rank {w} has iteration {t}, expected "
                                f"{self.last_step[w]} (duplicate or out-of-order report)")
        self.last_step[w] = t + 1
        applied = not flags & Flag.WARMUP
        k = self.module_of(w)
        if applied and k == self.K - 1 and w <= self.K:  # the last module of replica 0: one minibatch done
            done = int(h["epoch"]) + 1  # minibatches of replica 0 done: the version
            self.counter.set(done, done * self.cfg.batch_size * self.N)
            rec.update(version=done, lr=float(h["lr"]))
            rec.training_loss(float(h["loss"]), int(h["correct"]), int(h["samples"]))
        nonfinite = bool(flags & Flag.NONFINITE)
        staleness = t - version if applied or nonfinite else 0
        if applied:
            rec.count_staleness(staleness)
        rec.push(worker=w, step=t, base_version=version, version=t, staleness=staleness, loss=h["loss"],
                 correct=h["correct"], samples=h["samples"], epoch=h["epoch"], compute_s=h["compute_s"],
                 comm_s=h["comm_s"], wait_s=h["wait_s"], applied=applied, lr=h["lr"], rejected=nonfinite,
                 digest=h["digest"], data_s=h["data_s"])
        self.replicas.check(k, t, w, int(h["digest"]), self.N)
        if nonfinite:  # the module's replicas skipped this update together
            rec.event("skip", f"iteration {t}: module {k} (unit rank {w}) got a non-finite gradient for minibatch "
                              f"{int(h['epoch'])}; update skipped")
            rec.reject(w, t)
        elif applied:
            rec.accept(w)
        if flags & Flag.PREEMPT:
            self.r0.signal_from(f"a signal received by unit rank {w} (module {k})" if k and not flags & Flag.END
                                else "a signal reached the pipeline (module 0 ends the run)")
        if flags & Flag.LAST:
            rec.stop(f"the stopping rule after {int(h['step']) + 1} minibatches per replica")
        if flags & Flag.END:
            self.ended.add(w)
            if k == 0:
                self.send_stop(w)

    def on_snapshot(self, w: int, msg: Message) -> None:
        if w > self.K:
            raise ProtocolError(f"rank 0: SNAPSHOT from unit rank {w}; only replica 0 (ranks 1..{self.K}) sends them")
        k = self.module_of(w)
        start, stop = self.ranges[k]
        bstart, bstop = self.branges[k]
        self.params[start:stop] = msg.payload[:stop - start]
        self.buffers[bstart:bstop] = msg.payload[stop - start:]
        if int(msg.header["flags"]) & Flag.FINAL:
            self.final.add(k)
            return
        key = (int(msg.header["cursor"]), int(msg.header["step"]))  # (segment, iteration in it)
        if int(msg.header["flags"]) & Flag.EVALUATE:
            self.to_evaluate.add(key)
        got = self.pieces.setdefault(key, set())
        got.add(k)
        if len(got) == self.K:  # every module's weights after the same iteration: a whole-model snapshot
            del self.pieces[key]
            index = self.rec.snapshot(self.params, self.buffers)
            if key in self.to_evaluate:
                self.to_evaluate.discard(key)
                self.evaluate_snapshot(index)

    def evaluate_snapshot(self, index: int) -> None:
        """--eval-interval: evaluate the whole-model snapshot just assembled (log index `index`) on every test
        image, here (numpy), and log it as an evaluation during training; a signal abandons it (an event
        says so), the loop then preempts."""
        t0 = time.perf_counter()
        taken = self.rec.now()

        def interrupted() -> None:
            if signals.received():
                raise EvaluationAbandoned

        try:
            result = self.evaluate_whole(self.params, self.buffers, interrupted)
        except EvaluationAbandoned:
            result = None
        seconds = time.perf_counter() - t0
        self.r0.excuse(seconds)  # the units were not silent: rank 0 did not listen
        rec = self.rec
        if result is None:
            rec.event("evaluation", f"the evaluation of snapshot {index} during training not logged: rank 0 "
                                    f"abandoned it ({signals.received()} received)")
            return
        version = self.counter.version
        rec.periodic_eval(taken=taken, samples=float(self.counter.samples), versions=(version, version),
                          loss_sum=result.loss_sum, correct=result.correct, correct5=result.correct5,
                          count=result.count, seconds=seconds, snapshot=index)

    def evaluate_whole(self, params: np.ndarray, buffers: np.ndarray, on_batch: Any = None) -> Any:
        """`evaluate` (an `Evaluation`) of the whole model with copies of `params` and `buffers`, on every
        test image (`on_batch()` after each batch)."""
        weights = params.copy()
        self.model.bind(weights, np.zeros_like(weights), buffers.copy())
        idx = np.arange(self.dataset.test_y.size, dtype=np.int64)
        return evaluate(self.model, self.dataset, idx, self.cfg.eval_batch_size, on_batch)

    def final_evals(self, preempted: str) -> dict:
        """Evaluate the final weights with the final buffers on the whole test set here (numpy; not when
        preempted)."""
        if preempted:
            return {}
        return {1: self.evaluate_whole(self.params, self.buffers)}
