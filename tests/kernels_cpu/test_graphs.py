"""--cuda-graphs on the CPU: `StepGraphs` on the CUDA backend with the harness's kernels, captured and replayed
by the recorder of tests/kit/graphs.py (the launches and array calls a CUDA graph would capture, replayed in
order on the captured arrays). A replayed step must give the eager step's bits; what cannot be a graph (a sync
inside the step, a launch argument that changes every step, Dropout) falls back with its reason (auto) or
raises (on)."""

from __future__ import annotations

import numpy as np
import pytest
from kit.graphs import RecordingGraphs

from kernels_cpu.cuda_cpu import cases, harness
from mpiasgd.model.layers import (
    BatchNorm2d,
    Conv2d,
    Dropout,
    Flatten,
    GlobalAvgPool,
    Linear,
    MaxPool2d,
    ReLU,
    Residual,
    SubsamplePad,
    walk,
)
from mpiasgd.model.model import Model
from mpiasgd.ops.cuda.graphs import GraphError, StepGraphs

pytestmark = pytest.mark.skipif(harness.find_cxx() is None,
                                reason="no g++: the CUDA-on-CPU harness needs a C++17 compiler")


@pytest.fixture(scope="module")
def lib():
    return harness.build()


def digits() -> list:
    return [Conv2d(1, 4, 3, pad=1), ReLU(), MaxPool2d(2, 2), Flatten(), Linear(64, 10)]


def residual() -> list:  # BatchNorm (running statistics in the buffers), an option-A shortcut, global pooling
    return [Conv2d(2, 4, 3, pad=1, bias=False), BatchNorm2d(4), ReLU(),
            Residual([Conv2d(4, 8, 3, 2, 1, bias=False), BatchNorm2d(8), ReLU(),
                      Conv2d(8, 8, 3, 1, 1, bias=False), BatchNorm2d(8)], [SubsamplePad(4, 8, 2)], [ReLU()]),
            GlobalAvgPool(), Linear(8, 10)]


# small reduction blocks: each harness thread is an OS thread (the graph's bits do not depend on them)
SMALL = {"batchnorm_threads": 16, "reduce_threads": 16}
NETS = {"digits": ((1, 8, 8), digits), "residual": ((2, 4, 4), residual)}


def bound(ops, net: str, layers=None) -> Model:
    shape, build = NETS[net]
    model = Model(net, shape, build() if layers is None else layers, ops)
    params = model.init_params(5)
    params += np.float32(0.01)  # (non-zero classifier weights: every layer gets a gradient)
    model.bind(params, np.zeros(model.num_params, np.float32))
    return model


def minibatches(shape, steps: int, batch: int = 4) -> list:
    rng = np.random.default_rng(11)
    return [(rng.standard_normal((batch, *shape)).astype(np.float32), rng.integers(0, 10, batch))
            for _ in range(steps)]


def train(model: Model, batches: list, step, lr: float = 0.05) -> list:
    """Steps of SGD on `batches` through `step(x, y, minibatch)` -> LossStats: each step's (loss, hits, grads,
    buffers). The weights change between steps, in place (a graph must read the current ones)."""
    out = []
    for i, (x, y) in enumerate(batches):
        stats = step(x, y, i)
        out.append((stats.get(), model.grads.copy(), model.buffers.copy()))
        model.params -= np.float32(lr) * model.grads
    return out


def eager_step(model: Model):
    return lambda x, y, i: model.forward_backward_deferred(x, y, i)


def assert_same_bits(got: list, want: list) -> None:
    for i, ((g_loss, g_grads, g_buf), (w_loss, w_grads, w_buf)) in enumerate(zip(got, want, strict=True)):
        assert g_loss == w_loss, f"step {i}: loss and hits {g_loss} != {w_loss}"
        assert np.array_equal(g_grads.view(np.uint32), w_grads.view(np.uint32)), f"step {i}: gradients differ"
        assert np.array_equal(g_buf.view(np.uint32), w_buf.view(np.uint32)), f"step {i}: buffers differ"


