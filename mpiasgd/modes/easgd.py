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

Rank 0 counts the bytes of every exchange (the summary's `wire_bytes_pushed`, `wire_bytes_pulled`; always
fp32: `--wire` is async's and ssp's).

`--servers S` (`mpiasgd.comms.shard_cut`): S parameter-server shards, rank 0 and ranks N+1..N+S-1, each an
EasgdCenter on its contiguous slice of the center (shard 0 also carries the layer buffers), with its own
version counter; `EasgdMode.rank0` gives each rank its slice. The elastic update is elementwise, so it shards
exactly: an exchange sends shard s its slice of x_i (PUSH, with the version of shard s's slice the worker last
got); shard s computes delta = alpha (x_i - x~) on its slice, moves its slice of x~ by it, counts a version
and answers with its slice of x~ before the update; the worker assembles the S slices and takes its elastic
step x_i -= alpha (x_i - x~) over the whole vector (`EasgdWorker.train_sharded`, with
`mpiasgd.modes.sharded_worker`). Given the same arrival order, the S shards end with the center of one server, bit
for bit. The step size and flags come from shard 0. The stop, FINISH, evaluation, checkpoints (every slice,
velocity zeros, `shard_versions`; `--resume` keeps S), preemption and a dead or hung shard are as for async
(`mpiasgd.rank0.server`, `mpiasgd.rank0.shard_hub`): only rank 0 decides; the shards agree which exchanges in
flight each applies, so every shard ends at the same version and every worker evaluates the same final
center. Each shard's staleness is counted on its own versions (/shard_pushes). An x_i that is not finite in any
one slice is rejected by every shard: the worker sets flag NONFINITE on all S pushes (`ShardedStaging`), and a
shard rejects a push so flagged as one whose own slice is not finite, so all keep the same exchanges and count
the same rejects. With S = 1 nothing of this runs.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd.comms import Flag, SendSlots, Tag, wait
from mpiasgd.config import Config
from mpiasgd.modes.base import LossTally, Mode, WorkerJob, initial_buffers, need, round_fits
from mpiasgd.modes.sharded_worker import ShardedWorker
from mpiasgd.optim import LocalSGD, fraction_done
from mpiasgd.optim.rules import ElasticRule, elastic_difference
from mpiasgd.rank0.server import ShardedServer, server_shard

BETA = 0.9  # the paper's beta = p alpha


def moving_rate(cfg: Config, num_workers: int) -> float:
    """alpha: `--easgd-alpha`, or (0) the paper's rule beta / p, beta = 0.9, p = `num_workers`."""
    return cfg.easgd_alpha or BETA / num_workers


