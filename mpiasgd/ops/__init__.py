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


def cuda_probe() -> tuple[int, str]:
    """(visible CUDA devices, why there are none: "" when there are some).

    The reason names what failed: cupy not installed, the driver reporting no device, or the CUDA
    error cupy raised (an old driver for this cupy, no driver at all, ...), so that a GPU node that
    cannot run the cupy backend says why instead of looking like a CPU node.
    """
    try:
        import cupy
    except ImportError as e:
        return 0, f"cupy is not installed ({e})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # cupy's CUDARuntimeError (no driver, a driver too old) and driver load errors
        text = str(e)
        if "NoDevice" in text or "no CUDA-capable device" in text:
            return 0, "the driver reports no CUDA device"
        if "InsufficientDriver" in text and not cuda_driver_loadable():  # the runtime's words for "no driver"
            return 0, "no CUDA driver here (libcuda.so.1 cannot be loaded): no GPU, or its driver is not installed"
        return 0, f"CUDA failed: {text}"
    return count, "" if count else "the driver reports no CUDA device"


def cuda_driver():
    """The CUDA driver library (libcuda.so.1) loaded through ctypes, or None where it does not load."""
    import ctypes

    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def cuda_driver_loadable() -> bool:
    """Whether the CUDA driver library loads in this process. The CUDA runtime reports a missing driver
    as cudaErrorInsufficientDriver, the same error as a driver too old for it."""
    return cuda_driver() is not None


def cuda_device_count() -> int:
    """Number of visible CUDA devices; 0 when cupy, the driver or a device is missing (`cuda_probe` says which)."""
    return cuda_probe()[0]


def get_backend(name: str) -> ModuleType:
    """The ops module for backend `name` (imported on first use; cupy is imported only for "cupy").

    Raises ValueError naming the unknown backend and the valid ones; BackendUnavailable for "cupy"
    when cupy is not installed, no CUDA device is usable (the CUDA error is named), NVRTC (the
    runtime compiler that builds kernels/*.cu) cannot be loaded, or a kernel source is missing.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown ops backend {name!r}; valid backends: {', '.join(BACKENDS)}")
    if name == "cupy":
        try:
            import cupy  # noqa: F401
        except ImportError as e:
            raise BackendUnavailable("ops backend 'cupy' needs cupy: pip install 'cupy-cuda12x[ctk]' (or "
                                     f"cupy-cuda13x[ctk]), or use --backend numpy ({e})") from e
        count, why = cuda_probe()
        if count == 0:
            raise BackendUnavailable(f"ops backend 'cupy': no usable CUDA device ({why}); use --backend numpy")
        try:
            from cupy_backends.cuda.libs import nvrtc

            nvrtc.getVersion()
        except Exception as e:  # the library is loaded on first use: a missing toolkit shows here
            raise BackendUnavailable(
                "ops backend 'cupy': NVRTC, the CUDA runtime compiler that builds kernels/*.cu, cannot be "
                f"loaded ({type(e).__name__}: {e}); install a CUDA toolkit or pip install 'cupy-cuda12x[ctk]' "
                "(the [gpu] extra of mpiasgd does)") from e
    module = importlib.import_module(BACKENDS[name])
    if name == "cupy":
        try:
            module.check_kernel_sources()
        except FileNotFoundError as e:
            raise BackendUnavailable(f"ops backend 'cupy': {e}") from e
    return module
