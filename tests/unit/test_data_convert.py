"""Tests for mpiasgd.data.convert and `mpiasgd data`: image folders (made here with Pillow), both CIFAR-10
layouts, downsampled-ImageNet pickles and npz files (S = 8), synthetic sets, `info`, and the command line.

Run: .venv/bin/pytest tests/unit/test_data_convert.py   (about 10 s; one test starts 2 decoding processes)
"""

from __future__ import annotations

import os
import pickle

import h5py
import numpy as np
import pytest
from PIL import Image

from mpiasgd.cli import main
from mpiasgd.data import convert
from mpiasgd.data.dataset import DataError
from mpiasgd.data.h5data import H5Dataset

# class -> the colour of the centred square of each of its images (sorted names: labels 0, 1, 2)
COLOURS = {"blue": (30, 40, 210), "grey": (128, 128, 128), "red": (200, 30, 30)}
CLASSES = tuple(sorted(COLOURS))
SIZE = 8  # side of the stored images in these tests


def picture(colour: tuple[int, ...], w: int, h: int) -> np.ndarray:
    """(h, w, len(colour)) uint8: black bars on the long sides, the centred min(w, h) square in `colour`."""
    s = min(w, h)
    x = np.zeros((h, w, len(colour)), np.uint8)
    top, left = (h - s) // 2, (w - s) // 2
    x[top:top + s, left:left + s] = colour
    return x


def make_tree(root, val: bool = True) -> dict[str, list[str]]:
    """An ImageFolder tree: 4 train images a class (png and jpg, non-square, one grey 'L', one RGBA, one palette
    with transparency, an upper-case .JPG) plus a text file to ignore; val/ has blue and red only."""
    sizes = [(48, 24), (20, 36), (30, 30), (41, 19)]
    made = {}
    for split, count in (("train", 4), *((("val", 2),) if val else ())):
        for name, colour in COLOURS.items():
            if split == "val" and name == "grey":
                continue
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                w, h = sizes[i]
                if name == "grey" and i == 0:
                    im = Image.fromarray(picture((128,), w, h)[:, :, 0], "L")
                elif name == "red" and i == 1:
                    im = Image.fromarray(picture((*colour, 90), w, h), "RGBA")  # alpha dropped on conversion
                elif name == "blue" and i == 2:
                    im = Image.fromarray(picture(colour, w, h)).convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
                    im.info["transparency"] = 0
                else:
                    im = Image.fromarray(picture(colour, w, h))
                ext = ".png" if i % 2 == 0 or im.mode in ("RGBA", "P") else (".JPG" if i == 3 else ".jpg")
                kw = {"quality": 98} if ext.lower() == ".jpg" else {}
                im.save(folder / f"img{i}{ext}", **kw)
            made.setdefault(split, []).append(name)
    (root / "train" / "red" / "notes.txt").write_text("not an image")
    return made


