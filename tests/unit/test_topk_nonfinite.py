"""Top-1 and top-k accuracy of rows whose logits are not all finite: wrong for every k, so that top-5 >= top-1
always, also for a NaN network (whose rows np.argmax sends to class 0)."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits

from mpiasgd.model import build_model
from mpiasgd.model.model import topk_correct


def test_a_row_with_a_non_finite_logit_is_wrong_for_every_k():
    logits = np.array([[np.nan, 0, 0, 0, 0, 0, 0],   # label 3: nothing is strictly above it, but the row is NaN
                       [np.inf, 5, 0, 0, 0, 0, 0],   # label 0: the argmax, but +inf is no score
                       [-np.inf, 5, 0, 0, 0, 0, 0],  # label 1
                       [1, 5, 0, 0, 0, 0, 0]],       # label 1: the one finite row, a hit
                      dtype=np.float32)
    labels = np.array([3, 0, 1, 1])
    assert [topk_correct(logits, labels, k) for k in (1, 5, 7)] == [1, 1, 1]


def test_a_nan_network_scores_zero_for_top1_and_top5():
    """Every weight NaN: every logit is NaN; np.argmax puts every row at class 0, which counted the images of
    label 0 as top-1 hits while no image was a top-5 hit (top-5 below top-1)."""
    data = load_digits()
    x = (data.images[:64] / 16.0).astype(np.float32).reshape(64, 1, 8, 8)
    y = data.target[:64].astype(np.int64)
    assert (y == 0).any()
    model = build_model("digits")
    params = np.full(model.num_params, np.nan, np.float32)
    model.bind(params, np.empty_like(params))
    loss_sum, correct, correct5 = model.evaluate(x, y, batch_size=20)
    assert np.isnan(loss_sum) and (correct, correct5) == (0, 0)
    params[...] = model.init_params(0)
    params[:10] = np.nan  # the first layer's weights: NaN rows in some images only
    _, correct, correct5 = model.evaluate(x, y, batch_size=20)
    assert correct5 >= correct


def test_a_diverging_network_overflows_without_runtime_warnings():
    """Weights of 1e30: the numpy backend's forward and backward overflow; the loss and the gradient are
    non-finite (the caller rejects the push, the run reports the divergence) and numpy's "overflow encountered"
    RuntimeWarnings stay out of `train`'s and `evaluate`'s output (issue 36)."""
    import warnings

    data = load_digits()
    x = (data.images[:32] / 16.0).astype(np.float32).reshape(32, 1, 8, 8)
    y = data.target[:32].astype(np.int64)
    model = build_model("digits")
    params = np.full(model.num_params, 1e30, np.float32)
    grads = np.empty_like(params)
    model.bind(params, grads)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any RuntimeWarning fails the test
        loss, _ = model.forward_backward(x, y)
        loss_sum, correct, correct5 = model.evaluate(x, y, batch_size=16)
        with np.errstate(over="warn"):  # the silencing is local: numpy's own setting is left as it was
            try:
                np.float32(1e30) * np.float32(1e30)
            except RuntimeWarning as e:
                assert "overflow" in str(e)
            else:
                raise AssertionError("np.errstate leaked out of the model")
    assert not np.isfinite(loss) and not np.isfinite(grads).all()
    assert not np.isfinite(loss_sum) and (correct, correct5) == (0, 0)
