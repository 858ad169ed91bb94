"""Gradient checks shared by the op, layer and network tests: elementwise closeness with the worst element
named, central finite differences of a scalar function, and a network's parameter gradient against them.

Tolerance convention: |got - ref| <= atol + rtol * |ref| elementwise.
"""

from __future__ import annotations

import numpy as np

FD_STEP = 1e-6
ATOL64, RTOL64 = 1e-7, 1e-6  # float64 analytic vs float64 finite differences


def assert_close(got, ref, what: str, atol: float = ATOL64, rtol: float = RTOL64) -> None:
    """Elementwise |got - ref| <= atol + rtol*|ref|; on failure report the worst element."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != expected {ref.shape}"
    if got.size == 0:
        return
    excess = np.abs(got - ref) - (atol + rtol * np.abs(ref))
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape)
    assert excess[worst] <= 0, (
        f"{what}: worst element {tuple(int(i) for i in worst)}: got {got[worst]:.10g}, "
        f"expected {ref[worst]:.10g} (|diff| {abs(got[worst] - ref[worst]):.3g} > "
        f"atol + rtol*|ref| = {atol + rtol * abs(ref[worst]):.3g})")


def numeric_grad(f, x: np.ndarray, h: float = FD_STEP) -> np.ndarray:
    """Central differences of the scalar f() with respect to every element of x (modified in place)."""
    grad = np.empty_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        keep = flat[i]
        flat[i] = keep + h
        up = f()
        flat[i] = keep - h
        down = f()
        flat[i] = keep
        gflat[i] = (up - down) / (2 * h)
    return grad


def check_model_gradient(model, params: np.ndarray, x, y, rng: np.random.Generator, per_tensor: int = 3,
                         atol: float = 1e-7, rtol: float = 1e-5, minibatch: int | None = None) -> np.ndarray:
    """The training-mode gradient of float64 `model` (bound to `params` here) at `per_tensor` random elements
    of every parameter tensor against central differences of the mean loss; returns the analytic gradient.
    `minibatch` fixes the dropout key (else each evaluation would draw new masks)."""
    grads = np.zeros_like(params)
    model.bind(params, grads, model.init_buffers().astype(params.dtype))
    model.forward_backward(x, y, minibatch=minibatch)
    analytic = grads.copy()
    layout = model.layout()
    check = np.concatenate([offset + rng.choice(int(np.prod(shape)), min(per_tensor, int(np.prod(shape))),
                                                replace=False) for _, offset, shape in layout])
    for i in check:
        keep = params[i]
        params[i] = keep + FD_STEP
        up = model.forward_backward(x, y, minibatch=minibatch)[0]
        params[i] = keep - FD_STEP
        down = model.forward_backward(x, y, minibatch=minibatch)[0]
        params[i] = keep
        numeric = (up - down) / (2 * FD_STEP)
        name = layout[int(np.searchsorted([o for _, o, _ in layout], i, "right")) - 1][0]
        assert abs(analytic[i] - numeric) <= atol + rtol * abs(numeric), \
            f"{name} (element {i}): analytic {analytic[i]:.10g}, numeric {numeric:.10g}"
    return analytic