class EasgdCenter(ShardedServer):
    """(rank 0, or a parameter-server shard) The center variable x~ (`params`, float32 (P,): the whole vector, or
    this shard's slice) and the exchanges; see the module docstring (`ShardedServer`: the replies, the shards).
    `buffers` (float32 (B,)): the layers' initial buffers (shard 0)."""

    def __init__(self, r0: Any, params: np.ndarray, buffers: np.ndarray | None = None) -> None:
        super().__init__(r0, params, buffers)
        self.alpha = moving_rate(self.cfg, len(self.workers))
        self.rule = ElasticRule(self.params, self.alpha)  # x~ <- x~ + alpha (x_i - x~)
        self.pushed_what = "weight vector"
        # worker -> version of the center an applied exchange used, which its send buffer holds (`take_push`):
        # the WEIGHTS answering that exchange carries it (any other reply: the center now)
        self.carried: dict[int, int] = {}

    def begin(self) -> None:
        for w in self.workers:
            self.started.add(w)
            self.send(w, Tag.WEIGHTS, self.last_step[w], initial=True)

    def tick(self) -> None:
        self.rec.check_stop()
        self.agreement.answer_finishing()  # (--servers: STOP to the workers owed one, once the shards agreed)
        if self.periodic.due():  # --eval-interval: the running workers evaluate the center of their next reply
            self.periodic.ask([w for w in self.workers if w not in self.stopped])

    def local_lr(self) -> float:
        """The step size of a worker's next tau local steps: the schedule at the middle of the round ahead."""
        rec = self.rec
        ahead = 0.5 * self.cfg.easgd_tau * self.cfg.batch_size * len(self.workers) / rec.num_train
        epoch = rec.epoch + ahead
        return self.schedule(epoch, fraction_done(rec.rule, epoch, self.counter.version, rec.train_time()))

    def send(self, w: int, tag: Tag, step: int, initial: bool = False) -> None:
        """Post the center (this slice of it) to worker `w`: WEIGHTS or STOP. The WEIGHTS answering an applied
        exchange carries the center that exchange used (`carried`, already in the send buffer); every other
        reply the center now."""
        self.out[w].take(0)
        out = self.outbox[w]
        version = self.carried.pop(w, None)  # the version of the center this reply carries
        if tag != Tag.WEIGHTS or version is None:
            out.payload[:self.P] = self.params
            version = self.counter.version
        if self.buffers.size:  # a worker takes them from its first WEIGHTS only (see AsgdServer)
            out.payload[self.P:] = self.current_buffers()
        flags = Flag.PREEMPT if tag == Tag.STOP and self.r0.stops_on_signal else 0
        if initial and self.rec.resumed is not None:
            flags |= Flag.RESUME
        # --eval-interval: the center this reply carries is evaluated
        number = self.periodic.flag(w, version) if tag == Tag.WEIGHTS and not initial else 0
        if number:
            flags |= Flag.EVALUATE
        self.tell_losses(w)
        out.stamp(tag, self.rank, step=step, version=self.counter.version, flags=flags, cursor=self.cursor[w],
                  elapsed=self.rec.train_time(), lr=self.local_lr(), epoch=number)
        self.post(w, out, tag)
        self.rec.count_wire(pulled=out.buf.nbytes)

    def update_target(self, w: int) -> np.ndarray:
        """The center this exchange uses goes back to worker `w` (copied into its send buffer once its previous
        send completed: `carried`); the center itself is updated in place."""
        self.out[w].take(0)
        self.outbox[w].payload[:self.P] = self.params
        self.carried[w] = self.counter.version
        return self.params

    def unapplied_lr(self, h: np.void) -> float:
        return float(h["lr"])  # (the worker's step size, as an applied exchange's row)


