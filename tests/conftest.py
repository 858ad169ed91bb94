"""Test tiers, one folder each, and the fixtures they share.

    tests/unit/         in-process tests: no ranks launched (the fake communicator, files, subprocesses
                        of the CLI)                                            marker `unit`
    tests/kernels_cpu/  kernels/*.cu on the CPU through the CUDA-on-CPU harness (kernels_cpu/cuda_cpu),
                        the CuPy wrappers with a fake device, NVRTC/nvcc builds  marker `kernels`
    tests/mpi/          real `mpiexec` jobs of 1 to 9 ranks, each under a timeout   marker `mpi`
    tests/gpu/          cupy on a CUDA device (skipped without one)             marker `gpu`
    tests/slurm/        the job scripts under a real one-node SLURM              marker `slurm`

`make test-fast` runs unit/ and kernels_cpu/, `make test` every folder. Each test gets its folder's
marker here, so `-m "not mpi and not slurm and not gpu"` and the like select the same tests as the
folders do. A test that launches ranks (it takes the `mpirun` fixture or calls a launcher of
kit.launch) belongs in mpi/ (or gpu/, which also marks it `mpi`): anywhere else it fails collection.
Shared helpers live in tests/kit/ (importable as `kit`), never in a test module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # kit/ and the tier packages, whatever the import mode
    sys.path.insert(0, str(TESTS))

from kit import launch  # noqa: E402  (after the path set-up)
from kit.cifar import write_tiny_cifar  # noqa: E402

# folder under tests/ -> the marker its tests get
TIERS = {"unit": "unit", "kernels_cpu": "kernels", "mpi": "mpi", "gpu": "gpu", "slurm": "slurm"}
LAUNCHING = {"mpi", "gpu"}  # the folders whose tests may launch mpiexec ranks
# a test that uses any of these launches ranks (the harness's launchers, and tests' own helpers around them)
MPI_NAMES = {"mpirun", "start_mpi", "run_mpi", "mpi_command", "signal_a_rank", "resume_for_a_second"}


def pytest_configure(config):
    # pytest keeps the 3 newest numbered temporary folders of a user (/tmp/pytest-of-USER/pytest-N) and deletes
    # older ones when a session starts: a second session on the machine (make test-fast while CI runs) deleted
    # the folders of the tests of the first under them. Each session gets a folder of its own instead.
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="pytest-mpiasgd-")
        config.own_basetemp = config.option.basetemp
    # Open MPI's libfabric transport (btl "ofi") probes for fabric providers in every MPI_Init, ~1 s per
    # process here with no fabric to find; on one node the ranks talk through shared memory ("sm")
    # either way. Left out for this session and the jobs it launches, unless OMPI_MCA_btl is set.
    os.environ.setdefault("OMPI_MCA_btl", "^ofi")
    config.addinivalue_line("markers", "unit: in-process, no ranks launched (tests/unit; make test-fast)")
    config.addinivalue_line("markers", "kernels: the CUDA kernels on the CPU harness, NVRTC (tests/kernels_cpu; "
                                       "make test-fast)")
    config.addinivalue_line("markers", "mpi: launches mpiexec ranks (tests/mpi; seconds each)")
    config.addinivalue_line("markers", "slurm: submits jobs to the SLURM test cluster (tests/slurm)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu; skipped without one)")


def pytest_sessionfinish(session, exitstatus):
    """The session's own temporary folder goes at its end when every test passed (pytest would prune it); a
    failed session keeps it, for a look at what the tests left."""
    own = getattr(session.config, "own_basetemp", None)
    if own and exitstatus in (0, 5):
        shutil.rmtree(own, ignore_errors=True)


def launches_ranks(item) -> set[str]:
    """The launcher names a test takes as fixtures or calls (its own code, not nested functions)."""
    code = getattr(getattr(item, "function", None), "__code__", None)
    return (set(getattr(item, "fixturenames", ())) | set(code.co_names if code else ())) & MPI_NAMES


def pytest_collection_modifyitems(config, items):
    """Mark each test with its folder's tier (and `mpi` where a gpu test launches ranks); refuse a test
    outside the tier folders, or one that launches ranks outside mpi/ and gpu/."""
    misplaced = []
    for item in items:
        parts = item.path.resolve().relative_to(TESTS).parts
        folder = parts[0] if len(parts) > 1 else ""
        if folder not in TIERS:
            misplaced.append(f"{item.nodeid}: not in a tier folder ({', '.join(f'tests/{f}/' for f in TIERS)})")
            continue
        item.add_marker(TIERS[folder])
        launchers = launches_ranks(item)
        if launchers and folder not in LAUNCHING:
            misplaced.append(f"{item.nodeid}: launches mpiexec ranks (uses {', '.join(sorted(launchers))}) "
                             f"but sits in tests/{folder}/; multi-rank tests belong in tests/mpi/")
        elif launchers and folder != "mpi":
            item.add_marker("mpi")
    if misplaced:
        raise pytest.UsageError("tests in the wrong tier:\n  " + "\n  ".join(misplaced))


# --- fixtures shared by the tiers -------------------------------------------------------------------------

@pytest.fixture(autouse=True, scope="session")
def remove_job_tmpdirs():
    yield
    launch.remove_job_tmpdirs()


@pytest.fixture(autouse=True, scope="session")
def one_blas_thread():
    """Tiny GEMMs gain nothing from BLAS threads, and spinning threads slow down ~50x when other
    processes (MPI ranks of a parallel test) hold the cores."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1, user_api="blas"):
        yield


@pytest.fixture(scope="session")
def digits():
    """The digits dataset (read-only arrays: one copy serves every test of the session)."""
    from mpiasgd.data import load_dataset

    return load_dataset("digits")


@pytest.fixture
def tiny_cifar(tmp_path):
    """Both layouts of one tiny CIFAR-10 (5 x 20 train, 10 test) under tmp_path; returns (dir, arrays)."""
    return write_tiny_cifar(tmp_path)


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs at tmp_path/small (root and `mount` needed, else the test is skipped)."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a 3 MB tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
