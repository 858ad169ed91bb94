"""--cuda-graphs on a GPU: a step replayed from its CUDA graph gives the eager step's bits (grads, buffers,
loss), for `cifar10` and `resnet20`; the run's log says what the option resolved to. Skipped without a device."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("net", ["cifar10", "resnet20"])
def test_graph_replays_give_the_eager_bits_on_the_device(net):
    import cupy

    from mpiasgd.model import build_model
    from mpiasgd.ops.cuda.graphs import CupyGraphs, StepGraphs

    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((64, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 64))
               for _ in range(6)]

    def run(graphs: bool) -> tuple[list, StepGraphs | None]:
        model = build_model(net, "cupy")
        params = model.init_params(1)
        params += np.float32(0.01)  # (the classifier starts at zero: every layer gets a gradient)
        model.bind(cupy.asarray(params), cupy.zeros(model.num_params, np.float32))
        stepper = StepGraphs(model, CupyGraphs(cupy)) if graphs else None
        out = []
        for i, (x, y) in enumerate(batches):
            if stepper is not None:
                stats = stepper.step(x, y, i)
            else:
                stats = model.forward_backward_deferred(cupy.asarray(x), cupy.asarray(y), i)
            out.append((stats.get(), cupy.asnumpy(model.grads), cupy.asnumpy(model.buffers)))
            model.params -= np.float32(0.05) * model.grads
        return out, stepper

    want, _ = run(False)
    got, stepper = run(True)
    assert stepper.reason == "" and stepper.replays == 4
    for i, ((g_loss, g_grads, g_buf), (w_loss, w_grads, w_buf)) in enumerate(zip(got, want, strict=True)):
        assert g_loss == w_loss, f"step {i}"
        assert np.array_equal(g_grads.view(np.uint32), w_grads.view(np.uint32)), f"step {i}: gradients differ"
        assert np.array_equal(g_buf.view(np.uint32), w_buf.view(np.uint32)), f"step {i}: buffers differ"


def test_a_run_logs_what_cuda_graphs_resolved_to(tmp_path):
    from kit.launch import run_mpi

    from mpiasgd.runlog import open_log

    args = ["train", "--model", "digits", "--backend", "cupy", "--share-devices", "--epochs", "1", "--batch-size",
            "32", "--no-progress", "--cuda-graphs", "auto", "--name", "g"]
    res = run_mpi(3, args, 240, tmp_path)
    assert res.returncode == 0, res.explain()
    with open_log(str(tmp_path / "runs" / "g.h5")) as f:
        events = f["events"][()]
    texts = [row["text"].decode() for row in events if row["kind"] == b"cuda_graphs"]
    assert len(texts) == 2 and all("replays one CUDA graph" in text for text in texts), texts
