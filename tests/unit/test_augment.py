"""Tests for mpiasgd.data.augment.Augmentation: parsing, checks, bit-compatibility with random_crop_flip,
and what each item does to a batch (values checked against slices, Pillow and the covariance's eigenbasis).

Run: .venv/bin/pytest tests/unit/test_augment.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from mpiasgd.data import augment
from mpiasgd.data.augment import Augmentation, random_crop_flip
from mpiasgd.data.dataset import DataError, channel_stats

VALID = "valid items: pad-crop=P | inner-crop=S | resized-crop=S"


def _batch(b: int, c: int, h: int, w: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random uint8 (B, C, H, W) pixels and their float32 channel mean and std, as a Dataset has them."""
    raw = np.random.default_rng(seed).integers(0, 256, size=(b, c, h, w), dtype=np.uint8)
    mean, std = channel_stats(raw)
    return raw, mean, std


def _normalised(raw: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """The normalisation of Dataset.batch, the same float32 ops in the same order."""
    x = raw.astype(np.float32)
    x -= mean[:, None, None]
    x /= std[:, None, None]
    return x


def _assert_fresh_float32(y: np.ndarray, shape: tuple[int, ...]) -> None:
    assert y.dtype == np.float32 and y.shape == shape and y.flags.c_contiguous and y.flags.owndata


# --- parse, describe, default, check ---


@pytest.mark.parametrize(
    ("text", "canonical", "fields"),
    [
        ("none", "none", ("none", 0, False, 0.0)),
        (" none ", "none", ("none", 0, False, 0.0)),
        ("flip", "flip", ("none", 0, True, 0.0)),
        ("pad-crop=4,flip", "pad-crop=4,flip", ("pad-crop", 4, True, 0.0)),
        ("flip, pad-crop = 2", "pad-crop=2,flip", ("pad-crop", 2, True, 0.0)),
        ("pca-noise=0.1,flip,inner-crop=24", "inner-crop=24,flip,pca-noise=0.1", ("inner-crop", 24, True, 0.1)),
        ("resized-crop=224", "resized-crop=224", ("resized-crop", 224, False, 0.0)),
        ("pca-noise=1e-05", "pca-noise=1e-05", ("none", 0, False, 1e-05)),
        ("pca-noise=2", "pca-noise=2.0", ("none", 0, False, 2.0)),
    ],
)
def test_parse_describe_round_trip(text, canonical, fields):
    aug = Augmentation.parse(text)
    assert (aug.crop, aug.crop_size, aug.flip, aug.pca_noise) == fields
    assert aug.describe() == canonical
    assert Augmentation.parse(aug.describe()) == aug
    assert aug.random is (canonical != "none")


@pytest.mark.parametrize(
    ("text", "item", "why"),
    [
        ("", "''", "is empty"),
        ("crop=4", "'crop=4'", "is unknown"),
        ("flip,,pad-crop=4", "''", "is empty"),
        ("pad-crop=4,inner-crop=3", "'inner-crop=3'", "second crop after pad-crop"),
        ("resized-crop=8,resized-crop=8", "'resized-crop=8'", "given twice"),
        ("flip,flip", "'flip'", "given twice"),
        ("none,flip", "'none'", "must stand alone"),
        ("flip=1", "'flip=1'", "takes no value"),
        ("pad-crop", "'pad-crop'", "integer >= 1"),
        ("pad-crop=0", "'pad-crop=0'", "integer >= 1"),
        ("inner-crop=-3", "'inner-crop=-3'", "integer >= 1"),
        ("resized-crop=2.5", "'resized-crop=2.5'", "integer >= 1"),
        ("pca-noise=abc", "'pca-noise=abc'", "SIGMA > 0"),
        ("pca-noise=0", "'pca-noise=0'", "SIGMA > 0"),
        ("pca-noise=-0.1", "'pca-noise=-0.1'", "SIGMA > 0"),
        ("pca-noise=nan", "'pca-noise=nan'", "SIGMA > 0"),
        ("pca-noise=inf", "'pca-noise=inf'", "SIGMA > 0"),
    ],
)
def test_parse_rejects_bad_text_naming_the_item(text, item, why):
    with pytest.raises(DataError) as err:
        Augmentation.parse(text)
    message = str(err.value)
    assert f"item {item}" in message and why in message and VALID in message


def test_constructor_rejects_inconsistent_fields():
    for kwargs in ({"crop": "centre"}, {"crop": "pad-crop"}, {"crop_size": 3}, {"pca_noise": -1.0},
                   {"pca_noise": math.nan}):
        with pytest.raises(DataError):
            Augmentation(**kwargs)


def test_default_by_image_size():
    assert Augmentation.default((3, 32, 32)) == Augmentation.parse("pad-crop=4,flip")
    assert Augmentation.default((3, 224, 224)).describe() == "pad-crop=4,flip"
    assert Augmentation.default((1, 8, 8)) == Augmentation.parse("none")
    assert Augmentation.default((3, 32, 31)).describe() == "none"
    assert not Augmentation.default((1, 8, 8)).random


def test_check_and_output_shape():
    cov = np.diag([3.0, 2.0, 1.0])
    Augmentation.parse("inner-crop=32,flip").check((3, 32, 32))
    Augmentation.parse("pad-crop=40").check((1, 8, 8))  # padding larger than the image is legal
    Augmentation.parse("resized-crop=300").check((3, 32, 32))  # resizing up is legal
    Augmentation.parse("pca-noise=0.1").check((3, 8, 8), cov)
    with pytest.raises(DataError, match=r"'inner-crop=33': the 33x33 crop is larger than the 32x40 images"):
        Augmentation.parse("inner-crop=33").check((3, 32, 40))
    with pytest.raises(DataError, match="larger than the 40x32"):
        Augmentation.parse("inner-crop=33").check((3, 40, 32))
    with pytest.raises(DataError, match="3 channels"):
        Augmentation.parse("pca-noise=0.1").check((1, 8, 8), np.eye(1))
    with pytest.raises(DataError, match="needs the covariance"):
        Augmentation.parse("pca-noise=0.1").check((3, 8, 8))
    with pytest.raises(DataError, match=r"\(3, 3\) pixel covariance, got shape \(2, 2\)"):
        Augmentation.parse("pca-noise=0.1").check((3, 8, 8), np.eye(2))
    with pytest.raises(DataError, match="symmetric"):
        Augmentation.parse("pca-noise=0.1").check((3, 8, 8), np.triu(np.ones((3, 3))))
    with pytest.raises(DataError, match=r"\(C, H, W\)"):
        Augmentation.parse("none").check((8, 8))
    assert Augmentation.parse("pad-crop=4,flip").output_shape((3, 32, 32)) == (3, 32, 32)
    assert Augmentation.parse("none").output_shape((1, 8, 8)) == (1, 8, 8)
    assert Augmentation.parse("inner-crop=24").output_shape((3, 32, 30)) == (3, 24, 24)
    assert Augmentation.parse("resized-crop=40,flip").output_shape((3, 32, 30)) == (3, 40, 40)


def test_train_and_test_check_the_batch():
    raw, mean, std = _batch(2, 3, 16, 16)
    rng = np.random.default_rng(0)
    with pytest.raises(DataError, match="larger than the 16x16"):
        Augmentation.parse("inner-crop=17").train(raw, rng, mean, std)
    with pytest.raises(DataError, match="larger than the 16x16"):
        Augmentation.parse("inner-crop=17").test(raw, mean, std)
    with pytest.raises(DataError, match="needs the covariance"):
        Augmentation.parse("pca-noise=0.1").train(raw, rng, mean, std)
    with pytest.raises(DataError, match="uint8"):
        Augmentation.parse("none").train(raw.astype(np.float32), rng, mean, std)
    with pytest.raises(DataError, match=r"mean and std must be \(3,\)"):
        Augmentation.parse("none").test(raw, mean[:2], std[:2])
    # pca-noise is a training item: the test view needs no covariance
    _assert_fresh_float32(Augmentation.parse("pca-noise=0.1").test(raw, mean, std), (2, 3, 16, 16))


# --- bit-compatibility with the augmentation that existed before ---


def test_pad_crop_flip_is_random_crop_flip_bit_for_bit():
    raw, mean, std = _batch(64, 3, 32, 32, seed=1)
    aug = Augmentation.parse("pad-crop=4,flip")
    rng_a, rng_b = np.random.default_rng(7), np.random.default_rng(7)
    got = aug.train(raw, rng_a, mean, std)
    want = random_crop_flip(_normalised(raw, mean, std), rng_b, pad=4)
    _assert_fresh_float32(got, (64, 3, 32, 32))
    assert np.array_equal(got, want)
    assert rng_a.bit_generator.state == rng_b.bit_generator.state  # the same draws, no more
    assert np.array_equal(aug.test(raw, mean, std), _normalised(raw, mean, std))


def test_none_normalises_and_draws_nothing():
    raw, mean, std = _batch(5, 1, 8, 8, seed=2)
    aug = Augmentation.parse("none")
    rng = np.random.default_rng(3)
    before = rng.bit_generator.state
    got = aug.train(raw, rng, mean, std)
    assert rng.bit_generator.state == before
    want = _normalised(raw, mean, std)
    _assert_fresh_float32(got, (5, 1, 8, 8))
    assert np.array_equal(got, want)
    assert np.array_equal(aug.test(raw, mean, std), want)


def test_pad_crop_alone_shifts_by_the_drawn_offsets():
    raw, mean, std = _batch(6, 2, 10, 12, seed=4)
    got = Augmentation.parse("pad-crop=3").train(raw, np.random.default_rng(5), mean, std)
    draws = np.random.default_rng(5)
    top, left = draws.integers(0, 7, 6), draws.integers(0, 7, 6)
    padded = np.pad(_normalised(raw, mean, std), ((0, 0), (0, 0), (3, 3), (3, 3)))
    for b in range(6):
        assert np.array_equal(got[b], padded[b, :, top[b] : top[b] + 10, left[b] : left[b] + 12])


# --- inner-crop ---


def test_inner_crop_test_is_the_centre_crop():
    raw, mean, std = _batch(4, 3, 31, 28, seed=5)
    got = Augmentation.parse("inner-crop=24,flip").test(raw, mean, std)
    _assert_fresh_float32(got, (4, 3, 24, 24))
    assert np.array_equal(got, _normalised(raw, mean, std)[:, :, 3:27, 2:26])  # (31-24)//2, (28-24)//2


def test_inner_crop_train_takes_drawn_sub_windows():
    raw, mean, std = _batch(12, 3, 20, 18, seed=6)
    x = _normalised(raw, mean, std)
    got = Augmentation.parse("inner-crop=15,flip").train(raw, np.random.default_rng(8), mean, std)
    _assert_fresh_float32(got, (12, 3, 15, 15))
    draws = np.random.default_rng(8)  # the documented order: top, left, flip
    top, left, flip = draws.integers(0, 6, 12), draws.integers(0, 4, 12), draws.random(12) < 0.5
    assert 0 < flip.sum() < 12
    for b in range(12):
        window = x[b, :, top[b] : top[b] + 15, left[b] : left[b] + 15]
        assert np.array_equal(got[b], window[:, :, ::-1] if flip[b] else window)
        # and it is a window of this image and no other position (random pixels make it unique)
        oriented = got[b][:, :, ::-1] if flip[b] else got[b]
        hits = [(t, s) for t in range(6) for s in range(4) if np.array_equal(oriented, x[b, :, t : t + 15, s : s + 15])]
        assert hits == [(top[b], left[b])]


# --- resized-crop ---


def test_resized_crop_shapes_and_windows_follow_torchvision():
    raw, mean, std = _batch(3, 3, 40, 48, seed=7)
    aug = Augmentation.parse("resized-crop=20,flip")
    _assert_fresh_float32(aug.train(raw, np.random.default_rng(0), mean, std), (3, 3, 20, 20))
    _assert_fresh_float32(aug.test(raw, mean, std), (3, 3, 20, 20))
    top, left, h, w = augment.resized_crop_windows(40, 48, 4000, np.random.default_rng(1))
    assert np.all((top >= 0) & (left >= 0) & (top + h <= 40) & (left + w <= 48) & (h >= 1) & (w >= 1))
    area, ratio = h * w / (40 * 48), w / h
    assert area.min() >= 0.07 and area.max() <= 1.0  # [0.08, 1] up to rounding the sides
    assert ratio.min() >= 0.7 and ratio.max() <= 1.4  # [3/4, 4/3] up to rounding the sides
    assert 0.25 < np.median(area) < 0.75  # not stuck at the fallback (the whole image)
    assert len(set(zip(top.tolist(), left.tolist(), strict=True))) > 100  # positions vary


def test_resized_crop_falls_back_to_the_centre_for_a_strip():
    # 4 x 400: no window of area >= 0.08 * 1600 and ratio <= 4/3 fits 4 rows -> torchvision's fallback
    top, left, h, w = augment.resized_crop_windows(4, 400, 5, np.random.default_rng(2))
    assert top.tolist() == [0] * 5 and h.tolist() == [4] * 5
    assert w.tolist() == [5] * 5 and left.tolist() == [197] * 5  # round(4 * 4/3), (400 - 5) // 2


def test_resized_crop_of_the_whole_image_is_the_resize(monkeypatch):
    raw, mean, std = _batch(3, 3, 24, 20, seed=8)
    full = np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64), np.full(3, 24), np.full(3, 20)
    monkeypatch.setattr(augment, "resized_crop_windows", lambda h, w, b, rng: full)
    got = Augmentation.parse("resized-crop=12").train(raw, np.random.default_rng(0), mean, std)
    for b in range(3):  # Pillow on an RGB image, the module resizes one channel at a time
        rgb = Image.fromarray(np.ascontiguousarray(raw[b].transpose(1, 2, 0)), "RGB")
        small = np.asarray(rgb.resize((12, 12), Image.BILINEAR)).transpose(2, 0, 1)
        assert np.array_equal(got[b], _normalised(small[None], mean, std)[0])
    # resizing to the same size is the identity, so the whole "crop" is the normalised image itself
    full = np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.int64), np.full(3, 24), np.full(3, 24)
    square, mean1, std1 = _batch(3, 1, 24, 24, seed=9)
    got = Augmentation.parse("resized-crop=24").train(square, np.random.default_rng(0), mean1, std1)
    assert np.array_equal(got, _normalised(square, mean1, std1))


