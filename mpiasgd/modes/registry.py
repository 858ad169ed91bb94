"""The training modes: name, implementing module, help, and the config keys each one owns.

This file is read by the config (flags, TOML keys, validation) without importing any mode's code,
so reading a run log or printing `--help` never starts MPI. A mode is added by one module in
`mpiasgd/modes/` (a `MODE` object: see `mpiasgd.modes.base.Mode`) and entries here: its `ModeSpec`, and
its keys as a typed dataclass of options (`SspOptions`, ...: fields made by `option`, listed in
`MODE_OPTIONS`), which `mpiasgd.config.Config` inherits, so `cfg.staleness_bound` is typed; `OPTIONS` holds
each key's `Option` (the modes that own it, its flag group, its label).

A key owned by other modes must keep its default (ConfigError naming the key and the modes that
take it), so a flag never silently does nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Option:
    """A config key (TOML key `name`, flag `--name-with-dashes`) owned by the modes in `modes`.

    `type` is "int" | "float" | "str" | "bool"; `help` is one line with its unit; `group` the
    heading it is listed under in `--help`.
    """

    name: str
    default: Any
    type: str
    help: str
    modes: tuple[str, ...]
    group: str = "parallelism"
    fixed_on_resume: bool = False  # a resumed run keeps it: the state it continues only fits that value
    label: str = ""                # how report tables name a run's variant, e.g. "s={}" (str.format of the value)
    always: bool = False           # label it at its default too (else only when set otherwise)


@dataclass(frozen=True)
class ModeSpec:
    """`name` (the `--mode` value), `module` (defines `MODE`), a one-line `help`, and `note`: what a key
    of another mode is not, here (named when such a key is set)."""

    name: str
    module: str
    help: str
    note: str = ""


PS_MODES = ("async", "ssp")  # the parameter-server modes of GPU A-SGD
SERVER_MODES = (*PS_MODES, "easgd")  # the modes whose rank 0 answers every push (`mpiasgd.rank0.server`)
SERVER_WAITS = ("auto", "spin", "backoff")  # --server-wait: how the server ranks poll (`mpiasgd.comms.waits`)

MODES: dict[str, ModeSpec] = {spec.name: spec for spec in (
    ModeSpec("async", "mpiasgd.modes.asgd", "A-SGD through the parameter server"),
    ModeSpec("sync", "mpiasgd.modes.sync", "workers allreduce their gradients every step; rank 0 only logs",
             note="no parameter server updates"),
    ModeSpec("ssp", "mpiasgd.modes.ssp", "async, but no worker more than --staleness-bound steps ahead of the "
             "slowest"),
    ModeSpec("pipeline", "mpiasgd.modes.pipeline", "decoupled backpropagation: --modules K x --replicas N units, "
             "Pham and Ahn 2025", note="no parameter server updates"),
    ModeSpec("easgd", "mpiasgd.modes.easgd", "elastic averaging SGD: workers train locally and every --easgd-tau "
             "steps move toward rank 0's center variable, which moves toward them (Zhang et al. 2015)"),
)}


def option(default: Any, help: str, modes: tuple[str, ...], group: str = "parallelism", *,
           fixed_on_resume: bool = False, label: str = "", always: bool = False) -> Any:
    """A mode's config key as a field of its typed options dataclass; its `Option` is in the metadata."""
    return field(default=default, metadata={"help": help, "modes": modes, "group": group,
                                            "fixed_on_resume": fixed_on_resume, "label": label, "always": always})


@dataclass(frozen=True)
class SspOptions:
    """The options of `--mode ssp` (Ho et al. 2013)."""

    staleness_bound: int = option(3, "ssp: steps a worker may run ahead of the slowest worker (0 = lockstep); "
        "steps", ("ssp",), label="s={}", always=True)


