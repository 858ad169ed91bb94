"""The in-memory dataset every worker trains from (its error type, `DataError`, is `errors.py`'s).

A `Dataset` keeps raw uint8 pixels (NCHW) in memory, a few hundred MB at most for CIFAR-10, and
turns a minibatch of indices into normalised float32 on request (`Dataset.batch`). Loaders for
each named dataset live beside this file (`digits.py`, `cifar10.py`, `synthetic.py`); `load_dataset`
(`loader.py`) picks one.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpiasgd.data.augment import Augmentation
from mpiasgd.data.errors import DataError

__all__ = ["DATASETS", "DataError", "Dataset", "Splits", "channel_stats", "default_data_dir"]

DATASETS = ("digits", "cifar10", "synthetic64", "synthetic224")  # names load_dataset accepts


def default_data_dir() -> str:
    """Folder searched for datasets when none is given: `$MPIASGD_DATA` if set, else ~/.cache/mpiasgd.

    The same default as the tool that writes CIFAR-10 in the official layouts. Nothing is created.
    """
    env = os.environ.get("MPIASGD_DATA")
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "mpiasgd")


def channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and (population) standard deviation of uint8 images x (N, C, H, W).

    Returns two float32 arrays (C,) in raw pixel units. Computed from a 256-bin histogram per
    channel, so it is exact and needs no float copy of x. A channel with zero spread gets std 1
    so that normalising never divides by zero.
    """
    if x.dtype != np.uint8 or x.ndim != 4:
        raise DataError(f"channel_stats: expected uint8 (N, C, H, W), got {x.dtype} {x.shape}")
    values = np.arange(256, dtype=np.float64)
    mean = np.empty(x.shape[1], dtype=np.float64)
    var = np.empty(x.shape[1], dtype=np.float64)
    for c in range(x.shape[1]):  # C is 1 or 3
        hist = np.bincount(x[:, c].ravel(), minlength=256).astype(np.float64)
        n = hist.sum()
        mean[c] = hist @ values / n
        var[c] = hist @ (values - mean[c]) ** 2 / n
    std = np.sqrt(var)
    std[std == 0] = 1.0
    return mean.astype(np.float32), std.astype(np.float32)


class Splits:
    """What every dataset derives from its labels and its augmentation (in memory: `Dataset`; a file:
    `h5data.H5Dataset`): needs `train_y`, `test_y`, `image_shape` and `augmentation`."""

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H', W') of the minibatches `batch` returns: the stored images after the augmentation's crop."""
        return self.augmentation.output_shape(self.image_shape)

    @property
    def augment(self) -> bool:
        """Training minibatches are augmented (the augmentation draws anything from the rng)."""
        return self.augmentation.random

    @property
    def num_train(self) -> int:
        return int(self.train_y.size)

    @property
    def num_test(self) -> int:
        return int(self.test_y.size)


