"""`mpiasgd train`: assign roles by rank, set up every rank, run, and fail fast.

Run it with one parameter server and N workers, e.g. 1 + 2 on one machine:

    mpiexec -n 3 python -m mpiasgd train --model digits --epochs 30 --name demo
    mpiexec -n 3 python -m mpiasgd train --model cifar10 --epochs 10 --data-dir ~/data

Start-up (config, data, model, run log) is collective: if any rank fails there, rank 0 prints one
message naming the ranks and what went wrong, and every rank exits with status 2. After start-up,
an exception on any rank prints that rank's traceback and aborts the whole job (MPI_Abort) with a
non-zero status within seconds; a failing worker first tells the server, which records the failure
and closes the run log, so nothing already logged is lost. A run log that cannot be written (disk
full) is one error line, not a traceback: `log_unwritable`.

SIGTERM, SIGUSR1 and SIGINT on any rank end the run with a checkpoint (`mpiasgd.signals`): every
rank exits with EXIT_PREEMPTED (75), and `--resume RUN_DIR/NAME.ckpt.h5` continues it
(`mpiasgd.checkpoint`).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import __version__, checkpoint, protocol, signals
from mpiasgd.comms import CommTimeout, wait
from mpiasgd.config import Config, ConfigError
from mpiasgd.data import DataError, ShardSampler, default_data_dir, load_dataset
from mpiasgd.device import (
    DeviceError,
    assign_device,
    local_worker_rank,
    make_staging,
    mpix_cuda_support,
    resolve_backend,
    resolve_cuda_aware,
    sharing_error,
    tuning_turns,
    use_device,
    visible_hint,
)
from mpiasgd.ops import BackendUnavailable, cuda_probe, get_backend
from mpiasgd.protocol import Message, ProtocolError, Tag
from mpiasgd.runlog import RunLogError, WriterLock

STARTUP_ERRORS = (ConfigError, DataError, OSError, ValueError, BackendUnavailable, DeviceError)
EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3  # --on-divergence stop ended the run (log status 'diverged')
EXIT_PREEMPTED = signals.EXIT_PREEMPTED  # 75: checkpointed on a signal; requeue and --resume
ABORT_CODE = 1


@dataclass
class Rank:
    """Who this process is: `rank` in `comm` of `size`; rank 0 is the parameter server."""

    comm: Any
    rank: int
    size: int
    host: str

    @property
    def is_server(self) -> bool:
        return self.rank == 0

    @property
    def num_workers(self) -> int:
        return self.size - 1


def node_workers(me: Rank) -> tuple[int, int]:
    """Collective: (workers on this rank's node, this worker's index among them; -1 on the server).

    The index is the local rank used to pick a GPU; the parameter server takes none, so it is not counted.
    """
    node = me.comm.Split_type(MPI.COMM_TYPE_SHARED)  # collective: every rank calls it
    is_worker = node.allgather(not me.is_server)
    node_rank = node.Get_rank()
    node.Free()
    if me.is_server:
        return sum(is_worker), -1
    index, count = local_worker_rank(is_worker, node_rank)
    return count, index


def blas_threads(me: Rank, requested: int, workers_here: int) -> int:
    """BLAS threads for this rank: `requested`, or (0) the cores this rank may use / workers sharing them.

    The server gets 1 (it only runs vector updates). Workers on one node split the node's cores, so
    ranks never oversubscribe them: 2 workers on 2 cores get 1 thread each.
    """
    if me.is_server:
        return 1
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers_here))


def run_name(cfg: Config, num_workers: int) -> str:
    return cfg.name or f"{cfg.model}-{cfg.mode}-{num_workers}w-{time.strftime('%Y%m%d-%H%M%S')}"


def versions() -> dict:
    import h5py
    import mpi4py

    return {"mpiasgd": __version__, "python": platform.python_version(), "numpy": np.__version__,
            "mpi4py": mpi4py.__version__, "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version}


def worker_backend(cfg: Config, me: Rank, local_rank: int) -> tuple[str, object]:
    """(all workers) Resolve the backend and, for cupy, select this worker's GPU before anything is allocated.

    Returns (backend, DeviceInfo or None). Raises BackendUnavailable (cupy requested, but cupy or a
    device is missing) or DeviceError.
    """
    count, why = (0, "") if cfg.backend == "numpy" else cuda_probe()  # numpy: cupy is never imported
    backend = resolve_backend(cfg.backend, count)
    if backend != "cupy":
        # a GPU node that cannot run cupy, or device buffers asked for where there is no device
        gpu_only = [flag for flag, on in (("--cuda-aware on", cfg.cuda_aware == "on"),
                                          ("--conv-algo autotune", cfg.conv_algo == "autotune")) if on]
        if cfg.backend == "auto" and (why.startswith("CUDA failed") or gpu_only):
            dropped = "".join(f"; {flag} does not apply" for flag in gpu_only)
            print(f"mpiasgd: warning (rank {me.rank} on {me.host}): --backend auto runs on the CPU (numpy): "
                  f"{why}{dropped}{visible_hint()}", file=sys.stderr, flush=True)
        return backend, None
    try:
        ops = get_backend("cupy")
    except BackendUnavailable as e:
        raise BackendUnavailable(f"--backend cupy: {e}{visible_hint()}") from None
    device = use_device(assign_device(local_rank, count), me.rank, me.host)
    ops.set_conv_algo(cfg.conv_algo)
    try:  # on the selected device: a kernel that does not compile stops start-up (autotune: every tile's)
        ops.compile_kernels(autotune=cfg.conv_algo == "autotune")
    except RuntimeError as e:
        raise BackendUnavailable(f"--backend cupy: {e}") from None
    return backend, device


def autotune_convs(cfg: Config, dataset: Any, first: int = 0, last: int | None = None) -> list[str]:
    """(cupy workers, --conv-algo autotune) One forward/backward of layers first..last-1 (default: the
    whole model; a pipeline unit: its module's) on a throwaway copy of the model, so that every conv
    pass this worker trains with picks its tile now (`cupy_ops.conv_plans`) and not in the first
    training step. The input: the training set's first `batch_size` images, or for a module after
    the first, standard-normal activations of the shape it receives. Returns the plans' descriptions
    (tile chosen, ms per call of each tile). Raises BackendUnavailable naming the failure."""
    from mpiasgd.model import build_model

    model = build_model(cfg.model, "cupy")
    ops, layers = model.ops, model.layers[first:last]
    try:
        model.bind(ops.asarray(model.init_params(cfg.seed)), ops.zeros(model.num_params))
        if first == 0:
            x, _ = dataset.batch("train", np.arange(cfg.batch_size), np.random.default_rng(cfg.seed))
        else:
            x = np.random.default_rng(cfg.seed).standard_normal((cfg.batch_size, *model.shapes[first - 1]))
        h = ops.asarray(x)
        for layer in layers:
            h = layer.forward(h)
        d = ops.asarray(np.full(h.shape, 1.0 / h.size))  # the backward passes' speed does not depend on values
        for layer in reversed(layers):
            d = layer.backward(d)
    except Exception as e:  # a CUDA error or a launch refused: a start-up error with its cause, not a traceback
        raise BackendUnavailable(f"--conv-algo autotune: the tuning step at start-up failed ({type(e).__name__}: "
                                 f"{e})") from e
    return [plan.describe() for plan in ops.conv_plans()]


def setup(cfg: Config, me: Rank, local_rank: int = 0) -> dict:
    """Per-rank start-up; returns what the role needs. Raises one of STARTUP_ERRORS on bad input.

    `local_rank` is a worker's index among the workers of its node (its GPU, modulo visible devices).
    """
    from mpiasgd.model import build_model

    if me.size < 2:
        raise ConfigError(f"mpiasgd train needs at least 2 MPI ranks (1 parameter server + workers), got {me.size}; "
                          "launch it with e.g. 'mpiexec -n 3 python -m mpiasgd train'")
    data_dir = cfg.data_dir or default_data_dir()
    dataset = load_dataset(cfg.dataset_name, data_dir)
    backend, device = ("numpy", None) if me.is_server else worker_backend(cfg, me, local_rank)
    model = build_model(cfg.model, backend)  # the server keeps host weights: always numpy
    if tuple(dataset.train_x.shape[1:]) != tuple(model.input_shape):
        raise ConfigError(f"model '{cfg.model}' takes inputs {tuple(model.input_shape)}, dataset "
                          f"'{cfg.dataset_name}' has images {tuple(dataset.train_x.shape[1:])}")
    slow = sorted(r for r in cfg.stragglers() if r > me.num_workers)
    if slow:
        raise ConfigError(f"config key 'straggler' = {cfg.straggler!r}: rank(s) {slow} are not workers "
                          f"(workers are ranks 1..{me.num_workers})")
    if cfg.nsync > 1 and cfg.epochs and cfg.nsync * cfg.batch_size * me.num_workers > cfg.epochs * dataset.train_y.size:
        raise ConfigError(f"config key 'nsync' = {cfg.nsync}: one round of local steps by every worker "
                          f"({cfg.nsync} x {cfg.batch_size} images x {me.num_workers} workers) is longer than the "
                          f"run ({cfg.epochs:g} epochs of {dataset.train_y.size} images)")
    shards, shard = me.num_workers, me.rank - 1  # pipeline: one shard per replica
    out = {"dataset": dataset, "model": model, "backend": backend, "device": device}
    if cfg.mode == "pipeline":
        from mpiasgd.pipeline import partition

        shards, modules = pipeline_grid(cfg, me)
        shard = (me.rank - 1) // modules
        out["bounds"] = partition(model, modules, cfg.cut_points(), cfg.balance)
    smallest_shard = dataset.train_y.size // shards
    if smallest_shard and cfg.batch_size > smallest_shard:  # 0: the sampler names too many workers
        raise ConfigError(f"config key 'batch_size' = {cfg.batch_size}: larger than the smallest worker shard "
                          f"({smallest_shard} images: {dataset.train_y.size} over {shards} shards)")
    if me.is_server:
        out["path"] = os.path.join(cfg.run_dir, run_name(cfg, me.num_workers) + ".h5")
        if cfg.resume:
            ckpt = out["checkpoint"] = checkpoint.load(cfg.resume)
            if ckpt.num_workers != me.num_workers:
                raise ConfigError(f"--resume: checkpoint '{cfg.resume}' was written by a run with {ckpt.num_workers} "
                                  f"workers; this job has {me.num_workers} (launch {1 + ckpt.num_workers} ranks)")
            # the log lives next to its checkpoint, wherever the job is started from
            out["path"] = os.path.join(os.path.dirname(os.path.abspath(cfg.resume)), os.path.basename(ckpt.log))
            check_fits(ckpt, cfg, me, model)
        log_dir = os.path.dirname(out["path"]) or "."
        what = f"--resume {cfg.resume!r}: the checkpoint's directory" if cfg.resume else f"config key 'run_dir' = " \
                                                                                          f"{cfg.run_dir!r}"
        if os.path.exists(log_dir) and not os.path.isdir(log_dir):
            raise ConfigError(f"{what}: is a file, expected a directory")
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{what}: cannot create it ({e.strerror})") from None
        if not os.access(log_dir, os.W_OK):
            raise ConfigError(f"{what}: directory is not writable")
        out["lock"] = WriterLock(out["path"])
        out["lock"].acquire("--resume: another job is writing this run's log; wait for it to end" if cfg.resume
                            else "choose another --name")  # held until the log is closed, or the process dies
        left = left_behind(out["path"], out["lock"])  # by a job that died writing this run (its temporaries go)
        if os.path.exists(out["path"]) and not cfg.overwrite and not cfg.resume:
            out["lock"].release()
            raise FileExistsError(f"run log '{out['path']}' exists; choose another --name or pass --overwrite"
                                  + (f" ({left})" if left else ""))
        if cfg.resume and os.path.exists(out["path"]):
            owner = run_id_of(out["path"])
            if owner and ckpt.run_id and owner != ckpt.run_id:
                out["lock"].release()
                raise ConfigError(f"--resume: run log '{out['path']}' belongs to another run (run id {owner}) than "
                                  f"checkpoint '{cfg.resume}' (run id {ckpt.run_id}): it was overwritten since; "
                                  f"move it away to resume into a new log")
        if left:
            print(f"mpiasgd: note: {left}", file=sys.stderr, flush=True)
    else:
        # validates: more workers than samples is a DataError naming both numbers
        out["sampler"] = ShardSampler(dataset.train_y.size, shards, shard, cfg.seed)

        out["test_idx"] = np.array_split(np.arange(dataset.test_y.size, dtype=np.int64), me.num_workers)[me.rank - 1]
        query = getattr(MPI, "Query_cuda_support", None)
        if backend == "cupy" and cfg.cuda_aware == "auto" and query is None:
            query = mpix_cuda_support()  # mpi4py's PyPI wheels lack Query_cuda_support: ask libmpi itself
        cuda_aware = backend == "cupy" and resolve_cuda_aware(cfg.cuda_aware, query)
        out["staging"] = make_staging(backend, cuda_aware, model.num_params)  # buffers reused every step
        out["make_staging"] = lambda: make_staging(backend, cuda_aware, model.num_params)  # --overlap: a second one
    return out


def check_fits(ckpt: checkpoint.Checkpoint, cfg: Config, me: Rank, model: Any) -> None:
    """ConfigError unless checkpoint `ckpt` fits this job: its mode, model, parameter count, worker ranks."""
    where = f"--resume: checkpoint '{cfg.resume}'"
    if (ckpt.mode, ckpt.model) != (cfg.mode, cfg.model):
        raise ConfigError(f"{where} holds a '{ckpt.mode}' run of model '{ckpt.model}', its config says "
                          f"'{cfg.mode}' and '{cfg.model}'")
    if ckpt.params.size != model.num_params:
        raise ConfigError(f"{where} holds {ckpt.params.size} parameters, model '{cfg.model}' has {model.num_params}")
    ranks = sorted(int(r) for r in ckpt.workers["rank"])
    if ranks != list(range(1, me.num_workers + 1)):
        raise ConfigError(f"{where} holds workers {ranks}, this job has workers 1..{me.num_workers}")
    if not ckpt.log.endswith(".h5"):
        raise ConfigError(f"{where} names its run log {ckpt.log!r}, expected NAME.h5")


def left_behind(path: str, lock: WriterLock) -> str:
    """(server only, holding `lock`, the writer lock of the run log at `path`) What a job that died while
    writing this run left behind, in one line ("" if nothing): its log with status "running" (its
    writer is gone: this job holds the lock; a resume recovers and continues it, --overwrite replaces
    it) and the temporary checkpoint files of processes that no longer exist, which are removed here
    (`checkpoint.remove_stale_temporaries`: a live process's file is kept)."""
    from mpiasgd.runlog import clear_stale_flags, open_log

    removed = checkpoint.remove_stale_temporaries(checkpoint.checkpoint_path(path))
    parts = []
    try:
        clear_stale_flags(path, check_writer=False)  # its writer was killed with the file open (we hold the lock)
        with open_log(path) as f:
            status = f.attrs.get("status", "")
    except OSError:  # no log (or not one): nothing to say about it
        status = ""
    if (status.decode() if isinstance(status, bytes) else status) == "running":
        parts.append("it with status 'running' (readable up to its last flush)")
    if removed:
        names = ", ".join(f"'{name}'" for name in removed)
        what = ("files", "processes that no longer exist") if len(removed) > 1 else ("file", "a process that no "
                                                                                              "longer exists")
        parts.append(f"the temporary checkpoint {what[0]} {names} (of {what[1]}: removed)")
    if not parts:
        return ""
    who = f" (rank 0 was pid {lock.dead_pid})" if lock.dead_pid else ""
    return f"a job that died writing run log '{path}'{who} left " + " and ".join(parts)


def run_id_of(path: str) -> str:
    """The `run_id` attribute of the run log at `path` ("" for logs written before run ids, or unreadable)."""
    from mpiasgd.runlog import open_log

    try:
        with open_log(path) as f:
            value = f.attrs.get("run_id", "")
    except OSError:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def pipeline_grid(cfg: Config, me: Rank) -> tuple[int, int]:
    """(replicas N, modules K) of pipeline mode; ConfigError unless the workers are exactly N x K."""
    K = cfg.modules
    N = cfg.replicas or me.num_workers // K
    if N < 1 or N * K != me.num_workers:
        given = f" --replicas {cfg.replicas}" if cfg.replicas else ""
        raise ConfigError(f"--mode pipeline with --modules {K}{given} needs 1 + N x {K} ranks (rank 0 logs; "
                          f"N replicas of {K} modules), got {me.size} ranks; launch e.g. "
                          f"'mpiexec -n {1 + max(1, N) * K}'")
    return N, K


def communicators(cfg: Config, me: Rank) -> tuple[Any, Any]:
    """Collective (all ranks): the workers-only communicators of the mode, (None, None) elsewhere.

    sync: (workers, None), every worker; pipeline: (the replica's pipeline along k, the module's
    data communicator along n) for unit (n, k) on rank 1 + n*K + k. Rank 0 gets MPI.COMM_NULL.
    """
    comm, worker = me.comm, not me.is_server
    if cfg.mode == "sync":
        return comm.Split(0 if worker else MPI.UNDEFINED, me.rank), None
    if cfg.mode == "pipeline":
        n, k = divmod(me.rank - 1, cfg.modules)
        return (comm.Split(n if worker else MPI.UNDEFINED, k), comm.Split(k if worker else MPI.UNDEFINED, n))
    return None, None


def tune_convs(cfg: Config, me: Rank, state: dict, turns: list[int]) -> bool:
    """Collective (--conv-algo autotune): each GPU worker times its conv tiles (`autotune_convs`; a
    pipeline unit, its module's layers) at its turn (`device.tuning_turns`: workers sharing a GPU one
    after another), its plans kept in state["autotune"] for the start-up gather. True if any rank
    failed (reported once by rank 0, as every start-up error)."""
    for turn in range(max(turns, default=-1) + 1):
        error = None
        if turns[me.rank] == turn:
            first, last = 0, None
            if cfg.mode == "pipeline":
                module = (me.rank - 1) % cfg.modules
                first, last = state["bounds"][module], state["bounds"][module + 1]
            try:
                state["autotune"] = autotune_convs(cfg, state["dataset"], first, last)
            except STARTUP_ERRORS as e:
                error = str(e)
        if report_startup_errors(me, error):
            return True
    return False


def report_startup_errors(me: Rank, error: str | None) -> bool:
    """Collective: gather every rank's start-up error; rank 0 prints them once. True if any rank failed."""
    errors = me.comm.allgather(error)
    if not any(errors):
        return False
    if me.is_server:
        by_text: dict[str, list[int]] = {}
        for r, text in enumerate(errors):
            if text:
                by_text.setdefault(text, []).append(r)
        for text, ranks in by_text.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            print(f"mpiasgd: error ({who}): {text}", file=sys.stderr, flush=True)
    return True


def abort(me: Rank, text: str) -> None:
    """Print `text` (a traceback) prefixed with the rank and host, then abort the whole job."""
    sys.stdout.flush()
    print(f"mpiasgd: rank {me.rank} on {me.host} failed:\n{text}", file=sys.stderr, flush=True)
    me.comm.Abort(ABORT_CODE)


def worker_failed(me: Rank, text: str, timeout: float = 5.0) -> None:
    """(all workers) Tell the server about this rank's exception, wait briefly for it to close the log, abort."""
    try:
        sending = me.comm.Isend(protocol.error_message(me.rank, text).buf, dest=0, tag=int(Tag.ERROR))
        ack = Message(0)
        acked = me.comm.Irecv(ack.buf, source=0, tag=int(Tag.ERROR_ACK))
        wait(acked, "acknowledgement of the error report", me.rank, timeout)
        wait(sending, "the error report send", me.rank, timeout)
    except CommTimeout:
        pass  # the server is gone or stuck: abort regardless
    abort(me, text)


def split_gathered(gathered: list[tuple]) -> tuple[list[tuple], list[str]]:
    """The workers' start-up tuples (rank order) -> (their `runlog.WORKER_ROW` fields, one "autotune"
    event text per worker that tuned its conv tiles: rank, host and the plans it made)."""
    workers, events = [], []
    for *row, plans in gathered:
        workers.append(tuple(row))
        if plans:
            events.append(f"worker rank {row[0]} on {row[1]}: conv tiles chosen by timing (ms per call of each "
                          "tile):\n" + "\n".join(plans))
    return workers, events


def run_server(cfg: Config, me: Rank, state: dict) -> int:
    """(server only) Create (or, resuming, continue) the run log, serve, close the log, print the summary.

    Returns 0, EXIT_PREEMPTED when a signal ended the run (the checkpoint is written), or EXIT_DIVERGED when
    --on-divergence stop ended it.
    """
    from tqdm import tqdm

    from mpiasgd.health import LossWatch
    from mpiasgd.report import summary_lines
    from mpiasgd.runlog import RunLog
    from mpiasgd.server import PREEMPT_GRACE, ParameterServer, Preempted, SyncMonitor, WorkerFailed

    model, dataset = state["model"], state["dataset"]
    workers, tuned = split_gathered(me.comm.gather(None, root=0)[1:])
    kinds: dict[str, int] = {}
    for w in workers:  # e.g. "cupy (pinned) x2" or "numpy (host) x2"
        key = f"{w[4]} ({w[9]})"
        kinds[key] = kinds.get(key, 0) + 1
    print(f"mpiasgd {__version__}: {me.num_workers} worker{'s' * (me.num_workers != 1)} "
          f"[{', '.join(f'{k} x{n}' for k, n in kinds.items())}], model {cfg.model} ({model.num_params:,} parameters), "
          f"dataset {cfg.dataset_name} ({dataset.train_y.size:,} train / {dataset.test_y.size:,} test images)",
          flush=True)
    if cfg.show_config:
        print(f"resolved config:\n{cfg.describe()}", flush=True)
    if cfg.mode == "pipeline":
        from mpiasgd.pipeline import describe_partition

        cuts = describe_partition(model, state["bounds"], cfg.balance, cfg.decoupling)
        replicas = me.num_workers // cfg.modules
        print(f"pipeline: {replicas} replica{'s' * (replicas != 1)} x {cfg.modules} modules, decoupling "
              f"{cfg.decoupling}:\n{cuts}", flush=True)
    attrs = {"config": cfg.to_json(), "versions": versions(), "layout": model.layout(), "model": cfg.model,
             "mode": cfg.mode, "num_workers": me.num_workers, "num_params": model.num_params,
             "num_train": int(dataset.train_y.size), "num_test": int(dataset.test_y.size),
             "data_source": dataset.source, "command": " ".join(sys.argv)}
    if cfg.mode == "pipeline":
        attrs["module_bounds"] = state["bounds"]  # module k: layers bounds[k]..bounds[k+1]-1
    ckpt = state.get("checkpoint")
    if ckpt is not None and os.path.exists(state["path"]):
        log = RunLog.reopen(state["path"], workers, cfg.flush_interval, state["lock"], resumed_at=ckpt.log_time)
    else:
        if ckpt is not None:  # the run continues from its checkpoint; its history is gone
            attrs["run_id"] = ckpt.run_id
            print(f"mpiasgd: warning: run log '{state['path']}' of checkpoint '{ckpt.path}' is missing: a new log "
                  f"starts at the checkpoint (version {ckpt.version})", file=sys.stderr, flush=True)
        log = RunLog.create(state["path"], attrs, workers, model.num_params, cfg.flush_interval, state["lock"])
    if ckpt is not None:
        from mpiasgd.config import from_mapping, resume_overrides

        changed = resume_overrides(from_mapping(json.loads(ckpt.config)), cfg)
        text = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items()) or "none"
        log.add("events", (max(ckpt.log_time, log.last_time()), b"overrides", f"resumed with config changes: {text}; "
                                                                             f"command: {' '.join(sys.argv)}"))
        log.file.attrs["config"] = cfg.to_json()
        from mpiasgd.optim import fraction_done

        if fraction_done(cfg, ckpt.samples / dataset.train_y.size, ckpt.version, ckpt.elapsed) >= 1:
            print(f"mpiasgd: warning: checkpoint '{ckpt.path}' already meets the stopping rule (version "
                  f"{ckpt.version}, {ckpt.samples / dataset.train_y.size:.2f} epochs, {ckpt.elapsed:.1f} s): nothing "
                  f"is trained; raise --epochs, --max-pushes or --max-time to train longer", file=sys.stderr,
                  flush=True)
        print(f"mpiasgd: resuming '{state['path']}' from checkpoint '{ckpt.path}' (version {ckpt.version}, "
              f"{ckpt.elapsed:.1f} s of training); config changes: {text}", flush=True)
    at = log.last_time() if ckpt is None else max(ckpt.log_time, log.last_time())  # (reads the file: once)
    for text in tuned:  # --conv-algo autotune: what each GPU worker chose (after a resume's events)
        log.add("events", (at, b"autotune", text))
    params = model.init_params(cfg.seed)
    bar = None
    if cfg.progress:
        total = cfg.epochs * dataset.train_y.size if cfg.epochs else None
        total = int(total) if total and total < 2**53 else None  # a huge --epochs: a bar without a total
        bar = tqdm(total=total, unit="img", unit_scale=True, dynamic_ncols=True, mininterval=0.5,
                   desc="training", file=sys.stderr)
    args = (me.comm, cfg, params, model.decay_mask(), me.num_workers, dataset.train_y.size, log, bar)
    if cfg.mode == "pipeline":
        from mpiasgd.pipeline import PipelineMonitor

        server = PipelineMonitor(*args, model, dataset, state["bounds"])
    else:
        server = (SyncMonitor if cfg.mode == "sync" else ParameterServer)(*args)
    if ckpt is not None:
        server.restore(ckpt)
    state["server"] = server  # for `log_unwritable`, should the log fail
    hosts = {int(w[0]): w[1] for w in workers}
    server.pids = {int(w[0]): (w[1], int(w[2])) for w in workers}
    server.health = LossWatch(len(dataset.classes), me.num_workers, asynchronous=cfg.mode in ("async", "ssp"))
    try:
        summary = server.run()
    except (Preempted, WorkerFailed) as stop:
        # close the log first, so nothing already logged is lost, then end the whole job
        if isinstance(stop, WorkerFailed):
            status, code, text = "failed", ABORT_CODE, f"worker rank {stop.rank} on {hosts[stop.rank]} failed"
        elif stop.dead:  # the launcher's SIGTERM after a worker died
            names = ", ".join(f"rank {w} on {hosts[w]}" for w in stop.waiting)
            status, code = "failed", ABORT_CODE
            text = f"worker {names} died (its process exited; the launcher ended the job); {server.resume_note()}"
        else:  # a signal, and some workers did not answer: hung, or dead on another host
            names = ", ".join(f"rank {w} on {hosts[w]}" for w in stop.waiting)
            status, code = "preempted", EXIT_PREEMPTED
            text = (f"{stop.why}; {server.resume_note()}; worker(s) {names} did not answer within {PREEMPT_GRACE:g} s: "
                    f"dead (a launcher ends the job with SIGTERM when a rank dies) or hung")
        log.add("events", (server.now(), status.encode(),
                           f"{text}:\n{stop.text}" if isinstance(stop, WorkerFailed) else text))
        closed = f"run log '{state['path']}' closed with status '{status}'"
        try:
            log.close(status)
        except RunLogError as e:  # the disk is full too
            closed = f"{e}; {log.outcome}"
        if isinstance(stop, WorkerFailed):  # the failed worker waits for this acknowledgement before it aborts
            me.comm.Isend(Message(0).stamp(Tag.ERROR_ACK, 0).buf, dest=stop.rank, tag=int(Tag.ERROR_ACK))
        if bar is not None:
            bar.close()
        print(f"mpiasgd: {text}; {closed}." + (f"\n{stop.text}" if isinstance(stop, WorkerFailed) else ""),
              file=sys.stderr, flush=True)
        if isinstance(stop, Preempted) and stop.dead:
            time.sleep(0.3)  # the launcher is tearing the job down: let it forward this message first
        me.comm.Abort(code)
        return code
    except BaseException as e:
        if isinstance(e, RunLogError):
            raise  # the log cannot be written (disk full): `train` reports it in one line (`log_unwritable`)
        if isinstance(e, CommTimeout) and server.checkpoints_here:  # a hung worker: the state on rank 0 is sound
            server.write_checkpoint("failure")
        log.add("events", (server.now(), b"failed", traceback.format_exc()))
        try:
            log.close("failed")
        except RunLogError as closing:  # the disk is full too: say so; the traceback of `e` follows
            print(f"mpiasgd: error: rank 0: {closing}; {log.outcome}", file=sys.stderr, flush=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    if server.preempted:
        if server.checkpoint_error:  # nothing to requeue from: not the status that says "try again"
            text = f"run preempted ({server.preempted}) but its {server.checkpoint_error}"
            log.add("events", (server.now(), b"failed", text))
            log.close("failed", summary)  # not "preempted": there is no checkpoint of this state to resume from
            print(f"mpiasgd: error: {text}", file=sys.stderr, flush=True)
            me.comm.Abort(ABORT_CODE)
            return ABORT_CODE
        log.close("preempted", summary)
        print(f"mpiasgd: run preempted ({server.preempted}); checkpoint '{server.checkpoint_path}' written at "
              f"version {summary['version']}; continue with --resume {server.checkpoint_path}", file=sys.stderr,
              flush=True)
        return EXIT_PREEMPTED
    if server.diverged:  # --on-divergence stop: the run ended early, evaluated, with status 'diverged'
        log.close("diverged", summary)
        print("\n".join(summary_lines(state["path"])), flush=True)
        print(f"mpiasgd: error: run stopped (--on-divergence stop): {server.diverged}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    log.close("completed", summary)
    print("\n".join(summary_lines(state["path"])), flush=True)
    return 0


def log_unwritable(me: Rank, state: dict, error: RunLogError) -> None:
    """(server only) The run log cannot be written (disk full, quota, I/O error): print one error line naming
    the file and the cause, end the log as far as the disk allows (`RunLog.abandon`: status "failed";
    readable up to its last flush either way) and release its lock, write a checkpoint where rank 0
    holds the state (async, ssp; one line says whether it was written), then abort the whole job: the
    workers end with it."""
    server = state.get("server")
    try:
        if server is None:  # the log could not even be created or reopened: there is nothing to close
            state["lock"].release()
            print(f"mpiasgd: error: rank 0: {error}", file=sys.stderr, flush=True)
            return
        print(f"mpiasgd: error: rank 0: {error}; {server.log.abandon()}", file=sys.stderr, flush=True)
        path = server.checkpoint_path
        if server.checkpoints_here:
            if server.write_checkpoint("failure"):  # a failed write prints its own warning line
                print(f"mpiasgd: checkpoint '{path}' written (version {server.version}); once there is space, "
                      f"continue with --resume {path}", file=sys.stderr, flush=True)
        else:
            kept = (f"the last one, '{path}', is kept: continue from it with --resume" if os.path.isfile(path)
                    else "there is none to resume from")
            print(f"mpiasgd: no checkpoint written now (the state is on the workers); {kept}", file=sys.stderr,
                  flush=True)
    finally:
        time.sleep(0.3)  # let the launcher forward these lines before the abort tears the job down
        me.comm.Abort(ABORT_CODE)


def train(cfg: Config, comm: Any = None) -> int:
    """Run `mpiasgd train` on every rank of `comm` (default MPI.COMM_WORLD); returns the exit status."""
    comm = comm or MPI.COMM_WORLD
    me = Rank(comm, comm.Get_rank(), comm.Get_size(), socket.gethostname())
    # start-up (all ranks): collective, so bad input gives one message and a clean exit
    error, state, threads = None, {}, 1
    try:
        workers_here, local_rank = node_workers(me)
        threads = blas_threads(me, cfg.threads, workers_here)
        state = setup(cfg, me, local_rank)
    except STARTUP_ERRORS as e:
        error = str(e)
    if report_startup_errors(me, error):
        if state.get("lock") is not None:  # rank 0 took the log's lock; no log was written
            state["lock"].release()
        return EXIT_BAD_INPUT
    # (all ranks) two workers on one GPU: every rank judges the same gathered list
    devices = comm.allgather(state.get("device"))
    shared = None if me.is_server else sharing_error(devices, me.rank, cfg.share_devices)
    # (every rank sees the same answers, so all skip the tuning rounds alike)
    if report_startup_errors(me, shared) or (cfg.conv_algo == "autotune" and
                                              tune_convs(cfg, me, state, tuning_turns(devices))):
        if state.get("lock") is not None:
            state["lock"].release()
        return EXIT_BAD_INPUT

    from threadpoolctl import threadpool_limits

    # (all ranks) sync: the workers' own communicator for the allreduce; pipeline: the grid's two
    workers_comm, data_comm = communicators(cfg, me)
    signals.set_rank(None if me.is_server else me.rank)  # the signals were routed by cli._train
    status = 0
    try:
        with threadpool_limits(limits=threads, user_api="blas"):
            if me.is_server:
                status = run_server(cfg, me, state)
            else:
                dev = state["device"]
                pipeline = cfg.mode == "pipeline"
                module, replica = divmod(me.rank - 1, cfg.modules)[::-1] if pipeline else (-1, -1)
                comm.gather((me.rank, me.host, os.getpid(), threads, state["backend"], len(state["sampler"]),
                             -1 if dev is None else dev.index, "" if dev is None else dev.name,
                             "" if dev is None else dev.uuid, state["staging"].kind, module, replica,
                             state.get("autotune", [])), root=0)
                if pipeline:
                    from mpiasgd.pipeline import PipelineUnit

                    preempted = PipelineUnit(comm, cfg, state["model"], state["dataset"], state["sampler"], me.rank,
                                             workers_comm, data_comm, state["bounds"]).run()
                else:
                    from mpiasgd.worker import Worker

                    preempted = Worker(comm, cfg, state["model"], state["dataset"], state["sampler"],
                                       state["test_idx"], me.rank, state["staging"], state["make_staging"],
                                       workers_comm).run()
                status = EXIT_PREEMPTED if preempted else 0
    except RunLogError as e:  # (server only) the disk is full: one line, not a traceback
        log_unwritable(me, state, e)
        status = ABORT_CODE
    except BaseException as e:
        # a timeout or a protocol violation says all in its message (naming the rank); anything else: traceback
        text = str(e) if isinstance(e, (CommTimeout, ProtocolError)) else traceback.format_exc()
        if me.is_server:
            abort(me, text)
        else:
            worker_failed(me, text)
    return status
