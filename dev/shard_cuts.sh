#!/bin/bash
# Sharded runs (--servers 2 and 3) in every server mode with an interval checkpoint every 0.1 s: each must end
# with every shard at one version and its checkpoints one consistent cut (dev/shard_cuts.py). From the
# repository root: bash dev/shard_cuts.sh [RUN_DIR]   (about 1 min; Open MPI as root: the OMPI_ALLOW_* below)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi
PY=${PY:-.venv/bin/python}; MPI=${MPI:-.venv/bin/mpiexec}; DIR=${1:-/tmp/shard_cuts}
bad=0
run() {  # ranks, options...
  n=$1; shift; rm -rf "$DIR"
  timeout 120 $MPI -n "$n" --oversubscribe --bind-to none $PY -m mpiasgd train --model digits --batch-size 16 \
    --snapshot-interval 0.2 --flush-interval 0.2 --no-progress --comm-timeout 30 --epochs 0 \
    --checkpoint-interval 0.1 --run-dir "$DIR" --name x "$@" > /dev/null 2>&1
  echo "rc $? $*: $($PY dev/shard_cuts.py "$DIR/x.h5" "$DIR/x.ckpt.h5" 2>&1 | tail -1)" || true
  $PY dev/shard_cuts.py "$DIR/x.h5" "$DIR/x.ckpt.h5" > /dev/null 2>&1 || bad=1
}
run 4 --servers 2 --max-time 4
run 5 --servers 3 --max-time 4
run 4 --servers 2 --max-time 4 --mode ssp --staleness-bound 1
run 4 --servers 2 --max-time 4 --mode easgd --easgd-tau 2 --lr 0.05
run 4 --servers 2 --max-time 4 --nsync 2
run 5 --servers 2 --max-time 4 --wire fp16 --eval-interval 1
run 4 --servers 2 --max-pushes 300 --warm-start 1
run 5 --servers 2 --max-time 4 --dc-lambda 0.5 --lookahead -1
exit $bad
