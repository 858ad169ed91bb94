"""The timing model of `mpiasgd simulate`: how long each virtual worker computes, how long a message
travels, how long the parameter server takes per update (GPU A-SGD, Paine et al. 2013, arXiv 1312.6186:
the experiments over the number of clients, nsync and warm start, replayed on a virtual clock).

    compute    seconds per minibatch of each worker: lognormal with a mean and a coefficient of
               variation (cv 0: always the mean), or an empirical list of measured seconds taken in a random
               order, each once a pass (`ComputeDraws`); one distribution for every worker and, optionally, one of
               a worker's own (`workers`); optionally a start-up (`startup_s`) added to a worker's first
               minibatch only. `--straggler RANK:FACTOR` multiplies that worker's draws.
    stragglers the --straggler factors of the run a model was fitted from ({rank: factor}): a simulation
               without a --straggler of its own applies them, so that it reproduces that run; its own
               --straggler replaces them (RANK:1: that worker at its device's speed)
    latency_s  seconds one message takes one way, whatever its size
    bandwidth  bytes/s of each link (0 = infinite): a message of n bytes takes latency_s + n / bandwidth
               (n: the message as sent, 160-byte header + 4 or, with --wire fp16|bf16, 2 bytes a value).
               Links are independent (no contention at the server's link).
    server_s   seconds the parameter server takes per push it serves (applied, rejected or drained after the
               stop; one message at a time, first come first served; an EVAL costs nothing)
    eval_s_per_image  seconds per test image of a forward-only evaluation (--eval-interval and the final
               evaluation); default: the mean compute seconds / batch size / 3 (a forward pass is about a
               third of forward + backward)

Three sources: a JSON profile (`load_profile`, strict: one error naming the file, the key and what was
expected), a real run log (`fit_run_log`), or the command line's quick model (`TimingModel.quick`).
A profile looks like

    {"compute": {"mean_s": 0.05, "cv": 0.1},               or {"samples": [0.049, 0.052, ...]}
                                                            (either: "startup_s": 0.3, optional)
     "workers": {"3": {"mean_s": 0.15, "cv": 0.1}},         optional: a worker's own distribution
     "stragglers": {"3": 3.0},                              optional: the fitted run's --straggler
     "latency_s": 0.0005, "bandwidth": 1.25e9, "server_s": 0.002,
     "eval_s_per_image": 0.0004,                            optional (null: the default above)
     "batch_size": 32,                                      optional: images per minibatch measured (0: unknown)
     "model": "cifar10", "network": "5f0c...",              optional: the network measured, its --model and
                                                            the digest of its definition (`network_digest`)
     "note": "fitted from runs/c10.h5"}                     optional free text

Draws come from numpy Generators seeded by (the run's --seed, the worker's rank), one per worker, so a
simulation is deterministic and a worker's compute times do not depend on what the others do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpiasgd.config import Config, ConfigError
from mpiasgd.files import checkpoint_path
from mpiasgd.modes.registry import PS_MODES
from mpiasgd.runlog import load


class ProfileError(ConfigError):
    """A timing profile (or the run log it is fitted from) is malformed; the message names the file, the key
    and what was expected."""


@dataclass(frozen=True)
class ComputeTime:
    """Seconds one worker takes per minibatch (data, forward, backward): lognormal of mean `mean_s` (> 0 s)
    and coefficient of variation `cv` (>= 0; 0: always `mean_s`), or, when `samples` is non-empty, those
    measured seconds (each > 0) in a random order, one pass through all of them after another (a new order
    each pass), or with `replay` in their own order. `startup_s` (>= 0 s) is added to the first minibatch
    alone: a worker's one-off start-up (first touch of its memory, compiled kernels, the data file's first
    read), which a draw must not bring back in mid-run. `ComputeDraws` takes them, one worker's."""

    mean_s: float = 0.0
    cv: float = 0.0
    samples: tuple[float, ...] = ()
    replay: bool = False  # with samples: take them in their order (a trace), from the worker's offset, cycling
    startup_s: float = 0.0  # s added to draw 0 (not with replay: a trace holds its own start-up)

    @property
    def mean(self) -> float:
        """The distribution's mean, seconds."""
        return float(np.mean(self.samples)) if self.samples else self.mean_s

    def to_dict(self) -> dict:
        startup = {"startup_s": self.startup_s} if self.startup_s else {}
        if self.samples:
            return {"samples": list(self.samples), **({"replay": True} if self.replay else {}), **startup}
        return {"mean_s": self.mean_s, "cv": self.cv, **startup}

    def describe(self) -> str:
        startup = f", start-up +{self.startup_s:.3g} s once" if self.startup_s else ""
        if self.samples:
            how = "replayed in order" if self.replay else "shuffled, each once a pass"
            return f"empirical ({len(self.samples)} samples {how}, mean {self.mean:.4g} s{startup})"
        return f"{self.mean_s:.4g} s" + (f" (lognormal, cv {self.cv:g}{startup})" if self.cv else
                                         f" ({startup[2:]})" if startup else "")


