"""Everything a loop needs to talk MPI: the wire protocol, waits that name what they wait for,
send slots, intervals, and staging between the model's arrays and the MPI buffers.

    protocol   message layout (header + float32 payload), tags, flags, checks (`mpiasgd.comms.protocol`)
    wire       --wire fp16|bf16: the 16-bit payload codecs (numpy and cupy) and error feedback
    waits      wait / wait_all / probe without burning a core, CommTimeout, Deadline, Backoff, Interval
    slots      SendSlots: buffers reused only after their send completed
    staging    Staging (host, pinned, device): how weights and gradients meet MPI
    ulfm       fault tolerance (mpiexec --with-ft ulfm): is it on, is an error a rank's death, which ranks died
"""

from mpiasgd.comms.protocol import (
    HEADER,
    HEADER_BYTES,
    Flag,
    Message,
    ProtocolError,
    Tag,
    check,
    check_size,
    error_message,
    error_text,
    message_bytes,
    parse_tag,
    weights_digest,
)
from mpiasgd.comms.slots import SendSlots
from mpiasgd.comms.staging import Staging, make_staging
from mpiasgd.comms.waits import PAUSE_GAP, Backoff, CommTimeout, Deadline, Interval, probe, wait, wait_all

CommTimeout.__module__ = __name__  # its public name in tracebacks: mpiasgd.comms.CommTimeout

__all__ = ["HEADER", "HEADER_BYTES", "PAUSE_GAP", "Backoff", "CommTimeout", "Deadline", "Flag", "Interval",
           "Message", "ProtocolError", "SendSlots", "Staging", "Tag", "check", "check_size", "error_message",
           "error_text", "make_staging", "message_bytes", "parse_tag", "probe", "wait", "wait_all", "weights_digest"]
