"""CUDA graphs for a worker's training step (`--cuda-graphs auto|on|off`).

A small network's step on a GPU is bound by the host, not the device: each of its kernels costs Python and the
driver microseconds to launch, more than many of them run (the H200's `cifar10` step took the same 3.2 ms at batch
64 and 128, docs/benchmarks/gpu.md). A CUDA graph records the launches of one step once (stream capture) and
replays them with one call: the host's cost of a step no longer grows with its kernels.

`StepGraphs.step(x, y, minibatch)` is the worker's forward and backward (`Model.forward_backward_deferred`):

    static inputs   one device x (B, C, H, W) float32 and y (B,) per batch shape; the host minibatch is copied into
                    them first (a graph reads the addresses it was captured with), eager steps included
    key             (the batch shape, the addresses of the bound params, grads and buffers): each binding of the
                    worker (two with --overlap) and the smaller last batch of an epoch get a graph of their own
    per key         step 1 eager (conv plans, tap tables and workspaces made, so that the capture finds them);
                    step 2 captured (not run), then run eagerly; step 3 run eagerly and, from the same state, by a
                    replay of the graph, which must give the same bits (grads, buffers, loss rows): a step that
                    passes a kernel an argument that changes every step (a step size, a dropout key), allocates
                    where it should not or waits for the device fails here; from step 4 on, replays
    loss            each replay's per-row losses and hits copied (`LossStats.copied`, queued, no wait) before
                    the next replay writes them again, so a round of nsync steps reads every step's loss
    memory          everything a capture allocates comes from a pool of its own, which nothing outside a
                    capture allocates from: a graph's scratch never aliases an array alive elsewhere; the
                    arrays made before it that it uses and the backend may replace (layer workspaces, tap
                    tables) the graph holds for its life (`StepGraphs.held`)

auto: the first failure (a capture that raises, a replay that differs) makes every later step eager and is said
once (`on_fallback(reason)`); on: it raises `GraphError`. The local update of sync, nsync and easgd stays one
eager kernel after the graph (its step size changes every step). Dropout refuses a graph at once: its mask's key
is the minibatch number, a kernel argument a graph would freeze (`eager_reason`).

The runtime (`CupyGraphs` on a GPU) is what captures and replays; the tests' `tests/kit/graphs.py` is a recorder
of the backend's launches and array calls on the CUDA-on-CPU harness, replayed in order on the same arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from mpiasgd.model.layers import Dropout, walk
from mpiasgd.ops.protocol import LossStats


class GraphError(RuntimeError):
    """--cuda-graphs on: the worker's step cannot run as a CUDA graph (the reason in the message)."""


class GraphRuntime(Protocol):
    """What captures and replays (`CupyGraphs`; a recorder in the tests)."""

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """(graph, fn's result): fn's device work recorded, not run. Raises what the capture raised."""

    def replay(self, graph: Any) -> None:
        """Queue the graph's work after everything queued so far on the worker's stream (no wait)."""

    def address(self, a: Any) -> int:
        """The device address of array `a`'s data."""


class CupyGraphs:
    """Stream capture with CuPy: graphs captured and replayed on a stream of their own (non-blocking), ordered
    after the worker's current stream by an event and before its next work by another, allocating during
    capture from a private `cupy.cuda.MemoryPool` (`pool`). Relaxed capture mode (CuPy's default): the pool
    may grow (cudaMalloc) during a capture."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()
        self._before = cupy.cuda.Event(disable_timing=True)
        self._after = cupy.cuda.Event(disable_timing=True)

    def _follow_current(self) -> Any:
        current = self.cupy.cuda.get_current_stream()
        current.record(self._before)
        self.stream.wait_event(self._before)
        return current

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        self._follow_current()
        with self.cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture()
            try:
                out = fn()
            except BaseException:
                try:  # end the (invalidated) capture so the stream is usable again; fn's error is the one to say
                    self.stream.end_capture()
                except Exception:
                    pass
                raise
            graph = self.stream.end_capture()
        return graph, out

    def replay(self, graph: Any) -> None:
        current = self._follow_current()
        graph.launch(stream=self.stream)
        self.stream.record(self._after)
        current.wait_event(self._after)

    def address(self, a: Any) -> int:
        return int(a.data.ptr)


def eager_reason(model: Any) -> str:
    """Why `model`'s step cannot be a graph at all ("" if it can): a Dropout with p > 0 (its mask is keyed by the
    minibatch number, `ops.dropout_fprop`'s argument, which a captured launch would keep)."""
    names = [type(layer).__name__ for layer in walk(model.layers) if isinstance(layer, Dropout) and layer.p > 0]
    if names:
        return (f"the network has {len(names)} Dropout layer(s) with p > 0: a dropout mask is keyed by the "
                "minibatch number, a kernel argument a graph would keep from its capture")
    return ""