@dataclass(frozen=True)
class PipelineOptions:
    """The options of `--mode pipeline`: decoupled backpropagation x data parallelism (Pham and Ahn 2025; FDG)."""

    modules: int = option(2, "pipeline: K, the modules the layer list is cut into (1 = plain backprop)",
        ("pipeline",), "pipeline", fixed_on_resume=True, label="K={}", always=True)
    replicas: int = option(0, "pipeline: N, data-parallel replicas of the whole pipeline; 0 = (ranks - 1) / K",
        ("pipeline",), "pipeline", fixed_on_resume=True)
    cuts: str = option("", "pipeline: K-1 layer indices where modules start, e.g. '3,6' (default: balanced by "
        "--balance)", ("pipeline",), "pipeline", fixed_on_resume=True)
    balance: str = option("flops", "pipeline: automatic cuts balance forward FLOPs | params", ("pipeline",),
        "pipeline", fixed_on_resume=True)
    shrink: float = option(1.0, "pipeline: beta, each module scales the input gradient it sends back (module "
        "k's gradient is scaled by beta^(K-1-k); FDG's gradient shrinking)", ("pipeline",), "pipeline",
        label="beta={:g}")
    decoupling: str = option("full", "pipeline: full (forward and backward decoupled: module k's gradient is "
        "2(K-1-k) iterations old, FDG) | backward (forward locked: K-1-k, DDG)", ("pipeline",), "pipeline",
        fixed_on_resume=True, label="{}")
    weight_stashing: bool = option(False, "pipeline: backward uses the weights the minibatch's forward used "
        "(PipeDream); default: the current weights", ("pipeline",), "pipeline", label="stashing")
    weight_prediction: bool = option(False, "pipeline: a module computes a minibatch's forward and its delayed "
        "backward on the weights predicted for when its gradient is applied, w - lr * c * v after the module's "
        "delay d of momentum-only updates, c = m (1 - m^d) / (1 - m) (SpecTrain, Chen et al. 2018); needs "
        "momentum > 0; the backward uses the forward's predicted weights, so --weight-stashing adds nothing to it; "
        "default: the current weights", ("pipeline",), "pipeline", label="prediction")
    pipeline_activations: str = option("recompute", "pipeline: how a module's delayed backward gets its "
        "forward's activations: recompute (keep the input, re-run the forward before the backward: the "
        "activations of the weights then) | store (keep every layer's activations of the forward, FDG's; more "
        "memory, no extra forward)", ("pipeline",), "pipeline", label="activations={}")


@dataclass(frozen=True)
class ShardOptions:
    """The options of the parameter-server shards (the modes whose rank 0 answers every push: async, ssp, easgd)."""

    servers: int = option(1, "async/ssp/easgd: S parameter-server shards, each owning a contiguous slice of "
        "the parameters (easgd: of the center variable; balanced by bytes): rank 0 and ranks N+1..N+S-1 after the "
        "N workers (launch N + S ranks); each applies its slice with its own version counter; 1 = one server",
        SERVER_MODES, fixed_on_resume=True, label="S={}")
    server_threads: int = option(1, "async/ssp: threads of each parameter-server rank's update (the SGD step and "
        "an nsync push's delta, in blocks shared among the threads: the same bits as one); give a server rank the "
        "cores its node has to spare (bench/server.py --sweep --threads times 1, 2, 4, ...); 1 = one thread",
        PS_MODES)
    server_wait: str = option("auto", "async/ssp/easgd: how every parameter-server rank waits for its next message: "
        "spin (polls without sleeping: it owns a core) | backoff (sleeps 10 us to 2 ms between polls: shares a "
        "core) | auto (spin where the node has a core per rank, else backoff)", SERVER_MODES)


