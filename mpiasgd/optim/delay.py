"""What the parameter server does about a stale gradient besides the staleness rule (`staleness_factor`):
delay compensation (DC-ASGD), the look-ahead reply (DANA) and the momentum that asynchrony already adds.

Delay compensation (Zheng, Meng, Wang, Chen, Yu, Ma and Liu 2017, "Asynchronous Stochastic Gradient
Descent with Delay Compensation", ICML, arXiv 1609.08326, eq. 9-10; MXNet's `DCASGD` optimizer): a
gradient g computed on the weights w_pulled that a worker pulled, applied when the master weights are
w, is corrected by the first term of its Taylor expansion around w_pulled, with the Hessian
approximated by lambda times the outer product of g (its diagonal):

    g_dc = g + lambda * g * g * (w - w_pulled)                              (DC-ASGD-c, constant lambda)
    ms  <- m * ms + (1 - m) * g * g;  lambda_t = lambda / sqrt(ms + eps)    (DC-ASGD-a, per weight)

(elementwise products). A push computed from the weights the server holds (staleness 0) is not
changed: w - w_pulled = 0.

Gap-Aware (Barkai, Hakimi and Schuster 2020, "Gap-Aware Mitigation of Gradient Staleness", ICLR, arXiv
1909.10802): the staleness of a gradient is measured per weight by how far the weight has moved
since the worker pulled it, the gap |w - w_pulled|, in units of one update's typical step C, and the
gradient is divided by it:

    G = max(1, |w - w_pulled| / C);   g_ga = g / G                               (elementwise)
    C <- d C + (1 - d) |lr * lr_mult * v|   after each update, bias-corrected (d = GAP_DECAY)

where v is the velocity the update applied (the gradient itself without momentum). A weight that moved no
more than one step since the pull keeps its gradient; one that moved k typical steps gets 1/k of it. (The
paper's C is the largest step a weight takes in one update, estimated from a running mean; taking the mean
step itself, and max(1, .) rather than 1 + ., leaves a gradient of staleness 0 or 1 unchanged, so one worker
is plain SGD.)
"""

from __future__ import annotations

import numpy as np

from mpiasgd.optim.sgd import CHUNK, _check

DC_EPSILON = 1e-7  # DC-ASGD-a: added to the mean square under the square root (the paper's epsilon)
GAP_DECAY = 0.99  # Gap-Aware: the decay of the running mean of one update's step, C (about the last 100 updates)


class DelayCompensation:
    """DC-ASGD's correction of a pushed gradient (see the module docstring) on one flat float32 vector of
    `size` values: `lam` is lambda (> 0); `adaptive` the decay m of the mean square (0 < m < 1: DC-ASGD-a),
    0 for a constant lambda.

    Memory: the server needs the weights each worker computed its gradient on. It already holds them: a
    worker's send buffer keeps the weights of its last reply until the worker's next push is applied
    (`AsgdServer`), so the constant form costs no memory beyond N (P + B) float32 values the server has
    anyway; the adaptive form keeps one more float32 (P,) vector, the mean square (`mean_square`). It is not
    in the checkpoint: a resumed run starts it from zero again (the first push sets it to (1 - m) g * g).

    Cost: cache-blocked like `NumpySGD.step`, about four passes over each block in L2 (six adaptive).
    """

    def __init__(self, size: int, lam: float, adaptive: float = 0.0, chunk: int = CHUNK) -> None:
        if not lam > 0:
            raise ValueError(f"delay compensation: lambda must be > 0, got {lam!r}")
        if not 0 <= adaptive < 1:
            raise ValueError(f"delay compensation: the mean square's decay must be in [0, 1), got {adaptive!r}")
        self.size, self.chunk = size, chunk
        self.lam = np.float32(lam)
        self.decay = np.float32(adaptive)
        self.mean_square = np.zeros(size, np.float32) if adaptive else None
        n = min(chunk, size)
        self.scratch = np.empty(n, np.float32)
        self.scratch2 = np.empty(n, np.float32)

    def correct(self, grad: np.ndarray, weights: np.ndarray, pulled: np.ndarray) -> np.ndarray:
        """Correct `grad` in place for the move of the weights from `pulled` (what the worker computed it on)
        to `weights` (the server's now); all float32 (P,) C-contiguous; returns `grad`. The adaptive form
        first folds g * g into the mean square. ValueError for a wrong shape, dtype or layout."""
        for name, a in (("grad", grad), ("weights", weights), ("pulled", pulled)):
            _check(name, a, self.size)
        one_minus = np.float32(1) - self.decay
        ms = self.mean_square
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is a non-finite result: checked after
            self._correct(grad, weights, pulled, one_minus, ms)
        return grad

    def _correct(self, grad: np.ndarray, weights: np.ndarray, pulled: np.ndarray, one_minus: np.float32,
                 ms: np.ndarray | None) -> None:
        for a in range(0, self.size, self.chunk):
            b = min(a + self.chunk, self.size)
            gb = grad[a:b]
            sq, moved = self.scratch[: b - a], self.scratch2[: b - a]
            np.multiply(gb, gb, out=sq)                    # g * g
            np.subtract(weights[a:b], pulled[a:b], out=moved)  # w - w_pulled
            if ms is not None:  # ms <- m ms + (1 - m) g g; lambda_t = lambda / sqrt(ms + eps)
                mb = ms[a:b]
                mb *= self.decay
                mb += one_minus * sq
                sq *= moved
                np.add(mb, np.float32(DC_EPSILON), out=moved)
                np.sqrt(moved, out=moved)
                np.divide(sq, moved, out=sq)
            else:
                sq *= moved
            sq *= self.lam
            gb += sq                                       # g + lambda g g (w - w_pulled)


