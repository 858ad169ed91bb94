"""The papers' networks (cifar10_18pct, alexnet_1gpu, alexnet_1gpu_64) and model export (.npz, PyTorch names,
`mpiasgd export` on run logs and checkpoints).

Parameter counts are computed here from the layer sizes by hand (k*k*Cin*Cout + Cout per conv, In*Out + Out
per linear), not from the model; the PyTorch key lists of the ResNets are written out from ResNet_cifar.py's
attribute names. bench/torch_models.py checks the logits against PyTorch itself where torch is installed.
"""

from __future__ import annotations

import json
import math
import os

import h5py
import numpy as np
import pytest
from kit.grads import check_model_gradient

from mpiasgd import checkpoint
from mpiasgd.cli import main
from mpiasgd.model import MODELS, Model, build_model
from mpiasgd.model.export import SPEC_KEY, export_npz, load_npz, named_arrays, torch_names
from mpiasgd.model.layers import Conv2d, Flatten, GlobalAvgPool, Linear, LocalResponseNorm
from mpiasgd.model.networks import alexnet_1gpu, cifar10_18pct
from mpiasgd.model.spec import ModelSpecError, model_spec, resolve, to_json
from mpiasgd.ops import get_backend
from mpiasgd.runlog import RunLog, SnapshotRow, WorkerRow

ops = get_backend("numpy")
NEW = ("cifar10_18pct", "alexnet_1gpu", "alexnet_1gpu_64")


def conv(k: int, cin: int, cout: int) -> int:
    return k * k * cin * cout + cout


def fc(fin: int, fout: int) -> int:
    return fin * fout + fout


def alexnet_count(classes: int, size: int) -> int:
    first, last = (conv(11, 3, 64), 6) if size == 224 else (conv(5, 3, 64), 4)
    return (first + conv(5, 64, 192) + conv(3, 192, 384) + conv(3, 384, 256) + conv(3, 256, 256)
            + fc(256 * last * last, 4096) + fc(4096, 4096) + fc(4096, classes))


def of_kind(model: Model, kind: str) -> list[tuple[int, ...]]:
    return [shape for shape, layer in zip(model.shapes, model.layers, strict=True) if layer.kind == kind]


# ----------------------------------------------------------------------------------------------
# the networks


def test_parameter_counts_by_hand():
    assert conv(5, 3, 32) + conv(5, 32, 32) + conv(5, 32, 64) + fc(1024, 10) == 89578
    assert alexnet_count(1000, 224) == 61_100_840  # torchvision's alexnet has the same count
    assert alexnet_count(1000, 64) == 40_110_888
    assert build_model("cifar10_18pct").num_params == 89578
    assert build_model("alexnet_1gpu").num_params == alexnet_count(1000, 224)
    assert build_model("alexnet_1gpu_64").num_params == alexnet_count(1000, 64)
    for classes, size in ((200, 64), (10, 64), (100, 224)):
        model = Model("a", (3, size, size), alexnet_1gpu(classes, size), ops)
        assert (model.num_params, model.num_classes) == (alexnet_count(classes, size), classes)
    model = Model("c", (3, 32, 32), cifar10_18pct(100), ops)
    assert (model.num_params, model.num_classes) == (89578 - fc(1024, 10) + fc(1024, 100), 100)


def test_cifar10_18pct_layers_and_shapes():
    model = build_model("cifar10_18pct")
    assert [layer.kind for layer in model.layers] == [
        "conv", "pool", "relu", "lrn", "conv", "relu", "avgpool", "lrn", "conv", "relu", "avgpool", "flatten", "fc"]
    # cuda-convnet's ceil output size: 32 -> 16 -> 8 -> 4 (floor would give 15, 7, 3)
    assert of_kind(model, "pool") == [(32, 16, 16)] and of_kind(model, "avgpool") == [(32, 8, 8), (64, 4, 4)]
    assert model.shapes[-1] == (10,) and model.input_shape == (3, 32, 32)
    assert MODELS["cifar10_18pct"].dataset == "cifar10"
    lrn = [layer for layer in model.layers if isinstance(layer, LocalResponseNorm)]
    assert [(x.size, x.alpha, x.beta, x.k) for x in lrn] == [(3, 5e-5, 0.75, 1.0)] * 2
    convs = [layer for layer in model.layers if isinstance(layer, Conv2d)]
    assert [(c.kernel, c.pad, c.params()[0].init, c.params()[0].std) for c in convs] == \
        [(5, 2, "normal", 1e-4), (5, 2, "normal", 0.01), (5, 2, "normal", 0.01)]


