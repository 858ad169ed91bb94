"""The registry of built-in networks: their layers, input shape and dataset, and `build_model`.

    model = build_model("cifar10", "numpy")          # a fresh, unbound Model
    model = build_model(spec, "cupy")                # from a stored definition (mpiasgd.model.spec)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpiasgd.model.definition import layers_from_spec
from mpiasgd.model.layers import (
    BatchNorm2d,
    Conv2d,
    Flatten,
    GlobalAvgPool,
    Layer,
    Linear,
    MaxPool2d,
    ReLU,
    Residual,
    Shape,
    SubsamplePad,
)
from mpiasgd.model.model import Model
from mpiasgd.model.networks import alexnet_1gpu, cifar10_18pct
from mpiasgd.ops import get_backend


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: per-sample input shape (C, H, W), a builder of its layer list, its dataset."""

    input_shape: Shape
    build: Callable[[], list[Layer]]  # fresh layers, without a backend (the Model gives them one)
    doc: str
    dataset: str  # the dataset it trains on unless --dataset says otherwise

    def __call__(self, ops: Any = None) -> list[Layer]:
        layers = self.build()
        if ops is not None:
            for layer in layers:
                layer.set_ops(ops)
        return layers


def _digits() -> list[Layer]:
    return [
        Conv2d(1, 16, 3, pad=1), ReLU(), MaxPool2d(2, 2),   # 16x8x8 -> 16x4x4
        Conv2d(16, 32, 3, pad=1), ReLU(), MaxPool2d(2, 2),  # 32x4x4 -> 32x2x2
        Flatten(), Linear(128, 10, init="zeros"),
    ]


def _cifar10() -> list[Layer]:
    # pool before relu in the first block (as in layers-18pct): same result, relu on 4x fewer values
    return [
        Conv2d(3, 32, 5, pad=2), MaxPool2d(3, 2), ReLU(),   # 32x32x32 -> 32x15x15
        Conv2d(32, 32, 5, pad=2), ReLU(), MaxPool2d(3, 2),  # 32x15x15 -> 32x7x7
        Conv2d(32, 64, 5, pad=2), ReLU(), MaxPool2d(3, 2),  # 64x7x7 -> 64x3x3
        Flatten(), Linear(576, 10, init="zeros"),
    ]


def _cifar10_deep() -> list[Layer]:
    def block(cin: int, cout: int) -> list[Layer]:
        return [Conv2d(cin, cout, 3, pad=1), ReLU(), Conv2d(cout, cout, 3, pad=1), ReLU(), MaxPool2d(2, 2)]

    return [*block(3, 16), *block(16, 32), *block(32, 64),  # 16x32x32 -> 32x16x16 -> 64x8x8 -> 64x4x4
            Flatten(), Linear(1024, 10, init="zeros")]


def resnet_cifar(depth: int, num_classes: int = 10) -> list[Layer]:
    """The CIFAR ResNet of He et al. 2016 (arXiv 1512.03385 section 4.2) as FDG's ResNet_cifar.py builds it:
    depth = 6n + 2; a bias-free 3x3 conv (16) + BatchNorm + ReLU, then three stages of n basic blocks
    with 16, 32, 64 channels (the first block of stages 2 and 3 has stride 2 and an option-A shortcut:
    `SubsamplePad`), global average pooling and a linear classifier.

    Block: y = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), each block one layer of the model
    (pipeline cuts fall on block boundaries, as FDG's). Convs He-initialised (FDG: kaiming_normal_);
    the classifier starts at zero; weight decay on every parameter, BatchNorm's and biases' included
    (decay_mult 1: FDG passes model.parameters() to torch.optim.SGD with weight_decay).
    """
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"resnet_cifar: depth must be 6n + 2 >= 8 (20, 32, 44, 56, 110), got {depth}")
    n = (depth - 2) // 6

    def bn(c: int) -> BatchNorm2d:
        return BatchNorm2d(c, decay_mult=1.0)

    layers: list[Layer] = [Conv2d(3, 16, 3, pad=1, bias=False), bn(16), ReLU()]
    cin = 16
    for cout, first_stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(n):
            stride = first_stride if i == 0 else 1
            shortcut = [SubsamplePad(cin, cout, stride)] if stride != 1 or cin != cout else []
            main = [Conv2d(cin, cout, 3, stride, 1, bias=False), bn(cout), ReLU(),
                    Conv2d(cout, cout, 3, 1, 1, bias=False), bn(cout)]
            layers.append(Residual(main, shortcut, [ReLU()]))
            cin = cout
    return [*layers, GlobalAvgPool(), Linear(64, num_classes, init="zeros", bias_decay_mult=1.0)]


