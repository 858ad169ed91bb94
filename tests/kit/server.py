"""Rank 0 driven in-process through the fake communicator: a server on 2 workers and P = 6 parameters,
crafted pushes, one message served at a time, the replies read back."""

from __future__ import annotations

import numpy as np

from kit.fakempi import Network, rank0
from mpiasgd.comms import Backoff, probe
from mpiasgd.comms.protocol import HEADER_BYTES, Message, Tag
from mpiasgd.comms.wire import encode, wire_dtype
from mpiasgd.config import Config
from mpiasgd.runlog import RunLog

P = 6


def make_server(tmp_path, num_workers=2, **overrides):
    cfg = Config(**{"lr": 0.5, "momentum": 0.0, "weight_decay": 0.0, "lr_schedule": "constant", "warmup_epochs": 0.0,
                    "epochs": 0, "max_pushes": 100, "snapshot_interval": 0, "progress": False, "comm_timeout": 2.0,
                    **overrides})
    net = Network(num_workers + 1)
    log = RunLog.create(str(tmp_path / "run.h5"), {"config": cfg.to_json()}, [], P, flush_interval=60)
    params = np.arange(P, dtype=np.float32)
    server = rank0(net.comm(0), cfg, params, np.ones(P, np.float32), num_workers, 100, log)
    return server, net, log


def push(net, worker, step, version, grad, samples=10, loss=1.0, wire="fp32", **fields):
    """Post a PUSH of float32 `grad` from `worker`, in wire format `wire` (encoded: --wire fp16|bf16)."""
    msg = Message(len(grad), wire).stamp(Tag.PUSH, worker, step=step, version=version, samples=samples,
                                         loss=loss, **fields)
    encode(wire, np.ascontiguousarray(grad, np.float32), msg.payload)
    net.post(worker, 0, Tag.PUSH, msg.buf)
    return msg


def serve_one(server):
    server.handle(*probe(server.comm, 0, 1.0, "test message", Backoff()))


def reply(net, worker, wire="fp32"):
    """The last message the server sent to `worker`: (tag, header, payload), the payload as it travelled
    (16-bit values with --wire fp16|bf16: decode it for the weights)."""
    source, tag, data = net.pending(worker)[-1]
    assert source == 0
    msg = Message((len(data) - HEADER_BYTES) // wire_dtype(wire).itemsize, wire)
    msg.buf[:] = np.frombuffer(data, np.uint8)
    return Tag(tag), msg.header, msg.payload.copy()