class ComputeDraws:
    """One worker's compute seconds, minibatch after minibatch (`next()`), from `compute` with the worker's
    own generator `rng`; `offset` is its place in a replayed trace (a worker replaying the pooled one).

    Measured samples are taken without replacement, a pass through all of them in a random order, then
    another: over any pass the worker's times are the measured ones, each once, so a simulation of as many
    pushes as the run it was fitted from has that run's compute seconds in total and its slow minibatches
    as often. Drawn with replacement, a run's count of slow minibatches is random (binomial) and with it
    each worker's push count (about 1 / sqrt(pushes), 5 % for a straggler's 100 pushes) and the top of the
    staleness distribution (the p99 is a handful of pushes) move from simulation to simulation.
    """

    def __init__(self, compute: ComputeTime, rng: np.random.Generator, offset: int = 0) -> None:
        self.compute, self.rng, self.index = compute, rng, offset
        self.order: np.ndarray | None = None  # the current pass's order of the samples

    def next(self) -> float:
        """The next minibatch's seconds (+ `startup_s` for the worker's first)."""
        c, i = self.compute, self.index
        self.index += 1
        if c.replay:
            return float(c.samples[i % len(c.samples)])
        startup = c.startup_s if i == 0 else 0.0
        if c.samples:
            if self.order is None or i % len(c.samples) == 0:  # a new pass
                self.order = self.rng.permutation(len(c.samples))
            return float(c.samples[self.order[i % len(c.samples)]]) + startup
        if c.cv == 0:
            return c.mean_s + startup
        sigma2 = math.log1p(c.cv * c.cv)  # lognormal with E = mean_s, sd / E = cv
        return float(self.rng.lognormal(math.log(c.mean_s) - sigma2 / 2, math.sqrt(sigma2))) + startup


