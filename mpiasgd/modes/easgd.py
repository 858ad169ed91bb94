"""`--mode easgd`: asynchronous elastic averaging SGD (Zhang, Choromanska and LeCun 2015, arXiv
1412.6651, Algorithm 1; with momentum local steps, EAMSGD, Algorithm 2).

Every worker trains its own weights x_i; rank 0 holds the center variable x~. Every `--easgd-tau`
local steps, worker i exchanges with rank 0 (one round trip):

    worker -> rank 0   PUSH    x_i (its weights now; header: the center version it last saw)
    rank 0             delta = alpha (x_i - x~)       with x~ the center now
                       x~ <- x~ + delta,  version <- version + 1
    rank 0 -> worker   WEIGHTS x~ before the update (the center delta was computed with), lr
    worker             delta = alpha (x_i - x~)       the same float32 operations: the same delta
                       x_i <- x_i - delta

so the pull of x~ and its update are one atomic step on rank 0, as in the paper's Algorithm 1,
and both sides move toward each other by the same delta (the elastic force). alpha is
`--easgd-alpha`, by default the paper's rule alpha = beta / p with beta = 0.9 and p the number of
workers. Between exchanges a worker takes momentum SGD steps on its own weights with the step
size rank 0 sent (the schedule at rank 0's count; `optim.LocalSGD`: heavy-ball momentum in
PyTorch's form, where the paper's EAMSGD uses Nesterov's).

Rank 0 logs every exchange as a push (staleness: center updates since the worker's last exchange;
lr: the worker's local step size; the updates table's grad_norm: |delta|), snapshots the center
variable, judges the stopping rule (`--max-pushes` counts exchanges; epochs, the images the workers
trained on), and checkpoints the center: a resumed run restarts every worker from the center with
zero velocity (a worker's own x_i and velocity are not in the checkpoint). Once the run stops, each
worker's next exchange is answered with STOP and the center, which it evaluates on its test slice.
An x_i that is not finite is rejected (not applied; --max-rejects in a row end the run).

Evaluation during training (--eval-interval; `mpiasgd.rank0.evals`): when one is due on rank 0's clock,
the next WEIGHTS reply to every running worker carries flag EVALUATE; the worker evaluates the center
that reply carries (the x~ its exchange used, with rank 0's mean buffers) on its test slice before its
next local steps, sends EVAL (flag EVALUATE) and goes on. Its own x_i is not evaluated.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import checkpoint
from mpiasgd.comms import Flag, Message, Tag, wait
from mpiasgd.modes.base import Mode, WorkerJob, WorkerLoop, initial_buffers, need, round_fits
from mpiasgd.optim import LocalSGD, Schedule, finite_square, fraction_done
from mpiasgd.rank0.role import Role

BETA = 0.9  # the paper's beta = p alpha


def moving_rate(cfg: Any, num_workers: int) -> float:
    """alpha: `--easgd-alpha`, or (0) the paper's rule beta / p, beta = 0.9, p = `num_workers`."""
    return cfg.easgd_alpha or BETA / num_workers


def elastic_difference(x: Any, center: Any, alpha: float) -> Any:
    """delta = alpha (x - center) in float32 (numpy or cupy; both sides of an exchange call this)."""
    return np.float32(alpha) * (x - center)


