"""Reference PyTorch definitions of mpiasgd's built-in networks, the loader of an `mpiasgd export` .npz into
them, and a check that both frameworks compute the same logits.

    python bench/torch_models.py runs/c10.npz              # an export: load it, compare logits on random images
    python bench/torch_models.py cifar10_18pct resnet20    # built-ins, with random weights and buffers

Needs PyTorch (optional; nothing in mpiasgd/ or tests/ imports this file). The state_dict keys are
`mpiasgd.model.export.torch_names`: the CIFAR ResNets as FDG's/akamaster's ResNet_cifar.py (conv1, bn1,
layer{1,2,3}.{i}.conv1/bn1/conv2/bn2, linear), the other networks as nn.Sequential(OrderedDict(
features=..., flatten=nn.Flatten(), classifier=...)), every layer at its own index as in torchvision's
alexnet. Loading into PyTorch, in five lines:

    import numpy as np, torch
    from mpiasgd.model.export import load_npz, torch_names
    from bench.torch_models import reference
    spec, _, _ = load_npz("c10.npz"); z = np.load("c10.npz", allow_pickle=False); net = reference(spec)
    net.load_state_dict({k: torch.from_numpy(z[n]) for n, k in torch_names(spec).items()}, strict=False)

strict=False because PyTorch's BatchNorm2d has a num_batches_tracked buffer that mpiasgd does not keep (1.13
fills it in with 0 by itself). Checked with Debian's PyTorch 1.13 (CPU): every built-in within ATOL + RTOL |logit|.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from functools import partial
from typing import Any

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ModuleNotFoundError as e:  # an optional extra: say how to get it, not a traceback
    if __name__ != "__main__":
        raise
    sys.exit(f"bench/torch_models.py: needs PyTorch ({e}); install the optional extra: pip install -e '.[bench]'")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpiasgd.model import MODELS, Model, build_model
from mpiasgd.model.export import load_npz, torch_names

ATOL, RTOL = 1e-4, 1e-4  # |ours - torch| <= ATOL + RTOL * |torch| on every logit (float32 both)


def _sequential(features: list[nn.Module], classifier: list[nn.Module]) -> nn.Sequential:
    return nn.Sequential(OrderedDict(features=nn.Sequential(*features), flatten=nn.Flatten(),
                                     classifier=nn.Sequential(*classifier)))


def cifar10_18pct(num_classes: int = 10) -> nn.Sequential:
    """cuda-convnet's layers-18pct network as `mpiasgd.model.networks.cifar10_18pct` builds it (cross-map LRN
    in place of its within-map rnorm; see there)."""
    def lrn() -> nn.Module:
        return nn.LocalResponseNorm(3, alpha=5e-5, beta=0.75, k=1.0)

    return _sequential(
        [nn.Conv2d(3, 32, 5, 1, 2), nn.MaxPool2d(3, 2, ceil_mode=True), nn.ReLU(), lrn(),
         nn.Conv2d(32, 32, 5, 1, 2), nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True), lrn(),
         nn.Conv2d(32, 64, 5, 1, 2), nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True)],
        [nn.Linear(1024, num_classes)])


def alexnet_1gpu(num_classes: int = 1000, size: int = 224) -> nn.Sequential:
    """The one-tower AlexNet (arXiv 1404.5997; cuda-convnet2's layers-imagenet-1gpu.cfg) as
    `mpiasgd.model.networks.alexnet_1gpu` builds it, for 224x224 or 64x64 inputs."""
    def lrn() -> nn.Module:
        return nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0)

    def pool() -> nn.Module:
        return nn.MaxPool2d(3, 2, ceil_mode=True)

    first, last = (nn.Conv2d(3, 64, 11, 4, 2), 6) if size == 224 else (nn.Conv2d(3, 64, 5, 2, 2), 4)
    return _sequential(
        [first, lrn(), pool(), nn.ReLU(),
         nn.Conv2d(64, 192, 5, 1, 2), nn.ReLU(), lrn(), pool(),
         nn.Conv2d(192, 384, 3, 1, 1), nn.ReLU(),
         nn.Conv2d(384, 256, 3, 1, 1), nn.ReLU(),
         nn.Conv2d(256, 256, 3, 1, 1), pool(), nn.ReLU()],
        [nn.Linear(256 * last * last, 4096), nn.ReLU(), nn.Dropout(0.5),
         nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(0.5),
         nn.Linear(4096, num_classes)])


class LambdaLayer(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class BasicBlock(nn.Module):
    """ResNet_cifar.py's block, option A shortcut: x[:, :, ::2, ::2] with planes//4 zero channels each side."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or in_planes != planes:
            pad = planes // 4
            self.shortcut = LambdaLayer(lambda x: F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, pad, pad), "constant", 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCifar(nn.Module):
    """FDG's/akamaster's ResNet_cifar.py: depth 6n + 2, stages of 16, 32, 64 channels, linear classifier."""

    def __init__(self, depth: int, num_classes: int = 10) -> None:
        super().__init__()
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        planes = 16
        stages = []
        for width, stride in ((16, 1), (32, 2), (64, 2)):
            blocks = []
            for i in range(n):
                blocks.append(BasicBlock(planes, width, stride if i == 0 else 1))
                planes = width
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.linear = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.avg_pool2d(out, out.size()[3])
        return self.linear(out.view(out.size(0), -1))


def from_spec(spec: dict[str, Any]) -> nn.Sequential:
    """A sequential network with one Flatten (digits, cifar10, cifar10_deep, ...) from its stored definition."""
    def layer(d: dict[str, Any]) -> nn.Module:
        kind = d["type"]
        if kind == "Conv2d":
            return nn.Conv2d(d["in_channels"], d["out_channels"], d["kernel"], d.get("stride", 1), d.get("pad", 0),
                             bias=d.get("bias", True))
        if kind == "Linear":
            return nn.Linear(d["in_features"], d["out_features"], bias=d.get("bias", True))
        if kind in ("MaxPool2d", "AvgPool2d"):
            extra = {"count_include_pad": d.get("count_include_pad", True)} if kind == "AvgPool2d" else {}
            return getattr(nn, kind)(d["kernel"], d.get("stride") or d["kernel"], d.get("pad", 0),
                                     ceil_mode=d.get("ceil_mode", False), **extra)
        if kind == "LocalResponseNorm":
            return nn.LocalResponseNorm(d["size"], d.get("alpha", 1e-4), d.get("beta", 0.75), d.get("k", 1.0))
        if kind == "BatchNorm2d":
            return nn.BatchNorm2d(d["num_features"], d.get("eps", 1e-5), d.get("momentum", 0.1))
        if kind == "Dropout":
            return nn.Dropout(d.get("p", 0.5))
        if kind == "ReLU":
            return nn.ReLU()
        raise ValueError(f"from_spec: no PyTorch layer for {kind}")

    kinds = [d["type"] for d in spec["layers"]]
    if kinds.count("Flatten") != 1:
        raise ValueError(f"from_spec: network {spec['name']!r} is not sequential with one Flatten")
    cut = kinds.index("Flatten")
    return _sequential([layer(d) for d in spec["layers"][:cut]], [layer(d) for d in spec["layers"][cut + 1:]])


REFERENCES = {"cifar10_18pct": cifar10_18pct, "alexnet_1gpu": alexnet_1gpu,
              "alexnet_1gpu_64": partial(alexnet_1gpu, size=64)}


def reference(spec: dict[str, Any]) -> nn.Module:
    """The PyTorch definition of the network `spec` defines: the written-out ones above for the built-ins
    (with the spec's number of classes), `from_spec` for other sequential networks."""
    kinds = [d["type"] for d in spec["layers"]]
    classes = spec["layers"][-1]["out_features"]
    if "Residual" in kinds:
        return ResNetCifar(6 * (kinds.count("Residual") // 3) + 2, classes)
    if spec["name"] in REFERENCES:
        return REFERENCES[spec["name"]](num_classes=classes)
    return from_spec(spec)


def load_export(path: str) -> tuple[dict[str, Any], nn.Module]:
    """(definition, PyTorch network holding the weights and buffers of the export `path`), in eval mode."""
    spec, _, _ = load_npz(path)
    net = reference(spec)
    with np.load(path, allow_pickle=False) as z:
        state = {key: torch.from_numpy(np.array(z[name])) for name, key in torch_names(spec).items()}
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or any(not key.endswith("num_batches_tracked") for key in missing):
        raise ValueError(f"{path}: keys PyTorch's {spec['name']} lacks {unexpected}, keys it misses {missing}")
    return spec, net.eval()


def random_state(model: Model, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Weights N(0, 2/fan_in) (biases N(0, 0.1^2), BatchNorm gamma near 1) and buffers off their initial
    values, so that every layer (LRN included) acts on values of order 1 and more."""
    rng = np.random.default_rng(seed)
    params = np.zeros(model.num_params, np.float32)
    for name, offset, shape in model.layout():
        size = int(np.prod(shape))
        if len(shape) > 1:
            values = rng.standard_normal(size) * np.sqrt(2.0 / np.prod(shape[1:]))
        elif name.split(".")[-2].startswith("bn") and name.endswith("weight"):
            values = 1 + 0.1 * rng.standard_normal(size)
        else:
            values = 0.1 * rng.standard_normal(size)
        params[offset:offset + size] = values
    buffers = np.zeros(model.num_buffers, np.float32)
    for name, offset, shape in model.buffer_layout():
        size = int(np.prod(shape))
        buffers[offset:offset + size] = (rng.uniform(0.5, 2.0, size) if name.endswith("running_var")
                                         else 0.1 * rng.standard_normal(size))
    return params, buffers


def compare(path: str, batch: int, seed: int) -> bool:
    """Logits of our numpy model and of PyTorch's on the same random images, evaluation mode; prints the worst
    element against the tolerance."""
    spec, net = load_export(path)
    ours = build_model(spec, "numpy")
    params, buffers = load_npz(path)[1:]
    ours.bind(params, np.zeros_like(params), buffers)
    ours.eval()
    x = (10 * np.random.default_rng(seed).standard_normal((batch, *ours.input_shape))).astype(np.float32)
    h = x
    for layer in ours.layers:
        h = layer.forward(h)
    with torch.no_grad():
        ref = net(torch.from_numpy(x)).numpy()
    err = np.abs(h - ref)
    bound = ATOL + RTOL * np.abs(ref)
    worst = np.unravel_index(int(np.argmax(err / bound)), err.shape)
    ok = bool((err <= bound).all())
    print(f"{spec['name']:<16} {ours.num_params:>11,} params  max |ours - torch| {err.max():.3g} "
          f"(|torch| up to {np.abs(ref).max():.3g}); worst {tuple(map(int, worst))}: ours {h[worst]:.6g}, "
          f"torch {ref[worst]:.6g}, {float(err[worst] / bound[worst]):.3f} of the tolerance  {'ok' if ok else 'FAIL'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="+", help="an .npz written by mpiasgd export, or a built-in network's name")
    parser.add_argument("--batch", type=int, default=4, help="random images per comparison (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmp", default="/tmp", help="folder for the exports of built-ins (default /tmp)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    ok = True
    for what in args.what:
        path = what
        if what in MODELS:
            from mpiasgd.model.export import export_npz

            model = build_model(what)
            path = os.path.join(args.tmp, f"torch_models-{what}.npz")
            export_npz(path, model.spec(), *random_state(model, args.seed))
        ok &= compare(path, args.batch, args.seed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
