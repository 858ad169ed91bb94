"""Tests for mpiasgd.data: digits, both CIFAR-10 layouts (tiny files written here), sharding, augmentation.

Run: .venv/bin/pytest tests/unit/test_data.py
The real-CIFAR-10 test needs shared/data/cifar10-jpg.tar.gz beside the repo (or $MPIASGD_SHARED)
and skips with a reason without it.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kit import REPO
from kit.cifar import N_PER_BATCH, N_TEST, write_bin_batch, write_py_batch

from mpiasgd.data import (
    DataError,
    ShardSampler,
    default_data_dir,
    load_dataset,
)
from mpiasgd.data.augment import crop_flip, random_crop_flip
from mpiasgd.data.cifar10 import CLASSES, load_cifar10


def test_digits_shapes_and_dtypes(digits):
    assert digits.name == "digits"
    assert digits.train_x.shape == (1437, 1, 8, 8) and digits.test_x.shape == (360, 1, 8, 8)
    assert digits.train_y.shape == (1437,) and digits.test_y.shape == (360,)
    assert digits.train_x.dtype == np.uint8 and digits.test_x.dtype == np.uint8
    assert digits.train_y.dtype == np.int64 and digits.test_y.dtype == np.int64
    assert digits.train_x.flags.c_contiguous and digits.test_x.flags.c_contiguous
    assert digits.train_x.max() == 16 and digits.test_x.max() <= 16
    assert digits.classes == tuple(str(d) for d in range(10))
    assert digits.augment is False
    assert digits.source == "sklearn.datasets.load_digits"
    assert digits.mean.dtype == np.float32 and digits.mean.shape == (1,)
    assert digits.std.dtype == np.float32 and digits.std.shape == (1,)


def test_digits_split_is_cached_and_read_back_without_sklearn(tmp_path, monkeypatch):
    """The first load writes the split to the cache; a later one reads it (scikit-learn not imported) and is
    equal to scikit-learn's split, array for array; a corrupt or unwritable cache falls back to it."""
    from mpiasgd.data import digits as digits_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = digits_mod.cache_path()
    assert path.startswith(str(tmp_path / "cache" / "mpiasgd")) and not os.path.exists(path)
    reference = digits_mod._split_with_sklearn()
    first = digits_mod.load_digits()
    assert os.path.exists(path)
    monkeypatch.setattr(digits_mod, "_split_with_sklearn", lambda: pytest.fail("imported scikit-learn again"))
    second = digits_mod.load_digits()
    for k in digits_mod.ARRAYS:
        np.testing.assert_array_equal(getattr(first, k), reference[k])
        np.testing.assert_array_equal(getattr(second, k), reference[k])
        assert getattr(second, k).dtype == reference[k].dtype
    assert second.classes == first.classes and second.source == first.source
    monkeypatch.setattr(digits_mod, "_split_with_sklearn", lambda: reference)
    good = open(path, "rb").read()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 1
    rolled = dict(reference, train_y=np.roll(reference["train_y"], 1))
    with open(tmp_path / "rolled.npz", "wb") as f:  # right shapes and dtypes, other labels, the old digest
        np.savez(f, **rolled, sha256=np.array(digits_mod._digest(reference)))
    bad_files = {"text": b"not an npz", "empty": b"", "torn": good[:len(good) // 2], "one bit": bytes(flipped),
                 "rolled labels": (tmp_path / "rolled.npz").read_bytes()}
    with open(tmp_path / "bare.npy", "wb") as f:
        np.save(f, reference["test_x"])
    bad_files["a bare .npy"] = (tmp_path / "bare.npy").read_bytes()
    for what, content in bad_files.items():  # every one is rebuilt into a cache that reads back
        with open(path, "wb") as f:
            f.write(content)
        assert digits_mod._read_cache(path) is None, what
        got = digits_mod.load_digits()
        for k in digits_mod.ARRAYS:
            np.testing.assert_array_equal(getattr(got, k), reference[k], err_msg=what)
        assert digits_mod._read_cache(path) is not None, what
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    (tmp_path / "ro").write_text("a file where the cache folder should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro"))
    np.testing.assert_array_equal(digits_mod.load_digits().train_y, reference["train_y"])


