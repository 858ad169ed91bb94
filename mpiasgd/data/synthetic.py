"""Synthetic ImageNet-shaped datasets, generated in memory from a fixed seed: for timing and end-to-end runs
of the ImageNet networks (`alexnet_1gpu`, `alexnet_1gpu_64`) where no ImageNet copy is at hand.

    synthetic64    3x64x64,   1000 classes, 12,800 train / 1,000 test images (157 MB of uint8)
    synthetic224   3x224x224, 1000 classes,  1,280 train /   250 test images (193 MB)

Each class has a fixed smooth template (a random 8x8 image per channel, upsampled); an image is its
class's template plus independent noise, quantised to uint8, so a network can learn the classes (the
accuracy says that training works, nothing about ImageNet). Every rank generates the same arrays
(`np.random.default_rng(SEED)`), so nothing is read from disk or sent between ranks. Training images
get the usual random crop (pad 4) and horizontal flip.
"""

from __future__ import annotations

import numpy as np

from mpiasgd.data.dataset import Dataset

SEED = 20131212  # GPU A-SGD's arXiv date: any fixed number; changing it changes every synthetic image
SIZES = {"synthetic64": (64, 12800, 1000), "synthetic224": (224, 1280, 250)}  # side, train, test
CLASSES = 1000


def load_synthetic(name: str) -> Dataset:
    """The synthetic dataset `name` (a key of SIZES): uint8 (N, 3, S, S) images, int64 labels in 0..999."""
    side, n_train, n_test = SIZES[name]
    rng = np.random.default_rng(SEED)
    coarse = rng.normal(128, 48, size=(CLASSES, 3, 8, 8)).astype(np.float32)
    reps = side // 8
    templates = np.repeat(np.repeat(coarse, reps, axis=2), reps, axis=3)  # (1000, 3, S, S), blocky

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, CLASSES, n).astype(np.int64)
        images = np.empty((n, 3, side, side), np.uint8)
        for start in range(0, n, 256):  # in chunks: the float32 noise of all at once would double the memory
            stop = min(n, start + 256)
            noise = rng.normal(0, 32, size=(stop - start, 3, side, side)).astype(np.float32)
            images[start:stop] = np.clip(templates[labels[start:stop]] + noise, 0, 255).astype(np.uint8)
        return images, labels

    train_x, train_y = split(n_train)
    test_x, test_y = split(n_test)
    return Dataset.from_arrays(name=name, train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y,
                               classes=tuple(f"class{i}" for i in range(CLASSES)), augment=True,
                               source=f"generated (mpiasgd.data.synthetic, seed {SEED})")
