"""`--mode sync`: synchronous data parallelism; the workers allreduce, rank 0 only logs.

After the initial pull, the workers average their gradients with an allreduce on a communicator
of workers only and each applies the same SGD step to its own copy, so the copies stay identical;
rank 0 turns every worker's REPORT into a row of the pushes table (one per worker per step) and
an updates row per step, stores the SNAPSHOTs the first worker sends, and collects the EVALs.

A max-allreduce of (non-finite flag, elapsed seconds, preempt, halt) comes first every step: a
non-finite gradient on any worker makes every worker skip that step (logged as an event naming the
worker; `--max-rejects` such steps in a row from one worker end the run with TrainingDiverged), and
the stopping rule is judged on one clock for all: their last REPORT carries the flag LAST. The
first worker also sends the SNAPSHOTs and the CHECKPOINTs (weights and velocity), at intervals
judged on that clock and at the end. A signal on any worker, or a STOP from rank 0 (a signal there,
flag PREEMPT, or --on-divergence stop), enters the control allreduce: every worker makes that step
its last.

Layer state (BatchNorm's running statistics; `WorkerLoop.buffers`): every worker updates its own in
each training forward, then the gradient allreduce carries them after the gradient ([grads |
buffers], divided by N as the gradient is), so every replica holds the replicas' mean after every
step: bit for bit the same buffers everywhere, as the weights. The running statistics are thereby
updated with the replicas' mean batch statistics (the momentum update is affine: averaging the
updated buffers is updating with the averaged batch mean and unbiased variance). A step every
worker skips (a non-finite gradient somewhere) leaves the buffers as they were before it, as the
weights. The REPORT digest covers weights and buffers (0 with one worker: nothing to compare).
The initial WEIGHTS carry rank 0's buffers
(initial, or the checkpoint's on a resume), which the workers take; the first worker's SNAPSHOTs and
CHECKPOINTs carry the common buffers after the weights (and velocity), which rank 0 logs and stores.

Evaluation during training (--eval-interval): every worker decides alike, after a step's REPORT, on the
allreduced clock (seconds) or the steps applied (epochs), so all evaluate the same weights, each on its
test slice, and send EVAL (flag EVALUATE, the evaluation's number and step); the first worker also
sends the SNAPSHOT of that step (flag EVALUATE), so the log holds the weights each evaluation had
(its row's `snapshot`). Rank 0 logs the evaluation when every worker has answered (`rank0.evals`).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd.comms import Flag, Interval, Message, ProtocolError, SendSlots, Tag, check, ulfm, wait, weights_digest
from mpiasgd.config import Config
from mpiasgd.modes.base import Mode, WorkerJob, WorkerLoop, initial_buffers
from mpiasgd.optim import EvalSchedule, LocalSGD, Schedule, StopRule, finite_square, fraction_done, snapshot_seconds
from mpiasgd.rank0.evals import PeriodicEvals
from mpiasgd.rank0.role import Role


class Replicas:
    """(rank 0) Replicas must report the same weight digest for the same step (sync: all workers;
    pipeline: a module's replicas): RuntimeError naming the step and the ranks at the first difference."""

    def __init__(self) -> None:
        self.digests: dict[tuple[int, int], tuple] = {}  # (group, step) -> (first digest and rank, ranks seen)

    def check(self, group: int, step: int, w: int, digest: int, replicas: int) -> None:
        key = (group, step)
        first, seen = self.digests.get(key, (None, []))
        seen.append(w)
        if first is not None and digest != first[0]:
            raise RuntimeError(f"rank 0: the replicas' weights differ after step {step}: worker rank {w} has "
                               f"digest {digest:08x}, worker rank {first[1]} has {first[0]:08x}")
        if len(seen) == replicas:
            self.digests.pop(key, None)
        else:
            self.digests[key] = (first or (digest, w), seen)


class SyncMonitor(Role):
    """(rank 0) Logs the workers' REPORTs and SNAPSHOTs, writes the CHECKPOINTs the first worker sends.

    `params` (float32 (P,)) and `buffers` (float32 (B,), the layers' buffers) are the initial ones, then
    the first worker's latest snapshot: SNAPSHOT payload [weights | buffers], CHECKPOINT payload
    [weights | velocity | buffers]."""

    def __init__(self, r0: Any, params: np.ndarray, buffers: np.ndarray | None = None) -> None:
        super().__init__(r0, params, buffers)
        self.P, self.B = params.size, self.buffers.size
        self.replicas = Replicas()
        self.snapshot_inbox = Message(self.P + self.B)
        self.checkpoint_inbox: Message | None = None
        self.eval_snapshots: dict[int, int] = {}  # step -> index of its SNAPSHOT (flag EVALUATE) in the log
        batch = self.cfg.batch_size * len(self.workers)
        self.periodic = PeriodicEvals(self.rec, self.cfg, self.workers, decided_by_workers=True,
                                      samples_at=lambda version: float(version * batch),
                                      snapshot_of=lambda version: self.eval_snapshots.pop(version, -1))

    # --- workers that die (ULFM) ---
    def survives(self) -> str:
        """sync goes on without a worker that died: the workers shrink their allreduce group (`SyncWorker.shrink`)."""
        return ""

    def leader(self) -> int:
        """The worker that sends the snapshots and checkpoints: the first that lives (the first of the shrunk
        group)."""
        return min(w for w in self.workers if w not in self.lost)

    def steps_to_samples(self, version: int) -> int:
        """Images the first `version` applied steps took: batch x the workers alive at each step."""
        return self.counter.samples + (version - self.counter.version) * self.cfg.batch_size * (
            len(self.workers) - len(self.lost))

    def handlers(self) -> dict:
        return {Tag.REPORT: self.on_report, Tag.SNAPSHOT: self.on_snapshot, Tag.CHECKPOINT: self.on_checkpoint,
                Tag.EVAL: self.on_eval}

    def buffer_for(self, tag: Tag, source: int) -> Message | None:
        if tag == Tag.CHECKPOINT:  # weights, velocity and buffers
            if self.checkpoint_inbox is None:
                self.checkpoint_inbox = Message(2 * self.P + self.B)
            return self.checkpoint_inbox
        return self.snapshot_inbox if tag == Tag.SNAPSHOT else None

    def begin(self) -> None:
        """The initial weights and buffers, and on a resume the checkpoint's velocity (CHECKPOINT), to every
        worker."""
        ck = self.rec.resumed
        for w in self.workers:
            out = Message(self.P + self.B)
            out.payload[:self.P] = self.params
            out.payload[self.P:] = self.buffers
            flags = Flag.RESUME if ck is not None else 0
            out.stamp(Tag.WEIGHTS, self.rank, step=self.last_step[w], version=self.counter.version, flags=flags,
                      cursor=self.cursor[w], elapsed=self.rec.train_time(), samples=self.counter.samples)
            self.out[w].take(0)
            self.post(w, out, Tag.WEIGHTS)
            if ck is not None:
                self.send_state(w, ck.momentum)

    def on_preempt(self) -> None:
        """Tell every worker: they end together after the step where the control allreduce hears of it, and
        the first worker sends the CHECKPOINT of that step."""
        self.stop_workers()

    def stop_workers(self) -> None:
        """A STOP to every worker (flag PREEMPT on a signal; without it they end with the final evaluation)."""
        for w in self.workers:
            self.send_stop(w)

    def on_checkpoint(self, w: int, msg: Message) -> None:
        if w != self.leader():
            raise ProtocolError(f"rank 0: CHECKPOINT from worker rank {w}; only rank {self.leader()} sends them")
        h, P = msg.header, self.P
        flags = int(h["flags"])
        reason = "preempt" if flags & Flag.PREEMPT else "end" if flags & Flag.FINAL else "interval"
        step, cursor = int(h["step"]), int(h["cursor"])  # the same on every worker
        ckpt = self.rec.checkpoint(msg.payload[:P], msg.payload[P:2 * P], reason,
                                   dict.fromkeys(self.workers, (step, cursor)), float(h["elapsed"]),
                                   msg.payload[2 * P:])
        ckpt.version = int(h["version"])
        ckpt.samples = self.steps_to_samples(ckpt.version)
        self.rec.write_checkpoint(ckpt)

    def on_report(self, w: int, msg: Message) -> None:
        rec = self.rec
        h = msg.header
        step, version, flags = int(h["step"]), int(h["version"]), int(h["flags"])
        if w in self.stopped:
            raise ProtocolError(f"rank 0: REPORT step {step} from worker rank {w} after its last step")
        if step != self.last_step[w] + 1:
            raise ProtocolError(f"rank 0: REPORT from worker rank {w} has step {step}, expected "
                                f"{self.last_step[w] + 1} (duplicate or out-of-order report)")
        self.last_step[w] = step
        applied, nonfinite = not flags & Flag.SKIPPED, bool(flags & Flag.NONFINITE)
        if version > self.counter.version:  # the first report of a step that updated the weights
            self.counter.set(version, self.steps_to_samples(version))
            rec.update(version=version, lr=float(h["lr"]))
        rec.training_loss(float(h["loss"]), int(h["correct"]), int(h["samples"]))
        rec.push(worker=w, step=step, base_version=version - applied, version=version, staleness=0, loss=h["loss"],
                 correct=h["correct"], samples=h["samples"], epoch=h["epoch"], compute_s=h["compute_s"],
                 comm_s=h["comm_s"], wait_s=h["wait_s"], applied=applied, lr=h["lr"], rejected=nonfinite,
                 digest=h["digest"], data_s=h["data_s"])
        self.replicas.check(0, step, w, int(h["digest"]), len(self.workers) - len(self.lost))
        if nonfinite:
            rec.event("skip", f"step {step} skipped by every worker: worker rank {w} computed a non-finite gradient")
            rec.reject(w, step)
        else:
            rec.accept(w)
        if flags & Flag.PREEMPT:  # every worker's last REPORT
            self.r0.signal_from(f"a signal reached the workers (the control allreduce of step {step}; the worker "
                                f"it reached printed it)")
        if flags & Flag.LAST:
            self.stopped.add(w)
            self.send_stop(w)
            rec.stop(f"the workers' stopping rule at step {step} (epoch {rec.epoch:.2f})")

    def on_snapshot(self, w: int, msg: Message) -> None:
        if w != self.leader():
            raise ProtocolError(f"rank 0: SNAPSHOT from worker rank {w}; only rank {self.leader()} sends them")
        self.params[:] = msg.payload[:self.P]
        self.buffers[:] = msg.payload[self.P:]
        flags = int(msg.header["flags"])
        if not flags & Flag.FINAL:  # the final weights are logged by the loop's finish
            # of the step they come from (another worker's later REPORT may have arrived before them)
            version = int(msg.header["version"])
            index = self.rec.snapshot(self.params, self.buffers, version, self.steps_to_samples(version))
            if flags & Flag.EVALUATE:  # the weights of an evaluation during training: its row names this snapshot
                self.eval_snapshots[int(msg.header["version"])] = index


def world_ranks(group: Any, world: Any) -> list[int]:
    """The ranks in `world` (a group) of every member of `group`."""
    return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)]


