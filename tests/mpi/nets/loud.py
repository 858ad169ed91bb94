"""A network for the --wire fp16 range tests: digits through large weights (He-sized ones times about 5,000),
within fp16's range [-65504, 65504] at the start, whose gradients are not: their largest magnitudes are
about 70,000 to 130,000, finite in float32, inf in fp16, at any step size."""

from mpiasgd.model.layers import Flatten, Linear, ReLU


def build() -> list:
    return [Flatten(), Linear(64, 16, init="normal", std=1e4), ReLU(), Linear(16, 10, init="normal", std=1e4)]