class EasgdCenter(Role):
    """(rank 0) The center variable x~ (`params`, float32 (P,)) and the exchanges; see the module docstring."""

    checkpoints_here = True
    snapshots_here = True

    def __init__(self, r0: Any, params: np.ndarray, buffers: np.ndarray | None = None) -> None:
        super().__init__(r0, params, buffers)
        self.alpha = moving_rate(self.cfg, len(self.workers))
        self.schedule = Schedule.of(self.cfg)
        self.P = P = params.size
        self.inbox = {w: Message(P + self.buffers.size) for w in self.workers}  # x_i, then its buffers
        self.outbox = {w: Message(P + self.buffers.size) for w in self.workers}

    def handlers(self) -> dict:
        return {Tag.PUSH: self.on_exchange, Tag.EVAL: self.on_eval}

    def buffer_for(self, tag: Tag, source: int) -> Message | None:
        return self.inbox[source] if tag == Tag.PUSH else None

    def begin(self) -> None:
        for w in self.workers:
            self.send(w, Tag.WEIGHTS, self.last_step[w], initial=True)

    def tick(self) -> None:
        self.rec.check_stop()
        if self.periodic.due():  # --eval-interval: the running workers evaluate the center of their next reply
            self.periodic.ask([w for w in self.workers if w not in self.stopped])

    def local_lr(self) -> float:
        """The step size of a worker's next tau local steps: the schedule at the middle of the round ahead."""
        rec = self.rec
        ahead = 0.5 * self.cfg.easgd_tau * self.cfg.batch_size * len(self.workers) / rec.num_train
        epoch = rec.epoch + ahead
        return self.schedule(epoch, fraction_done(rec.rule, epoch, rec.version, rec.train_time()))

    def send(self, w: int, tag: Tag, step: int, initial: bool = False, center: np.ndarray | None = None) -> None:
        """Post the center (or `center`, the one an exchange used) to worker `w`: WEIGHTS or STOP."""
        self.out[w].take(0)
        out = self.outbox[w]
        out.payload[:self.P] = self.params if center is None else center
        if self.buffers.size:  # a worker takes them from its first WEIGHTS only (see AsgdServer)
            out.payload[self.P:] = self.current_buffers()
        flags = Flag.PREEMPT if tag == Tag.STOP and self.r0.preempted else 0
        if initial and self.rec.resumed is not None:
            flags |= Flag.RESUME
        # --eval-interval: the center this reply carries is evaluated (`center`: the one before this update)
        number = (self.periodic.flag(w, self.rec.version - (center is not None))
                  if tag == Tag.WEIGHTS and not initial else 0)
        if number:
            flags |= Flag.EVALUATE
        out.stamp(tag, self.rank, step=step, version=self.rec.version, flags=flags, cursor=self.cursor[w],
                  elapsed=self.rec.train_time(), lr=self.local_lr(), epoch=number)
        self.post(w, out, tag)

    def on_exchange(self, w: int, msg: Message) -> None:
        rec = self.rec
        h = msg.header
        step, base = self.check_push(w, msg)
        self.last_step[w] = step
        self.cursor[w] = int(h["cursor"])
        if int(h["flags"]) & Flag.PREEMPT:
            self.r0.signal_from(f"a signal received by worker rank {w}")
        staleness = rec.version - base
        x = msg.payload[:self.P]
        rejected = not finite_square(x)[0]
        applied = not rejected and not rec.stop_reason
        if applied:  # (not after the stop: the mean the STOPs carry is the final snapshot's)
            self.take_buffers(w, msg.payload[self.P:])
        norm = 0.0
        if applied:
            self.out[w].take(0)
            center = self.outbox[w].payload[:self.P]
            center[:] = self.params                           # the center this exchange uses, sent back
            delta = elastic_difference(x, center, self.alpha)
            self.params += delta                              # x~ <- x~ + alpha (x_i - x~)
            norm = math.sqrt(finite_square(delta)[1])
            rec.version += 1
            rec.samples += int(h["samples"])
            rec.count_staleness(staleness)
            rec.update(version=rec.version, lr=float(h["lr"]), grad_norm=norm)
            rec.training_loss(float(h["loss"]), int(h["correct"]), int(h["samples"]))
            rec.check_stop()
        rec.push(worker=w, step=step, base_version=base, version=rec.version, staleness=staleness, loss=h["loss"],
                 correct=h["correct"], samples=h["samples"], epoch=h["epoch"], compute_s=h["compute_s"],
                 comm_s=h["comm_s"], wait_s=h["wait_s"], applied=applied, lr=h["lr"], rejected=rejected,
                 data_s=h["data_s"])
        if rejected:
            rec.reject(w, step, "weight vector")
        else:
            rec.accept(w)
        if rec.stop_reason:
            self.stopped.add(w)
            self.periodic.withdraw(w)
            self.send(w, Tag.STOP, step)
        elif applied:
            self.send(w, Tag.WEIGHTS, step, center=self.outbox[w].payload[:self.P].copy())
        else:  # rejected: the center as it is (the worker's elastic step then moves it toward it)
            self.send(w, Tag.WEIGHTS, step)

    def state(self, reason: str) -> checkpoint.Checkpoint:
        """The center, each worker's step and data position (velocity zero: the workers hold theirs)."""
        return self.rec.checkpoint(self.params, np.zeros_like(self.params), reason,
                                   {w: (self.last_step[w], self.cursor[w]) for w in self.workers},
                                   self.rec.train_time(), self.current_buffers())


