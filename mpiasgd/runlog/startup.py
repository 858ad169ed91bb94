"""What start-up puts into the run log: the typed record every worker (and every parameter-server shard)
tells rank 0 before training (the /workers table, the shards' attributes), and the library versions.

Below rank 0 and start-up alike (`mpiasgd.rank0.serve` and `mpiasgd.launch.startup` import it), like the
rest of the run log.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import h5py
import mpi4py
import numpy as np

from mpiasgd import __version__
from mpiasgd.runlog.records import WorkerRow


def versions() -> dict:
    """{library: version} of mpiasgd, Python, NumPy, mpi4py, the MPI library, h5py and HDF5 (the run log's
    `versions` attribute)."""
    from mpi4py import MPI  # its import runs MPI_Init: the run log's readers must not, only its writer calls this

    return {"mpiasgd": __version__, "python": platform.python_version(), "numpy": np.__version__,
            "mpi4py": mpi4py.__version__, "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version}


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as it starts (gathered by rank 0; the /workers table of the run log).

    `threads` BLAS threads; `backend` "numpy" | "cupy"; `shard_size` training images in its shard;
    `device` GPU ordinal (-1 without one), `device_name`, `device_uuid`; `transfer` its staging kind
    ("host" | "pinned" | "device"); (`module`, `replica`) its place in the mode's grid (-1, -1 where
    there is none); `autotune` the conv plans it chose under --conv-algo autotune (one text each);
    `graphs` what --cuda-graphs resolved to on it ("" where it does not apply: `launch.startup.probe_cuda_graphs`).
    """

    rank: int
    host: str
    pid: int
    threads: int
    backend: str
    shard_size: int
    device: int = -1
    device_name: str = ""
    device_uuid: str = ""
    transfer: str = "host"
    module: int = -1
    replica: int = -1
    autotune: tuple[str, ...] = ()
    graphs: str = ""

    def row(self) -> WorkerRow:
        return WorkerRow(rank=self.rank, host=self.host.encode(), pid=self.pid, threads=self.threads,
                         backend=self.backend.encode(), shard_size=self.shard_size, device=self.device,
                         device_name=self.device_name.encode(), device_uuid=self.device_uuid.encode(),
                         transfer=self.transfer.encode(), module=self.module, replica=self.replica)

    def autotune_event(self) -> str:
        """The "autotune" event text of a worker that tuned its conv tiles ("" if it did not)."""
        if not self.autotune:
            return ""
        return (f"worker rank {self.rank} on {self.host}: conv tiles chosen by timing (ms per call of each "
                "tile):\n" + "\n".join(self.autotune))

    def graphs_event(self) -> str:
        """The "cuda_graphs" event text of a GPU worker ("" where --cuda-graphs does not apply)."""
        return f"worker rank {self.rank} on {self.host}: {self.graphs}" if self.graphs else ""


@dataclass(frozen=True)
class ShardInfo:
    """One parameter-server shard of rank >= 1 as it starts (--servers S > 1; gathered by rank 0 with the
    workers' records): `shard` its number, and its process, by which rank 0 names it when it dies."""

    rank: int
    shard: int
    host: str
    pid: int
