"""The trainable policy: a frozen Hugging Face causal LM with a peft LoRA adapter, sharded with FSDP2.

- The base is loaded in float32 and frozen. It is the master copy; the LoRA tensors are trained, checkpointed
  and published in float32 too.
- The adapter is ``peft.LoraConfig(r, lora_alpha, lora_dropout, target_modules)``: ``lora_A`` is drawn from a
  seeded generator (identical on every rank before sharding), ``lora_B`` starts at zero, so the untrained
  policy is exactly the base model: version 0. ``target_modules`` is checked against the model (built on the
  meta device) before its weights load, and ``"all-linear"`` expanded (:mod:`common.lora_targets`): a name
  that selects nothing, an embedding or the output head is a config error (exit 2).
- FSDP2: ``fully_shard`` on each decoder layer (the classes the model lists in ``_no_split_modules``), then on
  the root, over the 1-D mesh of :mod:`learner.parallel`. Frozen and trainable parameters share a group.
- Mixed precision: ``auto`` computes in bf16 (fp32 gradient reduction) on GPUs that support it, fp32 elsewhere;
  ``bf16`` forces it (it works on CPU too, slowly); ``fp32`` turns it off.
- The reference policy for the KL penalty is the same model with the adapter disabled (:meth:`Policy.reference`),
  so no second copy of the base is held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from common.config import LearnerConfig
from common.lora_targets import check_model_dir
from learner.parallel import Parallel


@dataclass(slots=True)
class Policy:
    """The sharded peft model and what publishing and checkpointing need to know about it."""

    model: nn.Module  # the PeftModel, wrapped by fully_shard (an FSDPModule)
    lora_config: LoraConfig
    model_dir: Path
    compute_dtype: torch.dtype
    vocab_size: int

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] int64 -> logits [B, L, V] (compute dtype)."""
        return self.model(input_ids=input_ids, use_cache=False).logits

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The base policy: the adapter disabled for the duration (the KL reference)."""
        peft_model: PeftModel = self.model  # type: ignore[assignment]
        with peft_model.disable_adapter():
            yield


def resolve_compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """learner.mixed_precision -> the dtype forward/backward run in."""
    if setting == "bf16":
        return torch.bfloat16
    if setting == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def lora_config_for(learner: LearnerConfig, model_dir: Path, target_modules: list[str]) -> LoraConfig:
    """The adapter's peft config; ``target_modules`` as :func:`common.lora_targets.check_model_dir` resolved them."""
    return LoraConfig(r=learner.lora_rank, lora_alpha=learner.lora_alpha, lora_dropout=learner.lora_dropout,
                      target_modules=target_modules, task_type="CAUSAL_LM", bias="none",
                      base_model_name_or_path=str(model_dir))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks FSDP2 shards one by one: modules of the classes in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (its _no_split_modules is "
                         f"{sorted(names)}); loraflow shards models whose blocks are listed there")
    return layers


def build_policy(model_dir: Path, learner: LearnerConfig, parallel: Parallel, *, seed: int) -> Policy:
    """Load the base, add the LoRA adapter (seeded), shard with FSDP2; identical on every rank."""
    from transformers import AutoModelForCausalLM

    target_modules = check_model_dir(learner.target_modules, model_dir)  # before any weight is read
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    base.config.use_cache = False
    base.requires_grad_(False)
    layers = decoder_layers(base)
    lora_config = lora_config_for(learner, model_dir, target_modules)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, lora_config)
    model.to(parallel.device)
    compute_dtype = resolve_compute_dtype(learner.mixed_precision, parallel.device)
    options: dict = {"mesh": parallel.mesh}
    if compute_dtype != torch.float32:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return Policy(model=model, lora_config=lora_config, model_dir=model_dir, compute_dtype=compute_dtype,
                  vocab_size=int(base.config.vocab_size))
