"""SGD with momentum and weight decay: the parameter server's (`SGD`, one compiled loop, and
`NumpySGD`, its numpy reference), a worker's own (`LocalSGD`, on the model's backend), the update by
a pushed weight difference (`apply_delta`, nsync > 1), and the staleness rule.

The server's updates are memory-bound: a 4M-parameter SGD step must move 80 MB (gradient, weights
and velocity read, velocity and new weights written). `SGD` and `apply_delta` are one compiled loop
each (`mpiasgd.optim.compiled`, numba) that reads and writes every array once. `NumpySGD`, the
readable reference, runs cache-blocked: all the numpy operations of the update are applied to one
block of `CHUNK` values while it sits in L2, so each array is read from memory once and each result
written once, instead of once per numpy operation; numpy still makes six passes over each block in
L2, which costs it 1.7-2x the compiled loop's time (see `SGD`). The float32 operations and their
order are those of the whole-vector formula, so the results are equal to it bit for bit (skipping a
term that is zero, momentum 0 or a bias's weight decay, could only change the sign of a zero result
or the NaN of an infinite weight); `SGD` does the same operations and skips the same terms, so it
equals `NumpySGD` bit for bit in every case, infinities and NaN included.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

CHUNK = 65536  # float32 values per block (256 KiB per array); see `SGD` for the measured sweep
MIN_RUN = 4096  # mean length of a vector's constant runs below which the vector is read as an array


def run_blocks(vectors: list[np.ndarray], chunk: int) -> list[tuple]:
    """The blocks of one update: [(start, stop, c_1, ..., c_k)] covering 0..P in order, stop - start <=
    chunk, one coefficient per vector of `vectors` (k float32 (P,) vectors: the weight decay, the
    learning-rate multipliers).

    A vector made of a few constant runs (a model's layers and their weights and biases are
    contiguous blocks, each with one decay and one lr multiplier) is never read by the update: every
    block lies in one of its runs and carries that run's value (np.float32). A vector with many
    short runs (mean length below `MIN_RUN`) gets the coefficient None: read `vector[start:stop]`.
    The blocks start at every run start of the run-read vectors (the plain grid when there are none)
    and then every `chunk` values.
    """
    size = vectors[0].size
    edges = [np.flatnonzero(v[1:] != v[:-1]) + 1 for v in vectors]  # where a run of equal values starts
    as_runs = [not size or (e.size + 1) * MIN_RUN <= size for e in edges]
    cuts = sorted(set().union(*(e.tolist() for e, runs in zip(edges, as_runs, strict=True) if runs)))
    starts, stops = [0, *cuts], [*cuts, size]
    return [(a, min(a + chunk, stop), *(v[start] if runs else None for v, runs in zip(vectors, as_runs, strict=True)))
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


def _multipliers(name: str, values: Any, size: int) -> np.ndarray:
    """`values` as a float32 (P,) vector; ValueError naming `name` for a wrong shape or a value that is
    negative or not finite."""
    out = np.asarray(values, np.float32)
    if out.shape != (size,) or not (np.isfinite(out) & (out >= 0)).all():
        raise ValueError(f"{name} must be float32 ({size},) with finite values >= 0, got shape {out.shape}")
    return out


class NumpySGD:
    """SGD with momentum on one flat float32 parameter vector (P,), in PyTorch's form
    (`torch.optim.SGD`, dampening 0), heavy-ball or Nesterov, in numpy: the readable reference of
    `SGD`, the server's (the same update as one compiled loop, equal to this bit for bit):

        d <- s_g * g + weight_decay * decay_mult * w
        v <- momentum * v + d
        w <- w - (lr * lr_mult) * v                    (heavy ball, the default)
        w <- w - (lr * lr_mult) * (d + momentum * v)   (nesterov=True; v the new velocity)

    `decay_mult` (float32 (P,)) is the weight-decay multiplier of each parameter: a 0/1 mask (1 on
    conv/linear weights, 0 on biases, so biases are not decayed) or a layer's own multiplier
    (Caffe's `decay_mult`, cuda-convnet's per-layer `wc`). `lr_mult` (`lr_scale`, float32 (P,), None
    = 1 everywhere) is the learning-rate multiplier (Caffe's `lr_mult`, cuda-convnet's epsW/epsB
    relative to the base rate); the float32 product lr * lr_mult is formed first. `s_g` is the
    gradient's scale (`step(..., grad_scale=s_g)`, default 1: the staleness rule, see
    `staleness_factor`). All arrays float32 (P,), C-contiguous.

    Conventions differ when the step size changes. cuda-convnet and Caffe keep the step inside the
    velocity, v <- momentum * v - lr * lr_mult * (g + wd * decay_mult * w), w <- w + v: a new lr
    scales only the new gradient's share. Here lr multiplies the whole velocity at each step, so a
    new lr rescales every earlier gradient's remaining contribution at once. The two agree while lr
    is constant (v_here = -v_caffe / (lr * lr_mult)).

    Nesterov is torch.optim.SGD's form of Nesterov's accelerated gradient. Sutskever, Martens, Dahl
    and Hinton 2013 (ICML, eq. 3-4) take the gradient at a look-ahead point: v_S <- momentum * v_S -
    lr * grad(theta + momentum * v_S), theta <- theta + v_S. The form here is a change of variables
    (as in Bengio, Boulanger-Lewandowski and Pascanu 2012, arXiv 1212.0901, which Caffe's Nesterov
    solver implements with lr inside the velocity h: w <- w - ((1 + momentum) h - momentum * h_old)):
    `w` is the look-ahead point theta + momentum * v_S itself (v_S = -lr * lr_mult * v while lr is
    constant), so the gradient is the one at the weights held and no second weight vector is kept.
    Nesterov needs momentum > 0 (ValueError otherwise, as torch).

    `params` is the current weight vector. `step(g, lr)` updates it in place; `step(g, lr, out=buf)`
    writes the new weights into `buf` instead, leaves the old vector unchanged, and re-points
    `params` at `buf` (the server's double buffering: the old vector may still be being sent).

    Cost: momentum 0 keeps no velocity (`velocity` is None) and skips its pass; weight decay 0, or
    decay multipliers made of contiguous runs, never read a (P,) decay vector, and lr multipliers made
    of runs never read a (P,) vector either (see `run_blocks`); a vector of lr multipliers all 1 is
    dropped (`lr_scale` None). Nesterov adds two passes over each block in L2, lr multipliers read
    as an array one pass and one (P,) read. Blocks of `chunk` values (default `CHUNK`); the block size,
    and no threads (the server's workers need the cores), were chosen by `python bench/server.py --sweep`
    (docs/benchmarks/server.md).
    """

    def __init__(self, params: np.ndarray, decay_mult: np.ndarray, momentum: float, weight_decay: float,
                 chunk: int = CHUNK, nesterov: bool = False, lr_scale: np.ndarray | None = None) -> None:
        _check("params", params, params.size)
        if nesterov and not momentum:
            raise ValueError("Nesterov momentum needs momentum > 0 (as torch.optim.SGD)")
        size = params.size
        self.params = params
        self.decay = (weight_decay * _multipliers("decay_mult", decay_mult, size)).astype(np.float32)  # (P,)
        self.lr_scale = None if lr_scale is None else _multipliers("lr_scale", lr_scale, size)
        if self.lr_scale is not None and (self.lr_scale == 1).all():
            self.lr_scale = None  # lr * 1 = lr: the default path
        self.momentum = np.float32(momentum)
        self.nesterov = bool(nesterov)
        self.velocity = np.zeros_like(params) if momentum else None
        blocks = run_blocks([self.decay] if self.lr_scale is None else [self.decay, self.lr_scale], chunk)
        one = np.float32(1)
        # [(start, stop, decay coefficient, lr multiplier)]; None: read the (P,) vector
        self.blocks = [(a, b, c, one) for a, b, c in blocks] if self.lr_scale is None else blocks
        self.chunk = chunk
        n = min(chunk, size)
        self.scratch = np.empty(n, np.float32)  # for in-place steps
        self.scratch2: np.ndarray | None = np.empty(n, np.float32) if nesterov else None  # see step()
        read_lr = any(block[3] is None for block in self.blocks)
        self.lr_scratch = np.empty(n, np.float32) if read_lr else None  # lr * lr_scale[a:b]

    def _target(self, grad: np.ndarray, out: np.ndarray | None) -> tuple[np.ndarray, bool]:
        """(`out`, defaulting to `params`; True if it is `params` or `grad`) after the checks `step` states."""
        size = self.params.size
        out = self.params if out is None else out
        _check("grad", grad, size)
        in_place = _scratch_needed(out, (self.params, grad), size)
        if self.velocity is not None and np.may_share_memory(out, self.velocity):
            raise ValueError("out must not be the optimizer's velocity")
        return out, in_place

    def warm_up(self) -> None:
        """Load what the first step would wait for (`SGD`: its compiled loops); numpy: nothing."""

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
        out, in_place = self._target(grad, out)
        lr32, m, v = np.float32(lr), self.momentum, self.velocity
        scale = np.float32(grad_scale)
        if scale != 1 and self.scratch2 is None:
            self.scratch2 = np.empty(min(self.chunk, size), np.float32)
        for a, b, coef, mult in self.blocks:
            wb, gb, ob = w[a:b], grad[a:b], out[a:b]
            t = self.scratch[: b - a] if in_place else ob  # ob is free until its final write
            if scale != 1:  # t = s * g + decay * w
                np.multiply(gb, scale, out=t)
                if coef is None or coef:
                    d = self.scratch2[: b - a]
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
                vb += t                                  # v = m * v + d
                if self.nesterov:
                    u = self.scratch2[: b - a]
                    np.multiply(vb, m, out=u)
                    u += t                               # d + m * v (the new v)
                    t = u
                else:
                    t = vb
            if mult is None:
                step_size = self.lr_scratch[: b - a]
                np.multiply(self.lr_scale[a:b], lr32, out=step_size)  # lr * lr_mult, per element
            else:
                step_size = lr32 * mult                  # lr * 1 = lr on the default path
            s = self.scratch[: b - a] if in_place else ob
            np.multiply(t, step_size, out=s)             # (lr * lr_mult) * v
            np.subtract(wb, s, out=ob)                   # w - lr * lr_mult * v
        self.params = out
        return out



class SGD(NumpySGD):
    """`NumpySGD`'s update as one compiled loop (`mpiasgd.optim.compiled`, numba): the parameter
    server's optimizer. Same constructor, fields, arguments and errors; the new weights and velocity
    are equal to `NumpySGD`'s bit for bit (the same float32 operations in the same order, no FMA).

    Each element is read and written once: 20 bytes per parameter with momentum (gradient, weights
    and velocity read, velocity and new weights written), 12 with momentum 0, 4 more for each
    multiplier vector read as an array; numpy makes six passes over each block in L2. Its time against that roofline
    (`python bench/server.py --sweep`) is in docs/benchmarks/server.md. Not done: fusing the server's finite
    check (`finite_square`) into this loop. A non-finite push must leave the weights and the velocity as they
    were, and the loop cannot know that before it has read the whole gradient: it would have to write the new
    velocity into a second buffer (its write-allocate reads cost more than the check's read) and could not
    update in place at all (one worker: the reply buffer holds the weights). `threads` > 1 shares the blocks
    among that many threads (`compiled.sgd_blocks_parallel`, the same bits): for a node whose server rank has
    cores to spare (`python bench/server.py --sweep` times 1, 2, 4, ... threads).

    A process's first updates import numba and load the machine code an earlier process cached: 0.4-0.5
    s in all (0.6-0.8 on a loaded machine). With no cache, compiling what a server runs (SGD and
    apply_delta, out of place and in place) makes it 2.5-3.3 s, once per machine and version of
    `compiled.py` (numba keys its cache on the file's modification time).
    """

    def __init__(self, params: np.ndarray, decay_mult: np.ndarray, momentum: float, weight_decay: float,
                 chunk: int = CHUNK, nesterov: bool = False, lr_scale: np.ndarray | None = None,
                 threads: int = 1) -> None:
        super().__init__(params, decay_mult, momentum, weight_decay, chunk, nesterov, lr_scale)
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"SGD: threads must be an integer >= 1, got {threads!r}")
        self.threads = threads  # > 1: the blocks shared among that many threads (`compiled.sgd_blocks_parallel`)
        blocks = self.blocks
        # the blocks as the loop takes them: (K,) starts, stops, decay coefficients, lr multipliers
        self.starts = np.array([block[0] for block in blocks], np.int64)
        self.stops = np.array([block[1] for block in blocks], np.int64)
        self.coefs = np.array([0 if block[2] is None else block[2] for block in blocks], np.float32)
        self.mults = np.array([1 if block[3] is None else block[3] for block in blocks], np.float32)
        self.read_decay = any(block[2] is None for block in blocks)  # (all or none)
        self.read_lr = any(block[3] is None for block in blocks)

    def warm_up(self) -> None:
        """Load the compiled loops this optimizer's updates run (numba's import and the cached machine code:
        the 0.4-0.5 s of a process's first update) now: calls `sgd_blocks`, out of place and in place, and
        `apply_delta`'s loop on 8-value scratch vectors with the argument types of this optimizer's steps.
        The server calls it before its clocks start, so its first push is not held up. Changes nothing."""
        from mpiasgd.optim import compiled

        def scratch(dtype=np.float32) -> np.ndarray:
            return np.zeros(8, dtype)

        w, g = scratch(), scratch()
        v = None if self.velocity is None else scratch()
        decay, lr_scale = (scratch() if self.read_decay else None), (scratch() if self.read_lr else None)
        starts, stops = np.zeros(1, np.int64), np.full(1, 8, np.int64)
        for out in (scratch(), None):
            compiled.sgd_blocks(w, g, out, v, decay, lr_scale, starts, stops, scratch()[:1], scratch()[:1],
                                self.momentum, self.nesterov, np.float32(0), np.float32(1))
            compiled.add_scaled(w, g, np.float32(0), out)
            if self.threads > 1:
                numba_threads(self.threads)
                compiled.sgd_blocks_parallel(w, g, out, v, decay, lr_scale, starts, stops, scratch()[:1],
                                             scratch()[:1], self.momentum, self.nesterov, np.float32(0), np.float32(1))
                compiled.add_scaled_parallel(w, g, np.float32(0), out, CHUNK)

    def step(self, grad: np.ndarray, lr: float, out: np.ndarray | None = None, grad_scale: float = 1.0) -> np.ndarray:
        """As `NumpySGD.step`: same arguments, result and errors."""
        from mpiasgd.optim import compiled  # numba: loaded by the first step, not with mpiasgd.optim

        w = self.params
        out, _ = self._target(grad, out)
        loop = compiled.sgd_blocks
        if self.threads > 1:
            numba_threads(self.threads)
            loop = compiled.sgd_blocks_parallel
        loop(w, grad, None if out is w else out, self.velocity, self.decay if self.read_decay else None,
             self.lr_scale if self.read_lr else None, self.starts, self.stops, self.coefs, self.mults, self.momentum,
             self.nesterov, np.float32(lr), np.float32(grad_scale))
        self.params = out
        return out


def numba_threads(threads: int) -> None:
    """Let numba's parallel loops use `threads` threads (at most its pool's, `numba.config.NUMBA_NUM_THREADS`,
    the cores it saw at import or $NUMBA_NUM_THREADS)."""
    import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def apply_delta(params: np.ndarray, delta: np.ndarray, scale: float, out: np.ndarray | None = None,
                threads: int = 1) -> np.ndarray:
    """out = params + scale * delta in float32 (float32(scale) * delta first, as numpy would), one
    compiled loop (`mpiasgd.optim.compiled`; `threads` > 1: in blocks of `CHUNK` shared among that many
    threads, the same bits); returns `out`.

    The server's update for an accumulated push (nsync > 1): `delta` (float32 (P,)) is the change of
    the worker's weights since its last pull, already scaled by its own learning rate. `out`
    (default: `params`, in place) may also be a separate buffer; `params` is then left unchanged.
    ValueError for a wrong shape, dtype or layout, and for an `out` that partly overlaps an input.
    12 bytes per parameter (params and delta read, out written); numpy's two passes over blocks in L2
    took 1.5x as long (see `SGD`).
    """
    from mpiasgd.optim import compiled  # numba: loaded by the first update, not with mpiasgd.optim

    size = params.size
    _check("params", params, size)
    _check("delta", delta, size)
    out = params if out is None else out
    _scratch_needed(out, (params, delta), size)  # the overlap check
    if threads > 1:
        numba_threads(threads)
        compiled.add_scaled_parallel(params, delta, np.float32(scale), None if out is params else out, CHUNK)
    else:
        compiled.add_scaled(params, delta, np.float32(scale), None if out is params else out)
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
    """SGD with momentum and weight decay on a worker's own weights, on the model's backend: the
    update of the parameter server (`SGD`, same formula, heavy-ball or Nesterov, with the model's
    decay and learning-rate multipliers), through the backend's `sgd_momentum` op.

    For workers that step locally: every step in sync mode, between exchanges with nsync > 1 and in
    EASGD, and each pipeline module on its slice. `step(lr)` updates `model.params` in place with
    `model.grads`; the velocity (float32, on the model's backend) persists across pulls. The
    multipliers are the model's host float32 (P,) vectors `decay_mult()` (a model without it:
    `decay_mask()`, 1 on conv/linear weights) and `lr_mult()` (without it: 1 everywhere), sliced to
    [start, stop) for a pipeline module; lr multipliers all 1 are passed as None (the op's default
    path). ValueError for nesterov with momentum 0.
    """

    def __init__(self, model: Any, momentum: float, weight_decay: float, start: int = 0,
                 stop: int | None = None, nesterov: bool = False) -> None:
        if nesterov and not momentum:
            raise ValueError("Nesterov momentum needs momentum > 0 (as torch.optim.SGD)")
        self.model = model
        self.ops = model.ops
        self.momentum = momentum
        self.nesterov = bool(nesterov)
        decay_mult = getattr(model, "decay_mult", None) or model.decay_mask
        mult = decay_mult()[start:stop]  # a pipeline module steps its own slice [start, stop)
        size = mult.size
        self.decay = self.ops.asarray((weight_decay * _multipliers("decay_mult", mult, size)).astype(np.float32))
        lr_mult = getattr(model, "lr_mult", None)
        scale = None if lr_mult is None else _multipliers("lr_mult", lr_mult()[start:stop], size)
        self.lr_scale = None if scale is None or (scale == 1).all() else self.ops.asarray(scale)
        self.velocity = self.ops.zeros(size)

    def step(self, lr: float, params: Any = None, grads: Any = None) -> None:
        """Update `params` (default: the model's) in place with `grads` (default: the model's)."""
        params = self.model.params if params is None else params
        grads = self.model.grads if grads is None else grads
        self.ops.sgd_momentum(params, self.velocity, grads, self.decay, self.momentum, lr, nesterov=self.nesterov,
                              lr_scale=self.lr_scale)
