#!/usr/bin/env bash
# One rollout worker (called by loraflow-worker@N.service as `worker.sh N`).
#
#   worker.sh INSTANCE   the worker id is <short hostname>-INSTANCE, stable across restarts of the unit
#   LORAFLOW_ENDPOINT    the broker's address (tcp://broker-host:5555)
#   LORAFLOW_WORKER_DEVICE  e.g. cuda:1 (optional; default from the config, worker.device)
#   LORAFLOW_CONFIG, LORAFLOW_RUN_DIR, LORAFLOW_KEYS_DIR, LORAFLOW_EXTRA_ARGS, LORAFLOW_VENV (see common.sh)
#
# SIGTERM: returns unfinished leases to the broker, waits for acks of submitted groups, exits 0.
set -euo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ] || [ $# -ne 1 ]; then
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
    [ $# -eq 1 ] && exit 0
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
loraflow_check
loraflow_common_args "${LORAFLOW_WORKER_KEY:-worker}"
args=(--endpoint "$LORAFLOW_ENDPOINT" --worker-id "$(hostname -s)-$1")
[ -n "${LORAFLOW_WORKER_DEVICE:-}" ] && args+=(--device "$LORAFLOW_WORKER_DEVICE")
loraflow_exec "$LORAFLOW_PYTHON" -m rollout_worker "${LORAFLOW_ARGS[@]}" "${args[@]}"