@dataclass(frozen=True)
class TimingModel:
    """A cluster's timing (see the module docstring); frozen, round-trips through JSON (`to_json`,
    `from_json`). `workers` maps a worker rank to its own ComputeTime (others use `compute`; entries for
    ranks the run does not have are unused)."""

    compute: ComputeTime
    latency_s: float = 0.0                  # s, one way, per message
    bandwidth: float = 0.0                  # bytes/s per link; 0 = infinite
    server_s: float = 0.0                   # s per push the parameter server serves
    eval_s_per_image: float | None = None   # s per test image evaluated; None: from the compute time
    workers: dict[int, ComputeTime] = field(default_factory=dict)
    stragglers: dict[int, float] = field(default_factory=dict)  # the fitted run's --straggler: rank -> factor
    batch_size: int = 0                     # images per minibatch the compute times are for; 0 = unknown
    model: str = ""                         # the --model the compute times were measured on; "" = unknown
    network: str = ""                       # that network's `network_digest`; "" = unknown (then by `model`)
    note: str = ""                          # where the model comes from, for a person

    @classmethod
    def quick(cls, compute_s: float, cv: float = 0.0, latency_s: float = 0.0, bandwidth: float = 0.0,
              server_s: float = 0.0, eval_s_per_image: float | None = None) -> TimingModel:
        """The command line's model: one lognormal for every worker. ProfileError on a value out of range."""
        values = {"compute": {"mean_s": compute_s, "cv": cv}, "latency_s": latency_s, "bandwidth": bandwidth,
                  "server_s": server_s, "eval_s_per_image": eval_s_per_image}
        return cls.from_dict(values, "the command line's timing flags")

    def compute_for(self, rank: int) -> ComputeTime:
        """Worker `rank`'s compute distribution."""
        return self.workers.get(rank, self.compute)

    def transfer_s(self, nbytes: int) -> float:
        """Seconds a message of `nbytes` takes one way: latency_s + nbytes / bandwidth."""
        return self.latency_s + (nbytes / self.bandwidth if self.bandwidth else 0.0)

    def eval_seconds(self, images: int, batch_size: int) -> float:
        """Seconds a worker takes to evaluate `images` test images (forward only)."""
        per_image = self.eval_s_per_image
        if per_image is None:
            per_image = self.compute.mean / max(1, self.batch_size or batch_size) / 3
        return per_image * images

    def resolved(self, batch_size: int) -> TimingModel:
        """This model with eval_s_per_image and batch_size filled in (the defaults made explicit), for a run of
        minibatches of `batch_size` images."""
        size = self.batch_size or batch_size
        return dataclasses.replace(self, batch_size=size, eval_s_per_image=self.eval_seconds(1, size))

    def describe(self) -> str:
        """One line: the model's figures."""
        own = "".join(f"; worker {w}: {c.describe()}" for w, c in sorted(self.workers.items()))
        slow = (f"; the fitted run's --straggler {straggler_text(self.stragglers)} (unless --straggler is given)"
                if self.stragglers else "")
        bw = f"{self.bandwidth:.4g} bytes/s" if self.bandwidth else "infinite"
        per_image = "from compute" if self.eval_s_per_image is None else f"{self.eval_s_per_image:.3g} s"
        return (f"compute {self.compute.describe()} per minibatch{own}{slow}; latency {self.latency_s:.4g} s, "
                f"bandwidth {bw}, server {self.server_s:.4g} s per update, evaluation {per_image} per image")

    # --- JSON ---
    def to_dict(self) -> dict:
        out: dict[str, Any] = {"compute": self.compute.to_dict(), "latency_s": self.latency_s,
                               "bandwidth": self.bandwidth, "server_s": self.server_s,
                               "eval_s_per_image": self.eval_s_per_image}
        if self.workers:
            out["workers"] = {str(w): c.to_dict() for w, c in sorted(self.workers.items())}
        if self.stragglers:
            out["stragglers"] = {str(w): f for w, f in sorted(self.stragglers.items())}
        if self.batch_size:
            out["batch_size"] = self.batch_size
        if self.model:
            out["model"] = self.model
        if self.network:
            out["network"] = self.network
        if self.note:
            out["note"] = self.note
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "timing profile") -> TimingModel:
        """Parse JSON text (no NaN or Infinity); ProfileError naming `source` when it is not valid JSON or
        not a valid model."""
        def refuse(constant: str) -> None:
            raise ValueError(f"{constant} is not a number here")

        def unique(pairs: list) -> dict:
            keys = [k for k, _ in pairs]
            twice = sorted({k for k in keys if keys.count(k) > 1})
            if twice:
                raise ValueError(f"key(s) {twice} given twice")
            return dict(pairs)

        try:
            values = json.loads(text, parse_constant=refuse, object_pairs_hook=unique)
        except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError; RecursionError: nesting
            raise ProfileError(f"{source}: not valid JSON ({str(e) or 'nested too deeply'})") from None
        return cls.from_dict(values, source)

    @classmethod
    def from_dict(cls, values: Any, source: str = "timing profile") -> TimingModel:
        """A model from parsed JSON `values`; ProfileError "SOURCE: key 'K' = V: expected E" for the first
        key missing, unknown, of the wrong type or out of range."""
        if not isinstance(values, dict):
            raise ProfileError(f"{source}: expected a JSON object of keys {sorted(PROFILE_KEYS)}, got "
                               f"{type(values).__name__}")
        unknown = sorted(set(values) - set(PROFILE_KEYS))
        if unknown:
            raise ProfileError(f"{source}: unknown key(s) {unknown}; valid keys: {sorted(PROFILE_KEYS)}")
        missing = [k for k in REQUIRED_KEYS if k not in values]
        if missing:
            raise ProfileError(f"{source}: key '{missing[0]}' is missing: expected {PROFILE_KEYS[missing[0]]}")
        workers = values.get("workers") or {}
        if not isinstance(workers, dict):
            raise ProfileError(f"{source}: key 'workers' = {workers!r}: expected {PROFILE_KEYS['workers']}")
        own = {_rank(key, "workers", source): _compute(spec, f"workers.{key}", source) for key, spec in workers.items()}
        slow = values.get("stragglers") or {}
        if not isinstance(slow, dict):
            raise ProfileError(f"{source}: key 'stragglers' = {slow!r}: expected {PROFILE_KEYS['stragglers']}")
        factors = {}
        for key in slow:
            factor = _number(slow, key, source, what=f"stragglers.{key}", most=MAX_SECONDS)
            if factor < 1:
                raise ProfileError(f"{source}: key 'stragglers.{key}' = {factor!r}: expected a factor >= 1")
            factors[_rank(key, "stragglers", source)] = factor
        per_image = values.get("eval_s_per_image")
        batch_size = values.get("batch_size", 0)
        if not (isinstance(batch_size, int) and not isinstance(batch_size, bool) and 0 <= batch_size <= 10**6):
            raise ProfileError(f"{source}: key 'batch_size' = {batch_size!r}: expected {PROFILE_KEYS['batch_size']}")
        for key in ("model", "network", "note"):
            if not isinstance(values.get(key, ""), str):
                raise ProfileError(f"{source}: key '{key}' = {values[key]!r}: expected {PROFILE_KEYS[key]}")
        return cls(compute=_compute(values["compute"], "compute", source),
                   latency_s=_number(values, "latency_s", source), bandwidth=_bandwidth(values, source),
                   server_s=_number(values, "server_s", source),
                   eval_s_per_image=None if per_image is None else _number(values, "eval_s_per_image", source),
                   workers=own, stragglers=factors, batch_size=batch_size, model=values.get("model", ""),
                   network=values.get("network", ""), note=values.get("note", ""))


