# Sourced by broker.sh, worker.sh and learner.sh: defaults, checks, and the arguments every role shares.
# Every setting comes from the environment (systemd: EnvironmentFile=/etc/loraflow/loraflow.env; by hand:
# `set -a; . deploy/systemd/loraflow.env; set +a`). LORAFLOW_DRY_RUN=1 prints the command instead of running it.

: "${LORAFLOW_HOME:=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
: "${LORAFLOW_VENV:=$LORAFLOW_HOME/.venv}"
: "${LORAFLOW_CONFIG:=$LORAFLOW_HOME/deploy/configs/demo.toml}"
: "${LORAFLOW_RUN_DIR:=/var/lib/loraflow/run}"
: "${LORAFLOW_ENDPOINT:=tcp://127.0.0.1:5555}"
: "${LORAFLOW_KEYS_DIR:=}"
: "${LORAFLOW_EXTRA_ARGS:=}"

LORAFLOW_PYTHON="$LORAFLOW_VENV/bin/python"

loraflow_die() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

loraflow_check() {
    [ -x "$LORAFLOW_PYTHON" ] || loraflow_die "no Python at $LORAFLOW_PYTHON (set LORAFLOW_VENV, or run 'make venv' in $LORAFLOW_HOME)"
    [ -f "$LORAFLOW_CONFIG" ] || loraflow_die "config file $LORAFLOW_CONFIG does not exist (set LORAFLOW_CONFIG)"
    if [ -n "$LORAFLOW_KEYS_DIR" ] && [ ! -d "$LORAFLOW_KEYS_DIR" ]; then
        loraflow_die "LORAFLOW_KEYS_DIR=$LORAFLOW_KEYS_DIR is not a directory (make one with 'loraflow keys DIR')"
    fi
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
}

# loraflow_args ROLE_KEY: the config file, run dir, and CURVE settings (client key name ROLE_KEY) as "$@"
loraflow_common_args() {
    local client_key="$1"
    LORAFLOW_ARGS=("$LORAFLOW_CONFIG" --run-dir "$LORAFLOW_RUN_DIR")
    if [ -n "$LORAFLOW_KEYS_DIR" ]; then
        LORAFLOW_ARGS+=(--set security.enabled=true --set "security.keys_dir=\"$LORAFLOW_KEYS_DIR\"")
        [ -n "$client_key" ] && LORAFLOW_ARGS+=(--set "security.client_key=\"$client_key\"")
    fi
    # shellcheck disable=SC2206 # word splitting of the extra arguments is intended
    [ -n "$LORAFLOW_EXTRA_ARGS" ] && LORAFLOW_ARGS+=($LORAFLOW_EXTRA_ARGS)
    return 0
}

loraflow_exec() {
    if [ "${LORAFLOW_DRY_RUN:-0}" = 1 ]; then
        [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && printf 'CUDA_VISIBLE_DEVICES=%s ' "$CUDA_VISIBLE_DEVICES"
        printf '%q ' "$@"
        echo
        exit 0
    fi
    exec "$@"
}

# loraflow_exec_keeping_exit_code CMD...: run CMD (torchrun) to its end and exit with its code, except that a
# learner rank's own 2 (config error) or 4 (replaced by another learner), which torchrun reports as 1, is
# passed on: systemd must not restart either (RestartPreventExitStatus=2 4). A SIGTERM or ctrl-C reaches CMD
# too (systemd signals every process of the unit; the terminal its process group); this shell waits for it.
loraflow_exec_keeping_exit_code() {
    [ "${LORAFLOW_DRY_RUN:-0}" = 1 ] && loraflow_exec "$@"
    local code_file code=0 own
    code_file="$(mktemp "${TMPDIR:-/tmp}/loraflow-exit.XXXXXX")"
    trap ':' TERM INT
    LORAFLOW_EXIT_CODE_FILE="$code_file" "$@" || code=$?
    own="$(cat "$code_file" 2>/dev/null || true)"
    rm -f "$code_file"
    if [ "$code" != 0 ] && { [ "$own" = 2 ] || [ "$own" = 4 ]; }; then
        echo "$(basename "$0"): a learner rank exited with $own (torchrun reported $code)" >&2
        code="$own"
    fi
    exit "$code"
}