MODELS: dict[str, ModelSpec] = {
    "digits": ModelSpec(
        (1, 8, 8), _digits,
        "sklearn 8x8 digits: conv3x3(16) relu pool2 - conv3x3(32) relu pool2 - fc10; 6,090 parameters", "digits"),
    "cifar10": ModelSpec(
        (3, 32, 32), _cifar10,
        "CIFAR-10, cuda-convnet layers-18pct style: conv5x5(32) pool3/2 relu - conv5x5(32) relu pool3/2 "
        "- conv5x5(64) relu pool3/2 - fc10 (spatial 32->15->7->3); 85,098 parameters", "cifar10"),
    "cifar10_deep": ModelSpec(
        (3, 32, 32), _cifar10_deep,
        "CIFAR-10, six 3x3 conv layers worth cutting into pipeline modules: [conv3x3(C) relu conv3x3(C) relu "
        "pool2] for C = 16, 32, 64 - fc10 (spatial 32->16->8->4); 82,330 parameters, 20 MFLOP per image", "cifar10"),
    "resnet20": ModelSpec(
        (3, 32, 32), lambda: resnet_cifar(20),
        "CIFAR ResNet-20 (He et al. 2016; FDG's ResNet_cifar.py): bias-free convs, BatchNorm, option-A "
        "shortcuts, 3 stages x 3 blocks (16/32/64 channels), global average pooling - fc10; 269,722 "
        "parameters, 81 MFLOP per image", "cifar10"),
    "resnet56": ModelSpec(
        (3, 32, 32), lambda: resnet_cifar(56),
        "CIFAR ResNet-56, as resnet20 with 9 blocks per stage; 853,018 parameters, 251 MFLOP per image", "cifar10"),
    "cifar10_18pct": ModelSpec(
        (3, 32, 32), cifar10_18pct,
        "CIFAR-10, cuda-convnet's layers-18pct.cfg (Krizhevsky): conv5x5(32) maxpool3/2 relu lrn3 - conv5x5(32) "
        "relu avgpool3/2 lrn3 - conv5x5(64) relu avgpool3/2 - fc10, ceil pooling (32->16->8->4), its initW, "
        "epsB/epsW and wc as multipliers (use --lr 0.001 --weight-decay 0.004); 89,578 parameters", "cifar10"),
    "alexnet_1gpu": ModelSpec(
        (3, 224, 224), alexnet_1gpu,
        "ImageNet one-tower AlexNet (Krizhevsky 2014, arXiv 1404.5997; cuda-convnet2 layers-imagenet-1gpu): "
        "conv11x11/4(64) lrn pool - conv5x5(192) lrn pool - conv3x3(384, 256, 256) pool - fc4096 fc4096 "
        "(dropout 0.5) - fc1000; 61,100,840 parameters; trains on the generated synthetic224 unless --dataset "
        "says otherwise", "synthetic224"),
    "alexnet_1gpu_64": ModelSpec(
        (3, 64, 64), lambda: alexnet_1gpu(size=64),
        "alexnet_1gpu for 64x64 inputs: conv5x5/2(64) first, the same depth, maps 32->16->8->4, fc4096 fc4096 "
        "- fc1000; 40,110,888 parameters; trains on the generated synthetic64 unless --dataset says otherwise",
        "synthetic64"),
}


def build_model(name: str | dict, backend: str = "numpy") -> Model:
    """A fresh, unbound `Model` on ops backend `backend`: of the built-in network `name` (`MODELS`), or
    from a stored definition (a dict, `mpiasgd.model.spec`).

    Built in: "digits" (1x8x8, 6,090 parameters), "cifar10" (3x32x32, 85,098), "cifar10_deep"
    (3x32x32, six conv layers, 82,330), "resnet20" and "resnet56" (CIFAR ResNets with BatchNorm).
    Raises ValueError listing the valid names (or backends) when unknown; `spec.ModelSpecError` (a
    ValueError) naming the layer for a definition that cannot be built.
    """
    if isinstance(name, dict):
        layers = layers_from_spec(name)
        ops = get_backend(backend)
        return Model(name["name"], tuple(name["input_shape"]), layers, ops)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(sorted(MODELS))}")
    ops = get_backend(backend)
    spec = MODELS[name]
    return Model(name, spec.input_shape, spec(ops), ops)
