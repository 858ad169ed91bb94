"""A network's definition as data: its format, the checks that refuse a bad one, and JSON.

A definition is a dict of JSON values:

    {"format": "mpiasgd.model/1", "name": "resnet20", "input_shape": [3, 32, 32],
     "layers": [{"type": "Conv2d", "in_channels": 3, "out_channels": 16, "kernel": 3, "pad": 1, ...},
                {"type": "Residual", "main": [...], "shortcut": [...], "after": [...]}, ...]}

Every "type" is a class of `mpiasgd.model.layers.LAYER_TYPES` and every other key one of its
constructor's keyword arguments, checked against the argument's type (`layer_from_spec`). The ways users
name a network (`--model`: a built-in, a Python file, a JSON file) are `mpiasgd.model.spec`'s, which
re-exports everything here.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from mpiasgd.model.errors import ModelSpecError
from mpiasgd.model.layers import LAYER_TYPES, Layer, layer_spec

FORMAT = "mpiasgd.model/1"
KEYS = ("format", "name", "input_shape", "layers")  # a definition's keys, no others
MAX_DEPTH = 16  # residual blocks nested in residual blocks, at most (a deeper definition is refused, not recursed)
MAX_LAYERS = 10_000  # layers in a network, those inside residual blocks included (resnet56: 196); more is refused


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
