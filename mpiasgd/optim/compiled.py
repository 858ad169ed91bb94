"""The parameter server's updates as single compiled loops (numba): `sgd_blocks` for `SGD.step`,
`add_scaled` for `apply_delta`.

A memory-bound update should touch each array once. numpy cannot: each operation is its own pass, so
`NumpySGD` runs six of them over every block while it sits in L2. A compiled loop reads the gradient,
the weights and the velocity once and writes the velocity and the new weights once, element by
element, in AVX registers.

The loops do the float32 operations of `NumpySGD`, in its order, so the results are equal to it bit
for bit: numba's default (no `fastmath`) lets LLVM neither reassociate nor contract a multiply and an
add into an FMA, and every scalar is cast to float32 before it enters (a Python float would make the
arithmetic float64). A NaN's payload is the one thing that may differ (LLVM may swap the operands of
an addition); a push holding one is rejected before it reaches the update.

Arguments that are None select what the loop reads: `out` None writes the new weights over `w` (in
place), `v` None is momentum 0 (no velocity), `decay` None takes each block's decay coefficient from
`coefs` (else the (P,) vector is read), `lr_scale` None takes each block's lr multiplier from
`mults`. numba compiles one machine-code version per pattern of None arguments; inside the loop the
`is None` tests are loop-invariant and LLVM moves them out of it, so each pattern runs as a straight,
vectorized loop (AVX-512 here). Two details keep it vectorized: the loop indexes slices from 0 (an
index that numba cannot prove >= 0 gets a wraparound test on every access, which stops the
vectorizer), and in place it writes through `w` itself (two array arguments that are the same memory
fail LLVM's runtime overlap check, which falls back to scalar code: 1.4-1.8x slower).

`cache=True`: the machine code is stored beside this file (`__pycache__`, or numba's user cache
directory when that is read-only) and loaded by the next process, `import numba` included, in
0.4-0.5 s; compiling what a server runs takes 2.5-3.3 s (see `SGD`). Imported by the first update,
not with `mpiasgd.optim`: `import numba` alone takes 0.3-0.5 s, which the workers never need.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, boundscheck=False)
def _sgd_block(w, g, out, v, decay, lr_scale, coef, momentum, nesterov, lr, grad_scale, step_size):
    """One block of `sgd_blocks`: all arrays are the block's slices (None as in the module docstring)."""
    for i in range(g.size):
        # d = s_g * g + decay * w; NumpySGD skips a zero coefficient's term, so does this loop
        if decay is not None:
            t = g[i] * grad_scale + w[i] * decay[i]
        elif coef != 0:
            t = g[i] * grad_scale + w[i] * coef
        else:
            t = g[i] * grad_scale                      # s_g = 1: g * 1 is g, bit for bit
        if v is not None:
            u = v[i] * momentum + t                    # v = m * v + d
            v[i] = u
            t = u * momentum + t if nesterov else u    # nesterov: d + m * v (the new v)
        s = lr_scale[i] * lr if lr_scale is not None else step_size
        if out is None:
            w[i] = w[i] - t * s                        # w - (lr * lr_mult) * v, in place
        else:
            out[i] = w[i] - t * s


@numba.njit(cache=True, boundscheck=False)
def sgd_blocks(w: np.ndarray, g: np.ndarray, out: np.ndarray | None, v: np.ndarray | None, decay: np.ndarray | None,
               lr_scale: np.ndarray | None, starts: np.ndarray, stops: np.ndarray, coefs: np.ndarray,
               mults: np.ndarray, momentum: np.float32, nesterov: bool, lr: np.float32,
               grad_scale: np.float32) -> None:
    """`NumpySGD.step`'s update over the blocks [starts[k], stops[k]) (int64 (K,)), block k with decay
    coefficient coefs[k] and lr multiplier mults[k] (float32 (K,); read only where `decay` / `lr_scale`
    is None). w, g, out, v, decay, lr_scale: float32 (P,) or None (module docstring); momentum, lr,
    grad_scale: float32; nesterov: bool. Updates `v` in place and writes the new weights into `out`
    (or `w`)."""
    for k in range(starts.size):
        a, b = starts[k], stops[k]
        _sgd_block(w[a:b], g[a:b], None if out is None else out[a:b], None if v is None else v[a:b],
                   None if decay is None else decay[a:b], None if lr_scale is None else lr_scale[a:b],
                   coefs[k], momentum, nesterov, lr, grad_scale, lr * mults[k])  # lr * mult: float32, as numpy


@numba.njit(cache=True, boundscheck=False, parallel=True)
def sgd_blocks_parallel(w: np.ndarray, g: np.ndarray, out: np.ndarray | None, v: np.ndarray | None,
                        decay: np.ndarray | None, lr_scale: np.ndarray | None, starts: np.ndarray, stops: np.ndarray,
                        coefs: np.ndarray, mults: np.ndarray, momentum: np.float32, nesterov: bool, lr: np.float32,
                        grad_scale: np.float32) -> None:
    """`sgd_blocks` with the blocks shared among numba's threads (`numba.set_num_threads`): each block is the
    same loop on its own slices, so the results are equal to `sgd_blocks`' bit for bit."""
    for k in numba.prange(starts.size):
        a, b = starts[k], stops[k]
        _sgd_block(w[a:b], g[a:b], None if out is None else out[a:b], None if v is None else v[a:b],
                   None if decay is None else decay[a:b], None if lr_scale is None else lr_scale[a:b],
                   coefs[k], momentum, nesterov, lr, grad_scale, lr * mults[k])


