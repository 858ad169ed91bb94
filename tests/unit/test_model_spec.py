"""The layer contract (parameters with init and multipliers, buffers, train/eval), residual blocks, and
networks as stored definitions (mpiasgd.model.spec): built from data, from user files, with clear errors."""

import json
import os
import signal
import time

import numpy as np
import pytest
from kit import REPO
from kit.grads import check_model_gradient

from mpiasgd.model import Model, build_model
from mpiasgd.model.layers import (
    AvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool,
    Layer,
    Linear,
    LocalResponseNorm,
    MaxPool2d,
    ReLU,
    Residual,
    SubsamplePad,
)
from mpiasgd.model.spec import FORMAT, ModelSpecError, check_spec, from_json, layer_from_spec, resolve, stored, to_json
from mpiasgd.ops import get_backend

ops = get_backend("numpy")
NET = REPO / "tests" / "mpi" / "nets" / "small_bn.py"


def every_layer() -> list[Layer]:
    """A float64-checkable network on (3, 8, 8) inputs holding every layer type and all three shortcut kinds."""
    def block(cin: int, cout: int, stride: int, shortcut: list) -> Residual:
        return Residual([Conv2d(cin, cout, 3, stride, 1, bias=False), BatchNorm2d(cout), ReLU(),
                         Conv2d(cout, cout, 3, 1, 1, bias=False), BatchNorm2d(cout)], shortcut, [ReLU()])

    return [Conv2d(3, 4, 3, 1, 1), BatchNorm2d(4), ReLU(), LocalResponseNorm(3, 1e-2, 0.75, 2.0),
            MaxPool2d(3, 1, 1, ceil_mode=True),                   # 4x8x8
            block(4, 4, 1, []),                                   # identity
            block(4, 8, 2, [SubsamplePad(4, 8, 2)]),              # option A: 8x4x4
            block(8, 6, 1, [Conv2d(8, 6, 1, bias=False), BatchNorm2d(6)]),  # projection
            AvgPool2d(3, 2, 1, count_include_pad=False),          # 6x2x2
            Dropout(0.0), Flatten(), Linear(24, 12), ReLU(), Dropout(0.3), Linear(12, 5)]


def test_every_layer_gradient_matches_float64_finite_differences():
    """Training-mode gradient of a network with BatchNorm (batch statistics depend on x), residual blocks
    of all three shortcut kinds, LRN, padded/ceil max pooling, average pooling and dropout (the same mask
    for every evaluation: the minibatch number is fixed) against central differences."""
    model = Model("every", (3, 8, 8), every_layer(), ops, dtype=np.float64)
    rng = np.random.default_rng(7)
    params = model.init_params(1).astype(np.float64) + 0.05 * rng.standard_normal(model.num_params)
    x, y = rng.standard_normal((6, 3, 8, 8)), rng.integers(0, 5, 6)
    check_model_gradient(model, params, x, y, rng, per_tensor=3, minibatch=3)


def test_parameters_declare_init_and_multipliers():
    layers = [Conv2d(3, 8, 3, pad=1, init="normal", std=0.01, lr_mult=1.0, decay_mult=4.0, bias_lr_mult=2.0),
              BatchNorm2d(8, decay_mult=0.5), ReLU(), GlobalAvgPool(), Linear(8, 10, init="zeros", lr_mult=3.0)]
    model = Model("m", (3, 8, 8), layers, ops)
    names = [n for n, _, _ in model.layout()]
    assert names == ["conv1.weight", "conv1.bias", "bn1.weight", "bn1.bias", "fc1.weight", "fc1.bias"]
    sizes = [216, 8, 8, 8, 80, 10]
    expand = lambda values: np.repeat(np.float32(values), sizes)  # noqa: E731
    np.testing.assert_array_equal(model.decay_mult(), expand([4, 0, 0.5, 0.5, 1, 0]))
    np.testing.assert_array_equal(model.lr_mult(), expand([1, 2, 1, 1, 3, 1]))
    p = model.init_params(0)
    w = p[:216]
    assert 0.007 < w.std() < 0.013 and (p[216:224] == 0).all()
    np.testing.assert_array_equal(p[224:232], 1.0)  # gamma starts at 1, beta at 0
    assert (p[232:] == 0).all()  # beta, the zero-initialised classifier and its bias
    np.testing.assert_array_equal(p[:216], (np.random.default_rng(0).standard_normal(216) * 0.01).astype(np.float32))
    with pytest.raises(ValueError, match="init must be one of he, normal, zeros, ones, got 'xavier'"):
        Conv2d(3, 8, 3, init="xavier")
    with pytest.raises(ValueError, match="init 'normal' needs std > 0"):
        Linear(3, 8, init="normal")


