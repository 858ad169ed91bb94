"""The compiled loops of the cpu backend (`mpiasgd.ops.cpu_ops`), numba: batch normalisation.

The numpy reference makes a float64 copy of the whole activation for each sum and one pass per
operation; these loops read each channel once per sum and write each output once, with the
reference's arithmetic: float64 sums (eight fixed lanes, added in a fixed order at the end: the
same input gives the same bits, and no float atomics), and the per-element float32 operations in the
reference's order (numba's default makes no FMA contractions), so the elementwise results equal the
reference's whenever the sums round to the same float32 values, which they do up to float64 rounding.

`cache=True`: the machine code is stored beside this file (or in numba's user cache where that is
read-only) and loaded by later processes (`mpiasgd.optim.compiled` says more).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, boundscheck=False)
def _sum(row: np.ndarray, shift: float, square: bool, other: np.ndarray) -> float:
    """sum over i of (row[i] - shift) (square: its square; `other` not empty: times other[i]), in float64, in
    eight lanes a0..a7 (element i in lane i % 8), added as ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7))."""
    n = row.size
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    times = other.size > 0
    for i in range(0, n - n % 8, 8):
        v0, v1, v2, v3 = row[i] - shift, row[i + 1] - shift, row[i + 2] - shift, row[i + 3] - shift
        v4, v5, v6, v7 = row[i + 4] - shift, row[i + 5] - shift, row[i + 6] - shift, row[i + 7] - shift
        if square:
            v0, v1, v2, v3, v4, v5, v6, v7 = v0 * v0, v1 * v1, v2 * v2, v3 * v3, v4 * v4, v5 * v5, v6 * v6, v7 * v7
        elif times:
            v0, v1, v2, v3 = v0 * other[i], v1 * other[i + 1], v2 * other[i + 2], v3 * other[i + 3]
            v4, v5, v6, v7 = v4 * other[i + 4], v5 * other[i + 5], v6 * other[i + 6], v7 * other[i + 7]
        a0 += v0
        a1 += v1
        a2 += v2
        a3 += v3
        a4 += v4
        a5 += v5
        a6 += v6
        a7 += v7
    for i in range(n - n % 8, n):  # the tail, into the first lanes
        v = row[i] - shift
        if square:
            v = v * v
        elif times:
            v = v * other[i]
        if i % 8 == 0:
            a0 += v
        elif i % 8 == 1:
            a1 += v
        elif i % 8 == 2:
            a2 += v
        elif i % 8 == 3:
            a3 += v
        elif i % 8 == 4:
            a4 += v
        elif i % 8 == 5:
            a5 += v
        else:
            a6 += v
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@numba.njit(cache=True, boundscheck=False)
def batchnorm_stats(x3: np.ndarray, mean: np.ndarray, var: np.ndarray) -> None:
    """x3 (N, C, H*W) float -> mean (C,) and biased var (C,) float64: the mean, then the mean squared
    deviation from it (two passes, as the reference)."""
    N, C, HW = x3.shape
    none = np.empty(0, dtype=x3.dtype)
    for c in range(C):
        s = 0.0
        for n in range(N):
            s += _sum(x3[n, c], 0.0, False, none)
        m = s / (N * HW)
        d = 0.0
        for n in range(N):
            d += _sum(x3[n, c], m, True, none)
        mean[c] = m
        var[c] = d / (N * HW)


@numba.njit(cache=True, boundscheck=False)
def batchnorm_fprop(x3: np.ndarray, mean: np.ndarray, a: np.ndarray, beta: np.ndarray, y3: np.ndarray) -> None:
    """y = (x - mean) * a + beta per channel, in x's dtype, the reference's order; mean, a, beta (C,) x's dtype."""
    N, C, HW = x3.shape
    for n in range(N):
        for c in range(C):
            xr, yr = x3[n, c], y3[n, c]
            m, f, b = mean[c], a[c], beta[c]
            for i in range(HW):
                yr[i] = (xr[i] - m) * f + b


@numba.njit(cache=True, boundscheck=False)
def batchnorm_sums(dy3: np.ndarray, x3: np.ndarray, mean64: np.ndarray, sum_dy: np.ndarray,
                   sum_dy_dev: np.ndarray) -> None:
    """Per channel, float64: sum_dy = sum dy, sum_dy_dev = sum dy * (x - mean) (mean64 float64 (C,))."""
    N, C, _ = x3.shape
    none = np.empty(0, dtype=x3.dtype)
    for c in range(C):
        s = 0.0
        p = 0.0
        for n in range(N):
            s += _sum(dy3[n, c], 0.0, False, none)
            p += _sum(x3[n, c], mean64[c], False, dy3[n, c])
        sum_dy[c] = s
        sum_dy_dev[c] = p


@numba.njit(cache=True, boundscheck=False)
def batchnorm_dx(dy3: np.ndarray, x3: np.ndarray, mean: np.ndarray, neg_e: np.ndarray, a: np.ndarray, b: np.ndarray,
                 dx3: np.ndarray) -> None:
    """dx = (x - mean) * (-e) + dy * a - b per channel, in x's dtype, the reference's order."""
    N, C, HW = x3.shape
    for n in range(N):
        for c in range(C):
            xr, dr, out = x3[n, c], dy3[n, c], dx3[n, c]
            m, ne, f, g = mean[c], neg_e[c], a[c], b[c]
            for i in range(HW):
                out[i] = ((xr[i] - m) * ne + dr[i] * f) - g
