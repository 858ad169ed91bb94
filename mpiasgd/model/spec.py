"""A network's stored definition: layers as JSON data, and the ways users name a network.

A definition is a dict of JSON values:

    {"format": "mpiasgd.model/1", "name": "resnet20", "input_shape": [3, 32, 32],
     "layers": [{"type": "Conv2d", "in_channels": 3, "out_channels": 16, "kernel": 3, "pad": 1, ...},
                {"type": "Residual", "main": [...], "shortcut": [...], "after": [...]}, ...]}

Every "type" is a class of `mpiasgd.model.layers.LAYER_TYPES` and every other key one of its
constructor's keyword arguments, checked against the argument's type, so rebuilding a network from a
run log or a checkpoint (`model_from_spec`) runs no code from the file: a network stored in a log is
data, not source. The run log keeps it in its `model_spec` attribute, the checkpoint alongside the
weights.

Users name a network (`--model`) as:

    resnet20                a built-in (`mpiasgd.model.registry.MODELS`)
    path/to/net.py:build    a function in a Python file returning a list of layers of
                            `mpiasgd.model.layers` (run once, by rank 0 at start-up; the workers and
                            every later reader build from the definition it produced)
    path/to/net.json        a definition as above, or just its "layers" list

`resolve(ref, input_shape)` turns any of these into a definition.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import re
import signal
import sys
import threading
from typing import Any

import numpy as np

from mpiasgd.model.layers import LAYER_TYPES, Layer

FORMAT = "mpiasgd.model/1"
KEYS = ("format", "name", "input_shape", "layers")  # a definition's keys, no others
MAX_DEPTH = 16  # residual blocks nested in residual blocks, at most (a deeper definition is refused, not recursed)
MAX_LAYERS = 10_000  # layers in a network, those inside residual blocks included (resnet56: 196); more is refused
USER_FILE = re.compile(r"^(?P<path>.+\.py):(?P<func>[A-Za-z_]\w*)$")


class ModelSpecError(ValueError):
    """A network definition that cannot be built, or a --model reference that does not name one."""


def layer_spec(layer: Layer) -> dict[str, Any]:
    """{"type": class name, **layer.config()}; ModelSpecError for a layer class that is not built in (a user's
    own Layer subclass cannot be stored as data)."""
    name = type(layer).__name__
    if LAYER_TYPES.get(name) is not type(layer):
        raise ModelSpecError(f"layer {layer.describe()} is a {type(layer).__module__}.{name}, not one of mpiasgd's "
                             f"layer types ({', '.join(LAYER_TYPES)}): a network must be made of them to be "
                             "stored in the run log and rebuilt from it")
    return {"type": name, **{key: _plain(value) for key, value in layer.config().items()}}


def _plain(value: Any) -> Any:
    """A config value as plain JSON data: numpy scalars as Python numbers (a user's np.int64 channel count)."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def model_spec(name: str, input_shape: tuple[int, ...], layers: list[Layer]) -> dict[str, Any]:
    """The definition of a network `name` taking per-sample inputs `input_shape` (C, H, W); ModelSpecError as
    `check_spec` (more than MAX_LAYERS layers, say)."""
    spec = {"format": FORMAT, "name": str(name), "input_shape": [int(d) for d in input_shape],
            "layers": [layer_spec(layer) for layer in layers]}
    check_spec(spec)
    return spec


def count_layers(layers: list[Any], depth: int = 0) -> int:
    """How many layers the definitions `layers` hold, those in residual blocks' lists included (a block counts
    too); counting stops below MAX_DEPTH + 1 levels, where `layer_from_spec` refuses the nesting anyway."""
    count = 0
    for spec in layers:
        count += 1
        if isinstance(spec, dict) and depth <= MAX_DEPTH:
            count += sum(count_layers(v, depth + 1) for v in spec.values() if isinstance(v, list))
    return count


_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
}


def _accepts(annotation: str, value: Any) -> bool:
    for option in (a.strip() for a in str(annotation).split("|")):
        if option == "None" and value is None:
            return True
        if option.startswith("list[Layer]") and isinstance(value, list):
            return True
        if option in _CHECKS and _CHECKS[option](value):
            return True
    return False


