"""The compiled fp16 codec of the numpy path (`mpiasgd.comms.wire`: `--wire fp16` on the parameter server), numba.

numpy's float32 <-> float16 casts run fp16's subnormal range (|x| < 2^-14, where small gradients live) in
scalar code, and the integer workaround that replaced them (`wire._fp16_numpy`, `_fp16_decode_numpy`)
makes several passes over the data. These loops read each value once and write each result once, equal
bit for bit to numpy's casts for every input (numpy's `npy_floatbits_to_halfbits` and
`npy_halfbits_to_floatbits`: to nearest, ties to even; NaN payloads kept). With u the float32's bits and
a = u & 0x7FFFFFFF its magnitude:

    encode (float32 -> binary16 bits, by integer arithmetic):
      a > 0x7F800000   NaN        0x7C00 | max((a >> 13) & 0x3FF, 1)   (the payload's upper 10 bits, kept a NaN)
      a >= 0x477FF000  >= 65520   0x7C00, inf (65520 = 65504 + half its ulp: the tie goes to the even 0x7C00)
      otherwise        k = min(max(126 - (a >> 23), 13), 25) bits dropped from
                       v = a - 0x38000000   (a >= 0x38800000, normal: the exponent rebiased by -112; k = 13)
                       v = (a & 0x7FFFFF) | 0x800000  (subnormal: the 24-bit significand, k = 14 .. 25)
                       h = (v + 2^(k-1) - 1 + ((v >> k) & 1)) >> k   (to nearest, ties to even; a carry moves
                       into the exponent: 0x0400 is the smallest normal, 0x7C00 inf; k = 25 for |x| < 2^-25,
                       float32 subnormals and zeros: 0)
      then | (u >> 16) & 0x8000 (the sign)
    decode (binary16 bits h -> float32 bits, exact), e = h & 0x7FFF:
      e >= 0x7C00      inf, NaN   (e << 13) + 0x70000000 = 0x7F800000 | (h & 0x3FF) << 13 (payload kept)
      e >= 0x0400      normal     (e << 13) + 0x38000000 (the exponent rebiased by +112)
      otherwise        subnormal  the bits of float32(e) * 2^-24 (exact: e < 2^10, a power-of-two scaling into
                                  float32's normal range; e = 0 gives +0)
      then | (h & 0x8000) << 16

The cases are selects, not branches, so LLVM vectorizes both loops (AVX-512 on the development machine:
variable shifts, masked blends). numba widens integer operations to 64 bits: the encoder computes in int64
(8 values a register; signed, so that no mixed signed/unsigned operation is promoted to float64), the
decoder truncates each step back to uint32, which LLVM narrows to 16 values a register (1.5x faster than
int64 there). No fastmath: the one float operation (decode's subnormals) is exact.

`cache=True`: the machine code is stored beside this file (`mpiasgd.optim.compiled` says more). Imported
by the first numpy fp16 encode or decode (`wire.warm_up("fp16")` loads it ahead: the parameter server does,
before its clocks), not with `mpiasgd.comms.wire`: `import numba` alone takes 0.3-0.5 s, which fp32 and
bf16 never need.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, boundscheck=False)
def fp16_encode(bits: np.ndarray, out: np.ndarray) -> int:
    """bits: float32 values viewed as uint32 (n,); out: uint16 (n,) receives their binary16 bits (the module
    docstring's cases). int64 arithmetic (module docstring). Returns the largest magnitude's bits, max(a) (as
    float32 bits: the largest |x|, inf, or a NaN where there is one, since a NaN's bits exceed inf's; 0 for n = 0):
    `wire.encode_peak`'s measure of the range, in the same pass."""
    peak = np.int64(0)
    for i in range(bits.size):
        u = np.int64(bits[i])
        a = u & 0x7FFFFFFF
        peak = max(peak, a)
        e = a >> 23
        k = min(max(126 - e, 13), 25)                                   # bits dropped: 13 normal, 14..25 subnormal
        v = a - 0x38000000 if e >= 113 else (a & 0x7FFFFF) | 0x800000  # rebiased bits, or the significand
        h = (v + (1 << (k - 1)) - 1 + ((v >> k) & 1)) >> k              # to nearest, ties to even
        h = 0x7C00 if a >= 0x477FF000 else h                            # >= 65520 and inf: inf
        h = (0x7C00 | max((a >> 13) & 0x3FF, 1)) if a > 0x7F800000 else h  # NaN: its payload, kept a NaN
        out[i] = h | ((u >> 16) & 0x8000)
    return peak


U32 = np.uint32


@numba.njit(cache=True, boundscheck=False)
def fp16_decode(data: np.ndarray, out: np.ndarray) -> None:
    """data: binary16 bits, uint16 (n,); out: float32 (n,) viewed as uint32 receives the exact values' bits (the
    module docstring's cases). uint32 arithmetic, each step truncated back to 32 bits (module docstring)."""
    scale = np.float32(2.0 ** -24)
    for i in range(data.size):
        h = U32(data[i])
        e = U32(h & U32(0x7FFF))
        tiny = np.float32(np.float32(e) * scale).view(np.uint32)        # subnormal: exact (e < 2^10; 0 gives +0)
        f = U32((e << U32(13)) + U32(0x38000000)) if e >= U32(0x0400) else tiny
        f = U32((e << U32(13)) + U32(0x70000000)) if e >= U32(0x7C00) else f
        out[i] = f | U32((h & U32(0x8000)) << U32(16))
