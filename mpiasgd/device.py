"""GPU binding of the workers: backend resolution, one device per worker, and moving data for MPI.

Start-up (`mpiasgd.launch.startup`) resolves each worker's backend and device, all at start-up:

    backend = resolve_backend(cfg.backend, cuda_device_count())      # "auto" -> cupy if a GPU is visible
    index = assign_device(local_worker_rank, cuda_device_count())     # local rank modulo visible devices
    info = use_device(index)                                          # cupy: select it; name, UUID

Device numbers are those the process sees: CUDA_VISIBLE_DEVICES (and SLURM's `--gpus-per-task`,
which sets it per task) renumber the visible devices from 0, so two workers may both use "device
0" and still be on different GPUs. Whether two workers share one GPU is therefore decided by the
device's UUID (`shared_devices`), not by its number.

How weights and gradients then meet MPI: `mpiasgd.comms.staging`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpiasgd.ops import cuda_driver


class DeviceError(RuntimeError):
    """A worker cannot get a device of its own (sharing without --share-devices, no device visible)."""


# ----------------------------------------------------------------------------------------------
# backend and device assignment (pure functions: tested without a GPU)


def resolve_backend(requested: str, device_count: int) -> str:
    """The backend a worker runs: "auto" is "cupy" when `device_count` > 0, else "cpu" (the numpy
    reference with faster convolutions, `mpiasgd.ops.cpu_ops`).

    "numpy", "cpu" and "cupy" are returned as given; whether cupy can run is checked when its ops module
    is loaded (`mpiasgd.ops.get_backend` raises BackendUnavailable naming what is missing).
    """
    if requested == "auto":
        return "cupy" if device_count > 0 else "cpu"
    if requested not in ("numpy", "cpu", "cupy"):
        raise ValueError(f"unknown backend {requested!r}; expected auto, numpy, cpu or cupy")
    return requested


def local_worker_rank(is_worker_by_node_rank: list[bool], node_rank: int) -> tuple[int, int]:
    """(index of this worker among the workers of its node, workers on the node).

    `is_worker_by_node_rank[i]` says whether node rank i (of `comm.Split_type(COMM_TYPE_SHARED)`)
    is a worker; the parameter server takes no GPU, so it is not counted. Raises ValueError when
    `node_rank` is not a worker.
    """
    if not is_worker_by_node_rank[node_rank]:
        raise ValueError(f"node rank {node_rank} is not a worker")
    return sum(is_worker_by_node_rank[:node_rank]), sum(is_worker_by_node_rank)


def assign_device(local_rank: int, visible: int) -> int:
    """Device number (as this process sees it) of the worker with node-local worker index `local_rank`.

    Local rank modulo the `visible` devices; DeviceError when none is visible.
    """
    if visible < 1:
        raise DeviceError(f"no CUDA device visible{visible_hint()}")
    return local_rank % visible


def parse_visible(value: str | None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES ("0,2", "GPU-8f3c...", "" or "-1" = none); None when unset.

    The CUDA runtime stops at the first invalid entry; so does this ("0,-1,1" -> ["0"]).
    """
    if value is None:
        return None
    out = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def visible_hint(env: dict | None = None) -> str:
    """' (CUDA_VISIBLE_DEVICES=...)' when set, for error messages; '' otherwise."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return "" if value is None else f" (CUDA_VISIBLE_DEVICES={value!r})"


def physical_id(index: int, env: dict | None = None) -> str:
    """What device `index` (numbered from 0 as this process sees it) is on its node.

    The CUDA_VISIBLE_DEVICES entry it maps to (e.g. index 0 under "2,3" is "2"), else the index itself.
    """
    visible = parse_visible((os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES"))
    if visible is not None and index < len(visible):
        return visible[index]
    return str(index)


def format_uuid(raw: Any) -> str:
    """A device UUID as nvidia-smi prints it ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"); "" if absent
    or cut short.

    `raw` is the 16 bytes of cudaDeviceProp.uuid (bytes, or a str CuPy may hand back as is). CuPy
    converts that char[16] like a C string (`getDeviceProperties()["uuid"]`): it ends at the first
    zero byte, so fewer than 16 bytes are a truncated UUID (""), and more run past the field (the
    first 16 are the UUID).
    """
    if isinstance(raw, str):
        return raw
    raw = bytes(raw or b"")
    if len(raw) < 16:
        return ""
    h = raw[:16].hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def driver_uuid(index: int) -> bytes:
    """The 16 bytes of device `index`'s UUID from the CUDA driver (cuDeviceGetUuid_v2, cuDeviceGetUuid
    before CUDA 11.4), for the UUIDs CuPy cuts at a zero byte; b"" when there is no driver or it fails.
    Call it after the CUDA runtime has initialised the driver (`use_device` does)."""
    lib = cuda_driver()
    get = None if lib is None else getattr(lib, "cuDeviceGetUuid_v2", None) or getattr(lib, "cuDeviceGetUuid", None)
    if get is None:  # no driver library, or one without the call
        return b""
    dev, raw = ctypes.c_int(), ctypes.create_string_buffer(16)
    if lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index)) != 0 or get(raw, dev) != 0:
        return b""
    return raw.raw


@dataclass(frozen=True)
class DeviceInfo:
    """One worker's device, as logged: host, index (as the process sees it), name, UUID, node-wide id."""

    rank: int
    host: str
    index: int
    name: str
    uuid: str
    physical: str  # CUDA_VISIBLE_DEVICES entry or index: identifies the GPU on its node without a UUID

    @property
    def key(self) -> tuple[str, str]:
        """Identity of the physical GPU: its UUID when known, else (host, CUDA_VISIBLE_DEVICES entry)."""
        return ("", self.uuid) if self.uuid else (self.host, self.physical)