def test_cifar10_18pct_multipliers_follow_eps_and_wc():
    # epsB/epsW = 0.002/0.001 on every bias; wc 0.004 on convs (decay_mult 1), 1 on fc10 (250), none on biases
    model = build_model("cifar10_18pct")
    lr, decay = model.lr_mult(), model.decay_mult()
    for name, offset, shape in model.layout():
        size = int(np.prod(shape))
        want_lr = 2.0 if name.endswith("bias") else 1.0
        want_decay = 0.0 if name.endswith("bias") else 250.0 if name.startswith("fc") else 1.0
        assert (lr[offset:offset + size] == want_lr).all(), name
        assert (decay[offset:offset + size] == want_decay).all(), name
    fc10 = model.layers[-1]
    assert fc10.params()[0].init == "normal" and fc10.params()[0].std == 0.01


def test_alexnet_shapes_are_arithmetic_only():
    big, small = build_model("alexnet_1gpu"), build_model("alexnet_1gpu_64")
    assert big.input_shape == (3, 224, 224) and small.input_shape == (3, 64, 64)
    assert of_kind(big, "pool") == [(64, 27, 27), (192, 13, 13), (256, 6, 6)]
    assert of_kind(small, "pool") == [(64, 16, 16), (192, 8, 8), (256, 4, 4)]
    assert big.shapes[0] == (64, 55, 55) and small.shapes[0] == (64, 32, 32)
    for model, flat in ((big, 9216), (small, 4096)):
        assert [layer.kind for layer in model.layers] == [
            "conv", "lrn", "pool", "relu", "conv", "relu", "lrn", "pool", "conv", "relu", "conv", "relu", "conv",
            "pool", "relu", "flatten", "fc", "relu", "drop", "fc", "relu", "drop", "fc"]
        fcs = [layer for layer in model.layers if isinstance(layer, Linear)]
        assert [(f.in_features, f.out_features) for f in fcs] == [(flat, 4096), (4096, 4096), (4096, 1000)]
        assert [c.out_channels for c in model.layers if isinstance(c, Conv2d)] == [64, 192, 384, 256, 256]
        lrn = [layer for layer in model.layers if isinstance(layer, LocalResponseNorm)]
        assert [(x.size, x.alpha, x.beta, x.k) for x in lrn] == [(5, 1e-4, 0.75, 2.0)] * 2
        assert {float(v) for v in model.lr_mult()} == {1.0, 2.0}
    assert (MODELS["alexnet_1gpu"].dataset, MODELS["alexnet_1gpu_64"].dataset) == ("synthetic224", "synthetic64")
    with pytest.raises(ValueError, match="size must be one of 224, 64, got 128"):
        alexnet_1gpu(size=128)


def test_new_networks_round_trip_through_their_definitions():
    for name in NEW:
        spec = resolve(name)
        assert json.loads(to_json(spec)) == spec
        rebuilt, built = build_model(spec), build_model(name)
        assert rebuilt.layout() == built.layout() and rebuilt.shapes == built.shapes
        assert (rebuilt.lr_mult() == built.lr_mult()).all() and (rebuilt.decay_mult() == built.decay_mult()).all()


def he_params(model: Model, rng: np.random.Generator) -> np.ndarray:
    """Weights of order-1 activations (so LRN and pooling matter), in the model's dtype."""
    params = np.zeros(model.num_params, model.dtype)
    for _, offset, shape in model.layout():
        size = int(np.prod(shape))
        scale = math.sqrt(2.0 / np.prod(shape[1:])) if len(shape) > 1 else 0.1
        params[offset:offset + size] = rng.standard_normal(size) * scale
    return params


