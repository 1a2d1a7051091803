"""`loraflow run` of the GSM8K-style example config, as written, on a realistic random instruct model.

The config's conversational prompts (with its system prompt) go through a Qwen2-family model's own chat
template, its two TRL-style built-in rewards score every group, and the learner trains all-linear LoRA. A random
model learns nothing here; what is checked is the plumbing: steps complete with both reward components in
metrics.jsonl, every trained prompt exactly once, the held-out evaluation ran at both ends, and the final
adapter is a PEFT directory of the model's linear layers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from loraflow.deploy import rundir
from tests.e2e.accounting import check_exactly_once, read_run
from tests.support import REPO, Processes, wait_for

pytestmark = pytest.mark.slow

NUM_STEPS = 3


def test_the_gsm8k_example_config_runs_on_an_instruct_model(procs: Processes, tmp_path: Path, zoo_model) -> None:
    model_dir = zoo_model("qwen2")
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "loraflow.deploy.cli", "run", str(REPO / "deploy/configs/gsm8k.toml"), "--model", str(model_dir),
            "--run-dir", str(run_dir), "--num-steps", str(NUM_STEPS),
            # shorter than the example's 160 tokens, and fewer held-out prompts: the plumbing, in seconds
            "--set", "worker.max_new_tokens=12", "--set", "worker.chunk_tokens=12", "--set", "eval.num_prompts=4",
            "--set", "launch.progress_every_s=1"]
    launcher = procs.spawn("launcher", argv)  # from the repository root, as the config's comment says
    wait_for(lambda: not launcher.alive(), 300, "loraflow run of gsm8k.toml to finish", procs)
    out = launcher.log()
    assert launcher.popen.returncode == 0, out + procs.logs()
    assert "base accuracy: " in out and "final accuracy: " in out

    steps = rundir.read_jsonl(rundir.metrics_path(run_dir))
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    for step in steps:
        assert set(step["reward_components"]) == {"exact_match", "format"}, step
    check_exactly_once(read_run(run_dir))

    evals = rundir.read_jsonl(run_dir / "evals.jsonl")
    assert {"base", "final"} <= {e["kind"] for e in evals} and all(0 <= e["accuracy"] <= 1 for e in evals)
    adapter_config = json.loads((run_dir / "final_adapter" / "adapter_config.json").read_text())
    assert set(adapter_config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"}
