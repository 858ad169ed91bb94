"""A worker (ranks 1..N): pull weights, compute minibatch gradients on its shard, push, repeat.

Async and ssp modes (the parameter server on rank 0 answers every push, see `mpiasgd.server`):

    pull w (version v)  ->  nsync = 1: one gradient g on w;            push g (base version v)
                            nsync = K: K local SGD steps from w to w'; push w' - w (base version v)

`--overlap` posts the pull and computes the next minibatch on the weights at hand while the
reply is in flight: the gradient pushed at step t was computed on the weights of the reply to
push t-2 instead of t-1 (one more step of staleness), and the wait for the reply overlaps compute.

Sync mode (`--mode sync`): after the initial pull, the workers average their gradients with an
allreduce on a communicator of workers only and each applies the same SGD step to its own copy,
so the copies stay identical; rank 0 only receives figures (REPORT) and snapshots (SNAPSHOT).
A max-allreduce of (non-finite flag, elapsed seconds) comes first every step: a non-finite
gradient on any worker makes every worker skip that step, and the time limit is judged on one
clock for all.

Buffers: the model's flat parameter vector IS the payload of a receive buffer, and its flat
gradient vector IS the payload of a send buffer, so a push or a pull never copies the model
(numpy backend). On a GPU (cupy backend) a `mpiasgd.device.Staging` chosen at start-up moves data
between the device and the MPI buffers (pinned host buffers, or device buffers with a CUDA-aware
MPI). A receive is posted before the push it answers is sent; a buffer is written only after its
send completed and read only after its receive completed. With `--overlap` there are two of each.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import protocol, signals
from mpiasgd.checkpoint import batch_rng
from mpiasgd.comms import wait
from mpiasgd.config import Config
from mpiasgd.data import Dataset, ShardSampler
from mpiasgd.device import Staging
from mpiasgd.evaluate import evaluate
from mpiasgd.optim import finite_square, fraction_done, learning_rate
from mpiasgd.protocol import Flag, Message, ProtocolError, Tag


def minibatches(sampler: ShardSampler, batch_size: int, start: int = 0):
    """Endless (epoch, indices) minibatches of `batch_size` over `sampler`'s shard, reshuffled every
    epoch; a batch may straddle two epochs (indices: int64 (batch_size,)). `start` skips the first
    `start` minibatches (a resumed worker's cursor) without drawing them."""
    skip = start * batch_size
    epoch, offset = divmod(skip, len(sampler))
    queue = sampler.indices(epoch)[offset:]
    epoch += 1
    while True:
        while queue.size < batch_size:
            queue = np.concatenate([queue, sampler.indices(epoch)])
            epoch += 1
        yield epoch - 1, queue[:batch_size]
        queue = queue[batch_size:]


class LocalSGD:
    """SGD with momentum and weight decay on a worker's own weights, on the model's backend.

    The update of the parameter server (`mpiasgd.optim.SGD`), for workers that step locally: every
    step in sync mode, and between exchanges with nsync > 1. `step(lr)` updates `model.params` in
    place with `model.grads`; the velocity lives on the model's backend and persists across pulls.
    """

    def __init__(self, model: Any, cfg: Config, start: int = 0, stop: int | None = None) -> None:
        self.model = model
        self.ops = model.ops
        self.momentum = cfg.momentum
        mask = model.decay_mask()[start:stop]  # a pipeline module steps its own slice [start, stop)
        self.decay = self.ops.asarray(cfg.weight_decay * mask)  # float32, 0 on biases
        self.velocity = self.ops.zeros(mask.size)

    def step(self, lr: float, params: Any = None, grads: Any = None) -> None:
        """Update `params` (default: the model's) in place with `grads` (default: the model's)."""
        params = self.model.params if params is None else params
        grads = self.model.grads if grads is None else grads
        self.ops.sgd_momentum(params, self.velocity, grads, self.decay, self.momentum, lr)


class Worker:
    """(all workers) One worker of rank `rank` (1-based) over `comm`; see the module docstring.

    `model` is an unbound `mpiasgd.model.Model`; `dataset` the loaded Dataset; `sampler` this
    worker's ShardSampler; `test_idx` (int64) the test images this worker evaluates at the end;
    `staging` how the model's params/grads meet the MPI buffers (default: the numpy backend's, no
    copies); `make_staging()` builds one more like it (needed by `--overlap`); `workers_comm` the
    communicator of the workers only (needed by sync mode).
    """

    def __init__(self, comm: Any, cfg: Config, model: Any, dataset: Dataset, sampler: ShardSampler,
                 test_idx: np.ndarray, rank: int, staging: Staging | None = None, make_staging: Any = None,
                 workers_comm: Any = None, num_train: int = 0) -> None:
        self.comm = comm
        self.cfg = cfg
        self.model = model
        self.dataset = dataset
        self.sampler = sampler
        self.test_idx = test_idx
        self.rank = rank
        self.staging = staging or Staging(model.num_params)
        self.make_staging = make_staging or (lambda: Staging(model.num_params))
        self.workers_comm = workers_comm
        self.num_train = num_train or dataset.train_y.size
        self.step = 0
        self.version = -1
        self.slowdown = cfg.stragglers().get(rank, 1.0)  # compute time multiplier of this worker
        self.cursor = 0                  # minibatches drawn from the shard: the data position
        self.batches = minibatches(sampler, cfg.batch_size)
        self.elapsed = 0.0               # seconds of training before this job (a resumed run)
        self.preempted = False           # the server's STOP said: a signal ended the run

    def resume(self, header: np.void) -> None:
        """Continue from the initial WEIGHTS of a resumed run (flag RESUME): step count, data position, clock."""
        self.step, self.cursor, self.elapsed = int(header["step"]), int(header["cursor"]), float(header["elapsed"])
        self.batches = minibatches(self.sampler, self.cfg.batch_size, self.cursor)

    def gradient(self) -> tuple[float, int, int, int]:
        """Forward and backward on the next minibatch into the bound grads; (loss, correct, samples, epoch)."""
        epoch, idx = next(self.batches)
        ops = self.model.ops
        rng = batch_rng(self.cfg.seed, self.rank, self.cursor)  # augmentation, reproducible from the cursor
        self.cursor += 1
        x, y = self.dataset.batch("train", idx, rng)  # (B, C, H, W) float32, (B,) int64, host
        x, y = ops.asarray(x), ops.asarray(y, y.dtype)     # cupy: host -> device; numpy: the same arrays
        loss, correct = self.model.forward_backward(x, y)
        return loss, correct, idx.size, epoch

    def straggle(self, t0: float) -> None:
        """--straggler: emulate a device `slowdown` times slower than this one (sleep for the difference)."""
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - t0))

    def receive_reply(self, request: Any, staging: Staging, what: str, timeout: float = 0.0,
                      initial: bool = False) -> tuple[Tag, float]:
        """Wait for WEIGHTS or STOP from the server into `staging.recv_buf`; returns (tag, seconds waited).

        After it returns, `staging.weights.header` and `staging.params` hold what arrived. The `initial`
        weights of a resumed run (flag RESUME) set the step, data position and clock (`resume`).
        """
        status = MPI.Status()
        waited = wait(request, what, self.rank, timeout or self.cfg.worker_timeout, status)
        staging.after_receive()  # cupy: weights host->device (pinned) or the header device->host (CUDA-aware)
        weights = staging.weights
        tag = protocol.parse_tag(status.Get_tag(), status.Get_source(), self.rank)
        if tag not in (Tag.WEIGHTS, Tag.STOP):
            raise ProtocolError(f"rank {self.rank}: expected WEIGHTS or STOP from rank 0, got {tag.name}")
        protocol.check_size(tag, 0, self.rank, status.Get_count(MPI.BYTE), weights.count)
        protocol.check(weights, tag, 0, self.rank)
        version, step = int(weights.header["version"]), int(weights.header["step"])
        flags = int(weights.header["flags"])
        if initial and flags & Flag.RESUME:
            self.resume(weights.header)
        if tag == Tag.STOP and flags & Flag.PREEMPT:
            self.preempted = True
        if step != self.step or version < self.version:
            raise ProtocolError(f"rank {self.rank}: {tag.name} answers step {step} at version {version}; "
                                f"expected step {self.step} at version >= {self.version}")
        self.version = version
        return tag, waited

    def run(self) -> bool:
        """Train until the run stops, then evaluate the final weights on this worker's test slice.

        Returns True if a signal ended the run (preempted: no evaluation, an EVAL of 0 images is sent).
        """
        if self.cfg.mode == "sync":
            self.run_sync()
        else:
            self.run_async()
        loss_sum = correct = count = 0
        if not self.preempted:
            loss_sum, correct, count = evaluate(self.model, self.dataset, self.test_idx, self.cfg.eval_batch_size)
        result = Message(0).stamp(Tag.EVAL, self.rank, samples=count, correct=correct, loss=loss_sum)
        sending = self.comm.Isend(result.buf, dest=0, tag=int(Tag.EVAL))
        wait(sending, "completion of the EVAL send", self.rank, self.cfg.worker_timeout)
        return self.preempted

    # --- async and ssp ---------------------------------------------------------------------------
    def run_async(self) -> None:
        """Push gradients (or nsync-step updates) and pull weights until the server says STOP.

        On return the model is bound to the final weights.
        """
        cfg, model, rank = self.cfg, self.model, self.rank
        ops = model.ops
        # one staging, or two with --overlap: the weights of one reply are in use while the next arrives
        stagings = [self.staging, self.make_staging()] if cfg.overlap else [self.staging]
        n = len(stagings)
        cur = 0  # the staging whose params hold the weights in use
        request = self.comm.Irecv(stagings[cur].recv_buf, source=0, tag=MPI.ANY_TAG)
        tag, wait_s = self.receive_reply(request, stagings[cur], "initial weights from the parameter server (rank 0)",
                                         timeout=cfg.worker_timeout + cfg.warm_start, initial=True)
        began = time.perf_counter() - self.elapsed
        local = LocalSGD(model, cfg) if cfg.nsync > 1 else None
        pulled = ops.empty(model.num_params) if local else None  # the weights at the start of this round
        sending: list[Any] = [None] * n  # the push in flight from each staging's send buffer
        reply = None  # --overlap: (request, staging index) of the reply in flight
        comm_s = 0.0
        version = self.version  # the version of the weights in use
        bound = None
        while tag == Tag.WEIGHTS:
            lr = float(stagings[cur].weights.header["lr"])  # step size of local steps (nsync > 1)
            out = (self.step + 1) % n  # the staging whose send buffer takes this push
            t = time.perf_counter()
            wait(sending[out], f"completion of push step {self.step + 1 - n}", rank, cfg.worker_timeout)
            t0 = time.perf_counter()
            comm_s += t0 - t
            if bound != (cur, out):
                model.bind(stagings[cur].params, stagings[out].grads)
                bound = (cur, out)
            if local is not None:
                pulled[...] = model.params
            loss = correct = samples = epoch = 0
            for _ in range(cfg.nsync):
                batch_loss, batch_correct, batch_samples, epoch = self.gradient()
                loss += batch_loss * batch_samples
                correct += batch_correct
                samples += batch_samples
                if local is not None:
                    local.step(lr)
                    if cfg.max_time and time.perf_counter() - began >= cfg.max_time:
                        break  # --max-time: push what this round has, the server then stops the run
            if local is not None:  # the accumulated update: the weights now minus the weights at the start
                model.grads[...] = model.params
                model.grads -= pulled
            stagings[out].finish_compute()  # cupy: device sync point
            self.straggle(t0)
            t1 = time.perf_counter()
            if reply is not None:  # --overlap: the reply to the previous push, usually here already
                request, cur = reply
                reply = None
                tag, wait_s = self.receive_reply(request, stagings[cur],
                                                 f"reply to push step {self.step} from the parameter server (rank 0)")
                if tag == Tag.STOP:
                    break  # the gradient just computed is dropped: the server takes no push after STOP
            t2 = time.perf_counter()
            self.step += 1
            stagings[out].push.stamp(Tag.PUSH, rank, step=self.step, version=version, samples=samples, epoch=epoch,
                                     correct=correct, loss=loss / samples, compute_s=t1 - t0, comm_s=comm_s,
                                     wait_s=wait_s, lr=lr, cursor=self.cursor,
                                     flags=(Flag.DELTA if local is not None else 0)
                                     | (Flag.PREEMPT if signals.received() else 0))
            stagings[out].before_send()  # cupy: gradient device->host (pinned) or header host->device (CUDA-aware)
            into = (cur + 1) % n  # --overlap: the reply lands in the staging not in use
            request = self.comm.Irecv(stagings[into].recv_buf, source=0, tag=MPI.ANY_TAG)
            sending[out] = self.comm.Isend(stagings[out].send_buf, dest=0, tag=int(Tag.PUSH))
            comm_s = time.perf_counter() - t2
            if cfg.overlap:
                reply = (request, into)
                version = self.version  # the weights now in use came with the reply received above
                continue
            tag, wait_s = self.receive_reply(
                request, stagings[into], f"reply to push step {self.step} from the parameter server (rank 0)")
            cur, version = into, self.version
        for req in sending:
            wait(req, "completion of the last push", rank, cfg.worker_timeout)
        model.bind(stagings[cur].params, stagings[cur].grads)  # the final weights

    # --- sync --------------------------------------------------------------------------------------
    def run_sync(self) -> None:
        """Allreduce-average gradients with the other workers and step locally until the stopping rule.

        The first worker (rank 0 of the workers' communicator) also sends rank 0 the SNAPSHOTs and the
        CHECKPOINTs (weights and velocity), at intervals judged on the max-allreduced clock and at the
        end. A signal on any worker, or a STOP from rank 0 (a signal there), enters the control
        allreduce: every worker makes that step its last, the state is checkpointed, and the run ends
        without the final evaluation.
        """
        cfg, model, rank, wc = self.cfg, self.model, self.rank, self.workers_comm
        staging, nworkers = self.staging, wc.Get_size()
        request = self.comm.Irecv(staging.recv_buf, source=0, tag=MPI.ANY_TAG)
        tag, _ = self.receive_reply(request, staging, "initial weights from the parameter server (rank 0)",
                                    initial=True)
        if tag != Tag.WEIGHTS:
            raise ProtocolError(f"rank {rank}: expected the initial WEIGHTS from rank 0, got {tag.name}")
        model.bind(staging.params, staging.grads)
        local = LocalSGD(model, cfg)
        applied = 0
        if int(staging.weights.header["flags"]) & Flag.RESUME:  # the velocity follows the weights
            applied = int(staging.weights.header["version"])
            state = Message(model.num_params)
            status = MPI.Status()
            wait(self.comm.Irecv(state.buf, source=0, tag=int(Tag.CHECKPOINT)),
                 "the optimizer state of the checkpoint from rank 0", rank, cfg.worker_timeout, status)
            protocol.check_size(Tag.CHECKPOINT, 0, rank, status.Get_count(MPI.BYTE), state.count)
            protocol.check(state, Tag.CHECKPOINT, 0, rank)
            local.velocity[...] = model.ops.asarray(state.payload)
        stop = Message(0)  # rank 0's STOP: after the last REPORT, at once on a signal (PREEMPT) or a divergence
        stop_req = self.comm.Irecv(stop.buf, source=0, tag=int(Tag.STOP))
        leader = wc.Get_rank() == 0  # sends the snapshots and checkpoints
        reports = [Message(0), Message(0)]  # header-only REPORTs; alternate so one is always free
        report_sends: list[Any] = [None, None]
        snap, snap_send = (Message(model.num_params), None) if leader else (None, None)
        ckpt, ckpt_send = (Message(2 * model.num_params), None) if leader else (None, None)
        ctrl = np.zeros(4, dtype=np.float64)  # [non-finite flag, elapsed seconds, preempt, halt], max-allreduced
        start = time.perf_counter() - self.elapsed
        last_snapshot = last_checkpoint = self.elapsed
        samples_per_step = cfg.batch_size * nworkers
        last = False
        while not last:
            t0 = time.perf_counter()
            loss, correct, samples, epoch = self.gradient()
            staging.finish_compute()
            self.straggle(t0)
            t1 = time.perf_counter()
            grads = model.grads
            nonfinite = not finite_square(grads)[0]
            stopped = bool(stop_req.Test())  # early: a signal on rank 0 (PREEMPT), or --on-divergence stop
            halt = stopped and not int(stop.header["flags"]) & Flag.PREEMPT
            preempt = bool(signals.received()) or (stopped and not halt)
            ctrl[:] = float(nonfinite), time.perf_counter() - start, float(preempt), float(halt)
            wait_s = wait(wc.Iallreduce(MPI.IN_PLACE, ctrl, op=MPI.MAX), "the control allreduce", rank,
                          cfg.worker_timeout)
            skipped = bool(ctrl[0])
            self.step += 1
            lr = 0.0
            if not skipped:  # every worker takes the same branch: ctrl is identical everywhere
                buf = staging.grads_to_mpi()
                wait_s += wait(wc.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM), "the gradient allreduce", rank,
                               cfg.worker_timeout)
                staging.grads_from_mpi()
                grads *= np.float32(1.0 / nworkers)
                done = applied * samples_per_step / self.num_train
                lr = learning_rate(cfg, done, fraction_done(cfg, done, applied, ctrl[1]))
                local.step(lr)
                applied += 1
            t2 = time.perf_counter()
            self.preempted = bool(ctrl[2])
            last = self.preempted or bool(ctrl[3]) or self.sync_should_stop(applied, ctrl[1], samples_per_step)
            flags = ((Flag.SKIPPED if skipped else 0) | (Flag.NONFINITE if nonfinite else 0)
                     | (Flag.LAST if last else 0) | (Flag.PREEMPT if self.preempted else 0))
            slot = self.step % 2
            wait(report_sends[slot], "completion of a REPORT send", rank, cfg.worker_timeout)
            digest = protocol.weights_digest(model.ops.to_numpy(model.params))  # rank 0 checks the replicas agree
            reports[slot].stamp(Tag.REPORT, rank, step=self.step, version=applied, samples=samples, epoch=epoch,
                                correct=correct, loss=loss, compute_s=t1 - t0, comm_s=t2 - t1 - wait_s,
                                wait_s=wait_s, lr=lr, flags=flags, digest=digest, cursor=self.cursor)
            report_sends[slot] = self.comm.Isend(reports[slot].buf, dest=0, tag=int(Tag.REPORT))
            if not leader:
                continue
            if last or (cfg.snapshot_interval and ctrl[1] - last_snapshot >= cfg.snapshot_interval):
                last_snapshot = ctrl[1]
                wait(snap_send, "completion of a SNAPSHOT send", rank, cfg.worker_timeout)
                snap.payload[:] = model.ops.to_numpy(model.params)
                snap.stamp(Tag.SNAPSHOT, rank, step=self.step, version=applied, flags=Flag.FINAL if last else 0)
                snap_send = self.comm.Isend(snap.buf, dest=0, tag=int(Tag.SNAPSHOT))
            if last or (cfg.checkpoint_interval and ctrl[1] - last_checkpoint >= cfg.checkpoint_interval):
                last_checkpoint = ctrl[1]
                wait(ckpt_send, "completion of a CHECKPOINT send", rank, cfg.worker_timeout)
                P = model.num_params
                ckpt.payload[:P] = model.ops.to_numpy(model.params)
                ckpt.payload[P:] = model.ops.to_numpy(local.velocity)
                ckpt.stamp(Tag.CHECKPOINT, rank, step=self.step, version=applied, cursor=self.cursor,
                           elapsed=ctrl[1], flags=(Flag.FINAL if last else 0) | (Flag.PREEMPT if self.preempted else 0))
                ckpt_send = self.comm.Isend(ckpt.buf, dest=0, tag=int(Tag.CHECKPOINT))
        for req in (*report_sends, snap_send, ckpt_send):
            wait(req, "completion of the last REPORT/SNAPSHOT/CHECKPOINT sends", rank, cfg.worker_timeout)
        wait(stop_req, "STOP from rank 0 after the last step", rank, cfg.worker_timeout)
        protocol.check(stop, Tag.STOP, 0, rank)

    def sync_should_stop(self, steps: int, elapsed: float, samples_per_step: int) -> bool:
        """The stopping rule, judged identically on every worker (steps and the max-allreduced clock).

        In sync mode --max-pushes counts steps (one update of every worker's copy each).
        """
        cfg = self.cfg
        return bool((cfg.epochs and steps * samples_per_step >= cfg.epochs * self.num_train)
                    or (cfg.max_pushes and steps >= cfg.max_pushes)
                    or (cfg.max_time and elapsed >= cfg.max_time))
