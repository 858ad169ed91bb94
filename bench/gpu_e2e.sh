#!/usr/bin/env bash
# Issue 38's end-to-end check on one GPU, as one device call: the carried Open MPI wheel unpacked
# (bench/gpu_env.sh, as bench/gpu_check.sh does), CIFAR-10 unpacked from the carried JPEG archive into
# the official layout (.gpudata/, git-ignored; docs/gpus.md, "The end-to-end check"), then
# bench/gpu_e2e.py with the arguments given (default: every part), then the server's update with
# threads (bench/server.py --sweep: whether the server rank should use the node's spare cores).
#
#     bash bench/gpu_e2e.sh                      # every part; $OUT/gpu_e2e.{json,md,log} when OUT is set
#     bash bench/gpu_e2e.sh --only race          # one part (a rerun)
#     bash bench/gpu_e2e.sh --dry-run            # no device: every step on the cpu backend, tiny sizes (CI)
#     (device tool) run(command="bash bench/gpu_e2e.sh", carry=[".whl", ".gpudata"], timeout_s=480)
# Exit status: gpu_e2e.py's (0 measured, 1 a part failed, 2 no usable GPU).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--dry-run" ]; then
    shift
    echo "== $(date -Is) gpu_e2e dry run, python: $PY"
    rc=0
    bash -n bench/gpu_env.sh || rc=1
    timeout -k 5 300 "$PY" bench/gpu_e2e.py --dry-run "$@" || rc=1
    timeout -k 5 120 "$PY" bench/server.py --sweep --params 65536 --repeats 2 --chunks 8192 --threads 2 \
        >/dev/null || { rc=1; echo "!! bench/server.py --sweep failed"; }
    echo "== dry run exit status: $rc"
    exit $rc
fi
[ -n "${OUT:-}" ] && mkdir -p "$OUT" && exec > >(tee "$OUT/gpu_e2e.log") 2>&1
echo "== $(date -Is) gpu_e2e on $(hostname), python: $PY"
. bench/gpu_env.sh
DATA=()
if [ -f .gpudata/data/cifar10-jpg.tar.gz ] && [ -f .gpudata/tools/cifar10_batches.py ]; then
    echo "== CIFAR-10 -> .gpudata/cifar10"
    if timeout -k 5 120 "$PY" .gpudata/tools/cifar10_batches.py .gpudata/cifar10 >/dev/null; then
        DATA=(--data .gpudata/cifar10)
    else
        echo "!! CIFAR-10 could not be unpacked: the race part reports it"
    fi
fi
timeout -k 5 420 "$PY" bench/gpu_e2e.py "${DATA[@]}" "$@"
rc=$?
echo "bench/gpu_e2e.py exit status: $rc"
echo "== the server's update with threads (bench/server.py --sweep, P = 40M: alexnet_1gpu_64)"
timeout -k 5 45 "$PY" bench/server.py --sweep --params 40110888 --repeats 5 --chunks 65536 --threads 2,4,8 \
    || echo "!! bench/server.py --sweep: exit status $?"
echo "== $(date -Is) done"
exit $rc