# key -> what it must be (the errors say it)
PROFILE_KEYS = {
    "compute": 'an object {"mean_s": seconds > 0, "cv": number >= 0} or {"samples": [seconds > 0, ...], '
               '"replay": false}, either with "startup_s": seconds >= 0 (optional)',
    "latency_s": "seconds >= 0 (one way, per message)",
    "bandwidth": "bytes/s >= 0 (0 = infinite)",
    "server_s": "seconds >= 0 (per push served)",
    "eval_s_per_image": "seconds >= 0, or null (from the compute time)",
    "workers": 'an object {"RANK": compute object, ...}',
    "stragglers": 'an object {"RANK": factor >= 1, ...} (the fitted run\'s --straggler)',
    "batch_size": "an integer 0..1000000 (images per minibatch measured; 0 = unknown)",
    "model": "a string (the --model whose compute times these are)",
    "network": "a string (the digest of that network's definition: mpiasgd.sim.timing.network_digest)",
    "note": "a string",
}
REQUIRED_KEYS = ("compute", "latency_s", "bandwidth", "server_s")


MAX_SECONDS = 1e6   # no time in a profile is longer (11.6 days a minibatch, message or update)
MIN_COMPUTE_S = 1e-6  # nor is a minibatch shorter (a simulation would take ~forever to reach its stop)


def _number(values: dict, key: str, source: str, positive: bool = False, what: str = "",
            most: float = MAX_SECONDS) -> float:
    """values[key] as a float >= 0 (>= MIN_COMPUTE_S with `positive`) and <= `most`; ProfileError naming `source`
    and the key."""
    value = values.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        ok = ok and math.isfinite(float(value))
    except OverflowError:  # an integer too large for a float
        ok = False
    ok = ok and (value >= MIN_COMPUTE_S if positive else value >= 0) and value <= most
    if not ok:
        expected = (f"seconds from {MIN_COMPUTE_S:g} to {most:g}" if positive
                    else f"{PROFILE_KEYS.get(key, 'a number >= 0')}, at most {most:g}")
        huge = isinstance(value, int) and abs(value) >= 10**20
        shown = f"an integer of {value.bit_length()} bits" if huge else value
        raise ProfileError(f"{source}: key '{what or key}' = {shown!r}: expected {expected}")
    return float(value)


def _bandwidth(values: dict, source: str) -> float:
    """values["bandwidth"]: 0 (infinite) or 1e3 to 1e15 bytes/s; ProfileError naming `source` otherwise."""
    value = _number(values, "bandwidth", source, most=1e15)
    if 0 < value < 1e3:
        raise ProfileError(f"{source}: key 'bandwidth' = {value!r}: expected 0 (infinite) or 1e3 to 1e15 bytes/s")
    return value


