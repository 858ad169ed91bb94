"""Pipeline mode (decoupled backpropagation x data parallelism), in-process: cutting the model into
modules, and modules chained giving the whole model's gradient.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from kit.runs import B

from mpiasgd.config import ConfigError
from mpiasgd.model import build_model
from mpiasgd.modes.pipeline import Module, layer_costs, partition

# --- cutting the model -----------------------------------------------------------------------------------

def test_partition_balances_flops_and_takes_given_cuts():
    model = build_model("digits")  # conv1 relu1 pool1 conv2 relu2 pool2 flatten1 fc1
    assert partition(model, 1) == [0, 8]
    assert partition(model, 2) == [0, 3, 8]          # conv2 is 88% of the forward FLOPs
    assert partition(model, 3, cuts=(2, 5)) == [0, 2, 5, 8]
    for balance in ("flops", "params"):  # the cuts minimise the largest module cost: brute force agrees
        costs = layer_costs(model, balance)
        for k in (2, 3, 4):
            def worst(bounds, costs=costs):
                return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
            bounds = partition(model, k, balance=balance)
            assert bounds[0] == 0 and bounds[-1] == 8 and len(bounds) == k + 1 and bounds == sorted(set(bounds))
            best = min(worst([0, *c, 8]) for c in itertools.combinations(range(1, 8), k - 1))
            assert worst(bounds) == best
    with pytest.raises(ConfigError, match="'modules' = 9: model 'digits' has only 8 layers"):
        partition(model, 9)
    with pytest.raises(ConfigError, match=r"expected 1 increasing layer index\(es\) in 1\.\.7"):
        partition(model, 2, cuts=(8,))


def test_modules_chained_give_the_whole_model_gradient(digits):
    """Module 0 then module 1 (no delay) compute exactly what the whole model's forward_backward does."""
    model, ref = build_model("digits"), build_model("digits")
    w = model.init_params(1)
    w += np.random.default_rng(0).standard_normal(w.size).astype(np.float32) * 0.05  # a non-zero classifier
    g_ref = np.zeros_like(w)
    ref.bind(w.copy(), g_ref)
    x, y = digits.batch("train", np.arange(B))
    ref.forward_backward(x, y)
    first, second = Module(model, 0, 3), Module(model, 3, 8)
    assert (first.start, first.stop, second.start, second.stop) == (0, 160, 160, 6090)
    assert first.out_shape == second.in_shape == (16, 4, 4) and second.is_last and not first.is_last
    first.params[...] = w[:160]
    second.params[...] = w[160:]
    _, _, dx = second.loss_backward(second.forward(first.forward(x)), y)
    assert first.backward(dx) is None  # module 0: nothing consumes the gradient w.r.t. the images
    np.testing.assert_allclose(np.concatenate([first.grads, second.grads]), g_ref, rtol=1e-5, atol=1e-7)
