"""`mpiasgd train`: assign roles by rank, start every rank up, run, and fail fast.

Run it with one parameter server and N workers, e.g. 1 + 2 on one machine:

    mpiexec -n 3 python -m mpiasgd train --model digits --epochs 30 --name demo
    mpiexec -n 3 python -m mpiasgd train --model cifar10 --epochs 10 --data-dir ~/data

or (async, ssp, easgd) with S parameter-server shards: N + S ranks, rank 0 and ranks N+1..N+S-1 the shards:

    mpiexec -n 4 python -m mpiasgd train --model digits --servers 2 --epochs 30 --name sharded

Start-up (config, data, model, run log) is collective (`mpiasgd.launch.startup`): if any rank fails
there, rank 0 prints one message naming the ranks and what went wrong, and every rank exits with
status 2. After start-up, an exception on any rank prints that rank's traceback and aborts the whole
job (MPI_Abort) with a non-zero status within seconds; a failing worker first tells rank 0, which
records the failure and closes the run log, so nothing already logged is lost. A run log that cannot
be written (disk full) is one error line, not a traceback (`mpiasgd.rank0.serve.log_unwritable`).

SIGTERM, SIGUSR1 and SIGINT on any rank end the run with a checkpoint (`mpiasgd.signals`): every
rank exits with EXIT_PREEMPTED (75), and `--resume RUN_DIR/NAME.ckpt.h5` continues it
(`mpiasgd.checkpoint`).

Files: ranks.py (who each process is), startup.py (the collective start-up); the typed start-up
record each worker sends rank 0 is `mpiasgd.runlog.startup`'s.
"""

from __future__ import annotations

import socket
import sys
import traceback
from typing import Any

from mpi4py import MPI
from threadpoolctl import threadpool_limits

from mpiasgd import checkpoint, signals
from mpiasgd.comms import CommTimeout, Message, ProtocolError, Tag, error_message, ulfm, wait
from mpiasgd.comms.waits import server_wait
from mpiasgd.config import Config
from mpiasgd.data import DataError
from mpiasgd.device import sharing_error, tuning_turns
from mpiasgd.launch.join import join
from mpiasgd.launch.ranks import Rank, blas_threads, node_workers, server_cores
from mpiasgd.launch.startup import (
    definition_text,
    load_data,
    report_startup_errors,
    send_definition,
    setup,
    shared_definition,
    startup_error,
    tune_convs,
    worker_info,
)
from mpiasgd.modes.base import WorkerJob
from mpiasgd.modes.registry import SERVER_MODES, load
from mpiasgd.rank0.recorder import TrainingDiverged
from mpiasgd.rank0.serve import ABORT_CODE, EXIT_DIVERGED, EXIT_PREEMPTED, log_unwritable, serve, serve_shard
from mpiasgd.runlog import RunLogError

EXIT_BAD_INPUT = 2

__all__ = ["ABORT_CODE", "EXIT_BAD_INPUT", "EXIT_DIVERGED", "EXIT_PREEMPTED", "Rank", "abort", "train",
           "worker_failed"]


def abort(me: Rank, text: str | None) -> None:
    """Print `text` (a traceback) prefixed with the rank and host (None: nothing, it was said), then abort the
    whole job."""
    sys.stdout.flush()
    if text is not None:
        print(f"mpiasgd: rank {me.rank} on {me.host} failed:\n{text}", file=sys.stderr, flush=True)
    me.comm.Abort(ABORT_CODE)


def worker_failed(me: Rank, text: str, timeout: float = 5.0, said: bool = False) -> None:
    """(all workers, and the parameter-server shards of rank >= 1) Tell rank 0 about this rank's exception, wait
    briefly for it to close the log, abort. `said`: this rank printed its error already (no traceback follows)."""
    try:
        sending = me.comm.Isend(error_message(me.rank, text).buf, dest=0, tag=int(Tag.ERROR))
        ack = Message(0)
        acked = me.comm.Irecv(ack.buf, source=0, tag=int(Tag.ERROR_ACK))
        wait(acked, "acknowledgement of the error report", me.rank, timeout)
        wait(sending, "the error report send", me.rank, timeout)
    except CommTimeout:
        pass  # rank 0 is gone or stuck: abort regardless
    abort(me, None if said else text)