@dataclass(frozen=True, eq=False)
class Dataset(Splits):
    """A labelled image dataset split into train and test, raw pixels in memory.

    Build one with `Dataset.from_arrays` (checks shapes, computes mean/std) or `load_dataset`.
    The arrays are read-only: every rank may share one `Dataset` without copying.
    """

    name: str
    train_x: np.ndarray = field(repr=False)  # uint8 (N, C, H, W), raw pixels, C-contiguous
    train_y: np.ndarray = field(repr=False)  # int64 (N,), class index 0..K-1
    test_x: np.ndarray = field(repr=False)  # uint8 (M, C, H, W)
    test_y: np.ndarray = field(repr=False)  # int64 (M,)
    mean: np.ndarray = field(repr=False)  # float32 (C,), per-channel mean of train_x, pixel units
    std: np.ndarray = field(repr=False)  # float32 (C,), per-channel std of train_x, pixel units
    classes: tuple[str, ...]  # class names, index = label
    source: str  # where it was read from: a folder, or "sklearn.datasets.load_digits"
    augmentation: Any = None  # an augment.Augmentation: "pad-crop=4,flip" if augment else "none" (from_arrays)
    chunk = 1  # samples the sampler keeps together: any sample is one read (in memory)
    fingerprint = ""  # what identifies a dataset file's content (`h5data.H5Dataset`); a built-in set: none

    @classmethod
    def from_arrays(
        cls,
        name: str,
        train_x: np.ndarray,
        train_y: np.ndarray,
        test_x: np.ndarray,
        test_y: np.ndarray,
        classes: tuple[str, ...],
        augment: bool,
        source: str,
    ) -> Dataset:
        """Check the arrays, compute mean/std from train_x, and freeze everything.

        x arrays must be uint8 (N, C, H, W) with the same C, H, W; y arrays integer (N,) with
        labels in 0..len(classes)-1. Arrays are made C-contiguous (int64 for labels) and
        read-only. Raises DataError naming `source` when a check fails.
        """
        arrays = {}
        for split, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
            x, y = np.asarray(x), np.asarray(y)
            if x.dtype != np.uint8 or x.ndim != 4:
                raise DataError(f"{source}: {split} images must be uint8 (N, C, H, W), got {x.dtype} {x.shape}")
            if y.ndim != 1 or y.shape[0] != x.shape[0] or not np.issubdtype(y.dtype, np.integer):
                raise DataError(
                    f"{source}: {split} labels must be integers of shape ({x.shape[0]},), got {y.dtype} {y.shape}"
                )
            bad = np.flatnonzero((y < 0) | (y >= len(classes)))
            if bad.size:
                raise DataError(
                    f"{source}: {split} label {int(y[bad[0]])} at index {int(bad[0])} is outside 0..{len(classes) - 1}"
                )
            x = np.ascontiguousarray(x)
            y = np.ascontiguousarray(y, dtype=np.int64)
            x.setflags(write=False)
            y.setflags(write=False)
            arrays[split] = (x, y)
        if arrays["train"][0].shape[1:] != arrays["test"][0].shape[1:]:
            raise DataError(
                f"{source}: train images are {arrays['train'][0].shape[1:]} but test images are "
                f"{arrays['test'][0].shape[1:]}"
            )
        if arrays["train"][0].shape[0] == 0:
            raise DataError(f"{source}: no training images")
        mean, std = channel_stats(arrays["train"][0])
        mean.setflags(write=False)
        std.setflags(write=False)
        return cls(
            name=name,
            train_x=arrays["train"][0],
            train_y=arrays["train"][1],
            test_x=arrays["test"][0],
            test_y=arrays["test"][1],
            mean=mean,
            std=std,
            classes=tuple(classes),
            source=source,
            augmentation=Augmentation.parse("pad-crop=4,flip" if augment else "none"),
        )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the stored images."""
        return tuple(int(d) for d in self.train_x.shape[1:])

    @functools.cached_property
    def pixel_cov(self) -> np.ndarray:
        """float64 (C, C): covariance of a pixel's channels over the training images, pixel units (PCA noise)."""
        c = self.train_x.shape[1]
        pixels = self.train_x.transpose(1, 0, 2, 3).reshape(c, -1)
        return np.cov(pixels.astype(np.float32), bias=True).reshape(c, c).astype(np.float64)

    def with_augmentation(self, augmentation: Any) -> Dataset:
        """The same data with another training augmentation (`augment.Augmentation`); DataError if it cannot
        apply to these images."""
        augmentation.check(self.image_shape, self.pixel_cov if augmentation.pca_noise > 0 else None)
        return dataclasses.replace(self, augmentation=augmentation)

    def batch(
        self, split: str, idx: np.ndarray, rng: np.random.Generator | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Gather a minibatch and normalise it.

        split: "train" or "test" (else ValueError). idx: integer indices (B,) into that split.
        Returns x float32 (B, C, H, W) C-contiguous, (x - mean) / std per channel, and y int64 (B,).

        Augmentation happens only for split "train" with an rng given: `self.augmentation.train`
        (by default on CIFAR-10 and the synthetic sets random crop with padding 4 and horizontal flip
        with p = 0.5; the padding is zeros AFTER normalisation, i.e. the padded border holds the
        channel mean in pixel units). The test split gets `self.augmentation.test` (normalisation, and
        the centre crop of a cropping augmentation).
        """
        if split == "train":
            xs, ys = self.train_x, self.train_y
        elif split == "test":
            xs, ys = self.test_x, self.test_y
        else:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        idx = np.asarray(idx)
        if idx.size == 0:
            idx = idx.astype(np.int64)  # np.asarray([]) is float64
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"idx must be a 1-D integer array, got {idx.dtype} {idx.shape}")
        raw = xs[idx]  # (B, C, H, W) uint8
        if split == "train" and rng is not None:
            cov = self.pixel_cov if self.augmentation.pca_noise > 0 else None
            return self.augmentation.train(raw, rng, self.mean, self.std, cov), ys[idx]
        return self.augmentation.test(raw, self.mean, self.std), ys[idx]
