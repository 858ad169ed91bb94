"""Dataset files (`mpiasgd.data.h5data`, format "mpiasgd.data/1") from what users have on disk, and synthetic ones.

    convert_image_folder(src, out, size)   train/<class>/*.jpg|png (torchvision ImageFolder), val/ or test/
    convert_cifar10(src, out)              either official CIFAR-10 layout (Krizhevsky 2009)
    convert_imagenet64(src, out)           downsampled ImageNet (Chrabaszcz et al. 2017, arXiv 1707.08819)
    synth(out, count, size)                ImageNet-shaped class templates + noise (Horovod's synthetic benchmark)
    info(path)                             what a file holds (`mpiasgd data info FILE`)

Every converter shuffles the training images once, with a seed, before writing them, so that each
HDF5 chunk mixes the classes (the worker reads whole chunks, see h5data). Images are written a block
of about BLOCK_BYTES at a time: nothing holds a whole dataset in memory except `convert_cifar10`
(CIFAR-10 is 180 MB). Every malformed input raises DataError naming the file or folder and saying
what was expected; the output file appears only when complete (H5Writer writes OUT.partial first).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Iterable
from contextlib import ExitStack
from typing import Any

import numpy as np
from PIL import Image
from tqdm import tqdm

from mpiasgd.data.cifar10 import CifarUnpickler, find_cifar10, load_cifar10
from mpiasgd.data.dataset import DataError
from mpiasgd.data.decoders import AHEAD, Decoders
from mpiasgd.data.h5data import FORMAT, H5Dataset, H5Writer, default_chunk

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")  # compared in lower case
RESIZE_MODES = ("crop", "squash")
TEST_FOLDERS = ("val", "test")  # an image folder's held-out split, stored as the file's test split
BLOCK_BYTES = 16 << 20  # pixels per H5Writer.write call
WINDOW_BYTES = 256 << 20  # decoded pixels in flight between the decoding processes and the writer
IMAGENET_CLASSES = 1000  # downsampled ImageNet labels are 1..1000
_TRAIN_BATCH = re.compile(r"train_data_batch_(\d+)(\.npz)?")
_VAL_BATCH = re.compile(r"val_data(\.npz)?")


def _block(image_shape: tuple[int, ...], chunk: int) -> int:
    """Images per write: a whole number of HDF5 chunks, about BLOCK_BYTES of pixels."""
    per_chunk = chunk * int(np.prod(image_shape))
    return chunk * max(1, BLOCK_BYTES // per_chunk)


def _bar(total: int, desc: str, progress: bool, unit: str = "img") -> Any:
    """A tqdm progress bar on stderr (a no-op one when progress is False)."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr, disable=not progress,
                dynamic_ncols=True)


def _write_stream(writer: H5Writer, split: str, images: Iterable[np.ndarray], labels: np.ndarray, bar: Any) -> None:
    """Write images (an iterable of uint8 (C, H, W), in row order) and labels int64 (n,) of `split` in blocks."""
    n = labels.size
    buf = np.empty((min(_block(writer.image_shape, writer.chunk), n), *writer.image_shape), np.uint8)  # (B, C, H, W)
    start = fill = 0
    for image in images:
        buf[fill] = image
        fill += 1
        bar.update(1)  # per image: a block of large images takes seconds to decode
        if fill == len(buf) or start + fill == n:
            writer.write(split, start, buf[:fill], labels[start:start + fill])
            start, fill = start + fill, 0
    if start != n:  # the iterable ended early: a bug, never the user's input
        raise RuntimeError(f"{writer.path}: {split}: {start} images written of {n}")


def _write_array(writer: H5Writer, split: str, images: np.ndarray, labels: np.ndarray, start: int,
                 bar: Any = None) -> None:
    """Write uint8 (n, C, H, W) images already in memory at rows start.., a block at a time."""
    block = _block(writer.image_shape, writer.chunk)
    for i in range(0, len(labels), block):
        writer.write(split, start + i, images[i:i + block], labels[i:i + block])
        if bar is not None:
            bar.update(min(block, len(labels) - i))


