"""Logits only for trained positions (learner/head.py, Policy.trained_logprobs) and the meta-device build.

- the chunked head gives the full-logits numbers of common/logprobs.py (values and gradients, to 1e-5 in fp32)
  for every chunk size and temperature, and its backward keeps no [T, V] tensor;
- on the tiny model, Policy.trained_logprobs equals logits -> select -> token_logprobs, LoRA gradients
  included, with and without activation checkpointing;
- the policy built on the meta device holds exactly the weights of from_pretrained, in the compute dtype,
  with fp32 LoRA parameters; an adapter too large for broker.max_message_bytes is a ConfigError naming both
  settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraflow.common.config import ConfigError, load_config
from loraflow.common.logprobs import token_entropy, token_logprobs
from loraflow.learner import head
from loraflow.learner.model import adapter_message_bytes, build_policy
from loraflow.learner.parallel import init_parallel


@pytest.fixture(scope="module")
def parallel():
    p = init_parallel("cpu")
    yield p
    p.close()


def learner_config(**learner):
    overrides = [f"learner.{k}={json.dumps(v)}" for k, v in learner.items()]
    return load_config(None, ["learner.lora_rank=8", "learner.target_modules=[\"q_proj\",\"v_proj\",\"down_proj\"]",
                              *overrides]).learner


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_full_logits(chunk: int, temperature: float) -> None:
    g = torch.Generator().manual_seed(chunk)
    num_tokens, hidden_size, vocab = 50, 16, 97
    hidden = torch.randn(num_tokens, hidden_size, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=g)
    targets = torch.randint(0, vocab, (num_tokens,), generator=g)
    upstream = torch.randn(num_tokens, generator=g)

    logits = hidden @ weight.T
    want_logp = token_logprobs(logits, targets, temperature)
    want_entropy = token_entropy(logits.detach(), temperature)
    (want_grad,) = torch.autograd.grad((want_logp * upstream).sum(), hidden)

    logp, entropy = head.trained_logprobs(hidden, weight, targets, temperature, chunk=chunk)
    (grad,) = torch.autograd.grad((logp * upstream).sum(), hidden)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-5)
    assert not entropy.requires_grad


def test_chunked_head_keeps_no_full_logits_for_backward() -> None:
    num_tokens, hidden_size, vocab, chunk = 256, 8, 1000, 16
    hidden = torch.randn(num_tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size)
    targets = torch.randint(0, vocab, (num_tokens,))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logp, _ = head.trained_logprobs(hidden, weight, targets, chunk=chunk)
        full_logp = token_logprobs(hidden @ weight.T, targets)
    ours = saved[:3]  # hidden [T, H], targets [T], logsumexp [T]; the head's weight is re-read in backward
    assert max(ours) == num_tokens * hidden_size  # no [T, V] tensor
    assert max(saved[3:]) >= num_tokens * vocab  # what the full-logits path keeps, for contrast
    logp.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    assert torch.allclose(logp, full_logp, atol=1e-5)
    assert head.chunk_tokens(151_936) * 151_936 * 4 <= head.CHUNK_BYTES


def _both_paths(policy, x, select, targets):
    """(logp, entropy, LoRA grads) from the chunked path and from full logits, same inputs."""
    params = policy.trainable_parameters()
    out = []
    for chunked in (True, False):
        if chunked:
            logp, entropy = policy.trained_logprobs(x, select, targets, 0.9)
        else:
            logits = policy.logits(x)[select]
            logp, entropy = token_logprobs(logits, targets, 0.9), token_entropy(logits.detach(), 0.9)
        for p in params:
            p.grad = None
        (logp * torch.linspace(-1, 1, logp.numel())).sum().backward()  # FSDP2 puts the sharded grads in .grad
        out.append((logp.detach(), entropy, [p.grad.full_tensor() for p in params]))
    return out


@pytest.mark.parametrize("checkpointing", ["off", "on"])
def test_policy_trained_logprobs_equals_full_logits(tiny_model_dir: Path, parallel, checkpointing: str) -> None:
    policy = build_policy(tiny_model_dir, learner_config(activation_checkpointing=checkpointing), parallel, seed=0)
    assert policy.activation_checkpointing == (checkpointing == "on")
    with torch.no_grad():  # a non-zero lora_B, so the adapter takes part in the forward pass
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.to_local().normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 259, (3, 17), generator=g)
    select = torch.rand(3, 17, generator=g) > 0.4
    targets = torch.randint(0, 259, (int(select.sum()),), generator=g)
    (logp, entropy, grads), (want_logp, want_entropy, want_grads) = _both_paths(policy, x, select, targets)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert any(w.abs().max() > 0 for w in want_grads)


def test_meta_build_loads_the_checkpoint_weights_in_the_compute_dtype(tiny_model_dir: Path, parallel) -> None:
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).state_dict()
    for setting, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        policy = build_policy(tiny_model_dir, learner_config(mixed_precision=setting), parallel, seed=0)
        frozen = {n: p for n, p in policy.model.named_parameters() if not p.requires_grad}
        base = policy.model.get_base_model()  # the embedding and the head: row-sharded (loraflow.learner.vocab), untied here
        rows = {"model.embed_tokens.weight": base.get_input_embeddings().vocab_rows,
                "lm_head.weight": base.get_output_embeddings().vocab_rows}
        assert len(frozen) + len(rows) == len(reference)
        for key, matrix in rows.items():
            assert matrix.rows.dtype == dtype and torch.equal(matrix.rows, reference[key].to(dtype)), key
        for name, param in frozen.items():
            key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert param.dtype == dtype, name
            assert torch.equal(param.full_tensor(), reference[key].to(dtype)), name
        lora = dict((n, p) for n, p in policy.model.named_parameters() if p.requires_grad)
        assert lora and {p.dtype for p in lora.values()} == {torch.float32}
        assert all(p.full_tensor().abs().max() == 0 for n, p in lora.items() if "lora_B" in n)
        assert all(p.full_tensor().std() > 0 for n, p in lora.items() if "lora_A" in n)
        buffers = dict(policy.model.named_buffers())
        rotary = [b for n, b in buffers.items() if n.endswith("inv_freq")]
        assert rotary and all(torch.isfinite(b).all() and b.max() <= 1 for b in rotary)


def test_an_adapter_larger_than_a_broker_message_is_a_config_error(tiny_model_dir: Path, parallel) -> None:
    learner = learner_config(lora_rank=64, target_modules="all-linear")
    policy = build_policy(tiny_model_dir, learner, parallel, seed=0)
    need = adapter_message_bytes(policy.model, torch.float32)
    lora_bytes = sum(p.numel() * 4 for p in policy.trainable_parameters())
    assert lora_bytes < need < lora_bytes + (1 << 20)
    build_policy(tiny_model_dir, learner, parallel, seed=0, max_message_bytes=need)  # fits exactly
    with pytest.raises(ConfigError, match=r"learner\.lora_rank = 64.*broker\.max_message_bytes = "):
        build_policy(tiny_model_dir, learner, parallel, seed=0, max_message_bytes=need - 1)
    half = adapter_message_bytes(policy.model, torch.bfloat16)
    build_policy(tiny_model_dir, learner_config(lora_rank=64, target_modules="all-linear", adapter_dtype="bfloat16"),
                 parallel, seed=0, max_message_bytes=half)


def test_the_learner_exits_2_when_its_adapter_cannot_fit_a_broker_message(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The check runs at start-up, before connecting (nobody listens on the endpoint) and before any weight loads."""
    import subprocess

    from tests.learner.test_learner_runs import learner_argv
    from tests.support import child_env

    argv = learner_argv(tmp_path / "run", "tcp://127.0.0.1:1", tiny_model_dir, "broker.max_message_bytes=65536")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 2, done.stderr[-3000:]
    assert "learner.lora_rank = 8" in done.stderr and "broker.max_message_bytes = 65536" in done.stderr
    assert "Traceback" not in done.stderr
