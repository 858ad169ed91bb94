"""Config: defaults < TOML < flags; unknown, ill-typed and out-of-range keys are errors naming the key."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mpiasgd.config import FIELDS, Config, ConfigError, from_mapping, load_toml, make_parser, resolve


def parse(argv):
    return resolve(make_parser().parse_args(argv))


def test_defaults_are_valid_and_round_trip_json():
    cfg = parse([])
    assert cfg == Config().validate()
    assert json.loads(cfg.to_json())["model"] == "digits"
    assert "batch_size" in cfg.describe()


def test_toml_then_flags_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "cifar10"\nbatch_size = 64\nlr = 1\nlr_milestones = [5, 8]\nprogress = false\n')
    cfg = parse(["--config", str(path), "--batch-size", "128"])
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.lr_milestones, cfg.progress) == ("cifar10", 128, 1.0, (5.0, 8.0),
                                                                                     False)
    assert isinstance(cfg.lr, float)


def test_flags_of_every_kind():
    cfg = parse(["--no-progress", "--lr-milestones", "3,6", "--max-time", "10", "--dataset", "digits"])
    assert cfg.progress is False and cfg.lr_milestones == (3.0, 6.0) and cfg.max_time == 10.0


@pytest.mark.parametrize("text,match", [
    ('modle = "digits"\n', r"unknown key 'modle' \(did you mean 'model' or 'mode'\?\)"),
    ('batch_size = "64"\n', "config key 'batch_size' = '64': expected an integer"),
    ("batch_size = 6.5\n", "config key 'batch_size' = 6.5: expected an integer"),
    ("progress = 1\n", "config key 'progress' = 1: expected true or false"),
    ("lr = true\n", "config key 'lr' = True: expected a number"),
    ('lr_milestones = ["a"]\n', "config key 'lr_milestones'"),
    ("lr = [\n", "is not valid TOML"),
])
def test_bad_toml_names_the_key(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_toml(str(path))


def test_unreadable_toml_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_toml(str(tmp_path))                        # a directory
    (tmp_path / "utf16.toml").write_bytes(b"\xff\xfel\x00r\x00")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_toml(str(tmp_path / "utf16.toml"))


def test_missing_toml_file():
    with pytest.raises(ConfigError, match=r"config file '/nope\.toml' not found"):
        load_toml("/nope.toml")


@pytest.mark.parametrize("values,match", [
    ({"lr": -0.1}, "'lr' = -0.1: expected a finite number > 0"),
    ({"momentum": 1.0}, "'momentum'"),
    ({"batch_size": 0}, "'batch_size' = 0"),
    ({"seed": -1}, "'seed' = -1: expected an integer from 0 to 2\\*\\*63 - 1 = 9223372036854775807"),
    ({"model": "resnet"}, "'model' = 'resnet': expected one of"),
    ({"mode": "hogwild"}, "'mode' = 'hogwild': expected one of"),
    ({"staleness_bound": -1}, "'staleness_bound' = -1: expected an integer >= 0"),
    ({"nsync": 0}, "'nsync' = 0: expected an integer >= 1"),
    ({"warm_start": -1.0}, "'warm_start' = -1.0: expected seconds >= 0"),
    ({"mode": "sync", "nsync": 10}, r"'nsync' = 10: expected 1 in mode 'sync' \(no parameter server updates"),
    ({"mode": "pipeline", "overlap": True}, "'overlap' = True: expected False in mode 'pipeline'"),
    ({"cuts": "3,x"}, "'cuts' = '3,x': expected comma-separated layer indices"),
    ({"cuts": "6,3"}, "'cuts' = '6,3': expected increasing layer indices > 0"),
    ({"modules": 3, "cuts": "4"}, "'cuts' = '4': expected 2 layer indices"),
    ({"shrink": 0.0}, "'shrink' = 0.0: expected 0 < beta <= 1"),
    ({"decoupling": "half"}, "'decoupling' = 'half': expected one of"),
    ({"mode": "pipeline", "weight_prediction": True, "momentum": 0.0},
     r"'weight_prediction' = True: expected False with momentum 0 \(the prediction follows the momentum\)"),
    ({"mode": "async", "weight_prediction": True},
     r"'weight_prediction' = True: expected False unless --mode pipeline"),
    ({"mode": "sync", "overlap": True}, "'overlap' = True: expected False in mode 'sync'"),
    ({"mode": "sync", "warm_start": 5.0}, "'warm_start' = 5.0: expected 0.0 in mode 'sync'"),
    ({"mode": "sync", "staleness_lr": "inverse"}, "'staleness_lr' = 'inverse': expected 'auto' in mode 'sync'"),
    ({"mode": "sync", "dc_lambda": 0.5}, r"'dc_lambda' = 0.5: expected 0.0 in mode 'sync'"),
    ({"dc_lambda": -1.0}, r"'dc_lambda' = -1.0: expected a number from 0 to 1e6"),
    ({"model_timeout": 1e10}, r"'model_timeout' = 10000000000.0: expected seconds > 0, at most 1e6"),
    ({"model_timeout": 0.0}, r"'model_timeout' = 0.0: expected seconds > 0, at most 1e6"),
    ({"dc_lambda": 1e39}, r"'dc_lambda' = 1e\+39: expected a number from 0 to 1e6"),
    ({"dc_lambda": 0.5, "nsync": 4}, r"'dc_lambda' = 0.5: expected 0 with nsync > 1"),
    ({"dc_lambda": 0.5, "overlap": True}, r"'dc_lambda' = 0.5: expected 0 with --overlap"),
    ({"servers": 0}, r"'servers' = 0: expected an integer >= 1"),
    ({"mode": "sync", "servers": 2}, r"'servers' = 2: expected 1 in mode 'sync'"),
    ({"mode": "pipeline", "servers": 2}, r"'servers' = 2: expected 1 in mode 'pipeline'"),
    ({"mode": "sync", "lookahead": 1.0}, r"'lookahead' = 1.0: expected 0.0 in mode 'sync'"),
    ({"lookahead": -2.0}, r"'lookahead' = -2.0: expected updates from 0 \(off\) to 1000, or -1"),
    ({"lookahead": 1.0, "momentum": 0.0}, r"'lookahead' = 1.0: expected 0 with momentum 0"),
    ({"lookahead": -1.0, "nsync": 2}, r"'lookahead' = -1.0: expected 0 with nsync > 1"),
    ({"dc_adaptive": 0.95}, r"'dc_adaptive' = 0.95: expected 0 without --dc-lambda"),
    ({"dc_lambda": 2.0, "dc_adaptive": 1.0}, r"'dc_adaptive' = 1.0: expected a decay 0 <= m < 1"),
    ({"async_momentum": "auto"}, r"'async_momentum' = 'auto': expected one of \('fixed', 'workers'\)"),
    ({"mode": "easgd", "async_momentum": "workers"}, r"'async_momentum' = 'workers': expected 'fixed' in mode"),
    ({"lr_scaling": "sqrt"}, r"'lr_scaling' = 'sqrt': expected one of \('none', 'linear'\)"),
    ({"lr_scaling": "linear"}, r"'lr_scaling' = 'linear': expected 'none' in mode 'async'"),
    ({"async_momentum": "workers", "nsync": 4}, r"'async_momentum' = 'workers': expected 'fixed' with nsync > 1"),
    ({"epochs": 0}, "no stopping rule"),
    ({"lr_milestones": (5.0, 2.0)}, "increasing epochs"),
    ({"name": "a/b"}, "'name'"),
    ({"name": " x"}, "'name'"),
    ({"name": ".hidden"}, "'name'"),
    ({"name": "run.h5"}, "'name'"),
    ({"flush_interval": 0}, "'flush_interval'"),
    ({"backend": "numpy", "cuda_aware": "on"}, r"'cuda_aware' = 'on': expected 'auto' or 'off' with --backend numpy"),
    ({"conv_algo": "fastest"}, r"'conv_algo' = 'fastest': expected one of \('heuristic', 'autotune'\)"),
    ({"backend": "numpy", "conv_algo": "autotune"},
     r"'conv_algo' = 'autotune': expected 'heuristic' with --backend numpy"),
    ({"backend": "cpu", "cuda_aware": "on"}, r"'cuda_aware' = 'on': expected 'auto' or 'off' with --backend cpu"),
    ({"backend": "cpu", "conv_algo": "autotune"}, r"'conv_algo' = 'autotune': expected 'heuristic' with --backend cpu"),
    ({"backend": "gpu"}, r"'backend' = 'gpu': expected one of \('auto', 'numpy', 'cpu', 'cupy'\)"),
    ({"nesterov": True, "momentum": 0.0}, r"'nesterov' = True: expected False with momentum 0 \(Nesterov momentum "
                                          r"needs a momentum > 0\)"),
])
def test_out_of_range_values(values, match):
    with pytest.raises(ConfigError, match=match):
        from_mapping(values).validate()


@pytest.mark.parametrize("mode", ["async", "ssp", "easgd"])
def test_every_mode_with_a_parameter_server_takes_servers(mode):
    """--servers S: the modes whose rank 0 answers every push shard it (`mpiasgd.rank0.server`)."""
    assert from_mapping({"mode": mode, "servers": 3}).validate().servers == 3


def test_bad_flags_raise_config_error_not_exit():
    with pytest.raises(ConfigError, match="unrecognized arguments: --bogus"):
        parse(["--bogus", "1"])
    with pytest.raises(ConfigError, match="argument --epochs: invalid float value"):
        parse(["--epochs", "ten"])
    with pytest.raises(ConfigError, match="expected a finite number"):
        parse(["--lr", "nan"])


def test_straggler_parsing():
    assert Config(straggler="2:3, 4:1.5").stragglers() == {2: 3.0, 4: 1.5}
    assert Config().stragglers() == {}
    for bad in ("2", "0:3", "2:0.5", "2:x", "2:3,2:4", "2:nan"):
        with pytest.raises(ConfigError, match="config key 'straggler' entry"):
            Config(straggler=bad).validate()


def test_conv_algos_are_the_backends():
    """config.CONV_ALGOS repeats the CUDA planner's CONV_ALGOS (the config must not import the backend)."""
    from mpiasgd.config import CONV_ALGOS
    from mpiasgd.ops.cuda import planner

    assert CONV_ALGOS == planner.CONV_ALGOS


