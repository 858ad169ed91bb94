"""Image decoding in worker processes for `mpiasgd.data.convert.convert_image_folder`: results in order, a
bounded number in flight, and workers that leave without a word when the converting process is gone.

    with Decoders(decode, workers=8) as pool:
        for image in pool.imap(paths, chunksize=64):   # decode(path) for each path, in order
            ...

Why not `multiprocessing.Pool`: its workers share two queues guarded by named semaphores, so a conversion
killed with SIGKILL (the OOM killer, a node lost) left each worker printing a BrokenPipeError traceback and
the resource tracker warning of leaked semaphores. Here each worker has a pipe of its own and no semaphore:
an orphaned worker reads EOF, or finds the pipe broken when it sends, and exits with status 0, silent.
Workers start with multiprocessing's forkserver method (they never inherit the converter's threads or its
open HDF5 file) and ignore SIGINT: Ctrl-C reaches the whole process group, and the converter stops them.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

AHEAD = 2  # chunks of paths queued per worker: one decoding, one waiting, so no worker idles between chunks


def _serve(conn: Any, decode: Callable[[str], np.ndarray]) -> None:
    """A worker's loop (worker processes only): receive a list of paths, send back ("ok", [decode(p) ...]) or
    ("error", the exception), until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the converter unwinds and terminates the workers
    try:
        while True:
            paths = conn.recv()
            try:
                reply: tuple[str, Any] = ("ok", [decode(p) for p in paths])
            except Exception as e:  # a DataError naming the image: raised again in the converter
                reply = ("error", e)
            conn.send(reply)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the converter closed the pipe, or is gone
        return


class Decoders:
    """`workers` processes that each run `decode` (picklable: a module-level function or a functools.partial of
    one) on chunks of paths sent over their own pipe. Started by `__enter__`, terminated by `__exit__` (also on
    an error: workers still decoding are stopped, not waited for).

    decode(path) returns a uint8 array (here (3, S, S)); an exception it raises (DataError) is raised again by
    `imap` in the converter. A worker that dies (killed, out of memory) is a ChildProcessError naming it.
    """

    def __init__(self, decode: Callable[[str], np.ndarray], workers: int) -> None:
        self.decode, self.workers = decode, workers
        self.procs: list[Any] = []
        self.conns: list[Any] = []

    def __enter__(self) -> Decoders:
        ctx = multiprocessing.get_context("forkserver")
        try:
            for _ in range(self.workers):
                ours, theirs = ctx.Pipe()
                self.conns.append(ours)
                proc = ctx.Process(target=_serve, args=(theirs, self.decode), daemon=True)
                proc.start()
                self.procs.append(proc)
                theirs.close()  # the worker's end lives in the worker only: its EOF means this process is gone
        except BaseException:  # the workers started so far go too
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()

    def imap(self, paths: list[str], chunksize: int) -> Iterator[np.ndarray]:
        """decode(path) for each of `paths`, in order. Chunk k of `chunksize` paths goes to worker k % workers;
        at most AHEAD chunks per worker are in flight, so memory holds at most
        AHEAD * workers * chunksize decoded images besides the one being consumed."""
        chunks = [paths[i:i + chunksize] for i in range(0, len(paths), chunksize)]
        sent = 0
        for k, chunk in enumerate(chunks):
            while sent < min(len(chunks), k + AHEAD * self.workers):
                try:
                    self.conns[sent % self.workers].send(chunks[sent])
                except (BrokenPipeError, ConnectionResetError):
                    raise self._died(sent % self.workers, chunks[sent]) from None
                sent += 1
            try:
                kind, value = self.conns[k % self.workers].recv()
            except (EOFError, ConnectionResetError):
                raise self._died(k % self.workers, chunk) from None
            if kind == "error":
                raise value
            yield from value

    def _died(self, w: int, chunk: list[str]) -> ChildProcessError:
        """The error of worker `w` found dead while it had `chunk` to decode."""
        self.procs[w].join(timeout=5)
        return ChildProcessError(f"image decoding process {self.procs[w].pid} ended (exit status "
                                 f"{self.procs[w].exitcode}) while decoding {chunk[0]} and the {len(chunk) - 1} "
                                 "images after it")
