"""Convolution cases shared by the ops tests of the numpy reference (tests/unit/test_ops.py) and of the cpu
backend (tests/unit/test_cpu_ops.py): the geometries, their random arrays, and a direct loop."""

from __future__ import annotations

import numpy as np


def naive_conv(x, w, b, stride, pad):
    """Direct loop over output pixels: y[n,k,p,q] = b[k] + sum_{c,r,s} w[k,c,r,s] * xpad[n,c,p*st+r,q*st+s]."""
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    xp = np.zeros((N, C, H + 2 * pad, W + 2 * pad), dtype=np.float64)
    xp[:, :, pad:pad + H, pad:pad + W] = x
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    y = np.zeros((N, K, P, Q))
    for n in range(N):
        for k in range(K):
            for p in range(P):
                for q in range(Q):
                    patch = xp[n, :, p * stride:p * stride + R, q * stride:q * stride + S]
                    y[n, k, p, q] = np.sum(patch * w[k]) + (0.0 if b is None else b[k])
    return y


# (N, C, H, W, K, R, S, stride, pad): stride 1/2/3, pad 0/1/2, odd and non-square inputs and
# kernels; covers both dgrad paths (stride 1 with pad < kernel -> as a convolution; else col2im)
CONV_CASES = [
    (2, 3, 5, 5, 4, 3, 3, 1, 0),
    (2, 2, 7, 6, 3, 3, 3, 2, 1),
    (1, 3, 6, 9, 2, 5, 5, 1, 2),
    (2, 1, 8, 5, 2, 3, 2, 2, 2),
    (1, 2, 5, 4, 3, 1, 1, 1, 1),
    (2, 2, 9, 7, 2, 3, 3, 3, 1),
    (1, 2, 6, 7, 3, 2, 4, 1, 1),
    (1, 2, 4, 4, 2, 3, 3, 1, 2),
]


def conv_case(case, seed=0):
    """(x, w, b, stride, pad) of a CONV_CASES entry: float64 normal arrays from `seed`."""
    N, C, H, W, K, R, S, stride, pad = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, C, H, W))
    w = rng.standard_normal((K, C, R, S))
    b = rng.standard_normal(K)
    return x, w, b, stride, pad