def layer_from_spec(spec: Any, where: str, depth: int = 0) -> Layer:
    """A fresh layer (no ops yet) from one layer definition; `where` names it in errors ("layers[3]").

    Raises ModelSpecError naming `where` for an unknown type, an unknown or mistyped argument, a value the
    layer refuses, or residual blocks nested deeper than MAX_DEPTH.
    """
    if depth > MAX_DEPTH:
        raise ModelSpecError(f"{where}: residual blocks nested more than {MAX_DEPTH} deep")
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise ModelSpecError(f"{where}: a layer must be an object with a \"type\", got {spec!r:.80}")
    kind = spec["type"]
    cls = LAYER_TYPES.get(kind)
    if cls is None:
        raise ModelSpecError(f"{where}: unknown layer type {kind!r}; known: {', '.join(LAYER_TYPES)}")
    params = {n: p for n, p in inspect.signature(cls.__init__).parameters.items() if n not in ("self", "ops")}
    kwargs: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "type":
            continue
        if key not in params:
            takes = f"takes {', '.join(params)}" if params else "takes no arguments"
            raise ModelSpecError(f"{where} ({kind}): unknown argument {key!r}; {kind} {takes}")
        if not _accepts(params[key].annotation, value):
            raise ModelSpecError(f"{where} ({kind}): {key} must be {params[key].annotation}, got {value!r:.80}")
        if isinstance(value, list) and str(params[key].annotation).startswith("list[Layer]"):
            value = [layer_from_spec(v, f"{where}.{key}[{i}]", depth + 1) for i, v in enumerate(value)]
        kwargs[key] = value
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise ModelSpecError(f"{where} ({kind}): missing argument(s) {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ModelSpecError(f"{where} ({kind}): {e}") from None


def layers_from_spec(spec: dict[str, Any]) -> list[Layer]:
    """The layers of a definition (checked as `check_spec`)."""
    check_spec(spec)
    return [layer_from_spec(s, f"layers[{i}]") for i, s in enumerate(spec["layers"])]


def check_spec(spec: Any) -> None:
    """ModelSpecError unless `spec` has a definition's keys and types (layers are checked when built)."""
    if not isinstance(spec, dict):
        raise ModelSpecError(f"a network definition must be a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise ModelSpecError(f"network definition: unknown key(s) {', '.join(map(repr, unknown))}; a definition "
                             f"has {', '.join(KEYS)}")
    if spec.get("format") != FORMAT:
        raise ModelSpecError(f"network definition format {spec.get('format')!r}, expected {FORMAT!r}")
    shape = spec.get("input_shape")
    if (not isinstance(shape, list) or len(shape) != 3
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise ModelSpecError(f"network definition: input_shape must be 3 integers > 0 (C, H, W), got {shape!r}")
    if not isinstance(spec.get("name"), str) or not isinstance(spec.get("layers"), list) or not spec["layers"]:
        raise ModelSpecError("network definition: needs a \"name\" string and a non-empty \"layers\" list")
    count = count_layers(spec["layers"])
    if count > MAX_LAYERS:
        raise ModelSpecError(f"network definition: {count} layers (residual blocks' included), at most {MAX_LAYERS} "
                             "are allowed: a network this deep would not fit in memory")


def to_json(spec: dict[str, Any]) -> str:
    """A definition as compact, standard JSON text (what the run log and checkpoint store). ModelSpecError
    for a value JSON cannot hold (NaN, infinities, objects) or nesting too deep to write."""
    try:
        return json.dumps(spec, separators=(",", ":"), sort_keys=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ModelSpecError(f"the network definition cannot be stored as JSON: {e}") from None


def from_json(text: str | bytes, what: str = "network definition") -> dict[str, Any]:
    """A definition from JSON text (json.loads: data only), checked; ModelSpecError naming `what`."""
    try:
        spec = json.loads(text)
    except (TypeError, ValueError, RecursionError) as e:  # RecursionError: nesting deeper than json can parse
        raise ModelSpecError(f"{what}: not valid JSON ({type(e).__name__}: {e})") from None
    try:
        check_spec(spec)
    except ModelSpecError as e:
        raise ModelSpecError(f"{what}: {e}") from None
    return spec


def stored(attrs: Any, what: str) -> dict[str, Any]:
    """The definition a run log's or checkpoint's attributes hold (`model_spec`), as data; for a file written
    before networks were stored, the built-in its `model` attribute names. ModelSpecError naming `what`
    (the file) when neither gives one."""
    text = attrs.get("model_spec", "")
    if not isinstance(text, (str, bytes)):
        raise ModelSpecError(f"{what}: its model_spec attribute is a {type(text).__name__}, expected JSON text")
    if text:
        return from_json(text, f"{what}: its network definition")
    from mpiasgd.model.registry import MODELS

    name = str(attrs.get("model", ""))
    if name not in MODELS:
        raise ModelSpecError(f"{what}: holds no network definition and names no built-in network ({name!r})")
    return resolve(name)


def label(ref: str) -> str:
    """A short name for --model `ref`: the built-in's name, or a file's stem ("nets/wide.py:build" -> "wide")."""
    m = USER_FILE.match(ref)
    path = m.group("path") if m else ref
    if m or ref.endswith(".json"):
        return os.path.splitext(os.path.basename(path))[0] or "model"
    return ref


def is_file_ref(ref: str) -> bool:
    """Whether --model `ref` names a file (path.py:function or path.json) rather than a built-in."""
    return bool(USER_FILE.match(ref)) or ref.endswith(".json")


def resolve(ref: str, input_shape: tuple[int, ...] | None = None, limit_s: float | None = None) -> dict[str, Any]:
    """The definition that --model `ref` names (see the module docstring).

    A built-in carries its own input shape; a file's network takes `input_shape` (the dataset's
    (C, H, W)) unless its JSON says otherwise. Raises ModelSpecError naming the reference: unknown
    built-in, missing file, a Python file that fails to import or whose function raises or returns
    something else than a list of mpiasgd layers, invalid JSON, more than MAX_LAYERS layers. With
    `limit_s` (seconds; main thread only), importing a Python file and calling its function must end
    within that time and is stopped by a preemption signal (SIGTERM, SIGUSR1, SIGINT), else ModelSpecError.
    """
    from mpiasgd.model.registry import MODELS

    if ref in MODELS:
        spec = MODELS[ref]
        return model_spec(ref, spec.input_shape, spec.build())
    m = USER_FILE.match(ref)
    if m is None and not ref.endswith(".json"):
        raise ModelSpecError(f"unknown model {ref!r}; valid models: {', '.join(sorted(MODELS))}, or a file: "
                             "path/to/net.py:function or path/to/net.json")
    path = m.group("path") if m else ref
    if not os.path.isfile(path):
        why = "not a regular file" if os.path.exists(path) else "no such file"
        raise ModelSpecError(f"--model {ref!r}: {why} {path!r}")
    if m is None:
        with open(path, encoding="utf-8-sig") as f:  # (a byte-order mark is allowed)
            text = f.read()
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ModelSpecError(f"--model {ref!r}: not valid JSON ({type(e).__name__}: {e})") from None
        if isinstance(data, list):
            data = {"layers": data}
        if not isinstance(data, dict):
            raise ModelSpecError(f"--model {ref!r}: expected a JSON object or a list of layers")
        data = {"format": FORMAT, "name": label(ref),
                "input_shape": list(input_shape) if input_shape is not None else None, **data}
        try:
            check_spec(data)
            layers_from_spec(data)
        except ModelSpecError as e:
            raise ModelSpecError(f"--model {ref!r}: {e}") from None
        return data
    layers = _call_user_file(ref, path, m.group("func"), limit_s)
    if input_shape is None:
        raise ModelSpecError(f"--model {ref!r}: the input shape must come from the dataset")
    try:
        return model_spec(label(ref), input_shape, layers)
    except ModelSpecError as e:
        raise ModelSpecError(f"--model {ref!r}: {e}") from None


class _Stopped(BaseException):
    """Raised in the main thread by `_bounded`'s signal handler: the time is up, or a signal came."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _bounded(limit_s: float | None) -> Any:
    """Raise _Stopped in the block after `limit_s` seconds (SIGALRM) or at a preemption signal: a user's
    file that loops or sleeps ends start-up with an error instead of hanging every rank. The signal
    handlers before are restored after. Does nothing without `limit_s` or outside the main thread."""
    if limit_s is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise _Stopped(signum)

    before = {signum: signal.signal(signum, stop)
              for signum in (signal.SIGALRM, signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    signal.setitimer(signal.ITIMER_REAL, limit_s, 1.0)  # (again each second, should the file catch it)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _call_user_file(ref: str, path: str, func: str, limit_s: float | None = None) -> list[Layer]:
    try:
        with _bounded(limit_s):
            return _run_user_file(ref, path, func)
    except _Stopped as e:
        if e.signum == signal.SIGALRM:
            raise ModelSpecError(f"--model {ref!r}: importing {path!r} and calling {func}() took more than "
                                 f"{limit_s:g} s (--model-timeout): does it loop or wait?") from None
        raise ModelSpecError(f"--model {ref!r}: {signal.Signals(e.signum).name} received while importing "
                             f"{path!r} or calling {func}(): start-up stopped") from None


def _run_user_file(ref: str, path: str, func: str) -> list[Layer]:
    name = f"mpiasgd_user_model_{abs(hash(os.path.abspath(path)))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ModelSpecError(f"--model {ref!r}: cannot load {path!r} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)  # the file may import modules beside it
    cwd = os.getcwd()  # (a file that changes folder must not move the run log)
    try:
        try:
            module_spec.loader.exec_module(module)
        except _Stopped:
            raise
        except BaseException as e:  # SystemExit, KeyboardInterrupt too: rank 0 must go on to report it
            raise ModelSpecError(f"--model {ref!r}: importing {path!r} failed: {type(e).__name__}: {e}") from None
        build = getattr(module, func, None)
        if not callable(build):
            got = f"{func!r} is not a function but of type {type(build).__name__}" if hasattr(module, func) else \
                f"has no function {func!r}"
            raise ModelSpecError(f"--model {ref!r}: {path!r} {got}")
        try:
            layers = build()
        except _Stopped:
            raise
        except BaseException as e:
            raise ModelSpecError(f"--model {ref!r}: {func}() raised {type(e).__name__}: {e}") from None
    finally:
        sys.path.remove(folder)
        os.chdir(cwd)
    if not isinstance(layers, (list, tuple)) or not layers or not all(isinstance(x, Layer) for x in layers):
        got = type(layers).__name__ if not isinstance(layers, (list, tuple)) else \
            ", ".join(sorted({type(x).__name__ for x in layers})) or "an empty list"
        raise ModelSpecError(f"--model {ref!r}: {func}() must return a non-empty list of mpiasgd.model.layers "
                             f"layers, got {got}")
    return list(layers)