FLOAT_KEYS = [key for key, f in FIELDS.items() if f.type == "float"]


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("text", ["inf", "-inf", "nan"])
def test_a_float_key_is_finite_from_toml_and_from_flags_alike(key, text, tmp_path):
    """One rule for both sources: TOML's inf and nan are refused as the flags refuse them."""
    path = tmp_path / "c.toml"
    path.write_text(f"{key} = {text}\n")
    with pytest.raises(ConfigError, match=f"config key '{key}' = .*: expected a finite number"):
        load_toml(str(path))
    with pytest.raises(ConfigError, match=f"flag --{key.replace('_', '-')} = .*: expected a finite number"):
        parse([f"--{key.replace('_', '-')}={text}"])
    path.write_text(f"lr_milestones = [5, {text}]\n")
    with pytest.raises(ConfigError, match=r"config key 'lr_milestones' = .*: expected a finite number"):
        load_toml(str(path))
    with pytest.raises(ConfigError, match=r"flag --lr-milestones = .*: expected a finite number"):
        parse([f"--lr-milestones=5,{text}"])


def test_a_seed_out_of_range_names_the_range():
    with pytest.raises(ConfigError, match=r"'seed' = 99999999999999999999: expected an integer from 0 to "
                                          r"2\*\*63 - 1 = 9223372036854775807"):
        parse(["--seed", "99999999999999999999"])
    assert parse(["--seed", str(2**63 - 1)]).seed == 2**63 - 1


