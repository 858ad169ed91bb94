"""What the parameter server does about a stale gradient besides the staleness rule (`staleness_factor`):
delay compensation (DC-ASGD) and the momentum that asynchrony already adds.

Delay compensation (Zheng, Meng, Wang, Chen, Yu, Ma and Liu 2017, "Asynchronous Stochastic Gradient
Descent with Delay Compensation", ICML, arXiv 1609.08326, eq. 9-10; MXNet's `DCASGD` optimizer): a
gradient g computed on the weights w_pulled that a worker pulled, applied when the master weights are
w, is corrected by the first term of its Taylor expansion around w_pulled, with the Hessian
approximated by lambda times the outer product of g (its diagonal):

    g_dc = g + lambda * g * g * (w - w_pulled)                              (DC-ASGD-c, constant lambda)
    ms  <- m * ms + (1 - m) * g * g;  lambda_t = lambda / sqrt(ms + eps)    (DC-ASGD-a, per weight)

(elementwise products). A push computed from the weights the server holds (staleness 0) is not
changed: w - w_pulled = 0.
"""

from __future__ import annotations

import numpy as np

from mpiasgd.optim.sgd import CHUNK, _check

DC_EPSILON = 1e-7  # DC-ASGD-a: added to the mean square under the square root (the paper's epsilon)


class DelayCompensation:
    """DC-ASGD's correction of a pushed gradient (see the module docstring) on one flat float32 vector of
    `size` values: `lam` is lambda (> 0); `adaptive` the decay m of the mean square (0 < m < 1: DC-ASGD-a),
    0 for a constant lambda.

    Memory: the server needs the weights each worker computed its gradient on. It already holds them: a
    worker's send buffer keeps the weights of its last reply until the worker's next push is applied
    (`AsgdServer`), so the constant form costs no memory beyond N (P + B) float32 values the server has
    anyway; the adaptive form keeps one more float32 (P,) vector, the mean square (`mean_square`). It is not
    in the checkpoint: a resumed run starts it from zero again (the first push sets it to (1 - m) g * g).

    Cost: cache-blocked like `SGD.step`, about four passes over each block in L2 (six adaptive).
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
