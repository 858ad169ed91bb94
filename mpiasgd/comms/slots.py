"""Send slots: buffers that non-blocking sends go out from, each reused only after its send completed.

A buffer belongs to MPI while its send is pending. Every loop that sends without waiting (the
workers' pushes and reports, the pipeline's activations and gradients, rank 0's replies) keeps
its buffers in `SendSlots`: `take(i)` completes the send that last used slot `i % n` and hands
back its buffer to be written; `post(i, request)` records the send now reading it. Two slots
double-buffer a stream of messages (message t is written while t - 1 is still in flight).
"""

from __future__ import annotations

from typing import Any

from mpiasgd.comms.waits import wait, wait_all


class SendSlots:
    """`buffers` (any objects: Messages, stagings) each with the send that last read it.

    `what` names the sends in a timeout ("rank R: no completion of WHAT after T s"); `rank` is
    this process's rank and `timeout` the seconds a completion may take (CommTimeout after it).
    """

    def __init__(self, buffers: list, what: str, rank: int, timeout: float) -> None:
        self.buffers = list(buffers)
        self.requests: list[Any] = [None] * len(self.buffers)
        self.what, self.rank, self.timeout = what, rank, timeout

    def __len__(self) -> int:
        return len(self.buffers)

    def add(self, buffer: Any) -> int:
        """One more slot holding `buffer` (a message kept until its send completed); returns its index."""
        self.buffers.append(buffer)
        self.requests.append(None)
        return len(self.buffers) - 1

    def take(self, i: int) -> Any:
        """The buffer of slot `i % n`, once the send that last read it has completed; returns it."""
        i %= len(self.buffers)
        wait(self.requests[i], f"completion of a {self.what} send", self.rank, self.timeout)
        self.requests[i] = None
        return self.buffers[i]

    def post(self, i: int, request: Any) -> None:
        """Record `request`, the send now reading slot `i % n`."""
        self.requests[i % len(self.buffers)] = request

    def send(self, comm: Any, i: int, dest: int, tag: int) -> None:
        """Post slot `i % n`'s Message (its `buf`) to `dest` with `tag`; take(i) must have come first."""
        self.post(i, comm.Isend(self.buffers[i % len(self.buffers)].buf, dest=dest, tag=tag))

    def pending(self) -> list[Any]:
        return [r for r in self.requests if r is not None]

    def drain(self) -> None:
        """Complete every send still in flight (at the end of a loop)."""
        wait_all(self.requests, f"completion of the last {self.what} sends", self.rank, self.timeout)
        self.requests = [None] * len(self.buffers)
