"""A pipeline unit: module k of replica n (see `mpiasgd.modes.pipeline`).

The backward of minibatch m at module k (delay d = its gradient's age in iterations) needs the layer
caches of m's forward, which d later forwards have overwritten. --pipeline-activations says how they
come back:

    recompute (default)  the module keeps m's input and re-runs its forward just before the backward:
                         the backward runs at the weights of that moment (the current ones, or with
                         --weight-stashing the ones m's forward used), activations included. Memory:
                         d + 1 module inputs; cost: one more forward per minibatch. The re-run draws
                         m's dropout masks again (ctx.minibatch = m) and does not update the running
                         statistics a second time (ctx.update_buffers False).
    store                the module keeps every layer's caches of m's forward (`Layer.save_cache`) and
                         back-propagates through those activations (FDG's semantics: PyTorch keeps the
                         forward's graph), with the current weights for dgrad (with --weight-stashing
                         the forward's: PipeDream's). Memory: d + 1 copies of everything the module's
                         layers cache (about every activation inside the module, several times its
                         input); no extra forward.

Either way a minibatch updates the module's running statistics once, in its first forward.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd.comms import (
    Flag,
    Interval,
    Message,
    ProtocolError,
    SendSlots,
    Tag,
    check,
    check_size,
    wait,
    weights_digest,
)
from mpiasgd.data import MinibatchStream
from mpiasgd.modes.base import WorkerJob, WorkerLoop
from mpiasgd.modes.pipeline.partition import Module
from mpiasgd.optim import (
    EvalSchedule,
    LocalSGD,
    Schedule,
    StopRule,
    finite_square,
    fraction_done,
    lookahead_factor,
    snapshot_seconds,
)


class Segment:
    """The state of one segment of a unit: from minibatch `base` to the drain."""

    def __init__(self, unit: PipelineUnit, base: int) -> None:
        k, K = unit.k, unit.K
        self.base = base
        self.ctrl = np.zeros(3, dtype=np.float64)  # [elapsed seconds, preempt, halt], max over the module's replicas
        model = unit.job.model  # --snapshot-interval -1 (auto): by the size of the whole model's weights
        self.snapshots = Interval(snapshot_seconds(unit.cfg.snapshot_interval, model.num_params + model.num_buffers),
                                  0.0)
        self.snapshot_at = -1          # the iteration after which replica 0 sends a snapshot
        self.evaluate_at = -1          # (module 0) that snapshot's weights are evaluated (--eval-interval)
        self.total: int | None = None  # minibatches done at the segment's end, once module 0 decided
        self.ending = 0                # Flag bits of the end: LAST (a drain), FINAL (the run ends), PREEMPT
        # (minibatch, input or None, stashed weights or None, layer caches or None), at most delay + 1
        self.stored: deque = deque()
        self.act_req = (unit.pipe.Irecv(unit.acts_in[base % 2].buf, source=k - 1, tag=int(Tag.ACTIVATION))
                        if k > 0 else None)
        self.grad_req = (unit.pipe.Irecv(unit.grads_in[base % 2].buf, source=k + 1, tag=int(Tag.GRADIENT))
                         if k < K - 1 else None)

    def running(self, m: int) -> bool:
        """Minibatch m belongs to this segment (started, and not past its end once that is known)."""
        return m >= self.base and (self.total is None or m < self.total)


@dataclass
class Iteration:
    """What one iteration of a unit reports: REPORT flags, loss and correct count (last module), the
    input gradient `dx` to send back, the step size, and seconds in communication and waits."""

    flags: int = 0
    wait_s: float = 0.0
    comm_s: float = 0.0
    loss: float = 0.0
    correct: int = 0
    lr: float = 0.0
    dx: Any = None


class PipelineUnit(WorkerLoop):
    """(workers, pipeline mode) Module k of replica n; see `mpiasgd.modes.pipeline`.

    `job.comms` is (pipe, data): the replica's pipeline communicator (rank k) and the module's data
    communicator (rank n); `job.comm` reaches rank 0; `job.sampler` is the replica's shard; the module
    bounds are `job.layout.attrs["module_bounds"]`.
    """

    def __init__(self, job: WorkerJob) -> None:
        super().__init__(job)
        cfg = self.cfg
        self.pipe, self.data = job.comms
        self.k, self.K = self.pipe.Get_rank(), self.pipe.Get_size()
        self.n, self.N = self.data.Get_rank(), self.data.Get_size()
        bounds = job.layout.attrs["module_bounds"]
        self.module = Module(job.model, bounds[self.k], bounds[self.k + 1])
        self.ops = job.model.ops
        self.full = cfg.decoupling == "full"
        self.delay = (2 if self.full else 1) * (self.K - 1 - self.k)
        self.schedule, self.rule = Schedule.of(cfg, self.N), StopRule.of(cfg)

    def forward_minibatch(self, t: int) -> int:
        """The minibatch (counted from the segment's first) whose forward this unit runs at iteration t."""
        return t - self.k if self.full else t

    def receive(self, request: Any, msg: Message, tag: Tag, source: int, m: int, what: str) -> float:
        """Wait for an ACTIVATION/GRADIENT of minibatch `m`; checks; returns seconds waited."""
        status = MPI.Status()
        waited = wait(request, what, self.rank, self.cfg.worker_timeout, status)
        check_size(tag, source, self.rank, status.Get_count(MPI.BYTE), msg.count)
        check(msg, tag, status.Get_source(), self.rank)
        if int(msg.header["step"]) != m:
            raise ProtocolError(f"rank {self.rank}: {tag.name} for minibatch {int(msg.header['step'])} from "
                                f"module {source}, expected minibatch {m}")
        return waited

    def run(self) -> bool:
        """Train in segments until the run stops; returns True if a signal ended it (preempted). Rank 0
        evaluates the final weights (the units send no EVAL).

        A segment ends with a drain: module 0 stops starting minibatches, every started one is
        back-propagated through every module, and replica 0 sends rank 0 each module's weights and
        velocity (CHECKPOINT). The state after a drain is complete (no minibatch in flight), so a run
        resumed from it continues exactly as the uninterrupted run did after the same drain.
        Segments end at the stopping rule, on a signal, and every --checkpoint-interval seconds.
        """
        cfg, ops, module, k, rank = self.cfg, self.ops, self.module, self.k, self.rank
        B, T = cfg.batch_size, cfg.worker_timeout
        self.in_count = B * int(np.prod(module.in_shape))
        self.out_count = B * int(np.prod(module.out_shape))
        # initial weights and buffers: this module's slices, from rank 0 (a resumed run: then the velocity)
        P, Bn = module.size, module.bsize
        start = Message(P + Bn)
        status = MPI.Status()
        wait(self.comm.Irecv(start.buf, source=0, tag=int(Tag.WEIGHTS)), "initial weights from rank 0", rank, T,
             status)
        check_size(Tag.WEIGHTS, 0, rank, status.Get_count(MPI.BYTE), start.count)
        check(start, Tag.WEIGHTS, 0, rank)
        module.params[...] = ops.asarray(start.payload[:P])
        if Bn:
            module.buffers[...] = ops.asarray(start.payload[P:])
        self.store = cfg.pipeline_activations == "store"
        self.model.train()
        self.reduce_buf = np.empty(P + Bn, np.float32) if self.N > 1 else None  # the replicas' allreduce
        self.local = LocalSGD(module.model, cfg.momentum, cfg.weight_decay, module.start, module.stop,
                              nesterov=cfg.nesterov)
        h = start.header
        base, t_base, elapsed = 0, 0, 0.0  # minibatches and iterations done, seconds trained
        if int(h["flags"]) & Flag.RESUME:
            base, t_base, elapsed = int(h["cursor"]), int(h["step"]), float(h["elapsed"])
            self.local.velocity[...] = ops.asarray(self.receive_state(module.size).payload)
        first, last = k == 0, k == self.K - 1
        self.acts_in = [Message(self.in_count), Message(self.in_count)] if not first else None
        self.grads_in = [Message(self.out_count), Message(self.out_count)] if not last else None
        self.acts_out = SendSlots([Message(self.out_count) for _ in range(2 * (not last))], "activation", rank, T)
        self.grads_out = SendSlots([Message(self.in_count) for _ in range(2 * (not first))], "gradient", rank, T)
        self.reports = SendSlots([Message(0), Message(0)], "REPORT", rank, T)
        self.snaps = SendSlots([Message(P + Bn)] if self.n == 0 else [], "SNAPSHOT", rank, T)
        self.ckpts = SendSlots([Message(2 * P + Bn)] if self.n == 0 else [], "CHECKPOINT", rank, T)
        # module 0 hears of a signal on rank 0 (or on another unit) by a STOP; the last STOP ends the run
        self.stop = Message(0) if first else None
        self.stop_req = self.comm.Irecv(self.stop.buf, source=0, tag=int(Tag.STOP)) if first else None
        # module 0 draws the images (stream 1 + n: the replica's); the last module only the labels
        self.stream = MinibatchStream(self.dataset, self.job.sampler, B, cfg.seed, 1 + self.n, base,
                                      prefetch=cfg.prefetch if k == 0 else 0)
        self.labels = (MinibatchStream(self.dataset, self.job.sampler, B, cfg.seed, 1 + self.n, base)
                       if module.is_last and k > 0 else self.stream)
        self.began = time.perf_counter() - elapsed
        self.checkpoints = Interval(cfg.checkpoint_interval, elapsed)
        # (module 0 of replica 0) --eval-interval: on the replicas' clock and the minibatches started
        self.evals = EvalSchedule.of(cfg, elapsed, base * B * self.N / self.num_train)
        final = False
        while not final:
            base, t_base, final = self.segment(base, t_base)
        self.stream.close()  # module 0's prefetch thread
        for slots in (self.acts_out, self.grads_out, self.reports, self.snaps, self.ckpts):
            slots.drain()
        if k == 0:
            wait(self.stop_req, "STOP from rank 0 after the last iteration", rank, T)
        return self.preempted

    def segment(self, base: int, t_base: int) -> tuple[int, int, bool]:
        """Iterations from minibatch `base` (the first of the segment) until the drain; the unit's
        iterations so far are `t_base`. Returns (minibatches done, iterations done, the run ended).

        Iteration t: the control allreduce (one clock for the replicas), the forward of the newest
        minibatch m_f (`forward`), the backward of the one `delay` older, m_b (`backward`), the update
        with its gradient averaged over the replicas (`update`), the REPORT, and replica 0's snapshot."""
        seg = Segment(self, base)
        t = 0
        while True:
            t0 = time.perf_counter()
            signal, wait_s = self.control(seg, t0)
            m_f = base + self.forward_minibatch(t)
            m_b = m_f - self.delay
            it = Iteration(flags=Flag.PREEMPT if signal else 0, wait_s=wait_s)
            forwarded = seg.running(m_f)
            if forwarded:
                self.forward(seg, it, t, m_f)
            applied = seg.running(m_b)
            if applied:
                self.backward(seg, it, m_b)
            else:
                it.flags |= Flag.WARMUP
            self.average(it, applied, forwarded)  # every replica of the module takes the same branches
            if applied:
                self.update(seg, it, m_b)
            if self.slowdown > 1:  # --straggler: emulate a unit `slowdown` times slower than this one
                time.sleep((self.slowdown - 1) * (time.perf_counter() - t0 - it.wait_s - it.comm_s))
            drained = seg.total is not None and m_b == seg.total - 1
            finished = drained and bool(seg.ending & Flag.FINAL)
            if finished:
                it.flags |= Flag.END | (seg.ending & Flag.PREEMPT)
                self.preempted = bool(seg.ending & Flag.PREEMPT)
            self.report(t_base + t, m_f, m_b if applied else -1, it.flags, it.loss, it.correct, applied,
                        time.perf_counter() - t0 - it.wait_s - it.comm_s, it.comm_s, it.wait_s, it.lr)
            if self.n == 0 and (t == seg.snapshot_at or finished):
                self.send_snapshot(t, base, m_b + 1, finished, evaluate=t == seg.evaluate_at and not finished)
            if drained:
                if self.n == 0:
                    self.send_checkpoint(t_base + t + 1, seg.total, seg.ending, seg.ctrl[0])
                return seg.total, t_base + t + 1, finished
            t += 1

    def control(self, seg: Segment, t0: float) -> tuple[bool, float]:
        """The control allreduce of an iteration: seg.ctrl = [elapsed seconds, preempt, halt], max over the
        module's replicas. A STOP from rank 0 is a signal there (flag PREEMPT) or --on-divergence stop
        (halt: the run ends as at the stopping rule, with the final evaluation). Returns (this unit's own
        signal, seconds waited)."""
        stopped = self.stop_arrived(self.stop_req, self.stop)
        halt = stopped and not int(self.stop.header["flags"]) & Flag.PREEMPT
        signal = self.signalled() or (stopped and not halt)
        seg.ctrl[:] = t0 - self.began, float(signal), float(halt)
        if self.N == 1:
            return signal, 0.0
        request = self.data.Iallreduce(MPI.IN_PLACE, seg.ctrl, op=MPI.MAX)
        return signal, wait(request, "completion of the control allreduce", self.rank, self.cfg.worker_timeout)

    def forward(self, seg: Segment, it: Iteration, t: int, m_f: int) -> None:
        """The forward of minibatch m_f: module 0 reads it (and decides where the segment ends), a later
        module takes the activation module k-1 sent; the output goes on to module k+1 (the input kept
        for the backward), or the last module computes the loss and its backward at once."""
        ops, module, k = self.ops, self.module, self.k
        module.model.ctx.minibatch = m_f  # dropout's key; the backward's recomputed forward uses it again
        y = None
        if k == 0:
            x, y, _ = self.stream.next()  # minibatch m_f: the stream's cursor is m_f
            x = ops.asarray(x)
            self.decide_end(seg, it, t, m_f)
        else:
            x = self.take_activation(seg, it, m_f)
        predicted = self.predicted(seg, m_f) if self.cfg.weight_prediction and self.delay else None
        if predicted is not None:  # --weight-prediction: the forward (and its backward) on the predicted weights
            module.bind(predicted)
        h = module.forward(x)
        if predicted is not None:
            module.bind(module.params)
        if module.is_last:  # loss and backward at once: delay 0
            y = self.dataset.train_y[self.labels.next_indices()[1]] if k > 0 else y
            it.loss, it.correct, it.dx = module.loss_backward(h, ops.asarray(y, y.dtype))
            return
        out = self.acts_out.take(m_f)
        out.payload[:] = ops.to_numpy(h).ravel()
        out.stamp(Tag.ACTIVATION, k, step=m_f, version=seg.snapshot_at,
                  flags=(seg.ending | Flag.LAST) if seg.total == m_f + 1 else 0)
        t1 = time.perf_counter()
        self.acts_out.send(self.pipe, m_f, k + 1, int(Tag.ACTIVATION))
        it.comm_s += time.perf_counter() - t1
        stashed = predicted if predicted is not None else ops.zeros(module.size) if self.cfg.weight_stashing else None
        if stashed is not None and predicted is None:
            stashed[...] = module.params
        if self.store:  # the layer caches of this forward (they hold what the backward needs of x)
            seg.stored.append((m_f, None, stashed, module.save_cache()))
        else:
            seg.stored.append((m_f, x, stashed, None))

    def predicted(self, seg: Segment, m: int) -> Any:
        """(--weight-prediction) The weights minibatch m's gradient will most likely be applied to, after the
        module's `delay` more updates by the momentum alone (SpecTrain, Chen et al. 2018: w - lr * lr_mult *
        c * v, c = `optim.lookahead_factor`, lr the schedule's at m): a new float32 (P,) array on the
        module's backend, kept with m's activations until its backward."""
        local, ops = self.local, self.ops
        out = ops.zeros(self.module.size)
        out[...] = local.velocity
        if local.lr_scale is not None:
            out *= local.lr_scale
        out *= np.float32(-self.lr_at(seg, m) * lookahead_factor(local.momentum, self.delay, local.nesterov))
        out += self.module.params
        return out

    def lr_at(self, seg: Segment, m: int) -> float:
        """The schedule's step size for the update with minibatch m's gradient."""
        done = m * self.cfg.batch_size * self.N / self.num_train
        return self.schedule(done, fraction_done(self.rule, done, m, seg.ctrl[0]))

    def decide_end(self, seg: Segment, it: Iteration, t: int, m_f: int) -> None:
        """(module 0) Whether the segment ends with minibatch m_f, on the replicas' clock: a signal (FINAL,
        PREEMPT), a halt or the stopping rule (FINAL), or the checkpoint interval (LAST: a drain); and
        (replica 0) the iteration after which every module sends a snapshot."""
        ctrl, K = seg.ctrl, self.K
        if seg.total is None:
            B = self.cfg.batch_size
            if ctrl[1]:
                seg.ending = Flag.FINAL | Flag.PREEMPT
            elif ctrl[2] or self.rule.reason((m_f + 1) * B * self.N, self.num_train, m_f + 1, ctrl[0]):
                seg.ending = Flag.FINAL
            elif self.checkpoints.due(ctrl[0]):
                seg.ending = Flag.LAST
            if seg.ending:
                seg.total = m_f + 1
                self.checkpoints.restart(ctrl[0])
                if seg.ending & Flag.FINAL:  # rank 0 logs the stop now (and why); the drain follows
                    it.flags |= Flag.LAST | (seg.ending & Flag.PREEMPT)
        if self.n == 0 and seg.snapshot_at < t and seg.total is None:
            snapshot = seg.snapshots.due(ctrl[0])
            # --eval-interval: rank 0 evaluates the snapshot it assembles (module 0's SNAPSHOT says so)
            evaluate = self.evals.due(ctrl[0], (m_f + 1) * self.cfg.batch_size * self.N / self.num_train)
            if snapshot or evaluate:
                # every module has heard of it by then (full: module k at t + k; backward: at t)
                seg.snapshot_at = t + (K - 1 if self.full else 0)
                seg.evaluate_at = seg.snapshot_at if evaluate else -1

    def take_activation(self, seg: Segment, it: Iteration, m_f: int) -> Any:
        """(module k > 0) The activation of minibatch m_f from module k-1 (a copy: the buffer is reused);
        its flags say whether the segment ends there and how."""
        k = self.k
        msg = self.acts_in[m_f % 2]
        it.wait_s += self.receive(seg.act_req, msg, Tag.ACTIVATION, k - 1, m_f,
                                  f"activation of minibatch {m_f} from module {k - 1}")
        if int(msg.header["flags"]) & Flag.LAST:  # the segment's last minibatch; how it ends
            seg.total = m_f + 1
            seg.ending = int(msg.header["flags"]) & (Flag.LAST | Flag.FINAL | Flag.PREEMPT)
        seg.snapshot_at = max(seg.snapshot_at, int(msg.header["version"]))
        x = self.ops.asarray(np.array(msg.payload.reshape(self.cfg.batch_size, *self.module.in_shape)))
        seg.act_req = None
        if seg.total is None:  # the next activation lands in the other buffer
            seg.act_req = self.pipe.Irecv(self.acts_in[(m_f + 1) % 2].buf, source=k - 1, tag=int(Tag.ACTIVATION))
        return x

    def backward(self, seg: Segment, it: Iteration, m_b: int) -> None:
        """The backward of minibatch m_b with the gradient module k+1 sent back (the last module did it in
        `forward`), then the input gradient to module k-1, shrunk by beta. The layer caches of m_b come
        back by a recomputed forward (its running statistics left alone) or from the stored ones
        (--pipeline-activations; see the module docstring)."""
        ops, module, k = self.ops, self.module, self.k
        if not module.is_last:
            msg = self.grads_in[m_b % 2]
            it.wait_s += self.receive(seg.grad_req, msg, Tag.GRADIENT, k + 1, m_b,
                                      f"gradient of minibatch {m_b} from module {k + 1}")
            dy = ops.asarray(msg.payload.reshape(self.cfg.batch_size, *module.out_shape))
            m, x, stashed, cache = seg.stored.popleft()
            if m != m_b:
                raise ProtocolError(f"rank {self.rank}: stored input of minibatch {m}, backward of {m_b}")
            if stashed is not None:
                module.bind(stashed)
            if cache is not None:
                module.load_cache(cache)
            else:
                self.recompute(x, m_b)
            it.dx = module.backward(dy)
            if stashed is not None:
                module.bind(module.params)
            seg.grad_req = None
            if seg.total is None or m_b + 1 < seg.total:
                seg.grad_req = self.pipe.Irecv(self.grads_in[(m_b + 1) % 2].buf, source=k + 1,
                                               tag=int(Tag.GRADIENT))
        if k > 0:
            out = self.grads_out.take(m_b)
            out.payload[:] = ops.to_numpy(it.dx).ravel()
            if self.cfg.shrink != 1.0:
                out.payload *= np.float32(self.cfg.shrink)
            out.stamp(Tag.GRADIENT, k, step=m_b)
            t1 = time.perf_counter()
            self.grads_out.send(self.pipe, m_b, k - 1, int(Tag.GRADIENT))
            it.comm_s += time.perf_counter() - t1

    def recompute(self, x: Any, m: int) -> None:
        """Re-run the module's forward on minibatch m's stored input `x` to rebuild the layer caches: the same
        dropout masks (ctx.minibatch = m), the running statistics not updated again (its first forward did)."""
        ctx = self.module.model.ctx
        ctx.minibatch, ctx.update_buffers = m, False
        try:
            self.module.forward(x)
        finally:
            ctx.update_buffers = True

    def average(self, it: Iteration, grads: bool, buffers: bool) -> None:
        """(N > 1) The mean over the module's replicas, in one allreduce, of its gradient (`grads`: a
        backward ran) and of its layers' buffers (`buffers`: a forward updated them), each divided by N
        alike: every replica then holds the same gradient and the same running statistics."""
        module, ops = self.module, self.ops
        P = module.size if grads else 0
        Bn = module.bsize if buffers else 0
        if self.N == 1 or not P + Bn:
            return
        host = self.reduce_buf[:P + Bn]  # [gradient | buffers]
        if P:
            host[:P] = ops.to_numpy(module.grads)
        if Bn:
            host[P:] = ops.to_numpy(module.buffers)
        what = "gradient" if not Bn else "buffers" if not P else "gradient and buffers"
        request = self.data.Iallreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        it.wait_s += wait(request, f"completion of the {what} allreduce", self.rank, self.cfg.worker_timeout)
        host *= np.float32(1.0 / self.N)
        if P:
            module.grads[...] = ops.asarray(host[:P])
        if Bn:
            module.buffers[...] = ops.asarray(host[P:])

    def update(self, seg: Segment, it: Iteration, m_b: int) -> None:
        """Step with the module gradient (averaged over the replicas by `average`), or skip a non-finite one
        (every replica alike: the check follows the allreduce; rank 0 counts it, --max-rejects)."""
        module = self.module
        if finite_square(module.grads)[0]:
            it.lr = self.lr_at(seg, m_b)
            self.local.step(it.lr, module.params, module.grads)
        else:
            it.flags |= Flag.NONFINITE | Flag.WARMUP

    def send_snapshot(self, t: int, base: int, version: int, final: bool, evaluate: bool = False) -> None:
        """(replica 0) This module's weights after iteration t of the segment starting at minibatch `base`:
        (cursor, step) = (base, t) are the same for every module, so rank 0 assembles a whole model.
        `evaluate` (module 0, --eval-interval): flag EVALUATE, rank 0 evaluates the assembled snapshot."""
        snap = self.snaps.take(0)
        P = self.module.size
        snap.payload[:P] = self.ops.to_numpy(self.module.params)
        snap.payload[P:] = self.ops.to_numpy(self.module.buffers)
        snap.stamp(Tag.SNAPSHOT, self.rank, step=t, cursor=base, version=version,
                   flags=Flag.FINAL if final else Flag.EVALUATE if evaluate else 0)
        self.snaps.send(self.comm, 0, 0, int(Tag.SNAPSHOT))

    def send_checkpoint(self, steps: int, total: int, ending: int, elapsed: float) -> None:
        """(replica 0, after a drain) This module's weights, velocity and buffers to rank 0, which writes the
        checkpoint once every module's has arrived: `steps` iterations and `total` minibatches done."""
        P = self.module.size
        ckpt = self.ckpts.take(0)
        ckpt.payload[:P] = self.ops.to_numpy(self.module.params)
        ckpt.payload[P:2 * P] = self.ops.to_numpy(self.local.velocity)
        ckpt.payload[2 * P:] = self.ops.to_numpy(self.module.buffers)
        ckpt.stamp(Tag.CHECKPOINT, self.rank, step=steps, version=total, cursor=total, elapsed=elapsed,
                   flags=ending & (Flag.FINAL | Flag.PREEMPT))
        self.ckpts.send(self.comm, 0, 0, int(Tag.CHECKPOINT))

    def report(self, t: int, m_f: int, m_b: int, flags: int, loss: float, correct: int,
               applied: bool, compute_s: float, comm_s: float, wait_s: float, lr: float) -> None:
        """REPORT of iteration t to rank 0: version = the iteration whose forward the applied gradient used;
        digest = `weights_digest` of the module's weights and buffers (N > 1: rank 0 checks that the replicas agree)."""
        report = self.reports.take(t)
        # samples: counted once per minibatch, by the last module (the pushes table sums them)
        samples = self.cfg.batch_size if applied and self.module.is_last else 0
        module = self.module
        digest = weights_digest(module.params, module.buffers) if self.N > 1 else 0
        report.stamp(Tag.REPORT, self.rank, step=t, version=t - self.delay if m_b >= 0 else -1, epoch=m_b,
                     samples=samples, correct=correct, loss=loss, compute_s=compute_s, comm_s=comm_s, wait_s=wait_s,
                     lr=lr, flags=flags, digest=digest, data_s=self.stream.data_s if self.k == 0 else 0.0)
        self.reports.send(self.comm, t, 0, int(Tag.REPORT))


