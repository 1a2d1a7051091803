#!/usr/bin/env bash
# The broker (called by loraflow-broker.service).
#
#   LORAFLOW_BIND        where it listens (default tcp://0.0.0.0:5555; port 0 = any free port)
#   LORAFLOW_CONFIG, LORAFLOW_RUN_DIR, LORAFLOW_KEYS_DIR, LORAFLOW_EXTRA_ARGS, LORAFLOW_VENV (see common.sh)
#
# The bound endpoint is written to $LORAFLOW_RUN_DIR/broker/endpoint. SIGTERM: persists its state, exits 0.
set -euo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
: "${LORAFLOW_BIND:=tcp://0.0.0.0:5555}"
loraflow_check
loraflow_common_args ""
loraflow_exec "$LORAFLOW_PYTHON" -m loraflow.broker "${LORAFLOW_ARGS[@]}" \
    --set "broker.bind=\"$LORAFLOW_BIND\"" --set "broker.endpoint_file=\"$LORAFLOW_RUN_DIR/broker/endpoint\""