class GapAware:
    """Gap-Aware's penalty of a pushed gradient (see the module docstring) on one flat float32 vector of `size`
    values. `penalize` divides a gradient by its gap before the update rule applies it; `observe` folds the step
    the rule then took into C. Before the first `observe` C is unknown and nothing is penalized.

    Memory: one float32 (P,) vector (C) beside the weights the server already holds (the last reply of each
    worker, as for DC-ASGD); it is not in the checkpoint: a resumed run learns C again from its first update.
    Cost: one compiled pass each (`mpiasgd.optim.compiled.gap_penalize`, `gap_observe`: numba, loaded with the
    first push), reading four vectors and writing one, then reading two and writing one; with DANA-Zero both are
    folded into its update's pass (`mpiasgd.optim.compiled.dana_ga_step`)."""

    def __init__(self, size: int, decay: float = GAP_DECAY) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"Gap-Aware: the decay of the mean step must be in (0, 1), got {decay!r}")
        self.size, self.decay = size, np.float32(decay)
        self.mean_step = np.zeros(size, np.float32)  # C before the bias correction
        self.updates = 0

    def warm_up(self, lr_scale: bool = False) -> None:
        """Load the compiled passes (`gap_penalize`, `gap_observe` with or without `lr_scale`) on 8-value scratch
        vectors now, so that the first pushes do not wait for numba. Changes nothing."""
        from mpiasgd.optim.compiled import gap_observe, gap_penalize

        x = [np.zeros(8, np.float32) for _ in range(4)]
        gap_penalize(x[0], x[1], x[2], x[3], np.float32(1))
        gap_observe(x[0], x[1], np.float32(0), x[2] if lr_scale else None, self.decay, np.float32(1) - self.decay)

    def penalize(self, grad: np.ndarray, weights: np.ndarray, pulled: np.ndarray) -> np.ndarray:
        """Divide `grad` in place by its gap max(1, |weights - pulled| / C), all float32 (P,) C-contiguous;
        returns `grad`. ValueError for a wrong shape, dtype or layout."""
        self.check(grad, weights, pulled)
        if self.updates:
            from mpiasgd.optim.compiled import gap_penalize

            gap_penalize(grad, weights, pulled, self.mean_step, self.unbias())
        return grad

    def check(self, grad: np.ndarray, weights: np.ndarray, pulled: np.ndarray) -> None:
        """ValueError naming the vector if `grad`, `weights` or `pulled` is not float32 (P,) C-contiguous."""
        for name, a in (("grad", grad), ("weights", weights), ("pulled", pulled)):
            _check(name, a, self.size)

    def unbias(self) -> np.float32:
        """The float32 inverse of C's bias correction, 1 / (1 - decay^updates); 0 before the first update (C is
        unknown: nothing is penalized)."""
        return np.float32(1 / (1 - float(self.decay) ** self.updates)) if self.updates else np.float32(0)

    def observe(self, velocity: np.ndarray, step_size: float, lr_scale: np.ndarray | None = None) -> None:
        """Fold one update's step |step_size * lr_scale * velocity| (`velocity` float32 (P,): what the update
        applied; `lr_scale` float32 (P,) or None: 1) into C."""
        from mpiasgd.optim.compiled import gap_observe

        _check("velocity", velocity, self.size)
        gap_observe(self.mean_step, velocity, np.float32(step_size), lr_scale, self.decay,
                    np.float32(1) - self.decay)
        self.updates += 1


def explicit_momentum(momentum: float, rule: str, num_workers: int) -> float:
    """The momentum the parameter server applies for `--momentum` = `momentum` under `--async-momentum`
    `rule` with `num_workers` workers: "fixed" gives `momentum`; "workers" gives max(0, momentum - (1 -
    1/N)).

    Mitliagkas, Zhang, Hadjis and Re 2016 ("Asynchrony begets momentum", arXiv 1605.09774, theorem 2):
    with N workers whose pushes arrive in a random order, the expected update of asynchronous SGD is
    that of momentum SGD with an implicit momentum 1 - 1/N. The rule takes the implicit part off the
    explicit one so that the two together stay near `momentum` (a first-order reading of their result;
    they tune the explicit momentum per N and find its best value falls as N grows, to 0 and below).
    """
    if rule == "workers":
        return max(0.0, momentum - (1.0 - 1.0 / max(1, num_workers)))
    return momentum