def test_an_empty_milestone_is_refused():
    with pytest.raises(ConfigError, match="argument --lr-milestones: expected comma-separated epochs, got '5,,8'"):
        parse(["--lr-milestones", "5,,8"])
    assert parse(["--lr-milestones", "5, 8"]).lr_milestones == (5.0, 8.0)
    assert parse(["--lr-milestones", ""]).lr_milestones == ()


def test_nesterov_from_flags_and_toml(tmp_path):
    assert parse([]).nesterov is False
    assert parse(["--nesterov"]).nesterov is True
    assert parse(["--nesterov", "--no-nesterov"]).nesterov is False
    path = tmp_path / "n.toml"
    path.write_text("nesterov = true\nmomentum = 0.95\n")
    cfg = parse(["--config", str(path)])
    assert (cfg.nesterov, cfg.momentum) == (True, 0.95)
    with pytest.raises(ConfigError, match="'nesterov' = True: expected False with momentum 0"):
        parse(["--config", str(path), "--momentum", "0"])
    path.write_text("nesterov = 1\n")
    with pytest.raises(ConfigError, match="config key 'nesterov' = 1: expected true or false"):
        load_toml(str(path))
    assert FIELDS["nesterov"].metadata["group"] == "optimizer"


def test_relative_paths_in_a_toml_file_resolve_against_its_folder(tmp_path, monkeypatch):
    """`--config exp/run.toml` with `model = "net.py:build"` means exp/net.py, from whatever working folder; every
    path key is read so (stored absolute); flags keep resolving against the working folder; built-in names and
    absolute paths are kept."""
    exp, work = tmp_path / "exp", tmp_path / "work"
    exp.mkdir()
    work.mkdir()
    (exp / "run.toml").write_text('model = "nets/net.py:build"\ndata = "data/x.h5"\ntest_data = "../t.h5"\n'
                                  'data_dir = "cache"\nrun_dir = "out"\n')
    monkeypatch.chdir(work)
    cfg = parse(["--config", "../exp/run.toml"])
    assert (cfg.model, cfg.data, cfg.test_data, cfg.data_dir, cfg.run_dir) == (
        f"{exp}/nets/net.py:build", f"{exp}/data/x.h5", f"{tmp_path}/t.h5", f"{exp}/cache", f"{exp}/out")
    cfg = parse(["--config", "../exp/run.toml", "--model", "mine.py:build", "--data", "d.h5", "--run-dir", "r"])
    assert (cfg.model, cfg.data, cfg.run_dir) == ("mine.py:build", f"{work}/d.h5", "r")
    (exp / "other.toml").write_text(f'model = "cifar10"\ndata = "{tmp_path}/a.h5"\n')
    cfg = parse(["--config", "../exp/other.toml"])
    assert (cfg.model, cfg.data, cfg.run_dir) == ("cifar10", f"{tmp_path}/a.h5", "runs")
    (exp / "json.toml").write_text('model = "net.json"\ndataset = "digits"\nresume = "runs/x.ckpt.h5"\n')
    with pytest.raises(ConfigError, match=rf"config key 'resume' in '\.\./exp/json\.toml': .*{exp}/runs/x\.ckpt\.h5"):
        parse(["--config", "../exp/json.toml"])
    assert load_toml("../exp/json.toml").model == f"{exp}/net.json"