def test_resized_crop_test_resizes_the_centre_square():
    raw, mean, std = _batch(2, 3, 32, 36, seed=10)
    # side round(0.875 * 32) = 28 at ((32 - 28) // 2, (36 - 28) // 2) = (2, 4); resized to 28: the crop itself
    got = Augmentation.parse("resized-crop=28").test(raw, mean, std)
    assert np.array_equal(got, _normalised(raw, mean, std)[:, :, 2:30, 4:32])
    got = Augmentation.parse("resized-crop=14").test(raw, mean, std)
    for b in range(2):
        rgb = Image.fromarray(np.ascontiguousarray(raw[b].transpose(1, 2, 0)), "RGB")
        small = np.asarray(rgb.resize((14, 14), Image.BILINEAR, box=(4, 2, 32, 30))).transpose(2, 0, 1)
        assert np.array_equal(got[b], _normalised(small[None], mean, std)[0])


def test_resized_crop_flip_mirrors_the_resized_window(monkeypatch):
    raw, mean, std = _batch(8, 1, 16, 16, seed=11)
    windows = augment.resized_crop_windows(16, 16, 8, np.random.default_rng(4))
    monkeypatch.setattr(augment, "resized_crop_windows", lambda h, w, b, rng: windows)
    plain = Augmentation.parse("resized-crop=8").train(raw, np.random.default_rng(5), mean, std)
    flipped = Augmentation.parse("resized-crop=8,flip").train(raw, np.random.default_rng(5), mean, std)
    flip = np.random.default_rng(5).random(8) < 0.5  # the stub drew nothing: flip is the first draw
    assert 0 < flip.sum() < 8
    assert np.array_equal(flipped, np.where(flip[:, None, None, None], plain[..., ::-1], plain))


