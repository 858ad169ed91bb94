"""One `mpiasgd simulate` run: start-up with `mpiasgd train`'s own functions (data, network, rank 0's
model, layout, shards, test slices, run log), the engine on a virtual clock, and the end as rank 0's
`serve` ends a run (the log closed with the summary, the summary lines printed).

The run log is a run log like any: `mpiasgd report`, `evaluate`, `watch`, `trace` and the plots read it.
Its attributes say it is simulated (`simulated`: the timing model as JSON; `clock` = "virtual"); its
/workers rows have host "simulated" and pid 0; every time in it is in virtual seconds.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
import traceback
from typing import Any

from threadpoolctl import threadpool_limits

from mpiasgd.config import Config
from mpiasgd.device import resolve_backend
from mpiasgd.launch.ranks import Rank
from mpiasgd.launch.startup import definition_text, load_data, setup, shared_definition, test_slice
from mpiasgd.model import build_model
from mpiasgd.modes.registry import load
from mpiasgd.rank0.serve import announce, make_recorder, start_log
from mpiasgd.runlog import RunLogError, summary_lines
from mpiasgd.runlog.startup import WorkerInfo
from mpiasgd.runlog.tensorboard import require
from mpiasgd.signals import Terminated
from mpiasgd.sim.engine import Simulation, VirtualRecorder, check_simulated
from mpiasgd.sim.timing import TimingModel, check_profile_path, mismatch_warnings
from mpiasgd.sim.timing import save_profile as save_timing

EXIT_DIVERGED = 3  # as `mpiasgd train`: --on-divergence stop ended the run (log status 'diverged')


def simulate(cfg: Config, num_workers: int, timing: TimingModel, save_profile: str | None = None,
             failures: dict[int, float] | None = None, joins: dict[int, float] | None = None) -> int:
    """Simulate run `cfg` (mode async or ssp) with `num_workers` virtual workers under `timing`; write its run
    log, print the start lines and the summary as `mpiasgd train` does. Returns 0, or EXIT_DIVERGED when
    --on-divergence stop ended it. `save_profile`: a JSON file to write the timing model used to, once every
    start-up check has passed (never this run's own log or checkpoint: ProfileError). `failures` (--fail):
    {worker: the virtual second it dies}; `joins` (--join): {worker: the virtual second it joins}.

    Raises, before any log is written, one of `launch.startup.STARTUP_ERRORS` for bad input (ConfigError for
    what is not simulated: `check_simulated`); once the log exists, RunLogError (it cannot be written) or
    TrainingDiverged (--max-rejects), the log closed with status "failed".
    """
    check_simulated(cfg, num_workers, failures, joins)
    # --servers S: the log keeps the run's config; the role and the workers are those of one server, whose update
    # and messages the engine times as S shards' (`Simulation`, `shards`)
    given, cfg = cfg, dataclasses.replace(cfg, servers=1)
    if cfg.tensorboard:  # before the log exists, as `train`
        require()
    mode = load(cfg.mode)
    me = Rank(None, 0, num_workers + 1, socket.gethostname())  # rank 0 of a job of 1 + N ranks, none of them MPI
    dataset = load_data(cfg)
    spec = shared_definition(definition_text(cfg, dataset))
    start = setup(cfg, me, mode, dataset, spec)  # takes the log's lock
    model, layout = start.model, start.layout  # rank 0's: numpy, as a real rank 0's
    try:
        for line in mismatch_warnings(timing, cfg.batch_size, cfg.model, model.spec()):  # (the spec the log stores)
            print(f"mpiasgd simulate: warning: {line}", file=sys.stderr, flush=True)
        backend = worker_backend(cfg.backend)
        worker_model = model if backend == "numpy" else build_model(spec, backend)
        timing = timing.resolved(cfg.batch_size)
        if save_profile:
            check_profile_path(save_profile, None, cfg.overwrite, start.path)
            save_timing(timing, save_profile)
            print(f"mpiasgd simulate: timing model written to '{save_profile}'", flush=True)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = [WorkerInfo(rank=w, host="simulated", pid=0, threads=cfg.threads or cores, backend=backend,
                              shard_size=len(start.samplers[layout.shard[w]])) for w in range(1, num_workers + 1)]
        if cfg.data_in_memory and hasattr(dataset, "keep_in_memory"):  # every worker's shard: the whole set
            for w in range(1, num_workers + 1):
                dataset.keep_in_memory(start.samplers[layout.shard[w]].shard_indices())
        announce(given, me, start, workers)
        print(f"simulated: {num_workers} virtual worker{'s' * (num_workers != 1)} in one process on a virtual clock "
              f"(no MPI), computing on backend {backend}{picked(cfg.backend, backend)}; {timing.describe()}"
              + (f"; {given.servers} parameter-server shards, timed as working in parallel on their slices"
                 if given.servers > 1 else ""),
              flush=True)
        log = start_log(given, me, start, workers, extra={"simulated": timing.to_json(), "clock": "virtual"})
    except BaseException:
        start.release()
        raise
    rec = make_recorder(cfg, start, log, num_workers, VirtualRecorder, desc="simulating")
    bar = rec.progress
    sim = Simulation(cfg, mode, model, dataset, layout, start.samplers,
                     {w: test_slice(dataset.num_test, num_workers, w) for w in range(1, num_workers + 1)},
                     timing, rec, model.init_params(cfg.seed), worker_model=worker_model, shards=given.servers,
                     failures=failures, joins=joins)
    began = time.perf_counter()
    try:
        summary = _limited(cfg.threads, sim.run)
    except BaseException as e:
        if isinstance(e, RunLogError):  # the disk is full: end the log as far as it can be; the caller says how
            e.outcome = log.abandon()
            raise
        interrupted = isinstance(e, KeyboardInterrupt)  # Ctrl-C, SIGTERM: no traceback, it is no failure of ours
        rec.event("failed", ("terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted (Ctrl-C)")
                  if interrupted else traceback.format_exc())
        try:
            log.close("failed")
        except RunLogError as closing:
            print(f"mpiasgd simulate: error: {closing}; {log.outcome}", file=sys.stderr, flush=True)
        raise
    finally:
        rec.close_tensorboard()
        if bar is not None:
            bar.close()
    real = time.perf_counter() - began
    log.close("diverged" if rec.diverged else "completed", summary)
    print("\n".join(summary_lines(start.path)), flush=True)
    print(f"simulated        {summary['wall_time_s']:.1f} virtual s in {real:.1f} s of real time (all times above "
          "are virtual)", flush=True)
    if rec.diverged:
        print(f"mpiasgd: error: run stopped (--on-divergence stop): {rec.diverged}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    return 0


def worker_backend(requested: str) -> str:
    """The backend the virtual workers compute on for --backend `requested`, resolved as `train` resolves a
    worker's on a node without a GPU (`device.resolve_backend`): auto -> cpu, numpy and cpu as given. The
    simulator computes on the host whatever GPUs there are (the timing model stands for the devices; cupy is
    refused by `check_simulated`)."""
    return resolve_backend(requested, 0)


def picked(requested: str, backend: str) -> str:
    """What the start line says of how `backend` was chosen."""
    if requested != "auto":
        return f" (--backend {requested})"
    return f" (--backend auto: {backend}, as train's workers on a node without a GPU)"


def _limited(threads: int, call: Any) -> Any:
    """`call()` with BLAS limited to `threads` threads (0: as many as it likes: the simulator is one process)."""
    if not threads:
        return call()

    with threadpool_limits(limits=threads, user_api="blas"):
        return call()