def read(path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        out = {f"{s}/{k}": f[s][k][...] for s in ("train", "test") if s in f for k in ("images", "labels")}
        out.update({k: f.attrs[k] for k in ("mean", "std", "pixel_cov")})
        out["classes"] = f.attrs["classes"]
        return out


def test_image_folder_counts_classes_colours_and_order(tmp_path, monkeypatch):
    make_tree(tmp_path / "src")
    monkeypatch.setattr(convert, "_block", lambda shape, chunk: 5)  # several writes per split
    out = convert.convert_image_folder(str(tmp_path / "src"), str(tmp_path / "a.h5"), SIZE, workers=1,
                                       progress=False)
    ds = H5Dataset(out)
    assert ds.classes == CLASSES and ds.name == "src" and ds.image_shape == (3, SIZE, SIZE)
    assert ds.num_train == 12 and ds.num_test == 4  # notes.txt ignored, img3.JPG counted; val/ -> test
    assert np.bincount(ds.train_y).tolist() == [4, 4, 4] and ds.test_y.tolist() == [0, 0, 2, 2]  # class order
    for split, y in (("train", ds.train_y), ("test", ds.test_y)):
        x = ds.images(split, np.arange(y.size)).astype(int)  # (n, 3, 8, 8)
        want = np.array([COLOURS[CLASSES[k]] for k in y])[:, :, None, None]
        inner = x[:, :, 2:-2, 2:-2]  # the centred square, beyond the reach of the bicubic filter into the bars
        assert np.abs(inner - want).max() <= 4, np.abs(inner - want).max()  # JPEG q98: a level or two
    ds.close()
    order = np.random.default_rng(0).permutation(12)  # the files' sorted order: 4 blue, 4 grey, 4 red
    assert ds.train_y.tolist() == (order // 4).tolist() and ds.train_y.tolist() != sorted(ds.train_y.tolist())

    squash = read(convert.convert_image_folder(str(tmp_path / "src"), str(tmp_path / "s.h5"), SIZE,
                                               resize="squash", workers=1, progress=False))
    wide = np.flatnonzero(order % 4 == 0)  # img0: 48x24, black bars a quarter of the width on either side
    assert squash["train/images"][wide][:, :, :, 0].max() <= 12  # squashed: the left column stays black
    assert squash["train/images"][wide][:, :, 4, 4].min() >= 25  # ... and the centre is the class colour


def test_image_folder_is_deterministic_per_seed_and_in_parallel(tmp_path, monkeypatch):
    make_tree(tmp_path / "src", val=False)
    monkeypatch.setattr(convert, "WINDOW_BYTES", 3 * SIZE * SIZE)  # 1-image chunks, to the workers in turn
    src = str(tmp_path / "src")
    one = read(convert.convert_image_folder(src, str(tmp_path / "1.h5"), SIZE, workers=1, progress=False))
    two = read(convert.convert_image_folder(src, str(tmp_path / "2.h5"), SIZE, workers=2, progress=False))
    other = read(convert.convert_image_folder(src, str(tmp_path / "3.h5"), SIZE, workers=1, seed=5,
                                              progress=False))
    for key in ("train/images", "train/labels", "mean", "std"):
        np.testing.assert_array_equal(one[key], two[key])
    assert "test/images" not in one  # no val/ or test/: a train-only file
    assert not np.array_equal(one["train/labels"], other["train/labels"])
    assert np.array_equal(np.sort(one["train/labels"]), np.sort(other["train/labels"]))


def test_broken_image_folders_each_name_what_is_wrong(tmp_path):
    def fails(src, match, **kw):
        out = tmp_path / "out.h5"
        with pytest.raises(DataError, match=match):
            convert.convert_image_folder(str(src), str(out), kw.pop("size", SIZE), workers=kw.pop("workers", 1),
                                         progress=False, **kw)
        assert not out.exists() and not (tmp_path / "out.h5.partial").exists()

    fails(tmp_path / "nowhere", r"nowhere does not exist")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"")
    fails(tmp_path / "flat", r"flat: no train/ folder")
    make_tree(tmp_path / "t")
    fails(tmp_path / "t", r"image size must be >= 1", size=0)
    fails(tmp_path / "t", r"resize must be one of", resize="stretch")
    (tmp_path / "t" / "val" / "cat").mkdir()
    Image.new("RGB", (9, 9)).save(tmp_path / "t" / "val" / "cat" / "c.png")
    fails(tmp_path / "t", r"val: class folder 'cat' is not among the 3 classes")
    (tmp_path / "t" / "val" / "cat" / "c.png").unlink()
    (tmp_path / "t" / "val" / "cat").rmdir()
    (tmp_path / "t" / "test").mkdir()
    fails(tmp_path / "t", r"both val/ and test/")
    (tmp_path / "t" / "test").rmdir()
    bad = tmp_path / "t" / "train" / "grey" / "img9.jpg"
    bad.write_bytes(b"\xff\xd8\xff not really a JPEG")
    fails(tmp_path / "t", rf"{bad}: cannot decode the image", workers=2)  # raised in a worker, re-raised here
    bad.unlink()
    (tmp_path / "t" / "train" / "zebra").mkdir()
    (tmp_path / "t" / "train" / "zebra" / "readme.md").write_text("")
    fails(tmp_path / "t", r"train/zebra: no images; expected files ending in \.jpg")


def test_cifar10_both_layouts_give_the_same_file(tiny_cifar, tmp_path):
    root, (train_x, train_y, test_x, test_y) = tiny_cifar
    files = [read(convert.convert_cifar10(str(root / layout), str(tmp_path / f"{layout}.h5")))
             for layout in ("cifar-10-batches-py", "cifar-10-batches-bin")]
    order = np.random.default_rng(0).permutation(len(train_y))
    for f in files:
        np.testing.assert_array_equal(f["train/images"], train_x[order])
        np.testing.assert_array_equal(f["train/labels"], train_y[order])
        np.testing.assert_array_equal(f["test/images"], test_x)
        np.testing.assert_array_equal(f["test/labels"], test_y)
        np.testing.assert_allclose(f["mean"], train_x.mean(axis=(0, 2, 3)), rtol=1e-6)
        np.testing.assert_allclose(f["std"], train_x.std(axis=(0, 2, 3)), rtol=1e-5)
    for key in files[0]:
        np.testing.assert_array_equal(files[0][key], files[1][key])
    assert H5Dataset(str(tmp_path / "cifar-10-batches-bin.h5")).classes == tuple(f"class{k}" for k in range(10))


def write_imagenet(folder, counts=(120, 100, 80), val=50, side=8, npz=False, seed=3, bytes_keys=False):
    """Downsampled-ImageNet files as distributed (pickled dicts, str keys) or their npz variant; returns
    [(data uint8 (n, 3*S*S), labels 1..1000)] for each train batch, then val."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for k, n in enumerate((*counts, val)):
        data = rng.integers(0, 256, size=(n, 3 * side * side), dtype=np.uint8)
        labels = rng.integers(1, 1001, size=n)
        labels[:2] = (1, 1000)
        name = f"train_data_batch_{k + 1}" if k < len(counts) else "val_data"
        batch = {"data": data, "labels": [int(v) for v in labels]}
        if k < len(counts):
            batch["mean"] = data.mean(axis=0)
        if npz:
            np.savez(folder / f"{name}.npz", **{**batch, "labels": labels})
        else:
            if bytes_keys:
                batch = {key.encode(): v for key, v in batch.items()}
            (folder / name).write_bytes(pickle.dumps(batch, protocol=4))
        made.append((data, labels))
    return made


def expected_imagenet(made, side=8, seed=0):
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for data, labels in made[:-1]:
        p = rng.permutation(len(labels))
        xs.append(data[p].reshape(-1, 3, side, side))
        ys.append(labels[p] - 1)
    return np.concatenate(xs), np.concatenate(ys), made[-1][0].reshape(-1, 3, side, side), made[-1][1] - 1


@pytest.mark.parametrize("variant", ["pickle", "npz"])
def test_imagenet64_batches_become_one_shuffled_file(tmp_path, monkeypatch, variant):
    made = write_imagenet(tmp_path / "src" / "Imagenet8_train", npz=variant == "npz")  # a subfolder, as unzipped
    monkeypatch.setattr(convert, "_block", lambda shape, chunk: 7)
    out = convert.convert_imagenet64(str(tmp_path / "src"), str(tmp_path / "i.h5"), progress=False)
    f = read(out)
    train_x, train_y, val_x, val_y = expected_imagenet(made)
    np.testing.assert_array_equal(f["train/images"], train_x)
    np.testing.assert_array_equal(f["train/labels"], train_y)
    np.testing.assert_array_equal(f["test/images"], val_x)
    np.testing.assert_array_equal(f["test/labels"], val_y)
    ds = H5Dataset(out)
    assert ds.name == "imagenet8" and ds.image_shape == (3, 8, 8) and (ds.num_train, ds.num_test) == (300, 50)
    assert len(ds.classes) == 1000 and ds.classes[:2] == ("label1", "label2") and train_y.min() == 0
    assert train_y.max() == 999
    ds.close()


def test_imagenet64_class_names_bytes_keys_and_bad_files(tmp_path):
    src = tmp_path / "src"
    made = write_imagenet(src, counts=(40, 30), val=20, bytes_keys=True)  # a Python 2 style pickle
    wnids = [f"n{10000000 + 7 * k:08d}" for k in range(1000)]
    lines = [f"{wnids[k]} {k + 1} name_{k}" for k in np.random.default_rng(0).permutation(1000)]  # any line order
    (src / "map_clsloc.txt").write_text("\n".join(lines) + "\n")
    out = convert.convert_imagenet64(str(src), str(tmp_path / "i.h5"), seed=4, progress=False)
    ds = H5Dataset(out)
    assert ds.classes == tuple(wnids)
    np.testing.assert_array_equal(ds.train_y, expected_imagenet(made, seed=4)[1])
    ds.close()

    def fails(match):
        with pytest.raises(DataError, match=match):
            convert.convert_imagenet64(str(src), str(tmp_path / "bad.h5"), progress=False)
        assert not (tmp_path / "bad.h5").exists() and not (tmp_path / "bad.h5.partial").exists()

    (src / "map_clsloc.txt").write_text("\n".join(lines[:999]) + "\n")
    fails(r"map_clsloc.txt: lists 999 labels")
    (src / "map_clsloc.txt").unlink()
    batch = pickle.loads((src / "train_data_batch_2").read_bytes())
    batch[b"labels"][5] = 0
    (src / "train_data_batch_2").write_bytes(pickle.dumps(batch))
    fails(r"train_data_batch_2: row 5 has label 0, expected 1..1000")
    batch[b"labels"][5] = 1
    batch[b"data"] = np.zeros((30, 3 * 16 * 16), np.uint8)  # 16x16 beside 8x8
    (src / "train_data_batch_2").write_bytes(pickle.dumps(batch))
    fails(r"train_data_batch_2: holds 16x16 images, .*train_data_batch_1 8x8")
    batch[b"data"] = np.zeros((30, 100), np.uint8)
    (src / "train_data_batch_2").write_bytes(pickle.dumps(batch))
    fails(r"train_data_batch_2: rows of 100 bytes are not 3\*S\*S")
    np.savez(src / "train_data_batch_2.npz", data=batch[b"data"], labels=np.ones(30, int))
    fails(r"train batch 2 found twice")
    (src / "train_data_batch_2.npz").unlink()
    (src / "train_data_batch_2").write_bytes(b"\x80\x04garbage")
    fails(r"train_data_batch_2: not a readable downsampled-ImageNet batch")
    for f in src.iterdir():
        f.unlink()
    fails(r"src: no downsampled-ImageNet train batches")


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_with_a_foreign_global_is_refused_unexecuted(tmp_path):
    marker = tmp_path / "pwned"
    src = tmp_path / "src"
    write_imagenet(src, counts=(10,), val=5)
    (src / "train_data_batch_1").write_bytes(pickle.dumps({"data": Exploit(marker), "labels": [1]}))
    with pytest.raises(DataError, match=r"train_data_batch_1: refusing to unpickle the global (posix|os)\.system"):
        convert.convert_imagenet64(str(src), str(tmp_path / "x.h5"), progress=False)
    assert not marker.exists()
    assert main(["data", "convert", str(src), str(tmp_path / "x.h5"), "--no-progress"]) == 2
    assert not marker.exists() and not (tmp_path / "x.h5").exists()


def test_synth_counts_shapes_and_learnable_classes(tmp_path, monkeypatch):
    monkeypatch.setattr(convert, "_block", lambda shape, chunk: 64)
    out = convert.synth(str(tmp_path / "s.h5"), count=400, size=12, classes=5, seed=1, progress=False)
    f = read(out)
    assert f["train/images"].shape == (400, 3, 12, 12) and f["test/images"].shape == (8, 3, 12, 12)  # 400 // 50
    assert np.bincount(f["train/labels"]).tolist() == [80] * 5 and f["test/labels"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert f["train/labels"][:10].tolist() != sorted(f["train/labels"][:10].tolist())
    x = f["train/images"].reshape(400, -1).astype(np.float64)
    centroids = np.stack([x[f["train/labels"] == k].mean(axis=0) for k in range(5)])  # (5, 432)
    assert np.abs(centroids[:, None] - centroids[None]).mean(axis=2)[~np.eye(5, dtype=bool)].min() > 20
    t = f["test/images"].reshape(8, -1).astype(np.float64)
    nearest = ((t[:, None] - centroids[None]) ** 2).sum(axis=2).argmin(axis=1)  # nearest class mean
    assert nearest.tolist() == f["test/labels"].tolist()
    again = read(convert.synth(str(tmp_path / "t.h5"), count=400, size=12, classes=5, seed=1, progress=False))
    np.testing.assert_array_equal(again["train/images"], f["train/images"])
    assert "test/images" not in read(convert.synth(str(tmp_path / "u.h5"), 10, 4, 2, test_count=0, progress=False))
    with pytest.raises(DataError, match=r"count, size and classes >= 1"):
        convert.synth(str(tmp_path / "v.h5"), count=10, size=0, progress=False)


def test_info_prints_the_counts_and_a_truncated_file_fails(tiny_cifar, tmp_path):
    root, _ = tiny_cifar
    out = convert.convert_cifar10(str(root), str(tmp_path / "c.h5"))
    text = convert.info(out)
    assert f"{out}: {os.path.getsize(out):,} bytes, format mpiasgd.data/1" in text
    assert "name     cifar10" in text and "classes  10: class0, class1" in text
    assert "train    100 images (10 to 10 a class, 10 classes present)" in text
    assert "test     10 images (1 to 1 a class" in text and "(3, 32, 32), chunks of 100 images" in text
    data = (tmp_path / "c.h5").read_bytes()
    for keep in (len(data) // 2, len(data) - 1000):
        cut = tmp_path / f"cut{keep}.h5"
        cut.write_bytes(data[:keep])
        with pytest.raises(DataError, match=rf"{cut}: "):
            convert.info(str(cut))
    with pytest.raises(DataError, match=r"does not exist"):
        convert.info(str(tmp_path / "none.h5"))


def test_cli_convert_synth_info_and_errors(tmp_path, tiny_cifar, capsys):
    make_tree(tmp_path / "src")
    out = str(tmp_path / "f.h5")
    args = ["data", "convert", str(tmp_path / "src"), out, "--size", "8", "--workers", "1", "--no-progress"]
    assert main(args) == 0
    assert "train    12 images (4 to 4 a class" in capsys.readouterr().out
    assert main(args) == 2  # refuses to overwrite
    assert capsys.readouterr().err == f"mpiasgd data convert: error: {out} exists; pass --overwrite to replace it\n"
    assert main([*args, "--overwrite", "--seed", "2", "--resize", "squash"]) == 0
    capsys.readouterr()

    (tmp_path / "empty").mkdir()
    assert main(["data", "convert", str(tmp_path / "empty"), str(tmp_path / "e.h5")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpiasgd data convert: error: {tmp_path / 'empty'}: not a dataset") and err.count("\n") == 1
    assert main(["data", "convert", str(tmp_path / "src"), str(tmp_path / "e.h5"), "--no-progress"]) == 2
    assert "is an image folder: pass --size" in capsys.readouterr().err
    assert main(["data", "convert", str(root := tiny_cifar[0]), str(tmp_path / "c.h5"), "--size", "8"]) == 2
    assert "--size apply to image folders only" in capsys.readouterr().err
    assert main(["data", "convert", str(root), str(tmp_path / "c.h5"), "--from", "imagefolder", "--size", "8"]) == 2
    assert "no train/ folder" in capsys.readouterr().err
    assert not (tmp_path / "e.h5").exists() and not (tmp_path / "c.h5").exists()

    assert main(["data", "convert", str(root), str(tmp_path / "c.h5")]) == 0  # auto: CIFAR-10
    assert "name     cifar10" in capsys.readouterr().out
    write_imagenet(tmp_path / "in", counts=(20,), val=10)
    assert main(["data", "convert", str(tmp_path / "in"), str(tmp_path / "i.h5"), "--no-progress"]) == 0
    assert "train    20 images" in capsys.readouterr().out
    assert main(["data", "synth", str(tmp_path / "s.h5"), "--count", "60", "--size", "16", "--classes", "3",
                 "--test-count", "6", "--no-progress"]) == 0
    assert "train    60 images (20 to 20 a class" in capsys.readouterr().out
    assert main(["data", "info", str(tmp_path / "s.h5")]) == 0
    assert "test     6 images (2 to 2 a class" in capsys.readouterr().out
    (tmp_path / "junk.h5").write_bytes(b"junk")
    assert main(["data", "info", str(tmp_path / "junk.h5")]) == 2
    assert capsys.readouterr().err.startswith(f"mpiasgd data info: error: {tmp_path / 'junk.h5'}: not a readable HDF5")


INTERRUPTED = "the conversion writing it was interrupted before it finished"


def test_a_killed_conversion_is_named_with_the_command_that_redoes_it(tmp_path, capsys, monkeypatch):
    """A conversion killed (SIGKILL, a node lost) leaves OUT.partial without statistics, not moved into place:
    given either path, the reader says the conversion was interrupted and prints the command that redoes it."""
    from mpiasgd.data.h5data import H5Writer

    monkeypatch.setattr(H5Writer, "close", lambda self: self.file.close())  # killed: no statistics, no rename
    out = str(tmp_path / "s.h5")
    assert main(["data", "synth", out, "--count", "60", "--size", "8", "--classes", "3", "--seed", "4",
                 "--no-progress"]) == 2
    capsys.readouterr()
    redo = f"redo it: mpiasgd data synth {out} --count 60 --size 8 --classes 3 --seed 4"
    assert main(["data", "info", out + ".partial"]) == 2
    assert capsys.readouterr().err == (f"mpiasgd data info: error: {out}.partial: an incomplete dataset file: "
                                       f"{INTERRUPTED}; {redo}\n")
    with pytest.raises(DataError) as e:
        H5Dataset(out)
    assert str(e.value) == (f"dataset file {out} does not exist; {out}.partial is an incomplete one: {INTERRUPTED}; "
                            f"{redo}")
    make_tree(tmp_path / "src")
    folder = str(tmp_path / "f.h5")
    assert main(["data", "convert", str(tmp_path / "src"), folder, "--size", "8", "--workers", "1",
                 "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"mpiasgd data convert: error: dataset file {folder} does not exist; "
                                       f"{folder}.partial is an incomplete one: {INTERRUPTED}; redo it: mpiasgd data "
                                       f"convert {tmp_path / 'src'} {folder} --size 8 --workers 1\n")


def test_a_partial_file_still_being_written_says_so(tmp_path):
    """OUT.partial that a running conversion holds (HDF5's file lock): wait for it, not redo it."""
    import subprocess
    import sys

    out = tmp_path / "s.h5"
    hold = subprocess.Popen([sys.executable, "-c", "import h5py, sys; f = h5py.File(sys.argv[1], 'w'); f.flush(); "
                             "print('open', flush=True); sys.stdin.read()", f"{out}.partial"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline() == "open\n"
        for path, start in ((f"{out}.partial", f"{out}.partial"),
                            (str(out), f"dataset file {out} does not exist yet: {out}.partial")):
            with pytest.raises(DataError) as e:
                H5Dataset(path)
            assert str(e.value) == (f"{start} is being written by a conversion still running (it holds the file's "
                                    f"lock); wait for it to finish, then use {out}")
        size = os.path.getsize(f"{out}.partial")
        with pytest.raises(DataError) as e:  # a second conversion to the same file: refused, the first one's kept
            convert.synth(str(out), count=10, size=4, progress=False)
        assert str(e.value) == (f"{out}: {out}.partial is being written by a conversion still running (it holds the "
                                "file's lock); wait for it to finish, or stop it, before converting again")
        assert os.path.getsize(f"{out}.partial") == size > 0
    finally:
        hold.communicate("", timeout=30)


def test_a_partial_file_that_records_no_command_says_so(tmp_path):
    """A .partial cut off before its first write (a full disk under an older version, a kill at once) or written
    without a command: the message says the file does not record it, never a placeholder command."""
    from mpiasgd.data.h5data import H5Writer

    out = tmp_path / "s.h5"
    (tmp_path / "s.h5.partial").write_bytes(b"")
    advice = (f"the file does not record the command that wrote it; run that `mpiasgd data convert` or `mpiasgd "
              f"data synth` again, with {out} as OUT.h5")
    with pytest.raises(DataError) as e:
        convert.info(f"{out}.partial")
    assert str(e.value) == f"{out}.partial: an incomplete dataset file: {INTERRUPTED}; {advice}"
    with pytest.raises(DataError) as e:
        H5Dataset(str(out))
    assert str(e.value) == f"dataset file {out} does not exist; {out}.partial is an incomplete one: {INTERRUPTED}; " \
                           f"{advice}"
    w = H5Writer(str(tmp_path / "t.h5"), "t", ["a"], (3, 4, 4), source="image folder /data/x")  # no command
    w.create("train", 2)
    w.file.close()  # killed: no statistics, no rename
    with pytest.raises(DataError) as e:
        convert.info(f"{tmp_path / 't.h5'}.partial")
    assert str(e.value).endswith("; the file does not record the command that wrote it (it was converting: image "
                                 "folder /data/x); run that `mpiasgd data convert` or `mpiasgd data synth` again, "
                                 f"with {tmp_path / 't.h5'} as OUT.h5")


def test_the_command_is_on_disk_before_the_first_image(tmp_path):
    """A conversion killed right after it created OUT.partial (here: os._exit) has already stored its command."""
    import subprocess
    import sys

    out = tmp_path / "s.h5"
    code = ("import os, sys; from mpiasgd.data.h5data import H5Writer\n"
            "w = H5Writer(sys.argv[1], 's', ['a'], (3, 4, 4), 'synthetic', command='mpiasgd data synth X --count 9')\n"
            "os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, timeout=60)
    with pytest.raises(DataError) as e:
        convert.info(f"{out}.partial")
    assert str(e.value) == f"{out}.partial: an incomplete dataset file: {INTERRUPTED}; redo it: mpiasgd data synth X " \
                           "--count 9"


@pytest.mark.parametrize("signum, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_stops_a_conversion_with_128_plus_its_number(tmp_path, capsys, monkeypatch, signum, status):
    """SIGTERM (scancel, kill) and Ctrl-C unwind as one: the partial file removed, one line, 128 + the signal."""
    import signal

    from mpiasgd.data.h5data import H5Writer

    def signalled(self, *args):
        if signum == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal: main's handler turns it into an exception
        raise KeyboardInterrupt  # Ctrl-C, as Python's own SIGINT handler raises it

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(H5Writer, "write", signalled)
    assert main(["data", "synth", str(tmp_path / "s.h5"), "--count", "60", "--size", "8", "--no-progress"]) == status
    assert capsys.readouterr().err == f"mpiasgd data synth: interrupted ({signum}); no output file written\n"
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) == before  # main's handler is not left behind


def test_workers_of_a_killed_conversion_exit_quietly(tmp_path):
    """`data convert` killed with SIGKILL while its 2 decoding processes work: they exit when they find their
    parent gone, printing nothing (no BrokenPipeError, no leaked-semaphore warning), and none stays behind."""
    import signal
    import subprocess
    import sys
    import time

    for name, colour in COLOURS.items():  # 2 x 6000 links to one 96x96 JPEG: a few seconds of decoding
        folder = tmp_path / "src" / "train" / name
        folder.mkdir(parents=True)
        Image.fromarray(picture(colour, 96, 96)).save(folder / "0.jpg")
        for i in range(1, 6000):
            os.link(folder / "0.jpg", folder / f"{i}.jpg")
    out = tmp_path / "out.h5"
    conv = subprocess.Popen([sys.executable, "-m", "mpiasgd", "data", "convert", str(tmp_path / "src"), str(out),
                             "--size", "32", "--workers", "2", "--no-progress"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)

    def children(pid):
        try:
            return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
        except OSError:
            return []

    deadline = time.monotonic() + 60
    while not (out.with_suffix(".h5.partial").exists() and os.path.getsize(f"{out}.partial") > 200_000):
        assert conv.poll() is None and time.monotonic() < deadline, "the conversion ended before it was killed"
        time.sleep(0.02)
    workers = [g for c in children(conv.pid) for g in children(c)]  # forkserver -> workers
    conv.send_signal(signal.SIGKILL)
    _, err = conv.communicate(timeout=60)  # stderr closes when the last process holding it has exited
    assert conv.returncode == -signal.SIGKILL and len(workers) == 2
    assert err == ""
    alive = []
    for w in workers:  # an exited worker may stay a zombie a while (its reaper is whatever adopted it)
        try:
            alive += [w] if open(f"/proc/{w}/stat").read().rsplit(")", 1)[1].split()[0] != "Z" else []
        except OSError:
            pass
    assert alive == []
