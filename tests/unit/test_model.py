"""Model: flat parameter binding, initialisation, registry, whole-model gradient, a few SGD steps."""

import numpy as np
import pytest
from kit.grads import check_model_gradient
from sklearn.datasets import load_digits

from mpiasgd.model import MODELS, Model, build_model
from mpiasgd.model.layers import Conv2d, Linear
from mpiasgd.ops import get_backend

ops = get_backend("numpy")




def bound(name: str, seed: int = 0) -> Model:
    model = build_model(name)
    params = model.init_params(seed)
    model.bind(params, np.empty_like(params))
    return model


@pytest.fixture(scope="module")
def digits_batch():
    """64 sklearn digits as (64, 1, 8, 8) float32 in [0, 1] and int64 labels."""
    data = load_digits()
    x = (data.images[:64] / 16.0).astype(np.float32).reshape(64, 1, 8, 8)
    return x, data.target[:64].astype(np.int64)


def test_parameter_counts_and_shapes():
    digits, cifar = build_model("digits"), build_model("cifar10")
    assert (digits.num_params, digits.input_shape, digits.num_classes) == (6090, (1, 8, 8), 10)
    assert (cifar.num_params, cifar.input_shape, cifar.num_classes) == (85098, (3, 32, 32), 10)
    assert [s for s, layer in zip(cifar.shapes, cifar.layers, strict=True) if layer.kind == "pool"] == \
        [(32, 15, 15), (32, 7, 7), (64, 3, 3)]
    assert cifar.shapes[-1] == (10,) and digits.shapes[-2] == (128,)
    deep = build_model("cifar10_deep")  # parameters per conv/linear layer: 9*Cin*Cout + Cout
    assert [deep.param_range(i, i + 1)[1] - deep.param_range(i, i + 1)[0] for i in range(len(deep.layers))
            if deep.layers[i].param_shapes()] == [448, 2320, 4640, 9248, 18496, 36928, 10250]
    assert deep.num_params == 82330 and sum(layer.kind == "conv" for layer in deep.layers) == 6
    assert [s for s, layer in zip(deep.shapes, deep.layers, strict=True) if layer.kind == "pool"] == \
        [(16, 16, 16), (32, 8, 8), (64, 4, 4)]
    assert MODELS["cifar10_deep"].dataset == "cifar10" and MODELS["digits"].dataset == "digits"


def test_layout_is_contiguous_and_named():
    model = build_model("cifar10")
    layout = model.layout()
    assert [name for name, _, _ in layout] == [
        "conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "conv3.weight", "conv3.bias",
        "fc1.weight", "fc1.bias"]
    offset = 0
    for _, start, shape in layout:
        assert start == offset
        offset += int(np.prod(shape))
    assert offset == model.num_params
    assert layout[0][2] == (32, 3, 5, 5) and layout[-2][2] == (10, 576)


def test_registry_and_unknown_names():
    assert set(MODELS) >= {"digits", "cifar10"}
    with pytest.raises(ValueError, match="unknown model 'mnist'; valid models: alexnet_1gpu, alexnet_1gpu_64, cifar10, "
                       "cifar10_18pct, cifar10_deep, digits, resnet20, resnet56"):
        build_model("mnist")
    with pytest.raises(ValueError, match="unknown ops backend 'tpu'; valid backends: numpy"):
        build_model("digits", backend="tpu")


def test_describe_lists_every_layer():
    text = build_model("cifar10").describe()
    for token in ("conv1", "pool3", "fc1", "(64, 3, 3)", "51,264", "85,098"):
        assert token in text
    assert len(text.splitlines()) == len(build_model("cifar10").layers) + 2


@pytest.mark.parametrize("bad, what", [
    (np.zeros(6090, np.float64), "dtype float64"),
    (np.zeros(6089, np.float32), r"shape \(6089,\)"),
    (np.zeros((6090, 1), np.float32), r"shape \(6090, 1\)"),
    (np.zeros(2 * 6090, np.float32)[::2], "a non-contiguous array"),
    (list(range(6090)), "list"),
])
def test_bind_rejects_bad_vectors(bad, what):
    model = build_model("digits")
    good = np.zeros(6090, np.float32)
    with pytest.raises(ValueError, match=f"Model.bind: params must be .*float32.*length 6090, got {what}"):
        model.bind(bad, good)
    with pytest.raises(ValueError, match=f"Model.bind: grads must be .*, got {what}"):
        model.bind(good, bad)
    with pytest.raises(ValueError, match="params and grads must be separate"):
        model.bind(good, good)


