"""The dataset file (mpiasgd.data.h5data): written, validated, read by chunks; the chunked shard sampler;
the prefetching minibatch stream."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from mpiasgd.data import DataError, Dataset, MinibatchStream, ShardSampler
from mpiasgd.data.h5data import FORMAT, H5Dataset, H5Writer, default_chunk
from mpiasgd.data.loader import open_data

CLASSES = ("a", "b", "c")


def make_arrays(n: int, m: int, seed: int = 0, shape=(3, 32, 32)):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, *shape), dtype=np.uint8), rng.integers(0, 3, n),
            rng.integers(0, 256, (m, *shape), dtype=np.uint8), rng.integers(0, 3, m))


def write_file(path, train_x, train_y, test_x=None, test_y=None, chunk=16, step=37):
    with H5Writer(str(path), "toy", CLASSES, train_x.shape[1:], source="test", chunk=chunk) as w:
        for split, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
            if x is None:
                continue
            w.create(split, len(x))
            for s in range(0, len(x), step):  # in uneven pieces: writes need not align with chunks
                w.write(split, s, x[s:s + step], y[s:s + step])
    return str(path)


@pytest.fixture
def toy(tmp_path):
    arrays = make_arrays(300, 50)
    return write_file(tmp_path / "toy.h5", *arrays), arrays


def test_default_chunk_is_about_one_mebibyte():
    assert default_chunk((3, 32, 32)) == 256
    assert default_chunk((3, 64, 64)) == 64
    assert default_chunk((3, 224, 224)) == 4
    assert default_chunk((1, 8, 8)) == 1024


def test_file_round_trip_and_statistics(toy):
    path, (tx, ty, vx, vy) = toy
    ds = H5Dataset(path)
    assert ds.image_shape == (3, 32, 32) and ds.num_train == 300 and ds.num_test == 50 and ds.chunk == 16
    assert ds.classes == CLASSES and ds.name == "toy"
    np.testing.assert_array_equal(ds.train_y, ty)
    np.testing.assert_array_equal(ds.images("train", np.array([5, 299, 0, 17])), tx[[5, 299, 0, 17]])
    np.testing.assert_array_equal(ds.images("test", np.arange(50)), vx)
    ref = Dataset.from_arrays("toy", tx, ty, vx, vy, CLASSES, augment=True, source="arrays")
    np.testing.assert_allclose(ds.mean, ref.mean, rtol=1e-6)
    np.testing.assert_allclose(ds.std, ref.std, rtol=1e-6)
    pixels = tx.transpose(1, 0, 2, 3).reshape(3, -1).astype(np.float64)
    np.testing.assert_allclose(ds.pixel_cov, np.cov(pixels, bias=True), rtol=1e-9)
    with h5py.File(path) as f:
        assert f.attrs["format"] == FORMAT and json.loads(f.attrs["classes"]) == list(CLASSES)
        assert f["train/images"].chunks == (16, 3, 32, 32)


def test_file_batches_equal_the_in_memory_dataset(toy):
    """Same images, same augmentation, same rng: the file gives the in-memory dataset's minibatch, bit for bit."""
    path, (tx, ty, vx, vy) = toy
    ds = H5Dataset(path)
    ref = Dataset.from_arrays("toy", tx, ty, vx, vy, CLASSES, augment=True, source="arrays")
    ds.mean, ds.std = ref.mean, ref.std  # the file's are the same to float rounding; make them identical
    idx = np.array([3, 25, 17, 17, 49])
    for split, rng in (("train", 7), ("test", None)):
        a = ds.batch(split, idx, None if rng is None else np.random.default_rng(rng))
        b = ref.batch(split, idx, None if rng is None else np.random.default_rng(rng))
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_incomplete_or_failed_write_leaves_no_file(tmp_path):
    tx, ty, _, _ = make_arrays(40, 0)
    path = tmp_path / "x.h5"
    with pytest.raises(DataError, match="incompletely"):
        with H5Writer(str(path), "toy", CLASSES, (3, 32, 32), source="t") as w:
            w.create("train", 40)
            w.write("train", 0, tx[:20], ty[:20])
    with pytest.raises(DataError, match=r"outside 0\.\.2"):
        with H5Writer(str(path), "toy", CLASSES, (3, 32, 32), source="t") as w:
            w.create("train", 40)
            w.write("train", 0, tx, np.full(40, 3))
    assert not path.exists() and not (tmp_path / "x.h5.partial").exists()