def test_cifar10_18pct_gradient_matches_finite_differences():
    model = Model("cifar10_18pct", (3, 32, 32), cifar10_18pct(), ops, dtype=np.float64)
    rng = np.random.default_rng(0)
    params = he_params(model, rng)
    x, y = 3 * rng.standard_normal((2, 3, 32, 32)), rng.integers(0, 10, 2)
    check_model_gradient(model, params, x, y, rng, per_tensor=2)


def test_cifar10_18pct_trains_a_step_from_its_own_init():
    model = build_model("cifar10_18pct")
    params = model.init_params(0)
    grads = np.empty_like(params)
    model.bind(params, grads)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 8)
    loss, _ = model.forward_backward(x, y)
    assert abs(loss - math.log(10)) < 0.05  # initW 0.01 on fc10: near-uniform predictions
    assert np.isfinite(grads).all() and np.abs(grads).max() > 0


def test_alexnet_1gpu_64_one_step_at_batch_2():
    model = build_model("alexnet_1gpu_64")
    params = model.init_params(0)
    grads = np.empty_like(params)
    model.bind(params, grads)
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((2, 3, 64, 64)).astype(np.float32), np.array([3, 999])
    loss, _ = model.forward_backward(x, y, minibatch=5)
    first = grads.copy()
    assert np.isfinite(loss) and np.isfinite(first).all()
    for name, offset, shape in model.layout():  # every tensor gets a gradient
        assert np.abs(first[offset:offset + int(np.prod(shape))]).max() > 0, name
    assert model.forward_backward(x, y, minibatch=5)[0] == loss  # the same dropout masks for the same minibatch
    assert np.array_equal(grads, first)
    params -= 0.01 * model.lr_mult() * first  # one SGD step lowers the loss on this batch (same masks)
    assert model.forward_backward(x, y, minibatch=5)[0] < loss
    model.eval()
    assert model.evaluate(x, y)[0] > 0  # dropout off: evaluation runs through the same layers


# ----------------------------------------------------------------------------------------------
# .npz export


def random_state(model: Model, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(model.num_params).astype(np.float32),
            rng.uniform(0.5, 2, model.num_buffers).astype(np.float32))


