"""The demo to its held-out target: ``loraflow run`` against TRL's GRPOTrainer in one process, same base and data.

Needs TRL (``pip install -e '.[peer]'``); installs nothing itself. For each seed, on the cached demo base of that
seed (deploy/demo_base.py; built before either side starts, so neither pays for it):

- loraflow: ``loraflow run`` on the demo config (2 hf workers, the learner, the broker), a PEFT adapter every
  ``--adapter-every`` versions, no evaluation during the run;
- TRL: ``GRPOTrainer`` in its own process with the demo's recipe: LoRA r16 alpha 32 on every projection, 16 prompts
  x 8 samples a step, the same learning rate, AdamW settings and gradient clip, temperature 1, top_k off, the
  same max new tokens, no KL (beta 0), a constant schedule, PPO clip 0.2, token-level loss, group-std scaled
  advantages, one update per generation; the reward is the demo task's score, which needs the end-of-sequence
  token (a completion cut off at max new tokens scores 0, as in loraflow). Its adapter is saved every
  ``--adapter-every`` steps from a callback (on its clock, as loraflow's adapter writes are on loraflow's).

Afterwards one greedy held-out evaluation (deploy/evaluate.py, ``--num-prompts`` prompts) scores both sides'
adapters in order, off both clocks. Per seed and as the median: training wall to the first adapter at
``--target`` (from the side's pipeline being up: loraflow's learner and a worker past start-up, TRL's first
step), samples to it, and start-up apart (process start to that point). loraflow's step timeline (learner wait /
compute / publish, adapter publish -> loaded in a worker, worker busy shares) is printed beside it.

Last line: value = loraflow's median training seconds, reference = TRL's, ``ratio`` = median over seeds of
loraflow / TRL (< 1: loraflow is faster), ``samples_ratio``, ``startup_s_loraflow``, ``startup_s_trl``.

    .venv/bin/python -m bench.vs_trl [--seeds 0,1,2] [--target 0.9] [--max-steps 100] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import accuracy_runs as runs
from bench import harness
from loraflow.common.config import load_config


def trl_child(config_path: Path, base: Path, out: Path, steps: int, adapter_every: int) -> None:
    """GRPOTrainer on the resolved loraflow config's recipe; writes ``out/result.json`` (times, samples, adapters)."""
    started_unix = time.time()
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from loraflow.common.tasks import load_task

    config = load_config(config_path)
    run, learner, worker = config.run, config.learner, config.worker
    torch.manual_seed(run.seed)
    task = load_task(run.task, run.seed, config.data)
    items = [task.item(i, "train") for i in range(steps * run.groups_per_step)]
    dataset = Dataset.from_list([{"prompt": item.prompt, "answer": item.answer} for item in items])
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    eos_ids = {tokenizer.eos_token_id, *([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])}

    def task_reward(completions: list[str], completion_ids: list[list[int]], answer: list[str],
                    **_: object) -> list[float]:
        return [task.score(text, want, finished=bool(ids) and ids[-1] in eos_ids)
                for text, ids, want in zip(completions, completion_ids, answer, strict=True)]

    samples_per_step = run.groups_per_step * run.group_size
    args = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, seed=run.seed, max_steps=steps,
        per_device_train_batch_size=samples_per_step, gradient_accumulation_steps=1, num_generations=run.group_size,
        learning_rate=learner.lr, weight_decay=learner.weight_decay, adam_epsilon=learner.adam_eps,
        max_grad_norm=learner.grad_clip or 1e9, lr_scheduler_type="constant", warmup_steps=0,
        temperature=worker.temperature, top_k=0, top_p=1.0, max_completion_length=worker.max_new_tokens,
        beta=0.0, epsilon=learner.clip_eps, loss_type="dapo", num_iterations=1,
        scale_rewards="group" if learner.scale_by_std else "none", logging_steps=1, save_strategy="no",
        report_to="none", remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
    lora = LoraConfig(r=learner.lora_rank, lora_alpha=learner.lora_alpha, lora_dropout=learner.lora_dropout,
                      target_modules=list(learner.target_modules), task_type="CAUSAL_LM")
    record: dict[str, object] = {"steps": [], "adapters": {}}

    class Timeline(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            record.setdefault("first_step_unix", time.time())

        def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
            version = state.global_step
            if version % adapter_every == 0:
                path = out / "adapters" / f"v{version}"
                model.save_pretrained(path)
                record["adapters"][str(version)] = str(path)
            record["steps"].append({"version": version, "time_unix": time.time(), "num_samples": samples_per_step})

    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[Timeline()])
    trainer.train()
    first = record.pop("first_step_unix")
    record.update(started_unix=first, startup_s=first - started_unix, torch_threads=torch.get_num_threads())
    (out / "result.json").write_text(json.dumps(record))


def trl_side(config_path: Path, base: Path, out: Path, args: argparse.Namespace) -> runs.Side:
    command = [sys.executable, "-m", "bench.vs_trl", "--trl-child", str(config_path), str(base), str(out),
               "--max-steps", str(args.max_steps), "--adapter-every", str(args.adapter_every)]
    return runs.child_side("TRL GRPOTrainer", command, out, args.max_duration + 600)[0]


def main() -> None:
    parser = runs.race_parser(__doc__)
    parser.add_argument("--trl-child", nargs=3, metavar=("CONFIG", "BASE", "OUT"), help=argparse.SUPPRESS)
    args = harness.parse(parser, None, seeds="0", max_steps=4, target=0.0, adapter_every=2, num_prompts=20)
    if args.trl_child:
        trl_child(Path(args.trl_child[0]), Path(args.trl_child[1]), Path(args.trl_child[2]), args.max_steps,
                  args.adapter_every)
        return
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("bench/vs_trl.py needs TRL: pip install -e '.[peer]'") from None
    races = runs.race(args, lambda run_dir, tmp, seed, base: trl_side(run_dir / "config.toml", base,
                                                                      tmp / f"trl-{seed}", args))
    runs.print_races(races, "TRL")
    runs.race_report("vs_trl", races, args.target, "trl",
                     startup_s_loraflow=round(runs.median_of(races, lambda r: r.ours.startup_s), 2),
                     startup_s_trl=round(runs.median_of(races, lambda r: r.peer.startup_s), 2),
                     loraflow_timeline=runs.median_breakdown([r.ours for r in races]))

if __name__ == "__main__":
    main()
