"""The registry of named models: their layers, input shape and dataset, and `build_model`.

    model = build_model("cifar10", "numpy")          # a fresh, unbound Model
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from mpiasgd.model.layers import Conv2d, Flatten, Layer, Linear, MaxPool2d, ReLU, Shape
from mpiasgd.model.model import Model
from mpiasgd.ops import get_backend


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: per-sample input shape (C, H, W), a builder of its layer list, its dataset."""

    input_shape: Shape
    build: Callable[[ModuleType], list[Layer]]  # ops backend -> fresh layers
    doc: str
    dataset: str  # the dataset it trains on unless --dataset says otherwise

    def __call__(self, ops: ModuleType) -> list[Layer]:
        return self.build(ops)


def _digits(ops: ModuleType) -> list[Layer]:
    return [
        Conv2d(1, 16, 3, pad=1, ops=ops), ReLU(ops=ops), MaxPool2d(2, 2, ops=ops),   # 16x8x8 -> 16x4x4
        Conv2d(16, 32, 3, pad=1, ops=ops), ReLU(ops=ops), MaxPool2d(2, 2, ops=ops),  # 32x4x4 -> 32x2x2
        Flatten(ops=ops), Linear(128, 10, ops=ops),
    ]


def _cifar10(ops: ModuleType) -> list[Layer]:
    # pool before relu in the first block (as in layers-18pct): same result, relu on 4x fewer values
    return [
        Conv2d(3, 32, 5, pad=2, ops=ops), MaxPool2d(3, 2, ops=ops), ReLU(ops=ops),   # 32x32x32 -> 32x15x15
        Conv2d(32, 32, 5, pad=2, ops=ops), ReLU(ops=ops), MaxPool2d(3, 2, ops=ops),  # 32x15x15 -> 32x7x7
        Conv2d(32, 64, 5, pad=2, ops=ops), ReLU(ops=ops), MaxPool2d(3, 2, ops=ops),  # 64x7x7 -> 64x3x3
        Flatten(ops=ops), Linear(576, 10, ops=ops),
    ]


def _cifar10_deep(ops: ModuleType) -> list[Layer]:
    def block(cin: int, cout: int) -> list[Layer]:
        return [Conv2d(cin, cout, 3, pad=1, ops=ops), ReLU(ops=ops), Conv2d(cout, cout, 3, pad=1, ops=ops),
                ReLU(ops=ops), MaxPool2d(2, 2, ops=ops)]

    return [*block(3, 16), *block(16, 32), *block(32, 64),  # 16x32x32 -> 32x16x16 -> 64x8x8 -> 64x4x4
            Flatten(ops=ops), Linear(1024, 10, ops=ops)]


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
}


def build_model(name: str, backend: str = "numpy") -> Model:
    """A fresh, unbound `Model` of registered architecture `name` on ops backend `backend`.

    Registered: "digits" (1x8x8, 10 classes, 6,090 parameters), "cifar10" (3x32x32, 10 classes,
    85,098 parameters) and "cifar10_deep" (3x32x32, six conv layers, 82,330 parameters). Raises
    ValueError listing the valid names (or backends) when unknown.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(sorted(MODELS))}")
    ops = get_backend(backend)
    spec = MODELS[name]
    return Model(name, spec.input_shape, spec(ops), ops)
