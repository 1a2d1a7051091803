#!/usr/bin/env bash
# One task of a loraflow Slurm job step: maps the task's Slurm environment to the settings of the role script
# the systemd units use (deploy/scripts), then becomes it.
#
#   step.sh broker            deploy/scripts/broker.sh
#   step.sh learner           deploy/scripts/learner.sh, node rank = this task's rank (one task per node)
#   step.sh worker INSTANCE   deploy/scripts/worker.sh INSTANCE
set -euo pipefail
# the step's output straight into its log (slurm_step names it): this process writes it, so nothing waits in
# srun's forwarding when the step is killed
[ -n "${LORAFLOW_STEP_LOG:-}" ] && exec >>"$LORAFLOW_STEP_LOG" 2>&1
scripts="$(cd "$(dirname "${BASH_SOURCE[0]}")/../scripts" && pwd)"
case "${1:-}" in
    broker) exec "$scripts/broker.sh" ;;
    learner)
        export LORAFLOW_LEARNER_NODE_RANK="${SLURM_PROCID:-0}"
        exec "$scripts/learner.sh" ;;
    worker) exec "$scripts/worker.sh" "${2:?step.sh worker INSTANCE}" ;;
    *) echo "usage: step.sh broker | learner | worker INSTANCE" >&2; exit 2 ;;
esac