# ---------------------------------------------------------------------------------------------- image folders


def _listdir(path: str) -> list[os.DirEntry]:
    with os.scandir(path) as it:
        return sorted(it, key=lambda e: e.name)


def _class_folders(split_dir: str) -> list[str]:
    """Sorted names of the class folders of a split folder (as ImageFolder; names starting with '.' skipped)."""
    return [e.name for e in _listdir(split_dir) if e.is_dir() and not e.name.startswith(".")]


def _images_in(folder: str) -> list[str]:
    """Paths of the image files under `folder`, recursively, sorted (as ImageFolder). Symlinked folders are
    followed once each: a folder reached again (a link to itself or to a parent) is skipped, so a loop
    neither hangs the scan nor repeats images."""
    found, seen = [], set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in sorted(files) if f.lower().endswith(IMAGE_EXTENSIONS)]
    return found


def scan_image_folder(src: str) -> tuple[tuple[str, ...], dict[str, tuple[list[str], np.ndarray]]]:
    """The images of an ImageFolder tree, without decoding any: (classes, {split: (paths, labels int64 (n,))}).

    src holds train/<class>/... and optionally val/<class>/... or test/<class>/... (stored as split "test").
    Classes are the sorted names of train's subfolders; each class folder is searched recursively for
    IMAGE_EXTENSIONS (any case); other files are ignored. Paths are in class order, then sorted.
    Raises DataError naming the folder: src missing, no train/, no class folder, a class folder without
    images, both val/ and test/, a held-out class that train/ lacks.
    """
    if not os.path.isdir(src):
        what = "is not a folder" if os.path.exists(src) else "does not exist"
        raise DataError(f"image folder {src} {what}; expected a folder holding train/<class>/*.jpg|png")
    train_dir = os.path.join(src, "train")
    if not os.path.isdir(train_dir):
        raise DataError(f"{src}: no train/ folder; expected {train_dir}/<class>/*.jpg|png (and optionally val/ or "
                        "test/ in the same form)")
    held_out = [d for d in TEST_FOLDERS if os.path.isdir(os.path.join(src, d))]
    if len(held_out) > 1:
        raise DataError(f"{src}: holds both val/ and test/; expected at most one held-out split (move one away)")
    classes = tuple(_class_folders(train_dir))
    if not classes:
        raise DataError(f"{train_dir}: no class folders; expected {train_dir}/<class>/*.jpg|png")
    splits = {}
    for split, folder in (("train", train_dir), *(("test", os.path.join(src, d)) for d in held_out)):
        names = _class_folders(folder)
        unknown = sorted(set(names) - set(classes))
        if unknown:
            raise DataError(f"{folder}: class folder {unknown[0]!r} is not among the {len(classes)} classes of "
                            f"{train_dir} ({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''})")
        paths, labels = [], []
        for name in names:
            found = _images_in(os.path.join(folder, name))
            if not found:
                raise DataError(f"{os.path.join(folder, name)}: no images; expected files ending in "
                                f"{', '.join(IMAGE_EXTENSIONS)} (any case)")
            paths += found
            labels += [classes.index(name)] * len(found)
        if not paths:
            raise DataError(f"{folder}: no class folders; expected {folder}/<class>/*.jpg|png")
        splits[split] = (paths, np.asarray(labels, dtype=np.int64))
    return classes, splits