def train(cfg: Config, comm: Any = None) -> int:
    """Run `mpiasgd train` on every rank of `comm` (default MPI.COMM_WORLD); returns the exit status."""
    comm = comm or MPI.COMM_WORLD
    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:  # (--respawn) a replacement worker, which rank 0 started
        return join(cfg, parent)
    me = Rank(comm, comm.Get_rank(), comm.Get_size(), socket.gethostname(), cfg.servers)
    mode = load(cfg.mode)
    signals.set_rank(None if me.is_rank0 else me.rank)  # (routed by cli._train) a worker's first signal is said at once
    # start-up (all ranks): collective, so bad input gives one message and a clean exit
    # (every failure of a rank is caught here, a user's model file's SystemExit included: no rank may leave
    # the collective start-up early, or the others would wait for it forever)
    error, start, threads, dataset, text, spec, resumed = None, None, 1, None, None, None, None
    try:
        workers_here, local_rank = node_workers(me)
        serving = cfg.mode in SERVER_MODES  # (sync's and pipeline's rank 0 neither spins nor has update threads)
        spins = serving and server_wait(cfg.server_wait, me.node_ranks, me.node_cores)[0] == "spin"
        threads = blas_threads(me, cfg.threads, workers_here,
                               server_cores(me, cfg.server_threads if serving else 1, spins, workers_here))
        dataset = load_data(cfg)
        if me.is_rank0:
            resumed = checkpoint.load(cfg.resume) if cfg.resume else None  # read once: here and for the log
            text = definition_text(cfg, dataset, resumed)
    except BaseException as e:
        error = startup_error(e)
    text = send_definition(me, text, cfg.model_timeout + cfg.comm_timeout)  # collective: every rank, failed or not
    if error is None and text is not None:  # (rank 0 failed: it reports why, the others wait for that)
        try:
            spec = shared_definition(text)
            start = setup(cfg, me, mode, dataset, spec, local_rank, resumed)
            start.definition = text
        except BaseException as e:
            error = startup_error(e)
    if report_startup_errors(me, error):
        if start is not None:  # rank 0 took the log's lock; no log was written
            start.release()
        return EXIT_BAD_INPUT
    # (all ranks) two workers on one GPU: every rank judges the same gathered list
    devices = comm.allgather(start.device)
    shared = None if not me.is_worker else sharing_error(devices, me.rank, cfg.share_devices)
    # (every rank sees the same answers, so all skip the tuning rounds alike)
    if report_startup_errors(me, shared) or (cfg.conv_algo == "autotune" and
                                              tune_convs(cfg, me, start, tuning_turns(devices))):
        start.release()
        return EXIT_BAD_INPUT

    comms = mode.communicators(cfg, comm, me.rank, start.layout)  # collective: the mode's own
    status = 0
    try:
        with threadpool_limits(limits=threads, user_api="blas"):
            if me.is_rank0:
                status = serve(cfg, me, start)
            elif me.is_shard:  # --servers S > 1: a shard of rank >= 1 serves its slice, rank 0 keeps the log
                status = serve_shard(cfg, me, start)
            else:
                comm.gather(worker_info(me, start, threads), root=0)
                job = WorkerJob(comm, cfg, start.model, start.dataset, start.sampler, me.rank, start.test_idx,
                                start.staging, start.make_staging, comms, start.layout, start.graphs)
                preempted = mode.worker(job).run()
                status = EXIT_PREEMPTED if preempted else 0
    except RunLogError as e:  # (rank 0) the disk is full: one line, not a traceback
        log_unwritable(me, start, e)
        status = ABORT_CODE
    except DataError as e:  # a dataset file changed or failed under the run (workers read it): one line, no traceback
        # said first: rank 0, told next, closes the log and aborts the job, which may end this process at once
        print(f"mpiasgd: error: rank {me.rank} on {me.host}: {e}", file=sys.stderr, flush=True)
        if me.is_rank0:  # (its log is closed by `serve`)
            abort(me, None)
        else:
            worker_failed(me, str(e), said=True)
    except BaseException as e:
        if ulfm.is_failure(e) and not me.is_rank0:  # (ULFM) a rank it talked to died: rank 0 hears of it from ULFM
            raise  # and names it; this rank says so in one line and ends (`mpiasgd.cli`), not as a failed worker
        # a timeout, a protocol violation or divergence (--max-rejects) says all in its message (naming the rank);
        # anything else: traceback
        text = str(e) if isinstance(e, (CommTimeout, ProtocolError, TrainingDiverged)) else traceback.format_exc()
        if me.is_rank0:
            abort(me, text)
        else:  # a worker, or a shard: rank 0 logs it first
            worker_failed(me, text)
    return status
