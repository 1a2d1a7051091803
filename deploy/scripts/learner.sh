#!/usr/bin/env bash
# The learner (called by loraflow-learner.service): one process, or torchrun ranks on one or several nodes.
#
#   LORAFLOW_ENDPOINT          the broker's address (rank 0 talks to it)
#   LORAFLOW_LEARNER_NPROC     ranks on this node (default 1; >1 or several nodes: torchrun)
#   LORAFLOW_LEARNER_NNODES    nodes (default 1); with more, also set on every node:
#   LORAFLOW_LEARNER_NODE_RANK   this node's rank (0 = the node whose rank 0 talks to the broker)
#   LORAFLOW_RDZV_ENDPOINT       host:port of node 0 for torchrun's c10d rendezvous (e.g. learner-0:29500)
#   LORAFLOW_LEARNER_GPUS      e.g. 4,5,6,7: CUDA_VISIBLE_DEVICES of the learner's ranks (optional)
#   LORAFLOW_CONFIG, LORAFLOW_RUN_DIR, LORAFLOW_KEYS_DIR, LORAFLOW_EXTRA_ARGS, LORAFLOW_VENV (see common.sh)
#
# Resumes from the newest checkpoint in $LORAFLOW_RUN_DIR/learner/checkpoints. SIGTERM: finishes the step,
# publishes and writes the last adapter, checkpoints, exits 0. Exits 2 on a config error and 4 when another
# learner took over the run (also under torchrun, which itself would say 1).
set -euo pipefail
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
: "${LORAFLOW_LEARNER_NPROC:=1}"
: "${LORAFLOW_LEARNER_NNODES:=1}"
: "${LORAFLOW_LEARNER_NODE_RANK:=0}"
: "${LORAFLOW_RDZV_ENDPOINT:=}"
loraflow_check
[ -n "${LORAFLOW_LEARNER_GPUS:-}" ] && export CUDA_VISIBLE_DEVICES="$LORAFLOW_LEARNER_GPUS"
loraflow_common_args "${LORAFLOW_LEARNER_KEY:-learner}"
args=("${LORAFLOW_ARGS[@]}" --endpoint "$LORAFLOW_ENDPOINT")
if [ "$LORAFLOW_LEARNER_NPROC" = 1 ] && [ "$LORAFLOW_LEARNER_NNODES" = 1 ]; then
    loraflow_exec "$LORAFLOW_PYTHON" -m loraflow.learner "${args[@]}"
fi
if [ "$LORAFLOW_LEARNER_NNODES" = 1 ]; then
    loraflow_exec_keeping_exit_code "$LORAFLOW_PYTHON" -m torch.distributed.run --standalone --local-addr=127.0.0.1 \
        --nproc_per_node="$LORAFLOW_LEARNER_NPROC" -m loraflow.learner "${args[@]}"
fi
[ -n "$LORAFLOW_RDZV_ENDPOINT" ] || loraflow_die "LORAFLOW_LEARNER_NNODES=$LORAFLOW_LEARNER_NNODES needs LORAFLOW_RDZV_ENDPOINT (host:port of node 0)"
loraflow_exec_keeping_exit_code "$LORAFLOW_PYTHON" -m torch.distributed.run --nnodes="$LORAFLOW_LEARNER_NNODES" \
    --nproc_per_node="$LORAFLOW_LEARNER_NPROC" --node_rank="$LORAFLOW_LEARNER_NODE_RANK" \
    --rdzv_backend=c10d --rdzv_endpoint="$LORAFLOW_RDZV_ENDPOINT" --rdzv_id=loraflow-learner \
    -m loraflow.learner "${args[@]}"
