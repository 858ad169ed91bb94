"""A worker (ranks 1..N): pull weights, compute a minibatch gradient on its shard, push it, repeat.

The model's flat parameter vector IS the payload of the receive buffer, and its flat gradient
vector IS the payload of the send buffer, so a push or a pull never copies the model: MPI reads
the gradient where backward wrote it and writes the weights where forward reads them. The
receive for the reply is posted before the push is sent (no unexpected-message buffering), and
both buffers are touched only after their requests completed.

That holds for the numpy backend. On a GPU (cupy backend) the model lives on the device and a
`mpiasgd.device.Staging` chosen at start-up moves data between it and the MPI buffers: pinned
host buffers with one host->device copy of the weights per pull and one device->host copy of the
gradient per push, or (CUDA-aware MPI) device buffers handed to MPI directly. The loop is the same
for all three; on the numpy backend the staging calls do nothing.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import protocol
from mpiasgd.comms import wait
from mpiasgd.config import Config
from mpiasgd.data import Dataset, ShardSampler
from mpiasgd.device import Staging
from mpiasgd.evaluate import evaluate
from mpiasgd.protocol import Message, ProtocolError, Tag


class Worker:
    """(all workers) One A-SGD worker of rank `rank` (1-based) over `comm`; see the module docstring.

    `model` is an unbound `mpiasgd.model.Model`; `dataset` the loaded Dataset; `sampler` this
    worker's ShardSampler; `test_idx` (int64) the test images this worker evaluates at the end;
    `staging` how the model's params/grads meet the MPI buffers (default: the numpy backend's, no copies).
    """

    def __init__(self, comm: Any, cfg: Config, model: Any, dataset: Dataset, sampler: ShardSampler,
                 test_idx: np.ndarray, rank: int, staging: Staging | None = None) -> None:
        self.comm = comm
        self.cfg = cfg
        self.model = model
        self.dataset = dataset
        self.sampler = sampler
        self.test_idx = test_idx
        self.rank = rank
        self.staging = staging
        self.step = 0
        self.version = -1
        self.slowdown = cfg.stragglers().get(rank, 1.0)  # compute time multiplier of this worker

    def batches(self):
        """Endless (epoch, indices) minibatches over this shard; a batch may straddle two epochs."""
        epoch, queue = 0, np.empty(0, dtype=np.int64)
        while True:
            while queue.size < self.cfg.batch_size:
                queue = np.concatenate([queue, self.sampler.indices(epoch)])
                epoch += 1
            yield epoch - 1, queue[: self.cfg.batch_size]
            queue = queue[self.cfg.batch_size:]

    def receive_reply(self, request: Any, staging: Staging, what: str) -> tuple[Tag, float]:
        """Wait for WEIGHTS or STOP from the server into `staging.recv_buf`; returns (tag, seconds waited).

        After it returns, `staging.weights.header` and the model's params hold what arrived.
        """
        status = MPI.Status()
        waited = wait(request, what, self.rank, self.cfg.comm_timeout, status)
        staging.after_receive()  # cupy: weights host->device (pinned) or the header device->host (CUDA-aware)
        weights = staging.weights
        tag = protocol.parse_tag(status.Get_tag(), status.Get_source(), self.rank)
        if tag not in (Tag.WEIGHTS, Tag.STOP):
            raise ProtocolError(f"rank {self.rank}: expected WEIGHTS or STOP from rank 0, got {tag.name}")
        protocol.check_size(tag, 0, self.rank, status.Get_count(MPI.BYTE), weights.count)
        protocol.check(weights, tag, 0, self.rank)
        version, step = int(weights.header["version"]), int(weights.header["step"])
        if step != self.step or version < self.version:
            raise ProtocolError(f"rank {self.rank}: {tag.name} answers step {step} at version {version}; "
                                f"expected step {self.step} at version >= {self.version}")
        self.version = version
        return tag, waited

    def run(self) -> None:
        """Train until the server says STOP, then evaluate the final weights on this worker's test slice."""
        cfg, model, rank = self.cfg, self.model, self.rank
        staging = self.staging or Staging(model.num_params)
        push, ops = staging.push, model.ops
        # numpy: params live in the receive buffer, grads in the send buffer; cupy: on the device
        model.bind(staging.params, staging.grads)
        rng = np.random.default_rng([cfg.seed, 1, rank])  # augmentation
        request = self.comm.Irecv(staging.recv_buf, source=0, tag=MPI.ANY_TAG)
        tag, wait_s = self.receive_reply(request, staging, "initial weights from the parameter server (rank 0)")
        comm_s = 0.0
        batches = self.batches()
        while tag == Tag.WEIGHTS:
            t0 = time.perf_counter()
            epoch, idx = next(batches)
            x, y = self.dataset.batch("train", idx, rng)      # (B, C, H, W) float32, (B,) int64, host
            x, y = ops.asarray(x), ops.asarray(y, y.dtype)    # cupy: host -> device; numpy: the same arrays
            loss, correct = model.forward_backward(x, y)      # gradient written into staging.grads
            staging.finish_compute()                          # cupy: device sync point
            if self.slowdown > 1:  # --straggler: emulate a device `slowdown` times slower than this one
                time.sleep((self.slowdown - 1) * (time.perf_counter() - t0))
            t1 = time.perf_counter()
            self.step += 1
            push.stamp(Tag.PUSH, rank, step=self.step, version=self.version, samples=idx.size, epoch=epoch,
                       correct=correct, loss=loss, compute_s=t1 - t0, comm_s=comm_s, wait_s=wait_s)
            staging.before_send()  # cupy: gradient device->host (pinned) or header host->device (CUDA-aware)
            request = self.comm.Irecv(staging.recv_buf, source=0, tag=MPI.ANY_TAG)  # weights buffer owned by MPI
            sending = self.comm.Isend(staging.send_buf, dest=0, tag=int(Tag.PUSH))  # gradient buffer owned by MPI
            t2 = time.perf_counter()
            tag, wait_s = self.receive_reply(
                request, staging, f"reply to push step {self.step} from the parameter server (rank 0)")
            t3 = time.perf_counter()
            wait(sending, f"completion of push step {self.step}", rank, cfg.comm_timeout)
            comm_s = (t2 - t1) + (time.perf_counter() - t3)
        # STOP: the model's params hold the final weights
        loss_sum, correct, count = evaluate(model, self.dataset, self.test_idx, cfg.eval_batch_size)
        result = Message(0).stamp(Tag.EVAL, rank, samples=count, correct=correct, loss=loss_sum)
        sending = self.comm.Isend(result.buf, dest=0, tag=int(Tag.EVAL))
        wait(sending, "completion of the EVAL send", rank, cfg.comm_timeout)
