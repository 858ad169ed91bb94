"""bench/vs_pytorch.py without PyTorch: its options (and one-line refusals), the exit status 2 and one line
when PyTorch is missing, the `mpiasgd train` flags of its ddp and race runs as mpiasgd's own parser reads
them, the timed window read from a run log's pushes table, the layer mapping and tables of --profile,
mpiasgd's profiler on the digits network (timers on, the same step as without them, all taken off
again), and the race's pure parts: the schedule the DDP side takes from mpiasgd's resolved config, its
step sizes, the training time of a run log's evaluations, time to a target, the table and the ratio.
The script imports torch only to measure; nothing here imports it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the scripts import their siblings

import vs_pytorch as vs  # bench/vs_pytorch.py

from mpiasgd.config import make_parser, resolve
from mpiasgd.model import build_model
from mpiasgd.optim import Schedule, StopRule
from mpiasgd.runlog.records import PERIODIC_EVAL_ROW, PUSH_ROW


def test_step_is_the_default_subcommand_with_the_issue_s_defaults():
    args = vs.parse([])
    assert args.command == "step"
    assert (args.models, args.batches, args.rounds, args.steps, args.warmup, args.backends, args.profile,
            args.json) == (["cifar10", "resnet20"], [64, 128], 5, 10, 2, ["numpy", "cpu"], False, None)
    args = vs.parse(["--rounds", "1", "--steps", "2", "--batches", "64", "--profile"])
    assert (args.command, args.rounds, args.steps, args.batches, args.profile) == ("step", 1, 2, [64], True)
    assert vs.parse(["step", "--backends", "numpy", "--models", "digits"]).models == ["digits"]
    assert vs.parse(["step", "--backends", "cpu"]).backends == ["cpu"]


def test_ddp_defaults():
    args = vs.parse(["ddp"])
    assert (args.command, args.steps, args.warmup, args.rounds, args.modes, args.model, args.seed) == (
        "ddp", 200, 20, 1, ["sync", "async"], "cifar10", 0)
    assert vs.parse(["ddp", "--model", "digits", "--modes", "sync"]).modes == ["sync"]


@pytest.mark.parametrize("bad", [["--batches", "0"], ["--batches", "64,x"], ["--models", "nope"],
                                 ["--rounds", "0"], ["--warmup", "0"], ["--backends", "bogus"], ["--backends", "cupy"],
                                 ["ddp", "--steps", "20", "--warmup", "20"], ["ddp", "--modes", "pipeline"],
                                 ["ddp", "--model", "resnet20"], ["--warmup", "1"], ["--seed", "-1"],
                                 ["ddp", "--seed", "-1"], ["--json", "/nonexistent/folder/x.json"],
                                 ["race", "--epochs", "0"], ["race", "--epochs", "nan"], ["race", "--epochs", "x"],
                                 ["race", "--eval-every", "-0.5"], ["race", "--epochs", "1", "--eval-every", "2"],
                                 ["race", "--targets", "60,65"], ["race", "--targets", "0.6,0.6"],
                                 ["race", "--targets", "0.6,x"], ["race", "--targets", ","],
                                 ["race", "--stop-at", "0.7", "--no-stop"], ["race", "--stop-at", "0.65"],
                                 ["race", "--stop-at", "1.5"], ["race", "--ratio-at", "0.5"],
                                 ["race", "--targets", "0.2,0.25", "--ratio-at", "0.65"], ["race", "--backend", "cupy"],
                                 ["race", "--seed", "-1"], ["race", "--timeout", "0"],
                                 ["race", "--json", "/nonexistent/folder/x.json"]])
def test_nonsense_is_refused_with_one_error_line(bad, capsys):
    with pytest.raises(SystemExit) as stop:
        vs.parse(bad)
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("vs_pytorch.py ")


@pytest.mark.parametrize("command", [["step"], ["step", "--profile"], ["ddp", "--steps", "30"],
                                     ["race", "--epochs", "0.2", "--eval-every", "0.1", "--no-stop"]])
def test_without_pytorch_one_line_and_exit_2(command, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(SystemExit) as stop:
        vs.main(command)
    assert stop.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == "vs_pytorch.py: needs PyTorch: pip install -e '.[bench]'\n"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ddp_train_flags_resolve_to_two_cpu_workers_on_one_thread(mode, monkeypatch):
    monkeypatch.setattr(vs, "launcher", lambda: ["mpiexec"])
    args = vs.parse(["ddp", "--steps", "30", "--warmup", "5", "--seed", "3"])
    cmd = vs.train_command(args, mode, "/tmp/runs", f"{mode}-r1")
    assert cmd[:3] == ["mpiexec", "-n", "3"] and cmd[4:7] == ["-m", "mpiasgd", "train"]
    cfg = resolve(make_parser().parse_args(cmd[7:]))
    assert (cfg.model, cfg.mode, cfg.backend, cfg.threads, cfg.batch_size, cfg.seed) == (
        "cifar10", mode, "cpu", 1, vs.DDP_BATCH, 3)
    assert resolve(make_parser().parse_args(vs.train_command(vs.parse(["ddp", "--backend", "numpy"]), mode, "/tmp",
                                                                  "n")[7:])).backend == "numpy"
    assert (cfg.lr, cfg.lr_schedule, cfg.warmup_epochs, cfg.momentum, cfg.weight_decay) == (
        vs.LR, "constant", 0.0, vs.MOMENTUM, vs.WEIGHT_DECAY)
    assert cfg.epochs == 0 and cfg.max_time == 0
    assert cfg.max_pushes == (30 if mode == "sync" else 2 * 30)  # async: pushes of both workers together
    assert (cfg.run_dir, cfg.name) == ("/tmp/runs", f"{mode}-r1")


def test_window_starts_after_the_warmup_rows_in_time_order():
    pushes = np.zeros(7, PUSH_ROW)
    pushes["time"] = [1.0, 1.5, 2.0, 2.2, 3.0, 3.1, 9.0]
    pushes["samples"] = 64
    pushes["applied"] = [1, 1, 1, 1, 1, 1, 0]  # a push the server did not apply is not counted
    pushes = pushes[[3, 0, 5, 1, 4, 2, 6]]  # rows in any order
    images, secs = vs.window_rate(pushes, 2)  # 2 workers x 1 warm-up step: from the 2nd row on
    assert images == 4 * 64 and secs == pytest.approx(3.1 - 1.5)
    with pytest.raises(ValueError, match="6 applied pushes"):
        vs.window_rate(pushes, 6)


def _fake_net(children: list[str]) -> SimpleNamespace:
    return SimpleNamespace(named_children=lambda: [(name, None) for name in children])


def test_torch_modules_of_a_sequential_and_a_residual_network():
    cifar = vs.torch_modules(build_model("cifar10"), _fake_net(["features", "flatten", "classifier"]))
    assert cifar == {"conv1": "features.0", "pool1": "features.1", "relu1": "features.2", "conv2": "features.3",
                     "relu2": "features.4", "pool2": "features.5", "conv3": "features.6", "relu3": "features.7",
                     "pool3": "features.8", "flatten1": "flatten", "fc1": "classifier.0"}
    resnet = vs.torch_modules(build_model("resnet20"),
                              _fake_net(["conv1", "bn1", "layer1", "layer2", "layer3", "linear"]))
    assert resnet["conv1"] == "conv1" and resnet["bn1"] == "bn1" and resnet["fc1"] == "linear"
    assert [resnet[f"res{i}"] for i in range(1, 10)] == [f"layer{s}.{b}" for s in (1, 2, 3) for b in range(3)]
    assert resnet["relu1"] is None and resnet["gap1"] is None  # functional in PyTorch's ResNet_cifar


def test_profile_tables_escape_the_residual_bar_and_give_shares():
    model = build_model("resnet20")
    modules = vs.torch_modules(model, _fake_net(["conv1", "bn1", "layer1", "layer2", "layer3", "linear"]))
    ours = {(name, what): 1.0 for name in [*model.names, "loss", "other", "pass"] for what in ("fprop", "bprop")}
    ours |= {("update", ""): 0.5, ("step", ""): 40.0, ("res1.conv1", "conv2d_fprop"): 2.0,
             ("res1.conv1", "conv2d_dgrad"): 3.0, ("res1.conv1", "conv2d_wgrad"): 5.0}
    theirs = {key: value for key, value in ours.items() if key[0] not in ("relu1", "gap1")}
    lines = vs.profile_lines(ours, theirs, modules, model)
    rows = [line for line in lines if line.startswith("| res")]
    assert len(rows) == 9 and all(row.replace("\\|", "").count("|") == 6 for row in rows)
    assert "| relu1 ReLU() (torch: no module) | 1.00 | - | 1.00 | - |" in lines
    conv = vs.conv_lines(ours, ["res1.conv1"], {"res1.conv1": 4_000_000}, 40.0)
    assert conv[2] == "| res1.conv1 | 2.00 | 3.00 | 5.00 | 0.00 | 2.0 / 1.3 / 0.8 | 25% |"
    assert vs.goal_line("mpiasgd", {"a": 0.95, "b": 0.85}).endswith(": no (lowest 0.85, b)")


def test_step_table_ratio_is_torch_median_over_ours_median():
    r = vs.StepResult("cifar10", 64, "numpy", ours_ms=[100.0, 200.0, 110.0], torch_ms=[90.0, 100.0, 88.0],
                      warmup_losses=([2.3, 2.0], [2.3, 2.0]))
    assert r.ratios == pytest.approx([0.9, 0.5, 0.8]) and r.ratio == pytest.approx(90.0 / 110.0)
    assert vs.step_table([r])[2] == "| cifar10 | 64 | numpy | 110.0 | 90.0 | 0.82 | 0.90 0.50 0.80 |"


def test_ours_profile_times_every_layer_and_leaves_the_step_unchanged():
    plain, profiled = vs.Ours.build("digits", None, 0), vs.Ours.build("digits", None, 0)
    x, y = vs.random_batch(plain.model, 16, 0)
    profile = vs.OursProfile(profiled)
    profile.install()
    try:
        for _ in range(2):
            profile.step(x, y)
    finally:
        profile.remove()
    for _ in range(2):
        plain.step(x, y)
    np.testing.assert_array_equal(profiled.model.params, plain.model.params)  # timers change nothing
    step = vs.medians(profile.steps)
    for name in profiled.model.names:
        assert step[(name, "fprop")] > 0 and step[(name, "bprop")] > 0
    assert ("conv1", "conv2d_dgrad") not in step and step[("conv2", "conv2d_dgrad")] > 0  # no dgrad of the images
    assert profile.convs == ["conv1", "conv2"]
    assert profile.flops == {"conv1": 2 * 16 * 16 * 8 * 8 * 1 * 3 * 3, "conv2": 2 * 16 * 32 * 4 * 4 * 16 * 3 * 3}
    assert min(step[("other", "fprop")], step[("other", "bprop")]) >= 0
    assert step[("step", "")] >= step[("pass", "fprop")] + step[("pass", "bprop")]
    # every timer is off again: the class's methods and the backend's own functions
    ops = profiled.model.ops
    assert not any(attr in layer.__dict__ for layer in profiled.model.layers for attr in ("forward", "backward"))
    assert not any(attr in profiled.model.loss.__dict__ for attr in ("forward", "backward"))
    assert not any(name in vars(ops) for name in vs.CONV_OPS)


# --- race --------------------------------------------------------------------------------------------------------


def test_race_defaults_are_the_issue_s():
    args = vs.parse(["race"])
    assert (args.command, args.epochs, args.eval_every, args.targets, args.backend, args.seed, args.model) == (
        "race", 10.0, 0.25, [0.6, 0.65, 0.7], "cpu", 0, "cifar10")
    assert (args.ratio_at, args.stop_at, args.no_stop, args.json, args.run_dir) == (0.65, 0.7, False, None, None)


def test_race_options_and_what_follows_from_the_targets():
    args = vs.parse(["race", "--targets", "0.7,0.6", "--no-stop", "--backend", "numpy"])
    assert (args.targets, args.stop_at, args.ratio_at, args.backend) == ([0.6, 0.7], None, 0.7, "numpy")  # sorted
    args = vs.parse(["race", "--epochs", "0.2", "--eval-every", "0.1", "--targets", "0.2,0.25"])
    assert (args.epochs, args.eval_every, args.ratio_at, args.stop_at) == (0.2, 0.1, 0.25, 0.25)  # no 65 %: the middle
    args = vs.parse(["race", "--stop-at", "0.8", "--ratio-at", "0.7", "--eval-every", "10"])
    assert (args.stop_at, args.ratio_at, args.eval_every) == (0.8, 0.7, 10.0)  # one evaluation: at the end


def _race_config(argv: list[str], monkeypatch, launcher=("mpiexec",)) -> tuple[list[str], object]:
    monkeypatch.setattr(vs, "launcher", lambda: list(launcher))
    cmd = vs.race_command(vs.parse(["race", *argv]), "/tmp/runs", "race-1")
    return cmd, resolve(make_parser().parse_args(cmd[cmd.index("train") + 1:]))


def test_race_train_flags_resolve_to_two_sync_workers_with_the_race_s_schedule(monkeypatch):
    cmd, cfg = _race_config(["--epochs", "0.3", "--eval-every", "0.05", "--seed", "3"], monkeypatch)
    assert cmd[:3] == ["mpiexec", "-n", "3"] and cmd[4:7] == ["-m", "mpiasgd", "train"]
    assert (cfg.model, cfg.mode, cfg.backend, cfg.threads, cfg.batch_size, cfg.seed) == (
        "cifar10", "sync", "cpu", 1, vs.DDP_BATCH, 3)
    assert (cfg.lr, cfg.lr_scaling, cfg.lr_schedule, cfg.warmup_epochs, cfg.momentum, cfg.weight_decay,
            cfg.nesterov) == (vs.LR, "none", "cosine", 0.5, vs.MOMENTUM, vs.WEIGHT_DECAY, False)
    assert (cfg.epochs, cfg.max_pushes, cfg.max_time) == (0.3, 0, 0)  # the epochs alone end the run
    assert cfg.eval_every() == (0.05, "ep") and cfg.stop_accuracy == 0.7  # stop at the highest default target
    assert (cfg.snapshot_interval, cfg.checkpoint_interval, cfg.progress) == (0, 0, False)
    assert (cfg.run_dir, cfg.name) == ("/tmp/runs", "race-1")
    _, cfg = _race_config(["--no-stop", "--backend", "numpy", "--epochs", "0.123456789", "--eval-every", "0.1"],
                            monkeypatch)
    assert (cfg.stop_accuracy, cfg.backend, cfg.epochs) == (0.0, "numpy", 0.123456789)  # no rounding of --epochs


def test_race_setup_gives_ddp_mpiasgd_s_own_schedule_rule_and_evaluations(monkeypatch):
    launcher = ("/x/mpiexec", "--oversubscribe", "--bind-to", "none")  # the real launcher's flags come first
    cmd, cfg = _race_config(["--epochs", "4", "--eval-every", "0.5", "--seed", "7"], monkeypatch, launcher)
    setup = vs.race_setup(cmd)
    assert Schedule(**setup["schedule"]) == Schedule.of(cfg, vs.DDP_WORLD) == Schedule(0.02, 0.5, "cosine")
    assert StopRule(**setup["rule"]) == StopRule.of(cfg) == StopRule(epochs=4.0)
    assert (setup["eval_every"], setup["stop_at"], setup["seed"], setup["batch"], setup["model"]) == (
        0.5, 0.7, 7, vs.DDP_BATCH, "cifar10")
    assert (setup["eval_batch"], setup["prefetch"], setup["shuffle_window"]) == (
        cfg.eval_batch_size, cfg.prefetch, cfg.shuffle_window)


def test_race_lr_is_the_sync_worker_s_warmup_then_cosine():
    schedule, rule = Schedule(0.02, 0.5, "cosine"), StopRule(epochs=10.0)
    per_step, n = 2 * 64, 50_000

    def lr(applied: int) -> float:
        return vs.race_lr(schedule, rule, applied, per_step, n, 123.0)  # the seconds do not count: no --max-time

    assert lr(0) == 0.0  # the first update: the warm-up starts at 0 (epochs done before the step)
    assert lr(100) == pytest.approx(0.02 * (100 * per_step / n) / 0.5)
    warm = int(np.ceil(0.5 * n / per_step))  # the first step after the warm-up
    done = warm * per_step / n
    assert lr(warm) == pytest.approx(0.01 * (1 + np.cos(np.pi * done / 10)))
    assert lr(int(10 * n / per_step)) == pytest.approx(0.0, abs=1e-7)  # to 0 at the end of the run
    assert lr(10 * n) == 0.0  # past it: progress is clipped to 1


def test_time_to_target_is_the_first_evaluation_at_or_above_it():
    rows = [(30.0, 0.66), (10.0, 0.55), (20.0, 0.65), (40.0, 0.64)]  # any order: by time
    assert vs.time_to_target(rows, 0.6) == 20.0 and vs.time_to_target(rows, 0.65) == 20.0  # at it counts
    assert vs.time_to_target(rows, 0.66) == 30.0 and vs.time_to_target(rows, 0.5) == 10.0
    assert vs.time_to_target(rows, 0.7) is None and vs.time_to_target([], 0.1) is None


def test_mpiasgd_evals_subtract_the_earlier_evaluations_from_the_log_clock():
    rows = np.zeros(3, PERIODIC_EVAL_ROW)
    rows["time"] = [10.0, 27.0, 45.0]  # rank 0's clock at the weights; it ran on through each evaluation
    rows["seconds"] = [5.0, 6.0, 7.0]
    rows["top1"] = [0.3, 0.5, 0.6]
    assert vs.mpiasgd_evals(rows[[2, 0, 1]]) == [(10.0, 0.3), (22.0, 0.5), (34.0, 0.6)]  # any order: by time
    assert vs.mpiasgd_evals(None) == [] and vs.mpiasgd_evals(rows[:0]) == []


def test_race_table_ratio_and_verdict():
    ddp = vs.RaceRun("PyTorch DDP", [(100.0, 0.55), (200.0, 0.62), (300.0, 0.66)], 128_000, 320.0, 0.66)
    ours = vs.RaceRun("mpiasgd sync (cpu)", [(110.0, 0.58), (210.0, 0.63), (330.0, 0.71)], 128_000, 400.0, 0.71)
    lines = vs.race_table([ddp, ours], [0.6, 0.65, 0.7])
    assert lines[0] == "| run | time to 60 % | time to 65 % | time to 70 % | final accuracy | images/s |"
    assert lines[1] == "| :-- | --: | --: | --: | --: | --: |"
    assert lines[2] == "| PyTorch DDP | 200.0 | 300.0 | - | 66.00 % | 400 |"
    assert lines[3] == "| mpiasgd sync (cpu) | 210.0 | 330.0 | 330.0 | 71.00 % | 320 |"
    assert vs.race_ratio(ours, ddp, 0.65) == pytest.approx(1.1)
    assert vs.race_verdict(1.1, ours, ddp, 0.65) == "mpiasgd/DDP time to 65 %: 1.10 (goal <= 1.1: yes)"
    assert vs.race_verdict(1.2, ours, ddp, 0.65).endswith("(goal <= 1.1: no)")
    assert vs.race_ratio(ours, ddp, 0.7) is None
    assert vs.race_verdict(None, ours, ddp, 0.7) == ("mpiasgd/DDP time to 70 %: - (PyTorch DDP did not reach it; "
                                                      "goal <= 1.1 not measured)")
    curves = vs.race_curves(ddp, vs.RaceRun("m", [(1.0, 0.5)], 1, 1.0, 0.5))
    assert curves[2] == "| 1 | 100.0 | 55.00 % | 1.0 | 50.00 % |" and curves[3] == "| 2 | 200.0 | 62.00 % |  |  |"