@pytest.mark.parametrize("net", sorted(NETS))
def test_replayed_steps_give_the_eager_steps_bits(lib, net):
    """Five SGD steps: eager, then through StepGraphs (warm-up, capture, checked replay, two replays), each
    step's loss, hits, gradients and layer buffers bit for bit; a replayed step launches nothing through the
    backend (the harness's kernels are looked up only by eager launches)."""
    launches = []
    ops = cases.cpu_backend(lib, record=lambda name, tile: launches.append(name), **SMALL)
    batches = minibatches(NETS[net][0], 5)
    model = bound(ops, net)
    want = train(model, batches, eager_step(model))
    assert np.abs(want[-1][1]).max() > 0 and np.isfinite(want[-1][0][0])
    model = bound(ops, net)
    runtime = RecordingGraphs(ops)
    graphs = StepGraphs(model, runtime)
    per_step = []

    def step(x, y, i):
        launches.clear()
        stats = graphs.step(x, y, i)
        per_step.append(len(launches))
        return stats

    got = train(model, batches, step)
    assert_same_bits(got, want)
    assert (graphs.reason, graphs.captured, graphs.replays, runtime.captures) == ("", 1, 3, 1)
    assert per_step[0] > 5 and per_step[3:] == [0, 0]  # steps 4 and 5: replays only
    # the arrays made before the capture that a later batch shape could replace: held by the graph
    (entry,) = graphs._entries.values()
    made = [a for layer in walk(model.layers) if getattr(layer, "ws", None) for a in layer.ws.arrays()]
    made += list(ops.planner.tap_tables.values())
    assert made and all(any(a is h for h in entry.held) for a in made)


def test_each_binding_and_batch_shape_gets_its_own_graph(lib):
    """--overlap's two bindings (the weights of one reply in use while the next arrives) and a smaller last
    batch: one graph per (batch shape, params, grads, buffers); every step still the eager bits."""
    ops = cases.cpu_backend(lib, **SMALL)
    batches = minibatches((1, 8, 8), 8) + minibatches((1, 8, 8), 4, batch=3)

    def run(stepper_of):
        model = bound(ops, "digits")
        other = (model.params.copy(), np.zeros_like(model.grads))
        mine = (model.params, model.grads)
        step = stepper_of(model)
        out = []
        for i, (x, y) in enumerate(batches):
            pair = (mine, other)[i % 2]
            model.bind(pair[0], pair[1], model.buffers)
            stats = step(x, y, i)
            out.append((stats.get(), model.grads.copy(), model.buffers.copy()))
            pair[0][...] -= np.float32(0.05) * pair[1]
        return out, step

    want, _ = run(eager_step)
    got, step = run(lambda model: StepGraphs(model, RecordingGraphs(ops)).step)
    assert_same_bits(got, want)
    graphs = step.__self__
    # batch 4: four steps of each binding, the 2nd captured, the 3rd and 4th replayed (the 3rd checked); batch 3:
    # two steps of each, the 2nd captured
    assert (graphs.reason, graphs.captured, graphs.replays) == ("", 4, 4)


