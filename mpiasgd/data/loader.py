"""The data a run trains on, whichever way it is named: a built-in dataset or an mpiasgd dataset file.

    dataset = open_data(cfg.data or cfg.dataset_name, data_dir, test_file, augment="pad-crop=4,flip")

Both kinds give the same interface (`Dataset` in memory, `H5Dataset` read from disk): `classes`,
`mean`, `std`, `source`, `image_shape`, `input_shape` (after the augmentation's crop), `train_y`,
`test_y`, `num_train`, `num_test`, `chunk`, `batch(split, idx, rng)`.
"""

from __future__ import annotations

from typing import Any

from mpiasgd.data.augment import Augmentation
from mpiasgd.data.cifar10 import load_cifar10
from mpiasgd.data.dataset import DATASETS, Dataset, default_data_dir
from mpiasgd.data.digits import load_digits
from mpiasgd.data.errors import DataError
from mpiasgd.data.h5data import H5Dataset
from mpiasgd.data.synthetic import load_synthetic


def is_data_file(name: str) -> bool:
    """`name` names a dataset file (not a built-in dataset): anything but the built-in names."""
    return name not in DATASETS


def open_data(name: str, data_dir: str | None = None, test_file: str = "", augment: str = "",
              cache_chunks: int = 32) -> Any:
    """The dataset `name` (a built-in name, `DATASETS`, or the path of an HDF5 dataset file), its test split
    from `test_file` when given (files only), with the training augmentation `augment`
    (`augment.Augmentation.parse`; "" = the dataset's default). `cache_chunks`: a file's chunks kept
    after reading, per split (the shuffle window + 2 reads each chunk once per epoch).

    Reads no training images (a file's labels and attributes only: rank 0 calls it too). Raises DataError
    naming the file or the name, and what was expected.
    """
    if is_data_file(name):
        dataset = H5Dataset(name, test_file or None, cache_chunks=cache_chunks)
    else:
        if test_file:
            raise DataError(f"a test-data file ({test_file}) needs a dataset file, not the built-in '{name}'")
        dataset = load_dataset(name, data_dir or default_data_dir())
    if augment:
        dataset = dataset.with_augmentation(Augmentation.parse(augment))
    return dataset


def load_dataset(name: str, data_dir: str | None = None) -> Dataset:
    """Load a dataset by name: "digits" (bundled with scikit-learn), "cifar10", or "synthetic64" /
    "synthetic224" (ImageNet-shaped images generated in memory: `mpiasgd.data.synthetic`).

    data_dir: where to look for CIFAR-10 (see `cifar10.load_cifar10`); None means
    `default_data_dir()`. Ignored for "digits", which never touches the disk beyond scikit-learn.
    Raises DataError for an unknown name (listing the valid ones) or missing/malformed files.
    """
    if name == "digits":
        return load_digits()
    if name == "cifar10":
        return load_cifar10(default_data_dir() if data_dir is None else data_dir)
    if name.startswith("synthetic") and name in DATASETS:
        return load_synthetic(name)
    raise DataError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
