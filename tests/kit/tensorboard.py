"""Reading TensorBoard event files back (what `--tensorboard` wrote), without TensorBoard itself: the
TFRecord framing parsed here, each record an `Event` protocol buffer of tensorboardX's own protos."""

from __future__ import annotations

import os
import struct


def events(logdir) -> list:
    """Every Event of every event file in `logdir`, files in name order (their creation time), records in
    file order."""
    from tensorboardX.proto import event_pb2

    out = []
    for name in sorted(os.listdir(logdir)):
        if not name.startswith("events.out.tfevents."):
            continue
        with open(os.path.join(logdir, name), "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):  # [u64 length][u32 crc of the length][record][u32 crc of the record]
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[at + 12:at + 12 + length])
            out.append(event)
            at += 12 + length + 4
    return out


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in the event files of `logdir`, in the order written."""
    found: dict[str, list[tuple[int, float]]] = {}
    for event in events(logdir):
        for value in event.summary.value:
            found.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
    return found
