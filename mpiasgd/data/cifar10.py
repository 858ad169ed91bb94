"""CIFAR-10 (Krizhevsky 2009) from the user's disk, in either official layout; never downloads.

    cifar-10-batches-py/   data_batch_1..5, test_batch, batches.meta
        pickled dicts with bytes keys: b"data" uint8 (n, 3072), b"labels" list of n ints,
        b"batch_label", b"filenames"; batches.meta holds b"label_names".
    cifar-10-batches-bin/  data_batch_1..5.bin, test_batch.bin, batches.meta.txt
        n records of 1 label byte + 3072 pixel bytes (file size a multiple of 3073).

Pixels are planar RGB, row-major: 1024 red, 1024 green, 1024 blue, so a row of 3072 bytes
reshapes straight to (3, 32, 32). Official batches hold 10,000 records; smaller ones are accepted.

The pickles are read with an unpickler that resolves only the few globals these files use
(numpy array and dtype reconstruction, and `_codecs.encode` for latin-1 bytes in protocol-2
pickles written by Python 3); any other global is refused with DataError before it is called.
"""

from __future__ import annotations

import codecs
import os
import pickle

import numpy as np

from mpiasgd.data.dataset import DataError, Dataset

PY_DIR = "cifar-10-batches-py"
BIN_DIR = "cifar-10-batches-bin"
TRAIN_BATCHES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5")
TEST_BATCH = "test_batch"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SHAPE = (3, 32, 32)  # (C, H, W)
IMAGE_BYTES = 3 * 32 * 32  # 3072
RECORD_BYTES = 1 + IMAGE_BYTES  # .bin record: label byte + pixels
OFFICIAL_RECORDS = 10_000  # records in each official batch file
DOWNLOAD_HINT = (
    "get CIFAR-10 from https://www.cs.toronto.edu/~kriz/cifar.html "
    "(cifar-10-python.tar.gz or cifar-10-binary.tar.gz), extract it with `tar -xzf FILE -C DIR`, "
    "and pass DIR as data_dir or set MPIASGD_DATA=DIR"
)


def find_cifar10(data_dir: str) -> tuple[str, str]:
    """Locate CIFAR-10 under data_dir. Returns (layout, folder), layout "py" or "bin".

    data_dir may contain cifar-10-batches-py/ or cifar-10-batches-bin/ (py wins when both are
    there), or be one of those folders itself (recognised by its name or by the batch files in
    it). Raises DataError saying where it looked, what it expected and how to get the data.
    """
    if not os.path.isdir(data_dir):
        what = "is not a folder" if os.path.exists(data_dir) else "does not exist"
        raise DataError(
            f"CIFAR-10 folder {data_dir} {what}; expected a folder containing {PY_DIR}/ or {BIN_DIR}/; "
            + DOWNLOAD_HINT
        )
    for layout, sub in (("py", PY_DIR), ("bin", BIN_DIR)):
        if os.path.isdir(os.path.join(data_dir, sub)):
            return layout, os.path.join(data_dir, sub)
    entries = os.listdir(data_dir)
    name = os.path.basename(os.path.normpath(data_dir))
    if name == PY_DIR or any(e in entries for e in (*TRAIN_BATCHES, TEST_BATCH, "batches.meta")):
        return "py", data_dir
    if name == BIN_DIR or any(e.endswith(".bin") and e[:-4] in (*TRAIN_BATCHES, TEST_BATCH) for e in entries):
        return "bin", data_dir
    archives = sorted(e for e in entries if e.startswith("cifar-10") and e.endswith((".tar.gz", ".tgz")))
    found = f"found the archive {archives[0]}, not extracted; " if archives else ""
    raise DataError(
        f"no CIFAR-10 in {data_dir}: expected {PY_DIR}/ (data_batch_1..5, test_batch) or {BIN_DIR}/ "
        f"(data_batch_1..5.bin, test_batch.bin) there, or data_dir to be one of those folders; "
        + found
        + DOWNLOAD_HINT
    )


