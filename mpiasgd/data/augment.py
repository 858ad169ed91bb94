"""Training-time augmentation and evaluation-time cropping of uint8 NCHW batches, whole batch at once.

`Augmentation` is what `--augment` names: a comma-separated list of items, at most one crop kind,

    pad-crop=P       zero-pad P pixels on each side (after normalising, so the border is the channel
                     mean) and take a random crop of the original size; the CIFAR-10 augmentation of
                     He et al. 2016, "Deep residual learning", sec. 4.2. Test: normalise only.
    inner-crop=S     a random S x S window inside the image, no padding: cuda-convnet's "inner size"
                     (Krizhevsky et al. 2012, "ImageNet classification with deep CNNs", sec. 4.1).
                     Test: the centre S x S window, offset ((H - S) // 2, (W - S) // 2).
    resized-crop=S   random-resized crop (Szegedy et al. 2015, "Going deeper with convolutions", sec. 6,
                     as torchvision's RandomResizedCrop), resized to S x S by Pillow's bilinear filter.
                     Test: the centre square of side round(0.875 * min(H, W)), resized to S x S.
    flip             mirror left-right with p = 0.5.
    pca-noise=SIGMA  AlexNet's colour noise (Krizhevsky et al. 2012, sec. 4.1): the offset
                     eigvec @ (alpha * eigval) / 255, alpha ~ N(0, SIGMA) (3,) per image, added to every
                     pixel before normalising; eigval, eigvec of the train split's (3, 3) pixel covariance
                     in 0..255 units (the paper's form on pixels in [0, 1], scaled to 0..255: SIGMA = 0.1
                     is the paper's 0.1).
    none             alone: no augmentation (training normalises only).

    aug = Augmentation.parse("pad-crop=4,flip")          # or Augmentation.default(image_shape)
    aug.check(image_shape, pixel_cov)                     # DataError now rather than mid-run
    x = aug.train(raw, rng, mean, std, pixel_cov)         # float32 (B, C, H', W'), normalised
    x = aug.test(raw, mean, std)                          # the deterministic evaluation view

`random_crop_flip` and `crop_flip` are the pad-crop + flip of normalised float32 batches that
`Augmentation.parse("pad-crop=4,flip").train` reproduces bit for bit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
from PIL import Image

from mpiasgd.data.errors import DataError

PAD = 4  # pixels of zero padding on each side before the random crop

CROPS = ("none", "pad-crop", "inner-crop", "resized-crop")  # values of Augmentation.crop
VALID_ITEMS = "pad-crop=P | inner-crop=S | resized-crop=S (at most one), flip, pca-noise=SIGMA; or none alone"
RESIZED_SCALE = (0.08, 1.0)  # resized-crop: range of the window's area as a fraction of the image's
RESIZED_RATIO = (3 / 4, 4 / 3)  # resized-crop: range of the window's width / height (log-uniform)
RESIZED_TRIES = 10  # resized-crop: windows drawn per image before the fallback centre crop
RESIZED_TEST_FRACTION = 0.875  # resized-crop test: centre square side / shorter image side (224 of 256)
_INT = re.compile(r"[0-9]+")


def crop_flip(x: np.ndarray, top: np.ndarray, left: np.ndarray, flip: np.ndarray, pad: int) -> np.ndarray:
    """Crop and optionally flip every image of a batch with given parameters (deterministic).

    x: (B, C, H, W) array. top, left: int (B,) in 0..2*pad, the corner of the H x W crop in the
    image zero-padded by `pad` on every side, so image b is shifted down by pad - top[b] and right
    by pad - left[b]. flip: bool (B,), mirror left-right after cropping.
    Returns a new C-contiguous (B, C, H, W) array of x's dtype. One gather, no loop over images.
    """
    b, c, h, w = x.shape
    padded = np.zeros((b, c, h + 2 * pad, w + 2 * pad), dtype=x.dtype)  # (B, C, H+2p, W+2p)
    padded[:, :, pad : pad + h, pad : pad + w] = x
    return _windows(padded, top, left, h, w, flip)


def random_crop_flip(x: np.ndarray, rng: np.random.Generator, pad: int = PAD) -> np.ndarray:
    """Random crop with zero padding `pad` and horizontal flip with p = 0.5, per image.

    x: normalised float32 (B, C, H, W). Draws, in this order, top (B,), left (B,) uniform in
    0..2*pad and flip (B,) from rng, so the result is a function of x and the rng state.
    Returns a new C-contiguous float32 (B, C, H, W) array.
    """
    if x.ndim != 4:
        raise ValueError(f"random_crop_flip expects (B, C, H, W), got shape {x.shape}")
    n = x.shape[0]
    top = rng.integers(0, 2 * pad + 1, size=n)
    left = rng.integers(0, 2 * pad + 1, size=n)
    flip = rng.random(n) < 0.5
    return crop_flip(x, top, left, flip, pad)


@dataclass(frozen=True)
class Augmentation:
    """A training augmentation and its evaluation view, as named by `--augment` (see the module docstring).

    Build one with `parse` or `default`; `describe` gives the canonical text back. `train` and `test`
    take raw uint8 (B, C, H, W) NCHW pixels and return new C-contiguous float32 (B, C, H', W'), each
    channel normalised as (x - mean) / std, (H', W') = `output_shape`.

    `train` draws from the rng in this fixed order, only for the items present, so its result is a
    function of (raw, rng state):
      1. the crop: pad-crop=P: top (B,), left (B,) integers in 0..2P (as `random_crop_flip`);
         inner-crop=S: top (B,) in 0..H-S, left (B,) in 0..W-S;
         resized-crop=S: area fractions (B, 10) uniform in [0.08, 1], log aspect ratios (B, 10) uniform
         in [log 3/4, log 4/3], then top (B,) and left (B,) uniform over the chosen window's positions.
      2. flip: (B,) uniform in [0, 1), mirrored where < 0.5.
      3. pca-noise=SIGMA: alpha (B, 3) normal with mean 0 and standard deviation SIGMA.
    So "pad-crop=4,flip" is `random_crop_flip(normalised, rng, 4)` exactly, and "none" draws nothing.

    The steps: crop (inner, resized) on uint8 -> flip (unless pad-crop) -> float32 -> PCA offset in
    pixel units -> x -= mean, x /= std -> pad-crop and flip (one gather, as `crop_flip`). A pad-crop's
    border is therefore 0 after normalising (the channel mean) and carries no colour noise.
    Raises DataError (from `mpiasgd.data.dataset`) for fields that name no valid augmentation.
    """

    crop: str = "none"  # one of CROPS
    crop_size: int = 0  # pixels: pad-crop: P, the padding on each side; inner-/resized-crop: S, the output side
    flip: bool = False  # mirror left-right with p = 0.5
    pca_noise: float = 0.0  # AlexNet's colour noise: SIGMA, standard deviation of alpha; 0 = off

    def __post_init__(self) -> None:
        if self.crop not in CROPS:
            _fail(f"crop must be one of {', '.join(CROPS)}, got {self.crop!r}")
        if (self.crop == "none") != (self.crop_size == 0) or self.crop_size < 0:
            _fail(f"crop_size must be >= 1 with a crop and 0 without, got {self.crop} with {self.crop_size}")
        if not (math.isfinite(self.pca_noise) and self.pca_noise >= 0):
            _fail(f"pca_noise must be a finite SIGMA >= 0 (0 = off), got {self.pca_noise}")

    @classmethod
    def parse(cls, text: str) -> Augmentation:
        """Parse `--augment` text: comma-separated items (spaces around them ignored), see the module docstring.

        P and S are integers >= 1, SIGMA a finite float > 0; at most one crop kind, each item at most
        once, `none` only alone. Raises DataError naming the bad item and listing the valid ones.
        """
        items = [item.strip() for item in str(text).split(",")]
        if items == ["none"]:
            return cls()
        fields: dict[str, object] = {}
        seen: set[str] = set()
        for item in items:
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()

            def bad(why: str, item: str = item) -> NoReturn:
                _fail(f"augmentation {text!r}: item {item!r} {why}; valid items: {VALID_ITEMS}")

            if key in seen:
                bad("is given twice")
            seen.add(key)
            if key == "none":
                bad("must stand alone")
            elif key == "flip":
                if eq:
                    bad("takes no value")
                fields["flip"] = True
            elif key in ("pad-crop", "inner-crop", "resized-crop"):
                if "crop" in fields:
                    bad(f"is a second crop after {fields['crop']}")
                if not _INT.fullmatch(value) or int(value) < 1:
                    bad("needs an integer >= 1 of pixels (pad-crop=P, inner-crop=S, resized-crop=S)")
                fields["crop"], fields["crop_size"] = key, int(value)
            elif key == "pca-noise":
                try:
                    sigma = float(value)
                except ValueError:
                    sigma = math.nan
                if not (math.isfinite(sigma) and sigma > 0):
                    bad("needs a finite number SIGMA > 0 (pca-noise=SIGMA)")
                fields["pca_noise"] = sigma
            else:
                bad("is unknown" if key else "is empty")
        return cls(**fields)

    @classmethod
    def default(cls, image_shape: tuple[int, int, int]) -> Augmentation:
        """The augmentation of a dataset of (C, H, W) images when none is asked for.

        "pad-crop=4,flip" (He et al. 2016) for H and W >= 32, else "none" (e.g. the 8x8 digits).
        """
        _, h, w = image_shape
        return cls("pad-crop", PAD, flip=True) if h >= 32 and w >= 32 else cls()

    @property
    def random(self) -> bool:
        """True when `train` draws anything from the rng, i.e. for anything but `none`."""
        return self.crop != "none" or self.flip or self.pca_noise > 0

    def describe(self) -> str:
        """The canonical text: crop, flip, pca-noise in that order, or "none"; parse(describe()) == self."""
        items = [f"{self.crop}={self.crop_size}"] if self.crop != "none" else []
        if self.flip:
            items.append("flip")
        if self.pca_noise > 0:
            items.append(f"pca-noise={float(self.pca_noise)!r}")
        return ",".join(items) or "none"

    def check(self, image_shape: tuple[int, ...], channels_cov: np.ndarray | None = None) -> None:
        """Raise DataError when this augmentation cannot apply to (C, H, W) images.

        inner-crop=S needs S <= H and S <= W. pca-noise needs C == 3 and channels_cov, the float
        (3, 3) covariance of a pixel's channels (pixel units), finite and symmetric.
        """
        _check_shape(self, image_shape)
        if self.pca_noise > 0:
            c = image_shape[0]
            if c != 3:
                _fail(f"augmentation {self.describe()!r}: pca-noise needs RGB images (3 channels), got {c}")
            if channels_cov is None:
                _fail(f"augmentation {self.describe()!r}: pca-noise needs the covariance of a pixel's channels "
                      "(pixel_cov), and none is known for this data")
            cov = np.asarray(channels_cov, dtype=np.float64)
            if cov.shape != (3, 3) or not np.all(np.isfinite(cov)) or not np.allclose(cov, cov.T):
                _fail(f"augmentation {self.describe()!r}: pca-noise needs a finite symmetric (3, 3) pixel "
                      f"covariance, got shape {cov.shape}")

    def output_shape(self, image_shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(C, H', W') of what `train` and `test` return for (C, H, W) images: (C, S, S) after an
        inner-/resized-crop=S, else (C, H, W)."""
        c, h, w = (int(d) for d in image_shape)
        if self.crop in ("inner-crop", "resized-crop"):
            return c, self.crop_size, self.crop_size
        return c, h, w

    def train(self, raw: np.ndarray, rng: np.random.Generator, mean: np.ndarray, std: np.ndarray,
              pixel_cov: np.ndarray | None = None) -> np.ndarray:
        """Augment and normalise a training batch; draws from rng in the order of the class docstring.

        raw: uint8 (B, C, H, W). mean, std: float (C,), pixel units (taken as float32). pixel_cov:
        float (C, C) covariance of a pixel's channels over the training set, pixel units; needed by
        pca-noise only. Returns a new C-contiguous float32 (B, C, H', W'), (H', W') from `output_shape`.
        Raises DataError for a batch this augmentation cannot apply to (see `check`).
        """
        mean, std = _stats(raw, mean, std)
        self.check(raw.shape[1:], pixel_cov)
        b, _, h, w = raw.shape
        s = self.crop_size
        top = left = np.zeros(b, dtype=np.int64)  # crop corners (B,): in the padded image for pad-crop
        if self.crop == "pad-crop":
            top = rng.integers(0, 2 * s + 1, size=b)
            left = rng.integers(0, 2 * s + 1, size=b)
        elif self.crop == "inner-crop":
            top = rng.integers(0, h - s + 1, size=b)
            left = rng.integers(0, w - s + 1, size=b)
        elif self.crop == "resized-crop":
            top, left, win_h, win_w = resized_crop_windows(h, w, b, rng)
        flip = rng.random(b) < 0.5 if self.flip else np.zeros(b, dtype=bool)
        offset = None
        if self.pca_noise > 0:
            alpha = rng.normal(0.0, self.pca_noise, size=(b, 3))  # (B, 3)
            offset = pca_offsets(alpha, pixel_cov)  # (B, 3) float64, pixel units

        # crop and flip in uint8 where the crop needs no padding (less to convert and normalise)
        if self.crop == "inner-crop":
            raw = _windows(raw, top, left, s, s, flip)  # (B, C, S, S)
        elif self.crop == "resized-crop":
            raw = resize_windows(raw, top, left, win_h, win_w, s)  # (B, C, S, S), a fresh array
            raw[flip] = raw[flip][..., ::-1]
        elif self.crop == "none" and self.flip:
            raw = _windows(raw, top, left, h, w, flip)
        x = raw.astype(np.float32)  # (B, C, H', W'), a fresh C-contiguous copy
        if offset is not None:
            x += offset.astype(np.float32)[:, :, None, None]  # the same colour shift on every pixel of image b
        x -= mean[:, None, None]
        x /= std[:, None, None]
        if self.crop == "pad-crop":
            x = crop_flip(x, top, left, flip, s)
        return x

    def test(self, raw: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
        """The deterministic evaluation view of a batch, normalised; draws nothing.

        raw: uint8 (B, C, H, W); mean, std: float (C,), pixel units. none, pad-crop: the whole image.
        inner-crop=S: the centre S x S window at ((H - S) // 2, (W - S) // 2), cuda-convnet's.
        resized-crop=S: the centre square of side c = round(0.875 * min(H, W)) at ((H - c) // 2,
        (W - c) // 2), resized to S x S bilinear: crop-then-resize, close to (not exactly)
        torchvision's Resize(S / 0.875) + CenterCrop(S). flip and pca-noise do nothing here.
        Returns a new C-contiguous float32 (B, C, H', W'). Raises DataError as `check` (without pca).
        """
        mean, std = _stats(raw, mean, std)
        _check_shape(self, raw.shape[1:])
        b, _, h, w = raw.shape
        if self.crop == "inner-crop":
            s = self.crop_size
            raw = raw[:, :, (h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]
        elif self.crop == "resized-crop":
            side = max(1, round(RESIZED_TEST_FRACTION * min(h, w)))
            full = np.full(b, side)
            raw = resize_windows(raw, np.full(b, (h - side) // 2), np.full(b, (w - side) // 2), full, full,
                                 self.crop_size)
        x = raw.astype(np.float32)  # (B, C, H', W'), a fresh C-contiguous copy
        x -= mean[:, None, None]
        x /= std[:, None, None]
        return x


def resized_crop_windows(h: int, w: int, b: int, rng: np.random.Generator
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Draw b random-resized-crop windows in an h x w image, as torchvision's RandomResizedCrop.get_params.

    Per image, 10 tries of area fraction uniform in [0.08, 1] and width / height log-uniform in
    [3/4, 4/3]; window sides round(sqrt(area * ratio)) x round(sqrt(area / ratio)) (round half to even,
    as Python's round); the first try that fits the image wins, at a uniform position. No try fits:
    torchvision's fallback, the whole image clipped to the ratio range, centred at ((h - wh) // 2,
    (w - ww) // 2). Draws scale (b, 10), log ratio (b, 10), top (b,), left (b,) -- all of them, whatever
    try wins, so the draws do not depend on the image. Returns top, left, height, width: int64 (b,).
    """
    area = h * w * rng.uniform(*RESIZED_SCALE, size=(b, RESIZED_TRIES))  # (B, 10) pixels^2
    ratio = np.exp(rng.uniform(math.log(RESIZED_RATIO[0]), math.log(RESIZED_RATIO[1]), size=(b, RESIZED_TRIES)))
    ww = np.rint(np.sqrt(area * ratio)).astype(np.int64)  # (B, 10)
    wh = np.rint(np.sqrt(area / ratio)).astype(np.int64)
    fits = (ww > 0) & (ww <= w) & (wh > 0) & (wh <= h)  # (B, 10)
    first = np.argmax(fits, axis=1)  # (B,) the first try that fits (0 where none does)
    ok = fits[np.arange(b), first]
    # the fallback window: the whole image, clipped to the ratio range
    if w / h < RESIZED_RATIO[0]:
        fw, fh = w, round(w / RESIZED_RATIO[0])
    elif w / h > RESIZED_RATIO[1]:
        fw, fh = round(h * RESIZED_RATIO[1]), h
    else:
        fw, fh = w, h
    win_h = np.where(ok, wh[np.arange(b), first], fh)
    win_w = np.where(ok, ww[np.arange(b), first], fw)
    top = np.where(ok, np.floor(rng.random(b) * (h - win_h + 1)), (h - fh) // 2).astype(np.int64)
    left = np.where(ok, np.floor(rng.random(b) * (w - win_w + 1)), (w - fw) // 2).astype(np.int64)
    return top, left, win_h, win_w


def resize_windows(raw: np.ndarray, top: np.ndarray, left: np.ndarray, win_h: np.ndarray, win_w: np.ndarray,
                   size: int) -> np.ndarray:
    """Resize window b of image b (rows top..top+win_h, columns left..left+win_w) of uint8 raw (B, C, H, W)
    to size x size with Pillow's bilinear filter (antialiased when shrinking, as torchvision on PIL images).

    Returns a new uint8 (B, C, size, size). One Pillow call per image and channel (an "L" image each:
    faster than an RGB image, which needs an HWC copy, and bit-identical to it).
    """
    raw = np.ascontiguousarray(raw)
    b, c = raw.shape[:2]
    out = np.empty((b, c, size, size), dtype=np.uint8)
    for i in range(b):
        box = (int(left[i]), int(top[i]), int(left[i] + win_w[i]), int(top[i] + win_h[i]))  # (x0, y0, x1, y1)
        for ch in range(c):
            out[i, ch] = np.asarray(Image.fromarray(raw[i, ch]).resize((size, size), Image.BILINEAR, box=box))
    return out


def pca_offsets(alpha: np.ndarray, pixel_cov: np.ndarray) -> np.ndarray:
    """AlexNet's colour noise (Krizhevsky et al. 2012, sec. 4.1): the offset [p1 p2 p3] (alpha * lambda)
    of each image, with p_k, lambda_k the eigenvectors and eigenvalues of pixel_cov.

    alpha: float (B, 3); pixel_cov: float (3, 3), 0..255 pixel units squared. Returns float64 (B, 3) in
    0..255 pixel units. The paper's convention, pixels in [0, 1]: lambda_01 = lambda / 255^2 and the
    offset 255 p (alpha lambda_01) = p (alpha lambda) / 255, so SIGMA = 0.1 is the paper's 0.1 whatever
    the pixel range.
    """
    eigval, eigvec = np.linalg.eigh(np.asarray(pixel_cov, dtype=np.float64))  # (3,), (3, 3) columns p_k
    return (alpha * eigval) @ eigvec.T / 255.0  # (B, 3): row b = eigvec @ (alpha_b * eigval) / 255


def _windows(x: np.ndarray, top: np.ndarray, left: np.ndarray, h: int, w: int, flip: np.ndarray) -> np.ndarray:
    """Window b of x (B, C, H, W): rows top[b]..+h, columns left[b]..+w, mirrored where flip[b].

    Returns a new C-contiguous (B, C, h, w) array of x's dtype. One gather, no loop over images.
    """
    b, c = x.shape[:2]
    rows = np.asarray(top)[:, None] + np.arange(h)  # (B, h) rows of x to read
    cols = np.asarray(left)[:, None] + np.arange(w)  # (B, w)
    cols = np.where(np.asarray(flip)[:, None], cols[:, ::-1], cols)
    return x[
        np.arange(b)[:, None, None, None],
        np.arange(c)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]  # (B, C, h, w)


def _check_shape(aug: Augmentation, image_shape: tuple[int, ...]) -> None:
    """DataError unless image_shape is (C, H, W) >= 1 that aug's crop fits in."""
    if len(image_shape) != 3 or min(image_shape) < 1:
        _fail(f"augmentation {aug.describe()!r}: images must be (C, H, W) with every side >= 1, got {image_shape}")
    _, h, w = image_shape
    if aug.crop == "inner-crop" and (aug.crop_size > h or aug.crop_size > w):
        _fail(f"augmentation {aug.describe()!r}: the {aug.crop_size}x{aug.crop_size} crop is larger than the "
              f"{h}x{w} images")


def _stats(raw: np.ndarray, mean: np.ndarray, std: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Check a batch and its per-channel stats; returns mean, std as float32 (C,)."""
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 4:
        _fail(f"augmentation: expected raw uint8 (B, C, H, W), got {getattr(raw, 'dtype', type(raw))} "
              f"{getattr(raw, 'shape', '')}")
    mean = np.asarray(mean, dtype=np.float32)
    std = np.asarray(std, dtype=np.float32)
    if mean.shape != (raw.shape[1],) or std.shape != (raw.shape[1],):
        _fail(f"augmentation: mean and std must be ({raw.shape[1]},), got {mean.shape} and {std.shape}")
    return mean, std


def _fail(message: str) -> NoReturn:
    """Raise DataError(message)."""

    raise DataError(message)
