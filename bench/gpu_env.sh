# Sourced by bench/gpu_check.sh and bench/gpu_e2e.sh on the GPU machine (with PY set: the Python to use):
# unpacks the wheels carried in .whl/ (git-ignored; the Open MPI wheel: mpiexec and libmpi for mpi4py) under
# /tmp/mpi and puts its bin/, lib/ and site-packages on PATH, LD_LIBRARY_PATH and PYTHONPATH (`pip install
# --prefix` from the local files only: a wheel's .data/data/{bin,lib} land in /tmp/mpi/{bin,lib}; `--target`
# drops them, and mpi4py then cannot load libmpi); sets `launcher`, the mpiexec the tests and benches use.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    echo "== carried wheels -> /tmp/mpi: $(cd .whl && echo *.whl)"
    # local files only; --ignore-installed: a wheel already in the environment would be skipped, not unpacked
    if PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 timeout -k 5 30 "$PY" -m pip install -q \
            --no-index --no-deps --no-compile --no-cache-dir --ignore-installed --prefix /tmp/mpi .whl/*.whl; then
        export PATH="/tmp/mpi/bin:$PATH" LD_LIBRARY_PATH="/tmp/mpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        for site in /tmp/mpi/lib/python3*/site-packages; do  # in case a wheel holds Python modules
            [ -d "$site" ] && export PYTHONPATH="$PYTHONPATH:$site"
        done
    else
        echo "!! the carried wheels could not be installed under /tmp/mpi"
    fi
fi
# the tests' launcher: the one beside the Python that runs them (a venv's Open MPI wheel), else PATH's
launcher=$(dirname "$(command -v "$PY")")/mpiexec
[ -x "$launcher" ] || launcher=$(command -v mpiexec)
[ -n "$launcher" ] && echo "mpiexec: $launcher" \
    || echo "!! no mpiexec beside $PY or on PATH: the MPI training tests of tests/gpu will skip"

