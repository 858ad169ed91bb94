"""Run configuration: one frozen dataclass, filled from defaults < TOML file < command-line flags.

Every field has a default and a one-line help with its unit. Unknown or ill-typed keys are errors
(`ConfigError`, suggesting the close key or flag), and so are values out of range. A TOML file's
relative paths are read against its own folder, a flag's against the working folder. Rank 0 stores
the resolved config in the run log (attribute `config`, JSON) and prints it once with `--show-config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from mpiasgd.data import DATASETS, DataError
from mpiasgd.data.augment import Augmentation
from mpiasgd.model import MODELS
from mpiasgd.model.spec import USER_FILE, is_file_ref, label
from mpiasgd.modes.registry import (
    MODES,
    OPTIONS,
    SERVER_WAITS,
    AsyncOptions,
    EasgdOptions,
    PipelineOptions,
    ShardOptions,
    SspOptions,
    load,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration key is unknown, ill-typed or out of range (the message names the key)."""


BACKENDS = ("auto", "numpy", "cpu", "cupy")
HOST_BACKENDS = ("numpy", "cpu")  # mpiasgd.ops's backends on the host (no GPU, cupy never imported)
CUDA_AWARE = ("auto", "on", "off")
CUDA_GRAPHS = ("auto", "on", "off")  # --cuda-graphs (mpiasgd.ops.cuda.graphs)
CONV_ALGOS = ("heuristic", "autotune")  # ops.cuda.planner.CONV_ALGOS (not imported: it would import the backend)
SCHEDULES = ("constant", "step", "cosine")
LR_SCALINGS = ("none", "linear")
ON_DIVERGENCE = ("warn", "stop")


def _opt(default: Any, group: str, help: str) -> Any:
    return field(default=default, metadata={"group": group, "help": help})