def test_digits_split_is_stratified_and_a_partition(digits):
    from sklearn.datasets import load_digits

    full = load_digits()
    all_counts = np.bincount(full.target, minlength=10)
    test_counts = np.bincount(digits.test_y, minlength=10)
    np.testing.assert_array_equal(np.bincount(digits.train_y, minlength=10) + test_counts, all_counts)
    assert np.all(np.abs(test_counts - all_counts * 360 / len(full.target)) <= 1)
    # train + test is the full set as a multiset of (image, label) rows
    rows = np.concatenate([digits.train_x.reshape(-1, 64), digits.test_x.reshape(-1, 64)]).astype(np.int64)
    rows = np.concatenate([rows, np.concatenate([digits.train_y, digits.test_y])[:, None]], axis=1)
    ref = np.concatenate([full.images.reshape(-1, 64), full.target[:, None]], axis=1).astype(np.int64)
    np.testing.assert_array_equal(np.unique(rows, axis=0), np.unique(ref, axis=0))
    assert len(rows) == len(ref)


def test_digits_is_deterministic(digits):
    again = load_dataset("digits")
    for field in ("train_x", "train_y", "test_x", "test_y", "mean", "std"):
        np.testing.assert_array_equal(getattr(digits, field), getattr(again, field))


def test_digits_mean_std_and_normalised_batch(digits):
    ref = digits.train_x.astype(np.float64)
    np.testing.assert_allclose(digits.mean, ref.mean(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(digits.std, ref.std(axis=(0, 2, 3)), rtol=1e-6)
    idx = np.array([5, 0, 1436, 5])
    x, y = digits.batch("train", idx, np.random.default_rng(0))  # augment False: rng changes nothing
    assert x.dtype == np.float32 and x.shape == (4, 1, 8, 8) and x.flags.c_contiguous
    np.testing.assert_allclose(x, (ref[idx] - digits.mean[0]) / digits.std[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(y, digits.train_y[idx])
    assert y.dtype == np.int64
    full, _ = digits.batch("train", np.arange(1437))
    np.testing.assert_allclose(full.mean(), 0, atol=1e-5)
    np.testing.assert_allclose(full.std(), 1, atol=1e-5)


def test_dataset_arrays_are_read_only(digits):
    with pytest.raises(ValueError):
        digits.train_x[0, 0, 0, 0] = 1


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(DataError, match=r"digits.*cifar10"):
        load_dataset("mnist")


def test_batch_rejects_bad_split(digits):
    with pytest.raises(ValueError, match="'train' or 'test'"):
        digits.batch("val", np.arange(3))


def test_batch_of_no_indices(digits):
    x, y = digits.batch("test", [])
    assert x.shape == (0, 1, 8, 8) and y.shape == (0,)


def test_both_layouts_give_the_arrays_written(tiny_cifar):
    root, (train_x, train_y, test_x, test_y) = tiny_cifar
    for layout in ("cifar-10-batches-py", "cifar-10-batches-bin"):
        ds = load_cifar10(str(root / layout))
        np.testing.assert_array_equal(ds.train_x, train_x)
        np.testing.assert_array_equal(ds.train_y, train_y)
        np.testing.assert_array_equal(ds.test_x, test_x)
        np.testing.assert_array_equal(ds.test_y, test_y)
        assert ds.train_x.dtype == np.uint8 and ds.train_x.flags.c_contiguous
        assert ds.train_y.dtype == np.int64
        assert ds.classes == tuple(f"class{k}" for k in range(10))
        assert ds.augment is True and ds.name == "cifar10"
        assert ds.source == str(root / layout)
        np.testing.assert_allclose(ds.mean, train_x.mean(axis=(0, 2, 3)), rtol=1e-6)
        np.testing.assert_allclose(ds.std, train_x.std(axis=(0, 2, 3)), rtol=1e-6)


def test_directory_may_be_parent_or_layout_folder(tiny_cifar, monkeypatch):
    root, (train_x, *_) = tiny_cifar
    assert load_dataset("cifar10", str(root)).source == str(root / "cifar-10-batches-py")  # py wins
    monkeypatch.setenv("MPIASGD_DATA", str(root))
    assert default_data_dir() == str(root)
    assert load_dataset("cifar10").source == str(root / "cifar-10-batches-py")
    (root / "cifar-10-batches-py").rename(root / "my-cifar")  # recognised by its files, not its name
    np.testing.assert_array_equal(load_dataset("cifar10", str(root / "my-cifar")).train_x, train_x)
    ds = load_dataset("cifar10", str(root))  # only bin left in the parent
    assert ds.source == str(root / "cifar-10-batches-bin")
    np.testing.assert_array_equal(ds.train_x, train_x)


def test_default_data_dir_without_env(monkeypatch):
    monkeypatch.delenv("MPIASGD_DATA", raising=False)
    assert default_data_dir() == os.path.join(os.path.expanduser("~"), ".cache", "mpiasgd")


def test_classes_fall_back_to_official_list(tiny_cifar):
    root, _ = tiny_cifar
    (root / "cifar-10-batches-py" / "batches.meta").unlink()
    (root / "cifar-10-batches-bin" / "batches.meta.txt").unlink()
    for layout in ("cifar-10-batches-py", "cifar-10-batches-bin"):
        assert load_cifar10(str(root / layout)).classes == CLASSES


def test_missing_folder_says_where_and_how(tmp_path):
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", str(tmp_path / "nowhere"))
    assert str(tmp_path / "nowhere") in str(err.value) and "cifar-10-batches-py" in str(err.value)
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"")
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "cifar-10-batches-bin" in msg and "https://" in msg
    assert "cifar-10-python.tar.gz, not extracted" in msg


@pytest.mark.parametrize("layout,suffix", [("cifar-10-batches-py", ""), ("cifar-10-batches-bin", ".bin")])
def test_missing_batch_names_the_file(tiny_cifar, layout, suffix):
    root, _ = tiny_cifar
    (root / layout / f"data_batch_3{suffix}").unlink()
    with pytest.raises(DataError, match=f"data_batch_3{suffix} is missing"):
        load_cifar10(str(root / layout))


def test_truncated_bin_names_the_file_and_sizes(tiny_cifar):
    root, _ = tiny_cifar
    path = root / "cifar-10-batches-bin" / "data_batch_2.bin"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"data_batch_2\.bin: size 61360 bytes is not a positive multiple of 3073"):
        load_cifar10(str(root / "cifar-10-batches-bin"))


def test_label_out_of_range_names_file_record_and_value(tiny_cifar):
    root, (train_x, train_y, *_) = tiny_cifar
    y = train_y[:N_PER_BATCH].copy()
    y[7] = 10
    write_bin_batch(root / "cifar-10-batches-bin" / "data_batch_1.bin", train_x[:N_PER_BATCH], y)
    write_py_batch(root / "cifar-10-batches-py" / "data_batch_1", train_x[:N_PER_BATCH], y)
    for layout, name in (("cifar-10-batches-bin", "data_batch_1.bin"), ("cifar-10-batches-py", "data_batch_1")):
        with pytest.raises(DataError, match=f"{name}: record 7 has label 10, expected 0..9"):
            load_cifar10(str(root / layout))


def test_pickle_with_wrong_data_shape(tiny_cifar):
    root, _ = tiny_cifar
    path = root / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(pickle.dumps({b"data": np.zeros((N_TEST, 3000), np.uint8), b"labels": [0] * N_TEST}))
    expected = r"test_batch: b'data' must be a uint8 array \(n, 3072\), got uint8 array \(10, 3000\)"
    with pytest.raises(DataError, match=expected):
        load_cifar10(str(root))


def test_pickle_label_count_mismatch(tiny_cifar):
    root, (train_x, *_) = tiny_cifar
    path = root / "cifar-10-batches-py" / "data_batch_4"
    path.write_bytes(pickle.dumps({b"data": train_x[:N_PER_BATCH].reshape(N_PER_BATCH, -1), b"labels": [1, 2]}))
    with pytest.raises(DataError, match="data_batch_4: 2 labels for 20 images"):
        load_cifar10(str(root))


class _RunsShell:
    """Pickles as a call to os.system: what a malicious batch file would contain."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_pickle_with_disallowed_global_is_refused_not_executed(tiny_cifar):
    root, _ = tiny_cifar
    marker = root / "pwned"
    path = root / "cifar-10-batches-py" / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _RunsShell(f"touch {marker}"), b"labels": []}, protocol=2))
    with pytest.raises(DataError, match=r"data_batch_1: refusing to unpickle the global \w+\.system"):
        load_cifar10(str(root))
    assert not marker.exists()


def test_pickle_with_object_dtype_is_refused(tiny_cifar):
    root, _ = tiny_cifar
    path = root / "cifar-10-batches-py" / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": np.array([1, "a"], dtype=object), b"labels": [0, 0]}, protocol=2))
    with pytest.raises(DataError, match="data_batch_1: refusing to unpickle an object dtype"):
        load_cifar10(str(root))


def test_pickle_codecs_encode_only_latin1(tiny_cifar):
    root, _ = tiny_cifar
    path = root / "cifar-10-batches-py" / "test_batch"
    payload = pickle.dumps({b"data": b"\xff"}, protocol=2)  # bytes travel as _codecs.encode(str, 'latin1')
    assert b"_codecs\nencode" in payload and b"latin1" in payload
    path.write_bytes(payload.replace(b"latin1", b"rot_13"))
    with pytest.raises(DataError, match=r"test_batch: refusing _codecs\.encode"):
        load_cifar10(str(root))


@pytest.mark.parametrize("content", [b"", b"\x80\x02}q\x00(X", b"not a pickle at all", pickle.dumps([1, 2, 3])])
def test_corrupt_pickle_names_the_file(tiny_cifar, content):
    root, _ = tiny_cifar
    (root / "cifar-10-batches-py" / "data_batch_5").write_bytes(content)
    with pytest.raises(DataError, match="data_batch_5: "):
        load_cifar10(str(root))


def test_numpy1_global_name_of_official_files_is_accepted(tiny_cifar):
    """The official pickles name numpy.core.multiarray._reconstruct; numpy 2 writes numpy._core."""
    root, (train_x, *_) = tiny_cifar
    path = root / "cifar-10-batches-py" / "data_batch_1"
    payload = path.read_bytes()
    if b"numpy._core.multiarray\n_reconstruct" in payload:
        payload = payload.replace(b"numpy._core.multiarray\n_reconstruct", b"numpy.core.multiarray\n_reconstruct")
    assert b"numpy.core.multiarray\n_reconstruct" in payload
    path.write_bytes(payload)
    ds = load_cifar10(str(root))
    np.testing.assert_array_equal(ds.train_x, train_x)


def test_str_keys_numpy_int_labels_and_protocol_5_are_accepted(tiny_cifar):
    root, (train_x, train_y, *_) = tiny_cifar
    path = root / "cifar-10-batches-py" / "data_batch_1"
    batch = {"data": train_x[:N_PER_BATCH].reshape(N_PER_BATCH, -1), "labels": list(train_y[:N_PER_BATCH])}
    path.write_bytes(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
    np.testing.assert_array_equal(load_cifar10(str(root)).train_y, train_y)


def test_bad_meta_names_the_file(tiny_cifar):
    root, _ = tiny_cifar
    (root / "cifar-10-batches-bin" / "batches.meta.txt").write_text("a\nb\n")
    with pytest.raises(DataError, match=r"batches\.meta\.txt: expected 10 class names, found 2"):
        load_cifar10(str(root / "cifar-10-batches-bin"))


# ------------------------------------------------------------------------- real CIFAR-10 (optional)


def shared_dir() -> Path:
    return Path(os.environ.get("MPIASGD_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="module")
def real_cifar_dir(tmp_path_factory) -> Path:
    """A folder holding both layouts written by shared/tools/cifar10_batches.py (reused when present)."""
    done = Path(default_data_dir())
    if all((done / d / ".complete").is_file() for d in ("cifar-10-batches-py", "cifar-10-batches-bin")):
        return done  # the converter's own output, written earlier
    archive = shared_dir() / "data" / "cifar10-jpg.tar.gz"
    if not archive.is_file():
        pytest.skip(f"real CIFAR-10 not available: neither {done} nor {archive} "
                    "(set MPIASGD_DATA to a converted copy, or MPIASGD_SHARED to the shared/ folder)")
    if importlib.util.find_spec("PIL") is None:
        pytest.skip("real CIFAR-10 needs pillow to decode the JPEG archive")
    out = tmp_path_factory.mktemp("cifar10")
    tool = shared_dir() / "tools" / "cifar10_batches.py"
    proc = subprocess.run(
        [sys.executable, str(tool), str(out)], capture_output=True, text=True, timeout=600, check=False
    )
    if proc.returncode:
        pytest.fail(f"{tool} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return out


def test_real_cifar10_both_layouts(real_cifar_dir):
    py = load_cifar10(str(real_cifar_dir / "cifar-10-batches-py"))
    bn = load_cifar10(str(real_cifar_dir / "cifar-10-batches-bin"))
    assert py.train_x.shape == (50000, 3, 32, 32) and py.test_x.shape == (10000, 3, 32, 32)
    np.testing.assert_array_equal(np.bincount(py.train_y, minlength=10), [5000] * 10)
    np.testing.assert_array_equal(np.bincount(py.test_y, minlength=10), [1000] * 10)
    np.testing.assert_allclose(py.mean, np.array([0.491, 0.482, 0.447]) * 255, atol=1.0)
    assert py.classes == CLASSES
    for field in ("train_x", "train_y", "test_x", "test_y", "mean", "std"):
        assert np.array_equal(getattr(py, field), getattr(bn, field)), field  # assert_array_equal: 1 s


# -------------------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("num_samples,num_shards", [(1, 1), (7, 7), (10, 3), (101, 5), (1437, 4)])
def test_shards_are_disjoint_covering_and_balanced(num_samples, num_shards):
    shards = [ShardSampler(num_samples, num_shards, s, seed=3) for s in range(num_shards)]
    for epoch in (0, 1, 5):
        parts = [s.indices(epoch) for s in shards]
        assert all(p.dtype == np.int64 for p in parts)
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(num_samples))
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == [len(s) for s in shards]
        # the same samples every epoch, only their order changes
        for s, p in zip(shards, parts, strict=True):
            np.testing.assert_array_equal(np.sort(p), np.sort(s.indices(0)))


def test_order_reshuffled_each_epoch_and_deterministic():
    a, b = ShardSampler(1000, 3, 1, seed=7), ShardSampler(1000, 3, 1, seed=7)
    orders = [a.indices(e) for e in range(4)]
    for e in range(4):
        np.testing.assert_array_equal(orders[e], b.indices(e))
    assert all(not np.array_equal(orders[i], orders[j]) for i in range(4) for j in range(i))
    other_seed = ShardSampler(1000, 3, 1, seed=8)
    assert set(other_seed.indices(0)) != set(orders[0])
    # documented recipe
    perm = np.random.default_rng(7).permutation(1000)[1::3]
    np.testing.assert_array_equal(orders[2], perm[np.random.default_rng((7, 2, 1)).permutation(len(perm))])


@pytest.mark.parametrize(
    "args,message",
    [
        ((10, 0, 0, 0), "num_shards must be >= 1"),
        ((10, 2, 2, 0), r"shard must be in 0\.\.1"),
        ((10, 2, -1, 0), r"shard must be in 0\.\.1"),
        ((3, 5, 0, 0), r"more workers \(5\) than samples \(3\)"),
        ((10, 2, 0, -1), "seed must be >= 0"),
    ],
)
def test_sampler_errors(args, message):
    with pytest.raises(DataError, match=message):
        ShardSampler(*args)


def test_sampler_negative_epoch():
    with pytest.raises(DataError, match="epoch must be >= 0"):
        ShardSampler(10, 2, 0, 0).indices(-1)


# ------------------------------------------------------------------------------------ augmentation


def coordinate_images(n: int, h: int = 32, w: int = 32) -> np.ndarray:
    """n identical 3-channel images whose pixel (r, c) holds 1 + r*w + c: every value names its source."""
    img = (1 + np.arange(h * w, dtype=np.float32)).reshape(h, w)
    return np.broadcast_to(img, (n, 3, h, w)).copy()


def test_crop_flip_exact_cases():
    x = coordinate_images(4, 8, 8)
    top, left = np.array([4, 0, 8, 4]), np.array([4, 4, 2, 4])
    out = crop_flip(x, top, left, flip=np.array([0, 0, 0, 1], bool), pad=4)
    assert out.shape == x.shape and out.dtype == x.dtype and out.flags.c_contiguous
    np.testing.assert_array_equal(out[0], x[0])  # centre crop: identity
    np.testing.assert_array_equal(out[1, :, :4], 0)  # shifted down by 4: zero rows on top
    np.testing.assert_array_equal(out[1, :, 4:], x[1, :, :4])
    np.testing.assert_array_equal(out[2, :, :4, 2:], x[2, :, 4:, :6])  # up by 4, right by 2
    np.testing.assert_array_equal(out[2, :, 4:], 0)
    np.testing.assert_array_equal(out[2, :, :, :2], 0)
    np.testing.assert_array_equal(out[3], x[3, :, :, ::-1])  # flip actually mirrors columns


def test_random_crop_flip_shifts_within_pad_and_flips_half():
    n, pad = 600, 4
    x = coordinate_images(n)
    out = random_crop_flip(x, np.random.default_rng(5), pad=pad)
    assert out.shape == (n, 3, 32, 32) and out.dtype == np.float32 and out.flags.c_contiguous
    # recover each image's crop from the centre pixel, which any shift of <= 4 keeps inside the image
    src = out[:, 0, 16, 16].astype(np.int64) - 1
    r, c = src // 32, src % 32
    flipped = (out[:, 0, 16, 17].astype(np.int64) - 1) % 32 == c - 1
    top = r - 16 + pad
    left = np.where(flipped, c - 15 + pad, c - 16 + pad)
    assert top.min() == 0 and top.max() == 2 * pad and left.min() == 0 and left.max() == 2 * pad
    assert 0.4 < flipped.mean() < 0.6
    np.testing.assert_array_equal(out, crop_flip(x, top, left, flipped, pad))


def test_augmented_batch_is_deterministic_given_rng(tiny_cifar):
    root, _ = tiny_cifar
    ds = load_cifar10(str(root))
    idx = np.arange(0, 100, 3)
    x1, y1 = ds.batch("train", idx, np.random.default_rng(11))
    x2, y2 = ds.batch("train", idx, np.random.default_rng(11))
    x3, _ = ds.batch("train", idx, np.random.default_rng(12))
    plain, _ = ds.batch("train", idx)
    assert x1.shape == (len(idx), 3, 32, 32) and x1.dtype == np.float32 and x1.flags.c_contiguous
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(y1, ds.train_y[idx])
    assert not np.array_equal(x1, x3) and not np.array_equal(x1, plain)
    expected = (ds.train_x[idx].astype(np.float32) - ds.mean[:, None, None]) / ds.std[:, None, None]
    np.testing.assert_allclose(plain, expected, rtol=1e-6, atol=1e-6)


def test_test_split_is_never_augmented(tiny_cifar):
    root, _ = tiny_cifar
    ds = load_cifar10(str(root))
    idx = np.arange(N_TEST)
    x, y = ds.batch("test", idx, np.random.default_rng(0))
    expected = (ds.test_x.astype(np.float32) - ds.mean[:, None, None]) / ds.std[:, None, None]
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(y, ds.test_y)


def test_synthetic_datasets_are_generated_the_same_on_every_call():
    """synthetic64: 3x64x64 uint8 images of 1000 classes, class template plus noise, identical on every rank."""
    from mpiasgd.data.synthetic import SIZES, load_synthetic

    assert SIZES["synthetic64"] == (64, 12800, 1000)
    a, b = load_synthetic("synthetic64"), load_synthetic("synthetic64")
    assert a.train_x.shape == (12800, 3, 64, 64) and a.test_x.shape == (1000, 3, 64, 64)
    assert a.train_x.dtype == np.uint8 and len(a.classes) == 1000 and a.augment
    np.testing.assert_array_equal(a.train_x[:50], b.train_x[:50])
    np.testing.assert_array_equal(a.test_y, b.test_y)
    assert 0 <= a.train_y.min() and a.train_y.max() <= 999
    # images of one class are closer to each other than to another class's (the classes are learnable)
    x = a.train_x.astype(np.float32).reshape(12800, -1)
    c = a.train_y[0]
    same = np.flatnonzero(a.train_y == c)[1:4]
    other = np.flatnonzero(a.train_y != c)[:3]
    d_same = np.linalg.norm(x[same] - x[0], axis=1).mean()
    d_other = np.linalg.norm(x[other] - x[0], axis=1).mean()
    assert d_same < 0.8 * d_other
