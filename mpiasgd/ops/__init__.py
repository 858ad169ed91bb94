"""Compute backends: the CNN ops (fprop/dgrad/wgrad) behind one protocol, layout NCHW float32.

Layers call only the backend object's ops, never numpy or cupy directly, so one layer code runs on both:

    ops = get_backend("numpy")          # numpy_ops.NumpyBackend: im2col + BLAS, the reference
    ops = get_backend("cupy")           # cuda.backend.CupyBackend: our CUDA C kernels (kernels/*.cu) on a GPU
    y = ops.conv2d_fprop(x, w, b, stride, pad)

The ops, their shapes, dtypes and errors: `mpiasgd.ops.protocol.Backend`; their argument checks, one
set for both backends: `mpiasgd.ops.contract`. The CUDA backend's parts: `mpiasgd.ops.cuda`.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
from typing import TYPE_CHECKING, Literal, overload

if TYPE_CHECKING:  # (the cupy backend's module is imported only when it is asked for)
    from mpiasgd.ops.cuda.backend import CupyBackend
    from mpiasgd.ops.numpy_ops import NumpyBackend
    from mpiasgd.ops.protocol import Backend

# backend name -> module whose make_backend() builds it (numpy first: the reference, and the default
# without a GPU)
BACKENDS: dict[str, str] = {"numpy": "mpiasgd.ops.numpy_ops", "cpu": "mpiasgd.ops.cpu_ops",
                            "cupy": "mpiasgd.ops.cuda.backend"}


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


@overload
def get_backend(name: Literal["numpy"]) -> NumpyBackend: ...
@overload
def get_backend(name: Literal["cupy"]) -> CupyBackend: ...
@overload
def get_backend(name: str) -> Backend: ...


def get_backend(name: str) -> Backend:
    """The backend object for `name`, one per process (built on first use; cupy is imported only for
    "cupy"). It satisfies `mpiasgd.ops.protocol.Backend`; the cupy one also has set_conv_algo,
    compile_kernels and conv_plans (`mpiasgd.ops.cuda.backend.CupyBackend`).

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
                                     f"cupy-cuda13x[ctk]), or use --backend cpu ({e})") from e
        count, why = cuda_probe()
        if count == 0:
            raise BackendUnavailable(f"ops backend 'cupy': no usable CUDA device ({why}); use --backend cpu")
        try:
            from cupy_backends.cuda.libs import nvrtc

            nvrtc.getVersion()
        except Exception as e:  # the library is loaded on first use: a missing toolkit shows here
            raise BackendUnavailable(
                "ops backend 'cupy': NVRTC, the CUDA runtime compiler that builds kernels/*.cu, cannot be "
                f"loaded ({type(e).__name__}: {e}); install a CUDA toolkit or pip install 'cupy-cuda12x[ctk]' "
                "(the [gpu] extra of mpiasgd does)") from e
        try:
            return _made(name)
        except FileNotFoundError as e:  # a kernel source missing: at start-up, not mid-run
            raise BackendUnavailable(f"ops backend 'cupy': {e}") from e
    return _made(name)


@functools.cache
def _made(name: str) -> Backend:
    """The backend of `name`, built once (a failed build raises and is tried again next time)."""
    return importlib.import_module(BACKENDS[name]).make_backend()