@pytest.mark.parametrize("name", ["resnet20", "cifar10_18pct"])
def test_export_round_trip(tmp_path, name):
    model = build_model(name)
    spec = model.spec()
    params, buffers = random_state(model)
    path = tmp_path / f"{name}.weights"  # exactly this name: no ".npz" appended
    export_npz(str(path), spec, params, buffers if model.num_buffers else None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.weights"]  # no temporary left behind
    with np.load(path, allow_pickle=False) as z:
        names = [n for n, _, _ in model.layout()] + [n for n, _, _ in model.buffer_layout()]
        assert sorted(z.files) == sorted([*names, SPEC_KEY])
        for n, offset, shape in model.layout():
            assert z[n].shape == shape and z[n].dtype == np.float32
            assert np.array_equal(z[n].reshape(-1), params[offset:offset + z[n].size])
        for n, offset, _ in model.buffer_layout():
            assert np.array_equal(z[n].reshape(-1), buffers[offset:offset + z[n].size])
        assert z[SPEC_KEY].shape == () and json.loads(str(z[SPEC_KEY])) == spec
    spec2, params2, buffers2 = load_npz(str(path))
    assert spec2 == spec and np.array_equal(params2, params)
    assert np.array_equal(buffers2, buffers if model.num_buffers else np.zeros(0, np.float32))


def test_resnet20_export_names_and_shapes(tmp_path):
    model = build_model("resnet20")
    arrays = named_arrays(model.spec(), *random_state(model))
    assert arrays["res4.conv1.weight"].shape == (32, 16, 3, 3)
    assert arrays["res4.bn1.running_mean"].shape == (32,) and arrays["fc1.weight"].shape == (10, 64)


def test_export_refuses_wrong_vectors_and_foreign_files(tmp_path):
    model = build_model("cifar10_18pct")
    spec = model.spec()
    with pytest.raises(ValueError, match=r"params must be a float vector of shape \(89578,\), got float32 \(5,\)"):
        export_npz(str(tmp_path / "x.npz"), spec, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"buffers must be a float vector of shape \(0,\)"):
        export_npz(str(tmp_path / "x.npz"), spec, np.zeros(89578, np.float32), np.zeros(3, np.float32))
    with pytest.raises(ModelSpecError):
        export_npz(str(tmp_path / "x.npz"), {"layers": []}, np.zeros(1, np.float32))
    assert not list(tmp_path.iterdir())
    params = np.zeros(89578, np.float32)
    # a target that is not a regular file is never replaced by the rename (a device node, a folder)
    for target in ("/dev/full", str(tmp_path)):
        with pytest.raises(FileExistsError, match=f"'{target}' exists and is not a regular file"):
            export_npz(target, spec, params)
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")
    # an OSError names the file asked for, not the temporary file beside it
    with pytest.raises(FileNotFoundError, match=f"No such file or directory: '{tmp_path}/no/x.npz'"):
        export_npz(str(tmp_path / "no" / "x.npz"), spec, params)
    assert not list(tmp_path.iterdir())
    np.savez(tmp_path / "plain.npz", a=np.zeros(3))
    with pytest.raises(ValueError, match="not an mpiasgd model export: it has no '__model_spec__' entry"):
        load_npz(str(tmp_path / "plain.npz"))
    arrays = named_arrays(spec, np.zeros(89578, np.float32))
    del arrays["fc1.bias"]
    np.savez(tmp_path / "short.npz", **arrays, **{SPEC_KEY: np.array(to_json(spec)), "extra": np.zeros(1)})
    with pytest.raises(ValueError, match=r"missing \['fc1.bias'\], unexpected \['extra'\]"):
        load_npz(str(tmp_path / "short.npz"))


# ----------------------------------------------------------------------------------------------
# PyTorch names


def resnet_torch_keys(n: int) -> tuple[set[str], set[str]]:
    """ResNet_cifar.py's state_dict keys without num_batches_tracked: (parameters, buffers)."""
    params, buffers = {"conv1.weight", "bn1.weight", "bn1.bias", "linear.weight", "linear.bias"}, set()
    buffers |= {"bn1.running_mean", "bn1.running_var"}
    for stage in (1, 2, 3):
        for i in range(n):
            block = f"layer{stage}.{i}"
            params |= {f"{block}.conv1.weight", f"{block}.conv2.weight"}
            for bn in ("bn1", "bn2"):
                params |= {f"{block}.{bn}.weight", f"{block}.{bn}.bias"}
                buffers |= {f"{block}.{bn}.running_mean", f"{block}.{bn}.running_var"}
    return params, buffers


@pytest.mark.parametrize("name", sorted(MODELS))
def test_torch_names_cover_every_parameter_and_buffer_once(name):
    model = build_model(name)
    names = torch_names(model.spec())
    ours = [n for n, _, _ in model.layout()] + [n for n, _, _ in model.buffer_layout()]
    assert list(names) == ours  # every one, in layout order
    assert len(set(names.values())) == len(ours)  # no two share a PyTorch key


@pytest.mark.parametrize("name, n, res4", [("resnet20", 3, "layer2.0"), ("resnet56", 9, "layer1.3")])
def test_resnet_torch_names_are_resnet_cifar_py(name, n, res4):
    model = build_model(name)
    names = torch_names(model.spec())
    params, buffers = resnet_torch_keys(n)
    assert {names[p] for p, _, _ in model.layout()} == params
    assert {names[b] for b, _, _ in model.buffer_layout()} == buffers
    assert names["res4.bn1.running_mean"] == f"{res4}.bn1.running_mean"
    assert names["conv1.weight"] == "conv1.weight" and names["fc1.bias"] == "linear.bias"
    assert names[f"res{3 * n}.conv2.weight"] == f"layer3.{n - 1}.conv2.weight"


def test_sequential_torch_names_index_every_layer():
    names = torch_names(build_model("alexnet_1gpu").spec())
    # features: conv lrn pool relu | conv relu lrn pool | conv relu | conv relu | conv pool relu; then
    # classifier: fc relu drop | fc relu drop | fc
    assert [names[f"conv{i}.weight"] for i in range(1, 6)] == [f"features.{i}.weight" for i in (0, 4, 8, 10, 12)]
    assert [names[f"fc{i}.bias"] for i in range(1, 4)] == [f"classifier.{i}.bias" for i in (0, 3, 6)]
    names = torch_names(build_model("cifar10_18pct").spec())
    assert names == {"conv1.weight": "features.0.weight", "conv1.bias": "features.0.bias",
                     "conv2.weight": "features.4.weight", "conv2.bias": "features.4.bias",
                     "conv3.weight": "features.8.weight", "conv3.bias": "features.8.bias",
                     "fc1.weight": "classifier.0.weight", "fc1.bias": "classifier.0.bias"}


def test_torch_names_refuse_unknown_layouts():
    spec = model_spec("gap", (3, 8, 8), [Conv2d(3, 4, 3), GlobalAvgPool(), Linear(4, 2)])
    with pytest.raises(ValueError, match="network 'gap' has no reference PyTorch layout"):
        torch_names(spec)
    spec = model_spec("two", (3, 8, 8), [Conv2d(3, 4, 3), Flatten(), Flatten(), Linear(144, 2)])
    with pytest.raises(ValueError, match="2 Flatten layers, expected 1"):
        torch_names(spec)


# ----------------------------------------------------------------------------------------------
# `mpiasgd export` on a run log and a checkpoint

WORKER = WorkerRow(rank=1, host=b"host", pid=1, threads=1, backend=b"numpy", shard_size=100, device=-1,
                   device_name=b"", device_uuid=b"", transfer=b"host", module=-1, replica=-1)


def write_run(path, name: str, snapshots: list[tuple[np.ndarray, np.ndarray]], with_spec: bool = True) -> str:
    """A closed run log of network `name` with these (params, buffers) snapshots; `with_spec=False` writes
    it as older logs are (a `model` attribute, no `model_spec`)."""
    model = build_model(name)
    attrs = {"config": {"model": name}, "model": name, "mode": "async", "num_workers": 1,
             "num_params": model.num_params}
    if with_spec:
        attrs["model_spec"] = to_json(model.spec())
    log = RunLog.create(str(path), attrs, [WORKER], model.num_params, flush_interval=60.0,
                        num_buffers=model.num_buffers)
    for i, (params, buffers) in enumerate(snapshots):
        log.add_snapshot(SnapshotRow(time=float(i), version=i, samples=0, epoch=0.0), params,
                         buffers if model.num_buffers else None)
    log.close("completed", {})
    return str(path)


def test_export_cli_writes_snapshots_of_a_run_log(tmp_path, capsys):
    model = build_model("resnet20")
    states = [random_state(model, seed) for seed in range(3)]
    log = write_run(tmp_path / "r20.h5", "resnet20", states)
    assert main(["export", log]) == 0  # default: the last snapshot, beside the log
    assert "snapshot 2 of 3" in capsys.readouterr().out
    spec, params, buffers = load_npz(str(tmp_path / "r20.npz"))
    assert spec == model.spec() and np.array_equal(params, states[2][0]) and np.array_equal(buffers, states[2][1])
    for flag, index in (("0", 0), ("-2", 1)):
        out = tmp_path / f"s{flag}.npz"
        assert main(["export", log, "--snapshot", flag, "-o", str(out)]) == 0
        _, params, buffers = load_npz(str(out))
        assert np.array_equal(params, states[index][0]) and np.array_equal(buffers, states[index][1])
    assert main(["export", log, "--snapshot", "3", "-o", str(tmp_path / "x.npz")]) == 2
    assert "has 3 weight snapshots (0..2, or -3..-1); there is no snapshot 3" in capsys.readouterr().err
    assert not (tmp_path / "x.npz").exists()


def test_export_cli_falls_back_to_the_built_in_for_older_logs(tmp_path, capsys):
    model = build_model("digits")
    params = np.arange(model.num_params, dtype=np.float32)
    log = write_run(tmp_path / "old.h5", "digits", [(params, None)], with_spec=False)
    assert main(["export", log, "-o", str(tmp_path / "old.npz")]) == 0
    spec, got, buffers = load_npz(str(tmp_path / "old.npz"))
    assert spec == resolve("digits") and np.array_equal(got, params) and buffers.size == 0


def test_export_cli_checkpoint_and_errors(tmp_path, capsys):
    model = build_model("resnet20")
    params, buffers = random_state(model, 7)
    log = write_run(tmp_path / "r.h5", "resnet20", [random_state(model, 1)])
    rows = np.array([(1, 5, 6, 0)], dtype=checkpoint.WORKER_STATE)
    ckpt = checkpoint.Checkpoint(params=params, momentum=np.zeros_like(params), workers=rows, version=4, samples=64,
                                 elapsed=1.0, log_time=1.0, config="{}", log=log, mode="async", model="resnet20",
                                 buffers=buffers, model_spec=to_json(model.spec()))
    checkpoint.write(checkpoint.checkpoint_path(log), ckpt)
    assert main(["export", log, "--checkpoint", "-o", str(tmp_path / "ck.npz")]) == 0
    assert "checkpoint" in capsys.readouterr().out
    _, got, got_buffers = load_npz(str(tmp_path / "ck.npz"))
    assert np.array_equal(got, params) and np.array_equal(got_buffers, buffers)
    with pytest.raises(SystemExit):  # argparse: not allowed with argument --snapshot
        main(["export", log, "--checkpoint", "--snapshot", "0"])
    capsys.readouterr()
    assert main(["export", str(tmp_path / "none.h5")]) == 2
    assert f"run log '{tmp_path / 'none.h5'}' not found" in capsys.readouterr().err
    empty = write_run(tmp_path / "empty.h5", "digits", [])
    assert main(["export", empty]) == 2
    assert f"run log '{empty}' has no weight snapshots" in capsys.readouterr().err
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    assert main(["export", str(tmp_path / "junk.h5")]) == 2
    assert "is not a readable HDF5 file" in capsys.readouterr().err
    # a snapshot whose width does not fit the stored network
    other = write_run(tmp_path / "d.h5", "digits", [(np.zeros(6090, np.float32), None)])
    with h5py.File(other, "r+") as f:
        f.attrs["model_spec"] = to_json(build_model("cifar10").spec())
    assert main(["export", other, "-o", str(tmp_path / "d.npz")]) == 2
    assert "does not fit its network 'cifar10': params must be a float vector of shape (85098,)" in \
        capsys.readouterr().err


def test_export_output_errors_are_one_sentence_naming_the_file_and_what_to_do(tmp_path, capsys):
    """-o a file in a folder that does not exist, under a file, in /proc, or a device: one line naming the output
    and what to do, no bare "[Errno 17]" (issue 36); nothing written beside."""
    model = build_model("digits")
    log = write_run(tmp_path / "d.h5", "digits", [random_state(model, 0)])
    missing = str(tmp_path / "no" / "x.npz")
    cases = {missing: f"output '{missing}': its folder '{tmp_path / 'no'}' does not exist; create it or choose "
                      "another -o",
             f"{log}/x.npz": f"output '{log}/x.npz': '{log}' is not a folder; choose another -o",
             "/proc/x.npz": "output '/proc/x.npz': no file can be created in '/proc'; choose another -o",
             "/dev/full": "output '/dev/full' exists and is not a regular file; choose another -o (export replaces "
                          "only a file)"}
    for output, says in cases.items():
        assert main(["export", log, "-o", output]) == 2
        assert capsys.readouterr().err == f"mpiasgd export: error: {says}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.h5"]


def test_export_never_writes_over_the_run_or_into_a_directory(tmp_path, capsys):
    model = build_model("digits")
    log = write_run(tmp_path / "d.h5", "digits", [random_state(model, 0)])
    before = (tmp_path / "d.h5").read_bytes()
    assert main(["export", log, "-o", log]) == 2
    assert f"output '{log}' is the run's own file" in capsys.readouterr().err
    assert (tmp_path / "d.h5").read_bytes() == before
    assert main(["export", log, "-o", str(tmp_path)]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err