def test_layers_hold_views_into_the_flat_vectors(digits_batch):
    model = build_model("digits")
    params, grads = model.init_params(0), np.zeros(model.num_params, np.float32)
    model.bind(params, grads)
    assert model.params is params and model.grads is grads
    convs = [layer for layer in model.layers if isinstance(layer, (Conv2d, Linear))]
    for layer in convs:
        assert np.shares_memory(layer.weight, params) and np.shares_memory(layer.bias, params)
        assert np.shares_memory(layer.dweight, grads) and np.shares_memory(layer.dbias, grads)
    params[:] = 0.5  # e.g. an MPI receive into the weight buffer
    assert (convs[0].weight == 0.5).all() and (convs[-1].bias == 0.5).all()
    x, y = digits_batch
    model.forward_backward(x, y)
    fc_offset = model.layout()[-2][1]
    assert np.array_equal(grads[fc_offset:fc_offset + 1280].reshape(10, 128), convs[-1].dweight)


def test_init_is_deterministic_he_normal_with_zero_biases_and_classifier():
    model = build_model("cifar10")
    a, b, c = model.init_params(0), model.init_params(0), model.init_params(1)
    assert a.dtype == np.float32 and a.shape == (85098,)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    fan_in = {"conv1": 75, "conv2": 800, "conv3": 800, "fc1": 576}
    for name, offset, shape in model.layout():
        values = a[offset:offset + int(np.prod(shape))]
        if name.endswith(".bias") or name.startswith("fc1"):  # biases and the classifier start at zero
            assert (values == 0).all(), name
        else:
            expected = np.sqrt(2.0 / fan_in[name.split(".")[0]])
            assert values.std() == pytest.approx(expected, rel=0.1), name
            assert abs(values.mean()) < 0.1 * expected, name


def test_decay_mask_covers_weights_only():
    model = build_model("digits")
    mask = model.decay_mask()
    assert mask.dtype == np.float32 and mask.shape == (6090,)
    assert set(np.unique(mask)) == {0.0, 1.0}
    assert mask.sum() == 16 * 9 + 32 * 16 * 9 + 10 * 128
    for name, offset, shape in model.layout():
        assert (mask[offset:offset + int(np.prod(shape))] == (1.0 if name.endswith("weight") else 0.0)).all()


def test_whole_model_gradient_matches_finite_differences():
    # float64 copy of the digits network: central differences are then accurate to ~1e-9
    spec = MODELS["digits"]
    model = Model("digits", spec.input_shape, spec(ops), ops, dtype=np.float64)
    rng = np.random.default_rng(4)
    params = model.init_params(3).astype(np.float64) + 0.1 * rng.standard_normal(model.num_params)  # non-zero head
    x, y = rng.standard_normal((4, 1, 8, 8)), rng.integers(0, 10, 4)
    analytic = check_model_gradient(model, params, x, y, rng, per_tensor=3)
    # the production float32 model computes the same gradient to float32 precision
    model32 = bound("digits", 3)
    model32.params[:] = params  # the same (perturbed) weights in float32
    model32.forward_backward(x.astype(np.float32), y)
    np.testing.assert_allclose(model32.grads, analytic, atol=1e-5, rtol=1e-3)


def test_forward_backward_overwrites_grads(digits_batch):
    model = bound("digits")
    x, y = digits_batch
    loss1, correct1 = model.forward_backward(x, y)
    first = model.grads.copy()
    loss2, correct2 = model.forward_backward(x, y)
    assert (loss1, correct1) == (loss2, correct2) and isinstance(correct1, int)
    assert np.array_equal(model.grads, first)