class SyncWorker(WorkerLoop):
    """(workers) Allreduce-average gradients and layer buffers with the other workers and step locally until
    the stopping rule (see the module docstring)."""

    def train(self) -> None:
        cfg, model, rank, wc = self.cfg, self.model, self.rank, self.job.comms
        staging, nworkers = self.staging, wc.Get_size()
        request = self.comm.Irecv(staging.recv_buf, source=0, tag=MPI.ANY_TAG)
        tag, _ = self.receive_weights(request, staging, "initial weights from the parameter server (rank 0)",
                                      initial=True)
        if tag != Tag.WEIGHTS:
            raise ProtocolError(f"rank {rank}: expected the initial WEIGHTS from rank 0, got {tag.name}")
        self.buffers_from(staging.params)  # rank 0's buffers (the checkpoint's on a resume)
        self.bind(staging.params, staging.grads)
        P, B, ops = self.P, self.B, model.ops
        kept = ops.empty(B) if B else None  # the buffers before the step: a skipped step restores them
        local = LocalSGD(model, cfg.momentum, cfg.weight_decay, nesterov=cfg.nesterov)
        schedule, rule = Schedule.of(cfg, nworkers), StopRule.of(cfg)
        applied = 0
        if int(staging.weights.header["flags"]) & Flag.RESUME:  # the velocity follows the weights
            applied = int(staging.weights.header["version"])
            local.velocity[...] = model.ops.asarray(self.receive_state(model.num_params).payload)
        stop = Message(0)  # rank 0's STOP: after the last REPORT, at once on a signal (PREEMPT) or a divergence
        stop_req = self.comm.Irecv(stop.buf, source=0, tag=int(Tag.STOP))
        leader = wc.Get_rank() == 0  # sends the snapshots and checkpoints
        reports = SendSlots([Message(0), Message(0)], "REPORT", rank, cfg.worker_timeout)
        snaps = SendSlots([Message(P + B)] if leader else [], "SNAPSHOT", rank, cfg.worker_timeout)
        ckpts = SendSlots([Message(2 * P + B)] if leader else [], "CHECKPOINT", rank, cfg.worker_timeout)
        ctrl = np.zeros(4, dtype=np.float64)  # [non-finite flag, elapsed seconds, preempt, halt], max-allreduced
        start = time.perf_counter() - self.elapsed
        snapshots = Interval(snapshot_seconds(cfg.snapshot_interval, P + B), self.elapsed)
        checkpoints = Interval(cfg.checkpoint_interval, self.elapsed)
        samples_per_step = cfg.batch_size * nworkers
        # images the applied steps took (fewer a step after a worker died; a resume: rank 0's count, which holds
        # when the checkpoint had another number of workers)
        self.seen = int(staging.weights.header["samples"]) if applied else 0
        self.last_lr = 0.0  # the step size of the last step applied
        evals = EvalSchedule.of(cfg, self.elapsed, applied * samples_per_step / self.num_train)
        number = 0  # evaluations during training made by this job
        last = False
        while not last:
            t0 = time.perf_counter()
            if kept is not None:
                kept[...] = self.buffers
            stats, samples, epoch = self.gradient()
            staging.finish_compute()
            loss, correct = stats.get()
            self.straggle(t0)
            t1 = time.perf_counter()
            grads = model.grads
            nonfinite = not finite_square(grads)[0]
            stopped = self.stop_arrived(stop_req, stop)  # early: a signal on rank 0 (PREEMPT), or a divergence
            halt = stopped and not int(stop.header["flags"]) & Flag.PREEMPT
            preempt = self.signalled() or (stopped and not halt)
            ctrl[:] = float(nonfinite), time.perf_counter() - start, float(preempt), float(halt)
            mine = ctrl.copy()  # (a worker's death mid-step: the control allreduce again, among the survivors)
            self.step += 1
            before = applied
            try:
                wait_s = wait(wc.Iallreduce(MPI.IN_PLACE, ctrl, op=MPI.MAX), "completion of the control allreduce",
                              rank, cfg.worker_timeout)
                skipped = bool(ctrl[0])
                lr = 0.0
                if not skipped:  # every worker takes the same branch: ctrl is identical everywhere
                    self.buffers_into(staging.grads)  # one allreduce: [gradient | buffers]
                    buf = staging.grads_to_mpi()
                    request = wc.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                    wait_s += wait(request, "completion of the gradient allreduce", rank, cfg.worker_timeout)
                    staging.grads_from_mpi()
                    staging.grads *= np.float32(1.0 / nworkers)  # the mean gradient, and the mean buffers
                    self.buffers_from(staging.grads)
                    done = self.seen / self.num_train
                    lr = schedule(done, fraction_done(rule, done, applied, ctrl[1]))
                    local.step(lr)
                    applied += 1
                    self.seen += samples_per_step
                    self.last_lr = lr
            except MPI.Exception as e:  # ULFM: a worker died; the survivors shrink the group and go on
                if not (ulfm.enabled() and ulfm.is_failure(e)):
                    raise
                if kept is not None:  # (the step's forward changed them; the step is dropped or taken whole)
                    self.buffers[...] = kept
                wc, applied, lr, behind = self.shrink(wc, local, before, mine, ctrl)
                nworkers, leader = wc.Get_size(), wc.Get_rank() == 0
                samples_per_step = cfg.batch_size * nworkers
                if leader and not snaps.buffers:  # this worker now sends the snapshots and checkpoints
                    snaps, ckpts = (SendSlots([Message(P + B)], "SNAPSHOT", rank, cfg.worker_timeout),
                                    SendSlots([Message(2 * P + B)], "CHECKPOINT", rank, cfg.worker_timeout))
                if behind:  # its step was applied (taken from another survivor): reported, then the next dropped
                    report = reports.take(self.step)
                    report.stamp(Tag.REPORT, rank, step=self.step, version=applied, samples=samples, epoch=epoch,
                                 correct=correct, loss=loss, compute_s=t1 - t0, comm_s=0.0,
                                 wait_s=time.perf_counter() - t1, lr=lr, flags=0,
                                 digest=weights_digest(model.params, self.buffers) if nworkers > 1 else 0,
                                 cursor=self.cursor, data_s=self.take_data_s())
                    reports.send(self.comm, self.step, 0, int(Tag.REPORT))
                    self.step += 1
                    samples = correct = 0
                    loss = 0.0
                skipped, wait_s, lr = True, time.perf_counter() - t1, 0.0
            if skipped and kept is not None and applied == before:  # a skipped step leaves the buffers as the
                self.buffers[...] = kept  # weights: as they were
            t2 = time.perf_counter()
            self.preempted = bool(ctrl[2])
            last = (self.preempted or bool(ctrl[3]) or bool(rule.reason(self.seen, self.num_train, applied, ctrl[1])))
            flags = ((Flag.SKIPPED if skipped else 0) | (Flag.NONFINITE if nonfinite else 0)
                     | (Flag.LAST if last else 0) | (Flag.PREEMPT if self.preempted else 0))
            report = reports.take(self.step)
            digest = (weights_digest(model.params, self.buffers)  # rank 0 compares (reduced where the weights are)
                      if nworkers > 1 else 0)  # (one replica: nothing to compare)
            report.stamp(Tag.REPORT, rank, step=self.step, version=applied, samples=samples, epoch=epoch,
                         correct=correct, loss=loss, compute_s=t1 - t0, comm_s=t2 - t1 - wait_s, wait_s=wait_s,
                         lr=lr, flags=flags, digest=digest, cursor=self.cursor, data_s=self.take_data_s())
            reports.send(self.comm, self.step, 0, int(Tag.REPORT))
            # --eval-interval: every worker decides alike (the allreduced clock, the steps applied)
            evaluating = not last and evals.due(ctrl[1], self.seen / self.num_train)
            if leader:
                self.send_duties(snaps, ckpts, snapshots, checkpoints, local, ctrl[1], applied, last, evaluating)
            if evaluating:  # the weights after this step, on this worker's slice (a STOP or a signal abandons it)
                number += 1
                self.evaluate_during_training(number, applied, stop=lambda: self.stop_arrived(stop_req, stop))
        for slots in (reports, snaps, ckpts):
            slots.drain()
        wait(stop_req, "STOP from rank 0 after the last step", rank, cfg.worker_timeout)
        check(stop, Tag.STOP, 0, rank)

    def shrink(self, wc: Any, local: LocalSGD, before: int, mine: np.ndarray,
               ctrl: np.ndarray) -> tuple[Any, int, float, bool]:
        """(ULFM) A worker died during this step's allreduces: the survivors revoke the group, shrink it, and agree.
        Some may have finished the step before it broke (they are one step ahead); the state of one that applied
        the most steps (weights, velocity, buffers, images seen, its last step size) is broadcast to all, so the
        replicas stay identical: a step some survivor finished counts as applied for every survivor, and the
        step in flight on the survivors ahead is dropped by all. The control allreduce is then redone among the
        survivors on each worker's own values `mine`, into `ctrl`. Returns (the shrunk group, steps applied, the
        last step size, whether this worker was behind: its step counts as applied and it reports the dropped
        one too); the dead workers' data and test slices are dealt to the survivors (`note_lost`).

        The global batch shrinks to batch size x the survivors (the step size schedule is not rescaled; the
        epochs count the images seen)."""
        t0 = time.perf_counter()
        old_group = wc.Get_group()
        wc.Revoke()
        new = wc.Shrink()
        world, new_group = self.comm.Get_group(), new.Get_group()
        dead = sorted(set(world_ranks(old_group, world)) - set(world_ranks(new_group, world)))
        for group in (old_group, new_group, world):
            group.Free()
        step, top = new.allreduce(self.step, op=MPI.MAX), new.allreduce(before, op=MPI.MAX)
        root = new.allreduce(new.Get_rank() if before == top else new.Get_size(), op=MPI.MIN)
        model, ops, P = self.model, self.model.ops, self.P
        state = np.concatenate([ops.to_numpy(model.params), ops.to_numpy(local.velocity), ops.to_numpy(self.buffers)])
        new.Bcast(state, root=root)
        model.params[...] = ops.asarray(state[:P])
        local.velocity[...] = ops.asarray(state[P:2 * P])
        self.buffers[...] = ops.asarray(state[2 * P:])
        self.seen, lr = new.bcast((self.seen, self.last_lr), root=root)
        ctrl[:] = mine
        new.Allreduce(MPI.IN_PLACE, ctrl, op=MPI.MAX)
        for w in dead:
            self.note_lost(w)
        if new.Get_rank() == 0:
            print(f"mpiasgd: worker rank{'s' * (len(dead) != 1)} {', '.join(map(str, dead))} died during step "
                  f"{step}: the allreduce group shrank to {new.Get_size()} worker{'s' * (new.Get_size() != 1)} in "
                  f"{time.perf_counter() - t0:.2f} s; step {step} is dropped, {top} applied", file=sys.stderr,
                  flush=True)
        return new, top, lr, self.step < step

    def send_duties(self, snaps: SendSlots, ckpts: SendSlots, snapshots: Interval, checkpoints: Interval,
                    local: LocalSGD, elapsed: float, applied: int, last: bool, evaluating: bool) -> None:
        """(the first worker) The SNAPSHOT (at its interval, at the last step, and at a step the workers
        evaluate: flag EVALUATE) and the CHECKPOINT (at its interval and the last step) of this step."""
        model, ops, rank, P = self.model, self.model.ops, self.rank, self.P
        if snapshots.due(elapsed) or last or evaluating:
            snapshots.restart(elapsed)
            snap = snaps.take(0)
            snap.payload[:P] = ops.to_numpy(model.params)
            snap.payload[P:] = ops.to_numpy(self.buffers)
            snap.stamp(Tag.SNAPSHOT, rank, step=self.step, version=applied,
                       flags=Flag.FINAL if last else Flag.EVALUATE if evaluating else 0)
            snaps.send(self.comm, 0, 0, int(Tag.SNAPSHOT))
        if checkpoints.due(elapsed) or last:
            checkpoints.restart(elapsed)
            ckpt = ckpts.take(0)
            ckpt.payload[:P] = ops.to_numpy(model.params)
            ckpt.payload[P:2 * P] = ops.to_numpy(local.velocity)
            ckpt.payload[2 * P:] = ops.to_numpy(self.buffers)
            ckpt.stamp(Tag.CHECKPOINT, rank, step=self.step, version=applied, cursor=self.cursor,
                       elapsed=elapsed, flags=(Flag.FINAL if last else 0) | (Flag.PREEMPT if self.preempted else 0))
            ckpts.send(self.comm, 0, 0, int(Tag.CHECKPOINT))


class SyncMode(Mode):
    name = "sync"
    elastic = True

    def communicators(self, cfg: Config, comm: Any, rank: int, layout: Any) -> Any:
        """The workers' own communicator, for the allreduces (rank 0: MPI.COMM_NULL)."""
        return comm.Split(0 if rank else MPI.UNDEFINED, rank)

    def rank0(self, r0: Any, params: np.ndarray, decay_mask: np.ndarray, model: Any, dataset: Any,
              layout: Any) -> SyncMonitor:
        return SyncMonitor(r0, params, initial_buffers(model))

    def worker(self, job: WorkerJob) -> SyncWorker:
        return SyncWorker(job)


MODE = SyncMode()
