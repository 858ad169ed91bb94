"""Compute backends: the CNN ops (fprop/dgrad/wgrad) behind one set of names, layout NCHW float32.

Layers call only these names, never numpy or cupy directly, so one layer code runs on both:

    ops = get_backend("numpy")          # mpiasgd.ops.numpy_ops: im2col + BLAS, the reference
    ops = get_backend("cupy")           # mpiasgd.ops.cupy_ops: our CUDA C kernels (kernels/*.cu) on a GPU
    y = ops.conv2d_fprop(x, w, b, stride, pad)

Every backend module provides: ndarray, Workspace, zeros, empty, asarray, to_numpy,
may_share_memory, conv2d_fprop, conv2d_dgrad, conv2d_wgrad, bias_grad, relu_fprop, relu_bprop,
maxpool_fprop, maxpool_bprop, linear_fprop, linear_dgrad, linear_wgrad, softmax_xent,
sgd_momentum (signatures and shapes: the docstrings in `numpy_ops`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

# backend name -> module (numpy first: the reference, and the default without a GPU)
BACKENDS: dict[str, str] = {"numpy": "mpiasgd.ops.numpy_ops", "cupy": "mpiasgd.ops.cupy_ops"}


class BackendUnavailable(RuntimeError):
    """A known backend that cannot run here (the cupy backend without cupy or without a CUDA device)."""


def cuda_device_count() -> int:
    """Number of visible CUDA devices; 0 when cupy, the driver or a device is missing."""
    try:
        import cupy
    except ImportError:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # cupy's CUDARuntimeError (no driver / no device) and driver load errors
        return 0


def get_backend(name: str) -> ModuleType:
    """The ops module for backend `name` (imported on first use; cupy is imported only for "cupy").

    Raises ValueError naming the unknown backend and the valid ones; BackendUnavailable for "cupy"
    when cupy is not installed or no CUDA device is found.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; valid backends: {', '.join(BACKENDS)}")
    if name == "cupy":
        try:
            import cupy  # noqa: F401
        except ImportError as e:
            raise BackendUnavailable("ops backend 'cupy' needs cupy: pip install cupy-cuda12x (or cupy-cuda13x), "
                                     f"or use --backend numpy ({e})") from e
        if cuda_device_count() == 0:
            raise BackendUnavailable("ops backend 'cupy': no CUDA device was found (cupy is installed, but the "
                                     "driver reports no device); use --backend numpy")
    return importlib.import_module(BACKENDS[name])