def test_buffers_layout_init_and_train_eval_behaviour():
    model = Model("bn", (2, 4, 4), [BatchNorm2d(2, momentum=0.5), GlobalAvgPool(), Linear(2, 3)], ops)
    assert model.buffer_layout() == [("bn1.running_mean", 0, (2,)), ("bn1.running_var", 2, (2,))]
    np.testing.assert_array_equal(model.init_buffers(), [0, 0, 1, 1])
    p = model.init_params(0)
    buffers = model.init_buffers()
    model.bind(p, np.zeros_like(p), buffers)
    x = np.random.default_rng(0).standard_normal((5, 2, 4, 4)).astype(np.float32) * 3 + 2
    y = np.arange(5) % 3
    model.forward_backward(x, y)
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3), ddof=1)  # PyTorch: unbiased into running_var
    np.testing.assert_allclose(buffers, np.concatenate([0.5 * mean, 0.5 + 0.5 * var]), rtol=1e-5)
    # evaluation uses the running statistics and leaves them alone; training uses the batch's
    before = buffers.copy()
    loss_eval, _, _ = model.evaluate(x, y)
    np.testing.assert_array_equal(buffers, before)
    loss_train, _ = model.forward_backward(x, y)
    assert loss_eval / 5 != pytest.approx(loss_train)
    model.ctx.update_buffers = False  # a pipeline module's recompute
    after = buffers.copy()
    model.forward_backward(x, y)
    np.testing.assert_array_equal(buffers, after)


def test_dropout_mask_is_keyed_by_minibatch_and_off_in_evaluation():
    model = Model("d", (4,), [Linear(4, 64), Dropout(0.5), Linear(64, 3)], ops)
    p = model.init_params(0)
    model.bind(p, np.zeros_like(p))
    x = np.ones((8, 4), np.float32)
    layer = model.layers[1]
    out = {}
    for m in (5, 5, 6):
        model.ctx.minibatch = m
        model.train()
        out.setdefault(m, []).append(layer.forward(model.layers[0].forward(x)))
    np.testing.assert_array_equal(out[5][0], out[5][1])
    assert not np.array_equal(out[5][0], out[6][0])
    kept = (out[5][0] != 0).mean()
    assert 0.4 < kept < 0.6
    model.eval()
    h = model.layers[0].forward(x)
    assert layer.forward(h) is h


def test_residual_block_is_one_layer_and_names_its_children():
    model = build_model("resnet20")
    assert [n for n in model.names if n.startswith("res")] == [f"res{i}" for i in range(1, 10)]
    assert len(model.layers) == 14 and model.num_params == 269722 and model.num_buffers == 1376
    names = [n for n, _, _ in model.layout()]
    assert names[:4] == ["conv1.weight", "bn1.weight", "bn1.bias", "res1.conv1.weight"]
    assert "res4.bn2.bias" in names and names[-2:] == ["fc1.weight", "fc1.bias"]
    assert ("res9.bn2.running_var", 1376 - 64, (64,)) in model.buffer_layout()
    assert model.shapes[3] == (16, 32, 32) and model.shapes[6] == (32, 16, 16) and model.shapes[9] == (64, 8, 8)
    # a pipeline module of blocks 4..6 owns one contiguous slice of parameters and of buffers
    start, stop = model.param_range(6, 9)
    assert stop - start == 13952 + 2 * 18560
    bstart, bstop = model.buffer_range(6, 9)
    assert bstop - bstart == 3 * 2 * 2 * 32
    with pytest.raises(ValueError, match=r"main branch gives \(8, 4, 4\), the shortcut \(4, 8, 8\)"):
        Model("bad", (4, 8, 8), [Residual([Conv2d(4, 8, 3, 2, 1)]), GlobalAvgPool(), Linear(8, 2)], ops)


