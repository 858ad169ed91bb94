"""Wire formats of the parameter-server exchange (`--wire`): how the values of a PUSH, WEIGHTS or STOP
payload travel, as Horovod's `Compression.fp16` does for its allreduce.

    wire   bytes/value  what travels                                    relative error (normal values in range)
    fp32   4            the float32 values as they are (the default)    0
    fp16   2            IEEE 754 binary16 (np.float16)                   <= 2^-11 = 4.9e-4
    bf16   2            bfloat16: the upper 16 bits of the float32,      <= 2^-8  = 3.9e-3
                        rounded to nearest even, stored as uint16

Formulas (x float32, round to nearest, ties to even; decoding is exact):

    fp16   encode(x) = binary16 nearest to x      decode(h) = float32(h)
           NaN: sign | 0x7C00 | ((u >> 13) & 0x3FF), at least 0x7C01; decoded: sign << 16 | 0x7F800000 |
           (h & 0x3FF) << 13 (numpy's casts, payload kept; the device path rewrites CUDA's 0x7FFF / 0x7FFFFFFF)
    bf16   u = bits(x) (uint32);  encode(x) = (u + 0x7FFF + ((u >> 16) & 1)) >> 16   (uint16)
           NaN: (u >> 16) | 0x0040 (sign and payload's upper bits kept, the quiet bit set, so a NaN never
           rounds into inf);  decode(b) = float32 with bits (b << 16)

Range and what falls outside it:

    fp16   normal |x| in [2^-14, 65504] = [6.1e-5, 6.6e4]: |decode(encode(x)) - x| <= 2^-11 |x|. Subnormal
           below 2^-14 down to 2^-24 = 6.0e-8, absolute error <= 2^-25; |x| < 2^-25 becomes +-0.
           |x| >= 65520 (= 65504 + half its ulp) becomes +-inf: a gradient that large arrives as inf,
           and the server rejects the push, as it rejects a NaN (counted against --max-rejects), but names
           the cause: the worker measures the largest magnitude it encodes (`encode_peak`, in the encoder's
           own pass on numpy) and stamps it on the push (header `peak`), so the server tells a value beyond
           the range from a NaN or an inf of the float32 gradient, names it and points to bf16, whose range
           is float32's (`beyond_range`). The server measures its replies the same way and stops the run
           rather than send weights or buffers beyond the range (they would arrive as inf, and every worker
           would compute NaN).
    bf16   float32's exponent range: normal |x| >= 2^-126 = 1.2e-38, |decode(encode(x)) - x| <= 2^-8 |x|;
           float32 subnormals keep 7 bits (absolute error <= 2^-134); |x| >= 2^128 (1 - 2^-9) = 3.39e38
           becomes +-inf.
    both   NaN stays NaN, +-inf stays +-inf, +-0 stays +-0; a value the format holds exactly (every
           fp16 or bf16 number, e.g. small integers, powers of two) round-trips exactly.

Costs (P values): the payload is 2P bytes instead of 4P, so a push and its reply each move half the
bytes (the 160-byte header is unchanged). The parameter server (numpy) decodes every push and encodes
every reply. numpy's casts convert fp16's subnormal range (|x| < 2^-14, where small gradients live) in slow
scalar code, so numpy fp16 is one compiled pass each way (`wire_kernels`, numba), equal bit for bit to numpy's
casts (all 2^32 float32 inputs were checked once; the tests take every exponent, every tie, every NaN payload
class and all 65,536 fp16 patterns). Its costs against the blocked numpy path it replaced and against bf16
(`python bench/server.py --sweep`): docs/benchmarks/server.md, "The wire codecs". The encoder is bound by its
arithmetic (int64 lanes, see `wire_kernels`), the decoder by memory. So on a CPU server fp16 now costs
less than bf16 (whose numpy codec makes several integer passes over blocks of `BLOCK` values, whose
temporaries stay in L2), and either pays off where the link, not the server's core, limits the pushes
per second. A GPU worker encodes on the device before its device -> host copy, which then moves half
the bytes.

Every function here works on numpy and on cupy arrays alike: it is written only in array operations
both provide, with `xp` the module of the array given, so the tests of the numpy path check the
formula the GPU path runs. cupy is imported only when a cupy array is passed (never on the CPU path).
The one exception is fp16 on numpy, the compiled loops of `wire_kernels` (imported at the first numpy fp16
call; `warm_up` loads them ahead): the device casts in hardware, so cupy takes the plain cast (and rewrites
its NaN payloads as numpy's).

`ErrorFeedback` keeps what a compressed push rounded away and adds it to the next one (error feedback:
1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et al. 2019).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

WIRES = ("fp32", "fp16", "bf16")
DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(np.uint16)}
NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # what a size error calls the values
BOUND = {"fp32": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}        # relative error, normal values in range
BLOCK = 65536  # values per block of the numpy bf16 encoder (its uint32 temporaries: 256 KiB each, in L2)
FP16_MAX = 65504.0   # fp16's largest finite value
FP16_INF = 65520.0   # |x| >= this (65504 + half its ulp) encodes to fp16's inf


def wire_dtype(wire: str) -> np.dtype:
    """The dtype of a payload in wire format `wire`: float32, float16, or uint16 (bf16's bit patterns).
    ValueError naming the formats for an unknown `wire`."""
    try:
        return DTYPES[wire]
    except KeyError:
        raise ValueError(f"unknown wire format {wire!r}: expected one of {WIRES}") from None


def array_module(a: Any) -> Any:
    """numpy for a numpy array, else cupy (imported here, so only for a device array)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


def _check(what: str, a: Any, dtype: np.dtype, size: int) -> None:
    if a.dtype != dtype or a.ndim != 1 or a.size != size or not a.flags.c_contiguous:
        raise ValueError(f"{what} must be a 1-D C-contiguous {dtype} array of {size} values, "
                         f"got {a.dtype} shape {a.shape}{'' if a.flags.c_contiguous else ' (not contiguous)'}")


def encode(wire: str, values: Any, out: Any) -> Any:
    """Write float32 `values` ((n,), numpy or cupy) into `out` ((n,) of `wire_dtype(wire)`, same module) in
    format `wire` (the module docstring's formulas); returns `out`. fp32 copies. ValueError for a wrong
    dtype, shape or layout."""
    _check(f"encode({wire}): values", values, DTYPES["fp32"], values.size)
    _check(f"encode({wire}): out", out, wire_dtype(wire), values.size)
    xp = array_module(values)
    if wire == "fp32" or (wire == "fp16" and xp is not np):
        with np.errstate(over="ignore"):  # numpy warns where fp16 overflows to inf: documented, not an error
            out[...] = values        # fp16: the cast rounds to nearest even (numpy's and CUDA's __float2half_rn)
        if wire == "fp16":
            _fp16_nan_payloads(xp, values, out)
        return out
    if wire == "fp16":  # numpy: one compiled pass, numpy's cast bit for bit (`wire_kernels`)
        _kernels().fp16_encode(values.view(np.uint32), out.view(np.uint16))
        return out
    step = BLOCK if xp is np else max(1, values.size)  # numpy: blocks whose temporaries stay in L2
    for a in range(0, values.size, step):
        _bf16(xp, values[a : a + step], out[a : a + step])
    return out


def encode_peak(wire: str, values: Any, out: Any) -> float:
    """`encode(wire, values, out)`, and for fp16 the largest magnitude among `values` (`peak`: what the range
    check compares with FP16_INF; NaN where a value is NaN), measured in the encoder's own pass on numpy (a
    reduction on the device for cupy, whose answer crosses to the host). fp32 and bf16 (float32's range): 0.0,
    not measured."""
    if wire != "fp16":
        encode(wire, values, out)
        return 0.0
    if array_module(values) is np:  # the compiled encoder returns the largest magnitude's bits
        _check("encode(fp16): values", values, DTYPES["fp32"], values.size)
        _check("encode(fp16): out", out, DTYPES["fp16"], values.size)
        bits = _kernels().fp16_encode(values.view(np.uint32), out.view(np.uint16))
        return float(np.array(bits, np.uint32).view(np.float32))
    encode(wire, values, out)
    return peak(values)


def peak(values: Any) -> float:
    """The largest magnitude among float32 `values` ((n,), numpy or cupy) as a Python float: inf where one is
    infinite, NaN where one is NaN (a NaN's bits exceed inf's), 0.0 for none. One reduction over the values'
    bits (on the device for cupy)."""
    if values.size == 0:
        return 0.0
    xp = array_module(values)
    top = (values.view(xp.uint32) & xp.uint32(0x7FFFFFFF)).max()
    return float(np.array(int(top), np.uint32).view(np.float32))


def beyond_range(wire: str, largest: float) -> bool:
    """Whether values whose largest magnitude is `largest` (`encode_peak`) leave the range of `wire` while finite
    in float32: fp16 and FP16_INF <= largest < inf (a NaN or an inf was not finite before the wire)."""
    return wire == "fp16" and FP16_INF <= largest < math.inf


RANGE = f"[-{FP16_MAX:.0f}, {FP16_MAX:.0f}]"  # fp16's range as the messages name it


def _kernels() -> Any:
    """`mpiasgd.comms.wire_kernels`, imported at the first numpy fp16 encode or decode (it imports numba)."""
    from mpiasgd.comms import wire_kernels

    return wire_kernels


def warm_up(wire: str) -> None:
    """Load the compiled codec of format `wire` (fp16: numba's import and the cached machine code, or compiling
    it, 0.3-1 s; fp32, bf16: nothing) now, so that the first push is not held up: the parameter server calls
    it before its clocks start (`AsgdServer.warm_up`). Encodes and decodes one value; changes nothing."""
    if wire == "fp16":
        roundtrip(wire, np.zeros(1, np.float32))


def _fp16_nan_payloads(xp: Any, values: Any, out: Any) -> None:
    """fp16 NaNs as numpy's cast writes them: sign | 0x7C00 | the payload's upper 10 bits ((u >> 13) & 0x3FF),
    or 1 where those are 0 (so it stays a NaN). CUDA's __float2half_rn writes 0x7FFF for every NaN: the
    device path rewrites those elements, so both paths send the same bits (one more elementwise pass)."""
    u = values.view(xp.uint32)
    h = ((u >> 16) & 0x8000) | 0x7C00 | xp.maximum((u >> 13) & 0x3FF, 1)
    bits = out.view(xp.uint16)
    bits[...] = xp.where(xp.isnan(values), h.astype(xp.uint16), bits)


SUBNORMAL16 = np.float32(2.0 ** -14)  # fp16's smallest normal value: below it numpy casts in slow scalar code


def _fp16_numpy(xp: Any, values: np.ndarray, out: np.ndarray) -> None:
    """(Not used by `encode`: the numpy path before `wire_kernels`, kept as the reference `bench/server.py
    --sweep` times the compiled codec against, in blocks of `BLOCK`; a test checks both give the same bits.)
    fp16 on numpy: the cast, except for |x| < 2^-14, fp16's subnormal range, which numpy converts in
    scalar software code (about 45x slower: small gradients live there). There the binary16 value is
    m * 2^-24 with m = rint(|x| * 2^24) (a power-of-two scaling, exact in float32; rint rounds half to
    even, as the cast does; m = 1024 is the smallest normal value, bits 0x0400), and the sign bit of x."""
    small = np.abs(values) < SUBNORMAL16   # (NaN: False, cast)
    count = int(np.count_nonzero(small))
    if 8 * count < small.size:  # few: cast the rest, then write those few
        with np.errstate(over="ignore"):
            out[...] = np.where(small, np.float32(0), values) if count else values
        if count:
            tiny = values[small]
            m = np.rint(np.abs(tiny) * np.float32(2.0 ** 24)).astype(np.uint16)
            out.view(np.uint16)[small] = ((tiny.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)) | m
        return
    m = np.rint(np.fmin(np.abs(values), SUBNORMAL16) * np.float32(2.0 ** 24)).astype(np.uint16)  # <= 1024
    m |= (values.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
    with np.errstate(over="ignore"):
        normal = np.where(small, np.float32(0), values).astype(np.float16).view(np.uint16)
    out.view(np.uint16)[...] = np.where(small, m, normal)


def _bf16(xp: Any, values: Any, out: Any) -> None:
    """bf16 = the upper half of float32 rounded to nearest even (the module docstring's formula)."""
    u = values.view(xp.uint32)
    r = u >> 16                      # (n,) uint32: the bit kept last ...
    r &= 1                           # ... its parity decides a tie (to even)
    r += 0x7FFF
    r += u                           # carries into the upper half when the lower half is past the tie
    r >>= 16                         # (wraps only for negative NaNs, replaced next)
    nan = values != values
    if xp is not np or nan.any():    # numpy: skip the select when there is no NaN (the device never syncs)
        r = xp.where(nan, (u >> 16) | 0x0040, r)  # a NaN's sign and upper payload, quiet bit set: a NaN
    out[...] = r                     # < 2^16: the uint16 cast keeps every bit


def decode(wire: str, data: Any, out: Any) -> Any:
    """Write the values of payload `data` ((n,) of `wire_dtype(wire)`, numpy or cupy) into float32 `out`
    ((n,), same module), exactly; returns `out`. ValueError for a wrong dtype, shape or layout."""
    _check(f"decode({wire}): data", data, wire_dtype(wire), data.size)
    _check(f"decode({wire}): out", out, DTYPES["fp32"], data.size)
    if wire == "bf16":
        bits = out.view(array_module(out).uint32)
        bits[...] = data             # widened to uint32 ...
        bits <<= 16                  # ... into the upper half: the float32 whose upper half it was
    elif wire == "fp16" and isinstance(data, np.ndarray):  # one compiled pass, numpy's cast bit for bit
        _kernels().fp16_decode(data.view(np.uint16), out.view(np.uint32))
    else:
        out[...] = data
        if wire == "fp16":
            _fp16_decode_nan_payloads(array_module(out), data, out)
    return out


def _fp16_decode_nan_payloads(xp: Any, data: Any, out: Any) -> None:
    """fp16 NaNs decoded as numpy's cast decodes them: sign << 16 | 0x7F800000 | (h & 0x3FF) << 13 (the payload
    kept). CUDA's __half2float writes 0x7FFFFFFF for every NaN: the device path rewrites those elements."""
    h = data.view(xp.uint16).astype(xp.uint32)
    f = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
    bits = out.view(xp.uint32)
    bits[...] = xp.where(((h & 0x7C00) == 0x7C00) & ((h & 0x3FF) != 0), f, bits)


def _fp16_decode_numpy(data: np.ndarray, out: np.ndarray) -> None:
    """(Not used by `decode`: the reference `_fp16_numpy` is, for decoding.)
    fp16 -> float32 on numpy: the cast, except for fp16's subnormals (exponent bits 0), which numpy
    converts in slow scalar code: there the value is (-1)^sign * m * 2^-24, m the 10 mantissa bits (exact)."""
    bits = data.view(np.uint16)
    small = (bits & np.uint16(0x7C00)) == 0  # zeros and subnormals
    count = int(np.count_nonzero(small))
    if 8 * count < small.size:  # few: cast the rest, then write those few
        out[...] = np.where(small, np.float16(0), data) if count else data
        if count:
            few = bits[small]
            values = (few & np.uint16(0x03FF)).astype(np.float32) * np.float32(2.0 ** -24)
            out[small] = np.where(few & np.uint16(0x8000), -values, values)
        return
    tiny = (bits & np.uint16(0x03FF)).astype(np.float32) * np.float32(2.0 ** -24)
    tiny = np.where(bits & np.uint16(0x8000), -tiny, tiny)
    np.copyto(out, np.where(small, tiny, np.where(small, np.float16(0), data).astype(np.float32)))


def roundtrip(wire: str, values: Any) -> Any:
    """decode(encode(values)) as a new float32 array: what the other side of the wire sees."""
    xp = array_module(values)
    return decode(wire, encode(wire, values, xp.empty(values.size, wire_dtype(wire))),
                  xp.empty(values.size, xp.float32))


class ErrorFeedback:
    """Error feedback for a worker's compressed pushes (1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et
    al. 2019). For push t with values g_t (the gradient, or the nsync accumulated update):

        p_t = g_t + e_t                       e_1 = 0
        send encode(p_t)
        e_{t+1} = p_t - decode(encode(p_t))   (exact in float32: the part the wire format rounded away)

    so sum_t decode(encode(p_t)) + e_{T+1} = sum_t g_t (up to the float32 rounding of g_t + e_t): what a
    push loses is pushed later, not lost. It applies to the first `size` values of a payload (the P
    parameters); the values after them (the layer buffers: state, not increments) are encoded as they are.

    `residual` (float32 (size,), on the device of the values: numpy or cupy) is allocated at the first
    push. It is the worker's own state, shared by its stagings (--overlap has two): not checkpointed, so a
    resumed run starts again from e = 0 (one push's rounding at most is lost). A value the wire cannot
    hold (fp16 beyond 65504 becomes inf, or a NaN) goes out as it is (the server rejects that push) and
    its residual is reset to 0 rather than carried to poison every later push.
    """

    def __init__(self, wire: str, size: int) -> None:
        if wire not in WIRES or wire == "fp32":
            raise ValueError(f"error feedback needs a 16-bit wire format (fp16 or bf16), got {wire!r}")
        self.wire, self.size = wire, size
        self.residual: Any = None

    def encode(self, values: Any, out: Any) -> float:
        """Encode float32 `values` ((n,), n >= size) into `out` ((n,) of the wire's dtype), the first `size`
        through the residual (see the class docstring), which it updates; returns the largest magnitude of
        what it encoded (`encode_peak`: fp16; 0.0 for bf16)."""
        xp = array_module(values)
        if self.residual is None:
            self.residual = xp.zeros(self.size, xp.float32)
        e, n = self.residual, self.size
        e += values[:n]                                         # p = g + e
        largest = encode_peak(self.wire, e, out[:n])
        e -= decode(self.wire, out[:n], xp.empty(n, xp.float32))  # e <- p - decode(encode(p))
        e[...] = xp.where(xp.isfinite(e), e, xp.float32(0))     # inf or NaN went out as such: not carried on
        rest = encode_peak(self.wire, values[n:], out[n:])
        return largest if largest != largest or largest >= rest else rest  # (a NaN wins, as in `peak`)