@dataclass(frozen=True)
class BaseConfig:
    """The keys every mode has; `Config` adds the keys the modes own (`mpiasgd.modes.registry.OPTIONS`)."""

    # --- model and data ---
    model: str = _opt("digits", "model and data",
                      "network: a built-in (digits | cifar10 | cifar10_deep | resnet20 | resnet56 | ...; the "
                      "docs/networks.md lists them), or a file: PATH.py:FUNCTION (returns a list of "
                      "mpiasgd.model.layers) or PATH.json (a stored definition); the run log stores the definition")
    model_timeout: float = _opt(120.0, "model and data",
                                "PATH.py:FUNCTION: rank 0 gives importing the file and calling FUNCTION this long, "
                                "else one start-up error (the workers give up after this plus --comm-timeout); "
                                "seconds")
    dataset: str = _opt("", "model and data", "dataset: digits | cifar10 | synthetic64 | synthetic224 (default: a "
                        "built-in network's own; "
                        "required with a network from a file)")
    data_dir: str = _opt("", "model and data",
                         "folder holding cifar-10-batches-py/ or -bin/ (default: $MPIASGD_DATA or ~/.cache/mpiasgd)")
    data: str = _opt("", "model and data",
                     "an mpiasgd dataset file (HDF5, written by `mpiasgd data convert` or `data synth`): train on "
                     "its train split, evaluate on its test split; replaces --dataset")
    test_data: str = _opt("", "model and data", "another dataset file whose test split to evaluate on (with --data)")
    augment: str = _opt("", "model and data",
                        "training augmentation, comma-separated: pad-crop=P | inner-crop=S | resized-crop=S, flip, "
                        "pca-noise=SIGMA, or none (default: the dataset's: pad-crop=4,flip for images of 32 pixels "
                        "or more, none for digits); evaluation centre-crops what training crops")
    shuffle_window: int = _opt(16, "model and data",
                               "--data: a worker reads its shard a chunk at a time in a shuffled chunk order and "
                               "shuffles the images within a window of this many chunks")
    data_in_memory: bool = _opt(False, "model and data",
                                "--data: each worker reads its whole shard into memory at start-up (when it fits)")
    prefetch: int = _opt(2, "model and data",
                         "minibatches a background thread prepares ahead of the step (read, augment, "
                         "normalise); 0 = in the step")
    seed: int = _opt(0, "model and data", "seed of initial weights, shards and augmentation")
    batch_size: int = _opt(32, "model and data", "minibatch per worker, images")
    # --- parallelism ---
    mode: str = _opt("async", "parallelism", "training mode: " + " | ".join(f"{m.name} ({m.help})"
                                                                           for m in MODES.values()))
    backend: str = _opt("auto", "parallelism",
                        "compute backend of the workers: auto (cupy where the worker's node has a GPU, else cpu) "
                        "| numpy (the reference: im2col + BLAS) | cpu (the reference with its convolutions run "
                        "from the cache, 1.2-2x faster) | cupy (default: auto)")
    share_devices: bool = _opt(False, "parallelism", "allow two workers on one GPU (else a start-up error)")
    cuda_aware: str = _opt("auto", "parallelism",
                           "MPI takes device buffers: auto (ask MPI.Query_cuda_support or MPIX_Query_cuda_support; off "
                           "without either) | on | off")
    conv_algo: str = _opt("heuristic", "parallelism",
                          "cupy workers' conv kernel tiles: heuristic (fixed rules; bit-reproducible) | autotune "
                          "(at start-up every conv pass times every tile and keeps the fastest, the heuristic's "
                          "unless another is > 3 % faster, as cudnn.benchmark; logged as 'autotune' events)")
    cuda_graphs: str = _opt("auto", "parallelism",
                            "cupy workers: each training step's forward and backward as a CUDA graph, captured once "
                            "per batch shape and replayed (one launch instead of one per kernel): auto (where the "
                            "capture works and its replay gives the eager step's bits, checked at start-up; else "
                            "eager launches, the reason logged as event 'cuda_graphs') | on (a start-up error where "
                            "a GPU worker's step cannot be a graph; a worker --backend auto puts on the CPU warns "
                            "that it does not apply) | off. Not in pipeline mode (its modules launch eagerly)")
    threads: int = _opt(0, "parallelism", "BLAS threads per worker rank; 0 = cores of the node / workers on it")
    comm_timeout: float = _opt(300.0, "parallelism",
                               "rank 0 ends the run when a worker has sent nothing for this long (naming it); "
                               "workers give up on a peer or on rank 0 after twice this; seconds")
    stall_warning: float = _opt(60.0, "parallelism",
                                "rank 0 warns (stderr and the log's events) when a worker has sent nothing for this "
                                "long; 0 = never; seconds")
    straggler: str = _opt("", "parallelism",
                          "RANK:FACTOR[,RANK:FACTOR]: those workers sleep FACTOR-1 times their compute time per "
                          "step (a heterogeneous cluster on one machine)")
    # --- optimizer (applied by the parameter server) ---
    lr: float = _opt(0.01, "optimizer", "peak learning rate (SGD step size)")
    lr_scaling: str = _opt("none", "optimizer",
                           "none | linear (sync, pipeline): the peak lr is --lr times the minibatches one update "
                           "averages (sync: the workers; pipeline: the replicas), the linear scaling rule of Goyal "
                           "et al. 2017 (use it with --warmup-epochs)")
    momentum: float = _opt(0.9, "optimizer", "momentum, 0 <= m < 1 (heavy ball unless --nesterov)")
    nesterov: bool = _opt(False, "optimizer", "Nesterov momentum (torch.optim.SGD's form) instead of heavy-ball; "
                          "needs momentum > 0")
    weight_decay: float = _opt(5e-4, "optimizer", "L2 penalty, times each parameter's decay_mult (by default 1 on "
                               "conv/linear weights, 0 on biases and BatchNorm; resnet20/56 decay every parameter)")
    lr_schedule: str = _opt("cosine", "optimizer", "after warm-up: constant | step | cosine (to 0 at the stop)")
    warmup_epochs: float = _opt(0.5, "optimizer", "linear learning-rate warm-up from 0, epochs")
    lr_milestones: tuple = _opt((), "optimizer", "step schedule: epochs at which lr is multiplied by --lr-gamma")
    lr_gamma: float = _opt(0.1, "optimizer", "step schedule: factor per milestone")
    max_rejects: int = _opt(10, "optimizer", "non-finite gradients in a row from one worker before the run stops")
    # --- stopping (first limit reached stops the run; 0 = no limit) ---
    epochs: float = _opt(10.0, "stopping", "passes over the training set by all workers together (0 = no limit)")
    max_pushes: int = _opt(0, "stopping", "gradient pushes applied by the server; sync: steps; easgd: exchanges; "
                                          "pipeline: minibatches "
                                          "per replica (0 = no limit)")
    max_time: float = _opt(0.0, "stopping", "wall time of training, seconds (0 = no limit)")
    stop_accuracy: float = _opt(0.0, "stopping",
                                "stop once an evaluation during training (--eval-interval) reaches this test top-1 "
                                "accuracy, a fraction (0.65 = 65 %); 0 = never")
    on_divergence: str = _opt("warn", "stopping",
                              "when the training loss spikes far above its running level, or the network is dead "
                              "(loss at ln(classes), chance accuracy, after the first epoch): warn (stderr and a "
                              "log event) | stop (also end the run there: status 'diverged', exit status 3)")
    # --- run log ---
    name: str = _opt("", "run log", "run name; the log is RUN_DIR/NAME.h5 (default: model-mode-Nw-timestamp)")
    run_dir: str = _opt("runs", "run log", "folder of run logs")
    overwrite: bool = _opt(False, "run log", "replace an existing log of the same name")
    snapshot_interval: float = _opt(-1.0, "run log",
                                    "weight snapshot every this many seconds; 0 = first and last only; -1 = auto: "
                                    "max(5, model MB / 1 MB/s) seconds, so that a large model does not write "
                                    "its whole weights into the log every 5 s (AlexNet: every 244 s, not 49 "
                                    "MB/s); the first and last snapshots are always taken")
    flush_interval: float = _opt(2.0, "run log", "log flushed to disk every this many seconds")
    checkpoint_interval: float = _opt(300.0, "run log",
                                      "rank 0 writes the training state to RUN_DIR/NAME.ckpt.h5 every this many "
                                      "seconds, and always at the end and on SIGTERM/SIGUSR1/SIGINT; 0 = only then; "
                                      "seconds")
    resume: str = _opt("", "run log",
                       "continue the run saved in this checkpoint (RUN_DIR/NAME.ckpt.h5): its config, log, "
                       "weights, optimizer state, step counts and data positions; flags given override the "
                       "config (model, mode, seed, batch size, name and the pipeline's layout excepted)")
    eval_batch_size: int = _opt(256, "run log", "images per forward pass when evaluating")
    eval_interval: str = _opt("", "run log",
                              "evaluate the current weights on the test split during training, every Ns seconds or "
                              "Nep epochs (e.g. 300s, 0.5ep); the workers evaluate their slices; '' = only at the end")
    tensorboard: bool = _opt(False, "run log",
                             "rank 0 also writes the metrics as TensorBoard event files into RUN_DIR/NAME.tb/ "
                             '(needs the tensorboard extra: pip install -e ".[tensorboard]")')
    progress: bool = _opt(True, "run log", "progress bar on rank 0")
    show_config: bool = _opt(False, "run log",
                             "rank 0 prints the resolved config (every key) before training; it is stored in the "
                             "run log either way (attribute 'config')")

    def validate(self) -> Config:
        """Check every value's range; raise ConfigError naming the key. Returns self."""
        def need(ok: bool, key: str, expected: str) -> None:
            if not ok:
                raise ConfigError(f"config key '{key}' = {getattr(self, key)!r}: expected {expected}")

        need(self.model in MODELS or is_file_ref(self.model), "model",
             f"one of {sorted(MODELS)}, or a file PATH.py:FUNCTION or PATH.json")

        need(self.dataset in ("", *DATASETS), "dataset", " | ".join(DATASETS))
        need(self.mode in MODES, "mode", f"one of {tuple(MODES)}")

        for name in MODES:  # the ranges of every mode's keys (a key of another mode is at its default: valid)
            load(name).check_config(self)
        for option in OPTIONS:  # a key of other modes keeps its default: a flag never silently does nothing
            if self.mode in option.modes:
                continue
            if len(option.modes) == 1:
                need(getattr(self, option.name) == option.default, option.name, f"{option.default!r} unless --mode "
                     f"{option.modes[0]} (it applies to the {option.modes[0]} mode only; mode is {self.mode!r})")
            else:
                note = MODES[self.mode].note
                need(getattr(self, option.name) == option.default, option.name, f"{option.default!r} in mode "
                     f"'{self.mode}' ({note + '; ' if note else ''}'{option.name}' applies to the "
                     f"{' and '.join(option.modes)} modes)")
        need(self.backend in BACKENDS, "backend", f"one of {BACKENDS}")
        need(self.cuda_aware in CUDA_AWARE, "cuda_aware", f"one of {CUDA_AWARE}")
        need(not (self.backend in HOST_BACKENDS and self.cuda_aware == "on"), "cuda_aware",
             f"'auto' or 'off' with --backend {self.backend} (device buffers need GPU workers: --backend cupy or auto)")
        need(self.conv_algo in CONV_ALGOS, "conv_algo", f"one of {CONV_ALGOS}")
        need(self.cuda_graphs in CUDA_GRAPHS, "cuda_graphs", f"one of {CUDA_GRAPHS}")
        need(not (self.cuda_graphs == "on" and self.backend in HOST_BACKENDS), "cuda_graphs",
             f"'auto' or 'off' with --backend {self.backend} (graphs are for GPU workers: --backend cupy or auto)")
        need(not (self.cuda_graphs == "on" and self.mode == "pipeline"), "cuda_graphs",
             "'auto' or 'off' with --mode pipeline (its modules launch eagerly)")
        need(self.server_wait in SERVER_WAITS, "server_wait", f"one of {SERVER_WAITS}")
        need(not (self.backend in HOST_BACKENDS and self.conv_algo == "autotune"), "conv_algo",
             f"'heuristic' with --backend {self.backend} (it chooses the tiles of the cupy backend's conv kernels: "
             "--backend cupy or auto, or pass --conv-algo heuristic, also over a --resume checkpoint's config)")
        need(self.batch_size >= 1, "batch_size", "an integer >= 1")
        need(0 <= self.seed < 2**63, "seed", f"an integer from 0 to 2**63 - 1 = {2**63 - 1}")
        need(self.threads >= 0, "threads", "an integer >= 0")
        need(self.comm_timeout > 0, "comm_timeout", "seconds > 0")
        need(0 < self.model_timeout <= 1e6, "model_timeout", "seconds > 0, at most 1e6")
        need(math.isfinite(self.stall_warning) and self.stall_warning >= 0, "stall_warning", "seconds >= 0")
        need(math.isfinite(self.lr) and self.lr > 0, "lr", "a finite number > 0")
        need(self.lr_scaling in LR_SCALINGS, "lr_scaling", f"one of {LR_SCALINGS}")
        need(self.lr_scaling == "none" or self.mode in ("sync", "pipeline"), "lr_scaling",
             f"'none' in mode '{self.mode}' (an update there is one worker's minibatch: the linear rule would "
             f"multiply by 1; see docs/modes.md, 'Step size and momentum for N workers')")
        need(0 <= self.momentum < 1, "momentum", "0 <= momentum < 1")
        need(not (self.nesterov and self.momentum == 0), "nesterov",
             "False with momentum 0 (Nesterov momentum needs a momentum > 0)")
        need(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "a number >= 0")
        need(self.lr_schedule in SCHEDULES, "lr_schedule", f"one of {SCHEDULES}")
        need(self.warmup_epochs >= 0, "warmup_epochs", "epochs >= 0")
        need(all(m > 0 for m in self.lr_milestones), "lr_milestones", "a list of epochs > 0")
        need(list(self.lr_milestones) == sorted(self.lr_milestones), "lr_milestones", "increasing epochs")
        need(0 < self.lr_gamma <= 1, "lr_gamma", "0 < gamma <= 1")
        need(self.max_rejects >= 1, "max_rejects", "an integer >= 1")
        need(self.on_divergence in ON_DIVERGENCE, "on_divergence", f"one of {ON_DIVERGENCE}")
        self.stragglers()  # raises on a malformed entry
        need(self.epochs >= 0, "epochs", "epochs >= 0 (0 = no limit)")
        need(self.max_pushes >= 0, "max_pushes", "a count >= 0 (0 = no limit)")
        need(self.max_time >= 0, "max_time", "seconds >= 0 (0 = no limit)")
        if self.epochs == 0 and self.max_pushes == 0 and self.max_time == 0:
            raise ConfigError("no stopping rule: set at least one of 'epochs', 'max_pushes', 'max_time' > 0")
        need(self.snapshot_interval >= 0 or self.snapshot_interval == -1, "snapshot_interval",
             "seconds >= 0, or -1 (auto)")
        need(self.flush_interval > 0, "flush_interval", "seconds > 0")
        need(math.isfinite(self.checkpoint_interval) and self.checkpoint_interval >= 0, "checkpoint_interval",
             "seconds >= 0 (0 = only at the end and on a signal)")
        need(self.eval_batch_size >= 1, "eval_batch_size", "an integer >= 1")
        self.eval_every()  # raises on a malformed interval
        need(0 <= self.stop_accuracy <= 1, "stop_accuracy", "a fraction 0..1 (0 = never)")
        need(not self.stop_accuracy or self.eval_every()[0] > 0, "stop_accuracy",
             "0 without --eval-interval (it is judged on the evaluations during training)")
        need(not (self.data and self.dataset), "data", "'' with --dataset (a file replaces the named dataset)")
        need(not self.test_data or bool(self.data), "test_data", "'' without --data")
        need(self.model in MODELS or self.dataset != "" or self.data != "", "dataset",
             f"a dataset name or a --data file for the network from file {self.model!r}")
        if self.augment:
            try:
                Augmentation.parse(self.augment)
            except DataError as e:
                raise ConfigError(f"config key 'augment' = {self.augment!r}: {e}") from None
        need(self.shuffle_window >= 1, "shuffle_window", "an integer >= 1 (chunks)")
        need(0 <= self.prefetch <= 64, "prefetch", "0..64 minibatches")
        need(self.name == "" or (self.name.strip() == self.name and "/" not in self.name
                                 and not self.name.startswith(".") and not self.name.endswith(".h5")),
             "name", "a file name without '/', leading '.', surrounding blanks or '.h5' (it is added)")
        return self

    def stragglers(self) -> dict[int, float]:
        """`straggler` parsed: {worker rank: slowdown factor >= 1}; ConfigError naming the bad entry."""
        out: dict[int, float] = {}
        for entry in filter(None, (e.strip() for e in self.straggler.split(","))):
            try:
                rank_text, factor_text = entry.split(":")
                rank, factor = int(rank_text), float(factor_text)
            except ValueError:
                raise ConfigError(f"config key 'straggler' entry {entry!r}: expected RANK:FACTOR, e.g. 2:3") from None
            if rank < 1 or not (math.isfinite(factor) and factor >= 1) or rank in out:
                raise ConfigError(f"config key 'straggler' entry {entry!r}: expected a worker rank >= 1 (once) "
                                  f"and a factor >= 1")
            out[rank] = factor
        return out

    def eval_every(self) -> tuple[float, str]:
        """`eval_interval` parsed: (0.0, "") when off, else (N > 0, "s") for every N seconds or (N, "ep") for every
        N epochs; a bare number is seconds. ConfigError naming the key when malformed."""
        text = self.eval_interval.strip()
        if text in ("", "0"):
            return 0.0, ""
        unit = "ep" if text.endswith("ep") else "s"
        number = text[:-2] if unit == "ep" else text.removesuffix("s")
        try:
            value = float(number)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"config key 'eval_interval' = {self.eval_interval!r}: expected Ns (seconds) or Nep "
                              "(epochs) with N > 0, e.g. 300s or 0.5ep; '' for none")
        return value, unit

    @property
    def worker_timeout(self) -> float:
        """Seconds a worker waits for any one message: twice `comm_timeout`, so that rank 0, which watches
        every worker, is the one that names a hung worker."""
        return 2 * self.comm_timeout

    @property
    def dataset_name(self) -> str:
        """The dataset to load: `dataset`, or the built-in model's own when empty."""
        if self.data:
            return self.data
        return self.dataset or MODELS[self.model].dataset

    @property
    def model_label(self) -> str:
        """A short name of the network: the built-in's, or the file's stem (run names, messages)."""
        return label(self.model)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def describe(self) -> str:
        """The resolved config as aligned `key = value` lines (printed once by rank 0)."""
        width = max(len(f.name) for f in dataclasses.fields(self))
        return "\n".join(f"  {f.name:<{width}} = {getattr(self, f.name)!r}" for f in dataclasses.fields(self))


