"""`mpiasgd train` with one fault injected by monkeypatching (no test hooks live in the product).

    mpiexec -n 3 python tests/mpi/scripts/fault.py KIND RANK [train flags...]

KIND: raise      rank RANK (a worker) raises RuntimeError("injected failure") in its 5th minibatch
      hang       rank RANK (a worker) hangs (sleeps for an hour) in its 20th minibatch
      server     parameter-server rank RANK (0, or a shard's: --servers) raises RuntimeError("injected server
                 failure") at its 5th push
      badtag     worker RANK sends a message with unknown tag 99 instead of training
      badsize    worker RANK sends a PUSH 8 bytes too short instead of training
      nan        worker RANK pushes NaN gradients from its 3rd step on
      nan1       worker RANK computes a NaN gradient in its 3rd step only
      perturb    worker RANK's weights are nudged after its 3rd local SGD step (sync, pipeline replicas)
      nanmodule  pipeline unit RANK's module gradients are NaN from its 3rd backward on
      preempt    rank RANK (a worker or a pipeline module 0) sends itself SIGUSR1 in its 10th minibatch
      sloweval   worker RANK takes 3 s longer over its final evaluation
      longeval   worker RANK's final evaluation takes 6 s more, in 12 batches of 0.5 s (each reported as
                 evaluation progress, as real batches are)
      logfull    rank 0's run log flushes fail as on a full disk (h5py's RuntimeError, errno 28) from the
                 30th dataset flush on; checkpoints still fit
      diskfull   as logfull, and from then on checkpoints fail too (ENOSPC)
      nocreate   rank 0 cannot create the run log (h5py's RuntimeError, errno 28)
"""

import sys

import numpy as np
from mpi4py import MPI

from mpiasgd.cli import main
from mpiasgd.comms import protocol
from mpiasgd.comms.protocol import Message, Tag

kind, target, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rank = MPI.COMM_WORLD.Get_rank()

if kind == "preempt" and rank == target:
    import os
    import signal

    from mpiasgd.data import MinibatchStream

    original_next, drawn = MinibatchStream.next, [0]

    def signalled_next(self):  # the step takes its 10th minibatch (the prefetch thread read it before)
        drawn[0] += 1
        if drawn[0] == 10:
            os.kill(os.getpid(), signal.SIGUSR1)  # what `scancel --signal=USR1` delivers
        return original_next(self)

    MinibatchStream.next = signalled_next

if kind == "sloweval" and rank == target:
    import time

    from mpiasgd.modes import base as worker

    original_evaluate = worker.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(3.0)
        return original_evaluate(*args, **kwargs)

    worker.evaluate = slow_evaluate

if kind == "longeval" and rank == target:
    import time

    from mpiasgd.modes import base as worker

    original_evaluate = worker.evaluate

    def long_evaluate(model, dataset, idx, batch_size, on_batch=None):
        for _ in range(12):
            time.sleep(0.5)
            if on_batch is not None:
                on_batch()
        return original_evaluate(model, dataset, idx, batch_size, on_batch)

    worker.evaluate = long_evaluate

if kind in ("logfull", "diskfull", "nocreate") and rank == 0:
    import h5py

    ENOSPC = ("Unable to flush dataset (file write failed: time = Tue Dec  1 14:55:29 2026\n, filename = "
              "'x.h5', file descriptor = 16, errno = 28, error message = 'No space left on device', buf = "
              "0x5577ffc8e7e5, total write size = 268011, bytes this sub-write = 268011, offset = 3141632)")
    full = [False]

    if kind == "nocreate":
        def no_dataset(self, *args, **kwargs):
            raise RuntimeError(ENOSPC)

        h5py.Group.create_dataset = no_dataset
    else:
        original_flush, flushes = h5py.Dataset.flush, [0]

        def failing_flush(self):
            flushes[0] += 1
            if flushes[0] >= 30:
                full[0] = True
                raise RuntimeError(ENOSPC)
            return original_flush(self)

        h5py.Dataset.flush = failing_flush

    if kind == "diskfull":
        import os

        from mpiasgd import checkpoint

        original_replace = os.replace

        def no_room(src, dst):
            if full[0]:
                raise OSError(28, "No space left on device")
            return original_replace(src, dst)

        checkpoint.os.replace = no_room  # (os itself: rank 0 renames nothing else once the disk is full)

if kind in ("raise", "hang") and rank == target:
    from mpiasgd.data import Dataset

    original, calls = Dataset.batch, [0]

    def failing_batch(self, split, idx, rng=None):
        calls[0] += 1
        if kind == "raise" and calls[0] == 5:
            raise RuntimeError("injected failure")
        if kind == "hang" and calls[0] == 20:
            import time
            time.sleep(3600)
        return original(self, split, idx, rng)

    Dataset.batch = failing_batch

if kind == "server" and rank == target:
    from mpiasgd.modes.asgd import AsgdServer

    original_push = AsgdServer.on_push

    def failing_push(self, w, msg):
        if self.rec.version == 4:
            raise RuntimeError("injected server failure")
        return original_push(self, w, msg)

    AsgdServer.on_push = failing_push

if kind in ("nan", "nan1") and rank == target:
    from mpiasgd.model import Model

    original_fb, steps = Model.forward_backward_deferred, [0]  # (what a worker's step calls)

    def nan_forward_backward(self, x, y, minibatch=None):
        out = original_fb(self, x, y, minibatch)
        steps[0] += 1
        if steps[0] == 3 or (kind == "nan" and steps[0] > 3):
            self.grads[:] = np.nan
        return out

    Model.forward_backward_deferred = nan_forward_backward

if kind == "perturb" and rank == target:
    from mpiasgd.optim import LocalSGD

    original_step, calls = LocalSGD.step, [0]

    def nudged_step(self, lr, params=None, grads=None):
        original_step(self, lr, params, grads)
        calls[0] += 1
        if calls[0] == 3:
            (self.model.params if params is None else params)[0] += 1e-3

    LocalSGD.step = nudged_step

if kind == "nanmodule" and rank == target:
    from mpiasgd.modes.pipeline import Module

    original_backward, backwards = Module.backward, [0]

    def nan_backward(self, dy):
        dx = original_backward(self, dy)
        backwards[0] += 1
        if backwards[0] >= 3:
            self.grads[...] = np.nan
        return dx

    Module.backward = nan_backward

if kind in ("badtag", "badsize") and rank == target:
    from mpiasgd.modes.base import WorkerLoop as Worker

    def rogue_run(self):
        comm = self.comm
        if kind == "badtag":
            comm.Send(np.zeros(16, np.uint8), dest=0, tag=99)
        else:
            msg = Message(self.model.num_params).stamp(Tag.PUSH, rank, step=1, version=0, samples=1)
            comm.Send(msg.buf[:-8], dest=0, tag=int(Tag.PUSH))
        assert protocol  # the server must abort the job; wait here to be killed
        import time
        time.sleep(60)

    Worker.run = rogue_run

sys.exit(main(["train", *argv]))