def test_broken_files_name_the_file(tmp_path, toy):
    path, (_, _, vx, vy) = toy
    raw = open(path, "rb").read()
    cut = tmp_path / "cut.h5"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"cut.h5.*(truncated|not a readable)"):
        H5Dataset(str(cut))
    with pytest.raises(DataError, match="does not exist"):
        H5Dataset(str(tmp_path / "none.h5"))
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.attrs["format"] = "something/2"
    with pytest.raises(DataError, match=r"expected 'mpiasgd\.data/1'"):
        H5Dataset(str(other))
    bad = tmp_path / "bad.h5"
    bad.write_bytes(raw)
    with h5py.File(bad, "a") as f:
        f["train/labels"][7] = 9
    with pytest.raises(DataError, match=r"bad.h5: /train/labels\[7\] = 9 is outside 0..2"):
        H5Dataset(str(bad))
    testonly = write_file(tmp_path / "testonly.h5", vx, vy)  # a file with one split, used as test data
    with pytest.raises(DataError, match=r"has no 'test' split"):
        H5Dataset(path, test_path=str(tmp_path / "testonly.h5"))
    small = write_file(tmp_path / "small.h5", *make_arrays(20, 10, shape=(3, 16, 16)))
    with pytest.raises(DataError, match=r"test images are \(3, 16, 16\)"):
        H5Dataset(path, test_path=small)
    assert H5Dataset(testonly).num_test == 0


def test_a_run_log_or_checkpoint_given_as_data_is_named_as_such(tmp_path):
    """`train --data runs/x.h5` with a run log (or a checkpoint) says what the file is, not "attribute format is
    ''" (issue 36); real files of both kinds, written by the run log's writer and the checkpoint's."""
    from mpiasgd import checkpoint
    from mpiasgd.runlog import RunLog

    log = tmp_path / "x.h5"
    RunLog.create(str(log), {"config": "{}"}, [], 3, flush_interval=60.0).close("completed", {})
    with pytest.raises(DataError) as e:
        H5Dataset(str(log))
    assert str(e.value) == (f"{log} is an mpiasgd run log, not a dataset; --data takes a file written by "
                            "`mpiasgd data convert`")
    ckpt = tmp_path / "x.ckpt.h5"
    with h5py.File(ckpt, "w") as f:  # the checkpoint's own format attribute, as checkpoint.save writes it
        f.attrs["format"] = checkpoint.FORMAT
        f["params"] = np.zeros(3, np.float32)
    with pytest.raises(DataError, match=r"x\.ckpt\.h5 is an mpiasgd checkpoint, not a dataset; --data takes"):
        H5Dataset(str(ckpt))


def test_open_data_reads_no_training_images(toy):
    path, _ = toy
    ds = open_data(path)
    assert ds.caches["train"].reads == 0 and ds.num_train == 300  # labels and attributes only (rank 0)
    ds.batch("train", np.arange(20), np.random.default_rng(0))
    assert ds.caches["train"].reads == 2  # rows 0..19: chunks 0 and 1 of 16