def test_definition_round_trip_is_data():
    model = Model("every", (3, 8, 8), every_layer(), ops)
    text = to_json(model.spec())
    spec = json.loads(text)
    assert spec["format"] == FORMAT and spec["input_shape"] == [3, 8, 8]
    rebuilt = build_model(from_json(text))
    assert rebuilt.layout() == model.layout() and rebuilt.buffer_layout() == model.buffer_layout()
    assert to_json(rebuilt.spec()) == text
    np.testing.assert_array_equal(rebuilt.init_params(3), model.init_params(3))
    np.testing.assert_array_equal(rebuilt.decay_mult(), model.decay_mult())
    p = model.init_params(3)
    x, y = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32), np.arange(4) % 5
    losses = []
    for m in (model, rebuilt):
        m.bind(p.copy(), np.zeros_like(p))
        losses.append(m.forward_backward(x, y, minibatch=1))
    assert losses[0] == losses[1]


@pytest.mark.parametrize("spec, message", [
    ({"type": "Eval", "x": 1}, r"layers\[0\]: unknown layer type 'Eval'"),
    ({"type": "Conv2d", "in_channels": 3, "out_channels": 4}, r"missing argument\(s\) kernel"),
    ({"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel": "3"}, "kernel must be int, got '3'"),
    ({"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel": 3, "code": "rm -rf"},
     "unknown argument 'code'"),
    ({"type": "Linear", "in_features": 3, "out_features": 4, "bias": 1}, "bias must be bool, got 1"),
    ({"type": "Dropout", "p": 1.5}, r"p must be in \[0, 1\)"),
    ({"type": "Residual", "main": [{"type": "__import__"}]}, r"layers\[0\].main\[0\]: unknown layer type"),
    ("Conv2d", 'a layer must be an object with a "type"'),
])
def test_bad_layer_definitions_are_one_clear_error(spec, message):
    with pytest.raises(ModelSpecError, match=message):
        layer_from_spec(spec, "layers[0]")


def test_stored_definitions_are_checked():
    good = to_json(build_model("digits").spec())
    with pytest.raises(ModelSpecError, match=r"run log 'x\.h5': its network definition: not valid JSON"):
        stored({"model_spec": good[:-3]}, "run log 'x.h5'")
    with pytest.raises(ModelSpecError, match="format 'pickle'"):
        from_json(json.dumps({**json.loads(good), "format": "pickle"}))
    assert stored({"model": "cifar10"}, "old log")["name"] == "cifar10"  # a log from before stored definitions
    with pytest.raises(ModelSpecError, match="holds no network definition and names no built-in"):
        stored({"model": "net.py:build"}, "old log")


