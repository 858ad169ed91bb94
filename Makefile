# mpiasgd: set up, demo, test.
#   make demo   create .venv, install mpiasgd with Open MPI from wheels, train the digits network
#               with 1 parameter server + 2 workers (mpiexec -n 3), write runs/digits-demo.h5
#   make test   the whole test suite (ruff + pytest over every tier under tests/); .ci/run calls exactly this
#   make test-fast  the inner loop: ruff + tests/unit + tests/kernels_cpu (no mpiexec ranks, SLURM or GPU)
#
# Clusters with their own MPI: `make venv EXTRAS=test` skips the Open MPI wheel; see docs/clusters.md.

PYTHON  ?= python3
VENV    ?= .venv
EXTRAS  ?= mpi,test
PY      := $(VENV)/bin/python
NP      ?= 3
# the launcher of the MPI that mpi4py uses: the wheel's beside the venv's python, else the system's
MPIEXEC ?= $(shell test -x $(VENV)/bin/mpiexec && echo $(VENV)/bin/mpiexec || echo mpiexec)
# Open MPI refuses root and more ranks than cores unless told; these apply to `make demo` only
MPIFLAGS ?= $(shell $(MPIEXEC) --version 2>/dev/null | grep -q "Open MPI" && echo --oversubscribe --bind-to none)
ROOTENV := $(shell test "$$(id -u)" = 0 && echo OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)

.PHONY: venv demo test test-fast clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

demo: venv
	env $(ROOTENV) $(MPIEXEC) -n $(NP) $(MPIFLAGS) $(PY) -m mpiasgd train \
	    --model digits --epochs 30 --batch-size 32 --lr 0.03 --name digits-demo --overwrite

test: venv
	$(VENV)/bin/ruff check mpiasgd tests bench dev
	$(PY) -m pytest -q tests

# the inner loop: tests/unit (in-process) and tests/kernels_cpu (the CUDA-on-CPU harness, NVRTC/nvcc);
# no mpiexec ranks, SLURM or GPU (docs/testing.md has the measured times)
test-fast: venv
	$(VENV)/bin/ruff check mpiasgd tests bench dev
	$(PY) -m pytest -q tests/unit tests/kernels_cpu

clean:
	rm -rf $(VENV) runs .pytest_cache
