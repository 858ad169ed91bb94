"""A network's stored definition: layers as JSON data, and the ways users name a network. The format and its
checks are `definition.py`'s (re-exported here); this module adds the references to built-ins and files.

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
import json
import os
import re
import signal
import sys
import threading
from typing import Any

from mpiasgd.model.definition import (  # noqa: F401 (the definition's format, re-exported: callers name it here)
    FORMAT,
    KEYS,
    MAX_DEPTH,
    MAX_LAYERS,
    check_spec,
    count_layers,
    from_json,
    layer_from_spec,
    layers_from_spec,
    model_spec,
    to_json,
)
from mpiasgd.model.errors import ModelSpecError
from mpiasgd.model.layers import Layer, layer_spec  # noqa: F401
from mpiasgd.model.registry import MODELS

USER_FILE = re.compile(r"^(?P<path>.+\.py):(?P<func>[A-Za-z_]\w*)$")


def stored(attrs: Any, what: str) -> dict[str, Any]:
    """The definition a run log's or checkpoint's attributes hold (`model_spec`), as data; for a file written
    before networks were stored, the built-in its `model` attribute names. ModelSpecError naming `what`
    (the file) when neither gives one."""
    text = attrs.get("model_spec", "")
    if not isinstance(text, (str, bytes)):
        raise ModelSpecError(f"{what}: its model_spec attribute is a {type(text).__name__}, expected JSON text")
    if text:
        return from_json(text, f"{what}: its network definition")
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