def load_image(path: str, size: int, resize: str = "crop") -> np.ndarray:
    """One image file as uint8 (3, size, size), RGB, NCHW order for one image.

    resize "crop": scale the shorter side to `size` and keep the centred size x size square (done in one
    resampling: the centred square of the source, `min(w, h)` on a side, is resampled to size x size);
    "squash": resample the whole image to size x size (aspect ratio not kept). Resampling is Pillow's
    antialiased BICUBIC; JPEGs are first decoded at a reduced scale (`Image.draft`, 1/2, 1/4 or 1/8) where
    the result stays at least size x size, which makes large photos several times faster to decode.
    Grey, palette, CMYK and alpha images become RGB (alpha dropped, as torchvision's loader does; EXIF
    orientation is ignored, as there). Raises DataError naming the file if it cannot be decoded.
    """
    try:
        with Image.open(path) as im:
            im.draft(im.mode, (size, size))  # JPEG only (a no-op elsewhere): DCT scaling, never below size
            if im.mode == "P" and "transparency" in im.info:
                im = im.convert("RGBA")  # Pillow's advice for palette transparency; alpha dropped next
            if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):  # 16-bit grey: Pillow's convert would clip
                deep = np.asarray(im, dtype=np.float64)
                scale = 255 / 65535 if deep.max(initial=0) > 255 else 1.0  # mode "I" may hold 8-bit values
                im = Image.fromarray(np.round(deep * scale).clip(0, 255).astype(np.uint8), "L")
            im = im.convert("RGB")
            w, h = im.size
            if resize == "crop":
                s = min(w, h)
                box = ((w - s) / 2, (h - s) / 2, (w + s) / 2, (h + s) / 2)
            else:
                box = (0, 0, w, h)
            im = im.resize((size, size), Image.Resampling.BICUBIC, box=box)
            return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1).copy()  # (H, W, 3) -> (3, H, W)
    except Exception as e:  # a broken image fails in many ways (OSError, SyntaxError, ...): one meaning to the user
        raise DataError(f"{path}: cannot decode the image ({type(e).__name__}: {e}); expected a readable "
                        f"{'/'.join(x[1:] for x in IMAGE_EXTENSIONS)} file") from None


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may use (a SLURM job's share, not the node)
    except AttributeError:
        return os.cpu_count() or 1


def convert_image_folder(src: str, out: str, size: int, resize: str = "crop", workers: int | None = None,
                         seed: int = 0, name: str | None = None, progress: bool = True, command: str = "") -> str:
    """Convert an ImageFolder tree (torchvision's layout) into the dataset file `out`; returns out.

    src: train/<class>/* and optionally val/<class>/* or test/<class>/* (the file's test split); see
    `scan_image_folder` for which files count. Classes are train's sorted subfolder names, label k = the
    k-th. size: the side of the stored square images, pixels (>= 1); resize: "crop" or "squash" (see
    `load_image`). Images are stored uint8 (N, 3, size, size), labels int64 (N,).

    The train images are put in the order `np.random.default_rng(seed).permutation(N)` of their sorted
    list before decoding, so each HDF5 chunk mixes the classes (the reader relies on it); the test split
    keeps class order. Decoding runs in `workers` processes (default: the CPUs this process may use;
    `mpiasgd.data.decoders`, multiprocessing's forkserver start method, so a script calling this needs the
    usual `if __name__ == "__main__":` guard), results in order; memory stays within one write block
    (BLOCK_BYTES) plus WINDOW_BYTES of decoded images in flight.
    name: the dataset's name (default: src's folder name). progress: a tqdm bar per split on stderr.
    command: the command line that redoes the conversion, stored in the file (see `H5Writer`).
    Raises DataError naming the file or folder for a bad tree, an undecodable image, size < 1, an unknown
    resize mode, or an output that cannot be created.
    """
    if size < 1:
        raise DataError(f"{src}: image size must be >= 1 pixel, got {size}")
    if resize not in RESIZE_MODES:
        raise DataError(f"{src}: resize must be one of {RESIZE_MODES}, got {resize!r}")
    classes, splits = scan_image_folder(src)
    paths, labels = splits["train"]
    order = np.random.default_rng(seed).permutation(len(paths))
    splits["train"] = ([paths[i] for i in order], labels[order])
    workers = max(1, min(workers or _available_cpus(), max(len(p) for p, _ in splits.values())))
    decode = functools.partial(load_image, size=size, resize=resize)
    name = name or os.path.basename(os.path.normpath(os.path.abspath(src)))
    source = f"image folder {os.path.abspath(src)} ({resize} to {size}x{size}, train shuffled with seed {seed})"
    # images a worker decodes at a time: all the workers' chunks in flight hold at most WINDOW_BYTES
    chunksize = max(1, min(64, WINDOW_BYTES // (AHEAD * workers * 3 * size * size)))
    with ExitStack() as stack:
        pool = stack.enter_context(Decoders(decode, workers)) if workers > 1 else None
        writer = stack.enter_context(H5Writer(out, name, classes, (3, size, size), source, command=command,
                                              images=sum(len(p) for p, _ in splits.values())))
        for split, (paths, labels) in splits.items():
            writer.create(split, len(paths))
            images = map(decode, paths) if pool is None else pool.imap(paths, chunksize)
            with _bar(len(paths), split, progress) as bar:
                _write_stream(writer, split, images, labels, bar)
    return out


# ---------------------------------------------------------------------------------------------- CIFAR-10


def convert_cifar10(src: str, out: str, seed: int = 0, command: str = "") -> str:
    """Convert CIFAR-10 (Krizhevsky 2009) in either official layout into the dataset file `out`; returns out.

    src: what `mpiasgd.data.cifar10.load_cifar10` accepts (a folder holding cifar-10-batches-py/ or
    cifar-10-batches-bin/, or one of those folders). The file holds train uint8 (50000, 3, 32, 32) in the
    order `np.random.default_rng(seed).permutation(50000)` of the official one, test (10000, 3, 32, 32) in
    the official order, labels int64 0..9, the official class names, name "cifar10". Both layouts of the
    same data give the same pixels, labels and statistics. Holds the whole set in memory (180 MB).
    command: as `convert_image_folder`'s. Raises DataError (from load_cifar10, or for an output that cannot be created).
    """
    ds = load_cifar10(src)
    order = np.random.default_rng(seed).permutation(len(ds.train_y))
    source = f"CIFAR-10 {ds.source} (train shuffled with seed {seed})"
    with H5Writer(out, "cifar10", ds.classes, ds.train_x.shape[1:], source, command=command,
                  images=len(order) + len(ds.test_y)) as writer:
        writer.create("train", len(order))
        block = _block(writer.image_shape, writer.chunk)
        for i in range(0, len(order), block):  # gathered a block at a time: no second copy of the set
            idx = order[i:i + block]
            writer.write("train", i, ds.train_x[idx], ds.train_y[idx])
        writer.create("test", len(ds.test_y))
        _write_array(writer, "test", ds.test_x, ds.test_y, 0)
    return out


# ---------------------------------------------------------------------------------------------- downsampled ImageNet


class BatchUnpickler(CifarUnpickler):
    """`CifarUnpickler` (numpy arrays, lists, bytes and ints only) with a message about downsampled-ImageNet
    files: any other global, e.g. `os.system`, raises DataError before it is called."""

    def find_class(self, module: str, name: str) -> object:
        try:
            return super().find_class(module, name)
        except DataError:
            raise DataError(f"refusing to unpickle the global {module}.{name}: a downsampled-ImageNet batch "
                            "holds only numpy arrays, lists and ints (not executed)") from None


def _field(obj: object, key: str, path: str) -> object:
    """obj["key"] (Python 3 pickles, npz) or obj[b"key"] (Python 2 pickles read with encoding="bytes")."""
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a pickled dict with keys 'data' and 'labels', got {type(obj).__name__}")
    for k in (key, key.encode()):
        if k in obj:
            return obj[k]
    raise DataError(f"{path}: no key '{key}' (keys: {sorted(map(repr, obj))[:8]}); expected 'data' uint8 "
                    "(n, 3*S*S) and 'labels' 1..1000")


def read_imagenet_batch(path: str, labels_only: bool = False) -> tuple[np.ndarray | None, np.ndarray]:
    """One downsampled-ImageNet file: (data uint8 (n, 3*S*S) planar RGB rows, labels int64 (n,) 0-based).

    A pickle (`train_data_batch_K`, `val_data`: a dict with str or bytes keys 'data', 'labels' 1..1000
    and, in train batches, 'mean', read with `BatchUnpickler`) or an npz (`train_data_batch_K.npz`,
    `val_data.npz`, read with np.load(allow_pickle=False)). labels_only: data is None; an npz then reads
    only its labels (its 'data' is not checked), a pickle is still read and checked whole. Labels are
    returned as label - 1. Raises DataError naming the file for an unreadable or unsafe file, wrong dtypes
    or shapes (rows not 3*S*S), or a label outside 1..1000.
    """
    try:
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:
                batch = {k: z[k] for k in ("data", "labels") if k in z.files and (k == "labels" or not labels_only)}
                if "data" not in z.files:
                    raise DataError(f"{path}: no array 'data' (arrays: {z.files}); expected 'data' uint8 (n, 3*S*S)")
        else:
            with open(path, "rb") as f:
                batch = BatchUnpickler(f).load()
    except DataError as e:
        raise DataError(str(e) if str(e).startswith(path) else f"{path}: {e}") from None
    except Exception as e:  # a corrupt pickle or zip fails in many ways; to the user they all mean one thing
        raise DataError(f"{path}: not a readable downsampled-ImageNet batch ({type(e).__name__}: {e}); expected a "
                        "pickled dict or an npz with 'data' uint8 (n, 3*S*S) and 'labels' 1..1000") from None
    try:
        labels = np.asarray(_field(batch, "labels", path))
    except (TypeError, ValueError) as e:
        raise DataError(f"{path}: 'labels' must be a list of ints 1..1000 ({e})") from None
    if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{path}: 'labels' must be a non-empty list of ints 1..1000, got {labels.dtype} {labels.shape}")
    bad = np.flatnonzero((labels < 1) | (labels > IMAGENET_CLASSES))
    if bad.size:
        raise DataError(f"{path}: row {int(bad[0])} has label {int(labels[bad[0]])}, expected 1..{IMAGENET_CLASSES}")
    labels = labels.astype(np.int64) - 1
    if labels_only and path.endswith(".npz"):
        return None, labels
    data = _field(batch, "data", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        got = f"{data.dtype} array {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: 'data' must be a uint8 array (n, 3*S*S), got {got}")
    if data.shape[0] != labels.size:
        raise DataError(f"{path}: {labels.size} labels for {data.shape[0]} rows of 'data', expected as many")
    image_side(path, data.shape[1])
    return (None if labels_only else data), labels


def image_side(path: str, row_bytes: int) -> int:
    """S from a planar RGB row of 3*S*S bytes (S = 8, 16, 32, 64, ...). Raises DataError naming the file."""
    side = round((row_bytes / 3) ** 0.5)
    if side < 1 or 3 * side * side != row_bytes:
        raise DataError(f"{path}: rows of {row_bytes} bytes are not 3*S*S planar RGB images (S = 8, 16, 32, 64 ...)")
    return side


def find_imagenet64(src: str) -> tuple[list[str], str | None, str | None]:
    """The downsampled-ImageNet files in src or its direct subfolders (as the official zips unpack).

    Returns (train batch paths in batch number order, the val_data path or None, the map_clsloc.txt path
    or None). Each name may be the pickle or the npz variant (`train_data_batch_K[.npz]`,
    `val_data[.npz]`). Raises DataError naming src when it is not a folder, holds no train batch, or holds
    a file twice (e.g. both variants of one batch, or in two subfolders).
    """
    if not os.path.isdir(src):
        what = "is not a folder" if os.path.exists(src) else "does not exist"
        raise DataError(f"downsampled-ImageNet folder {src} {what}; expected a folder holding train_data_batch_1..10 "
                        "and val_data (or their .npz variants)")
    folders = [src] + [e.path for e in _listdir(src) if e.is_dir()]
    train: dict[int, str] = {}
    val: list[str] = []
    maps: list[str] = []
    for folder in folders:
        for e in _listdir(folder):
            if not e.is_file():
                continue
            m = _TRAIN_BATCH.fullmatch(e.name)
            if m:
                k = int(m.group(1))
                if k in train:
                    raise DataError(f"{src}: train batch {k} found twice ({train[k]} and {e.path}); keep one")
                train[k] = e.path
            elif _VAL_BATCH.fullmatch(e.name):
                val.append(e.path)
            elif e.name == "map_clsloc.txt":
                maps.append(e.path)
    if not train:
        raise DataError(f"{src}: no downsampled-ImageNet train batches; expected train_data_batch_1..10 (pickles) or "
                        "train_data_batch_1..10.npz there or in a subfolder (Chrabaszcz et al. 2017)")
    for what, found in (("val_data", val), ("map_clsloc.txt", maps)):
        if len(found) > 1:
            raise DataError(f"{src}: {what} found {len(found)} times ({', '.join(found)}); keep one")
    return [train[k] for k in sorted(train)], (val[0] if val else None), (maps[0] if maps else None)


def read_clsloc(path: str) -> tuple[str, ...]:
    """The 1000 WordNet ids of ILSVRC's map_clsloc.txt ("n02119789 1 kit_fox" a line), index = label - 1.
    Raises DataError naming the file unless it lists labels 1..1000 once each."""
    wnids: dict[int, str] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) < 2 or not parts[1].isdigit() or not 1 <= int(parts[1]) <= IMAGENET_CLASSES:
                raise DataError(f"{path}: line {number} is {line.strip()!r}; expected 'WNID LABEL NAME' with LABEL "
                                f"1..{IMAGENET_CLASSES}")
            if int(parts[1]) in wnids:
                raise DataError(f"{path}: line {number}: label {parts[1]} listed twice")
            wnids[int(parts[1])] = parts[0]
    if len(wnids) != IMAGENET_CLASSES:
        raise DataError(f"{path}: lists {len(wnids)} labels; expected 1..{IMAGENET_CLASSES} once each")
    return tuple(wnids[k] for k in range(1, IMAGENET_CLASSES + 1))


def convert_imagenet64(src: str, out: str, seed: int = 0, progress: bool = True, command: str = "") -> str:
    """Convert downsampled ImageNet (Chrabaszcz, Loshchilov & Hutter 2017, arXiv 1707.08819) into `out`.

    src (or its direct subfolders) holds `train_data_batch_1..10` and `val_data` as distributed: pickled
    dicts with 'data' uint8 (n, 3*S*S), each row planar RGB (S*S red, S*S green, S*S blue, row-major),
    'labels' ints 1..1000 and, in train batches, 'mean' (not used: the file's statistics are computed);
    or the npz variant of the same names. S (8, 16, 32, 64) is read from the row length and must agree
    across files; the file is named f"imagenet{S}". Images are stored uint8 (N, 3, S, S) (a row reshapes
    straight to (3, S, S)), labels int64 label - 1 in 0..999. Class k is named "label{k+1}" (the source's
    1-based label), or, when a map_clsloc.txt (ILSVRC devkit) lies beside the batches, its WordNet id for
    label k+1. Without val_data the file holds only the train split. Whatever batch numbers are present
    are converted, in order.

    Memory: one batch file at a time (about 1.5 GB at 64x64; the whole train split is 15.7 GB). The source
    batches are already in random order; each is shuffled again with `np.random.default_rng(seed)` (one
    permutation per batch, in batch order) and written after the previous one, so chunks mix the classes
    without a global shuffle. val_data keeps its order. The row counts are needed before writing: npz
    files give them from their labels alone, pickles are read twice (once to count), so converting the
    npz variant reads about half as much. command: as `convert_image_folder`'s. Raises DataError naming the file for
    a missing, unreadable, unsafe (a pickle global other than numpy's arrays) or malformed file, or labels outside
    1..1000.
    """
    train_paths, val_path, map_path = find_imagenet64(src)
    classes = read_clsloc(map_path) if map_path else tuple(f"label{k + 1}" for k in range(IMAGENET_CLASSES))
    counts = {}
    pickles = not all(p.endswith(".npz") for p in train_paths)
    with _bar(len(train_paths) + bool(val_path), "counting rows", progress and pickles, unit="file") as bar:
        for path in [*train_paths, *([val_path] if val_path else [])]:
            counts[path] = read_imagenet_batch(path, labels_only=True)[1].size
            bar.update(1)
    rng = np.random.default_rng(seed)
    writer: H5Writer | None = None  # made once the first file gives S; closed (or, on an error, removed) by stack
    with ExitStack() as stack:
        bar = stack.enter_context(_bar(sum(counts.values()), "imagenet", progress))
        for split, paths in (("train", train_paths), ("test", [val_path] if val_path else [])):
            start = 0
            for path in paths:
                data, labels = read_imagenet_batch(path)
                if labels.size != counts[path]:
                    raise DataError(f"{path}: holds {labels.size} rows now, {counts[path]} when counted; was it "
                                    "changed during the conversion?")
                s = image_side(path, data.shape[1])
                if writer is None:
                    source = (f"downsampled ImageNet {s}x{s} (Chrabaszcz et al. 2017) {os.path.abspath(src)}: "
                              f"{len(train_paths)} train batch files{', val_data' if val_path else ''}; "
                              f"each train batch shuffled with seed {seed}")
                    writer = stack.enter_context(H5Writer(out, f"imagenet{s}", classes, (3, s, s), source,
                                                          command=command, images=sum(counts.values())))
                    writer.create("train", sum(counts[p] for p in train_paths))
                    if val_path:
                        writer.create("test", counts[val_path])
                elif (3, s, s) != writer.image_shape:
                    raise DataError(f"{path}: holds {s}x{s} images, {train_paths[0]} {writer.image_shape[1]}x"
                                    f"{writer.image_shape[2]}; expected one size across all files")
                images = data.reshape(-1, 3, s, s)  # planar rows: (n, 3*S*S) -> (n, 3, S, S), no copy
                if split == "train":
                    order = rng.permutation(labels.size)
                    block = _block(writer.image_shape, writer.chunk)
                    for i in range(0, labels.size, block):
                        idx = order[i:i + block]
                        writer.write(split, start + i, images[idx], labels[idx])
                        bar.update(idx.size)
                else:
                    _write_array(writer, split, images, labels, start, bar)
                start += labels.size
                del data, images  # this batch's 1.5 GB goes before the next is read
    return out


# ---------------------------------------------------------------------------------------------- synthetic


def synth(out: str, count: int, size: int, classes: int = 1000, test_count: int | None = None, seed: int = 0,
          progress: bool = True, command: str = "") -> str:
    """Write an ImageNet-shaped synthetic dataset (for throughput work, as Horovod's synthetic benchmarks).

    count train and test_count (default max(1, count // 50); 0: no test split) images uint8
    (n, 3, size, size), labels int64 0..classes-1: train labels a shuffled, balanced np.arange(count) %
    classes, test labels np.arange(test_count) % classes. As in `mpiasgd.data.synthetic`, class k has a
    fixed smooth template (8x8 per channel, normal(128, 48), upsampled by nearest neighbour to size x size)
    and an image is its template plus normal(0, 32) noise per pixel, clipped to 0..255, so a network can
    learn the classes. Generated and written a block (BLOCK_BYTES) at a time: any count fits in memory.
    Everything follows from `seed`. Classes are named "class0".."class{K-1}". command: as
    `convert_image_folder`'s. Raises DataError for count,
    size or classes < 1, test_count < 0, or an output that cannot be created.
    """
    test_count = max(1, count // 50) if test_count is None else test_count
    if count < 1 or size < 1 or classes < 1 or test_count < 0:
        raise DataError(f"{out}: synth needs count, size and classes >= 1 and test_count >= 0, got count {count}, "
                        f"size {size}, classes {classes}, test_count {test_count}")
    rng = np.random.default_rng(seed)
    coarse = rng.normal(128, 48, size=(classes, 3, 8, 8)).astype(np.float32)  # (K, 3, 8, 8)
    up = np.arange(size) * 8 // size  # nearest-neighbour upsampling index, any size
    splits = {"train": rng.permutation(np.arange(count) % classes).astype(np.int64)}
    if test_count:
        splits["test"] = (np.arange(test_count) % classes).astype(np.int64)
    source = (f"synthetic (mpiasgd.data.convert.synth, seed {seed}): {classes} classes, 8x8 templates + noise "
              "std 32")
    with H5Writer(out, f"synthetic{size}", [f"class{k}" for k in range(classes)], (3, size, size), source,
                  command=command, images=count + test_count) as writer, \
            _bar(count + test_count, "synth", progress) as bar:
        block = _block(writer.image_shape, writer.chunk)
        for split, labels in splits.items():
            writer.create(split, labels.size)
            for i in range(0, labels.size, block):
                y = labels[i:i + block]
                template = coarse[y][:, :, up][:, :, :, up]  # (B, 3, S, S)
                noise = rng.standard_normal(template.shape, dtype=np.float32)
                images = np.clip(template + 32 * noise, 0, 255).astype(np.uint8)
                writer.write(split, i, images, y)
                bar.update(y.size)
    return out


# ---------------------------------------------------------------------------------------------- detection, info


def detect_source(src: str) -> str:
    """Which converter `src` is for: "imagefolder" (src/train/ exists), "cifar10" (either official layout, see
    `mpiasgd.data.cifar10.find_cifar10`) or "imagenet64" (train_data_batch_K files). Raises DataError naming
    src and listing the three layouts when it is none of them."""
    if not os.path.isdir(src):
        what = "is not a folder" if os.path.exists(src) else "does not exist"
        hint = " (an archive: extract it first)" if os.path.isfile(src) else ""
        raise DataError(f"source {src} {what}{hint}; expected a folder")
    if os.path.isdir(os.path.join(src, "train")):
        return "imagefolder"
    try:
        find_cifar10(src)
        return "cifar10"
    except DataError:
        pass
    try:
        find_imagenet64(src)
        return "imagenet64"
    except DataError:
        pass
    raise DataError(f"{src}: not a dataset this converter knows; expected an image folder (train/<class>/*.jpg|png), "
                    "CIFAR-10 (cifar-10-batches-py/ or cifar-10-batches-bin/) or downsampled ImageNet "
                    "(train_data_batch_1..10, val_data)")


def info(path: str) -> str:
    """What `mpiasgd data info FILE` prints: the file's format, name, source, creation time, classes (count and
    the first few), each split's image count, shape and per-class counts, the chunk size, the file's bytes, and
    the train split's per-channel mean and std (pixel units). The file is validated by opening it with
    `H5Dataset`, so a malformed or truncated file raises its DataError (naming the file)."""
    ds = H5Dataset(path)
    try:
        a = ds.file.attrs
        shape = ds.image_shape
        lines = [
            f"{path}: {os.path.getsize(path):,} bytes, format {FORMAT}",
            f"  name     {ds.name}",
            f"  source   {a['source']}",
            f"  created  {a['created']}",
            f"  classes  {len(ds.classes)}: {', '.join(ds.classes[:8])}{', ...' if len(ds.classes) > 8 else ''}",
            f"  images   uint8 (C, H, W) = {shape}, chunks of {ds.chunk} images "
            f"({ds.chunk * int(np.prod(shape)):,} bytes; default {default_chunk(shape)})",
        ]
        for split, y in (("train", ds.train_y), ("test", ds.test_y)):
            if y.size:
                per = np.bincount(y, minlength=len(ds.classes))
                lines.append(f"  {split:<8} {y.size:,} images ({int(per.min()):,} to {int(per.max()):,} a class, "
                             f"{int(np.count_nonzero(per))} classes present)")
            else:
                lines.append(f"  {split:<8} none")
        lines.append("  mean     " + " ".join(f"{v:.2f}" for v in ds.mean) + "  (train, pixel units 0..255)")
        lines.append("  std      " + " ".join(f"{v:.2f}" for v in ds.std))
        return "\n".join(lines)
    finally:
        ds.close()
