"""CIFAR-10 files written here: batches in the official python and binary layouts, and one tiny
CIFAR-10 in both (the `tiny_cifar` fixture of tests/conftest.py)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

N_PER_BATCH, N_TEST = 20, 10


def write_py_batch(path: Path, x: np.ndarray, y: np.ndarray, protocol: int = 2) -> None:
    """A batch as the official python pickles hold it: bytes keys, uint8 (n, 3072), list labels."""
    batch = {b"batch_label": b"test", b"labels": [int(v) for v in y], b"data": x.reshape(len(x), -1),
             b"filenames": [b"img_%d.png" % i for i in range(len(y))]}
    path.write_bytes(pickle.dumps(batch, protocol=protocol))


def write_bin_batch(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    """A batch as the official binary files hold it: per record 1 label byte then 3072 pixel bytes."""
    np.concatenate([y.astype(np.uint8)[:, None], x.reshape(len(x), -1)], axis=1).tofile(path)


def write_tiny_cifar(tmp_path: Path) -> tuple[Path, tuple[np.ndarray, ...]]:
    """Both layouts of one tiny CIFAR-10 (5 x 20 train, 10 test) under tmp_path; returns (dir, arrays)."""
    rng = np.random.default_rng(1234)
    train_x = rng.integers(0, 256, size=(5 * N_PER_BATCH, 3, 32, 32), dtype=np.uint8)
    train_y = rng.permutation(np.arange(5 * N_PER_BATCH) % 10)
    test_x = rng.integers(0, 256, size=(N_TEST, 3, 32, 32), dtype=np.uint8)
    test_y = np.arange(N_TEST) % 10
    py, bn = tmp_path / "cifar-10-batches-py", tmp_path / "cifar-10-batches-bin"
    py.mkdir()
    bn.mkdir()
    for i in range(5):
        part = slice(i * N_PER_BATCH, (i + 1) * N_PER_BATCH)
        write_py_batch(py / f"data_batch_{i + 1}", train_x[part], train_y[part])
        write_bin_batch(bn / f"data_batch_{i + 1}.bin", train_x[part], train_y[part])
    write_py_batch(py / "test_batch", test_x, test_y)
    write_bin_batch(bn / "test_batch.bin", test_x, test_y)
    names = [f"class{k}" for k in range(10)]
    (py / "batches.meta").write_bytes(pickle.dumps({b"label_names": [n.encode() for n in names]}, protocol=2))
    (bn / "batches.meta.txt").write_text("\n".join(names) + "\n\n")
    return tmp_path, (train_x, train_y, test_x, test_y)


def write_dataset_file(path: Path, train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray,
                       chunk: int | None = None) -> Path:
    """Images and labels of 10 classes as an mpiasgd dataset file (train and test splits), chunks of `chunk`
    images (None: the format's default, 256 at 32x32: the tiny CIFAR-10 in one chunk). Returns the path."""
    from mpiasgd.data.h5data import H5Writer

    with H5Writer(str(path), "tiny", tuple(f"c{i}" for i in range(10)), train_x.shape[1:], source="tests",
                  chunk=chunk) as w:
        w.create("train", len(train_x))
        w.write("train", 0, train_x, train_y)
        w.create("test", len(test_x))
        w.write("test", 0, test_x, test_y)
    return path
