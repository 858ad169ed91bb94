"""Model export: a network's weights as a NumPy .npz keyed by parameter name, and PyTorch's names for them.

    python -m mpiasgd export runs/c10.h5 -o c10.npz               # the run's last weight snapshot
    python -m mpiasgd export runs/c10.h5 --snapshot 3 -o s3.npz   # snapshot 3 (negative: from the end)
    python -m mpiasgd export runs/c10.h5 --checkpoint -o ck.npz   # the checkpoint runs/c10.ckpt.h5

The file holds, and np.load(path, allow_pickle=False) reads:

    "conv1.weight", "res4.bn1.running_mean", ...   float32 arrays, one per parameter and per buffer, named
                                                   and shaped as `Model.layout()` and `buffer_layout()` say
    "__model_spec__"                               a 0-d str array: the network's definition as JSON
                                                   (`mpiasgd.model.spec`), from which `load_npz` rebuilds it

`torch_names(spec)` maps those names to the state_dict keys of the network's reference PyTorch
definition (bench/torch_models.py): the CIFAR ResNets as FDG's/akamaster's ResNet_cifar.py names them,
sequential networks as nn.Sequential(features, flatten, classifier). Reading the weights out of a run log
or a checkpoint (`mpiasgd export`) is `mpiasgd.tools.export`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from mpiasgd.model.layers import Flatten, Residual
from mpiasgd.model.model import Model
from mpiasgd.model.registry import build_model
from mpiasgd.model.spec import check_spec, from_json, to_json

SPEC_KEY = "__model_spec__"
NAME_CHARS = 60  # a network's name in a message: this many characters, then "..."


def short(name: str) -> str:
    """`name` quoted for a message, its first NAME_CHARS characters then "..." (a stored name may be huge)."""
    return repr(name[:NAME_CHARS]) + ("..." if len(name) > NAME_CHARS else "")


def _model(spec: dict[str, Any]) -> Model:
    return build_model(spec, "numpy")  # shapes and names only: nothing is allocated


def _vector(what: str, values: Any, size: int) -> np.ndarray:
    a = np.zeros(0, np.float32) if values is None else np.asarray(values)
    if a.shape != (size,) or not (a.dtype.kind == "f" or size == 0):
        raise ValueError(f"{what} must be a float vector of shape ({size},), got {a.dtype} {a.shape}")
    return a.astype(np.float32, copy=False)


def named_arrays(spec: dict[str, Any], params: Any, buffers: Any = None) -> dict[str, np.ndarray]:
    """{name: array} of the flat `params` ((P,) float) and `buffers` ((B,), None when B = 0) of the network
    `spec` defines, each float32 and shaped as its layer declares it; parameters first, in layout order.
    Raises ValueError on vectors of the wrong length, `spec.ModelSpecError` on a definition that cannot be built."""
    model = _model(spec)
    p = _vector("params", params, model.num_params)
    b = _vector("buffers", buffers, model.num_buffers)
    out = {name: p[o:o + int(np.prod(s, dtype=np.int64))].reshape(s) for name, o, s in model.layout()}
    out.update({name: b[o:o + int(np.prod(s, dtype=np.int64))].reshape(s) for name, o, s in model.buffer_layout()})
    return out


def export_npz(path: str, spec: dict[str, Any], params: Any, buffers: Any = None) -> None:
    """Write the weights `params` ((P,)) and layer buffers `buffers` ((B,), None when the network has none)
    of the network `spec` defines to the .npz file `path` (exactly that name: no ".npz" is appended),
    as the module docstring describes. Written to a temporary file in the same folder, then renamed:
    a failed write leaves no partial file. Raises ValueError (wrong lengths), ModelSpecError, FileExistsError
    when `path` exists and is not a regular file (such as a folder or /dev/full, which the rename would
    replace), and OSError naming `path` (no such folder, no permission, disk full, a folder such as /proc
    where no file can be created).
    """
    check_spec(spec)
    if os.path.exists(path) and not os.path.isfile(path):
        raise FileExistsError(errno.EEXIST, f"{path!r} exists and is not a regular file: export writes a new file "
                                            "or replaces one")
    arrays = named_arrays(spec, params, buffers)
    arrays[SPEC_KEY] = np.array(to_json(spec))  # 0-d '<U...': no pickle needed to read it
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:  # the umask's permissions, as any file written in place
            np.savez(f, **arrays)  # a file object: numpy keeps the name as given
        os.replace(tmp, path)
    except OSError as e:  # named by the file asked for, not the temporary one
        if e.errno == errno.ENOENT and os.path.isdir(folder):  # the folder is there but takes no new file (/proc)
            raise OSError(e.errno, f"no file can be created in '{folder}' ({e.strerror})", path) from None
        raise OSError(e.errno, e.strerror or str(e), path) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_npz(path: str) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """The inverse of `export_npz`: (definition, params (P,) float32, buffers (B,) float32) from `path`,
    read without pickle. Raises ValueError naming the file when it is not such an export: no
    "__model_spec__", a definition that is not valid, arrays missing, extra or of the wrong shape.
    """
    with np.load(path, allow_pickle=False) as z:
        if SPEC_KEY not in z.files:
            raise ValueError(f"'{path}' is not an mpiasgd model export: it has no {SPEC_KEY!r} entry")
        spec = from_json(str(z[SPEC_KEY][()]), what=f"'{path}' {SPEC_KEY}")
        model = _model(spec)
        expected = [*model.layout(), *model.buffer_layout()]
        names = {name for name, _, _ in expected}
        missing = [name for name, _, _ in expected if name not in z.files]
        extra = sorted(set(z.files) - names - {SPEC_KEY})
        if missing or extra:
            raise ValueError(f"'{path}' does not match its network {spec['name']!r}: "
                             f"missing {missing[:5] or 'none'}, unexpected {extra[:5] or 'none'}")
        params = np.zeros(model.num_params, np.float32)
        buffers = np.zeros(model.num_buffers, np.float32)
        for layout, flat in ((model.layout(), params), (model.buffer_layout(), buffers)):
            for name, offset, shape in layout:
                a = z[name]
                if a.shape != shape or a.dtype.kind != "f":
                    raise ValueError(f"'{path}': {name} must be a float array of shape {shape}, got {a.dtype} "
                                     f"{a.shape}")
                flat[offset:offset + a.size] = a.reshape(-1)
    return spec, params, buffers


# ----------------------------------------------------------------------------------------------
# PyTorch's names


def torch_names(spec: dict[str, Any]) -> dict[str, str]:
    """{our parameter or buffer name: its key in the state_dict of the network's reference PyTorch definition}
    (bench/torch_models.py), covering every name of `Model.layout()` and `buffer_layout()` once.

    Two layouts are known, told apart by the layers (not the network's name):

      * CIFAR ResNets (`registry.resnet_cifar`: conv, BatchNorm, ReLU, 3 stages of n residual
        blocks, global average pooling, linear), as FDG's/akamaster's ResNet_cifar.py name them:
        conv1.weight, bn1.{weight,bias,running_mean,running_var}, block i (from 0) of stage s (1-3)
        as layer{s}.{i}.conv1.weight, layer{s}.{i}.bn1.*, .conv2, .bn2 (a projection shortcut's
        layers as layer{s}.{i}.shortcut.{0,1}.*), and linear.{weight,bias}: "res4.bn1.running_mean"
        of resnet20 is "layer2.0.bn1.running_mean". PyTorch's BatchNorm2d also has a
        num_batches_tracked buffer, which we do not keep: PyTorch 1.13 fills it in with 0 when a state
        dict lacks it, load with strict=False where a version does not (it matters only for
        momentum=None, the cumulative average).
      * Sequential networks with one Flatten (digits, cifar10, cifar10_deep, cifar10_18pct,
        alexnet_1gpu, alexnet_1gpu_64): nn.Sequential(OrderedDict(features=nn.Sequential(layers before
        Flatten), flatten=nn.Flatten(), classifier=nn.Sequential(layers after it))), each layer at its
        own index (parameterless ones included, as in torchvision's alexnet): alexnet_1gpu's
        conv1.weight is features.0.weight and fc1.weight (after Flatten) is classifier.0.weight.

    Raises ValueError for other networks (naming them), `spec.ModelSpecError` for a definition that
    cannot be built.
    """
    model = _model(spec)
    if any(isinstance(layer, Residual) for layer in model.layers):
        rename = _resnet_rename(model, spec)
    else:
        rename = _sequential_rename(model, spec)
    out = {}
    for name, _, _ in [*model.layout(), *model.buffer_layout()]:
        top, leaf = name.split(".", 1)  # "res4", "bn1.running_mean"
        out[name] = rename(top, leaf)
    return out


def _unknown(spec: dict[str, Any], why: str) -> ValueError:
    return ValueError(f"torch_names: network {spec.get('name')!r} has no reference PyTorch layout ({why}); known: "
                      "CIFAR ResNets (resnet_cifar) and sequential networks with one Flatten")


def _sequential_rename(model: Model, spec: dict[str, Any]) -> Callable[[str, str], str]:
    flat = [i for i, layer in enumerate(model.layers) if isinstance(layer, Flatten)]
    if len(flat) != 1:
        raise _unknown(spec, f"{len(flat)} Flatten layers, expected 1")
    cut = flat[0]
    prefix = {lname: (f"features.{i}" if i < cut else f"classifier.{i - cut - 1}")
              for i, lname in enumerate(model.names)}
    return lambda top, leaf: f"{prefix[top]}.{leaf}"


def _resnet_rename(model: Model, spec: dict[str, Any]) -> Callable[[str, str], str]:
    kinds = [type(layer).__name__ for layer in model.layers]
    blocks = [i for i, kind in enumerate(kinds) if kind == "Residual"]
    n = len(blocks) // 3
    if n == 0 or kinds != ["Conv2d", "BatchNorm2d", "ReLU", *["Residual"] * 3 * n, "GlobalAvgPool", "Linear"]:
        raise _unknown(spec, "its layers are not conv, BatchNorm, ReLU, 3 stages of residual blocks, "
                             "global average pooling, linear")
    names = model.names
    prefix = {names[0]: "conv1", names[1]: "bn1", names[-1]: "linear"}
    prefix.update({names[i]: f"layer{k // n + 1}.{k % n}" for k, i in enumerate(blocks)})  # stage, block in stage
    shortcut: dict[str, str] = {}  # a projection shortcut's "shortcut.conv1" -> torch's nn.Sequential index
    for i in blocks:
        inner = [c for c in model.layers[i].child_names if c.startswith("shortcut.")]
        shortcut.update({f"{names[i]}.{c}": f"shortcut.{j}" for j, c in enumerate(inner)})

    def rename(top: str, leaf: str) -> str:
        if top not in prefix:
            raise _unknown(spec, f"a parameter of layer {top!r} has no PyTorch name")
        child, _, rest = leaf.rpartition(".")  # "bn1", "running_mean"; "" for a plain layer's "weight"
        child = shortcut.get(f"{top}.{child}", child)  # conv1, bn1, conv2, bn2: BasicBlock's own names
        return f"{prefix[top]}.{child}.{rest}" if child else f"{prefix[top]}.{rest}"

    return rename
