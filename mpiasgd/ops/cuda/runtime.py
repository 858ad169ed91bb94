"""Kernel loading: kernels/*.cu found on disk, compiled by NVRTC through `cupy.RawModule`, looked up by name.

    kernels = CudaKernels(cupy, check_kernel_sources())
    kernels.get("relu_fprop", None)(grid, block, (x, y, np.int64(n)))   # cupy.RawKernel's call form

Each .cu file (conv2d.cu once per tile) becomes one module, compiled on first use and kept by the
`CudaKernels` object (CuPy keeps the compiled code on disk as well). The CUDA-on-CPU harness of the
tests (tests/kernels_cpu/cuda_cpu) stands in for `CudaKernels`: anything with `get(kernel, tile)` returning a
callable `(grid, block, args, shared_mem=0)`, and `compile(filename, defines)` for start-up.
Importing this module needs neither cupy nor a GPU.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mpiasgd.ops.cuda.constants import HEADER_NAME
from mpiasgd.ops.cuda.tiles import tile_defines

KERNEL_FILES = {  # kernel -> file under kernels/
    "conv2d_fprop": "conv2d.cu", "conv2d_dgrad": "conv2d.cu", "conv2d_fprop_partial": "conv2d.cu",
    "conv2d_dgrad_partial": "conv2d.cu", "conv2d_wgrad_partial": "conv2d.cu", "conv2d_split_reduce": "conv2d.cu",
    "bias_grad": "bias.cu", "relu_fprop": "relu.cu", "relu_bprop": "relu.cu",
    "maxpool_fprop_u8": "pool.cu", "maxpool_fprop_i32": "pool.cu", "maxpool_bprop_u8": "pool.cu",
    "maxpool_bprop_i32": "pool.cu", "avgpool_fprop": "pool.cu", "avgpool_bprop": "pool.cu",
    "global_avgpool_fprop": "pool.cu", "global_avgpool_bprop": "pool.cu",
    "batchnorm_stats": "batchnorm.cu", "batchnorm_fprop": "batchnorm.cu", "batchnorm_bprop": "batchnorm.cu",
    "add": "residual.cu", "subsample_pad_fprop": "residual.cu", "subsample_pad_bprop": "residual.cu",
    "dropout": "dropout.cu", "lrn_fprop": "lrn.cu", "lrn_bprop": "lrn.cu",
    "softmax_xent": "softmax_xent.cu", "sgd_momentum": "sgd.cu",
}
# headers the .cu files include: constants.HEADER's (generated) and Philox4x32-10 (dropout.cu)
HEADERS = (HEADER_NAME, "philox.cuh")
NVRTC_OPTIONS = ("--std=c++14",)  # CuPy adds -ftz=true, -arch=sm_XX of the device, --device-as-default-execution-space
_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*(?://.*)?$', re.M)  # a local header (a comment may follow)


def kernel_dir() -> Path:
    """Folder holding the .cu files: $MPIASGD_KERNELS when set (it must exist and hold conv2d.cu), else
    `mpiasgd/kernels` (installed package), else `kernels/` of the source checkout. Raises
    FileNotFoundError naming the folder(s) tried."""
    here = Path(__file__).resolve()
    if os.environ.get("MPIASGD_KERNELS"):
        d = Path(os.environ["MPIASGD_KERNELS"])
        if not (d / "conv2d.cu").is_file():
            raise FileNotFoundError(f"$MPIASGD_KERNELS = {str(d)!r} holds no conv2d.cu (it must be a folder with "
                                    f"every kernel source: {', '.join(sorted(set(KERNEL_FILES.values())))})")
        return d
    candidates = [here.parents[2] / "kernels", here.parents[3] / "kernels"]
    for d in candidates:
        if (d / "conv2d.cu").is_file():
            return d
    raise FileNotFoundError(f"CUDA kernel sources not found in any of {[str(d) for d in candidates]}")


def check_kernel_sources() -> Path:
    """The kernel folder, after checking it holds every .cu file the backend launches from and the headers
    they include. Raises FileNotFoundError naming the folder and the missing files (at start-up, not mid-run)."""
    d = kernel_dir()
    missing = [f for f in (*sorted(set(KERNEL_FILES.values())), *HEADERS) if not (d / f).is_file()]
    if missing:
        raise FileNotFoundError(f"kernel folder {str(d)!r} lacks {', '.join(missing)}")
    return d


def kernel_source(filename: str, folder: Path) -> str:
    """The text NVRTC compiles for `folder/filename`: the file with each `#include "x.cuh"` of the folder
    replaced by that header's text, then a #line directive (compiler messages keep the file's own line
    numbers). Inlined rather than found through -I, because CuPy's on-disk cache keys on the source text
    and the options only: a changed header would otherwise reuse code compiled from the old one."""
    text = (folder / filename).read_text()

    def inline(m: re.Match) -> str:
        line = text.count("\n", 0, m.start()) + 1  # the #include's line number in `filename`
        return f"{(folder / m.group(1)).read_text().rstrip()}\n#line {line + 1} \"{filename}\""

    return _INCLUDE.sub(inline, text)


NULL = np.uint64(0)  # a NULL pointer kernel argument for CuPy: an 8-byte zero value


class NullSafeKernel:
    """A cupy.RawKernel called as `(grid, block, args, shared_mem=0)` whose None arguments become NULL
    pointers. CuPy itself hands the driver no argument value for None (a NULL pointer *to* the value),
    and the kernel then sees a garbage pointer, 0xffffffff in the report (cupy issue 9046), where an
    optional bias or tap table must read as NULL; an 8-byte zero (`NULL`) is a NULL pointer."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        self.fn(grid, block, tuple(NULL if a is None else a for a in args), shared_mem=shared_mem)