class EasgdWorker(WorkerLoop):
    """(workers) tau local momentum SGD steps on x_i, then an elastic exchange with rank 0; see the module."""

    def train(self) -> None:
        cfg, model, rank, staging = self.cfg, self.model, self.rank, self.staging
        ops = model.ops
        request = self.comm.Irecv(staging.recv_buf, source=0, tag=MPI.ANY_TAG)
        tag, wait_s = self.receive_weights(request, staging, "initial center from rank 0", initial=True)
        x, grads = ops.empty(model.num_params), ops.empty(model.num_params)
        x[...] = staging.params[:self.P]             # x_i starts at the center
        self.buffers_from(staging.params)            # and the buffers at rank 0's
        self.bind(x, grads)
        local = LocalSGD(model, cfg.momentum, cfg.weight_decay, nesterov=cfg.nesterov)
        alpha = moving_rate(cfg, self.comm.Get_size() - 1)
        began = time.perf_counter() - self.elapsed
        comm_s = 0.0
        while tag == Tag.WEIGHTS:
            lr = float(staging.weights.header["lr"])
            if int(staging.weights.header["flags"]) & Flag.EVALUATE:  # --eval-interval: the center received
                self.bind(staging.params, grads)
                self.evaluate_during_training(int(staging.weights.header["epoch"]), self.version, staging.params)
                self.bind(x, grads)
            t0 = time.perf_counter()
            loss = correct = samples = epoch = 0
            for _ in range(cfg.easgd_tau):
                batch_loss, batch_correct, batch_samples, epoch = self.gradient()
                local.step(lr)
                loss += batch_loss * batch_samples
                correct += batch_correct
                samples += batch_samples
                if self.signalled() or (cfg.max_time and time.perf_counter() - began >= cfg.max_time):
                    break  # a signal, --max-time: exchange what this round has; rank 0 then stops the run
            staging.grads[:self.P] = x                # the push carries x_i, then this worker's buffers
            self.buffers_into(staging.grads)
            staging.finish_compute()
            self.straggle(t0)
            t1 = time.perf_counter()
            self.step += 1
            staging.push.stamp(Tag.PUSH, rank, step=self.step, version=self.version, samples=samples, epoch=epoch,
                               correct=correct, loss=loss / samples, compute_s=t1 - t0, comm_s=comm_s,
                               wait_s=wait_s, lr=lr, cursor=self.cursor, data_s=self.take_data_s(),
                               flags=Flag.PREEMPT if self.signalled() else 0)
            staging.before_send()
            request = self.comm.Irecv(staging.recv_buf, source=0, tag=MPI.ANY_TAG)
            sending = self.comm.Isend(staging.send_buf, dest=0, tag=int(Tag.PUSH))
            comm_s = time.perf_counter() - t1
            tag, wait_s = self.receive_weights(request, staging, f"reply to exchange {self.step} (the center) from "
                                               "rank 0")
            wait(sending, f"completion of exchange {self.step}", rank, cfg.worker_timeout)
            if tag == Tag.WEIGHTS:                    # x_i <- x_i - alpha (x_i - x~)
                x -= elastic_difference(x, staging.params[:self.P], alpha)
        if tag == Tag.STOP:
            self.buffers_from(staging.params)        # with rank 0's mean buffers, as the last snapshot
        self.bind(staging.params, grads)             # the final center: what this worker evaluates


class EasgdMode(Mode):
    name = "easgd"
    asynchronous = True
    advice = ("the step size of the local steps is likely too large: lower --lr or lengthen --warmup-epochs "
              "(or exchange more often: a smaller --easgd-tau)")

    def check_config(self, cfg: Any) -> None:
        need(cfg.easgd_tau >= 1, cfg, "easgd_tau", "an integer >= 1 (local steps between exchanges)")
        need(math.isfinite(cfg.easgd_alpha) and 0 <= cfg.easgd_alpha < 1, cfg, "easgd_alpha",
             "0 < alpha < 1, or 0 for the paper's rule 0.9 / workers")

    def layout(self, cfg: Any, model: Any, num_workers: int, num_train: int) -> Any:
        round_fits(cfg, "easgd_tau", cfg.easgd_tau, num_workers, num_train)
        return super().layout(cfg, model, num_workers, num_train)

    def rank0(self, r0: Any, params: np.ndarray, decay_mask: np.ndarray, model: Any, dataset: Any,
              layout: Any) -> EasgdCenter:
        return EasgdCenter(r0, params, initial_buffers(model))

    def worker(self, job: WorkerJob) -> EasgdWorker:
        return EasgdWorker(job)


MODE = EasgdMode()