def test_a_sync_inside_the_step_fails_the_capture(lib, monkeypatch):
    """A step that reads the loss inside (a device-to-host copy) cannot be captured: auto falls back to eager
    steps (their bits unchanged) and says why once; on raises GraphError naming the cause."""
    ops = cases.cpu_backend(lib, **SMALL)
    batches = minibatches((1, 8, 8), 4)
    model = bound(ops, "digits")
    want = train(model, batches, eager_step(model))
    model = bound(ops, "digits")
    forward_deferred = model.loss.forward_deferred

    def reads_the_loss(logits, labels):
        stats = forward_deferred(logits, labels)
        stats.get()  # a sync inside the step
        return stats

    monkeypatch.setattr(model.loss, "forward_deferred", reads_the_loss)
    said = []
    graphs = StepGraphs(model, RecordingGraphs(ops), on_fallback=said.append)
    got = train(model, batches, graphs.step)
    assert_same_bits(got, want)
    assert graphs.replays == 0 and len(said) == 1 and said[0] == graphs.reason
    assert "the capture of the step failed (SyncDuringCapture" in graphs.reason
    strict = StepGraphs(model, RecordingGraphs(ops), mode="on")
    with pytest.raises(GraphError, match=r"--cuda-graphs on: the capture of the step failed \(SyncDuringCapture"):
        train(model, batches, strict.step)


def test_a_launch_argument_that_changes_every_step_is_caught_by_the_check(lib, monkeypatch):
    """Dropout's mask is keyed by the minibatch number, a launch argument: were it not refused up front, the
    replay checked against the eager step on the next minibatch would differ, and auto keeps the eager step's
    results and goes on eagerly."""
    import mpiasgd.ops.cuda.graphs as graphs_module

    ops = cases.cpu_backend(lib, **SMALL)
    batches = minibatches((1, 8, 8), 4)

    def dropped() -> list:
        return [Conv2d(1, 4, 3, pad=1), ReLU(), Dropout(0.5), MaxPool2d(2, 2), Flatten(), Linear(64, 10)]

    model = bound(ops, "digits", dropped())
    want = train(model, batches, eager_step(model))
    model = bound(ops, "digits", dropped())
    refused = StepGraphs(model, RecordingGraphs(ops))
    assert "1 Dropout layer(s) with p > 0" in refused.reason and not refused.active
    with pytest.raises(GraphError, match="Dropout"):
        StepGraphs(model, RecordingGraphs(ops), mode="on")
    monkeypatch.setattr(graphs_module, "eager_reason", lambda model: "")
    graphs = StepGraphs(model, RecordingGraphs(ops))
    got = train(model, batches, graphs.step)
    assert_same_bits(got, want)
    assert graphs.replays == 0 and "differs from the eager step" in graphs.reason
    assert "gradients" in graphs.reason


def test_a_label_outside_the_classes_is_named_as_without_graphs(lib):
    ops = cases.cpu_backend(lib, **SMALL)
    model = bound(ops, "digits")
    graphs = StepGraphs(model, RecordingGraphs(ops))
    x, y = minibatches((1, 8, 8), 1)[0]
    for _ in range(4):
        graphs.step(x, y, 0)
    assert graphs.replays == 2
    y = y.copy()
    y[2] = 10
    with pytest.raises(ValueError, match=r"label 10 at index 2 is outside \[0, 10\)"):
        graphs.step(x, y, 0).get()