def test_user_files(tmp_path):
    spec = resolve(f"{NET}:build", (1, 8, 8))
    assert spec["name"] == "small_bn" and spec["input_shape"] == [1, 8, 8]
    model = build_model(spec)
    assert model.num_params == 33594 and model.num_buffers == 352 and model.num_classes == 10
    # the same network as a JSON definition, with or without the envelope
    path = tmp_path / "net.json"
    path.write_text(json.dumps(spec["layers"]))
    assert build_model(resolve(str(path), (1, 8, 8))).layout() == model.layout()
    bad = tmp_path / "broken.py"
    bad.write_text("def build():\n    return [1, 2]\n")
    with pytest.raises(ModelSpecError, match=r"build\(\) must return a non-empty list of mpiasgd.model.layers "
                                             "layers, got int"):
        resolve(f"{bad}:build", (1, 8, 8))
    bad.write_text("import nonexistent_module_xyz\n")
    with pytest.raises(ModelSpecError, match=r"importing .* failed: ModuleNotFoundError"):
        resolve(f"{bad}:build", (1, 8, 8))
    with pytest.raises(ModelSpecError, match="no such file"):
        resolve(str(tmp_path / "missing.py") + ":build", (1, 8, 8))
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(ModelSpecError, match=r"folder.json': not a regular file '.*folder.json'$"):
        resolve(str(tmp_path / "folder.json"), (1, 8, 8))
    bad.write_text("build = 5\n")
    with pytest.raises(ModelSpecError, match=r"broken.py' 'build' is not a function but of type int$"):
        resolve(f"{bad}:build", (1, 8, 8))
    cwd = os.getcwd()  # a file that changes folder does not move the caller (the run log is written there)
    bad.write_text(f"import os\nos.chdir({str(tmp_path)!r})\nfrom mpiasgd.model.layers import ReLU\n"
                   "def build():\n    os.chdir('/')\n    return [ReLU()]\n")
    assert resolve(f"{bad}:build", (1, 8, 8))["layers"] == [{"type": "ReLU"}] and os.getcwd() == cwd
    custom = tmp_path / "custom.py"
    custom.write_text("from mpiasgd.model.layers import ReLU\nclass Mine(ReLU):\n    pass\n"
                      "def build():\n    return [Mine()]\n")
    with pytest.raises(ModelSpecError, match="not one of mpiasgd's layer types"):
        resolve(f"{custom}:build", (1, 8, 8))
    with pytest.raises(ModelSpecError, match="unknown model 'resnet21'"):
        resolve("resnet21")


@pytest.mark.parametrize("layer, message", [
    ({"type": "Conv2d", "in_channels": 3, "out_channels": 0, "kernel": 3}, r"Conv2d: out_channels must be an integer "
                                                                           r"in \[1, 2147483647\], got 0"),
    ({"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel": -3}, "Conv2d: kernel must be an integer"),
    ({"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel": 3, "stride": 0}, "Conv2d: stride must be"),
    ({"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel": 3, "pad": -1},
     r"pad must be an integer in \[0,"),
    ({"type": "Linear", "in_features": 3, "out_features": 10**30}, "out_features must be an integer"),
    ({"type": "Linear", "in_features": 3, "out_features": 4, "init": "normal", "std": float("inf")},
     "std must be a finite number > 0, got inf"),
    ({"type": "Linear", "in_features": 3, "out_features": 4, "lr_mult": float("nan")}, "lr_mult must be a finite"),
    ({"type": "Linear", "in_features": 3, "out_features": 4, "decay_mult": -1.0}, "decay_mult must be a finite"),
    ({"type": "MaxPool2d", "kernel": 0}, "MaxPool2d: kernel must be an integer"),
    ({"type": "AvgPool2d", "kernel": 2, "stride": 0}, "AvgPool2d: stride must be"),
    ({"type": "BatchNorm2d", "num_features": 4, "eps": float("inf")}, "BatchNorm2d: eps must be a finite"),
    ({"type": "BatchNorm2d", "num_features": 4, "eps": 10**400}, r"BatchNorm2d: eps must be a finite number > 0, got "
                                                                 r"10{29}\.\.\. \(401 characters\)$"),
    ({"type": "LocalResponseNorm", "size": 5, "beta": float("nan")}, "LocalResponseNorm: beta must be a finite "
                                                                      "number, got nan$"),
    ({"type": "MaxPool2d", "kernel": 10**400}, r"kernel must be an integer in \[1, \d+\], got 10{29}\.\.\. "
                                               r"\(401 characters\)$"),
    ({"type": "SubsamplePad", "in_channels": 8, "out_channels": 4}, "need out_channels >= in_channels"),
    ({"type": "Flatten", "x": 1}, "unknown argument 'x'; Flatten takes no arguments"),
])
def test_layer_arguments_out_of_range_are_refused_by_name(layer, message):
    with pytest.raises(ModelSpecError, match=message):
        layer_from_spec(layer, "layers[0]")


