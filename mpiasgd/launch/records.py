"""The typed records of start-up: what every worker (and every parameter-server shard) tells rank 0 before
training."""

from __future__ import annotations

from dataclasses import dataclass

from mpiasgd.runlog import WorkerRow


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as it starts (gathered by rank 0; the /workers table of the run log).

    `threads` BLAS threads; `backend` "numpy" | "cupy"; `shard_size` training images in its shard;
    `device` GPU ordinal (-1 without one), `device_name`, `device_uuid`; `transfer` its staging kind
    ("host" | "pinned" | "device"); (`module`, `replica`) its place in the mode's grid (-1, -1 where
    there is none); `autotune` the conv plans it chose under --conv-algo autotune (one text each).
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


@dataclass(frozen=True)
class ShardInfo:
    """One parameter-server shard of rank >= 1 as it starts (--servers S > 1; gathered by rank 0 with the
    workers' records): `shard` its number, and its process, by which rank 0 names it when it dies."""

    rank: int
    shard: int
    host: str
    pid: int
