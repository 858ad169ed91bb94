"""scikit-learn's bundled handwritten digits (1,797 8x8 grey images, 10 classes): the small, offline dataset.

Pixels are 0..16 (the UCI "optdigits" counts), stored as uint8 (N, 1, 8, 8). The test split is
fixed and stratified: 360 images, `train_test_split(..., test_size=360, stratify=y,
random_state=0)`; train is the other 1,437. No download ever happens.
"""

from __future__ import annotations

import numpy as np

from mpiasgd.data.dataset import Dataset

TEST_SIZE = 360  # images held out for test, stratified by class
SPLIT_SEED = 0  # random_state of the split, fixed so every run and rank sees the same split


def load_digits() -> Dataset:
    """The digits dataset: train (1437, 1, 8, 8), test (360, 1, 8, 8) uint8 in 0..16; no augmentation."""
    # Imported here: scikit-learn takes about a second to import and only this loader needs it.
    from sklearn.datasets import load_digits as sklearn_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_load_digits()
    images = bunch.images.astype(np.uint8)[:, None, :, :]  # (N, 1, 8, 8), exact: values are 0..16
    labels = bunch.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=TEST_SIZE, stratify=labels, random_state=SPLIT_SEED
    )
    return Dataset.from_arrays(
        name="digits",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        classes=tuple(str(int(c)) for c in bunch.target_names),
        augment=False,
        source="sklearn.datasets.load_digits",
    )
