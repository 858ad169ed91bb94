"""A CPU model of CUDA stream capture for `mpiasgd.ops.cuda.graphs.StepGraphs` on the CUDA backend with numpy
arrays (the CUDA-on-CPU harness's kernels, `CupyBackend.on_host`).

`RecordingGraphs(ops)` captures by recording, while `fn` runs, every kernel launch of the backend (kernel,
grid, block, arguments: the same array objects) and every call of its array module (`ops.xp`: matmul, add,
where, ...) with its result array; a replay runs them again in order on the same arrays, as a CUDA graph
replays its nodes on the addresses it captured: a launch argument that changes from step to step is replayed
as captured, an input not copied into the captured buffer is not seen, an output not written into a captured
array is lost. Unlike CUDA, the recorder also runs what it records (numpy cannot defer), which StepGraphs
allows for (it restores the layer buffers after a capture). A device-to-host copy during a capture raises
(`SyncDuringCapture`), as CUDA refuses a synchronous copy in a capturing stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class SyncDuringCapture(RuntimeError):
    """A device-to-host copy (a wait for the device) inside a capture."""


class _RecordingKernels:
    def __init__(self, inner: Any, log: list) -> None:
        self.inner, self.log = inner, log

    def get(self, kernel: str, tile: tuple[int, ...] | None = None) -> Callable:
        fn = self.inner.get(kernel, tile)

        def launch(grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
            self.log.append(("launch", kernel, fn, grid, block, args, shared_mem))
            fn(grid, block, args, shared_mem=shared_mem)

        return launch

    def compile(self, filename: str, defines: tuple[str, ...] = ()) -> None:
        self.inner.compile(filename, defines)


_ALLOCATIONS = ("empty", "empty_like")  # nothing to replay: a graph's allocation is its address


class _RecordingXp:
    """numpy, with every function call recorded (types and constants pass through)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def asnumpy(self, a: Any) -> np.ndarray:
        raise SyncDuringCapture("a device-to-host copy inside a capture (the step waits for the device)")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(np, name)
        if isinstance(attr, type) or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            self.log.append(("xp", name, attr, args, kwargs, out))
            return out

        return call


class RecordingGraphs:
    """The `GraphRuntime` of the tests (module docstring). `graphs` counts captures, `replays` replays."""

    def __init__(self, ops: Any) -> None:
        self.ops, self.captures, self.replays = ops, 0, 0

    def capture(self, fn: Callable[[], Any]) -> tuple[list, Any]:
        log: list = []
        ops = self.ops
        xp, kernels = ops.xp, ops.kernels
        ops.xp, ops.kernels = _RecordingXp(log), _RecordingKernels(kernels, log)
        try:
            out = fn()
        finally:
            ops.xp, ops.kernels = xp, kernels
        self.captures += 1
        return log, out

    def replay(self, graph: list) -> None:
        for node in graph:
            if node[0] == "launch":
                _, _, fn, grid, block, args, shared_mem = node
                fn(grid, block, args, shared_mem=shared_mem)
                continue
            _, name, fn, args, kwargs, out = node
            if name in _ALLOCATIONS or not isinstance(out, np.ndarray):
                continue
            result = fn(*args, **kwargs)
            if result is not out:  # (a function that wrote `out=` returns it)
                np.copyto(out, result)
        self.replays += 1

    def address(self, a: np.ndarray) -> int:
        return int(a.__array_interface__["data"][0])
