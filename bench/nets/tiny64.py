"""A small network for 3x64x64 images of 1,000 classes (the synthetic ImageNet-shaped sets of `mpiasgd data
synth`): cheap enough on a CPU that a benchmark about the input pipeline and memory is not about compute.

conv 5x5/2 (16) ReLU - max-pool 3/2 - conv 3x3 (32) ReLU - global average pool - fc1000; 40,664 parameters.
"""

from mpiasgd.model.layers import Conv2d, GlobalAvgPool, Linear, MaxPool2d, ReLU


def build() -> list:
    return [Conv2d(3, 16, 5, 2, 2), ReLU(), MaxPool2d(3, 2), Conv2d(16, 32, 3, 1, 1), ReLU(), GlobalAvgPool(),
            Linear(32, 1000)]
