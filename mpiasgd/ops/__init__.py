"""Compute backends: the CNN ops (fprop/dgrad/wgrad) behind one set of names, layout NCHW float32.

Layers call only these names, never numpy or cupy directly, so one layer code runs on both:

    ops = get_backend("numpy")          # mpiasgd.ops.numpy_ops: im2col + BLAS, the reference
    y = ops.conv2d_fprop(x, w, b, stride, pad)

Every backend module provides: ndarray, Workspace, zeros, empty, asarray, to_numpy,
may_share_memory, conv2d_fprop, conv2d_dgrad, conv2d_wgrad, bias_grad, relu_fprop, relu_bprop,
maxpool_fprop, maxpool_bprop, linear_fprop, linear_dgrad, linear_wgrad, softmax_xent
(signatures and shapes: the docstrings in `numpy_ops`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# backend name -> module; "cupy" (CUDA kernels in kernels/*.cu) is added with the GPU backend
BACKENDS: dict[str, str] = {"numpy": "mpiasgd.ops.numpy_ops"}


def get_backend(name: str) -> ModuleType:
    """The ops module for backend `name` (imported on first use).

    Raises ValueError naming the unknown backend and the valid ones.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; valid backends: {', '.join(sorted(BACKENDS))}")
    return importlib.import_module(BACKENDS[name])