@dataclass(frozen=True)
class Config(EasgdOptions, AsyncOptions, ShardOptions, PipelineOptions, SspOptions, BaseConfig):
    """The run configuration: `BaseConfig`'s keys, then those the modes own, each mode's as a typed dataclass
    of `mpiasgd.modes.registry` (the fields in that order: the bases in reverse).

    Frozen; `validate()` checks every value (ConfigError naming the key), `to_json()` is what the run
    log and checkpoints store."""


FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _coerce(key: str, value: Any) -> Any:
    """Check one TOML/JSON value against the field's type; raise ConfigError if it does not fit."""
    kind = FIELDS[key].type
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "tuple":
        ok = isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    else:  # pragma: no cover - a new field type needs a branch here
        raise AssertionError(f"unhandled config type {kind} of {key}")
    if not ok:
        expected = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
                    "tuple": "an array of numbers"}[kind]
        raise ConfigError(f"config key '{key}' = {value!r}: expected {expected}")
    if kind in ("float", "tuple") and not all(map(math.isfinite, value if kind == "tuple" else [value])):
        # one rule with the flags (resolve): TOML's inf and nan are refused, not read as "no limit"
        raise ConfigError(f"config key '{key}' = {value!r}: expected a finite number")
    if kind == "float":
        return float(value)
    return tuple(float(v) for v in value) if kind == "tuple" else value