def lookahead_steps(setting: float, num_workers: int, overlap: bool = False) -> float:
    """The updates K a reply looks ahead under `--lookahead` = `setting`: the setting itself when it is > 0,
    and for -1 ("auto") N - 1 with `num_workers` = N, 2N - 1 with `overlap` (--overlap). With N equal workers
    every push meets the other N - 1 workers' pushes between its pull and its update (staleness N - 1).
    With --overlap a worker computes on the weights of the reply before the last, so one more round of N
    pushes (its own previous one and the N - 1 others') lands in between: staleness 2N - 1 (1 with one
    worker). 0: no look-ahead."""
    if setting >= 0:
        return float(setting)
    n = max(1, num_workers)
    return float(2 * n - 1 if overlap else n - 1)


def lookahead_factor(momentum: float, steps: float, nesterov: bool = False) -> float:
    """c of a look-ahead `steps` momentum-only updates ahead (`LookAhead`: w - lr * lr_mult * c * v):
    momentum * (1 - momentum^steps) / (1 - momentum), momentum * steps for momentum 1, times momentum again
    with Nesterov momentum. ValueError unless steps >= 0 and 0 <= momentum <= 1."""
    if not steps >= 0 or not 0 <= momentum <= 1:
        raise ValueError(f"look-ahead: steps must be >= 0 and momentum in [0, 1], got {steps!r}, {momentum!r}")
    m = float(momentum)
    factor = m * steps if m == 1 else m * (1 - m ** steps) / (1 - m)
    return factor * m if nesterov else factor


class LookAhead:
    """The reply a worker computes its next gradient on, moved to where the master weights will most likely
    be when that gradient is applied (`--lookahead`): the weights after K more updates by the momentum
    alone (Hakimi, Barkai, Gabel and Schuster 2019, "Taming Momentum in a Distributed Asynchronous
    Environment", arXiv 1907.11612: DANA sends the look-ahead point instead of the master weights).

    With the server's velocity v (`optim.SGD`'s form, w <- w - lr * lr_mult * v, v <- momentum * v + d), K
    updates with no new gradient move the weights by lr * lr_mult * momentum * (1 + momentum + ... +
    momentum^(K-1)) * v, so

        reply = w - lr * lr_mult * c * v,    c = momentum * (1 - momentum^K) / (1 - momentum)

    (c = momentum * K for momentum 1, c = 0 for K = 0 or momentum 0). K need not be whole: the
    expected staleness. With Nesterov momentum (`nesterov`, `optim.SGD`'s form, w <- w - lr * lr_mult *
    (d + momentum * v)) an update with no new gradient moves the weights by lr * lr_mult * momentum^2 * v,
    so c gains a factor momentum: c = momentum^2 (1 - momentum^K) / (1 - momentum). The gradient is then
    computed near the weights it will be applied to: a push of staleness 1 is off by one gradient's step
    only, instead of that step plus the momentum's lr * momentum * v. The master weights and the
    optimizer are untouched: the look-ahead only changes what the workers compute on (and what DC-ASGD,
    which corrects for the move from there, starts from). The server sends the master weights where a
    worker evaluates them (STOP, an --eval-interval reply) and as the first weights.

    `lr_scale` (float32 (P,), None: 1 everywhere) are the learning-rate multipliers; all arrays float32 (P,).
    Cost: one pass over w and v writing the reply (cache-blocked, three numpy operations per block):
    the reply no longer lives in the master weights' buffer.
    """

    def __init__(self, size: int, momentum: float, steps: float, lr_scale: np.ndarray | None = None,
                 chunk: int = CHUNK, nesterov: bool = False) -> None:
        self.factor = lookahead_factor(momentum, steps, nesterov)  # c
        self.size, self.chunk = size, chunk
        self.scale = None if lr_scale is None else (lr_scale * np.float32(self.factor)).astype(np.float32)
        self.scratch = np.empty(min(chunk, size), np.float32)

    def reply(self, weights: np.ndarray, velocity: np.ndarray, lr: float, out: np.ndarray) -> np.ndarray:
        """Write w - lr * lr_mult * c * v into `out` (not `weights` nor `velocity`); returns `out`. ValueError
        for a wrong shape, dtype or layout."""
        for name, a in (("weights", weights), ("velocity", velocity), ("out", out)):
            _check(name, a, self.size)
        if np.may_share_memory(out, weights) or np.may_share_memory(out, velocity):
            raise ValueError("look-ahead: out must be a buffer of its own")
        step = np.float32(lr * self.factor)
        lr32 = np.float32(lr)
        for a in range(0, self.size, self.chunk):
            b = min(a + self.chunk, self.size)
            t = self.scratch[: b - a]
            if self.scale is None:
                np.multiply(velocity[a:b], step, out=t)
            else:
                np.multiply(velocity[a:b], self.scale[a:b], out=t)
                t *= lr32
            np.subtract(weights[a:b], t, out=out[a:b])
        return out
