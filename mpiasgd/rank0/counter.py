"""The server's version counter: how far the weights it holds have moved.

A parameter server numbers its weights (Dean et al. 2012; Li et al. 2014, ps-lite's timestamps): each
applied update makes a new version, and a push's staleness is the server's version less the version the
worker computed it from. `VersionCounter` is that counter on rank 0 (and on each parameter-server shard):
the mode's rank-0 role (`mpiasgd.rank0.role.Role.counter`) owns and advances it; the recorder only reads
it, for its rows, the summary and the stopping rules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VersionCounter:
    """`version`: updates applied to the weights (async, ssp, easgd: pushes applied; sync: steps; pipeline:
    replica 0's minibatches); `samples`: images in those updates (int, both >= 0; a resume starts them at
    the checkpoint's)."""

    version: int = 0
    samples: int = 0

    def advance(self, samples: int) -> int:
        """One update of `samples` images applied: the next version (returned)."""
        self.version += 1
        self.samples += int(samples)
        return self.version

    def set(self, version: int, samples: int) -> None:
        """The modes whose workers number the updates (sync, pipeline), and a resume: the version and images
        are `version` and `samples`."""
        self.version, self.samples = int(version), int(samples)