@pytest.mark.parametrize("chunk,window", [(1, 16), (16, 1), (16, 4), (7, 3)])
def test_shards_cover_every_sample_once_per_epoch(chunk, window):
    n, shards = 300, 3
    samplers = [ShardSampler(n, shards, s, seed=5, chunk=chunk, window=window) for s in range(shards)]
    for epoch in range(3):
        orders = [s.indices(epoch) for s in samplers]
        every = np.concatenate(orders)
        np.testing.assert_array_equal(np.sort(every), np.arange(n))  # each sample exactly once per epoch
        for s, order in zip(samplers, orders, strict=True):
            assert len(order) == len(s)
            np.testing.assert_array_equal(np.sort(order), np.sort(s.shard_indices()))  # always the same shard
    assert not np.array_equal(samplers[0].indices(0), samplers[0].indices(1))  # reshuffled each epoch
    if chunk > 1:  # whole chunks per shard: a chunk is never split between workers
        for s in samplers:
            blocks = np.unique(s.shard_indices() // chunk)
            assert sum(min(chunk, n - b * chunk) for b in blocks) == len(s)
            assert all(np.isin(np.arange(b * chunk, min(n, (b + 1) * chunk)), s.shard_indices()).all()
                       for b in blocks)


def test_chunked_order_reads_each_chunk_once_per_epoch(toy):
    """A minibatch touches at most two windows' chunks; a cache of window + 2 chunks reads each chunk once an epoch."""
    path, _ = toy
    window = 3
    ds = H5Dataset(path, cache_chunks=window + 2)
    sampler = ShardSampler(ds.num_train, 2, 0, seed=1, chunk=ds.chunk, window=window)
    order = sampler.indices(0)
    for start in range(0, order.size, 10):
        batch = order[start:start + 10]
        assert np.unique(batch // ds.chunk).size <= 2 * window
        ds.images("train", batch)
    assert ds.caches["train"].reads == np.unique(order // ds.chunk).size
    # the window shuffle mixes chunks: consecutive samples are not all from one chunk
    assert np.mean(np.diff(order[:48] // ds.chunk) != 0) > 0.3


def test_chunk_one_keeps_the_in_memory_order():
    """chunk 1 (in-memory datasets): the order of every epoch is the one mpiasgd always used."""
    s = ShardSampler(100, 3, 1, seed=9)
    mine = np.random.default_rng(9).permutation(100)[1::3]
    np.testing.assert_array_equal(s.shard_indices(), mine)
    np.testing.assert_array_equal(s.indices(2), mine[np.random.default_rng((9, 2, 1)).permutation(mine.size)])


def test_more_workers_than_chunks(toy):
    with pytest.raises(DataError, match=r"more workers \(20\) than chunks \(19 of 16 images"):
        ShardSampler(300, 20, 0, seed=0, chunk=16)


@pytest.mark.parametrize("prefetch", [1, 3])
def test_prefetch_yields_the_same_minibatches(toy, prefetch):
    """The background thread changes when minibatches are made, never what they are; seek restarts it exactly."""
    path, _ = toy
    ds = H5Dataset(path)
    sampler = ShardSampler(ds.num_train, 2, 1, seed=3, chunk=ds.chunk, window=2)
    plain = MinibatchStream(ds, sampler, 32, seed=3, stream=2)
    ahead = MinibatchStream(ds, sampler, 32, seed=3, stream=2, prefetch=prefetch)
    try:
        want = [plain.next() for _ in range(12)]  # crosses epochs (150 images a shard)
        for x, y, epoch in want:
            gx, gy, gepoch = ahead.next()
            np.testing.assert_array_equal(gx, x)
            np.testing.assert_array_equal(gy, y)
            assert gepoch == epoch
        assert ahead.cursor == 12 and ahead.data_s >= 0
        ahead.seek(5)  # a resumed worker
        for x, y, _ in want[5:9]:
            gx, gy, _ = ahead.next()
            np.testing.assert_array_equal(gx, x)
            np.testing.assert_array_equal(gy, y)
    finally:
        ahead.close()
    assert ahead.thread is None


def test_prefetch_raises_the_readers_error_in_the_step():

    class Broken:
        def batch(self, split, idx, rng):
            raise DataError("toy.h5: reading /train/images failed (disk gone)")

    sampler = ShardSampler(300, 1, 0, seed=0)
    stream = MinibatchStream(Broken(), sampler, 8, seed=0, stream=1, prefetch=2)
    with pytest.raises(DataError, match="disk gone"):
        stream.next()
    stream.close()


def test_keep_in_memory_reads_the_shard_once(toy):
    path, _ = toy
    ds = H5Dataset(path, cache_chunks=1)
    sampler = ShardSampler(ds.num_train, 2, 0, seed=0, chunk=ds.chunk)
    ds.keep_in_memory(sampler.shard_indices())
    reads = ds.caches["train"].reads
    assert reads == np.unique(sampler.shard_indices() // ds.chunk).size
    for epoch in range(2):
        ds.images("train", sampler.indices(epoch))
    assert ds.caches["train"].reads == reads  # nothing more read from the file


def test_writer_refuses_a_file_the_disk_cannot_hold(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 2 * 10**6, 2 * 10**6))
    with pytest.raises(DataError, match=r"big\.h5: not enough free space in .*: the file needs 4\.1 MB more, "
                                        r"2\.0 MB are free$"):
        with H5Writer(str(tmp_path / "big.h5"), "toy", CLASSES, (3, 32, 32), source="t") as w:
            w.create("train", 1000)  # 3 MB
    assert list(tmp_path.iterdir()) == []


def test_a_disk_that_fills_while_writing_gives_one_error_and_no_file(small_disk, monkeypatch):
    """A 3 MB tmpfs, the free-space check fooled (another process fills the disk after it): the failed write is
    one DataError naming the file, and the partial file is removed."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**12, 0, 10**12))
    tx, ty, _, _ = make_arrays(2000, 0)  # 6 MB
    with pytest.raises(DataError, match=r"full\.h5: not enough free space in .* \(writing failed: \[Errno 28\] No "
                                        r"space left on device\): the file needs \d\.\d MB more, 1000\.00 GB are "
                                        r"free; the partial file was removed$"):
        with H5Writer(str(small_disk / "full.h5"), "toy", CLASSES, (3, 32, 32), source="t") as w:
            w.create("train", 2000)
            for s in range(0, 2000, 250):
                w.write("train", s, tx[s:s + 250], ty[s:s + 250])
    assert list(small_disk.iterdir()) == []


def test_free_space_is_checked_before_the_file_is_created(tmp_path, monkeypatch):
    """Told how many images the file will hold, the writer refuses a disk without room for them before HDF5 makes
    a file: one line with what the file needs, nothing left behind."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9, 0))
    monkeypatch.setattr(h5py, "File", lambda *a, **k: pytest.fail("HDF5 called on a full disk"))
    with pytest.raises(DataError) as e:
        H5Writer(str(tmp_path / "big.h5"), "toy", CLASSES, (3, 64, 64), source="t", images=130560)
    assert str(e.value) == (f"{tmp_path / 'big.h5'}: not enough free space in {tmp_path}: the file needs 1.61 GB "
                            "more, 0 kB are free")
    assert list(tmp_path.iterdir()) == []


def test_a_file_hdf5_cannot_create_is_one_line_and_no_partial(tmp_path, monkeypatch):
    """The free-space check passed, then the disk filled: HDF5 makes OUT.partial and fails to write its first
    bytes (ENOSPC, its multi-line text). One line with the cause and what the file needs; the empty partial goes."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**12, 0, 10**12))

    def full(path, mode, **kwargs):
        open(path, "wb").close()  # as HDF5: the file is made, its superblock does not fit
        raise OSError(28, "Unable to synchronously create file (file write failed: time = Sun Dec  6 18:44:05 2026\n"
                          f", filename = '{path}', errno = 28, error message = 'No space left on device')")

    monkeypatch.setattr(h5py, "File", full)
    with pytest.raises(DataError) as e:
        H5Writer(str(tmp_path / "s.h5"), "toy", CLASSES, (3, 8, 8), source="t", images=1000)
    assert str(e.value) == (f"{tmp_path / 's.h5'}: not enough free space in {tmp_path} ([Errno 28] No space left on "
                            "device): the file needs 1.2 MB more, 1000.00 GB are free; the partial file was removed")
    assert list(tmp_path.iterdir()) == []


CHANGED = r"{path}: the dataset file changed while the run reads it \({what}\); rerun, or --resume, once it is complete"
CLOCK = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}"


def test_a_file_changed_under_a_reader_says_what_changed(tmp_path, toy, monkeypatch):
    """Replaced by another file of the same size, written in place with its modification time set back,
    truncated: the reader's one-line error says which of identity, times, size and conversion stamp differ."""
    import os
    import re
    import time

    path, _ = toy
    ds = H5Dataset(path)
    ino = os.stat(path).st_ino
    created = ds.file.attrs["created"]
    gmtime = time.gmtime
    with monkeypatch.context() as m:  # a conversion in 2030, 0 s past midnight
        m.setattr(time, "gmtime", lambda secs=None: gmtime(1893456000 if secs is None else secs))
        other = write_file(tmp_path / "other.h5", *make_arrays(300, 50, seed=1))
    assert os.path.getsize(other) == os.path.getsize(path)
    time.sleep(0.05)
    os.replace(other, path)
    with pytest.raises(DataError) as e:
        ds.images("train", np.arange(20))
    what = (rf"replaced by another file: inode {ino} -> {os.stat(path).st_ino}; modified {CLOCK} -> "
            rf"(\d\d:\d\d:\d\d\.\d{{3}}|{CLOCK}) UTC; another conversion: created {created} -> 2030-01-01T00:00:00Z")
    assert re.fullmatch(CHANGED.format(path=re.escape(path), what=what), str(e.value)), str(e.value)

    ds = H5Dataset(path)
    st = os.stat(path)
    time.sleep(0.05)
    with open(path, "r+b") as f:  # a byte of the images rewritten, the modification time put back
        f.seek(st.st_size - 10)
        f.write(b"x")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DataError) as e:
        ds.images("train", np.arange(20))
    what = rf"written in place with its modification time kept \(status changed {CLOCK} -> {CLOCK} UTC\)"
    assert re.fullmatch(CHANGED.format(path=re.escape(path), what=what), str(e.value)), str(e.value)

    ds = H5Dataset(path)
    size = os.path.getsize(path)
    time.sleep(0.05)
    os.truncate(path, size // 2)
    with pytest.raises(DataError) as e:
        ds.images("train", np.arange(20))
    what = rf"size {size:,} -> {size // 2:,} bytes; modified {CLOCK} -> (\d\d:\d\d:\d\d\.\d{{3}}|{CLOCK}) UTC"
    assert re.fullmatch(CHANGED.format(path=re.escape(path), what=what), str(e.value)), str(e.value)