def first_grad(model: Model, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Minus the gradient of `model` on (x, y): a descent direction."""
    model.forward_backward(x, y)
    return -model.grads.copy()


def test_evaluate_sums_loss_and_is_independent_of_chunking(digits_batch):
    model = bound("digits")
    x, y = digits_batch
    mean_loss, correct = model.forward_backward(x, y)
    loss_sum, correct_all, correct5 = model.evaluate(x, y)
    assert loss_sum == pytest.approx(mean_loss * 64, rel=1e-5) and correct_all == correct
    loss_chunked, correct_chunked, correct5_chunked = model.evaluate(x, y, batch_size=7)
    assert loss_chunked == pytest.approx(loss_sum, rel=1e-5) and correct_chunked == correct
    # the initial last layer is zero: every logit ties, so no image is a top-5 hit (ties count against the label)
    assert correct5_chunked == correct5 == 0 < correct
    model.bind(model.params + np.float32(0.05) * np.sign(first_grad(model, x, y)), model.grads)
    _, correct, correct5 = model.evaluate(x, y)
    assert correct5 == model.evaluate(x, y, batch_size=7)[2] >= correct > 0  # untied logits after a step


def test_constant_outputs_are_no_top5_hit():
    """A network whose logits are all equal (issue 36: it scored top-5 100 %): every label ties with 9 other
    classes, so no image is a top-5 hit; a model with zero weights evaluates so too."""
    from mpiasgd.model import build_model
    from mpiasgd.model.model import topk_correct

    logits = np.zeros((50, 10), np.float32)
    labels = np.arange(50) % 10
    assert [topk_correct(logits, labels, k) for k in (1, 5, 9, 10)] == [0, 0, 0, 50]
    model = build_model("digits")
    params = np.zeros(model.num_params, np.float32)
    model.bind(params, np.zeros_like(params))
    x = np.random.default_rng(0).random((40, 1, 8, 8), dtype=np.float32)
    _, correct, correct5 = model.evaluate(x, (np.arange(40) % 10).astype(np.int64), batch_size=16)
    assert (correct, correct5) == (4, 0)  # top-1: argmax is class 0 on a tie; top-5: ties count against


def test_top5_counts_the_label_among_the_five_largest_logits():
    """Top-k by hand: fewer than k other logits >= the label's (a tie counts against the label); with k or
    fewer classes every image is a hit; a NaN label logit never is."""
    from mpiasgd.model.model import topk_correct

    logits = np.array([[9, 8, 7, 6, 5, 4, 3],      # label 4: 4 logits above it -> top-5 hit
                       [9, 8, 7, 6, 5, 4, 3],      # label 5: 5 above -> miss
                       [1, 1, 1, 1, 1, 1, 1],      # all tied: 6 others >= the label's -> miss
                       [0, 0, np.nan, 0, 0, 0, 0],   # NaN label logit: a miss
                       [5, 5, 5, 5, 0, 0, 0]],     # label 3 tied with 3 others: 3 < 5 -> top-5 hit, top-1 miss
                      dtype=np.float32)
    labels = np.array([4, 5, 6, 2, 3])
    assert topk_correct(logits, labels, 5) == 2
    assert topk_correct(logits, labels, 4) == 1           # row 0: 4 others above -> miss; row 4: 3 tied -> hit
    assert topk_correct(logits, labels, 1) == 0           # no label is the unique maximum
    assert topk_correct(logits[:2, :5], np.array([4, 3]), 5) == 2  # 5 classes: every image a top-5 hit
    assert topk_correct(logits[:0], labels[:0], 5) == 0
    rng = np.random.default_rng(0)
    big = rng.standard_normal((200, 10)).astype(np.float32)
    y = rng.integers(0, 10, 200)
    top5 = np.argsort(-big, axis=1)[:, :5]
    assert topk_correct(big, y, 5) == int((top5 == y[:, None]).any(axis=1).sum())


def test_sgd_steps_on_a_fixed_digits_batch_decrease_the_loss(digits_batch):
    model = bound("digits")
    x, y = digits_batch
    losses = []
    for _ in range(30):
        loss, _ = model.forward_backward(x, y)
        losses.append(loss)
        model.params -= 0.1 * model.grads  # in place: the layers keep their views
    assert losses[0] == pytest.approx(np.log(10))  # zero-initialised classifier
    assert losses[-1] < 0.5 * losses[0], losses


def test_forward_backward_checks_its_inputs(digits_batch):
    x, y = digits_batch
    with pytest.raises(RuntimeError, match="call bind"):
        build_model("digits").forward_backward(x, y)
    model = bound("digits")
    with pytest.raises(ValueError, match=r"x must be float32 of shape \(N, 1, 8, 8\)"):
        model.forward_backward(x.reshape(64, 1, 4, 16), y)
    with pytest.raises(ValueError, match=r"x must be float32"):
        model.forward_backward(x.astype(np.float64), y)
    with pytest.raises(ValueError, match=r"y must be integer labels of shape \(64,\)"):
        model.forward_backward(x, y[:10])
    with pytest.raises(ValueError, match="label 10 at index 0"):
        model.forward_backward(x, np.full(64, 10))


def test_digits_reaches_97_percent_test_accuracy_with_sgd():
    # the project's digits split (mpiasgd.data.digits): 360 stratified test images, random_state 0
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    train_x, test_x, train_y, test_y = train_test_split(
        images, data.target.astype(np.int64), test_size=360, stratify=data.target, random_state=0)
    model = bound("digits", seed=1)
    params, grads = model.params, model.grads
    velocity, decay = np.zeros_like(params), 5e-4 * model.decay_mask()
    rng, epochs, batch = np.random.default_rng(1), 30, 32
    for epoch in range(epochs):  # SGD, momentum 0.9, weight decay 5e-4, cosine step size from 0.05
        lr = np.float32(0.05 * 0.5 * (1 + np.cos(np.pi * epoch / epochs)))
        order = rng.permutation(train_y.size)
        for start in range(0, train_y.size - batch + 1, batch):
            idx = order[start:start + batch]
            model.forward_backward(train_x[idx], train_y[idx])
            velocity *= np.float32(0.9)
            velocity += grads + decay * params
            params -= lr * velocity
    _, correct, correct5 = model.evaluate(test_x, test_y)
    assert correct / test_y.size >= 0.97, f"{correct}/{test_y.size} correct"
    assert correct <= correct5 <= test_y.size and correct5 / test_y.size >= 0.99
