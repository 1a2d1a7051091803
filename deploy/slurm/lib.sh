# Sourced by the sbatch templates in deploy/slurm: where the checkout is, where a run's files go, and how a
# role becomes a named job step (started with srun, stopped with `scancel --signal=TERM <job>.<step>`).
#
# sbatch runs a copy of the template from its spool directory, so the checkout is LORAFLOW_HOME (default: the
# directory sbatch was called from, SLURM_SUBMIT_DIR). LORAFLOW_DRY_RUN=1 prints each srun command instead of
# running it (and the role scripts print theirs); the templates then stop after the layout.

: "${LORAFLOW_HOME:=${SLURM_SUBMIT_DIR:-$PWD}}"
[ -x "$LORAFLOW_HOME/deploy/scripts/broker.sh" ] || {
    echo "loraflow slurm: no deploy/scripts/broker.sh under LORAFLOW_HOME=$LORAFLOW_HOME (submit from the checkout," \
         "or export LORAFLOW_HOME=/path/to/loraflow before sbatch)" >&2
    exit 2
}
: "${LORAFLOW_RUN_DIR:=$LORAFLOW_HOME/runs/slurm-${SLURM_JOB_ID:?not inside a Slurm job}}"
: "${LORAFLOW_SLURM_CPUS_PER_WORKER:=1}"
: "${LORAFLOW_SLURM_GPUS_PER_WORKER:=0}"
export LORAFLOW_HOME LORAFLOW_RUN_DIR
LORAFLOW_STEP="$LORAFLOW_HOME/deploy/slurm/step.sh"
LORAFLOW_SLURM_DIR="$LORAFLOW_RUN_DIR/slurm"  # endpoint, worker-jobs/, logs/ (one file per role)
LORAFLOW_LOGS="$LORAFLOW_SLURM_DIR/logs"
mkdir -p "$LORAFLOW_LOGS" "$LORAFLOW_SLURM_DIR/worker-jobs"
STEP_PIDS=()
STEP_PID=""

slurm_log() {
    echo "[$(date -u +%H:%M:%S)] loraflow slurm job $SLURM_JOB_ID: $*" >&2
}

# slurm_step NAME SRUN_OPTION... -- COMMAND...: one job step named NAME in the background, its output in
# logs/NAME.log (appended: a requeued job continues the same files), written by the step's own process
# (LORAFLOW_STEP_LOG, step.sh): a line it logs just before the step is SIGKILLed (scancel) is kept, where
# srun's output forwarding may drop it; its srun pid is appended to STEP_PIDS and is STEP_PID until the next step
slurm_step() {
    local name="$1" opts=()
    shift
    while [ "$1" != "--" ]; do opts+=("$1"); shift; done
    shift
    local cmd=(srun --job-name="$name" --output="$LORAFLOW_LOGS/$name.log" --open-mode=append --kill-on-bad-exit=0
               --export="ALL,LORAFLOW_STEP_LOG=$LORAFLOW_LOGS/$name.log" "${opts[@]}" "$@")
    if [ "${LORAFLOW_DRY_RUN:-0}" = 1 ]; then
        printf '%q ' "${cmd[@]}"
        echo
        return 0
    fi
    "${cmd[@]}" &
    STEP_PID="$!"
    STEP_PIDS+=("$STEP_PID")
}

# slurm_worker NODE INDEX: one rollout worker step on NODE; its worker id is <host>-<job id><index, 2 digits>,
# unique across jobs and stable when Slurm requeues the job (the broker then reclaims its leases at once)
slurm_worker() {
    local node="$1" instance
    instance="${SLURM_JOB_ID}$(printf '%02d' "$2")"
    local gres=()
    [ "$LORAFLOW_SLURM_GPUS_PER_WORKER" != 0 ] && gres=(--gres="gpu:$LORAFLOW_SLURM_GPUS_PER_WORKER")
    slurm_step "worker-$node-$instance" --exact --nodes=1 --ntasks=1 --cpus-per-task="$LORAFLOW_SLURM_CPUS_PER_WORKER" \
        "${gres[@]}" --nodelist="$node" -- "$LORAFLOW_STEP" worker "$instance"
}

# slurm_signal_steps PATTERN: SIGTERM to every running step of this job whose name matches the shell PATTERN
slurm_signal_steps() {
    local id name
    while read -r id name; do
        # shellcheck disable=SC2053 # PATTERN is a glob on purpose
        [[ "$name" == $1 ]] && scancel --signal=TERM "$id" 2>/dev/null  # it may have ended meanwhile
    done < <(squeue --noheader --steps --jobs="$SLURM_JOB_ID" --format='%i %j')
    return 0
}

# slurm_wait PID [ON_STOP...]: wait until that step's srun ended and return its exit code; once the script was
# asked to stop (stopping=1, set by its SIGTERM trap), run ON_STOP first (polls each second: a trap does not
# interrupt a foreground command)
slurm_wait() {
    local pid="$1"
    shift
    while kill -0 "$pid" 2>/dev/null; do
        if [ $# -gt 0 ] && [ "${stopping:-0}" = 1 ]; then
            "$@"
            set --
        fi
        sleep 1
    done
    wait "$pid"
}

slurm_wait_all() {
    local pid
    for pid in "${STEP_PIDS[@]}"; do slurm_wait "$pid" || true; done
    return 0
}

# slurm_stop_worker_jobs: SIGTERM to the batch script of every worker job that joined this run (listed in
# worker-jobs/ by loraflow-workers.sbatch), then wait up to a minute for them to leave the queue
slurm_stop_worker_jobs() {
    local jobs=() job_file
    for job_file in "$LORAFLOW_SLURM_DIR"/worker-jobs/*; do
        [ -e "$job_file" ] || continue
        jobs+=("$(basename "$job_file")")
        scancel --batch --signal=TERM "${jobs[-1]}" 2>/dev/null
    done
    [ "${#jobs[@]}" = 0 ] && return 0
    for _ in $(seq 60); do
        [ -z "$(squeue --noheader --jobs="$(IFS=,; echo "${jobs[*]}")" --format=%i 2>/dev/null)" ] && return 0
        sleep 1
    done
    slurm_log "worker jobs ${jobs[*]} still running after a minute"
}

# slurm_preempted: true when Slurm has selected this job for preemption (it is in its GraceTime)
slurm_preempted() {
    local when
    when="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'PreemptTime=[^ ]*')"
    slurm_log "${when:-PreemptTime unknown}"
    [[ "$when" == PreemptTime=[0-9]* ]]
}

# slurm_endpoint: the broker's address as the steps see it, from $LORAFLOW_SLURM_DIR/endpoint (written by the
# run job once its broker is bound) unless LORAFLOW_ENDPOINT is set
slurm_endpoint() {
    if [ -n "${LORAFLOW_ENDPOINT:-}" ]; then
        echo "$LORAFLOW_ENDPOINT"
        return 0
    fi
    [ -s "$LORAFLOW_SLURM_DIR/endpoint" ] || {
        echo "loraflow slurm: no $LORAFLOW_SLURM_DIR/endpoint: set LORAFLOW_RUN_DIR to the run job's run directory" \
             "(or LORAFLOW_ENDPOINT=tcp://host:port)" >&2
        return 2
    }
    cat "$LORAFLOW_SLURM_DIR/endpoint"
}
