"""One frozen base under several runs' policies (learner/model.py SharedBase, the pool learner's):

- the second policy built over a base holds the first one's tensors (the same storage, the embedding rows too),
  not a copy, never writes them (another run's backward may be using them), and builds its own LoRA tensors: a
  different rank and targets per run;
- each policy computes exactly what a policy built alone computes (log-probs and LoRA gradients), so a run
  trains the same in a pool learner as in its own;
- an optimizer step of one run changes neither the shared base nor the other run's outputs;
- a base of another model, or a policy built over a shared base on several ranks, is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loraflow.common.config import load_config
from loraflow.learner.model import SharedBase, build_policy
from tests.learner.test_trained_logits import parallel  # noqa: F401, F811  (the one-rank group, as a fixture)


def learner_config(**learner):
    overrides = [f"learner.{k}={json.dumps(v)}" for k, v in learner.items()]
    return load_config(None, ["learner.lora_rank=8", 'learner.target_modules=["q_proj","v_proj"]', *overrides]).learner


def batch(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 259, (3, 17), generator=g)
    select = torch.rand(3, 17, generator=g) > 0.4
    return x, select, torch.randint(0, 259, (int(select.sum()),), generator=g)


def nonzero_b(policy, seed: int) -> None:
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.to_local().normal_(0, 0.05, generator=torch.Generator().manual_seed(seed + len(name)))


def logprobs_and_grads(policy):
    x, select, targets = batch()
    params = policy.trainable_parameters()
    for p in params:
        p.grad = None
    logp, _ = policy.trained_logprobs(x, select, targets, 1.0)
    (logp * torch.linspace(-1, 1, logp.numel())).sum().backward()
    return logp.detach(), [p.grad.full_tensor() for p in params]


def test_runs_share_one_base_and_compute_as_alone(tiny_model_dir: Path, parallel) -> None:  # noqa: F811
    shared = SharedBase(tiny_model_dir)
    first = build_policy(tiny_model_dir, learner_config(), parallel, seed=1, shared=shared)
    writes = {name: p._version for name, p in shared.parameters.items()}
    second = build_policy(tiny_model_dir, learner_config(lora_rank=4, target_modules=["q_proj", "down_proj"]),
                          parallel, seed=2, shared=shared)
    assert shared.held_by(first.model) and shared.held_by(second.model)
    # building never writes the base: a write while another run's backward holds it fails that backward
    assert {name: p._version for name, p in shared.parameters.items()} == writes
    frozen = {n: p for n, p in second.model.named_parameters() if not p.requires_grad}
    assert frozen and all(isinstance(p, torch.Tensor) and not p.is_meta for p in frozen.values())
    embedding = second.model.get_base_model().get_input_embeddings().vocab_rows
    assert embedding is first.model.get_base_model().get_input_embeddings().vocab_rows
    assert {p.shape[0] for n, p in second.model.named_parameters() if "lora_A" in n} == {4}

    alone = build_policy(tiny_model_dir, learner_config(lora_rank=4, target_modules=["q_proj", "down_proj"]),
                         parallel, seed=2)
    for policy in (second, alone):
        nonzero_b(policy, seed=7)
    (logp, grads), (want_logp, want_grads) = logprobs_and_grads(second), logprobs_and_grads(alone)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)

    nonzero_b(first, seed=11)
    before_first, _ = logprobs_and_grads(first)
    base_before = {n: p.detach().clone() for n, p in frozen.items()}
    optimizer = torch.optim.AdamW(second.trainable_parameters(), lr=1e-2)
    logprobs_and_grads(second)
    optimizer.step()
    after_first, _ = logprobs_and_grads(first)
    torch.testing.assert_close(after_first, before_first, rtol=0, atol=0)  # run 2's step is not run 1's
    assert all(torch.equal(p, base_before[n]) for n, p in frozen.items())
    assert not torch.equal(logprobs_and_grads(second)[0], logp)


def test_a_shared_base_refuses_another_model(tiny_model_dir: Path, tmp_path: Path, parallel) -> None:  # noqa: F811
    shared = SharedBase(tiny_model_dir)
    with pytest.raises(ValueError, match="shared base is"):
        build_policy(tmp_path, learner_config(), parallel, seed=0, shared=shared)