def load_cifar10(data_dir: str) -> Dataset:
    """Load all of CIFAR-10 from data_dir (see `find_cifar10`) into memory.

    Returns a Dataset with train_x uint8 (50000, 3, 32, 32), test_x (10000, 3, 32, 32) for the
    official files (any number of records per batch is accepted), labels int64, augment True.
    Raises DataError naming the file for a missing file, wrong size or shape, a label outside
    0..9, or a corrupt or unsafe pickle. About 1 s for the whole set (np.frombuffer, no loop
    over images).
    """
    layout, folder = find_cifar10(data_dir)
    suffix = ".bin" if layout == "bin" else ""
    read = read_bin_batch if layout == "bin" else read_py_batch
    for batch in (*TRAIN_BATCHES, TEST_BATCH):
        path = os.path.join(folder, batch + suffix)
        if not os.path.isfile(path):
            other = os.path.join(os.path.dirname(folder), BIN_DIR if layout == "py" else PY_DIR)
            hint = f" ({other} also exists: pass it as data_dir to use it)" if os.path.isdir(other) else ""
            raise DataError(
                f"CIFAR-10 file {path} is missing: a {layout} layout folder holds "
                f"data_batch_1..5{suffix} and test_batch{suffix}{hint}"
            )
    train = [read(os.path.join(folder, b + suffix)) for b in TRAIN_BATCHES]
    test_x, test_y = read(os.path.join(folder, TEST_BATCH + suffix))
    train_x = np.concatenate([x for x, _ in train]).reshape(-1, *IMAGE_SHAPE)  # (N, 3, 32, 32)
    train_y = np.concatenate([y for _, y in train])
    classes = read_classes_bin(folder) if layout == "bin" else read_classes_py(folder)
    return Dataset.from_arrays(
        name="cifar10",
        train_x=train_x,
        train_y=train_y,
        test_x=test_x.reshape(-1, *IMAGE_SHAPE),
        test_y=test_y,
        classes=classes,
        augment=True,
        source=folder,
    )


def _check_labels(path: str, labels: np.ndarray) -> None:
    bad = np.flatnonzero((labels < 0) | (labels >= len(CLASSES)))
    if bad.size:
        i = int(bad[0])
        raise DataError(f"{path}: record {i} has label {int(labels[i])}, expected 0..{len(CLASSES) - 1}")


def read_bin_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One .bin batch: returns pixels uint8 (n, 3072) and labels int64 (n,). Raises DataError."""
    size = os.path.getsize(path)
    if size == 0 or size % RECORD_BYTES:
        raise DataError(
            f"{path}: size {size} bytes is not a positive multiple of {RECORD_BYTES} "
            f"(1 label byte + {IMAGE_BYTES} pixel bytes a record; an official batch is "
            f"{OFFICIAL_RECORDS * RECORD_BYTES} bytes)"
        )
    with open(path, "rb") as f:
        records = np.frombuffer(f.read(), dtype=np.uint8).reshape(-1, RECORD_BYTES)  # (n, 3073)
    labels = records[:, 0].astype(np.int64)
    _check_labels(path, labels)
    return records[:, 1:], labels  # pixels stay a view; concatenation makes the one copy


def read_py_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch: returns pixels uint8 (n, 3072) and labels int64 (n,). Raises DataError."""
    batch = read_pickle(path)
    data, labels = _get(batch, "data", path), _get(batch, "labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != IMAGE_BYTES:
        got = f"{data.dtype} array {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: b'data' must be a uint8 array (n, {IMAGE_BYTES}), got {got}")
    if data.shape[0] == 0:
        raise DataError(f"{path}: b'data' holds no images, expected (n, {IMAGE_BYTES}) with n > 0")
    try:
        labels = np.asarray(labels)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: b'labels' must be a list of ints ({exc})") from None
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{path}: b'labels' must be a list of ints, got {labels.dtype} {labels.shape}")
    if labels.shape[0] != data.shape[0]:
        raise DataError(f"{path}: {labels.shape[0]} labels for {data.shape[0]} images, expected as many")
    labels = labels.astype(np.int64)
    _check_labels(path, labels)
    return data, labels


def read_classes_py(folder: str) -> tuple[str, ...]:
    """Class names from batches.meta (b"label_names"), or the official list if the file is absent."""
    path = os.path.join(folder, "batches.meta")
    if not os.path.isfile(path):
        return CLASSES
    names = _get(read_pickle(path), "label_names", path)
    if not isinstance(names, list) or not all(isinstance(n, (bytes, str)) for n in names):
        raise DataError(f"{path}: b'label_names' must be a list of strings, got {type(names).__name__}")
    return _check_classes(path, [n.decode("latin-1") if isinstance(n, bytes) else n for n in names])