def test_definitions_are_bounded_and_strict(tmp_path):
    leaf = {"type": "ReLU"}
    nested = leaf
    for _ in range(20):
        nested = {"type": "Residual", "main": [nested]}
    with pytest.raises(ModelSpecError, match=r"nested more than 16 deep"):
        layer_from_spec(nested, "layers[0]")
    deep_text = "[" * 100000 + "]" * 100000
    with pytest.raises(ModelSpecError, match="not valid JSON"):
        from_json(deep_text)
    good = json.loads(to_json(build_model("digits").spec()))
    with pytest.raises(ModelSpecError, match="unknown key\\(s\\) 'input_shap'"):
        from_json(json.dumps({**good, "input_shap": [1, 8, 8]}))
    with pytest.raises(ModelSpecError, match="its model_spec attribute is a ndarray"):
        stored({"model_spec": np.zeros(3)}, "run log 'x.h5'")
    path = tmp_path / "bom.json"
    path.write_text(json.dumps(good["layers"]), encoding="utf-8-sig")
    assert build_model(resolve(str(path), (1, 8, 8))).num_params == 6090


def test_a_network_of_more_than_max_layers_is_refused_by_count(tmp_path):
    relu = {"type": "ReLU"}
    block = {"type": "Residual", "main": [relu] * 99}  # 100 layers, the block included
    ok = {"format": FORMAT, "name": "n", "input_shape": [1, 8, 8], "layers": [block] * 100}
    check_spec(ok)  # 10,000: the limit
    with pytest.raises(ModelSpecError, match=r"10001 layers \(residual blocks' included\), at most 10000"):
        check_spec({**ok, "layers": [block] * 100 + [relu]})
    path = tmp_path / "deep.py"  # a file's network is refused as it is made, before any rank builds it
    path.write_text("from mpiasgd.model.layers import ReLU\ndef build():\n    return [ReLU() for _ in range(200000)]\n")
    with pytest.raises(ModelSpecError, match=r"^--model '.*deep.py:build': network definition: 200000 layers"):
        resolve(f"{path}:build", (1, 8, 8))


