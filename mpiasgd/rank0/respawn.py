"""(`--respawn`, rank 0) A replacement for each worker that dies: started with `MPI_Comm_spawn`, it takes the dead
worker's rank and goes on where that worker stopped.

The wheel's Open MPI (5.0.11) spawns from rank 0 alone (COMM_SELF) in 1.2-2.6 s, also under ULFM; a second
`mpiexec` cannot attach to a running job (docs/training.md, "Workers that die"). The steps, rank 0 on the left:

    spawn        MPI.COMM_SELF.Spawn(python -m mpiasgd <this job's arguments>), merged (`Intercomm_merge`) into
                 a 2-rank communicator: rank 0 is 0, the replacement 1 (`JOINED_RANK`)
    JOIN ->      {"rank": W, "size": the job's ranks, "definition": the network definition, "local_rank": W's}
                 the replacement starts up as worker rank W would (dataset, model, staging: `launch.join`)
    <- JOIN      (error text or None, its WorkerInfo); rank 0 checks it at each tick (`tick`), not waiting
    JOIN ->      {"lost": the workers dead now, "notices": the LOST notices counted so far}: it deals itself
                 shares of the dead workers' data, as the survivors did
    WEIGHTS ->   the current weights, flag RESUME: it continues W's step count and data position

From then on rank 0 reaches it as worker rank W through `RoutedComm`; the other workers are told it is back (a
LOST notice with flag JOINED) and give W's data back from their next epoch. Its staleness counts from this pull.
A replacement that fails to start (its error, its death, or no answer within --model-timeout + --comm-timeout)
is logged (event `respawn_failed`) and the run goes on without it; a rank is replaced at most `MAX_RESPAWNS`
times.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from mpi4py import MPI

from mpiasgd.comms import ulfm
from mpiasgd.comms.routed import JOINED_RANK, RoutedComm

__all__ = ["JOINED_RANK", "JOIN_TAG", "MAX_RESPAWNS", "Respawner", "room_note"]

JOIN_TAG = 99         # the start-up messages between rank 0 and a replacement, on their own communicator
MAX_RESPAWNS = 3      # replacements per worker rank (one that dies at once is not started for ever)
HELLO_BYTES = 1 << 20  # the largest start-up answer (an error text, or the WorkerInfo) a replacement sends


def room_note(comm: Any) -> str:
    """What start-up says when the launcher's allocation has no slot beyond the job's ranks (MPI_UNIVERSE_SIZE,
    the slots Open MPI knows of, at most the job's size): a replacement then starts only where the launcher
    oversubscribes (`--oversubscribe`, which MPI does not tell); "" when there is room or MPI does not say."""
    universe = comm.Get_attr(MPI.UNIVERSE_SIZE)
    size = comm.Get_size()
    if not isinstance(universe, int) or universe > size:
        return ""
    return (f"the allocation has {universe} slot{'s' * (universe != 1)} for the job's {size} ranks: a replacement "
            "needs mpiexec --oversubscribe or a host with free slots")


def kill_here(host: str, pid: int) -> bool:
    """SIGKILL process `pid` if it runs on this host and is ours (its command line runs mpiasgd); True if sent."""
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"mpiasgd" not in f.read():
                return False
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True


class Pending:
    """A replacement spawned for worker rank `w`, starting up: its communicator, the receive of its answer, when
    it was asked for (`died`, monotonic seconds: the death was seen, or the attach came) and when it must have
    answered (`deadline`)."""

    def __init__(self, w: int, inter: Any, comm: Any, request: Any, died: float, deadline: float,
                 origin: str = "") -> None:
        self.w, self.inter, self.comm, self.request, self.died, self.deadline = w, inter, comm, request, died, deadline
        self.origin = origin  # "" (--respawn) or who asked for it ("an attach from ADDRESS": `mpiasgd attach`)
        self.info: Any = None  # its WorkerInfo once admitted (host, pid)


class Respawner:
    """(rank 0) Starts and admits replacements (module docstring). `r0` is the loop (`Rank0`), whose `comm` is a
    RoutedComm; `definition` the network definition text every worker started from; `size` the job's ranks;
    `argv` the arguments a replacement is started with (this process's); `infos` {worker rank: WorkerInfo} of
    the workers as they started (a replacement takes its predecessor's local rank: its GPU)."""

    def __init__(self, r0: Any, definition: str, size: int, argv: list[str], infos: dict[int, Any]) -> None:
        if not isinstance(r0.comm, RoutedComm):
            raise TypeError("Respawner: rank 0's communicator must be a RoutedComm")
        self.r0, self.definition, self.size, self.argv = r0, definition, size, argv
        self.local_rank = {w: max(0, int(getattr(info, "device", -1))) for w, info in infos.items()}
        self.threads = {w: int(getattr(info, "threads", 1)) for w, info in infos.items()}
        self.pending: dict[int, Pending] = {}
        self.children: list[Pending] = []  # every replacement spawned, for `close`
        self.count: dict[int, int] = {}  # replacements started per worker rank
        self.last_failure = ""  # the last replacement's failure (`failed`)

    def spawn(self, w: int, host: str = "", origin: str = "") -> bool:
        """Start a replacement for worker rank `w`, which was dropped: on `host` ("" = where MPI places it: the
        spawn's info key "host"); `origin` says who asked ("" = --respawn, at the death: at most MAX_RESPAWNS per
        rank; else `mpiasgd attach`, not counted). None once the run stops. Blocks while MPI spawns it (about 1-3 s);
        its start-up is followed at each `tick`. Returns whether MPI started it."""
        r0 = self.r0
        if r0.rec.stop_reason or r0.preempted:
            return False
        if not origin and self.count.get(w, 0) >= MAX_RESPAWNS:
            self.failed(w, f"worker rank {w} was replaced {MAX_RESPAWNS} times already (--respawn gives up on it)")
            return False
        if not origin:
            self.count[w] = self.count.get(w, 0) + 1
        died = time.monotonic()
        info = MPI.Info.Create() if host else MPI.INFO_NULL
        try:
            if host:
                info.Set("host", host)
            inter = MPI.COMM_SELF.Spawn(sys.executable, args=["-m", "mpiasgd", *self.argv], maxprocs=1, info=info)
            comm = inter.Merge(high=False)
            comm.send({"rank": w, "size": self.size, "definition": self.definition,
                       "local_rank": self.local_rank.get(w, w - 1), "threads": self.threads.get(w, 1)},
                      dest=JOINED_RANK, tag=JOIN_TAG)
            request = comm.irecv(bytearray(HELLO_BYTES), source=JOINED_RANK, tag=JOIN_TAG)
        except MPI.Exception as e:
            where = f" on host {host!r}" if host else ""
            self.failed(w, f"MPI_Comm_spawn of a replacement for worker rank {w}{where} failed: "
                           f"{e.Get_error_string()} (no free slot in the launcher's allocation"
                           f"{', or a host outside it' if host else ''}? docs/training.md, --respawn)")
            return False
        finally:
            if host:
                info.Free()
        r0.excuse(time.monotonic() - died)  # the workers' messages waited for the spawn: not their silence
        timeout = r0.cfg.model_timeout + r0.cfg.comm_timeout
        self.pending[w] = Pending(w, inter, comm, request, died, died + timeout, origin)
        self.children.append(self.pending[w])
        return True

    def tick(self) -> None:
        """Admit each replacement whose start-up answer came (`Rank0.admit`); give up on one that failed."""
        for w, p in list(self.pending.items()):
            try:
                done, answer = p.request.test()
            except MPI.Exception as e:
                if not ulfm.is_failure(e):
                    raise
                del self.pending[w]
                self.failed(w, f"the replacement for worker rank {w} died during its start-up")
                continue
            if not done:
                if time.monotonic() > p.deadline:
                    del self.pending[w]
                    self.failed(w, f"the replacement for worker rank {w} did not start within "
                                   f"{p.deadline - p.died:.0f} s (--model-timeout + --comm-timeout)")
                continue
            del self.pending[w]
            error, info = answer
            if error is not None:
                self.failed(w, f"the replacement for worker rank {w} could not start: {error}")
                continue
            if self.r0.rec.stop_reason or self.r0.preempted:  # the run ended meanwhile: it is sent home
                p.comm.send(None, dest=JOINED_RANK, tag=JOIN_TAG)
                continue
            p.info = info
            self.r0.admit(w, p.comm, info, time.monotonic() - p.died, p.origin)

    def close(self, timeout: float = 10.0) -> None:
        """(rank 0, at the end of the run) Disconnect from every replacement still alive: each disconnects from rank
        0 once its part is done and then finalizes MPI (Open MPI ends a spawned process that exits without
        MPI_Finalize as a failure of the whole job, and its MPI_Finalize waits for the disconnect). A replacement
        that does not answer within `timeout` seconds (hung, or stopped) is killed where it runs on this host, so that
        mpiexec does not wait for it. One still starting is sent home first, once its start-up answer comes."""
        deadline = time.monotonic() + timeout
        for child in list(self.pending.values()):
            try:
                while not child.request.test()[0] and time.monotonic() < deadline:
                    time.sleep(0.05)
                child.comm.send(None, dest=JOINED_RANK, tag=JOIN_TAG)
            except MPI.Exception:
                continue
        self.pending.clear()
        for child in self.children:
            try:
                if ulfm.failed_ranks(child.comm):
                    continue
                child.comm.Free()
            except MPI.Exception:
                continue
            done = threading.Event()

            def disconnect(inter: Any = child.inter, done: threading.Event = done) -> None:
                try:
                    inter.Disconnect()
                finally:
                    done.set()

            threading.Thread(target=disconnect, daemon=True, name="respawn-disconnect").start()
            if not done.wait(timeout):
                killed = child.info is not None and kill_here(child.info.host, child.info.pid)
                print(f"mpiasgd: warning: the replacement for worker rank {child.w} did not disconnect within "
                      f"{timeout:g} s (hung or stopped?)" + (f": killed (pid {child.info.pid}), so that the job can "
                                                             "end" if killed else ""), file=sys.stderr, flush=True)

    def will_replace(self, w: int) -> bool:
        """Whether a death of worker rank `w` now gets a replacement (--respawn, fewer than MAX_RESPAWNS so far, the
        run not ending)."""
        r0 = self.r0
        return bool(r0.cfg.respawn) and self.count.get(w, 0) < MAX_RESPAWNS and not (r0.rec.stop_reason or
                                                                                      r0.preempted)

    def failed(self, w: int, text: str) -> None:
        """Log (event "respawn_failed") and say that worker rank `w`'s replacement did not start, and why (kept in
        `last_failure` for `mpiasgd attach`'s answer); the run goes on without it unless that leaves fewer than
        --min-workers (`Rank0.short_of_workers`)."""
        self.last_failure = text
        self.r0.rec.event("respawn_failed", text)
        print(f"mpiasgd: warning: {text}; the run goes on without it", file=sys.stderr, flush=True)
        self.r0.short_of_workers(w, text)