@numba.njit(cache=True, boundscheck=False)
def add_scaled(params: np.ndarray, delta: np.ndarray, scale: np.float32, out: np.ndarray | None) -> None:
    """out = params + scale * delta (float32 (P,), scale float32); `out` None: in place into `params`."""
    for i in range(params.size):
        if out is None:
            params[i] = params[i] + delta[i] * scale
        else:
            out[i] = params[i] + delta[i] * scale


@numba.njit(cache=True, boundscheck=False, parallel=True)
def add_scaled_parallel(params: np.ndarray, delta: np.ndarray, scale: np.float32, out: np.ndarray | None,
                        chunk: int) -> None:
    """`add_scaled` in blocks of `chunk` values shared among numba's threads (the same bits)."""
    n = params.size
    for k in numba.prange((n + chunk - 1) // chunk):
        a = k * chunk
        b = min(n, a + chunk)
        add_scaled(params[a:b], delta[a:b], scale, None if out is None else out[a:b])


@numba.njit(cache=True, boundscheck=False, error_model="numpy")
def gap_penalize(g: np.ndarray, w: np.ndarray, pulled: np.ndarray, mean_step: np.ndarray, unbias: np.float32) -> None:
    """Gap-Aware's penalty in place (`mpiasgd.optim.delay.GapAware.penalize`): g /= max(1, |w - pulled| / C) with
    C = mean_step * unbias (`unbias` the float32 inverse of the mean's bias correction), written as g * (C / gap)
    where the gap exceeds C (one division, and a select the vectorizer keeps), a weight whose C is 0 left alone;
    float32 (P,) arrays."""
    one = np.float32(1)
    for i in range(g.size):
        c = mean_step[i] * unbias
        d = abs(w[i] - pulled[i])
        r = c / d if d > c and c > 0 else one  # (error_model numpy: no check for a zero divisor, never taken)
        g[i] = g[i] * r


@numba.njit(cache=True, boundscheck=False)
def gap_observe(mean_step: np.ndarray, v: np.ndarray, lr: np.float32, lr_scale: np.ndarray | None,
                decay: np.float32, one_minus: np.float32) -> None:
    """Gap-Aware's running mean of one update's step (`GapAware.observe`): mean_step = decay * mean_step +
    (1 - decay) * |lr * lr_scale * v|; float32 (P,) arrays (`lr_scale` None: 1), float32 scalars."""
    for i in range(v.size):
        s = abs(v[i]) * lr
        if lr_scale is not None:
            s = s * lr_scale[i]
        mean_step[i] = mean_step[i] * decay + s * one_minus


@numba.njit(cache=True, boundscheck=False, inline="always")
def _dana_value(i, w, g, out, v, total, decay, lr_scale, momentum, lr):
    """Value i of DANA-Zero's update (`dana_step`) for the gradient value `g`; returns the worker's new momentum
    (inlined into the loops that call it: they stay one vectorized loop)."""
    d = g + decay[i] * w[i] if decay is not None else g
    u = v[i] * momentum + d
    total[i] = (total[i] - v[i]) + u
    v[i] = u
    s = lr * lr_scale[i] if lr_scale is not None else lr
    if out is None:
        w[i] = w[i] - s * u
    else:
        out[i] = w[i] - s * u
    return u


@numba.njit(cache=True, boundscheck=False)
def dana_step(w: np.ndarray, g: np.ndarray, out: np.ndarray | None, v: np.ndarray, total: np.ndarray,
              decay: np.ndarray | None, lr_scale: np.ndarray | None, momentum: np.float32, lr: np.float32) -> None:
    """DANA-Zero's update of one worker's push (`mpiasgd.optim.rules.DanaZero.apply`) as one pass, the float32
    operations of its numpy form in their order: d = g + decay * w; v' = m v + d; total = (total - v) + v';
    new weights w - (lr * lr_scale) * v' into `out` (None: in place into `w`); `v` and `total` updated in place.
    float32 (P,) arrays (`decay`, `lr_scale` None: 0 and 1), float32 scalars."""
    for i in range(g.size):
        _dana_value(i, w, g[i], out, v, total, decay, lr_scale, momentum, lr)


@numba.njit(cache=True, boundscheck=False, error_model="numpy")
def dana_ga_step(w: np.ndarray, g: np.ndarray, out: np.ndarray | None, v: np.ndarray, total: np.ndarray,
                 decay: np.ndarray | None, lr_scale: np.ndarray | None, momentum: np.float32, lr: np.float32,
                 pulled: np.ndarray, mean_step: np.ndarray, unbias: np.float32, gap_decay: np.float32,
                 one_minus: np.float32) -> None:
    """DANA-GA's update of one worker's push as one pass (`mpiasgd.optim.rules.GapPenalized` around `DanaZero`):
    per value, `gap_penalize` (C = mean_step * unbias; `unbias` 0 before the first update: nothing penalized),
    then `dana_step`, then `gap_observe` of the worker's new momentum, the float32 operations of the three in
    their order, so the weights, momenta and C are those of the three passes bit for bit. The penalized gradient
    is written back into `g`. float32 (P,) arrays (`decay`, `lr_scale` None: 0 and 1), float32 scalars."""
    one = np.float32(1)
    for i in range(g.size):
        c = mean_step[i] * unbias
        gap = abs(w[i] - pulled[i])
        r = c / gap if gap > c and c > 0 else one
        gi = g[i] * r
        g[i] = gi
        u = _dana_value(i, w, gi, out, v, total, decay, lr_scale, momentum, lr)
        step = abs(u) * lr
        if lr_scale is not None:
            step = step * lr_scale[i]
        mean_step[i] = mean_step[i] * gap_decay + step * one_minus
