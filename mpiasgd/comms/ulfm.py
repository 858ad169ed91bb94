"""Fault tolerance through ULFM (User-Level Failure Mitigation, MPI 4.1's chapter draft; Open MPI 5's `ftmpi`
extension): a rank's death is reported to the ranks that talk to it instead of ending the job.

Open MPI keeps a job alive after a rank dies only when `mpiexec --with-ft ulfm` launched it (that flag sets
OMPI_MCA_mpi_ft_enable=1 in every rank; `--mca mpi_ft_enable true` alone does not stop the launcher's kill).
A dead rank is found by the heartbeat detector: `--mca mpi_ft_detector true --mca mpi_ft_detector_thread true`
(without the thread, heartbeats only run inside MPI calls and a busy rank is suspected falsely). Measured with
the wheel's Open MPI 5.0.11 on a loaded 2-core host (docs/training.md, "Workers that die"): a SIGKILLed rank
is reported in about 15 ms, an exited one in about 0.9 s, a stopped one after the detector's timeout
(`mpi_ft_detector_timeout`, 10 s by default).

What a failure looks like here (mpi4py's error handler on COMM_WORLD is ERRORS_RETURN): an operation that
involves the dead rank raises `MPI.Exception` of class ERR_PROC_FAILED; a receive or probe from
MPI_ANY_SOURCE raises ERR_PROC_FAILED_PENDING until the failure is acknowledged (`Comm.Ack_failed`), then
works again with the survivors; a send to the dead rank that was pending may stay pending for ever (drop it).
Point-to-point traffic between the survivors goes on, on the same communicator; collectives on it fail.

With the detector's thread, MPI_Finalize does not return (measured, with no failure at all): a rank of a
fault-tolerant job ends with `os._exit` once its output is flushed (`mpiasgd.cli`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from mpi4py import MPI

FAILURE_CLASSES = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)


class RankFailed(RuntimeError):
    """Ranks `ranks` (of the communicator the operation used) died; `what` says which operation found out."""

    def __init__(self, ranks: list[int], what: str) -> None:
        super().__init__(f"rank{'s' * (len(ranks) != 1)} {', '.join(map(str, ranks))} died ({what})")
        self.ranks, self.what = ranks, what


def enabled() -> bool:
    """This job runs under ULFM: `mpiexec --with-ft ulfm` started it (OMPI_MCA_mpi_ft_enable = "1"; the value
    "true" that a bare `--mca mpi_ft_enable true` sets does not keep the job alive, and does not count)."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable") == "1"


def detector_thread() -> bool:
    """The heartbeat detector runs in its own thread (`--mca mpi_ft_detector_thread true`)."""
    return os.environ.get("OMPI_MCA_mpi_ft_detector_thread", "").lower() in ("1", "true", "yes")


def is_failure(error: BaseException) -> bool:
    """`error` is MPI's report of a dead rank (ERR_PROC_FAILED, ..._PENDING, ERR_REVOKED)."""
    return isinstance(error, MPI.Exception) and error.Get_error_class() in FAILURE_CLASSES


def abort(comm: Any, code: int) -> None:
    """End the job with exit status `code`: MPI_Abort, except under ULFM when every other rank of `comm` has died.
    Open MPI's mpiexec (5.0.11, --with-ft ulfm) then exits 0 after an MPI_Abort (measured: 2 ranks, one
    SIGKILLed, the other aborting with 3: mpiexec's exit status 0; with a living rank left, 3), so this rank
    flushes its output and exits with `code` itself, which mpiexec passes on."""
    if enabled():
        try:
            dead = failed_ranks(comm)
        except MPI.Exception:
            dead = []
        if len(dead) >= comm.Get_size() - 1:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    comm.Abort(code)


def dead_ranks(comm: Any) -> str:
    """"rank 4" / "ranks 2, 4": the ranks of `comm` known dead (`failed_ranks`), or "a rank" when none can be
    named (the query itself can fail once the job is coming apart)."""
    try:
        dead = failed_ranks(comm)
    except Exception:
        dead = []
    return f"rank{'s' * (len(dead) > 1)} {', '.join(map(str, dead))}" if dead else "a rank"


def failed_ranks(comm: Any) -> list[int]:
    """Acknowledge every failure known on `comm` (so receives from any source work again) and return the ranks of
    `comm` that have failed, ascending (all of them since the start, not only the new ones). A communicator with a
    `failed_ranks` of its own (rank 0's `RoutedComm` under --respawn) answers for itself."""
    own = getattr(comm, "failed_ranks", None)
    if own is not None:
        return own()
    comm.Ack_failed()
    failed = comm.Get_failed()
    try:
        ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), comm.Get_group())
    finally:
        failed.Free()
    return sorted(int(r) for r in ranks if r != MPI.UNDEFINED)
