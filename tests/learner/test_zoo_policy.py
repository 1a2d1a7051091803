"""The learner's sharded policy on every model_zoo family equals the model transformers loads from the same
directory: tied output heads (Qwen2, Gemma) share the embedding, biases and q/k norms are loaded, the LoRA starts
at zero (the policy starts as the base)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraflow.common.config import load_config
from loraflow.learner.model import build_policy
from loraflow.learner.parallel import init_parallel


@pytest.fixture(scope="module")
def parallel():
    p = init_parallel("cpu")
    yield p
    p.close()


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "gemma"])
def test_the_policy_is_the_base_model(zoo_model, parallel, family: str) -> None:
    model_dir = zoo_model(family)
    config = load_config(None, ['learner.target_modules="all-linear"', "learner.lora_rank=4"])
    policy = build_policy(model_dir, config.learner, parallel, seed=0)
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    x = torch.randint(0, reference.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(policy.logits(x), reference(input_ids=x).logits, rtol=0, atol=1e-5)