def read_classes_bin(folder: str) -> tuple[str, ...]:
    """Class names from batches.meta.txt (one a line), or the official list if the file is absent."""
    path = os.path.join(folder, "batches.meta.txt")
    if not os.path.isfile(path):
        return CLASSES
    with open(path, encoding="latin-1") as f:
        return _check_classes(path, [line.strip() for line in f if line.strip()])


def _check_classes(path: str, names: list[str]) -> tuple[str, ...]:
    if len(names) != len(CLASSES):
        raise DataError(f"{path}: expected {len(CLASSES)} class names, found {len(names)}: {names[:12]}")
    return tuple(names)


def _get(obj: object, key: str, path: str) -> object:
    """obj[b"key"] (Python 2 pickles read with encoding="bytes") or obj["key"] (Python 3 str keys)."""
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    for k in (key.encode(), key):
        if k in obj:
            return obj[k]
    raise DataError(f"{path}: the pickled dict has no key b'{key}' (keys: {sorted(map(repr, obj))[:8]})")


def read_pickle(path: str) -> object:
    """Unpickle a CIFAR-10 file with `CifarUnpickler`. Raises DataError naming path on any failure."""
    try:
        with open(path, "rb") as f:
            return CifarUnpickler(f).load()
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    except Exception as exc:  # a corrupt pickle fails in many ways; to the user they all mean one thing
        raise DataError(f"{path}: not a readable CIFAR-10 pickle ({type(exc).__name__}: {exc})") from exc


def _latin1_encode(obj: object, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """`_codecs.encode` as protocol-2 pickles use it for bytes (latin-1 only); anything else is refused."""
    if not isinstance(obj, str) or codecs.lookup(encoding).name != "iso8859-1" or errors != "strict":
        raise DataError(f"refusing _codecs.encode({type(obj).__name__}, {encoding!r}, {errors!r})")
    return obj.encode("latin-1")


def _plain_dtype(*args: object) -> np.dtype:
    """`numpy.dtype` for unpickling, refusing object dtypes (they would hold arbitrary objects)."""
    dtype = np.dtype(*args)
    if dtype.hasobject:
        raise DataError(f"refusing to unpickle an object dtype {dtype}")
    return dtype


def _plain_scalar(scalar):
    """numpy's scalar reconstruction for unpickling, refusing object dtypes."""

    def make(dtype: object, *args: object) -> np.generic:
        if not isinstance(dtype, np.dtype) or dtype.hasobject:
            raise DataError(f"refusing to unpickle a numpy scalar of dtype {dtype!r}")
        return scalar(dtype, *args)

    return make


class CifarUnpickler(pickle.Unpickler):
    """An Unpickler (encoding="bytes") that resolves only the globals CIFAR-10 batch files use.

    Allowed: numpy's array reconstruction (`numpy.core.multiarray._reconstruct` as written by
    numpy 1, `numpy._core.multiarray._reconstruct` as written by numpy 2, and `_frombuffer` from
    either module for protocol 5), numpy scalars, `numpy.ndarray`, `numpy.dtype` (object
    dtypes refused) and `_codecs.encode` to latin-1. Any other global,
    e.g. `os.system`, raises DataError before anything is called.
    """

    def __init__(self, file):
        super().__init__(file, encoding="bytes")

    def find_class(self, module: str, name: str) -> object:
        # Take numpy's own functions from how it pickles an array, whichever module they live in.
        reconstruct = np.empty(0, dtype=np.uint8).__reduce_ex__(2)[0]  # protocols 0..4
        frombuffer = np.empty(0, dtype=np.uint8).__reduce_ex__(5)[0]  # protocol 5
        scalar = np.uint8(0).__reduce__()[0]  # numpy scalars, e.g. labels saved as np.int64
        allowed = {
            ("numpy.core.multiarray", "_reconstruct"): reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): reconstruct,
            ("numpy.core.numeric", "_frombuffer"): frombuffer,
            ("numpy._core.numeric", "_frombuffer"): frombuffer,
            ("numpy.core.multiarray", "scalar"): _plain_scalar(scalar),
            ("numpy._core.multiarray", "scalar"): _plain_scalar(scalar),
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): _plain_dtype,
            ("_codecs", "encode"): _latin1_encode,
        }
        if (module, name) not in allowed:
            raise DataError(
                f"refusing to unpickle the global {module}.{name}: a CIFAR-10 batch needs only "
                f"numpy arrays, lists, bytes and ints (not executed)"
            )
        return allowed[(module, name)]
