"""Wire format of the A-SGD protocol between the parameter server (rank 0) and the workers.

Every message is ONE contiguous byte buffer sent with buffer-based MPI (never pickle):

    [ header: HEADER, HEADER_BYTES = 160 bytes ][ payload: `count` float32 values ]

(`--wire fp16|bf16`, async and ssp: the payloads of PUSH, WEIGHTS and STOP carry their `count` values
in 2 bytes each, float16 or bfloat16 (`mpiasgd.comms.wire`); the header is the same. Both sides know
the format from the config, and a message's size is checked against it on arrival.)

The header makes each message self-describing: kind, sender, step, the weight version, loss,
sample count and timings travel in the same message as the gradient or weights they describe, so a
push can never be matched with another sender's figures. `check()` verifies every arrival: magic,
tag, sender, size.

Message flow, async and ssp modes (GPU A-SGD of Paine et al. 2013, n_fetch = n_push = nsync):

    server -> worker  WEIGHTS  (version v, lr, params)      initial pull, and the reply to every push
                                                             (a resumed run's initial pull: flag RESUME,
                                                             the worker's step, cursor and elapsed)
    worker -> server  PUSH     (base version v, gradient    one outstanding push per worker; the
                               or accumulated update)        payload is an update when nsync > 1
    server -> worker  STOP     (final version, params)       reply to a push once the run must end
                                                             (flag PREEMPT: a signal, skip the EVAL)
    worker -> server  EVAL     (loss sum, correct, correct5, its slice of the test set, final weights
                               count)
    server -> worker  WEIGHTS  flag EVALUATE, `epoch` = n    --eval-interval: evaluation n is due; the worker
                                                             evaluates these weights (async: the reply; easgd:
                                                             the center) with the buffers they carry, then
    worker -> server  EVAL     flag EVALUATE, step = n,      before its next push (0 images: abandoned on a
                               version, compute_s = seconds  signal); ALIVE meanwhile, as for the final one
    worker -> server  ERROR    (UTF-8 traceback)             a worker failed; the server logs, acks
    server -> worker  ERROR_ACK                              log closed, the job may now abort
    server -> worker  LOST     (header only: step = the      (ULFM, async: `mpiasgd.comms.ulfm`) a worker died;
                               dead worker's rank, version =  one per death, before the next WEIGHTS or STOP;
                               the deaths so far)             the worker deals itself a share of the dead one's
                                                             data and test slice (`mpiasgd.data.sampler`)

Sharded parameter server (`--servers S`, async, ssp and easgd; `mpiasgd.comms.shard_cut`): shard 0 is rank 0,
shard s >= 1 is rank N + s. Every shard exchanges WEIGHTS, PUSH and STOP with every worker as above, on its
own slice of count_s values (shard 0's messages also carry the B layer buffers) and with its own version
counter: a push to shard s carries the version of shard s's slice it was computed from (easgd: the push
carries that slice of x_i, the reply that slice of the center). A worker posts its
S receives, then its S pushes, and waits for all S replies. EVAL, ALIVE (worker -> server) and ERROR go
to rank 0 only. Besides:

    worker -> shard s  FINISH     (header only, step)           the reply to this step was STOP from some
                                                                 shard and WEIGHTS from s: s answers STOP with
                                                                 its final slice once it has stopped applying
    rank 0 -> shard    SHARD_STOP (header only; flag PREEMPT)   rank 0 decided the run stops (only rank 0
                                                                 decides): the shard processes no more pushes
                                                                 until SHARD_FINAL and answers
    shard -> rank 0    SHARD_STOPPED (step = rows; STOP_STEP    each worker's last step the shard processed
                                      rows: worker, step)        before it heard SHARD_STOP
    rank 0 -> shard    SHARD_FINAL (the same rows)              once every shard answered: each worker's largest
                                                                 such step (rank 0's own included); every shard
                                                                 applies each worker's pushes up to it, drops
                                                                 later ones, and once all have arrived answers
                                                                 every push and FINISH with STOP
    rank 0 -> shard    SHARD_PAUSE (header only)                an interval checkpoint is due: as after
                                                                 SHARD_STOP, the shard holds every push
    shard -> rank 0    SHARD_PAUSED (as SHARD_STOPPED)          each worker's last step it processed before
                                                                 it heard SHARD_PAUSE
    rank 0 -> shard    SHARD_FINAL (as after the stop)          the shard applies each worker's pushes up to
                                                                 it and holds later ones
    rank 0 -> shard    FETCH      (step = request number;       send your slice now (snapshot, checkpoint);
                                   flag RESUME)                  RESUME (the paused checkpoint's): once every
                                                                 agreed push is applied, then process the held
                                                                 pushes and go on
    shard -> rank 0    SLICE      (step = request number,       its params then its velocity (zeros without
                                   version, samples; 2 x size    momentum), always float32
                                   values)
    shard -> rank 0    SHARD_ROWS (step = rows, version,        its push rows (ShardPushRow bytes) every
                                   samples, elapsed = its clock  --flush-interval and at least every
                                   at the send; flags PREEMPT,   --comm-timeout / 4; PREEMPT: a signal reached
                                   FINAL)                        the shard; FINAL: its last batch (after END)
    rank 0 -> shard    ALIVE      (header only)                 every --comm-timeout / 4: rank 0 lives (the
                                                                 shard's own wait for messages times out)
    rank 0 -> shard    RESTORE    (version, samples, elapsed;   --resume, before the shard starts: its slice
                                   params, velocity, then the    of the checkpoint's params and velocity, its
                                   workers' WORKER_STATE rows)   version, every worker's step and cursor
    rank 0 -> shard    END        (header only)                 after the final snapshot and checkpoint: the
                                                                 shard sends its last SHARD_ROWS and ends
    shard -> rank 0    ERROR      as a worker's                 the shard failed; rank 0 logs, acks, aborts

The stop with S shards: rank 0 decides between two pushes of its own, but a push in flight may reach shard
s before s hears the decision (applied there) and rank 0 after it, or the other way round. So the shards
agree on one set of pushes (SHARD_STOPPED, SHARD_FINAL): each worker's pushes up to the largest step any
shard had processed when it heard of the stop. A worker has one push in flight, sent to every shard at once,
so every push of that set reaches every shard; each applies those it had not, drops later ones, and only
then answers STOP (and FETCH). Every shard ends at the same version, and every worker evaluates the same
final weights. An interval checkpoint is the same agreement as a pause (SHARD_PAUSE, SHARD_PAUSED,
SHARD_FINAL, then FETCH flag RESUME): every shard applies the same pushes, its slice is taken, and the pushes
beyond the agreed steps, held meanwhile, are processed after it; so the checkpoint is one consistent cut.

Sync mode (workers allreduce among themselves; rank 0 only logs): after the initial WEIGHTS,

    worker -> server  REPORT   (step, loss, timings, flags)  header only, one per worker per step
    worker -> server  SNAPSHOT (version, params)             the first worker, every snapshot interval
                                                             and once more (flag FINAL) at the end
    worker -> server  CHECKPOINT (step, weights and         the first worker, every checkpoint interval
                                 velocity, 2P values)       and at the end (rank 0 writes the file)
    server -> worker  STOP     (header only)                 the run ends: after the worker's last REPORT,
                                                             or at once (flag PREEMPT) on a signal
    worker -> server  EVAL     flag EVALUATE, step = n      --eval-interval: every worker evaluates the same
                                                             step (decided alike on the allreduced clock and the
                                                             step count), after its REPORT; the first worker's
                                                             SNAPSHOT of that step carries flag EVALUATE
    worker -> server  EVAL, ERROR as above

Pipeline mode (module k of replica n on rank 1 + n*K + k; see `mpiasgd.modes.pipeline`): after the
initial WEIGHTS (the unit's module slice), every iteration

    unit k -> unit k+1  ACTIVATION (minibatch m, flags LAST,    on the replica's pipeline communicator
                                    snapshot iteration, output)
    unit k -> unit k-1  GRADIENT   (minibatch m, d loss / d input)
    unit   -> server    REPORT     (iteration, delay, timings)   header only
    unit   -> server    SNAPSHOT   (module slice)                replica 0, at announced iterations and
                                                                 at the end (flag FINAL); module 0's flag
                                                                 EVALUATE: rank 0 evaluates the assembled
                                                                 whole-model snapshot (--eval-interval)
    unit   -> server    CHECKPOINT (module weights, velocity)    replica 0, after every drain (interval,
                                                                 end, flag PREEMPT on a signal)
    server -> module 0  STOP       (header only)                 after its last iteration, or at once
                                                                 (flag PREEMPT) on a signal
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import numpy as np

from mpiasgd.comms.wire import NAMES as WIRE_NAMES
from mpiasgd.comms.wire import array_module, wire_dtype

MAGIC = 0x41534744  # "ASGD"


class Tag(IntEnum):
    """MPI tags; one per message kind, unique values. An unknown tag is a ProtocolError."""

    WEIGHTS = 11
    PUSH = 12
    STOP = 13
    EVAL = 14
    ERROR = 15
    ERROR_ACK = 16
    REPORT = 17
    SNAPSHOT = 18
    ACTIVATION = 19
    GRADIENT = 20
    CHECKPOINT = 21
    ALIVE = 22  # header only, worker -> rank 0: busy evaluating (final or --eval-interval; resets the stall watch);
                # rank 0 -> a parameter-server shard (--servers): rank 0 lives
    FINISH = 23      # header only, worker -> shard: my final slice, please (the reply to this step was STOP elsewhere)
    SHARD_STOP = 24  # header only, rank 0 -> shard: the run stops, apply no more pushes
    FETCH = 25       # header only, rank 0 -> shard: send your slice (SLICE)
    SLICE = 26       # shard -> rank 0: its params and velocity
    SHARD_ROWS = 27  # shard -> rank 0: a batch of its push rows
    RESTORE = 28     # rank 0 -> shard (--resume): its slice of the checkpoint
    END = 29         # header only, rank 0 -> shard: send your last rows and end
    SHARD_STOPPED = 30  # shard -> rank 0, after SHARD_STOP: the last step it applied of every worker (STOP_STEP rows)
    SHARD_FINAL = 31    # rank 0 -> shard: the last step of every worker that every shard applies (STOP_STEP rows)
    SHARD_PAUSE = 32    # header only, rank 0 -> shard: an interval checkpoint; hold pushes until SHARD_FINAL
    SHARD_PAUSED = 33   # shard -> rank 0, after SHARD_PAUSE: the last step it applied of every worker (STOP_STEP rows)
    LOST = 34           # header only, rank 0 -> worker (ULFM, async): a worker died (step = its rank, version = the
                        # notice's number; flag JOINED: it is back, --respawn); sent before the next WEIGHTS or STOP


class Flag(IntEnum):
    """Bits of the header's `flags` field."""

    SKIPPED = 1      # REPORT: the step was skipped by every worker (a non-finite gradient somewhere)
    NONFINITE = 2    # REPORT: this worker's own gradient was not finite; PUSH (--servers S > 1, on all S pushes):
                     # some value of the worker's whole push (its P parameters', as encoded for the wire; not the
                     # layer buffers) is not finite: every shard rejects it, as a push whose own slice is not finite
    LAST = 4         # REPORT: the workers' last step (the stopping rule fired)
    FINAL = 8        # SNAPSHOT: the final weights (stored, not logged as an interval snapshot); SHARD_ROWS: the
                     # shard's last batch
    DELTA = 16       # PUSH: the payload is an accumulated update (nsync > 1), not a gradient
    WARMUP = 32      # REPORT (pipeline): no delayed gradient has reached this module yet, no update
    END = 64         # REPORT (pipeline): this unit's last iteration
    RESUME = 128     # WEIGHTS (initial): a resumed run; step, cursor and elapsed continue (sync, pipeline:
                     # a CHECKPOINT with the optimizer state follows); FETCH (--servers): the slice of a paused
                     # shard (an interval checkpoint), after which it processes the pushes it held
    PREEMPT = 256    # PUSH: a signal reached this worker; REPORT: the run ends on a signal (sync: every
                     # worker's last step; pipeline: module 0's stop and each unit's end; a unit's own signal);
                     # STOP and CHECKPOINT: the run ends on a signal, skip the final evaluation, exit 75;
                     # SHARD_ROWS: a signal reached this shard; SHARD_STOP: the run ends on a signal
    EVALUATE = 512   # WEIGHTS (async, ssp, easgd): evaluate these weights on the test slice before the next
                     # local steps (--eval-interval), header `epoch` = the evaluation's number; EVAL: the result
                     # of such a periodic evaluation (not the final one); SNAPSHOT (sync: the weights the workers
                     # evaluate at this step; pipeline, module 0: rank 0 evaluates the assembled snapshot)
    JOINED = 1024    # LOST (--respawn): the worker it names is back (a replacement took its rank), not dead