def _rank(key: Any, what: str, source: str) -> int:
    """A worker rank >= 1 from a JSON object's key under `what`; ProfileError naming it otherwise."""
    if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) >= 1):
        raise ProfileError(f"{source}: key '{what}' has entry {key!r}: expected a worker rank >= 1")
    return int(key)


def straggler_text(factors: dict[int, float]) -> str:
    """{rank: factor} as --straggler writes it: "2:3,4:1.5" (ranks in order)."""
    return ",".join(f"{w}:{f:g}" if float(f"{f:g}") == f else f"{w}:{f!r}" for w, f in sorted(factors.items()))


def _compute(spec: Any, key: str, source: str) -> ComputeTime:
    """A ComputeTime from its JSON object under `key`; ProfileError naming the key."""
    if not isinstance(spec, dict) or not spec:
        raise ProfileError(f"{source}: key '{key}' = {spec!r}: expected {PROFILE_KEYS['compute']}")
    startup = _number(spec, "startup_s", source, what=f"{key}.startup_s") if "startup_s" in spec else 0.0
    spec = {k: v for k, v in spec.items() if k != "startup_s"}
    if not spec:
        raise ProfileError(f"{source}: key '{key}' has only 'startup_s': expected {PROFILE_KEYS['compute']}")
    if "samples" in spec:
        extra = sorted(set(spec) - {"samples", "replay"})
        samples = spec["samples"]
        replay = spec.get("replay", False)
        if not isinstance(replay, bool):
            raise ProfileError(f"{source}: key '{key}.replay' = {replay!r}: expected true or false")
        if extra:
            raise ProfileError(f"{source}: key '{key}' has {extra} beside 'samples': expected one or the other of "
                               f"{PROFILE_KEYS['compute']}")
        if not isinstance(samples, list) or not samples:
            raise ProfileError(f"{source}: key '{key}.samples' = {samples!r}: expected a non-empty list of "
                               "seconds > 0")
        for i, value in enumerate(samples):
            _number({"s": value}, "s", source, positive=True, what=f"{key}.samples[{i}]")
        return ComputeTime(samples=tuple(float(v) for v in samples), replay=replay, startup_s=startup)
    extra = sorted(set(spec) - {"mean_s", "cv"})
    if extra:
        raise ProfileError(f"{source}: key '{key}' has unknown key(s) {extra}: expected {PROFILE_KEYS['compute']}")
    if "mean_s" not in spec:
        raise ProfileError(f"{source}: key '{key}.mean_s' is missing: expected seconds > 0")
    mean = _number(spec, "mean_s", source, positive=True, what=f"{key}.mean_s")
    cv = _number(spec, "cv", source, what=f"{key}.cv", most=100.0) if "cv" in spec else 0.0
    return ComputeTime(mean_s=mean, cv=cv, startup_s=startup)


def load_profile(path: str) -> TimingModel:
    """The TimingModel in JSON file `path` (`TimingModel.from_json`); ProfileError naming the file when it
    cannot be read or is not a valid model."""
    source = f"timing profile '{path}'"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ProfileError(f"{source} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{source} cannot be read ({e})") from None
    return TimingModel.from_json(text, source)