def test_start_up_probe_resolves_the_option_and_says_why(lib, monkeypatch):
    """`probe_cuda_graphs` (every GPU worker at start-up): three steps of a throwaway copy of the network; auto or
    on where the replay gave the eager bits, "off" with the reason for a network with Dropout under auto, a
    start-up error (BackendUnavailable naming Dropout) under on; the text is the worker's "cuda_graphs" event."""
    import mpiasgd.launch.startup as startup
    import mpiasgd.model.registry
    from mpiasgd.config import Config
    from mpiasgd.ops import BackendUnavailable
    from mpiasgd.runlog.startup import WorkerInfo

    ops = cases.cpu_backend(lib, **SMALL)
    monkeypatch.setattr(mpiasgd.model.registry, "get_backend", lambda name: ops)
    runtimes = []
    monkeypatch.setattr(startup, "CupyGraphs", lambda xp: runtimes.append(RecordingGraphs(ops)) or runtimes[-1])
    spec = Model("digits", (1, 8, 8), digits(), ops).spec()
    for mode in ("auto", "on"):
        resolved, note = startup.probe_cuda_graphs(Config(model="digits", batch_size=4, cuda_graphs=mode), spec)
        assert resolved == mode and f"--cuda-graphs {mode}: each training step replays one CUDA graph" in note
        assert (runtimes[-1].captures, runtimes[-1].replays) == (1, 1)
    info = WorkerInfo(rank=2, host="node7", pid=1, threads=1, backend="cupy", shard_size=10, graphs=note)
    assert info.graphs_event() == f"worker rank 2 on node7: {note}"
    assert WorkerInfo(rank=2, host="node7", pid=1, threads=1, backend="cupy", shard_size=10).graphs_event() == ""
    layers = [Conv2d(1, 4, 3, pad=1), ReLU(), Dropout(0.25), MaxPool2d(2, 2), Flatten(), Linear(64, 10)]
    dropped = Model("dropped", (1, 8, 8), layers, ops).spec()
    resolved, note = startup.probe_cuda_graphs(Config(model="digits", batch_size=4), dropped)
    assert resolved == "off" and note.startswith("--cuda-graphs auto: eager launches: the network has 1 Dropout")
    with pytest.raises(BackendUnavailable, match="--cuda-graphs on: the network has 1 Dropout layer"):
        startup.probe_cuda_graphs(Config(model="digits", batch_size=4, cuda_graphs="on"), dropped)


def test_a_replay_that_fails_falls_back_under_auto_and_raises_under_on(lib):
    """A CUDA error in a replay (here: the recorder refuses its second replay): auto runs that step and the later
    ones eagerly, with the eager bits, and says why once; on raises GraphError naming the error."""

    class Refusing(RecordingGraphs):
        def replay(self, graph):
            if self.replays == 1:
                raise RuntimeError("cudaErrorLaunchFailure")
            super().replay(graph)

    ops = cases.cpu_backend(lib, **SMALL)
    batches = minibatches((1, 8, 8), 5)
    model = bound(ops, "digits")
    want = train(model, batches, eager_step(model))
    model = bound(ops, "digits")
    said = []
    graphs = StepGraphs(model, Refusing(ops), on_fallback=said.append)
    assert_same_bits(train(model, batches, graphs.step), want)
    assert graphs.replays == 1 and said == ["a replay failed (RuntimeError: cudaErrorLaunchFailure)"]
    strict = StepGraphs(bound(ops, "digits"), Refusing(ops), mode="on")
    with pytest.raises(GraphError, match=r"--cuda-graphs on: a replay failed \(RuntimeError: cudaErrorLaunch"):
        train(strict.model, batches, strict.step)


def test_graphs_that_cannot_be_made_never_stop_an_auto_start(lib, monkeypatch):
    """The probe under auto: graphs that cannot even be set up (no stream, say) mean eager launches with the
    reason, not a start-up error; under on, the start-up error names it."""
    import mpiasgd.launch.startup as startup
    import mpiasgd.model.registry
    from mpiasgd.config import Config
    from mpiasgd.ops import BackendUnavailable

    ops = cases.cpu_backend(lib, **SMALL)
    monkeypatch.setattr(mpiasgd.model.registry, "get_backend", lambda name: ops)

    def no_stream(xp):
        raise RuntimeError("cudaErrorNotSupported: stream capture")

    monkeypatch.setattr(startup, "CupyGraphs", no_stream)
    spec = Model("digits", (1, 8, 8), digits(), ops).spec()
    resolved, note = startup.probe_cuda_graphs(Config(model="digits", batch_size=4), spec)
    assert resolved == "off" and note == ("--cuda-graphs auto: eager launches: the trial steps at start-up failed "
                                          "(RuntimeError: cudaErrorNotSupported: stream capture)")
    with pytest.raises(BackendUnavailable, match=r"--cuda-graphs on: the trial steps at start-up failed"):
        startup.probe_cuda_graphs(Config(model="digits", batch_size=4, cuda_graphs="on"), spec)
