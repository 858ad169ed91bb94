"""Waiting on MPI without burning a core, and with a timeout that names what was awaited.

`MPI.Request.Wait` busy-polls a whole core. With 1 parameter server + 2 workers on 2 cores that
core is taken from a worker, so every wait here polls `Test`/`Improbe` and sleeps between polls,
backing off from 10 us to a ceiling. The ceiling adapts to the traffic: a tenth of the typical gap
between messages, between 0.1 ms and 2 ms. A server whose workers push every 0.5 ms (digits)
answers within about 0.1 ms; one whose workers push every 100 ms (CIFAR-10) wakes 500 times a
second at most, a fraction of a percent of a core, and answers within 2 ms.

A parameter server that owns a core need not sleep at all: `--server-wait spin` (`Spin`) polls without
pausing, since `time.sleep` of 10 us to 2 ms oversleeps by tens of microseconds to milliseconds under load
(a worker waiting for a reply computed in 0.17 ms waited 1.2-1.3 ms a push on an H200 node).
`server_wait` resolves `--server-wait auto` from the ranks and cores of rank 0's node.
"""

from __future__ import annotations

import os
import time
from typing import Any

from mpi4py import MPI

from mpiasgd.comms.ulfm import RankFailed, failed_ranks, is_failure


class CommTimeout(TimeoutError):
    """A wait outlived its timeout; the message names the rank and what it waited for."""


PAUSE_GAP = 5.0  # seconds between two polls of one wait (normally at most milliseconds) that mean this process
                 # was paused (SIGSTOP/SIGCONT, a suspended job) or starved: not time the peer was silent


class Deadline:
    """The timeout of one wait, on a clock that stops while this process is paused.

    `expired()` is called after each poll that found nothing. A gap of more than PAUSE_GAP seconds
    since the previous call is taken off the time waited: the peer's message may have arrived
    meanwhile and needs a few more polls to be seen, so a pause of this rank is not the peer's
    silence (a job suspended for longer than --comm-timeout resumes instead of timing out).
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.start = self.last = time.perf_counter()

    def waited(self) -> float:
        """Seconds waited so far, pauses of this process excepted."""
        now = time.perf_counter()
        if now - self.last > PAUSE_GAP:
            self.start += now - self.last
        self.last = now
        return now - self.start

    def expired(self) -> bool:
        return self.waited() > self.timeout


class Backoff:
    """Pause between polls: yield at first, then sleep for doubling intervals up to a ceiling.

    The ceiling is `shortest`..`longest` seconds: a tenth of the moving average of the intervals
    between `reset()` calls (one per message received), so waits are cheap when messages are rare
    and prompt when they are frequent.
    """

    def __init__(self, first: float = 1e-5, shortest: float = 1e-4, longest: float = 2e-3) -> None:
        self.first = first
        self.shortest = shortest
        self.longest = longest
        self.ceiling = shortest
        self.delay = 0.0
        self.gap = 0.0          # moving average of the interval between messages, seconds
        self.last = time.perf_counter()

    def reset(self) -> None:
        now = time.perf_counter()
        self.gap = 0.9 * self.gap + 0.1 * (now - self.last)
        self.last = now
        self.ceiling = min(self.longest, max(self.shortest, self.gap / 10))
        self.delay = 0.0

    def pause(self) -> None:
        time.sleep(self.delay)  # sleep(0) yields the core
        self.delay = min(self.ceiling, max(self.first, 2 * self.delay))


class Spin:
    """A pause between polls that does not sleep (`--server-wait spin`): for a server rank that owns a core,
    so the next message is taken the moment it arrives. It yields the core (`os.sched_yield`: about a
    microsecond where nothing else waits for it) so that on a node busier than it looked at start a worker
    or another job still gets to run. The interface of `Backoff`."""

    def reset(self) -> None:
        pass

    def pause(self) -> None:
        os.sched_yield()


def server_wait(requested: str, ranks: int, cores: int) -> tuple[str, str]:
    """("spin" | "backoff", why) for `--server-wait requested` ("auto" | "spin" | "backoff", checked by the
    config: `mpiasgd.modes.registry.SERVER_WAITS`) on a node where `ranks` ranks of the job run and may use
    `cores` cores between them (the union of their CPU affinities).

    auto spins when the node has a core per rank (cores >= ranks), else backs off: a spinning server on a
    node with fewer cores than ranks takes a worker's core. `why` is one clause for the start-up line.
    """
    node = f"{ranks} rank{'s' * (ranks != 1)} on this node, {cores} core{'s' * (cores != 1)}"
    if requested != "auto":
        return requested, f"--server-wait {requested}; {node}"
    if cores >= ranks:
        return "spin", f"--server-wait auto: {node}, a core per rank"
    return "backoff", f"--server-wait auto: {node}, fewer cores than ranks (a spinning server would take a worker's)"


def pauser(kind: str) -> Backoff | Spin:
    """The pause between a server rank's polls: `Spin()` for "spin", else a `Backoff()` ("backoff")."""
    return Spin() if kind == "spin" else Backoff()