class EasgdWorker(ShardedWorker):
    """(workers) tau local momentum SGD steps on x_i, then an elastic exchange with rank 0 (--servers S > 1: with
    every parameter-server shard, `train_sharded`); see the module docstring."""

    def train(self) -> None:
        if self.cfg.servers > 1:
            self.train_sharded()
            return
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
            loss, correct, samples, epoch = self.local_round(local, lr, began)
            staging.grads[:self.P] = x                # the push carries x_i, then this worker's buffers
            self.buffers_into(staging.grads)
            staging.finish_compute()
            self.straggle(t0)
            t1 = time.perf_counter()
            self.step += 1
            staging.push.stamp(Tag.PUSH, rank, step=self.step, version=self.version, samples=samples, epoch=epoch,
                               correct=correct, loss=loss, compute_s=t1 - t0, comm_s=comm_s,
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

    def local_round(self, local: LocalSGD, lr: float, began: float) -> tuple[float, int, int, int]:
        """The tau local steps of one round on the bound x_i at step size `lr` (fewer on a signal or at --max-time,
        `began` being the training clock's start: the exchange then carries what the round has; rank 0 stops the
        run). Returns (mean loss over the round's samples, correct, samples, epoch of the last minibatch)."""
        cfg = self.cfg
        tally, epoch = LossTally(), 0
        for _ in range(cfg.easgd_tau):
            stats, batch_samples, epoch = self.gradient()
            local.step(lr)
            tally.add(stats, batch_samples)
            if self.signalled() or (cfg.max_time and time.perf_counter() - began >= cfg.max_time):
                break
        loss, correct, samples = tally.totals()
        return loss / samples, correct, samples, epoch

    # --- --servers S > 1: one message per shard each way ---
    def train_sharded(self) -> None:
        """The loop of `train` with S parameter-server shards (`modes.sharded_worker`): each exchange sends every
        shard its slice of x_i (and the version of that shard's center it last got), and x_i takes its elastic
        step once all S slices of the center have arrived: the same float32 operations on the same values as
        with one server, elementwise. `self.staging` is a ShardedStaging; the step size and flags come from
        shard 0 (rank 0). When one shard answers STOP, every shard that answered the same exchange with
        WEIGHTS is sent FINISH and answers with STOP and its final slice (`finish_shards`)."""
        cfg, model, rank = self.cfg, self.model, self.rank
        st = self.staging
        ranks = self.shard_ranks()
        S = len(ranks)
        pushes = SendSlots(list(range(S)), "exchange", rank, cfg.worker_timeout)  # slot s: the push to shard s
        versions = [-1] * S  # the version of each shard's slice of the center last received
        tags, wait_s = self.receive_replies(self.post_replies(ranks), ranks, versions, "initial center",
                                            initial=True)
        x, grads = model.ops.empty(model.num_params), model.ops.empty(model.num_params)
        x[...] = st.params[:self.P]                  # x_i starts at the center
        self.buffers_from(st.params)                 # and the buffers at rank 0's
        self.bind(x, grads)
        local = LocalSGD(model, cfg.momentum, cfg.weight_decay, nesterov=cfg.nesterov)
        alpha = moving_rate(cfg, self.comm.Get_size() - S)
        began = time.perf_counter() - self.elapsed
        comm_s = 0.0
        while Tag.STOP not in tags:
            head = st.weights[0].header  # rank 0's: the step size, the flags
            lr = float(head["lr"])
            if int(head["flags"]) & Flag.EVALUATE:  # --eval-interval: the center received
                self.bind(st.params, grads)
                self.evaluate_during_training(int(head["epoch"]), versions[0], st.params)
                self.bind(x, grads)
            t0 = time.perf_counter()
            loss, correct, samples, epoch = self.local_round(local, lr, began)
            t = time.perf_counter()
            for s in range(S):  # the previous exchange's sends have completed: the push buffers are free
                pushes.take(s)
            comm_s += time.perf_counter() - t
            st.grads[:self.P] = x                    # the pushes carry x_i, then this worker's buffers
            self.buffers_into(st.grads)
            st.finish_compute()  # cupy: device sync point
            self.straggle(t0)
            t1 = time.perf_counter()
            self.step += 1
            flags, data_s = Flag.PREEMPT if self.signalled() else 0, self.take_data_s()
            for s in range(S):
                st.push[s].stamp(Tag.PUSH, rank, step=self.step, version=versions[s], samples=samples, epoch=epoch,
                                 correct=correct, loss=loss, compute_s=t1 - t0, comm_s=comm_s, wait_s=wait_s,
                                 lr=lr, cursor=self.cursor, data_s=data_s, flags=flags)
            st.before_send()  # each slice of x_i into its shard's push; all flagged NONFINITE if x_i is not finite
            receives = self.post_exchange(pushes, ranks)
            comm_s = time.perf_counter() - t1
            tags, wait_s = self.receive_replies(receives, ranks, versions, f"reply to exchange {self.step} (the "
                                                "center)")
            if Tag.STOP not in tags:                 # x_i <- x_i - alpha (x_i - x~), x~ assembled from S slices
                x -= elastic_difference(x, st.params[:self.P], alpha)
        pushes.drain()
        self.finish_shards(tags, ranks, versions)
        self.buffers_from(st.params)                 # with rank 0's mean buffers, as the last snapshot
        self.bind(st.params, grads)                  # the final center: what this worker evaluates


class EasgdMode(Mode):
    name = "easgd"
    asynchronous = True
    elastic = True
    advice = ("the step size of the local steps is likely too large: lower --lr or lengthen --warmup-epochs "
              "(or exchange more often: a smaller --easgd-tau)")

    def check_config(self, cfg: Config) -> None:
        need(cfg.easgd_tau >= 1, cfg, "easgd_tau", "an integer >= 1 (local steps between exchanges)")
        need(math.isfinite(cfg.easgd_alpha) and 0 <= cfg.easgd_alpha < 1, cfg, "easgd_alpha",
             "0 < alpha < 1, or 0 for the paper's rule 0.9 / workers")

    def layout(self, cfg: Config, model: Any, num_workers: int, num_train: int) -> Any:
        round_fits(cfg, "easgd_tau", cfg.easgd_tau, num_workers, num_train)
        return super().layout(cfg, model, num_workers, num_train)

    def rank0(self, r0: Any, params: np.ndarray, decay_mask: np.ndarray, model: Any, dataset: Any,
              layout: Any) -> EasgdCenter:
        """The center variable of rank `r0.rank`: the whole vector, or (--servers S) the shard that rank holds, on
        its slice of `params`, with the layer buffers on shard 0 only (`mpiasgd.comms.shard_cut`)."""
        buffers = initial_buffers(model)
        cut, s = server_shard(r0, params.size, buffers)
        a, b = cut.slice(s)
        center = EasgdCenter(r0, params[a:b], buffers if s == 0 else None)
        center.place(cut, s)
        return center

    def worker(self, job: WorkerJob) -> EasgdWorker:
        return EasgdWorker(job)


MODE = EasgdMode()