# names other trainers give a key (PyTorch, Keras, Caffe): difflib finds no likeness in them
SYNONYMS = {"learning_rate": "lr", "base_lr": "lr", "num_epochs": "epochs", "max_epochs": "epochs",
            "wd": "weight_decay", "bs": "batch_size", "optimizer": "mode"}
# keys whose value is a path; a TOML file's relative ones are read against the file's folder (`load_toml`)
PATH_KEYS = ("model", "data", "test_data", "data_dir", "run_dir", "resume")


def close_keys(word: str, keys: list[str]) -> list[str]:
    """The one or two of `keys` that `word` (a mistyped config key, '-' or '_' alike) most likely meant: a known
    synonym, else difflib's closest matches (a second only when nearly as close as the first); [] if none is."""
    word = word.replace("-", "_")
    if SYNONYMS.get(word) in keys:
        return [SYNONYMS[word]]
    # two letters swapped ('modle') first: difflib's ratio ranks 'modules' above 'model' there
    scored = sorted(((sorted(word) == sorted(k), difflib.SequenceMatcher(None, word, k).ratio(), k) for k in keys),
                    reverse=True)
    return [k for _, r, k in scored[:2] if r >= 0.6 and r >= scored[0][1] - 0.1]


def did_you_mean(word: str, keys: list[str], quote: Any = "'{}'".format) -> str:
    """' (did you mean 'lr'?)' for `word` among `keys` (each shown through `quote`), '' when none is close."""
    matches = close_keys(word, keys)
    return f" (did you mean {' or '.join(map(quote, matches))}?)" if matches else ""


