"""The `mpirun` fixture of the multi-rank tests: a job in the test's tmp_path under a timeout (kit.launch)."""

from __future__ import annotations

import pytest
from kit.launch import SCRIPTS, Result, run_mpi


@pytest.fixture
def mpirun(tmp_path):
    """`mpirun(nranks, args, timeout=..)` -> Result, run in tmp_path; `script="fault.py"` runs
    tests/mpi/scripts/fault.py in place of `-m mpiasgd`."""
    def run(nranks: int, args: list[str], timeout: float = 120, env: dict | None = None,
            script: str | None = None) -> Result:
        program = (str(SCRIPTS / script),) if script else ("-m", "mpiasgd")
        return run_mpi(nranks, args, timeout, tmp_path, env, program)
    return run
