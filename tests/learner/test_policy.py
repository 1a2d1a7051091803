"""In one process (a process group of one): the FSDP2 policy, adapter publishing and DCP checkpoints.

- a published adapter, loaded by peft into a fresh copy of the base (from the wire and from the PEFT dir),
  gives the learner's logits, and vLLM serves the PEFT dir unchanged (marker ``vllm``);
- a checkpoint restores parameters, optimizer, scheduler and RNG so the next step is bit-identical;
- a half-written checkpoint is ignored, and only the newest ``keep`` checkpoints remain.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from loraflow.common import codec, framing
from loraflow.common.config import load_config
from loraflow.common.logprobs import token_logprobs
from loraflow.learner import data, publish
from loraflow.learner.checkpoint import Checkpointer, LearnerState
from loraflow.learner.loss import LossConfig
from loraflow.learner.model import build_policy
from loraflow.learner.parallel import init_parallel
from loraflow.learner.step import make_optimizer, train_step
from tests.learner.scripted import make_batch
from tests.support import child_env


@pytest.fixture(scope="module")
def parallel():
    p = init_parallel("cpu")
    yield p
    p.close()


def make_config(**learner):
    overrides = [f"learner.{k}={json.dumps(v)}" for k, v in learner.items()]
    return load_config(None, ["learner.lora_rank=8", "learner.target_modules=[\"q_proj\",\"v_proj\",\"down_proj\"]",
                              "learner.micro_batch_tokens=64", "learner.warmup_steps=3", *overrides])


def make_trainer(tiny_model_dir: Path, parallel, config):
    policy = build_policy(tiny_model_dir, config.learner, parallel, seed=0)
    return (policy, *make_optimizer(policy, config.learner))


def step_on(trainer, parallel, config, index: int) -> dict:
    policy, optimizer, scheduler = trainer
    batch = data.decode_step_batch(make_batch(7, index, num_groups=2, group_size=4))
    return train_step(policy, optimizer, scheduler, batch, parallel=parallel, config=config,
                      loss_config=LossConfig.from_learner(config.learner))


def adapter(policy) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in publish.gather_adapter(policy, is_main=True)}


def test_published_adapter_gives_the_learners_logits(tiny_model_dir: Path, parallel, tmp_path: Path) -> None:
    config = make_config()
    trainer = make_trainer(tiny_model_dir, parallel, config)
    policy = trainer[0]
    x = torch.randint(0, 259, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = policy.logits(x)
    for index in range(3):
        stats = step_on(trainer, parallel, config, index)
        assert stats["num_tokens"] > 0 and stats["grad_norm"] > 0
    snap = publish.snapshot(policy, version=3, step=3, is_main=True)
    assert snap is not None and snap.num_bytes > 0
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n, _ in snap.tensors)
    assert len(snap.tensors) == 4 * 3 * 2  # 4 layers x 3 target modules x (A, B)
    with torch.no_grad():
        learner_logits = policy.logits(x)
    assert (learner_logits - base_logits).abs().max() > 1e-3  # the adapter moved the policy

    # over the wire: encode, decode, check the checksum, load with set_peft_model_state_dict
    record, envelope = codec.decode(codec.encode(snap.update(), snap.tensors))
    received = {s.name: framing.as_torch(s, envelope.frames[s.frame]).clone() for s in envelope.specs}
    digest = hashlib.sha256()
    for s in envelope.specs:
        digest.update(framing.as_numpy(s, envelope.frames[s.frame]).tobytes())
    assert record.sha256 == digest.hexdigest() == snap.sha256
    fresh = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    peft_model = get_peft_model(fresh, LoraConfig.from_peft_type(**record.adapter_config))
    result = set_peft_model_state_dict(peft_model, received)
    assert not result.unexpected_keys
    with torch.no_grad():
        wire_logits = peft_model(input_ids=x).logits
    torch.testing.assert_close(wire_logits, learner_logits, rtol=0, atol=1e-5)

    # as a PEFT directory, loaded unchanged by PeftModel.from_pretrained
    path = publish.write_adapter_dir(tmp_path / "adapters", snap)
    assert path.name == "v000003" and sorted(p.name for p in path.iterdir()) == sorted(
        [publish.ADAPTER_CONFIG, publish.ADAPTER_WEIGHTS])
    assert [p.name for p in (tmp_path / "adapters").iterdir()] == ["v000003"]  # no temporary dirs left
    on_disk = load_file(str(path / publish.ADAPTER_WEIGHTS))
    assert all(torch.equal(on_disk[n], t) for n, t in snap.tensors)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(path))
    with torch.no_grad():
        dir_logits = loaded(input_ids=x).logits
    torch.testing.assert_close(dir_logits, learner_logits, rtol=0, atol=1e-5)
    assert publish.newest_adapter_version(tmp_path / "adapters") == 3


def test_checkpoint_resume_is_bit_identical(tiny_model_dir: Path, parallel, tmp_path: Path) -> None:
    config = make_config(lora_dropout=0.1)  # dropout draws from the RNG the checkpoint must restore
    checkpointer = Checkpointer(tmp_path / "ckpt", keep=2, parallel=parallel)
    torch.manual_seed(1)
    first = make_trainer(tiny_model_dir, parallel, config)
    state = LearnerState(step=0, version=0)
    for index in range(2):
        step_on(first, parallel, config, index)
        state.step += 1
        state.version += 1
        state.trained_group_ids.update({f"{index}:0", f"{index}:1"})
        checkpointer.save(*first, state)
    stats = step_on(first, parallel, config, 2)
    expected = adapter(first[0])

    torch.manual_seed(12345)  # a fresh process would have another RNG state
    second = make_trainer(tiny_model_dir, parallel, config)
    latest = checkpointer.latest()
    assert latest is not None and latest.name == "step_00000002"
    loaded = checkpointer.load(latest, *second)
    assert (loaded.step, loaded.version, loaded.checkpoint_version) == (2, 2, 2)
    assert loaded.trained_group_ids == {"0:0", "0:1", "1:0", "1:1"}
    # the scheduler resumes mid-warmup: the third step of a 3-step warmup runs at the full lr
    assert second[2].last_epoch == 2 and second[1].param_groups[0]["lr"] == pytest.approx(config.learner.lr)
    resumed_stats = step_on(second, parallel, config, 2)
    got = adapter(second[0])
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert resumed_stats["loss"] == stats["loss"] and resumed_stats["grad_norm"] == stats["grad_norm"]

    # without the restored RNG the dropout masks differ: the comparison above can fail
    third = make_trainer(tiny_model_dir, parallel, config)
    checkpointer.load(latest, *third)
    torch.manual_seed(777)
    step_on(third, parallel, config, 2)
    assert any(not torch.equal(t, expected[n]) for n, t in adapter(third[0]).items())


def test_partial_checkpoints_are_ignored_and_old_ones_pruned(tiny_model_dir: Path, parallel, tmp_path: Path) -> None:
    config = make_config()
    trainer = make_trainer(tiny_model_dir, parallel, config)
    checkpointer = Checkpointer(tmp_path / "ckpt", keep=2, parallel=parallel)
    for step in (1, 2, 3):
        checkpointer.save(*trainer, LearnerState(step=step, version=step))
    assert [p.name for p in checkpointer.complete()] == ["step_00000002", "step_00000003"]
    # a crash mid-save: DCP files without the state file, or a .partial directory
    (tmp_path / "ckpt" / "step_00000004").mkdir()
    (tmp_path / "ckpt" / "step_00000004" / ".metadata").write_bytes(b"half")
    (tmp_path / "ckpt" / "step_00000005.partial").mkdir()
    assert checkpointer.latest().name == "step_00000003"
    checkpointer.clean_partial()
    assert not (tmp_path / "ckpt" / "step_00000005.partial").exists()
    assert checkpointer.load(checkpointer.latest(), *trainer).step == 3


def test_bf16_mixed_precision_computes_in_bf16_with_fp32_master_weights_and_publishes_bf16(tiny_model_dir: Path, parallel) -> None:
    config = make_config(mixed_precision="bf16")
    trainer = make_trainer(tiny_model_dir, parallel, config)
    policy = trainer[0]
    assert policy.compute_dtype == torch.bfloat16
    stats = step_on(trainer, parallel, config, 0)
    assert stats["num_tokens"] > 0 and stats["grad_norm"] > 0 and torch.isfinite(torch.tensor(stats["loss"]))
    with torch.no_grad():
        assert policy.logits(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16
    assert {p.dtype for p in policy.trainable_parameters()} == {torch.float32}  # fp32 master weights
    assert {p.dtype for n, p in policy.model.named_parameters() if not p.requires_grad} == {torch.bfloat16}
    tensors = publish.gather_adapter(policy, is_main=True)
    assert {t.dtype for _, t in tensors} == {torch.bfloat16}  # published in the compute dtype (adapter_dtype=auto)
    assert any(t.abs().max() > 0 for n, t in tensors if "lora_B" in n)
    forced = make_trainer(tiny_model_dir, parallel, make_config(mixed_precision="bf16", adapter_dtype="float32"))[0]
    assert {t.dtype for _, t in publish.gather_adapter(forced, is_main=True)} == {torch.float32}


def test_bf16_with_a_kl_term_trains_from_the_first_step(tiny_model_dir: Path, parallel) -> None:
    """The KL reference forward (adapter disabled) runs before the policy's own, so it is each FSDP2 group's
    first forward, where FSDP2 fixes the mixed-precision reduce dtype from the parameters requiring grad: peft's
    disable_adapter turned those off, and the first backward failed ("assign a gradient with dtype BFloat16 to
    a tensor with grad_dtype Float"). One micro-batch (the default budget), as on a GPU learner."""
    config = make_config(mixed_precision="bf16", kl_beta=0.05, micro_batch_tokens=8192)
    trainer = make_trainer(tiny_model_dir, parallel, config)
    policy = trainer[0]
    with policy.reference():
        assert all(p.requires_grad for p in policy.trainable_parameters())  # the adapter's, still trainable
    kls = []
    for index in range(2):
        stats = step_on(trainer, parallel, config, index)
        assert stats["grad_norm"] > 0 and torch.isfinite(torch.tensor(stats["loss"]))
        kls.append(stats["kl"])
    assert kls[0] == 0 < kls[1]  # the zero-B start is the reference; after one step the policy has moved
    assert {p.grad.dtype for p in policy.trainable_parameters() if p.grad is not None} <= {torch.float32}


ADAPTER_DTYPES = ("float32", "bfloat16")


@pytest.mark.vllm
@pytest.mark.slow
def test_adapter_dir_loads_unchanged_in_vllm(tiny_model_dir: Path, parallel, tmp_path: Path) -> None:
    """vLLM's LoRARequest serves the learner's PEFT directory as peft does: same greedy tokens and log-probs,
    in fp32 and as the bf16 adapter a GPU learner publishes (learner.adapter_dtype). One engine serves both
    directories, each under its own LoRA id, as a worker serves successive versions."""
    paths = []
    for adapter_dtype in ADAPTER_DTYPES:
        config = make_config(lr=0.05, adapter_dtype=adapter_dtype)  # a few large steps: the adapter changes the output
        trainer = make_trainer(tiny_model_dir, parallel, config)
        for index in range(3):
            step_on(trainer, parallel, config, index)
        path = publish.write_adapter_dir(tmp_path / adapter_dtype, publish.snapshot(trainer[0], version=3, step=3,
                                                                                    is_main=True))
        dtypes = {str(t.dtype) for t in load_file(str(path / publish.ADAPTER_WEIGHTS)).values()}
        assert dtypes == {f"torch.{adapter_dtype}"}
        paths.append(path)
    prompts = [[1, 20, 30, 40], [1, 50, 60]]
    script = Path(__file__).with_name("vllm_generate.py")
    done = subprocess.run([sys.executable, str(script), str(tiny_model_dir), json.dumps(prompts), *map(str, paths)],
                          capture_output=True, text=True, timeout=300, env=child_env())
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(lines) == len(paths), done.stderr[-4000:]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    for path, line in zip(paths, lines, strict=True):
        served = json.loads(line.removeprefix("RESULT "))
        reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(path))
        changed = False
        for prompt, out in zip(prompts, served, strict=True):
            ids = torch.tensor([prompt + out["tokens"]])
            with torch.no_grad():
                logits = reference(input_ids=ids).logits[0, len(prompt) - 1:-1]
                base_greedy = base(input_ids=ids).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
            assert logits.argmax(-1).tolist() == out["tokens"], path  # vLLM's greedy choice is peft's at every step
            expected = token_logprobs(logits, torch.tensor(out["tokens"])).tolist()
            assert out["logprobs"] == pytest.approx(expected, abs=1e-4), path
            changed |= base_greedy != out["tokens"]
        assert changed, path  # the adapter was applied, not ignored
