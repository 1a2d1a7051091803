#!/usr/bin/env bash
# One rollout worker (called by loraflow-worker@N.service as `worker.sh N`).
#
#   worker.sh INSTANCE   the worker id is <short hostname>-INSTANCE, stable across restarts of the unit
#   LORAFLOW_ENDPOINT    the broker's address (tcp://broker-host:5555)
#   LORAFLOW_WORKER_GPUS  e.g. 0,1,2,3: instance N runs on GPU number N-1 of this list (modulo its length)
#                         via CUDA_VISIBLE_DEVICES, so loraflow-worker@{1..4} spread over four GPUs (optional)
#   LORAFLOW_CONFIG, LORAFLOW_RUN_DIR, LORAFLOW_KEYS_DIR, LORAFLOW_EXTRA_ARGS, LORAFLOW_VENV (see common.sh)
#
# SIGTERM: returns unfinished leases to the broker, waits for acks of submitted groups, exits 0.
set -euo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ] || [ $# -ne 1 ]; then
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    [ $# -eq 1 ] && exit 0
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
loraflow_check
loraflow_common_args "${LORAFLOW_WORKER_KEY:-worker}"
[[ "$1" =~ ^[0-9]+$ ]] || loraflow_die "the instance must be a number (loraflow-worker@N), got '$1'"
args=(--endpoint "$LORAFLOW_ENDPOINT" --worker-id "$(hostname -s)-$1")
if [ -n "${LORAFLOW_WORKER_GPUS:-}" ]; then
    IFS=, read -r -a gpus <<< "$LORAFLOW_WORKER_GPUS"
    export CUDA_VISIBLE_DEVICES="${gpus[$(( ($1 - 1) % ${#gpus[@]} ))]}"
fi
loraflow_exec "$LORAFLOW_PYTHON" -m loraflow.rollout_worker "${LORAFLOW_ARGS[@]}" "${args[@]}"
