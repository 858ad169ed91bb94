"""Start-up, collective on every rank: config, data, model, backend, layout, run log, communicators.

If any rank fails here, rank 0 prints one message naming the ranks and what went wrong, and every
rank exits with status 2 (`report_startup_errors`). What start-up leaves each rank is a `Startup`.
The mode is consulted only through its `Mode` object (`mpiasgd.modes.base`): its layout of the
workers, its communicators, the lines it prints.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from mpiasgd import checkpoint
from mpiasgd.comms import Staging, make_staging
from mpiasgd.comms.protocol import HEADER_BYTES
from mpiasgd.comms.shard_cut import ShardCut
from mpiasgd.comms.staging import make_sharded_staging
from mpiasgd.config import HOST_BACKENDS, Config, ConfigError
from mpiasgd.data import DataError, ShardSampler, default_data_dir, test_slice
from mpiasgd.data.loader import open_data
from mpiasgd.device import (
    DeviceError,
    assign_device,
    mpix_cuda_support,
    resolve_backend,
    resolve_cuda_aware,
    use_device,
    visible_hint,
)
from mpiasgd.launch.ranks import Rank
from mpiasgd.model import build_model
from mpiasgd.model.layers import BatchNorm2d, walk
from mpiasgd.model.spec import from_json, is_file_ref, layers_from_spec, resolve, to_json
from mpiasgd.modes.base import Layout, Mode, message_count, worker_feedback
from mpiasgd.ops import BackendUnavailable, cuda_probe, get_backend
from mpiasgd.ops.cuda.graphs import CupyGraphs, GraphError, StepGraphs
from mpiasgd.runlog import WriterLock, clear_stale_flags, open_log
from mpiasgd.runlog.startup import WorkerInfo

STARTUP_ERRORS = (ConfigError, DataError, OSError, ValueError, BackendUnavailable, DeviceError)
MAX_MESSAGE_VALUES = (2**31 - 1 - HEADER_BYTES) // 4  # float32 values in one message of < 2 GiB


@dataclass
class Startup:
    """What start-up leaves a rank. Every rank: `mode`, `dataset`, `model` (the server ranks': numpy),
    `backend`, `device` (a DeviceInfo, or None), `layout`, `samplers` (every data shard's ShardSampler, by
    shard number), `cut` (--servers S > 1: the parameter-server shards' ShardCut; None with one server).
    Rank 0: `path` of the run log, `lock` (held until the log is closed), `checkpoint` (resuming),
    `replace_log` (--resume --overwrite: why the checkpoint's log is replaced by a new one; "" to continue it).
    A worker: `sampler`, `test_idx` (int64), its `staging` (with S > 1 a ShardedStaging) and `make_staging()`
    for another like it (None with S > 1), `autotune` (plans chosen at start-up), `graphs` and `graphs_note`
    (--cuda-graphs as resolved at start-up: `probe_cuda_graphs`). A shard of rank >= 1 keeps
    only what every rank has."""

    mode: Mode
    dataset: Any
    model: Any
    backend: str
    device: Any
    layout: Layout
    path: str = ""
    lock: WriterLock | None = None
    checkpoint: checkpoint.Checkpoint | None = None
    sampler: ShardSampler | None = None
    test_idx: np.ndarray | None = None
    staging: Staging | None = None
    make_staging: Any = None
    autotune: list[str] = field(default_factory=list)
    graphs: str = "off"
    graphs_note: str = ""
    samplers: list[ShardSampler] = field(default_factory=list)
    cut: ShardCut | None = None
    replace_log: str = ""  # (rank 0, --resume --overwrite) why the log is not continued: "cannot be read (...)"
    rank0: Any = None  # rank 0's loop once it runs (`mpiasgd.rank0.serve.log_unwritable` needs it)
    definition: str = ""  # (rank 0) the network definition text every worker started from (--respawn sends it on)

    def release(self) -> None:
        """Release the run log's lock, if this rank holds it (a start-up that failed wrote no log)."""
        if self.lock is not None:
            self.lock.release()


def run_name(cfg: Config, num_workers: int) -> str:
    return cfg.name or f"{cfg.model_label}-{cfg.mode}-{num_workers}w-{time.strftime('%Y%m%d-%H%M%S')}"


def worker_backend(cfg: Config, me: Rank, local_rank: int) -> tuple[str, object]:
    """(all workers) Resolve the backend and, for cupy, select this worker's GPU before anything is allocated.

    Returns (backend, DeviceInfo or None). Raises BackendUnavailable (cupy requested, but cupy or a
    device is missing) or DeviceError.
    """
    count, why = (0, "") if cfg.backend in HOST_BACKENDS else cuda_probe()  # numpy, cpu: cupy is never imported
    backend = resolve_backend(cfg.backend, count)
    if backend != "cupy":
        # a GPU node that cannot run cupy, or device buffers asked for where there is no device
        gpu_only = [flag for flag, on in (("--cuda-aware on", cfg.cuda_aware == "on"),
                                          ("--conv-algo autotune", cfg.conv_algo == "autotune"),
                                          ("--cuda-graphs on", cfg.cuda_graphs == "on")) if on]
        if cfg.backend == "auto" and (why.startswith("CUDA failed") or gpu_only):
            dropped = "".join(f"; {flag} does not apply" for flag in gpu_only)
            print(f"mpiasgd: warning (rank {me.rank} on {me.host}): --backend auto runs on the CPU ({backend}): "
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


def autotune_convs(cfg: Config, dataset: Any, first: int = 0, last: int | None = None,
                   spec: dict | None = None) -> list[str]:
    """(cupy workers, --conv-algo autotune) One forward/backward of layers first..last-1 (default: the
    whole model; a pipeline unit: its module's) on a throwaway copy of the model, so that every conv
    pass this worker trains with picks its tile now (the backend's conv plans) and not in the first
    training step. The input: the training set's first `batch_size` images, or for a module after
    the first, standard-normal activations of the shape it receives. Returns the plans' descriptions
    (tile chosen, ms per call of each tile). Raises BackendUnavailable naming the failure."""
    model = build_model(cfg.model if spec is None else spec, "cupy")  # spec: the run's network definition
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


def probe_cuda_graphs(cfg: Config, spec: dict) -> tuple[str, str]:
    """(cupy workers, --cuda-graphs auto|on; not pipeline) Three steps of a throwaway copy of the network `spec`
    on random minibatches of batch_size through `StepGraphs` (`mpiasgd.ops.cuda.graphs`): the warm-up, the
    capture, and a replay checked bit for bit against the eager step on the next minibatch. Returns (what the
    worker trains with: cfg.cuda_graphs where it worked, else "off"; the text of event "cuda_graphs"). Raises
    BackendUnavailable naming the cause with --cuda-graphs on, or where an eager step itself fails."""
    model = build_model(spec, "cupy")
    ops = model.ops
    rng = np.random.default_rng(cfg.seed)
    try:
        model.bind(ops.asarray(model.init_params(cfg.seed)), ops.zeros(model.num_params))
        graphs = StepGraphs(model, CupyGraphs(ops.xp), cfg.cuda_graphs)
        for i in range(3):
            x = rng.standard_normal((cfg.batch_size, *model.input_shape)).astype(np.float32)
            graphs.step(x, rng.integers(0, model.num_classes, cfg.batch_size), i).get()
    except GraphError as e:
        raise BackendUnavailable(str(e)) from None
    except Exception as e:  # on: a start-up error with its cause; auto: eager launches (training says its own)
        why = f"the trial steps at start-up failed ({type(e).__name__}: {e})"
        if cfg.cuda_graphs == "on":
            raise BackendUnavailable(f"--cuda-graphs on: {why}") from e
        return "off", f"--cuda-graphs auto: eager launches: {why}"
    if graphs.reason:
        return "off", f"--cuda-graphs {cfg.cuda_graphs}: eager launches: {graphs.reason}"
    return cfg.cuda_graphs, (f"--cuda-graphs {cfg.cuda_graphs}: each training step replays one CUDA graph per "
                             "batch shape and binding (a replay gave the eager step's bits at start-up)")


def load_data(cfg: Config) -> Any:
    """(every rank) The run's dataset: the file `cfg.data` (its test split, or `cfg.test_data`'s), else the
    named `cfg.dataset_name` from `cfg.data_dir` or the default directory, with the augmentation `cfg.augment`.
    Reads no training images (rank 0 calls it too; a file's images are read by the worker that owns them)."""
    try:
        return open_data(cfg.dataset_name, cfg.data_dir or default_data_dir(), cfg.test_data, cfg.augment,
                         cache_chunks=cfg.shuffle_window + 2)
    except DataError as e:
        if cfg.resume and cfg.data and not os.path.exists(cfg.data):
            raise DataError(f"{e} (--resume: the checkpoint's config names it; if it moved, pass --data NEWPATH: "
                            "the run continues if it is the same file)") from None
        raise


def definition_text(cfg: Config, dataset: Any, resumed: checkpoint.Checkpoint | None = None) -> str:
    """(rank 0) The network's stored definition (`mpiasgd.model.spec`) as JSON text: a resumed run's from its
    checkpoint `resumed` (the network it trained, whatever the file says now; `checkpoint.load` verified
    its CRC), else what --model names, a file's network taking the dataset's image shape. Checked by
    building its layers. Raises ModelSpecError (a ValueError) or CheckpointError naming what is wrong."""
    stored = resumed.model_spec if resumed is not None else ""
    if stored:
        what = f"--resume: checkpoint '{cfg.resume}': its network definition"
        spec = from_json(stored, what)
        try:
            layers_from_spec(spec)
        except ValueError as e:
            raise ConfigError(f"{what} is corrupt: {e}") from None
        return to_json(spec)
    if resumed is not None and is_file_ref(cfg.model):  # (a checkpoint from before definitions were stored)
        raise ConfigError(f"--resume: checkpoint '{cfg.resume}' holds no network definition and names no built-in "
                          f"network ({cfg.model!r}): a file's network is rebuilt only from its stored definition, "
                          "never by running the file again")
    spec = resolve(cfg.model, tuple(dataset.input_shape), cfg.model_timeout)
    try:
        return to_json(spec)
    except (TypeError, ValueError, RecursionError) as e:  # (resolve made it from JSON values: a safeguard)
        raise ConfigError(f"--model {cfg.model!r}: its definition cannot be stored as JSON ({e})") from None


def send_definition(me: Rank, text: str | None, timeout: float) -> str | None:
    """(collective) Rank 0's definition text (`definition_text`, None when its start-up failed) on every rank.

    The workers wait for it without blocking, for `timeout` seconds at most: rank 0 bounds a user's file
    (--model-timeout), but a file stuck where no signal reaches it (a blocked SIGALRM, a C call) must not
    hang the job, so worker rank 1 (the others 2 s later) prints one error line after `timeout` and aborts the job.
    """
    if me.is_rank0:
        data = text.encode() if text is not None else b""
        size = np.array([len(data) if text is not None else -1], dtype=np.int64)
        me.comm.Ibcast(size, root=0).Wait()
    else:
        size = np.zeros(1, dtype=np.int64)
        request = me.comm.Ibcast(size, root=0)
        deadline = time.monotonic() + timeout + (0.0 if me.rank == 1 else 2.0)  # (one line: rank 1's, usually)
        while not request.Test():
            if time.monotonic() > deadline:
                print(f"mpiasgd: error: rank {me.rank}: rank 0 sent no network definition within {timeout:g} s "
                      "(--model-timeout + --comm-timeout): is its --model file stuck? The job is aborted",
                      file=sys.stderr, flush=True)
                me.comm.Abort(2)
            time.sleep(0.01)
        data = bytearray(max(int(size[0]), 0))
    if size[0] > 0:
        me.comm.Bcast(data, root=0)
    return None if size[0] < 0 else bytes(data).decode()


def shared_definition(text: str) -> dict:
    """The definition rank 0 sent (JSON text, `definition_text`), on every rank: every worker builds the
    network rank 0 logs, from data (no rank but 0 runs a user's model file)."""
    return from_json(text)


def startup_error(e: BaseException) -> str:
    """The one-line start-up error of exception `e`: the message of an expected error (STARTUP_ERRORS), else
    the exception's type and message (a MemoryError for a network too large, a user file's SystemExit)."""
    if isinstance(e, STARTUP_ERRORS):
        return str(e)
    if isinstance(e, MemoryError):
        return f"out of memory at start-up ({type(e).__name__}: {e}): the network or dataset is too large here"
    return f"start-up failed: {type(e).__name__}: {e}"


def setup(cfg: Config, me: Rank, mode: Mode, dataset: Any, spec: dict, local_rank: int = 0,
          resumed: checkpoint.Checkpoint | None = None) -> Startup:
    """Per-rank start-up with the run's dataset and network definition (and on rank 0 the checkpoint of a
    --resume, `resumed`, read once); returns what the role needs. Raises one of STARTUP_ERRORS on bad input.

    `local_rank` is a worker's index among the workers of its node (its GPU, modulo visible devices).
    """
    if me.size < 2 and cfg.servers <= 1:  # (--servers S > 1: the message below, which counts the shards)
        raise ConfigError(f"mpiasgd train needs at least 2 MPI ranks (1 parameter server + workers), got {me.size}; "
                          "launch it with e.g. 'mpiexec -n 3 python -m mpiasgd train'")
    if me.num_workers < 1:
        S = cfg.servers
        raise ConfigError(f"mpiasgd train --servers {S} needs at least {S + 1} MPI ranks ({S} parameter-server "
                          f"shards + workers), got {me.size}; launch it with e.g. 'mpiexec -n {S + 2} python -m "
                          f"mpiasgd train --servers {S}' (2 workers)")
    # the server ranks (rank 0 and the shards) keep host weights: always numpy, no GPU
    backend, device = ("numpy", None) if not me.is_worker else worker_backend(cfg, me, local_rank)
    try:
        model = build_model(spec, backend)  # the server keeps host weights: always numpy
    except ValueError as e:
        raise ConfigError(f"--model {cfg.model!r}: {e}") from None
    if tuple(dataset.input_shape) != tuple(model.input_shape):
        crop = (f" (its {tuple(dataset.image_shape)} images after --augment {dataset.augmentation.describe()})"
                if tuple(dataset.input_shape) != tuple(dataset.image_shape) else "")
        c, h, w = model.input_shape
        fits = (f"; --augment inner-crop={h} or resized-crop={h} gives {h}x{w} crops of these images"
                if h == w and c == dataset.image_shape[0] and h < min(dataset.image_shape[1:]) else "")
        raise ConfigError(f"model '{cfg.model_label}' takes inputs {tuple(model.input_shape)}, dataset "
                          f"'{cfg.dataset_name}' gives {tuple(dataset.input_shape)}{crop}: choose a network for "
                          f"these images{fits}")
    if model.num_params == 0:
        raise ConfigError(f"model '{cfg.model_label}' has no parameters to train")
    if message_count(model) > MAX_MESSAGE_VALUES:
        raise ConfigError(f"model '{cfg.model_label}' has {model.num_params:,} parameters and {model.num_buffers:,} "
                          f"buffer values; a message of mpiasgd holds at most {MAX_MESSAGE_VALUES:,} values "
                          "(MPI counts bytes with 32-bit ints)")
    single = [layer for layer in walk(model.layers)
              if isinstance(layer, BatchNorm2d) and cfg.batch_size * layer.plane < 2]
    if single:
        raise ConfigError(f"config key 'batch_size' = {cfg.batch_size}: {single[0].describe()} of model "
                          f"'{cfg.model_label}' would see one value per channel (1x1 maps); BatchNorm needs a "
                          "minibatch of at least 2 there")
    classes = max(len(dataset.classes), int(dataset.train_y.max()) + 1 if dataset.train_y.size else 0)
    if model.num_classes < classes:
        raise ConfigError(f"--model {cfg.model!r}: model '{cfg.model_label}', its last layer {model.names[-1]} "
                          f"({model.layers[-1].describe()}) gives {model.num_classes} logits, dataset "
                          f"'{cfg.dataset_name}' has {classes} classes")
    if cfg.min_workers > me.num_workers:
        raise ConfigError(f"config key 'min_workers' = {cfg.min_workers}: more than the job's {me.num_workers} "
                          f"worker{'s' * (me.num_workers != 1)} (below it a run that loses workers ends failed)")
    slow = sorted(r for r in cfg.stragglers() if r > me.num_workers)
    if slow:
        raise ConfigError(f"config key 'straggler' = {cfg.straggler!r}: rank(s) {slow} are not workers "
                          f"(workers are ranks 1..{me.num_workers})")
    if dataset.num_test == 0:
        raise ConfigError(f"dataset '{cfg.dataset_name}' has no test split to evaluate on: convert one into the "
                          "file (val/ or test/ beside train/) or pass --test-data FILE")
    layout = mode.layout(cfg, model, me.num_workers, dataset.num_train)
    # validates: more workers than samples (or a file's chunks) is a DataError naming both numbers
    samplers = [ShardSampler(dataset.num_train, layout.shards, s, cfg.seed, dataset.chunk, cfg.shuffle_window)
                for s in range(layout.shards)]
    smallest_shard = min(len(s) for s in samplers)
    if cfg.batch_size > smallest_shard:
        raise ConfigError(f"config key 'batch_size' = {cfg.batch_size}: larger than the smallest worker shard "
                          f"({smallest_shard} images: {dataset.num_train} over {layout.shards} shards)")
    # --servers S > 1: the slices of the shards (ShardError, a ValueError, for a model too small to cut)
    cut = ShardCut.balanced(model.num_params, model.num_buffers, cfg.servers) if cfg.servers > 1 else None
    out = Startup(mode, dataset, model, backend, device, layout, samplers=samplers, cut=cut)
    if me.is_rank0:
        open_run_log(cfg, me, out, resumed)
        return out
    if me.is_shard:  # (shards of rank >= 1) the dataset's size, the model's initial weights: nothing more
        return out
    out.sampler = samplers[layout.shard[me.rank]]
    out.test_idx = test_slice(dataset.num_test, me.num_workers, me.rank)
    if cfg.data_in_memory and hasattr(dataset, "keep_in_memory"):
        dataset.keep_in_memory(out.sampler.shard_indices())  # a file's shard, read once (MemoryError: a start-up error)
    if backend == "cupy" and cfg.cuda_graphs != "off" and mode.name != "pipeline":
        out.graphs, out.graphs_note = probe_cuda_graphs(cfg, model.spec())
    query = getattr(MPI, "Query_cuda_support", None)
    if backend == "cupy" and cfg.cuda_aware == "auto" and query is None:
        query = mpix_cuda_support()  # mpi4py's PyPI wheels lack Query_cuda_support: ask libmpi itself
    cuda_aware = backend == "cupy" and resolve_cuda_aware(cfg.cuda_aware, query)
    count = message_count(model)  # weights or gradient, then the layers' buffers
    feedback = worker_feedback(cfg, model)  # --wire-error-feedback: one residual, shared by both stagings
    if cut is not None:  # one message per shard each way
        out.staging = make_sharded_staging(backend, cut, wire=cfg.wire, feedback=feedback)
        out.make_staging = lambda: make_sharded_staging(backend, cut, wire=cfg.wire,
                                                        feedback=feedback)  # --overlap: a second one
        return out
    out.staging = make_staging(backend, cuda_aware, count, wire=cfg.wire, feedback=feedback)  # reused every step
    out.make_staging = lambda: make_staging(backend, cuda_aware, count, wire=cfg.wire,
                                            feedback=feedback)  # --overlap: a second one
    return out


def open_run_log(cfg: Config, me: Rank, out: Startup, resumed: checkpoint.Checkpoint | None = None) -> None:
    """(rank 0) The run log's path, its writer lock, and on --resume the checkpoint (`resumed` when already
    read, checked against this job): into `out`. ConfigError / FileExistsError naming the file.

    On --resume, a log that cannot be read (cut short, damaged) or belongs to another run is an error unless
    --overwrite: then `out.replace_log` says why, and the resumed run writes a new log that starts at the
    checkpoint (`rank0.serve.start_log`). A readable log of this run is continued either way."""
    out.path = os.path.join(cfg.run_dir, run_name(cfg, me.num_workers) + ".h5")
    if cfg.resume:
        ckpt = out.checkpoint = resumed if resumed is not None else checkpoint.load(cfg.resume)
        if ckpt.num_workers != me.num_workers and not out.mode.elastic:
            raise ConfigError(f"--resume: checkpoint '{cfg.resume}' was written by a run with {ckpt.num_workers} "
                              f"workers; this job has {me.num_workers} (launch {me.servers + ckpt.num_workers} "
                              f"ranks; mode '{cfg.mode}' resumes with the same number of workers only)")
        # the log lives next to its checkpoint, wherever the job is started from
        out.path = os.path.join(os.path.dirname(os.path.abspath(cfg.resume)), os.path.basename(ckpt.log))
        check_fits(ckpt, cfg, me, out.model)
        if simulated_log(out.path):
            raise ConfigError(f"--resume: checkpoint '{cfg.resume}' was written by `mpiasgd simulate` (its log "
                              f"'{out.path}' counts virtual seconds): `train` would go on in real ones in the same "
                              "log; resume real runs only")
    log_dir = os.path.dirname(out.path) or "."
    what = (f"--resume {cfg.resume!r}: the checkpoint's directory" if cfg.resume
            else f"config key 'run_dir' = {cfg.run_dir!r}")
    if os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ConfigError(f"{what}: is a file, expected a directory")
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what}: cannot create it ({e.strerror})") from None
    if not os.access(log_dir, os.W_OK):
        raise ConfigError(f"{what}: directory is not writable")
    out.lock = WriterLock(out.path)
    out.lock.acquire("--resume: another job is writing this run's log; wait for it to end" if cfg.resume
                     else "choose another --name")  # held until the log is closed, or the process dies
    left = left_behind(out.path, out.lock)  # by a job that died writing this run (its temporaries go)
    if os.path.exists(out.path) and not cfg.overwrite and not cfg.resume:
        out.lock.release()
        raise FileExistsError(f"run log '{out.path}' exists; choose another --name or pass --overwrite"
                              + (f" ({left})" if left else ""))
    if cfg.resume and os.path.exists(out.path):
        try:
            attrs = log_attrs(out.path, "data_fingerprint", "run_id")  # ("" for logs written before either)
        except (OSError, RuntimeError, KeyError) as e:  # RuntimeError, KeyError: h5py's, for damaged metadata
            if not cfg.overwrite:
                out.lock.release()
                raise ConfigError(f"--resume: run log '{out.path}' cannot be read ({e}); move it away to resume "
                                  "into a new log, which starts at the checkpoint (or pass --overwrite to "
                                  "replace it)") from None
            out.replace_log = f"cannot be read ({e})"
            attrs = {"data_fingerprint": "", "run_id": ""}  # (a new log: nothing of the old one to check)
        trained_on = attrs["data_fingerprint"]
        if trained_on and trained_on != out.dataset.fingerprint:
            out.lock.release()
            raise ConfigError(f"--resume: the run in '{out.path}' trained on a dataset file {trained_on}; "
                              f"'{cfg.dataset_name}' is another ({out.dataset.fingerprint or 'a built-in set'}): "
                              "pass --data with the file it trained on")
        owner = attrs["run_id"]
        if owner and out.checkpoint.run_id and owner != out.checkpoint.run_id and cfg.overwrite:
            out.replace_log = f"belongs to another run (run id {owner})"
        elif owner and out.checkpoint.run_id and owner != out.checkpoint.run_id:
            out.lock.release()
            raise ConfigError(f"--resume: run log '{out.path}' belongs to another run (run id {owner}) than "
                              f"checkpoint '{cfg.resume}' (run id {out.checkpoint.run_id}): it was overwritten "
                              f"since; move it away to resume into a new log (or pass --overwrite to replace it)")
    if left:
        print(f"mpiasgd: note: {left}", file=sys.stderr, flush=True)


def worker_info(me: Rank, start: Startup, threads: int) -> WorkerInfo:
    """(workers) This worker's start-up record, for rank 0."""
    dev = start.device
    module, replica = start.layout.place.get(me.rank, (-1, -1))
    return WorkerInfo(rank=me.rank, host=me.host, pid=os.getpid(), threads=threads, backend=start.backend,
                      shard_size=len(start.sampler), device=-1 if dev is None else dev.index,
                      device_name="" if dev is None else dev.name, device_uuid="" if dev is None else dev.uuid,
                      transfer=start.staging.kind, module=module, replica=replica, autotune=tuple(start.autotune),
                      graphs=start.graphs_note)


def simulated_log(path: str) -> bool:
    """The run log at `path` was written by `mpiasgd simulate` (attribute "clock" = "virtual"); False when there is
    none or it cannot be read (the resume's other checks say why)."""
    try:
        with open_log(path) as f:
            return str(f.attrs.get("clock", "")) == "virtual"
    except Exception:  # (missing, damaged, locked: not this check's to report)
        return False


def check_fits(ckpt: checkpoint.Checkpoint, cfg: Config, me: Rank, model: Any) -> None:
    """ConfigError unless checkpoint `ckpt` fits this job: its mode, model, parameter count, worker ranks."""
    where = f"--resume: checkpoint '{cfg.resume}'"
    if ckpt.buffers.size not in (0, model.num_buffers):
        raise ConfigError(f"{where} holds {ckpt.buffers.size} buffer values, model '{cfg.model_label}' has "
                          f"{model.num_buffers}")
    if (ckpt.mode, ckpt.model) != (cfg.mode, cfg.model):
        raise ConfigError(f"{where} holds a '{ckpt.mode}' run of model '{ckpt.model}', its config says "
                          f"'{cfg.mode}' and '{cfg.model}'")
    if ckpt.params.size != model.num_params:
        raise ConfigError(f"{where} holds {ckpt.params.size} parameters, model '{cfg.model}' has {model.num_params}")
    ranks = sorted(int(r) for r in ckpt.workers["rank"])
    if ranks != list(range(1, ckpt.num_workers + 1)):
        raise ConfigError(f"{where} holds workers {ranks}, expected 1..{ckpt.num_workers} (its num_workers)")
    shards = ckpt.shard_versions.size or 1
    if shards != cfg.servers:  # (the config refuses a change first: 'servers' is fixed on resume)
        raise ConfigError(f"{where} holds the state of {shards} parameter-server shard(s); this job has "
                          f"--servers {cfg.servers} (a resumed run keeps its shards)")
    if not ckpt.log.endswith(".h5"):
        raise ConfigError(f"{where} names its run log {ckpt.log!r}, expected NAME.h5")
def left_behind(path: str, lock: WriterLock) -> str:
    """(server only, holding `lock`, the writer lock of the run log at `path`) What a job that died while
    writing this run left behind, in one line ("" if nothing): its log with status "running" (its
    writer is gone: this job holds the lock; a resume recovers and continues it, --overwrite replaces
    it) and the temporary checkpoint files of processes that no longer exist, which are removed here
    (`checkpoint.remove_stale_temporaries`: a live process's file is kept)."""
    removed = checkpoint.remove_stale_temporaries(checkpoint.checkpoint_path(path))
    parts = []
    try:
        clear_stale_flags(path, check_writer=False)  # its writer was killed with the file open (we hold the lock)
        with open_log(path, hold_lock=True) as f:  # never a SWMR read: it waits minutes on a truncated file
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


def log_attrs(path: str, *names: str) -> dict[str, str]:
    """(server only, holding the log's writer lock) The text attributes `names` of the run log at `path` (""
    where absent), read in one opening. OSError, RuntimeError or KeyError (h5py's) when it cannot be read:
    cut short, its metadata damaged."""
    with open_log(path, hold_lock=True) as f:
        values = {name: f.attrs.get(name, "") for name in names}
    return {name: value.decode() if isinstance(value, bytes) else str(value) for name, value in values.items()}


def tune_convs(cfg: Config, me: Rank, start: Startup, turns: list[int]) -> bool:
    """Collective (--conv-algo autotune): each GPU worker times the conv tiles of the layers it computes
    (`autotune_convs`; the mode's layout says which) at its turn (`device.tuning_turns`: workers sharing
    a GPU one after another), its plans kept in `start.autotune` for the start-up gather. True if any
    rank failed (reported once by rank 0, as every start-up error)."""
    for turn in range(max(turns, default=-1) + 1):
        error = None
        if turns[me.rank] == turn:
            first, last = start.layout.layers[me.rank]
            try:
                start.autotune = autotune_convs(cfg, start.dataset, first, last,
                                                spec=None if start.model is None else start.model.spec())
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
    if me.is_rank0:
        by_text: dict[str, list[int]] = {}
        for r, text in enumerate(errors):
            if text:
                by_text.setdefault(text, []).append(r)
        for text, ranks in by_text.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            print(f"mpiasgd: error ({who}): {text}", file=sys.stderr, flush=True)
    return True


