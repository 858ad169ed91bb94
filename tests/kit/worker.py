"""A worker driven in-process: rank 1 of 2 in a thread on the fake network (the test plays rank 0),
the messages it sends read back, and its gradient computed by hand."""

from __future__ import annotations

import threading
import time

import numpy as np

from kit.fakempi import Network
from kit.runs import B
from mpiasgd.comms.protocol import Message
from mpiasgd.comms.wire import encode
from mpiasgd.config import Config
from mpiasgd.data import ShardSampler
from mpiasgd.model import build_model
from mpiasgd.modes.asgd import AsgdWorker
from mpiasgd.modes.base import WorkerJob


def start_worker(digits, timeout=5.0, **overrides):
    """Worker rank 1 of 2 running in a thread on a fake network; returns (net, sampler, thread, outcome)."""
    cfg = Config(batch_size=B, comm_timeout=timeout, seed=3, **overrides)
    net = Network(3)
    from mpiasgd.modes.registry import load

    sampler = ShardSampler(digits.train_y.size, 2, 0, cfg.seed)
    job = WorkerJob(net.comm(1), cfg, build_model("digits"), digits, sampler, 1, np.arange(20, dtype=np.int64))
    worker = load(cfg.mode).worker(job)
    outcome = {}

    def run():
        try:
            worker.run()
        except Exception as e:  # the test inspects it
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return net, sampler, thread, outcome


def send(net, tag, params, version, step, sender=0, wire="fp32"):
    """Post float32 `params` to worker 1 as rank 0 does, in wire format `wire` (encoded: --wire fp16|bf16)."""
    msg = Message(params.size, wire).stamp(tag, sender, version=version, step=step)
    encode(wire, np.ascontiguousarray(params, np.float32), msg.payload)
    net.post(sender, 1, tag, msg.buf)


def receive(net, tag, count, timeout=10.0, wire="fp32"):
    """The next `tag` message worker 1 sent rank 0, as a Message of `count` values in wire format `wire`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = net.take(0, 1, tag)
        if got is not None:
            msg = Message(count, wire)
            msg.buf[:] = np.frombuffer(got[2], np.uint8)
            return msg
        time.sleep(0.001)
    raise AssertionError(f"no {tag.name} from the worker within {timeout} s")


def reference_grad(params, digits, idx):
    model = build_model("digits")
    w, g = params.copy(), np.zeros_like(params)
    model.bind(w, g)
    x, y = digits.batch("train", idx)
    loss, _ = model.forward_backward(x, y)
    return g, loss


def worker_pair(cfg, digits, params, nworkers=2):
    """Workers 1..nworkers in-process (no communicator), all bound to the one `params` vector."""
    workers = []
    for rank in range(1, nworkers + 1):
        model = build_model("digits")
        model.bind(params, np.zeros(model.num_params, np.float32))
        sampler = ShardSampler(digits.train_y.size, nworkers, rank - 1, cfg.seed)
        workers.append(AsgdWorker(WorkerJob(None, cfg, model, digits, sampler, rank)))
    return workers