def from_mapping(values: dict, base: Config | None = None, source: str = "config") -> Config:
    """Config from a dict (e.g. a parsed TOML file) over `base`; unknown or ill-typed keys raise ConfigError
    (an unknown key with its likely meaning, or the valid keys when none is close)."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        hints = [did_you_mean(k, list(FIELDS)) for k in unknown]
        text = ", ".join(f"'{k}'{hint}" for k, hint in zip(unknown, hints, strict=True))
        rest = "" if all(hints) else f"; valid keys: {', '.join(sorted(FIELDS))}"
        raise ConfigError(f"{source}: unknown key{'s' if len(unknown) > 1 else ''} {text}{rest}")
    return dataclasses.replace(base or Config(), **{k: _coerce(k, v) for k, v in values.items()})


def _rebased(key: str, value: Any, folder: str) -> Any:
    """A TOML file's `value` of path key `key` read against `folder`, the file's own: an absolute path (a built-in
    network's name, an absolute path, '' and a value of the wrong type are kept)."""
    if not isinstance(value, str) or not value or os.path.isabs(value):
        return value
    if key != "model":
        return os.path.normpath(os.path.join(folder, value))

    m = USER_FILE.match(value)
    if m is None and not value.endswith(".json"):  # a built-in network's name
        return value
    path = m.group("path") if m else value
    if os.path.isabs(path):
        return value
    return os.path.normpath(os.path.join(folder, path)) + (f":{m.group('func')}" if m else "")


def load_toml(path: str, base: Config | None = None) -> Config:
    """Config from a TOML file of top-level `key = value` lines (keys as the dataclass fields). Relative paths in
    it (PATH_KEYS: the --model file, the dataset files and folders, the run folder, the checkpoint to resume)
    are read against the TOML file's folder, as a file that includes another does, and kept absolute."""
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file '{path}' cannot be read: {e.strerror}") from None
    folder = os.path.dirname(os.path.abspath(path))
    values = {k: _rebased(k, v, folder) if k in PATH_KEYS else v for k, v in values.items()}
    return from_mapping(values, base, source=f"config file '{path}'")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises ConfigError instead of exiting, so MPI ranks can agree on errors."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}{self.hint(message)}")

    def hint(self, message: str) -> str:
        """`flag_hint` for argparse's "unrecognized arguments: --learning-rate 0.1"; '' for other messages."""
        if not message.startswith("unrecognized arguments: "):
            return ""
        return flag_hint(message.split(": ", 1)[1].split(), self._option_string_actions)