def same_bits(a: Any, b: Any) -> bool:
    """Whether two float32 arrays hold the same bits (NaN payloads included); waits for the device."""
    return a.shape == b.shape and bool((a.view(np.uint32) == b.view(np.uint32)).all())


class _Entry:
    __slots__ = ("graph", "held", "stage", "stats")

    def __init__(self) -> None:
        self.stage, self.graph, self.stats = 1, None, None  # 1: warm-up next; 2: capture next; 3: verify; 4: replay
        self.held: list = []  # arrays made before the capture that the graph uses (`StepGraphs.held`)


class StepGraphs:
    """A worker's forward and backward as CUDA graphs (module docstring). `model`: the bound Model on the cupy
    backend; `runtime`: `CupyGraphs` (or the tests' recorder); `mode` "auto" or "on"; `on_fallback(reason)` is
    called once when auto falls back to eager launches. Raises GraphError (on) where the step cannot be a graph.

    Attributes: `reason` ("" while graphs are used: why the steps are eager otherwise), `replays` (steps run
    by a replay), `captured` (graphs made)."""

    def __init__(self, model: Any, runtime: GraphRuntime, mode: str = "auto",
                 on_fallback: Callable[[str], None] | None = None) -> None:
        if mode not in ("auto", "on"):
            raise ValueError(f"StepGraphs: mode must be 'auto' or 'on', got {mode!r}")
        self.model, self.runtime, self.mode, self.on_fallback = model, runtime, mode, on_fallback
        self.reason, self.replays, self.captured = "", 0, 0
        self._inputs: dict[tuple, tuple[Any, Any]] = {}
        self._entries: dict[tuple, _Entry] = {}
        self._classes = int(model.num_classes)
        reason = eager_reason(model)
        if reason:
            self._fail(reason)

    @property
    def active(self) -> bool:
        """Whether steps may still run as graphs (no failure yet)."""
        return not self.reason

    def _fail(self, reason: str) -> None:
        if self.mode == "on":
            raise GraphError(f"--cuda-graphs on: {reason}")
        if not self.reason:
            self.reason = reason
            if self.on_fallback is not None:
                self.on_fallback(reason)

    def _static(self, x: np.ndarray, y: np.ndarray) -> tuple[Any, Any, tuple]:
        """The static device buffers of this batch shape, holding x and y now; and their key."""
        ops = self.model.ops
        shape = (tuple(x.shape), str(x.dtype), str(y.dtype))
        if shape not in self._inputs:
            self._inputs[shape] = (ops.empty(x.shape, x.dtype), ops.empty(y.shape, y.dtype))
        xs, ys = self._inputs[shape]
        for static, host in ((xs, x), (ys, y)):  # host -> device, into the addresses the graphs read
            if hasattr(static, "set"):
                static.set(np.ascontiguousarray(host))  # (cupy)
            else:
                static[...] = host
        return xs, ys, shape

    def step(self, x: np.ndarray, y: np.ndarray, minibatch: int) -> LossStats:
        """Forward and backward of host minibatch x (B, C, H, W) float32, y (B,) integer labels into the bound
        grads (buffers updated): the LossStats of `Model.forward_backward_deferred`, whose errors it raises."""
        model = self.model
        if not self.active or (y.size and (int(y.min()) < 0 or int(y.max()) >= self._classes)):
            # (a label outside [0, K): the eager step's LossStats names it)
            return model.forward_backward_deferred(model.ops.asarray(x, x.dtype), model.ops.asarray(y, y.dtype),
                                                   minibatch)
        xs, ys, shape = self._static(x, y)
        rt = self.runtime
        key = (shape, rt.address(model.params), rt.address(model.grads), rt.address(model.buffers))
        entry = self._entries.setdefault(key, _Entry())
        if entry.stage == 4:
            model.ctx.minibatch = int(minibatch)
            try:
                rt.replay(entry.graph)
            except Exception as e:  # (auto: this step and the later ones eager; on: the error)
                self._fail(f"a replay failed ({type(e).__name__}: {e})")
                return model.forward_backward_deferred(xs, ys, minibatch)
            self.replays += 1
            return entry.stats.copied()
        if entry.stage == 1:
            entry.stage = 2
            return model.forward_backward_deferred(xs, ys, minibatch)
        if entry.stage == 2:
            return self._capture(entry, xs, ys, minibatch)
        return self._verify(entry, xs, ys, minibatch)

    def held(self) -> list:
        """The device arrays made before a capture that its launches use and that the backend may later drop for
        new ones (a layer's workspace when a batch of another shape comes, `DeviceWorkspace.get`; a tap table the
        planner evicts): a graph holds those it was captured with for its life, so their memory never goes to
        another array while the graph still reads and writes it."""
        held = []
        for layer in walk(self.model.layers):
            held.extend(getattr(getattr(layer, "ws", None), "arrays", list)())
        held.extend(getattr(getattr(self.model.ops, "planner", None), "tap_tables", {}).values())
        return held

    def _capture(self, entry: _Entry, xs: Any, ys: Any, minibatch: int) -> LossStats:
        model = self.model
        saved = model.buffers.copy()  # (a recorder runs what it records: the eager step below starts from here)
        try:
            entry.graph, entry.stats = self.runtime.capture(lambda: model.forward_backward_deferred(xs, ys, minibatch))
        except Exception as e:  # a launch that waits for the device, a copy from the host, an allocation refused
            model.buffers[...] = saved
            self._fail(f"the capture of the step failed ({type(e).__name__}: {e})")
            return model.forward_backward_deferred(xs, ys, minibatch)
        model.buffers[...] = saved
        entry.held = self.held()
        entry.stage = 3
        self.captured += 1
        return model.forward_backward_deferred(xs, ys, minibatch)

    def _verify(self, entry: _Entry, xs: Any, ys: Any, minibatch: int) -> LossStats:
        model = self.model
        saved = model.buffers.copy()
        eager = model.forward_backward_deferred(xs, ys, minibatch)
        grads, buffers = model.grads.copy(), model.buffers.copy()
        model.buffers[...] = saved
        model.ctx.minibatch = int(minibatch)
        try:
            self.runtime.replay(entry.graph)
            replayed = entry.stats.copied()
        except Exception as e:
            model.grads[...], model.buffers[...] = grads, buffers  # the eager step's results stand
            self._fail(f"the replay of the captured step failed ({type(e).__name__}: {e})")
            return eager
        differ = [what for what, ok in (("gradients", same_bits(model.grads, grads)),
                                        ("layer buffers", same_bits(model.buffers, buffers)),
                                        ("loss and hits", tuple(map(repr, replayed.get())) ==
                                         tuple(map(repr, eager.get())))) if not ok]
        if differ:
            model.grads[...], model.buffers[...] = grads, buffers  # the eager step's results stand
            self._fail(f"a replay of the captured step differs from the eager step on the next minibatch "
                       f"({', '.join(differ)} differ): a launch argument changes from step to step")
            return eager
        entry.stage = 4
        self.replays += 1
        return replayed