class ProtocolError(RuntimeError):
    """A message broke the protocol: unknown tag, wrong size, wrong sender, or out of order."""


HEADER = np.dtype([
    ("magic", "<u4"),
    ("tag", "<u4"),
    ("sender", "<i8"),      # rank of the sender
    ("step", "<i8"),        # PUSH: worker's step (1, 2, ...); WEIGHTS/STOP: step of the push answered;
                            # EVAL with flag EVALUATE: the evaluation's number; FINISH: the worker's step;
                            # FETCH/SLICE: the request's number; SHARD_ROWS: rows in the payload
    ("version", "<i8"),     # PUSH: version the gradient was computed from; WEIGHTS/STOP: version sent;
                            # SLICE, SHARD_ROWS, RESTORE: the shard's version
    ("samples", "<i8"),     # PUSH: minibatch size; EVAL: images evaluated; SLICE, SHARD_ROWS, RESTORE: images
                            # the shard has applied (its schedule's clock); initial WEIGHTS (sync): images trained
    ("epoch", "<i8"),       # PUSH: the worker's epoch over its shard; WEIGHTS with flag EVALUATE: the evaluation's
                            # number
    ("correct", "<i8"),     # PUSH: correct predictions in the minibatch; EVAL: over the slice; SHARD_ROWS, SLICE:
                            # the shard's wire bytes pushed (rank0.shard_hub.WIRE_FIELDS)
    ("count", "<i8"),       # values in the payload (float32; 16-bit ones with --wire fp16|bf16)
    ("loss", "<f8"),        # PUSH: minibatch mean loss; EVAL: summed loss
    ("compute_s", "<f8"),   # PUSH: seconds of data + forward + backward for this gradient
    ("comm_s", "<f8"),      # PUSH: seconds spent posting and completing MPI calls for the previous pull
    ("wait_s", "<f8"),      # PUSH: seconds idle waiting for the weights this gradient used
    ("lr", "<f8"),          # WEIGHTS: step size for a worker's local steps (nsync > 1); REPORT: step size used
    ("flags", "<i8"),       # Flag bits
    ("digest", "<u8"),      # REPORT (sync, pipeline): `weights_digest` of the worker's weights after the step
    ("cursor", "<i8"),      # PUSH/REPORT/CHECKPOINT: minibatches the worker has drawn from its shard (its data
                            # position); initial WEIGHTS of a resumed run: where to continue
    ("elapsed", "<f8"),     # CHECKPOINT: training seconds at the step; initial WEIGHTS: seconds already trained;
                            # RESTORE: the same; SHARD_ROWS: the shard's clock when it sent them
    ("data_s", "<f8"),      # PUSH/REPORT: seconds of compute_s the step waited for its minibatch (input pipeline)
    ("correct5", "<i8"),    # EVAL: images whose label is among the 5 largest logits (top-5); SHARD_ROWS,
                            # SLICE: the shard's wire bytes pulled
    ("peak", "<f8"),        # PUSH (--wire fp16): the largest magnitude among the values the worker encoded (NaN
                            # where one is NaN; `wire.encode_peak`), so the server can name a value beyond fp16's
                            # range, which arrives as inf; 0 otherwise
])
HEADER_BYTES = -(-HEADER.itemsize // 16) * 16  # 160: rounded up to 16 bytes so the payload stays aligned


class Message:
    """A send or receive buffer: `buf` (uint8, what MPI sees), `header` (HEADER view), `payload` (a view of
    `count` values in wire format `wire`: float32 by default; float16, or uint16 holding bfloat16, with
    --wire fp16|bf16, see `mpiasgd.comms.wire`). ValueError for an unknown `wire`.

    The buffer belongs to MPI while a request on it is pending: fill it before posting the send,
    read it only after the receive completed.
    """

    def __init__(self, count: int, wire: str = "fp32") -> None:
        dtype = wire_dtype(wire)
        self.wire = wire
        self.buf = np.zeros(HEADER_BYTES + dtype.itemsize * count, dtype=np.uint8)
        self.header = self.buf[: HEADER.itemsize].view(HEADER)[0]
        self.payload = self.buf[HEADER_BYTES:].view(dtype)
        self.header["magic"] = MAGIC
        self.header["count"] = count

    @property
    def count(self) -> int:
        return self.payload.size

    def stamp(self, tag: Tag, sender: int, **fields: float) -> Message:
        """Set the tag, the sender and the given header fields; returns self."""
        self.header["tag"] = int(tag)
        self.header["sender"] = sender
        for key, value in fields.items():
            self.header[key] = value
        return self


def message_bytes(count: int, wire: str = "fp32") -> int:
    """Size in bytes of a message carrying `count` values in wire format `wire` (4 bytes each for fp32, 2 for
    fp16 and bf16)."""
    return HEADER_BYTES + wire_dtype(wire).itemsize * count


def parse_tag(tag: int, source: int, rank: int) -> Tag:
    """The Tag for an MPI tag number; ProtocolError naming the receiving rank and the source if unknown."""
    try:
        return Tag(tag)
    except ValueError:
        raise ProtocolError(
            f"rank {rank}: message from rank {source} has unknown tag {tag}; "
            f"known tags: {', '.join(f'{t.name}={t.value}' for t in Tag)}") from None


def check_size(tag: Tag, source: int, rank: int, nbytes: int, count: int, wire: str = "fp32", whose: str = "") -> None:
    """Raise ProtocolError unless a message of `nbytes` carries exactly `count` values in wire format `wire`;
    `whose` (e.g. " for parameter-server shard 1 of 2 (parameters [192, 1000))") ends the message."""
    expected = message_bytes(count, wire)
    if nbytes != expected:
        raise ProtocolError(
            f"rank {rank}: {tag.name} message from rank {source} is {nbytes} bytes, expected {expected} "
            f"({HEADER_BYTES}-byte header + {count} {WIRE_NAMES[wire]} values"
            f"{'' if wire == 'fp32' else f': --wire {wire}'}){whose}")


def check(msg: Message, tag: Tag, source: int, rank: int) -> None:
    """Validate a received message's header against the MPI envelope; raise ProtocolError naming what differs."""
    h = msg.header
    if int(h["magic"]) != MAGIC:
        raise ProtocolError(f"rank {rank}: {tag.name} message from rank {source} has a bad magic number "
                            f"{int(h['magic']):#x} (not an mpiasgd message)")
    if int(h["tag"]) != tag:
        raise ProtocolError(f"rank {rank}: message from rank {source} arrived on tag {tag.name} "
                            f"but its header says tag {int(h['tag'])}")
    if int(h["sender"]) != source:
        raise ProtocolError(f"rank {rank}: {tag.name} message from rank {source} claims sender {int(h['sender'])}")
    if int(h["count"]) != msg.count:
        raise ProtocolError(f"rank {rank}: {tag.name} message from rank {source} declares {int(h['count'])} "
                            f"values, expected {msg.count}")


def error_message(sender: int, text: str) -> Message:
    """An ERROR message: UTF-8 `text` padded into the payload; header `samples` holds its byte length."""
    data = text.encode("utf-8", "replace")
    msg = Message(-(-len(data) // 4)).stamp(Tag.ERROR, sender, samples=len(data))
    msg.buf[HEADER_BYTES : HEADER_BYTES + len(data)] = np.frombuffer(data, np.uint8)
    return msg


def error_text(msg: Message) -> str:
    """The text of an ERROR message built by `error_message`."""
    n = min(int(msg.header["samples"]), msg.buf.size - HEADER_BYTES)
    return msg.buf[HEADER_BYTES : HEADER_BYTES + n].tobytes().decode("utf-8", "replace")


DIGEST_CHUNK = 1 << 22  # values per pass of `weights_digest` (32 MiB of uint64 scratch)


def weights_digest(*vectors: Any) -> int:
    """The REPORT `digest` by which rank 0 checks that replicas agree: the sum over i of b_i (2 i + 1) mod 2^64,
    b_i the bits of the i-th float32 value of `vectors` (1-D, C-contiguous; numpy or cupy, all of one kind)
    taken in turn, its high 32 bits folded onto the low ones. Integer sums are exact in any order, so a GPU
    reduces it where the weights are (8 bytes cross to the host, not the weights) and every device and the
    host give the same digest of the same bits; one value changed, or two swapped, changes the sum (the
    multipliers are odd, so invertible mod 2^64). Not cryptographic: it tells copies apart, as the CRC-32 of
    host copies it replaced did, at a fraction of the cost (no copy of the weights per step)."""
    xp = array_module(vectors[0])
    total, offset = xp.zeros((), xp.uint64), 0
    for vector in vectors:
        words = vector.view(xp.uint32)
        for start in range(0, words.size, DIGEST_CHUNK):
            part = words[start:start + DIGEST_CHUNK].astype(xp.uint64)
            odd = xp.arange(offset + start, offset + start + part.size, dtype=xp.uint64)
            odd *= xp.uint64(2)
            odd += xp.uint64(1)
            part *= odd
            total += part.sum(dtype=xp.uint64)
        offset += words.size
    digest = int(total)
    return (digest ^ (digest >> 32)) & 0xFFFFFFFF


STOP_STEP = np.dtype([("worker", "<i8"), ("step", "<i8")])  # a row of SHARD_STOPPED and SHARD_FINAL


def rows_message(tag: Tag, sender: int, rows: np.ndarray, **fields: float) -> Message:
    """A message whose payload carries `rows` (a structured array) as bytes, padded to whole float32 values;
    header `step` = the number of rows, plus `fields`. `rows_of` reads them back."""
    data = np.ascontiguousarray(rows).view(np.uint8).reshape(-1)
    msg = Message(-(-data.size // 4)).stamp(tag, sender, step=len(rows), **fields)
    msg.buf[HEADER_BYTES : HEADER_BYTES + data.size] = data
    return msg


def rows_of(msg: Message, dtype: np.dtype, source: int, rank: int) -> np.ndarray:
    """The rows of `dtype` a `rows_message` carries (a copy); ProtocolError when its size does not hold the
    `step` rows its header declares."""
    n = int(msg.header["step"])
    nbytes = n * dtype.itemsize
    if n < 0 or -(-nbytes // 4) != msg.count:
        raise ProtocolError(f"rank {rank}: {Tag(int(msg.header['tag'])).name} message from rank {source} declares "
                            f"{n} rows of {dtype.itemsize} bytes in {msg.count * 4} payload bytes")
    return msg.buf[HEADER_BYTES : HEADER_BYTES + nbytes].copy().view(dtype)