# --- flip ---


def test_flip_mirrors_the_drawn_images():
    raw, mean, std = _batch(16, 3, 6, 7, seed=12)
    got = Augmentation.parse("flip").train(raw, np.random.default_rng(9), mean, std)
    flip = np.random.default_rng(9).random(16) < 0.5
    assert 0 < flip.sum() < 16
    x = _normalised(raw, mean, std)
    _assert_fresh_float32(got, (16, 3, 6, 7))
    assert np.array_equal(got[flip], x[flip][..., ::-1]) and np.array_equal(got[~flip], x[~flip])
    assert np.array_equal(Augmentation.parse("flip").test(raw, mean, std), x)


# --- pca-noise ---


def _rank2_cov() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (3, 3) covariance with eigenvalues 900, 100, 0 along a rotated basis (columns of q)."""
    q, _ = np.linalg.qr(np.array([[1.0, 2.0, 0.5], [0.3, -1.0, 2.0], [1.5, 0.2, -0.7]]))
    eigval = np.array([900.0, 100.0, 0.0])
    return q @ np.diag(eigval) @ q.T, q, eigval


def test_pca_noise_adds_a_constant_offset_along_the_eigenvectors():
    n, sigma = 4000, 5.0
    raw = np.full((n, 3, 2, 2), 128, dtype=np.uint8)
    raw[:, :, 0, 1] = 90  # not flat, so a constant offset is not just any change
    mean, std = np.array([110.0, 120.0, 100.0], np.float32), np.array([50.0, 60.0, 70.0], np.float32)
    cov, q, eigval = _rank2_cov()
    aug = Augmentation.parse(f"pca-noise={sigma}")
    got = aug.train(raw, np.random.default_rng(13), mean, std, cov)
    _assert_fresh_float32(got, (n, 3, 2, 2))
    offset = (got - _normalised(raw, mean, std)) * std[:, None, None]  # (N, 3, 2, 2) pixel units
    per_image = offset[:, :, 0, 0]  # (N, 3)
    assert np.allclose(offset, per_image[:, :, None, None], atol=1e-3)  # the same on every pixel
    # exactly eigvec @ (alpha * eigval), alpha the first draw (nothing else draws here)
    alpha = np.random.default_rng(13).normal(0.0, sigma, size=(n, 3))
    eigval_np, eigvec_np = np.linalg.eigh(cov)
    assert np.allclose(per_image, (alpha * eigval_np) @ eigvec_np.T / 255, atol=1e-3)  # [0, 1] pixels' SIGMA
    # in the span of the eigenvectors with non-zero eigenvalues; spread sigma * eigval along each
    coords = per_image @ q  # (N, 3) along q's columns
    assert np.abs(coords[:, 2]).max() < 1e-3
    assert np.allclose(coords.std(axis=0)[:2], sigma * eigval[:2] / 255, rtol=0.06)
    assert abs(np.corrcoef(coords[:, 0], coords[:, 1])[0, 1]) < 0.06
    assert np.allclose(coords.mean(axis=0)[:2], 0.0, atol=0.1 * sigma * eigval[:2] / 255)


def test_pca_noise_is_applied_before_the_pad_crop_border():
    raw, mean, std = _batch(4, 3, 8, 8, seed=14)
    cov, _, _ = _rank2_cov()
    got = Augmentation.parse("pad-crop=2,flip,pca-noise=0.05").train(raw, np.random.default_rng(15), mean, std, cov)
    draws = np.random.default_rng(15)  # top, left, flip, alpha
    top, left, flip = draws.integers(0, 5, 4), draws.integers(0, 5, 4), draws.random(4) < 0.5
    alpha = draws.normal(0.0, 0.05, size=(4, 3))
    eigval, eigvec = np.linalg.eigh(cov)
    noisy = raw.astype(np.float32) + ((alpha * eigval) @ eigvec.T / 255).astype(np.float32)[:, :, None, None]
    noisy -= mean[:, None, None]
    noisy /= std[:, None, None]
    assert np.array_equal(got, augment.crop_flip(noisy, top, left, flip, 2))  # border zeros carry no noise


# --- determinism ---


@pytest.mark.parametrize("text", ["pad-crop=4,flip", "inner-crop=12,flip,pca-noise=0.01", "resized-crop=10,flip",
                                  "flip", "pca-noise=0.01"])
def test_train_is_a_function_of_the_rng_state(text):
    raw, mean, std = _batch(8, 3, 16, 16, seed=16)
    cov, _, _ = _rank2_cov()
    aug = Augmentation.parse(text)
    a = aug.train(raw, np.random.default_rng(21), mean, std, cov)
    b = aug.train(raw, np.random.default_rng(21), mean, std, cov)
    c = aug.train(raw, np.random.default_rng(22), mean, std, cov)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(aug.test(raw, mean, std), aug.test(raw, mean, std))