@dataclass(frozen=True)
class AsyncOptions:
    """The options of GPU A-SGD's parameter server (async, ssp): nsync, overlap, warm start, the answers to
    staleness, the wire."""

    nsync: int = option(1, "async/ssp: local optimizer steps between exchanges; a worker pushes the accumulated "
        "update (its weights minus the weights it pulled) every NSYNC minibatches (n_push = n_fetch = NSYNC, "
        "GPU A-SGD / Downpour); 1 = push every gradient", PS_MODES)
    overlap: bool = option(False, "async/ssp: compute the next minibatch on the weights at hand while the pull "
        "is in flight (hides communication, one more step of staleness)", PS_MODES, label="overlap")
    warm_start: float = option(0.0, "async/ssp: worker rank 1 trains alone for this many seconds before the "
        "others get their first weights (GPU A-SGD's warm start); seconds", PS_MODES, label="warm {:g}s")
    staleness_lr: str = option("auto", "scale of a pushed gradient (nsync > 1: accumulated update) of staleness s as "
        "the server applies it: none = 1, inverse = 1/max(1,s), sqrt = 1/sqrt(max(1,s)) (Zhang et al. 2016), auto = "
        "inverse with nsync > 1 (N workers' updates then average instead of adding up), else none", PS_MODES,
        "optimizer")
    dc_lambda: float = option(0.0, "delay compensation (DC-ASGD, Zheng et al. 2017): the server corrects a "
        "pushed gradient g to g + lambda * g * g * (w - w_pulled), w_pulled the weights the worker computed it "
        "on; 0 = off; needs nsync 1 and no --overlap", PS_MODES, "optimizer", label="dc={:g}")
    dc_adaptive: float = option(0.0, "DC-ASGD-a: lambda divided by sqrt of a running mean square of g (per "
        "weight) with this decay, 0 < m < 1 (0.95 in the paper); 0 = a constant lambda", PS_MODES, "optimizer",
        label="dc-a={:g}")
    gap_aware: bool = option(False, "Gap-Aware (Barkai et al. 2020): the server divides each weight's pushed "
        "gradient by its gap, max(1, |w - w_pulled| / C), C a running mean of one update's step: a weight that "
        "moved k typical steps since the worker's pull gets 1/k of its gradient; with DANA-Zero, DANA-GA (what "
        "--update-rule auto gives from 2 workers, where --no-gap-aware is refused: --update-rule dana-zero is "
        "DANA-Zero alone); needs nsync 1 and no --overlap or --dc-lambda", PS_MODES, "optimizer", label="gap-aware")
    min_workers: int = option(1, "async, ssp, easgd (with any --servers) and sync: under ULFM (mpiexec --with-ft ulfm: "
        "docs/training.md) a worker that dies is dropped and the run goes on while at least this many workers are "
        "left (with --respawn a dead worker whose replacement starts counts); below it the run ends with status "
        "failed (a checkpoint where rank 0 holds the state); without ULFM any death ends the job",
        (*SERVER_MODES, "sync"))
    respawn: bool = option(False, "async and ssp with one server, under ULFM: rank 0 starts a replacement for each "
        "worker that dies (MPI_Comm_spawn, in a free slot of the launcher's); it takes the dead worker's rank, the "
        "current weights and its data position, and the run goes on with as many workers as it began with "
        "(docs/training.md)", PS_MODES)
    attach: bool = option(False, "async and ssp with one server, under ULFM: rank 0 listens for `mpiasgd attach "
        "RUN.attach`, a second launch that brings back worker ranks the job lost (rank 0 starts them with "
        "MPI_Comm_spawn, on a host the attach names); RUN.attach, beside the run log, is readable by your user alone "
        "and holds the token an attach must give (docs/training.md)", PS_MODES)
    async_momentum: str = option("fixed", "the server's momentum: fixed = --momentum | workers = max(0, "
        "momentum - (1 - 1/N)) for N workers, since asynchrony itself adds about 1 - 1/N of momentum "
        "(Mitliagkas et al. 2016)", PS_MODES, "optimizer", label="momentum={}")
    update_rule: str = option("auto", "async/ssp: the server's update: sgd (one momentum for all the workers: "
        "GPU A-SGD, Downpour) | dana-zero (a momentum per worker, the replies looking one step ahead along their "
        "sum: DANA-Zero, Hakimi et al. 2019; N + 1 momentum vectors on the server; momentum in (0, 1), nsync 1, "
        "no --lookahead, --nesterov, --dc-lambda, --staleness-lr inverse|sqrt or --async-momentum workers) | auto "
        "(from 2 workers: dana-zero with Gap-Aware, DANA-GA, whatever --gap-aware says; dana-zero alone with "
        "--overlap; sgd where an option dana-zero rules out is given; said at start-up; 1 worker: sgd)",
        PS_MODES)
    lookahead: float = option(0.0, "async/ssp: the server replies with the weights K momentum-only updates ahead, "
        "w - lr * c * v with c = m (1 - m^K) / (1 - m), where a push computed on them will most likely be applied "
        "(DANA, Hakimi et al. 2019); the master weights are not changed; K in updates, 0 = off, -1 = auto: N - 1 "
        "for N workers (2N - 1 with --overlap); needs momentum > 0 and nsync 1", PS_MODES, "optimizer",
        label="lookahead={:g}")
    wire: str = option("fp32", "async/ssp: how pushes and the server's replies carry the weights, gradients "
        "and layer buffers: fp32 | fp16 | bf16 (2 bytes a value, half the bytes; rounded to nearest even, "
        "relative error <= 2^-11 | 2^-8; the server keeps float32 weights and state; an fp16 value beyond "
        "65504 becomes inf: its push is rejected, naming the value; weights beyond it stop the run)", PS_MODES,
        label="wire={}")
    wire_error_feedback: bool = option(False, "async/ssp with --wire fp16|bf16: each worker adds what the "
        "rounding of its last push lost to its next push (error feedback, Seide et al. 2014; "
        "Karimireddy et al. 2019); the residual is not checkpointed", PS_MODES, label="EF")


