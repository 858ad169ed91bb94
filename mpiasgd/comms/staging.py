"""Staging: where a worker's weights and gradients live relative to the MPI buffers.

Staging (one object per worker, chosen once; the worker loop calls the same three methods on all):

    host      numpy backend: params ARE the receive payload, grads ARE the send payload; no copies
    pinned    cupy backend: MPI buffers in pinned host memory (reused every step); weights copied
              host->device after each receive, the gradient device->host before each send
    device    cupy backend with a CUDA-aware MPI: the message buffers live on the device, params and
              grads are views into them; only the 160-byte header crosses to and from the host
              (and sync mode's gradient: Open MPI's MPI_Iallreduce takes no device buffers)

ShardedStaging (`--servers S > 1`; async, ssp, easgd): one message each way per parameter-server shard
(`mpiasgd.comms.shard_cut`). The model still binds one contiguous float32 vector (P + B: the parameters,
then the layer buffers), so the worker copies: after its S replies arrived, each payload into its slice
of params (shard 0's payload is its slice, then the B buffers); before its S pushes, each slice of grads
into that shard's push payload. A 16-bit wire decodes the whole vector after the copies in and encodes it
(through the error feedback, as with one server) before the copies out, so the rounding is that of one
server's. On a GPU worker (cupy) the messages live in pinned host memory and each slice crosses on its
own (the CUDA-aware staging is not used with S > 1: the same copies go through pinned memory).

Each shard checks only its own slice for values that are not finite, so before its S pushes the sharded
staging checks the whole push as the shards will decode it (`all_finite`: the float32 gradient with fp32, the
16-bit values themselves otherwise, where a value beyond fp16's range has become inf) and sets flag NONFINITE on
every push's header if any of the P parameters' values is not; every shard then rejects the push, so all keep
applying the same pushes. One pass over the values the worker holds, a reduction on the device for cupy (no
copy). Its cost against the whole `before_send`: docs/benchmarks/server.md, "The wire codecs".
The layer buffers after the parameters are not checked (no server checks them).

Every loop that moves model data through MPI uses these objects: the A-SGD and EASGD workers (one
`Staging` per exchange buffer), sync mode's allreduce (`grads_to_mpi`), and the pipeline units
(`module_staging`: the module's weights and velocity for snapshots and checkpoints).

With a 16-bit wire format (`--wire fp16|bf16`, async and ssp; `mpiasgd.comms.wire`) the model still
computes in float32, so params and grads are float32 arrays of their own on every staging (the host
one too): after_receive decodes the received payload into params, before_send encodes grads into the
send payload (through the worker's `ErrorFeedback` with --wire-error-feedback); fp16 also stamps the largest
magnitude it encoded on the push (header `peak`, `wire.encode_peak`), by which the server names a value beyond
fp16's range, which travels as inf. The pinned staging
does both on the device, so each host <-> device copy moves the 16-bit payload, half the bytes; the
device staging decodes from and encodes into its device message buffers. With fp32 every staging is
as described above: the host one copies nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpiasgd.comms.protocol import HEADER, HEADER_BYTES, Flag, Message, message_bytes
from mpiasgd.comms.wire import ErrorFeedback, array_module, decode, encode_peak, wire_dtype

# a 16-bit value (bits b) is inf or NaN iff its exponent bits are all ones: b & 0x7FFF >= this
NONFINITE_BITS = {"fp16": 0x7C00, "bf16": 0x7F80}
CHECK_BLOCK = 262144  # values per block of `all_finite` on 16-bit host values (the uint16 scratch: 512 KiB, in L2)


def all_finite(values: Any, wire: str = "fp32", scratch: Any = None) -> bool:
    """Whether every value of `values` is finite as it travels in wire format `wire`: float32 values (fp32), or
    the encoded 16-bit values themselves (fp16: float16, bf16: uint16), numpy or cupy (reduced on the device;
    only the answer crosses to the host). fp32: one dot product, as the server's `finite_square`, the exact
    elementwise check only when the dot is not finite. 16-bit: the largest `bits & 0x7FFF` against
    NONFINITE_BITS, through `scratch` (uint16, at least one value; as many as `values` for one pass on the
    device) block by block, stopping at the first block that holds one."""
    xp = array_module(values)
    if wire == "fp32":
        with np.errstate(over="ignore", invalid="ignore"):
            square = float(values.dot(values))
        return math.isfinite(square) or bool(xp.isfinite(values).all())
    bits, limit, n = values.view(xp.uint16), NONFINITE_BITS[wire], scratch.size
    for i in range(0, bits.size, n):
        part = bits[i:i + n]
        masked = scratch[:part.size]
        xp.bitwise_and(part, xp.uint16(0x7FFF), out=masked)
        if int(masked.max()) >= limit:
            return False
    return True


def message_in(buf: np.ndarray, count: int, wire: str = "fp32") -> Message:
    """A protocol Message of `count` values in wire format `wire` whose buffer is `buf` (uint8,
    message_bytes(count, wire) long, e.g. pinned host memory) instead of a fresh numpy allocation."""
    nbytes = message_bytes(count, wire)
    if buf.dtype != np.uint8 or buf.shape != (nbytes,) or not buf.flags.c_contiguous:
        raise ValueError(f"message_in: buf must be contiguous uint8 of {nbytes} bytes, got {buf.dtype} {buf.shape}")
    msg = Message(0, wire)  # header fields set; then rehomed onto `buf`
    buf[:] = 0
    buf[:HEADER_BYTES] = msg.buf[:HEADER_BYTES]
    msg.buf = buf
    msg.header = buf[:HEADER.itemsize].view(HEADER)[0]
    msg.payload = buf[HEADER_BYTES:].view(wire_dtype(wire))
    msg.header["count"] = count
    return msg


@dataclass(frozen=True)
class Transfers:
    """The device primitives staging needs (CuPy's by default; tests pass numpy stand-ins).

    empty(n): (n,) float32 device array; empty_bytes(n): (n,) uint8 device array; pinned(n): (n,)
    uint8 numpy array in page-locked host memory; to_device(dst, src) / to_host(dst, src): copy a
    whole host array into a device array and back; synchronize(): wait for the current stream.

    The copy stream (None where there is none: every copy then runs in order on the current stream):
    to_device_async(dst, src) queues the host-to-device copy on a stream of its own, after the work queued so
    far on the current stream (which may still read dst), and returns its event; wait_on_device(event) makes
    the current stream's later work wait for it (the host goes on); wait_on_host(event) blocks the host until
    it has happened (src may then be written again).
    """

    empty: Callable[[int], Any]
    empty_bytes: Callable[[int], Any]
    pinned: Callable[[int], np.ndarray]
    to_device: Callable[[Any, np.ndarray], None]
    to_host: Callable[[np.ndarray, Any], None]
    synchronize: Callable[[], None]
    to_device_async: Callable[[Any, np.ndarray], Any] | None = None
    wait_on_device: Callable[[Any], None] | None = None
    wait_on_host: Callable[[Any], None] | None = None


def cupy_transfers() -> Transfers:
    """Transfers on the current CuPy device (call `use_device` first)."""
    import cupy

    def pinned(n: int) -> np.ndarray:
        mem = cupy.cuda.alloc_pinned_memory(n)  # kept alive by the array (frombuffer holds it)
        return np.frombuffer(mem, np.uint8, n)

    def to_host(dst: np.ndarray, src: Any) -> None:
        src.get(out=dst)

    copies = cupy.cuda.Stream(non_blocking=True)  # host -> device copies beside the compute stream

    def to_device_async(dst: Any, src: np.ndarray) -> Any:
        copies.wait_event(cupy.cuda.get_current_stream().record())  # after the kernels that may still read dst
        runtime = cupy.cuda.runtime
        runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes, runtime.memcpyHostToDevice, copies.ptr)
        return copies.record()

    return Transfers(empty=lambda n: cupy.empty(n, dtype=np.float32),
                     empty_bytes=lambda n: cupy.empty(n, dtype=np.uint8),
                     pinned=pinned,
                     to_device=lambda dst, src: dst.set(src),
                     to_host=to_host,
                     synchronize=lambda: cupy.cuda.get_current_stream().synchronize(),
                     to_device_async=to_device_async,
                     wait_on_device=lambda event: cupy.cuda.get_current_stream().wait_event(event),
                     wait_on_host=lambda event: event.synchronize())


class Staging:
    """How a worker's weights and gradient meet MPI. Kind "host" (numpy backend): no copies at all.

    Attributes: `weights` and `push` (protocol Messages of `count` values in wire format `wire`, whose
    headers the worker reads and stamps), `recv_buf` / `send_buf` (what MPI receives into / sends from),
    `params` / `grads` (float32 (count,): what the model binds). The worker calls, every step, in this order:

        after_receive()    the receive into recv_buf completed: make weights.header and params current
        finish_compute()   backward was launched: wait until the gradient exists (device sync point)
        before_send()      push is stamped: make send_buf hold header and gradient

    fp32: params ARE weights.payload and grads ARE push.payload, so all three do nothing. fp16, bf16:
    params and grads are float32 arrays; after_receive decodes the payload into params, before_send
    encodes grads into the push payload, the first P values through `feedback` (the worker's
    ErrorFeedback, shared by its stagings; None: plain rounding). ValueError for `feedback` with fp32.
    """

    kind = "host"

    def __init__(self, count: int, wire: str = "fp32", feedback: ErrorFeedback | None = None) -> None:
        if feedback is not None and wire == "fp32":
            raise ValueError("error feedback needs a 16-bit wire format (fp16 or bf16), the wire is fp32")
        self.wire, self.feedback = wire, feedback
        self.weights, self.push = Message(count, wire), Message(count, wire)
        self.recv_buf, self.send_buf = self.weights.buf, self.push.buf
        if wire == "fp32":  # the model computes in the message buffers themselves
            self.params, self.grads = self.weights.payload, self.push.payload
        else:               # the model computes in float32: decoded from, encoded into the 16-bit payloads
            self.params, self.grads = np.zeros(count, np.float32), np.zeros(count, np.float32)

    def after_receive(self) -> None:
        if self.wire != "fp32":
            decode(self.wire, self.weights.payload, self.params)

    def defer_landing(self) -> bool:
        """(--overlap with one server) Let `after_receive` queue its host-to-device copy on the copy stream and
        return, the copy overlapping the push's device-to-host copy; the worker then calls `ready()` before
        anything reads params, and `before_receive()` before MPI receives into recv_buf again. True where
        this staging does so (pinned, with a copy stream); here: False, nothing to copy."""
        return False

    def ready(self) -> None:
        """(after defer_landing) Make params hold the weights received: the compute stream waits for the copy
        (the host does not), then a 16-bit payload is decoded. Nothing to do otherwise."""

    def before_receive(self) -> None:
        """(after defer_landing) Before MPI receives into recv_buf again: wait until the copy out of it is done."""

    def finish_compute(self) -> None:
        pass

    def before_send(self) -> None:
        if self.wire != "fp32":
            self.encode_grads(self.push.payload)

    def encode_grads(self, out: Any) -> None:
        """(16-bit wire) grads encoded into `out` (the payload, or its device copy), through the error feedback;
        the push's header `peak` set to the largest magnitude encoded (fp16; `wire.encode_peak`)."""
        if self.feedback is not None:
            self.push.header["peak"] = self.feedback.encode(self.grads, out)
        else:
            self.push.header["peak"] = encode_peak(self.wire, self.grads, out)

    def grads_to_mpi(self) -> Any:
        """(sync mode, whose wire is always fp32) After finish_compute: the array an allreduce of the gradient
        works on."""
        return self.grads

    def grads_from_mpi(self) -> None:
        """(sync mode) After the allreduce completed: make `grads` hold its result."""


class PinnedStaging(Staging):
    """cupy backend, MPI without CUDA support: host messages in pinned memory, model on the device.

    after_receive: weights payload host->device into params. finish_compute: stream sync.
    before_send: grads device->host into the push payload. Buffers are allocated once and reused.
    With `defer_landing()` (--overlap, one server) the host->device copy runs on the copy stream while the
    push's device->host copy runs on the compute stream: the two directions overlap; `ready()` orders the next
    round's kernels after it.
    16-bit wire: `coded` (device, `count` values of the wire's dtype) is where the payload is copied to
    and decoded from on the device, and where grads are encoded into before the copy back: each copy
    moves 2 bytes a value.
    """

    kind = "pinned"

    def __init__(self, count: int, dev: Transfers, wire: str = "fp32", feedback: ErrorFeedback | None = None) -> None:
        if feedback is not None and wire == "fp32":
            raise ValueError("error feedback needs a 16-bit wire format (fp16 or bf16), the wire is fp32")
        self.dev, self.wire, self.feedback = dev, wire, feedback
        self.weights = message_in(dev.pinned(message_bytes(count, wire)), count, wire)
        self.push = message_in(dev.pinned(message_bytes(count, wire)), count, wire)
        self.recv_buf, self.send_buf = self.weights.buf, self.push.buf
        self.params, self.grads = dev.empty(count), dev.empty(count)
        dtype = wire_dtype(wire)
        self.coded = None if wire == "fp32" else dev.empty_bytes(count * dtype.itemsize).view(dtype)
        self.deferred = False
        self.landing = self.pending = None  # the copy's event: for the compute stream, for the host

    def defer_landing(self) -> bool:
        self.deferred = self.dev.to_device_async is not None
        return self.deferred

    def after_receive(self) -> None:
        target = self.params if self.coded is None else self.coded  # a 16-bit payload: half the bytes
        if self.deferred:
            self.landing = self.pending = self.dev.to_device_async(target, self.weights.payload)
            return
        self.dev.to_device(target, self.weights.payload)  # pinned -> device; done before MPI reuses it
        if self.coded is not None:
            decode(self.wire, self.coded, self.params)  # on the device

    def ready(self) -> None:
        if self.landing is None:
            return
        self.dev.wait_on_device(self.landing)
        self.landing = None
        if self.coded is not None:
            decode(self.wire, self.coded, self.params)

    def before_receive(self) -> None:
        if self.pending is not None:
            self.dev.wait_on_host(self.pending)
            self.pending = None

    def finish_compute(self) -> None:
        self.dev.synchronize()  # device sync point: the gradient is complete before it is copied

    def before_send(self) -> None:
        if self.coded is None:
            self.dev.to_host(self.push.payload, self.grads)  # device -> pinned; MPI sends it next
        else:
            self.encode_grads(self.coded)                    # on the device, then the 16-bit copy
            self.dev.to_host(self.push.payload, self.coded)

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
    calls that do not take device buffers, with or without UCX. 16-bit wire: params and grads are float32
    device arrays of their own, decoded from and encoded into the payloads of the device buffers.
    """

    kind = "device"

    def __init__(self, count: int, dev: Transfers, wire: str = "fp32", feedback: ErrorFeedback | None = None) -> None:
        if feedback is not None and wire == "fp32":
            raise ValueError("error feedback needs a 16-bit wire format (fp16 or bf16), the wire is fp32")
        self.dev, self.wire, self.feedback = dev, wire, feedback
        self.weights, self.push = Message(count, wire), Message(count, wire)
        nbytes = message_bytes(count, wire)
        self.recv_buf, self.send_buf = dev.empty_bytes(nbytes), dev.empty_bytes(nbytes)
        dtype = wire_dtype(wire)
        self.received = self.recv_buf[HEADER_BYTES:].view(dtype)  # the device payloads
        self.sending = self.send_buf[HEADER_BYTES:].view(dtype)
        if wire == "fp32":
            self.params, self.grads = self.received, self.sending
        else:  # decoded from / encoded into the device payloads (16-bit wire)
            self.params, self.grads = dev.empty(count), dev.empty(count)

    def after_receive(self) -> None:
        self.dev.to_host(self.weights.buf[:HEADER_BYTES], self.recv_buf[:HEADER_BYTES])
        if self.wire != "fp32":
            decode(self.wire, self.received, self.params)  # on the device (done before before_send's sync)

    def finish_compute(self) -> None:
        self.dev.synchronize()  # device sync point

    def before_send(self) -> None:
        if self.wire != "fp32":
            self.encode_grads(self.sending)  # on the device; the sync below completes it before MPI reads it
        self.dev.to_device(self.send_buf[:HEADER_BYTES], self.push.buf[:HEADER_BYTES])
        self.dev.synchronize()  # the header copy is complete before MPI reads send_buf

    def grads_to_mpi(self) -> Any:
        self.dev.to_host(self.push.payload, self.grads)  # a non-blocking reduction of device memory is unsupported
        return self.push.payload

    def grads_from_mpi(self) -> None:
        self.dev.to_device(self.grads, self.push.payload)


class ShardedStaging:
    """(--servers S > 1) How a worker's weights and gradient meet the S messages of the parameter-server shards
    of `cut` (a ShardCut). Kind "host" (`dev` None: numpy) or "pinned" (cupy: messages in pinned host memory,
    `dev` the Transfers).

    Attributes: `weights[s]` and `push[s]` (protocol Messages of `cut.count(s)` values in wire format `wire`),
    `recv_bufs[s]` / `send_bufs[s]` (their buffers, what MPI receives into / sends from), `params` / `grads`
    (float32 (P + B,): what the model binds, on the device for cupy). The worker calls, as on a `Staging`:

        after_receive()    every shard's reply has arrived: params <- the S payloads (decoded)
        finish_compute()   backward was launched: wait until the gradient exists (device sync point)
        before_send()      the S pushes are stamped: each push payload <- its slice of grads (encoded); every
                           push's flag NONFINITE set (cleared) when a parameter's value is not finite (is) as
                           it travels (`all_finite`); `nonfinite` says which

    `feedback` is the worker's ErrorFeedback over the P parameters (None: plain rounding); ValueError for
    `feedback` with fp32.
    """

    def __init__(self, cut: Any, wire: str = "fp32", feedback: ErrorFeedback | None = None,
                 dev: Transfers | None = None) -> None:
        if feedback is not None and wire == "fp32":
            raise ValueError("error feedback needs a 16-bit wire format (fp16 or bf16), the wire is fp32")
        self.cut, self.wire, self.feedback, self.dev = cut, wire, feedback, dev
        self.kind = "host" if dev is None else "pinned"
        counts = [cut.count(s) for s in range(cut.shards)]
        n = cut.num_params + cut.num_buffers
        dtype = wire_dtype(wire)
        if dev is None:
            self.weights = [Message(c, wire) for c in counts]
            self.push = [Message(c, wire) for c in counts]
            self.params, self.grads = np.zeros(n, np.float32), np.zeros(n, np.float32)
        else:
            self.weights = [message_in(dev.pinned(message_bytes(c, wire)), c, wire) for c in counts]
            self.push = [message_in(dev.pinned(message_bytes(c, wire)), c, wire) for c in counts]
            self.params, self.grads = dev.empty(n), dev.empty(n)
        # 16-bit wire: the whole vector in wire format, decoded from (received) and encoded into (sent) at once
        self.received = self.sending = None
        if wire != "fp32":
            self.received, self.sending = (np.zeros(n, dtype) if dev is None else
                                           dev.empty_bytes(n * dtype.itemsize).view(dtype) for _ in range(2))
        self.recv_bufs = [m.buf for m in self.weights]
        self.send_bufs = [m.buf for m in self.push]
        self.nonfinite = False  # whether the last push (before_send) held a parameter's value that is not finite
        self.scratch = None     # 16-bit wire: all_finite's (host: one block; device: the P values, one pass)
        if wire != "fp32":
            P = cut.num_params
            self.scratch = (np.empty(min(P, CHECK_BLOCK), np.uint16) if dev is None else
                            dev.empty_bytes(2 * P).view(np.uint16))

    def pieces(self, s: int) -> list[tuple[int, int, int]]:
        """(start, stop, offset) of each piece of shard `s`'s payload: vector[start:stop] is
        payload[offset:offset + stop - start] (shard 0: its parameters, then the buffers)."""
        a, b = self.cut.slice(s)
        out = [(a, b, 0)]
        if s == 0 and self.cut.num_buffers:
            P = self.cut.num_params
            out.append((P, P + self.cut.num_buffers, b - a))
        return out

    def after_receive(self) -> None:
        into = self.params if self.received is None else self.received
        for s, msg in enumerate(self.weights):
            for a, b, o in self.pieces(s):
                if self.dev is None:
                    into[a:b] = msg.payload[o:o + b - a]
                else:
                    self.dev.to_device(into[a:b], msg.payload[o:o + b - a])  # pinned -> device, slice by slice
        if self.received is not None:
            decode(self.wire, self.received, self.params)  # (on the device for cupy)

    def finish_compute(self) -> None:
        if self.dev is not None:
            self.dev.synchronize()  # device sync point: the gradient is complete before it is copied

    def before_send(self) -> None:
        out, largest = self.grads, 0.0
        if self.sending is not None:  # as one server's: the whole vector encoded, through the error feedback
            out = self.sending
            if self.feedback is not None:
                largest = self.feedback.encode(self.grads, out)
            else:
                largest = encode_peak(self.wire, self.grads, out)
        # each shard sees its slice only: every push says whether the whole one is finite (on the device for cupy)
        self.nonfinite = not all_finite(out[:self.cut.num_params], self.wire, self.scratch)
        for s, msg in enumerate(self.push):
            flags = int(msg.header["flags"]) & ~Flag.NONFINITE
            msg.header["flags"] = flags | (Flag.NONFINITE if self.nonfinite else 0)
            msg.header["peak"] = largest  # the whole push's (fp16): each shard names a value beyond the range alike
            for a, b, o in self.pieces(s):
                if self.dev is None:
                    msg.payload[o:o + b - a] = out[a:b]
                else:
                    self.dev.to_host(msg.payload[o:o + b - a], out[a:b])  # device -> pinned; MPI sends it next


def make_staging(backend: str, cuda_aware: bool, count: int, dev: Transfers | None = None, wire: str = "fp32",
                 feedback: ErrorFeedback | None = None) -> Staging:
    """The staging of a worker with `count` values per message: host (numpy), pinned or device (cupy), in wire
    format `wire` with the worker's error `feedback` (None: none; it needs fp16 or bf16, else ValueError).

    `dev` defaults to `cupy_transfers()` for the cupy backend.
    """
    if backend != "cupy":  # numpy, cpu: host arrays
        return Staging(count, wire, feedback)
    dev = dev or cupy_transfers()
    return (DeviceStaging if cuda_aware else PinnedStaging)(count, dev, wire, feedback)


def make_sharded_staging(backend: str, cut: Any, dev: Transfers | None = None, wire: str = "fp32",
                         feedback: ErrorFeedback | None = None) -> ShardedStaging:
    """(--servers S > 1) The ShardedStaging of a worker for the shards of `cut`: host (numpy) or pinned (cupy,
    CUDA-aware MPI or not; `dev` defaults to `cupy_transfers()`)."""
    if backend != "cupy":
        return ShardedStaging(cut, wire, feedback)
    return ShardedStaging(cut, wire, feedback, dev or cupy_transfers())