def wait(request: Any, what: str, rank: int, timeout: float, status: Any = None) -> float:
    """Complete `request` by polling; returns the seconds waited.

    `request` None counts as complete. Raises CommTimeout("rank R: no WHAT after T s") if it did not
    complete within `timeout` seconds.
    """
    start = time.perf_counter()
    if request is None or request.Test(status):
        return 0.0
    backoff = Backoff()
    deadline = Deadline(timeout)
    while not request.Test(status):
        waited = deadline.waited()
        if waited > timeout:
            raise CommTimeout(f"rank {rank}: no {what} after {timeout:.0f} s")
        # the longer the wait so far, the longer the nap: answers within ~5 % of the wait, at most 2 ms late
        backoff.ceiling = min(backoff.longest, max(backoff.shortest, waited / 20))
        backoff.pause()
    return time.perf_counter() - start


def wait_all(requests: list, what: str, rank: int, timeout: float) -> None:
    """Complete every request in `requests` (None entries skipped) within `timeout` seconds in total."""
    deadline = time.perf_counter() + timeout
    for req in requests:
        if req is not None:
            wait(req, what, rank, max(0.0, deadline - time.perf_counter()))


def probe(comm: Any, rank: int, timeout: float, what: str, backoff: Backoff | Spin, idle: Any = None) -> tuple:
    """Poll for the next message from any source with any tag; returns (MPI.Message, MPI.Status).
    Under ULFM a rank's death raises RankFailed naming every failed rank (acknowledged: the next probe works).

    `idle()` is called between polls (the server flushes its log and checks its clocks there);
    raises CommTimeout naming `what` when a poll `timeout` seconds after the start finds no message
    (a pause of this process, SIGSTOP or a suspended job, does not count: `Deadline`).
    """
    status = MPI.Status()
    deadline = Deadline(timeout)
    while True:
        try:
            message = comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        except MPI.Exception as e:  # ULFM (`mpiasgd.comms.ulfm`): a rank died; the failure acknowledged
            if not is_failure(e):
                raise
            raise RankFailed(failed_ranks(comm), f"rank {rank} waited for a {what}") from None
        if message is not None:
            backoff.reset()
            return message, status
        # judged right after a poll that found nothing: a pause of this process (SIGSTOP) inside idle()
        # does not time out a wait whose messages arrived in the meantime
        if deadline.expired():
            raise CommTimeout(f"rank {rank}: no {what} after {timeout:.0f} s")
        if idle is not None:
            idle()
        backoff.pause()


class Interval:
    """A duty due every `seconds` on a caller's clock (seconds; 0 = never due): snapshots, checkpoints,
    the progress bar, the stall watch, on rank 0 and on the workers alike.

    `due(now)` is True once `seconds` have passed since the last time it was True (or since
    `restart(now)`, for a duty also done for other reasons, e.g. a checkpoint on a signal), and
    restarts the interval when it is.
    """

    def __init__(self, seconds: float, start: float = 0.0) -> None:
        self.seconds = seconds
        self.last = start

    def due(self, now: float) -> bool:
        if not self.seconds or now - self.last < self.seconds:
            return False
        self.last = now
        return True

    def restart(self, now: float) -> None:
        self.last = now