class Kernels(Protocol):
    """Where a backend's kernels come from: `CudaKernels` on a GPU, the harness in tests."""

    def get(self, kernel: str, tile: tuple[int, ...] | None = None) -> Any:
        """Callable `(grid, block, args, shared_mem=0)` that launches `kernel` (conv2d.cu's compiled for `tile`)."""

    def compile(self, filename: str, defines: tuple[str, ...] = ()) -> None:
        """Build the module of `filename` with -D `defines` now; raises the compiler's error (with its log)."""


class CudaKernels:
    """The kernels of kernels/*.cu as `cupy.RawModule`s, compiled by NVRTC on first use: one module per
    file, and per tile for conv2d.cu (`tiles.tile_defines`), kept for the life of this object.

    `cupy`: the cupy module; `folder`: the kernel folder (`check_kernel_sources()`)."""

    def __init__(self, cupy: Any, folder: Path) -> None:
        self.cupy, self.folder = cupy, folder
        self._modules: dict[tuple[str, tuple[str, ...]], Any] = {}  # (file, defines) -> cupy.RawModule
        self._kernels: dict[tuple[str, tuple[int, ...] | None], NullSafeKernel] = {}

    def module(self, filename: str, defines: tuple[str, ...] = ()) -> Any:
        """The cupy.RawModule of one .cu file (and tile variant); NVRTC compiles it at its first use."""
        key = (filename, tuple(defines))
        if key not in self._modules:
            source = kernel_source(filename, self.folder)
            self._modules[key] = self.cupy.RawModule(code=source, options=NVRTC_OPTIONS + tuple(defines))
        return self._modules[key]

    def compile(self, filename: str, defines: tuple[str, ...] = ()) -> None:
        """Compile the module of `filename` with `defines` now (on the current device); CuPy's
        CompileException carries NVRTC's log."""
        self.module(filename, defines).compile()

    def get(self, kernel: str, tile: tuple[int, ...] | None = None) -> NullSafeKernel:
        """The launcher of `kernel` (of conv2d.cu's module for `tile`), looked up once."""
        key = (kernel, tile)
        if key not in self._kernels:
            fn = self.module(KERNEL_FILES[kernel], tile_defines(tile)).get_function(kernel)
            self._kernels[key] = NullSafeKernel(fn)
        return self._kernels[key]


def check_args(kernel: str, args: tuple) -> None:
    """TypeError unless every argument is an array (anything with a dtype), None (a NULL pointer) or a
    scalar of its C type already (np.int32, np.int64, np.float32, np.uint32 for an unsigned int: dropout's
    key words): a Python int or float here is a bug."""
    for a in args:
        if not (a is None or isinstance(a, (np.int32, np.int64, np.float32, np.uint32)) or hasattr(a, "dtype")):
            raise TypeError(f"{kernel}: argument {a!r} has no C type (use np.int32/np.int64/np.float32/np.uint32)")
