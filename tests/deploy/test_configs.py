"""The example configs in deploy/configs parse, validate, and say what their comments promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraflow.common.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
ALL_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_every_example_config_is_there() -> None:
    assert {p.name for p in CONFIGS.glob("*.toml")} >= {"demo.toml", "demo-vllm.toml", "calculator.toml",
                                                         "gpu-example.toml"}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_config_loads_and_validates(path: Path) -> None:
    config = load_config(path)
    assert config.run.name == path.stem
    assert config.capacity_groups >= config.run.groups_per_step


@pytest.mark.parametrize("name", ["demo.toml", "demo-vllm.toml"])
def test_demo_configs_use_the_recipe_that_learned(name: str) -> None:
    """FACTS.md: LoRA r=16 on every projection, lr 1e-3..2e-3, 16 prompts x 8 samples, temperature 1,
    6 new tokens, PPO clip 0.2, token-level loss; on the warmed-up demo base."""
    config = load_config(CONFIGS / name)
    assert config.model.path == "builtin:demo"
    assert config.run.task == "arith"
    assert (config.run.groups_per_step, config.run.group_size) == (16, 8)
    assert config.worker.temperature == 1.0 and config.worker.top_p == 1.0
    assert config.worker.max_new_tokens == 6
    assert config.learner.lora_rank == 16 and set(config.learner.target_modules) == ALL_PROJECTIONS
    assert 1e-3 <= config.learner.lr <= 2e-3
    assert config.learner.clip_eps == 0.2
    assert config.run.max_staleness >= 1  # the demo is the asynchronous mode; 0 is the synchronous one


def test_backends_and_tasks_of_the_examples() -> None:
    assert load_config(CONFIGS / "demo.toml").worker.backend == "hf"
    assert load_config(CONFIGS / "demo-vllm.toml").worker.backend == "vllm"
    calculator = load_config(CONFIGS / "calculator.toml")
    assert calculator.run.task == "calculator" and calculator.worker.max_turns > 1
    gpu = load_config(CONFIGS / "gpu-example.toml")
    assert gpu.worker.backend == "vllm" and gpu.launch.learner_ranks == 2
    assert not gpu.model.path.startswith("builtin:")
    assert gpu.learner.device == "cuda" and gpu.worker.device == "cuda"


def test_demo_run_fits_the_five_minute_target() -> None:
    """The demo stops by itself: a wall-time limit below five minutes, base build included."""
    config = load_config(CONFIGS / "demo.toml")
    assert 0 < config.run.max_duration_s < 300
    assert config.eval.num_prompts == 200 and config.eval.every_s > 0


@pytest.mark.parametrize("path", sorted((CONFIGS / "pool-runs").glob("*.toml")), ids=lambda p: p.name)
def test_example_run_files_fit_the_demo_pool(path: Path) -> None:
    """The run files README.md submits to a pool of the demo config set only what a run may set."""
    from loraflow.common import pool_runs

    config = pool_runs.run_config(load_config(CONFIGS / "demo.toml"), "example", pool_runs.read_settings(path))
    assert (config.run.pool_run, config.model.path) == ("example", "builtin:demo")