@dataclass(frozen=True)
class EasgdOptions:
    """The options of `--mode easgd`: elastic averaging SGD (Zhang, Choromanska and LeCun 2015)."""

    easgd_tau: int = option(4, "easgd: local steps between two exchanges with the center variable (tau in "
        "Zhang et al. 2015); steps", ("easgd",), "easgd", label="tau={}", always=True)
    easgd_alpha: float = option(0.0, "easgd: the elastic moving rate alpha, 0 < alpha < 1 (each exchange moves "
        "a worker by alpha (x_i - center) and the center by as much back); 0 = the paper's rule alpha = "
        "beta / p, beta = 0.9, p = the number of workers", ("easgd",), "easgd", label="alpha={:g}")


# the modes' options in the order report tables label a variant (`Config` has them after `BaseConfig`'s keys)
MODE_OPTIONS = (SspOptions, PipelineOptions, ShardOptions, AsyncOptions, EasgdOptions)
OPTIONS: tuple[Option, ...] = tuple(
    Option(f.name, f.default, f.type, f.metadata["help"], f.metadata["modes"], f.metadata["group"],
           f.metadata["fixed_on_resume"], f.metadata["label"], f.metadata["always"])
    for options in MODE_OPTIONS for f in fields(options))


def variant(cfg: dict) -> str:
    """The options that make a run's mode variant, short, from its stored config (a dict): the labels of
    the keys its mode owns that are set otherwise than by default (or always labelled), e.g. "s=2" (ssp),
    "K=2 beta=0.5" (pipeline), "tau=4 alpha=0.1" (easgd), "overlap warm 30s" (async)."""
    mode = cfg.get("mode", "async")
    parts = []
    for option in OPTIONS:
        value = cfg.get(option.name, option.default)
        if option.label and mode in option.modes and (option.always or value != option.default):
            parts.append(option.label.format(value))
    return " ".join(parts)


def load(name: str) -> Any:
    """The `Mode` object of mode `name` (imports its module); KeyError for an unknown name."""
    return importlib.import_module(MODES[name].module).MODE
