"""Training-time augmentation: random crop with zero padding and horizontal flip, whole batch at once.

The standard CIFAR-10 augmentation (He et al. 2016, "Deep residual learning", sec. 4.2): pad each
side by 4, take a random 32x32 crop, flip left-right with probability 0.5. It runs on the
normalised float32 batch, so the zero padding is the channel mean in pixel units.
"""

from __future__ import annotations

import numpy as np

PAD = 4  # pixels of zero padding on each side before the random crop


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
    rows = np.asarray(top)[:, None] + np.arange(h)  # (B, H) rows of the padded image to read
    cols = np.asarray(left)[:, None] + np.arange(w)  # (B, W)
    cols = np.where(np.asarray(flip)[:, None], cols[:, ::-1], cols)
    return padded[
        np.arange(b)[:, None, None, None],
        np.arange(c)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]  # (B, C, H, W)


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