def flag_hint(words: list[str], flags: Any) -> str:
    """' (did you mean --lr?)' for the unrecognized command-line `words` (["--learning-rate", "0.1"]) among the
    parser's option strings `flags` (Python < 3.14's argparse suggests nothing); '' when no flag is close."""
    longs = [f[2:] for f in flags if f.startswith("--")]
    hints: list[str] = []
    for word in words:
        if word.startswith("--"):
            hints += [f"--{m}" for m in close_keys(word[2:].split("=")[0], longs) if f"--{m}" not in hints]
    return f" (did you mean {' or '.join(hints)}?)" if hints else ""


def _parse_milestones(text: str) -> tuple:
    try:  # "" is no milestones; an empty entry ("5,,8") is a typo, not a value
        return tuple(float(v) for v in text.split(",")) if text.strip() else ()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated epochs, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config FILE` and one flag per Config field, grouped as in the dataclass."""
    parser.add_argument("--config", metavar="FILE", help="TOML file of config keys (flags override it)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(Config):
        group = groups.setdefault(f.metadata["group"], parser.add_argument_group(f.metadata["group"]))
        flag = "--" + f.name.replace("_", "-")
        text = f.metadata["help"]
        text = text if "default:" in text else f"{text} (default: {f.default!r})"
        text = text.replace("%", "%%")  # argparse formats help with %: a literal one must be doubled
        common = dict(dest=f.name, default=None, help=text)
        if f.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif f.type == "tuple":
            group.add_argument(flag, type=_parse_milestones, metavar="E1,E2", **common)
        else:
            group.add_argument(flag, type={"int": int, "float": float, "str": str}[f.type], **common)


# what a resumed run may not change: the state it continues would not fit
# (`data` may change: a file moved; start-up checks that it is the same file by its fingerprint)
FIXED_ON_RESUME = ("model", "dataset", "augment", "shuffle_window", "mode", "seed", "batch_size", "name", "run_dir",
                   *(o.name for o in OPTIONS if o.fixed_on_resume))


def resume_overrides(saved: Config, cfg: Config) -> dict[str, tuple]:
    """{key: (saved value, new value)} for every key `cfg` changes from the checkpoint's config `saved`
    (`resume`, `overwrite`, `progress` and `show_config` aside); ConfigError for a key in FIXED_ON_RESUME."""
    out = {}
    for key in FIELDS:
        old, new = getattr(saved, key), getattr(cfg, key)
        if old == new or key in ("resume", "overwrite", "progress", "show_config"):
            continue
        if key in PATH_KEYS and _rebased(key, old, os.getcwd()) == new:  # the same path, stored relative (a run
            continue                                                      # from before TOML paths were absolute)
        if key in FIXED_ON_RESUME:
            shown = f"{old!r} (the default)" if old == FIELDS[key].default else repr(old)
            raise ConfigError(f"config key '{key}' = {new!r}: a resumed run keeps {shown} (the checkpoint "
                              f"'{cfg.resume}' holds state that only fits it)")
        out[key] = (old, new)
    return out


def resolve(args: argparse.Namespace) -> Config:
    """Defaults < TOML (`args.config`) < flags given on the command line; validated.

    With `--resume PATH` the defaults are the config stored in that checkpoint (CheckpointError, a
    ConfigError, if it cannot be read), but for `overwrite` (a run started with --overwrite does not make its
    resume replace an unreadable log), and keys in FIXED_ON_RESUME may not change.
    """
    base = Config()
    resume, named_by = getattr(args, "resume", None), "--resume"
    if not resume and getattr(args, "config", None):  # `resume = PATH` in the TOML file works as the flag does
        resume, named_by = load_toml(args.config).resume, f"config key 'resume' in '{args.config}'"
    if resume:
        from mpiasgd.checkpoint import CheckpointError, load_config

        try:
            base = from_mapping(load_config(resume), source=f"checkpoint '{resume}'")
        except CheckpointError as e:
            raise ConfigError(f"{named_by}: {e}") from None
        # what the run was started with is not what this job asks for: --overwrite is this command's only
        base = dataclasses.replace(base, overwrite=False)
    cfg = load_toml(args.config, base) if getattr(args, "config", None) else base
    flags = {k: getattr(args, k) for k in FIELDS if getattr(args, k, None) is not None}
    for key, value in flags.items():
        kind = FIELDS[key].type
        if kind in ("float", "tuple") and not all(map(math.isfinite, value if kind == "tuple" else [value])):
            raise ConfigError(f"flag --{key.replace('_', '-')} = {value!r}: expected a finite number")
    cfg = dataclasses.replace(cfg, **flags)
    if flags.get("gap_aware") is False and cfg.update_rule == "auto":  # (False is the default: it would do nothing)
        raise ConfigError("flag --no-gap-aware with --update-rule auto: auto gives DANA-Zero with Gap-Aware (DANA-GA) "
                          "from 2 workers whatever --gap-aware says; for DANA-Zero without Gap-Aware give "
                          "--update-rule dana-zero (for one momentum, --update-rule sgd)")
    # dataset files by absolute path: the config stored in the log and checkpoint works from any directory
    cfg = dataclasses.replace(cfg, **{key: os.path.abspath(getattr(cfg, key)) for key in ("data", "test_data")
                                      if getattr(cfg, key)})
    if cfg.resume:
        resume_overrides(base, cfg)  # raises for a key that may not change (before the mode's keys are judged)
    cfg = cfg.validate()
    return cfg


def make_parser(prog: str = "mpiasgd train") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Train with asynchronous SGD: rank 0 parameter server, ranks 1..N workers.")
    add_arguments(parser)
    return parser
