"""(`--respawn`) The start-up of a replacement worker: a process rank 0 started with `MPI_Comm_spawn`
(`mpiasgd.rank0.respawn`, whose docstring has the steps) becomes the worker rank it replaces.

It talks to rank 0 alone, on the 2-rank communicator both merged from the spawn (rank 0 there is 0, this process
1): the other workers of an async job never talk to it. It starts up as that worker rank would have (`setup` with
its rank in the job's numbering: the same shard, test slice and dropout seed), answers rank 0 with its
WorkerInfo (or the error that stopped it), learns the workers dead now, and runs the mode's worker loop, whose
first weights (flag RESUME) continue the dead worker's step count and data position.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from typing import Any

from mpi4py import MPI
from threadpoolctl import threadpool_limits

from mpiasgd import signals
from mpiasgd.comms import CommTimeout, ProtocolError, ulfm
from mpiasgd.config import Config
from mpiasgd.launch.ranks import Rank
from mpiasgd.launch.startup import load_data, setup, shared_definition, startup_error, worker_info
from mpiasgd.modes.base import WorkerJob
from mpiasgd.modes.registry import load
from mpiasgd.rank0.respawn import JOIN_TAG
from mpiasgd.rank0.serve import EXIT_PREEMPTED

EXIT_NOT_ADMITTED = 0  # the run ended while this replacement started: nothing to do
LEAVE_TIMEOUT = 10.0  # seconds a replacement waits for rank 0's disconnect at the end


def join(cfg: Config, parent: Any) -> int:
    """Run a replacement worker spawned by rank 0 (`parent`: the intercommunicator of the spawn); returns the exit
    status (0; EXIT_PREEMPTED when a signal ended the run; 2 when its start-up failed, which rank 0 logs; 1 when
    it failed later: rank 0 hears of its death from ULFM)."""
    comm = parent.Merge(high=True)
    info = comm.recv(source=0, tag=JOIN_TAG)
    me = Rank(comm, int(info["rank"]), int(info["size"]), socket.gethostname(), cfg.servers)
    mode = load(cfg.mode)
    signals.set_rank(me.rank)
    threads = max(1, int(info.get("threads", 1)))
    start, error = None, None
    try:
        dataset = load_data(cfg)
        start = setup(cfg, me, mode, dataset, shared_definition(info["definition"]), int(info["local_rank"]))
    except BaseException as e:
        error = startup_error(e)
    comm.send((error, None if error else worker_info(me, start, threads)), dest=0, tag=JOIN_TAG)
    if error is not None:
        print(f"mpiasgd: error: the replacement for worker rank {me.rank} could not start: {error}", file=sys.stderr,
              flush=True)
        return 2
    welcome = comm.recv(source=0, tag=JOIN_TAG)
    if welcome is None:  # the run stopped while this process started
        leave(comm, parent, EXIT_NOT_ADMITTED)
        return EXIT_NOT_ADMITTED
    job = WorkerJob(comm, cfg, start.model, start.dataset, start.sampler, me.rank, start.test_idx, start.staging,
                    start.make_staging, None, start.layout, start.graphs)
    try:
        with threadpool_limits(limits=threads, user_api="blas"):
            loop = mode.worker(job)
            loop.lost, loop.notices = [int(w) for w in welcome["lost"]], int(welcome["notices"])
            if loop.lost:
                loop.deal()  # shares of the workers dead now, as the survivors read them
            status = EXIT_PREEMPTED if loop.run() else 0
    except BaseException as e:
        if ulfm.is_failure(e):
            raise  # rank 0 died: `mpiasgd.cli` says so in one line
        text = str(e) if isinstance(e, (CommTimeout, ProtocolError)) else traceback.format_exc()
        print(f"mpiasgd: replacement worker rank {me.rank} on {me.host} failed:\n{text}", file=sys.stderr, flush=True)
        return 1  # (it exits without MPI_Finalize: rank 0 hears of its death from ULFM)
    leave(comm, parent, status)
    return status


def leave(comm: Any, parent: Any, status: int, timeout: float = LEAVE_TIMEOUT) -> None:
    """Disconnect from rank 0 (which does the same at the run's end: `Respawner.close`) and finalize MPI: Open MPI
    takes a spawned process that exits without MPI_Finalize for a failure of the whole job. When rank 0 does not
    disconnect within `timeout` seconds (it ended the job on a signal before this process was done), the process
    ends without (exit status `status`): mpiexec's exit status is then not 0, but nothing waits for ever."""
    done = threading.Event()

    def disconnect() -> None:
        try:
            comm.Free()
            parent.Disconnect()
            MPI.Finalize()
        finally:
            done.set()

    threading.Thread(target=disconnect, daemon=True, name="leave").start()
    if not done.wait(timeout):
        print(f"mpiasgd: warning: replacement worker: rank 0 did not disconnect within {timeout:g} s; this process "
              "ends without MPI_Finalize", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
