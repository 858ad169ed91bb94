"""Run `python -m mpiasgd ARGS...` and, when it exits, write this rank's peak resident set size.

    mpiexec -n 3 python bench/peak_rss.py OUT_DIR train --data FILE ...

writes OUT_DIR/rank<R>.json = {"rank": R, "peak_rss_mib": ...} (getrusage's ru_maxrss: the largest RSS the
process had, in KiB on Linux). R comes from the launcher's environment (Open MPI, MPICH/Hydra, SLURM).
Used by bench/data_memory.py.
"""

import atexit
import json
import os
import resource
import runpy
import sys


def rank() -> int:
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def dump(out: str) -> None:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    with open(os.path.join(out, f"rank{rank()}.json"), "w") as f:
        json.dump({"rank": rank(), "peak_rss_mib": peak}, f)


if __name__ == "__main__":
    out = sys.argv[1]
    atexit.register(dump, out)
    sys.argv = ["mpiasgd", *sys.argv[2:]]
    runpy.run_module("mpiasgd", run_name="__main__", alter_sys=True)
