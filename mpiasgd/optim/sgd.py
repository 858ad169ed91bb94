"""SGD with momentum and weight decay: the parameter server's (host, cache-blocked), a worker's own
(`LocalSGD`, on the model's backend), the update by a pushed weight difference (nsync > 1), and the
staleness rule.

Both updates are memory-bound: a 4M-parameter SGD step moves 80 MB. They run cache-blocked: all
the operations of the update are applied to one block of `CHUNK` values while it sits in L2, so
each array is read from memory once and each result written once, instead of once per numpy
operation. The float32 operations and their order are those of the whole-vector formula, so the
results are equal to it bit for bit (skipping a term that is zero, momentum 0 or a bias's weight
decay, could only change the sign of a zero result or the NaN of an infinite weight).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

CHUNK = 65536  # float32 values per block (256 KiB per array); see `SGD` for the measured sweep
MIN_RUN = 4096  # mean length of the decay mask's constant runs below which the mask is read as an array


def decay_blocks(decay: np.ndarray, chunk: int) -> list[tuple[int, int, np.float32 | None]]:
    """The blocks of one update: [(start, stop, coefficient)] covering 0..P in order, stop - start <= chunk.

    `decay` (float32 (P,)) is weight_decay * mask. When it is a few constant runs (a model's
    weights and biases are contiguous blocks), each block lies in one run and carries that run's
    value (np.float32; 0 for no decay), so the update never reads `decay`. Otherwise the blocks are
    the plain grid and the coefficient is None: read `decay[start:stop]`.
    """
    size = decay.size
    edges = np.flatnonzero(decay[1:] != decay[:-1]) + 1  # where a run of equal values starts
    if size and (edges.size + 1) * MIN_RUN > size:
        return [(a, min(a + chunk, size), None) for a in range(0, size, chunk)]
    starts = [0, *edges.tolist()]
    stops = [*edges.tolist(), size]
    return [(a, min(a + chunk, stop), decay[start])
            for start, stop in zip(starts, stops, strict=True) if stop > start
            for a in range(start, stop, chunk)]


def _check(name: str, a: np.ndarray, size: int) -> None:
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == (size,) and a.flags.c_contiguous):
        raise ValueError(f"{name} must be a C-contiguous float32 array of shape ({size},), got "
                         f"{type(a).__name__} {getattr(a, 'dtype', '')} {getattr(a, 'shape', '')}")


def _scratch_needed(out: np.ndarray, reads: tuple[np.ndarray, ...], size: int) -> bool:
    """True if `out` is one of `reads` (in place); ValueError if it overlaps any of them otherwise.

    The update writes its intermediates into `out` block by block when `out` is a separate buffer:
    that is only correct if no input lives there.
    """
    _check("out", out, size)
    same = [np.may_share_memory(out, a) for a in reads]
    if not any(same):
        return False
    if any(s and a.ctypes.data != out.ctypes.data for s, a in zip(same, reads, strict=True)):
        raise ValueError("out overlaps an input without being the same array: pass the input itself "
                         "(in place) or a separate buffer")
    return True


class SGD:
    """Heavy-ball SGD on one flat float32 parameter vector (P,), in PyTorch's form (`torch.optim.SGD`
    with dampening 0, not Nesterov):

        v <- momentum * v + (s * g + weight_decay * mask * w)
        w <- w - lr * v

    `mask` is 1 on conv/linear weights and 0 on biases, so biases are not decayed; `s` is the
    gradient's scale (`step(..., grad_scale=s)`, default 1: the staleness rule, see
    `staleness_factor`). All arrays float32 (P,), C-contiguous.

    Conventions differ when the step size changes. cuda-convnet and Caffe (and Sutskever et al.
    2013, eq. 1-2) keep the step inside the velocity, v <- momentum * v - lr * (g + wd * w),
    w <- w + v: a new lr scales only the new gradient's share. Here lr multiplies the whole
    velocity at each step, so a new lr rescales every earlier gradient's remaining contribution at
    once. The two agree while lr is constant (v_here = -v_caffe / lr).

    `params` is the current weight vector. `step(g, lr)` updates it in place; `step(g, lr, out=buf)`
    writes the new weights into `buf` instead, leaves the old vector unchanged, and re-points
    `params` at `buf` (the server's double buffering: the old vector may still be being sent).

    Cost: momentum 0 keeps no velocity (`velocity` is None) and skips its pass; weight decay 0, or a
    mask made of contiguous runs, never reads a (P,) decay vector (see `decay_blocks`). Blocks of
    `chunk` values (default `CHUNK`), measured on one AMD EPYC core (L2 1 MiB) shared with other
    jobs, P = 4M, out of place, ms per step (`python bench/server.py --sweep`):

        block                    16K   32K   64K  128K  256K  none (whole vector)
        momentum + decay         3.5   3.1   3.1   3.3   3.1   3.6-4.4
        momentum 0, decay 0      1.8   1.6   1.5   1.5   1.5   1.4
        apply_delta              1.9   1.6   1.4   1.4   1.4   1.4

    for comparison a 16 MB copy takes 0.6 ms, and a compiled single loop doing the same float32
    operations 1.4 (in place) to 1.7 ms (the memory-bound floor; numpy pays for six passes over
    each block in L2). Two threads (numpy releases the GIL) were no faster on the idle 2-core
    machine (2.7 vs 2.7 ms) and gained only by taking cores from other processes when they ran
    (4.3 vs 6.6 ms with two busy processes): the server has none, its workers need the cores.
    """

    def __init__(self, params: np.ndarray, decay_mask: np.ndarray, momentum: float, weight_decay: float,
                 chunk: int = CHUNK) -> None:
        _check("params", params, params.size)
        self.params = params
        self.decay = (weight_decay * decay_mask).astype(np.float32)  # (P,), 0 on biases; read only if not runs
        self.momentum = np.float32(momentum)
        self.velocity = np.zeros_like(params) if momentum else None
        self.blocks = decay_blocks(self.decay, chunk)
        self.scratch = np.empty(min(chunk, params.size), np.float32)  # for in-place steps
        self.chunk = chunk
        self.decay_scratch: np.ndarray | None = None  # for grad_scale != 1, allocated on first use

    def step(self, grad: np.ndarray, lr: float, out: np.ndarray | None = None, grad_scale: float = 1.0) -> np.ndarray:
        """Apply one update with step size `lr` for gradient `grad` scaled by `grad_scale`; returns the
        new weights.

        `grad_scale` multiplies the gradient before it enters the velocity (weight decay, computed on
        the current weights, is not scaled): the staleness rule (Zhang et al. 2016) scales the stale
        gradient, not the velocity that holds the earlier ones. 1 (the default) takes the exact float32
        operations of the unscaled formula.

        `out` (float32 (P,)) receives them: `params` itself (the default, in place) or a separate
        buffer; either way `params` is `out` afterwards, and a separate buffer leaves the old weight
        vector unchanged. `grad` is not modified unless it is `out`. ValueError for a wrong shape,
        dtype or layout, and for an `out` that partly overlaps `params` or `grad`, or is the velocity.
        """
        w, size = self.params, self.params.size
        out = w if out is None else out
        _check("grad", grad, size)
        in_place = _scratch_needed(out, (w, grad), size)
        if self.velocity is not None and np.may_share_memory(out, self.velocity):
            raise ValueError("out must not be the optimizer's velocity")
        lr32, m, v = np.float32(lr), self.momentum, self.velocity
        scale = np.float32(grad_scale)
        if scale != 1 and self.decay_scratch is None:
            self.decay_scratch = np.empty(min(self.chunk, size), np.float32)
        for a, b, coef in self.blocks:
            wb, gb, ob = w[a:b], grad[a:b], out[a:b]
            t = self.scratch[: b - a] if in_place else ob  # ob is free until its final write
            if scale != 1:  # t = s * g + decay * w
                np.multiply(gb, scale, out=t)
                if coef is None or coef:
                    d = self.decay_scratch[: b - a]
                    np.multiply(wb, self.decay[a:b] if coef is None else coef, out=d)
                    t += d
            elif coef is None:
                np.multiply(self.decay[a:b], wb, out=t)  # (decay * w)
                t += gb                                  # + g
            elif coef:
                np.multiply(wb, coef, out=t)
                t += gb
            else:
                t = gb                                   # no decay here: g + 0 * w = g
            if v is not None:
                vb = v[a:b]
                vb *= m
                vb += t                                  # v = m * v + (g + decay * w)
                t = vb
            s = self.scratch[: b - a] if in_place else ob
            np.multiply(t, lr32, out=s)                  # lr * v
            np.subtract(wb, s, out=ob)                   # w - lr * v
        self.params = out
        return out


def apply_delta(params: np.ndarray, delta: np.ndarray, scale: float, out: np.ndarray | None = None,
                chunk: int = CHUNK) -> np.ndarray:
    """out = params + scale * delta in float32, cache-blocked; returns `out`.

    The server's update for an accumulated push (nsync > 1): `delta` (float32 (P,)) is the change of
    the worker's weights since its last pull, already scaled by its own learning rate. `out`
    (default: `params`, in place) may also be a separate buffer; `params` is then left unchanged.
    ValueError for a wrong shape, dtype or layout, and for an `out` that partly overlaps an input.
    """
    size = params.size
    _check("params", params, size)
    _check("delta", delta, size)
    out = params if out is None else out
    in_place = _scratch_needed(out, (params, delta), size)
    scratch = np.empty(min(chunk, size), np.float32) if in_place else None
    scale32 = np.float32(scale)
    for a in range(0, size, chunk):
        b = min(a + chunk, size)
        t = scratch[: b - a] if in_place else out[a:b]
        np.multiply(delta[a:b], scale32, out=t)
        np.add(params[a:b], t, out=out[a:b])
    return out


def staleness_factor(rule: str, staleness: int) -> float:
    """Multiplier of a push of `staleness` (>= 0) under `rule`.

    "none": 1. "inverse": 1 / max(1, s), the staleness-dependent learning rate of Zhang, Gupta,
    Lian and Liu 2016 (arXiv 1511.05950, alpha / tau). "sqrt": 1 / sqrt(max(1, s)), a milder form.
    A fresh push (s = 0) and one of staleness 1 get the full step under every rule.

    The server scales the pushed gradient by it before the gradient enters the momentum
    (`SGD.step(grad_scale=...)`), so a stale gradient's total contribution, lr / (1 - momentum)
    over the following steps, is scaled by the factor, and the velocity built from earlier pushes
    is not. (Scaling the step lr of that one update instead would shrink the whole velocity's move
    at that step: at momentum 0.9 a gradient of staleness 8 would still move the weights by about
    9.1 lr in total against 10 lr for a fresh one.) An accumulated update (nsync > 1) is scaled as
    a whole: the server keeps no momentum for it.
    """
    if rule == "inverse":
        return 1.0 / max(1, staleness)
    if rule == "sqrt":
        return 1.0 / math.sqrt(max(1, staleness))
    return 1.0


def finite_square(a) -> tuple[bool, float]:
    """(every element of `a` is finite, sum of squares of `a`) for a float vector, numpy or cupy.

    One dot product; the exact elementwise check runs only when the dot is not finite (a NaN or
    infinity, or huge finite values whose squares overflow float32).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        square = float(a.dot(a))
        return math.isfinite(square) or bool(np.isfinite(a).all()), square


class LocalSGD:
    """SGD with momentum and weight decay on a worker's own weights, on the model's backend.

    The update of the parameter server (`SGD`), for workers that step locally: every step in sync
    mode, between exchanges with nsync > 1 and in EASGD, and each pipeline module on its slice.
    `step(lr)` updates `model.params` in place with `model.grads`; the velocity (float32, on the
    model's backend) persists across pulls. `decay_mask` (float32 (P,), 1 on conv/linear weights)
    is sliced to [start, stop) for a pipeline module.
    """

    def __init__(self, model: Any, momentum: float, weight_decay: float, start: int = 0,
                 stop: int | None = None) -> None:
        self.model = model
        self.ops = model.ops
        self.momentum = momentum
        mask = model.decay_mask()[start:stop]  # a pipeline module steps its own slice [start, stop)
        self.decay = self.ops.asarray(weight_decay * mask)  # float32, 0 on biases
        self.velocity = self.ops.zeros(mask.size)

    def step(self, lr: float, params: Any = None, grads: Any = None) -> None:
        """Update `params` (default: the model's) in place with `grads` (default: the model's)."""
        params = self.model.params if params is None else params
        grads = self.model.grads if grads is None else grads
        self.ops.sgd_momentum(params, self.velocity, grads, self.decay, self.momentum, lr)
