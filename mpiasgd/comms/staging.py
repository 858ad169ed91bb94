"""Staging: where a worker's weights and gradients live relative to the MPI buffers.

Staging (one object per worker, chosen once; the worker loop calls the same three methods on all):

    host      numpy backend: params ARE the receive payload, grads ARE the send payload; no copies
    pinned    cupy backend: MPI buffers in pinned host memory (reused every step); weights copied
              host->device after each receive, the gradient device->host before each send
    device    cupy backend with a CUDA-aware MPI: the message buffers live on the device, params and
              grads are views into them; only the 160-byte header crosses to and from the host
              (and sync mode's gradient: Open MPI's MPI_Iallreduce takes no device buffers)

Every loop that moves model data through MPI uses these objects: the A-SGD and EASGD workers (one
`Staging` per exchange buffer), sync mode's allreduce (`grads_to_mpi`), and the pipeline units
(`module_staging`: the module's weights and velocity for snapshots and checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpiasgd.comms.protocol import HEADER, HEADER_BYTES, Message, message_bytes


def message_in(buf: np.ndarray, count: int) -> Message:
    """A protocol Message of `count` values whose buffer is `buf` (uint8, message_bytes(count) long,
    e.g. pinned host memory) instead of a fresh numpy allocation."""
    if buf.dtype != np.uint8 or buf.shape != (message_bytes(count),) or not buf.flags.c_contiguous:
        raise ValueError(f"message_in: buf must be contiguous uint8 of {message_bytes(count)} bytes, "
                         f"got {buf.dtype} {buf.shape}")
    msg = Message(0)  # header fields set; then rehomed onto `buf`
    buf[:] = 0
    buf[:HEADER_BYTES] = msg.buf[:HEADER_BYTES]
    msg.buf = buf
    msg.header = buf[:HEADER.itemsize].view(HEADER)[0]
    msg.payload = buf[HEADER_BYTES:].view(np.float32)
    msg.header["count"] = count
    return msg


@dataclass(frozen=True)
class Transfers:
    """The device primitives staging needs (CuPy's by default; tests pass numpy stand-ins).

    empty(n): (n,) float32 device array; empty_bytes(n): (n,) uint8 device array; pinned(n): (n,)
    uint8 numpy array in page-locked host memory; to_device(dst, src) / to_host(dst, src): copy a
    whole host array into a device array and back; synchronize(): wait for the current stream.
    """

    empty: Callable[[int], Any]
    empty_bytes: Callable[[int], Any]
    pinned: Callable[[int], np.ndarray]
    to_device: Callable[[Any, np.ndarray], None]
    to_host: Callable[[np.ndarray, Any], None]
    synchronize: Callable[[], None]


def cupy_transfers() -> Transfers:
    """Transfers on the current CuPy device (call `use_device` first)."""
    import cupy

    def pinned(n: int) -> np.ndarray:
        mem = cupy.cuda.alloc_pinned_memory(n)  # kept alive by the array (frombuffer holds it)
        return np.frombuffer(mem, np.uint8, n)

    def to_host(dst: np.ndarray, src: Any) -> None:
        src.get(out=dst)

    return Transfers(empty=lambda n: cupy.empty(n, dtype=np.float32),
                     empty_bytes=lambda n: cupy.empty(n, dtype=np.uint8),
                     pinned=pinned,
                     to_device=lambda dst, src: dst.set(src),
                     to_host=to_host,
                     synchronize=lambda: cupy.cuda.get_current_stream().synchronize())


class Staging:
    """How a worker's weights and gradient meet MPI. Kind "host" (numpy backend): no copies at all.

    Attributes: `weights` and `push` (protocol Messages whose headers the worker reads and stamps),
    `recv_buf` / `send_buf` (what MPI receives into / sends from), `params` / `grads` (what the
    model binds). The worker calls, every step, in this order:

        after_receive()    the receive into recv_buf completed: make weights.header and params current
        finish_compute()   backward was launched: wait until the gradient exists (device sync point)
        before_send()      push is stamped: make send_buf hold header and gradient

    Here params ARE weights.payload and grads ARE push.payload, so all three do nothing.
    """

    kind = "host"

    def __init__(self, count: int) -> None:
        self.weights, self.push = Message(count), Message(count)
        self.recv_buf, self.send_buf = self.weights.buf, self.push.buf
        self.params, self.grads = self.weights.payload, self.push.payload

    def after_receive(self) -> None:
        pass

    def finish_compute(self) -> None:
        pass

    def before_send(self) -> None:
        pass

    def grads_to_mpi(self) -> Any:
        """(sync mode) After finish_compute: the array an allreduce of the gradient works on."""
        return self.grads

    def grads_from_mpi(self) -> None:
        """(sync mode) After the allreduce completed: make `grads` hold its result."""


class PinnedStaging(Staging):
    """cupy backend, MPI without CUDA support: host messages in pinned memory, model on the device.

    after_receive: weights payload host->device into params. finish_compute: stream sync.
    before_send: grads device->host into the push payload. Buffers are allocated once and reused.
    """

    kind = "pinned"

    def __init__(self, count: int, dev: Transfers) -> None:
        self.dev = dev
        self.weights = message_in(dev.pinned(message_bytes(count)), count)
        self.push = message_in(dev.pinned(message_bytes(count)), count)
        self.recv_buf, self.send_buf = self.weights.buf, self.push.buf
        self.params, self.grads = dev.empty(count), dev.empty(count)

    def after_receive(self) -> None:
        self.dev.to_device(self.params, self.weights.payload)  # pinned -> device; done before MPI reuses it

    def finish_compute(self) -> None:
        self.dev.synchronize()  # device sync point: the gradient is complete before it is copied

    def before_send(self) -> None:
        self.dev.to_host(self.push.payload, self.grads)  # device -> pinned; MPI sends it next

    def grads_to_mpi(self) -> Any:
        self.dev.to_host(self.push.payload, self.grads)  # the allreduce runs on the pinned host copy
        return self.push.payload

    def grads_from_mpi(self) -> None:
        self.dev.to_device(self.grads, self.push.payload)


class DeviceStaging(Staging):
    """cupy backend with a CUDA-aware MPI: messages on the device, params/grads views into their payloads.

    Host `weights` / `push` keep only the headers: after_receive copies the received header
    device->host (HEADER_BYTES), before_send the stamped header host->device, then syncs the stream,
    so MPI never reads device memory a kernel or copy is still writing. The sync-mode gradient
    allreduce still runs on a host copy (`push.payload`): Open MPI lists MPI_Iallreduce among the
    calls that do not take device buffers, with or without UCX.
    """

    kind = "device"

    def __init__(self, count: int, dev: Transfers) -> None:
        self.dev = dev
        self.weights, self.push = Message(count), Message(count)
        self.recv_buf, self.send_buf = dev.empty_bytes(message_bytes(count)), dev.empty_bytes(message_bytes(count))
        self.params = self.recv_buf[HEADER_BYTES:].view(np.float32)
        self.grads = self.send_buf[HEADER_BYTES:].view(np.float32)

    def after_receive(self) -> None:
        self.dev.to_host(self.weights.buf[:HEADER_BYTES], self.recv_buf[:HEADER_BYTES])

    def finish_compute(self) -> None:
        self.dev.synchronize()  # device sync point

    def before_send(self) -> None:
        self.dev.to_device(self.send_buf[:HEADER_BYTES], self.push.buf[:HEADER_BYTES])
        self.dev.synchronize()  # the header copy is complete before MPI reads send_buf

    def grads_to_mpi(self) -> Any:
        self.dev.to_host(self.push.payload, self.grads)  # a non-blocking reduction of device memory is unsupported
        return self.push.payload

    def grads_from_mpi(self) -> None:
        self.dev.to_device(self.grads, self.push.payload)


def make_staging(backend: str, cuda_aware: bool, count: int, dev: Transfers | None = None) -> Staging:
    """The staging of a worker with `count` parameters: host (numpy), pinned or device (cupy).

    `dev` defaults to `cupy_transfers()` for the cupy backend.
    """
    if backend == "numpy":
        return Staging(count)
    dev = dev or cupy_transfers()
    return DeviceStaging(count, dev) if cuda_aware else PinnedStaging(count, dev)