def save_profile(model: TimingModel, path: str) -> None:
    """Write `model` as JSON to `path` (indented; `load_profile` reads it back). ProfileError if it cannot."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(model.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
    except OSError as e:
        raise ProfileError(f"--save-profile '{path}': cannot write it ({e.strerror})") from None


def check_profile_path(path: str, fitted: str | None, overwrite: bool, run_log: str | None = None) -> None:
    """ProfileError unless `path` may take --save-profile's JSON: never the --fit run log, this run's own log
    or checkpoint (`run_log`, once known) or another HDF5 file (a run log), and an existing file only with
    --overwrite."""
    if run_log and os.path.abspath(path) in (os.path.abspath(run_log), os.path.abspath(checkpoint_path(run_log))):
        raise ProfileError(f"--save-profile '{path}' is this run's own log or checkpoint: give another file")
    if fitted and os.path.exists(fitted) and os.path.exists(path) and os.path.samefile(path, fitted):
        raise ProfileError(f"--save-profile '{path}' is the run log --fit reads: give another file")
    if os.path.exists(path):
        with open(path, "rb") as f:
            if f.read(8) == b"\x89HDF\r\n\x1a\n":
                raise ProfileError(f"--save-profile '{path}' is an HDF5 file (a run log?): it is not replaced")
        if not overwrite:
            raise ProfileError(f"--save-profile '{path}' exists: give another file, or --overwrite to replace it")


def network_digest(spec: dict) -> str:
    """A network definition's (`mpiasgd.model.spec`) input shape and layers as 16 hex digits of their SHA-256:
    equal for the same network whatever its name (a built-in and its copy in a JSON file), different when a
    layer or an argument differs."""
    network = {"input_shape": spec.get("input_shape"), "layers": spec.get("layers")}
    return hashlib.sha256(json.dumps(network, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def mismatch_warnings(timing: TimingModel, batch_size: int, model: str, spec: dict) -> list[str]:
    """What a run of minibatches of `batch_size` images of network `spec` (its --model `model`) takes from
    `timing` that was measured for another run, one line each ([] when nothing is): another minibatch size, or
    another network (by `network_digest` when `timing` has one, else by the --model name; nothing when the
    timing model names no network, as the quick flags' model)."""
    lines = []
    if timing.batch_size and timing.batch_size != batch_size:
        lines.append(f"the timing model's compute times are for minibatches of {timing.batch_size} images; this "
                     f"run's are {batch_size} (--batch-size)")
    if timing.network:  # the definitions compared: a renamed copy is the same network, an edited file is not
        other = timing.network != network_digest(spec)
    else:  # an older log or profile: by name
        other = bool(timing.model) and timing.model != model
    if other:
        measured = repr(timing.model or "(unnamed)")
        if timing.model == model:
            measured += " as it was defined then (another definition than this run's)"
        note = f" ({timing.note})" if timing.note else ""
        lines.append(f"the timing model's compute times were measured on network {measured}{note}; this run "
                     f"simulates network {model!r} (--model): its compute times are the other network's, not "
                     "this one's")
    return lines


def fit_run_log(path: str, replay: bool = False) -> TimingModel:
    """A TimingModel fitted from the run log at `path` of an async or ssp run (real or simulated).

    compute    each worker's empirical distribution: the compute_s of its pushes (data + forward + backward
               of the push's nsync minibatches), divided by the run's nsync and by that worker's --straggler
               factor (the device's own speed); `compute` pools every worker's samples, `workers` keeps each
               one's. A worker's first push is its start-up (first touch, compiled kernels, the first chunk
               read; several times a later push): drawn again at random it would come back in mid-run as
               a slow spell of one worker alone, which the real run never had (a long push that others
               overtake several times: the top of the staleness distribution). So it is left out of the
               samples and its excess over nsync typical minibatches (the median) is `startup_s`, paid once
               by that worker's first minibatch (the pooled distribution: the workers' median excess).
               `replay`: the samples, the first included, are taken in their order (each worker replays its
               own trace; workers the log does not have replay the pooled one from an offset of their own),
               else shuffled, each once a pass (`ComputeDraws`)
    stragglers the run's --straggler factors (of the workers in the log): a simulation without a --straggler
               of its own applies them, so by default it reproduces the run as measured
    server_s   the shortest gap between two consecutive updates (the updates table): the server cannot apply
               two pushes faster than it takes per push, and with 2+ workers some pushes arrive while it is
               busy, so the shortest gap is one push's whole handling (receive, update, log, reply); 0 for a
               run of one worker (folded into the latency then)
    latency_s  (median over pushes after each worker's first of (wait_s + comm_s - held_s) - server_s) / 2:
               a push's round-trip overhead is 2 transfers + the server's time (+ queueing, which the median
               mostly leaves out); ssp's hold (held_s) is no part of it. The transfers' size-dependent part
               is folded in: bandwidth = 0 (infinite)
    eval_s_per_image  from the run's evaluations during training when it has any (the slowest worker's seconds
               over its slice's images, median), else None (from the compute time)
    batch_size, model, network  the run's --batch-size, --model and `network_digest` of its stored definition
               (`mismatch_warnings` compares them with a simulation's)

    A run with --overlap hides part of its wait behind compute: its latency comes out too low. Raises
    ProfileError naming the file when it is not a run log, not of an async/ssp run, or has too few pushes.
    """
    source = f"--fit '{path}'"
    try:
        run = load(path)
    except (OSError, ValueError, KeyError) as e:
        raise ProfileError(f"{source}: {e}") from None
    cfg = run["config"]
    mode = run.get("mode") or cfg.get("mode")
    if mode not in PS_MODES:
        raise ProfileError(f"{source}: a '{mode}' run; a timing model is fitted from an async or ssp run (its "
                           "pushes are request/reply round trips to the parameter server)")
    pushes = run["pushes"]
    if pushes is None or len(pushes) < 2:
        raise ProfileError(f"{source}: {0 if pushes is None else len(pushes)} pushes; at least 2 are needed to fit "
                           "a timing model")
    pushes = pushes[pushes["samples"] > 0]
    nsync = max(1, int(cfg.get("nsync", 1) or 1))
    slow = Config(straggler=str(cfg.get("straggler", "") or "")).stragglers()
    own = {}
    for w in sorted(set(pushes["worker"].tolist())):
        seconds = pushes["compute_s"][pushes["worker"] == w].astype(np.float64) / nsync / slow.get(int(w), 1.0)
        seconds = seconds[np.isfinite(seconds) & (seconds > 0)]
        startup = 0.0  # replay: a trace keeps its start-up where it was; one push: it is all there is
        if not replay and len(seconds) >= 2:  # (the first push's nsync minibatches against as many typical ones)
            startup, seconds = max(0.0, nsync * (seconds[0] - float(np.median(seconds[1:])))), seconds[1:]
        if len(seconds):
            own[int(w)] = ComputeTime(samples=tuple(float(s) for s in seconds), replay=replay, startup_s=startup)
    if not own:
        raise ProfileError(f"{source}: no push with a compute time > 0 to fit from")
    pooled = ComputeTime(samples=tuple(s for c in own.values() for s in c.samples), replay=replay,
                         startup_s=float(np.median([c.startup_s for c in own.values()])))
    updates = run["updates"]
    server_s = 0.0
    if int(run.get("num_workers") or len(own)) >= 2 and updates is not None and len(updates) >= 2:
        gaps = np.diff(np.sort(updates["time"].astype(np.float64)))
        gaps = gaps[gaps > 0]
        server_s = float(gaps.min()) if len(gaps) else 0.0
    later = pushes[pushes["step"] >= 2]  # a worker's first wait is its start-up (and a warm start's hold)
    overhead = (later["wait_s"].astype(np.float64) + later["comm_s"] - later["held_s"]) if len(later) else np.zeros(0)
    overhead = overhead[np.isfinite(overhead)]
    median = float(np.median(overhead)) if len(overhead) else server_s
    if median < server_s:  # the round trip is shorter than the gap estimate: the server was never the queue
        server_s = median
    latency = max(0.0, (median - server_s) / 2)
    per_image = None
    evals = run.get("periodic_evals")
    workers = max(1, int(run.get("num_workers") or len(own)))
    if evals is not None and len(evals):
        ok = evals[(evals["count"] > 0) & np.isfinite(evals["seconds"])]
        if len(ok):
            per_image = float(np.median(ok["seconds"].astype(np.float64) / (ok["count"] / workers)))
    return TimingModel(compute=pooled, latency_s=latency, bandwidth=0.0, server_s=server_s,
                       eval_s_per_image=per_image, workers=own,
                       stragglers={w: f for w, f in slow.items() if w in own and f != 1.0},
                       batch_size=int(cfg.get("batch_size", 0) or 0),
                       model=str(run.get("model") or cfg.get("model") or ""),
                       network=_stored_digest(run.get("model_spec")),
                       note=f"fitted from run log '{path}' ({len(pushes)} pushes, {len(own)} workers)")


def _stored_digest(text: Any) -> str:
    """`network_digest` of a run log's stored definition (JSON text); "" for none (an older log) or one that is
    not a JSON object (the network is then known by its --model name alone)."""
    try:
        spec = json.loads(text) if text else None
    except (TypeError, ValueError, RecursionError):
        return ""
    return network_digest(spec) if isinstance(spec, dict) else ""