def shared_devices(infos: list[DeviceInfo | None]) -> dict[tuple[str, str], list[DeviceInfo]]:
    """The GPUs used by two or more workers: key -> the workers on it (ranks ascending). None entries
    (numpy workers, the server) are ignored."""
    by_key: dict[tuple[str, str], list[DeviceInfo]] = {}
    for info in infos:
        if info is not None:
            by_key.setdefault(info.key, []).append(info)
    return {k: sorted(v, key=lambda i: i.rank) for k, v in by_key.items() if len(v) > 1}


def tuning_turns(infos: list[DeviceInfo | None]) -> list[int]:
    """Per rank, its turn to time kernels on its GPU (--conv-algo autotune): 0 for the first worker on a
    device, 1 for the second (--share-devices), ...; -1 for ranks without a device. Workers sharing a
    GPU then time one after another and not each other's kernels; every rank computes the same list."""
    seen: dict[tuple[str, str], int] = {}
    turns = []
    for info in infos:
        if info is None:
            turns.append(-1)
            continue
        turns.append(seen.get(info.key, 0))
        seen[info.key] = turns[-1] + 1
    return turns


def sharing_error(infos: list[DeviceInfo | None], rank: int, share: bool) -> str | None:
    """The start-up error of worker `rank` if it shares its GPU and `share` is False; else None.

    Every rank computes this from the same gathered list, so all agree without another message.
    """
    if share:
        return None
    for group in shared_devices(infos).values():
        if any(i.rank == rank for i in group):
            first = group[0]
            ranks = ", ".join(str(i.rank) for i in group)
            return (f"workers (ranks {ranks}) would share one GPU: device {first.index} ({first.name or 'unnamed'}"
                    f"{', ' + first.uuid if first.uuid else ''}) on host {first.host}{visible_hint()}; start at "
                    "most one worker per visible GPU on each node, or pass --share-devices")
    return None


def mpix_cuda_support(maps: str = "/proc/self/maps") -> Callable[[], bool] | None:
    """`MPIX_Query_cuda_support` of the MPI library this process has loaded, called through ctypes: the
    query for an mpi4py built without `MPI.Query_cuda_support` (the PyPI wheels). Open MPI (every
    version since 2.0; the extension is built by default) and MPICH >= 4 export it; it returns 1
    when the library was built with CUDA and the runtime takes CUDA buffers, and must be called after
    MPI_Init. None when no loaded libmpi* (found in `maps`, Linux's /proc/self/maps) exports it.
    """
    paths = set()
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split()  # address perms offset dev inode [path]
                if len(fields) >= 6 and os.path.basename(fields[5]).startswith("libmpi") and ".so" in fields[5]:
                    paths.add(fields[5])
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, []
        return lambda: bool(fn())
    return None


def resolve_cuda_aware(setting: str, query: Callable[[], bool] | None) -> bool:
    """Whether device buffers go to MPI directly: "on"/"off" as given; "auto" asks the MPI library.

    `query` is `MPI.Query_cuda_support` where this mpi4py and MPI have it (Open MPI >= 5, MPICH
    >= 4.1 via MPIX), else `mpix_cuda_support()`; without either "auto" means off (pinned host
    buffers: always correct).
    """
    if setting == "on":
        return True
    if setting == "off" or query is None:
        return False
    if setting != "auto":
        raise ValueError(f"unknown cuda_aware setting {setting!r}; expected auto, on or off")
    return bool(query())


def use_device(index: int, rank: int, host: str) -> DeviceInfo:
    """(cupy workers) Make device `index` current for this process and describe it. Needs cupy and a GPU.

    Called before the model allocates anything, so every array of this worker lives on that device.
    """
    import cupy

    cupy.cuda.Device(index).use()
    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props.get("name", b"")
    name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    uuid = format_uuid(props.get("uuid", b"")) or format_uuid(driver_uuid(index))  # CuPy's may be cut short
    return DeviceInfo(rank, host, index, name, uuid, physical_id(index))
