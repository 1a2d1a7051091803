"""Adapters and reference computations for the worker tests: what a learner would publish, and what a plain
transformers forward pass says the right tokens and log-probs are."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from msgspec.structs import replace

from loraflow.common import codec
from loraflow.common.framing import Envelope, frames_sha256
from loraflow.common.logprobs import token_logprobs
from loraflow.common.protocol import AdapterUpdate, PromptLease
from loraflow.rollout_worker.adapters import AdapterStore, ReceivedAdapter


@dataclass
class Adapter:
    """A LoRA adapter as a learner would publish it, plus its decoded form as a worker receives it."""

    update: AdapterUpdate
    envelope: Envelope
    config: dict[str, Any]
    state: dict[str, torch.Tensor]
    frames: list[Any]


def make_adapter(model_dir: Path, version: int, seed: int, *, rank: int = 8, alpha: float = 64.0,
                 dtype: torch.dtype = torch.float32,
                 target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                    "up_proj", "down_proj")) -> Adapter:
    """Random non-zero LoRA weights (large enough to change greedy output) as an AdapterUpdate message."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = get_peft_model(base, config)
    state = {k: v.detach().to(dtype).contiguous() for k, v in get_peft_model_state_dict(model).items()}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        config_dict = json.loads((Path(tmp) / "adapter_config.json").read_text())
    tensors = list(state.items())
    frames = codec.encode(AdapterUpdate(version=version, sha256="", adapter_config={}), tensors)
    sha = frames_sha256(frames[2:])
    update = AdapterUpdate(version=version, sha256=sha, adapter_config=config_dict, step=version)
    frames = codec.encode(update, tensors)
    record, envelope = codec.decode([bytes(f) for f in frames])
    return Adapter(update=record, envelope=envelope, config=config_dict, state=state, frames=frames)


class Reference:
    """A plain transformers (+ peft) model: the ground truth for tokens and log-probs."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model_dir = model_dir
        self.base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def model(self, adapter: Adapter | None) -> Any:
        if adapter is None:
            return self.base
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
        config = LoraConfig(**{k: v for k, v in adapter.config.items() if k in LoraConfig.__dataclass_fields__})
        model = get_peft_model(base, config)
        set_peft_model_state_dict(model, {k: v.float() for k, v in adapter.state.items()})
        return model.eval()

    @torch.inference_mode()
    def logprobs(self, adapter: Adapter | None, prompt: list[int], completion: list[int],
                 temperature: float = 1.0) -> list[float]:
        ids = torch.tensor([prompt + completion])
        logits = self.model(adapter)(ids).logits[:, len(prompt) - 1:-1]
        return token_logprobs(logits, torch.tensor([completion]), temperature)[0].tolist()

    @torch.inference_mode()
    def greedy(self, adapter: Adapter | None, prompt: list[int], num_tokens: int, eos_token_id: int) -> list[int]:
        model = self.model(adapter)
        ids = list(prompt)
        for _ in range(num_tokens):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token == eos_token_id:
                break
        return ids[len(prompt):]


def lease(group_id: str = "0:0", *, prompt: str = "12+34=", answer: str = "46", task: str = "arith",
          group_size: int = 2, meta: dict[str, Any] | None = None) -> PromptLease:
    return PromptLease(lease_id=f"lease-{group_id}", group_id=group_id, prompt_index=0, epoch=0, task=task,
                       prompt=prompt, answer=answer, meta=meta or {}, group_size=group_size, deadline_s=60.0)


def receive(store: AdapterStore, adapter: Adapter, version: int | None = None) -> ReceivedAdapter:
    """What the worker's session does with an AdapterUpdate: verify and write it (optionally as another version)."""
    update = adapter.update if version is None else replace(adapter.update, version=version)
    return store.receive(update, adapter.envelope.specs, adapter.envelope.frames)