def test_a_resume_takes_the_absolute_model_path_for_the_relative_one_it_stored(tmp_path, monkeypatch):
    """A checkpoint from before TOML paths were made absolute stored `net.py:build` as written; resuming with the
    same TOML file (now read as /abs/net.py:build) is the same network, not a changed fixed key."""
    from mpiasgd.config import resume_overrides

    monkeypatch.chdir(tmp_path)
    saved = from_mapping({"model": "net.py:build", "dataset": "digits", "run_dir": "out"})
    now = {"model": f"{tmp_path}/net.py:build", "dataset": "digits", "run_dir": f"{tmp_path}/out"}
    assert resume_overrides(saved, from_mapping(now)) == {}
    with pytest.raises(ConfigError, match=r"config key 'model' = '/elsewhere/net\.py:build': a resumed run keeps"):
        resume_overrides(saved, from_mapping({**now, "model": "/elsewhere/net.py:build"}))


@pytest.mark.parametrize("text,message", [
    ("learning_rate = 0.1\n", "config file '{path}': unknown key 'learning_rate' (did you mean 'lr'?)"),
    ("batchsize = 64\nmomentun = 0.8\n", "config file '{path}': unknown keys 'batchsize' (did you mean "
                                         "'batch_size'?), 'momentun' (did you mean 'momentum'?)"),
    ("weight-decay = 0.1\n", "config file '{path}': unknown key 'weight-decay' (did you mean 'weight_decay'?)"),
])
def test_an_unknown_toml_key_suggests_the_close_one(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_toml(str(path))
    assert str(e.value) == message.format(path=path)


def test_an_unknown_key_without_a_close_one_lists_the_keys(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("zzz = 1\n")
    with pytest.raises(ConfigError) as e:
        load_toml(str(path))
    assert str(e.value) == f"config file '{path}': unknown key 'zzz'; valid keys: {', '.join(sorted(FIELDS))}"


def test_an_unknown_flag_suggests_the_close_one():
    with pytest.raises(ConfigError) as e:
        parse(["--learning-rate", "0.1", "--epochs", "2"])
    assert str(e.value) == "mpiasgd train: unrecognized arguments: --learning-rate 0.1 (did you mean --lr?)"
    with pytest.raises(ConfigError) as e:
        parse(["--batchsize=64"])
    assert str(e.value) == "mpiasgd train: unrecognized arguments: --batchsize=64 (did you mean --batch-size?)"


def test_a_resume_does_not_take_overwrite_from_the_run_it_continues(tmp_path, monkeypatch):
    """A run started with --overwrite stores overwrite = true; its resume must not replace an unreadable log
    because of that (trial of issue 36): --overwrite counts only when this command gives it."""
    import mpiasgd.checkpoint

    stored = dataclasses.asdict(from_mapping({"model": "digits", "dataset": "digits", "overwrite": True}))
    monkeypatch.setattr(mpiasgd.checkpoint, "load_config", lambda path: stored)
    ckpt = tmp_path / "x.ckpt.h5"
    ckpt.write_bytes(b"")
    assert stored["overwrite"] is True and parse(["--resume", str(ckpt)]).overwrite is False
    assert parse(["--resume", str(ckpt), "--overwrite"]).overwrite is True