def test_a_model_file_that_hangs_is_stopped_by_the_time_limit_or_a_signal(tmp_path):
    path = tmp_path / "stuck.py"
    path.write_text("import time\ndef build():\n    time.sleep(60)\n"
                    "def swallows():\n    try:\n        time.sleep(60)\n    except BaseException:\n        pass\n"
                    "    time.sleep(60)\n"
                    "def signals():\n    import os, signal\n    os.kill(os.getpid(), signal.SIGUSR1)\n"
                    "    time.sleep(60)\n")
    before = signal.getsignal(signal.SIGUSR1)
    start = time.monotonic()
    with pytest.raises(ModelSpecError, match=r"^--model '.*stuck.py:build': importing '.*stuck.py' and calling "
                                             r"build\(\) took more than 0.5 s \(--model-timeout\)"):
        resolve(f"{path}:build", (1, 8, 8), limit_s=0.5)
    # a file that catches the first stop is stopped again each second
    with pytest.raises(ModelSpecError, match=r"swallows\(\) took more than 0.5 s"):
        resolve(f"{path}:swallows", (1, 8, 8), limit_s=0.5)
    with pytest.raises(ModelSpecError, match=r"SIGUSR1 received while importing '.*stuck.py' or calling signals\(\)"):
        resolve(f"{path}:signals", (1, 8, 8), limit_s=30)
    assert time.monotonic() - start < 10
    assert signal.getsignal(signal.SIGUSR1) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_model_file_may_import_its_neighbours_and_numpy_sizes_are_stored_as_numbers(tmp_path):
    (tmp_path / "blocks.py").write_text("from mpiasgd.model.layers import Conv2d, ReLU\n"
                                        "def stem(width):\n    return [Conv2d(1, width, 3, pad=1), ReLU()]\n")
    (tmp_path / "net.py").write_text("import numpy as np\nfrom blocks import stem\n"
                                     "from mpiasgd.model.layers import GlobalAvgPool, Linear\n"
                                     "def build():\n    w = np.int64(6)\n"
                                     "    return [*stem(w), GlobalAvgPool(), Linear(w, 10)]\n")
    spec = resolve(f"{tmp_path / 'net.py'}:build", (1, 8, 8))
    assert spec["layers"][0]["out_channels"] == 6 and type(spec["layers"][0]["out_channels"]) is int
    assert from_json(to_json(spec)) == spec
    (tmp_path / "bye.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ModelSpecError, match=r"importing .* failed: SystemExit: 0"):
        resolve(f"{tmp_path / 'bye.py'}:build", (1, 8, 8))


def test_batchnorm_refuses_one_value_per_channel_in_training():
    """As torch.nn.BatchNorm2d: a batch statistic of one value is no statistic (its variance is 0)."""
    model = Model("one", (1, 8, 8), [Conv2d(1, 4, 8), BatchNorm2d(4), ReLU(), Flatten(), Linear(4, 3)], ops)
    assert model.layers[1].plane == 1  # 1x1 maps: the start-up check refuses --batch-size 1 for it
    p = model.init_params(0)
    model.bind(p, np.zeros_like(p))
    x = np.ones((1, 1, 8, 8), np.float32)
    with pytest.raises(ValueError, match=r"BatchNorm2d\(4\): training needs more than one value per channel"):
        model.forward_backward(x, np.zeros(1, np.int64))
    assert np.isfinite(model.evaluate(x, np.zeros(1, np.int64))[0])  # evaluation uses the running statistics
    model.forward_backward(np.ones((2, 1, 8, 8), np.float32), np.zeros(2, np.int64))


def test_resuming_a_checkpoint_without_a_definition_never_runs_the_file_its_config_names(tmp_path):
    """A checkpoint from before definitions were stored names a built-in; one naming a file (forged: the CRC is a
    checksum, not a signature) is refused before the file is imported."""
    from types import SimpleNamespace

    from mpiasgd.config import Config, ConfigError
    from mpiasgd.launch.startup import definition_text

    marker = tmp_path / "ran"
    path = tmp_path / "pwn.py"
    path.write_text(f"open({str(marker)!r}, 'w').close()\nfrom mpiasgd.model.layers import ReLU\n"
                    "def build():\n    return [ReLU()]\n")
    old = SimpleNamespace(model_spec="")  # what checkpoint.load gives for a file without one
    data = SimpleNamespace(input_shape=(1, 8, 8))
    cfg = Config(model=f"{path}:build", resume="old.ckpt.h5")
    with pytest.raises(ConfigError, match=r"^--resume: checkpoint 'old.ckpt.h5' holds no network definition and "
                                          r"names no built-in network \('.*pwn.py:build'\)"):
        definition_text(cfg, data, old)
    assert not marker.exists()
    text = definition_text(Config(model="digits", resume="old.ckpt.h5"), data, old)  # a built-in: by its name
    assert from_json(text) == resolve("digits")


def test_a_layer_output_larger_than_the_kernels_index_is_refused_when_the_model_is_built():
    """A pad of 1,000,000 passes its own check (an extent < 2^31) but makes 3.2e13 values per image: refused by
    name before any memory is asked for (train's start-up, evaluate and simulate build the model alike)."""
    spec = {"format": FORMAT, "name": "bigpad", "input_shape": [1, 8, 8], "layers": [
        {"type": "Conv2d", "in_channels": 1, "out_channels": 8, "kernel": 3, "pad": 1000000},
        {"type": "GlobalAvgPool"}, {"type": "Linear", "in_features": 8, "out_features": 10}]}
    with pytest.raises(ValueError, match=r"^model 'bigpad', layer conv1: its output \(8, 2000006, 2000006\) holds "
                                         r"32,000,192,000,288 values per image, more than 2,147,483,647 "):
        build_model(spec)
    spec["layers"][0]["pad"] = 1000  # 33 million values per image: allowed
    assert build_model(spec).shapes[0] == (8, 2006, 2006)
