"""Loops run in threads for the in-process tests: every rank's loop a daemon thread over the fake MPI
(`kit.fakempi`), joined under a timeout, so a hung loop fails the test instead of hanging it."""

from __future__ import annotations

import threading
import time

JOIN_TIMEOUT = 20.0  # seconds for every thread of a test to end (a healthy run takes well under 1 s)


class Loop(threading.Thread):
    """`call()` (a loop's run) in a daemon thread; keeps what it returned (`result`) or raised (`error`)."""

    def __init__(self, name: str, call) -> None:
        super().__init__(name=name, daemon=True)
        self.call, self.result, self.error = call, None, None

    def run(self) -> None:
        try:
            self.result = self.call()
        except Exception as e:  # the test reports it
            self.error = e


def start(loops: dict) -> list[Loop]:
    """Start {name: call} in threads, in the order given."""
    threads = [Loop(name, call) for name, call in loops.items()]
    for thread in threads:
        thread.start()
    return threads


def join(threads: list[Loop], timeout: float = JOIN_TIMEOUT) -> None:
    """Join every thread within `timeout` seconds in all; assert each ended, and without an exception."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"still running after {timeout:g} s: {hung}"
    errors = {t.name: repr(t.error) for t in threads if t.error is not None}
    assert not errors, errors


def run_threads(loops: dict, timeout: float = JOIN_TIMEOUT) -> list[Loop]:
    """Run {name: call} in threads and join them (`join`); returns the threads (their `result`s)."""
    threads = start(loops)
    join(threads, timeout)
    return threads
