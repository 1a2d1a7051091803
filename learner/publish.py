"""Adapter out: the LoRA tensors gathered to rank 0, named as PEFT names them, checksummed, written atomically.

Publishing version v+1 (every ``learner.publish_every`` steps):

1. every rank: ``get_model_state_dict(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)``
   all-gathers only the trainable (LoRA) tensors; rank 0 receives them on the CPU, other ranks nothing.
   The base model never moves.
2. rank 0: ``peft.get_peft_model_state_dict`` maps them to PEFT names
   (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), the names
   ``PeftModel.from_pretrained``, ``set_peft_model_state_dict`` and vLLM's LoRA loader expect.
3. :class:`AdapterSnapshot` -> ``AdapterUpdate`` (PEFT names, ``adapter_config.json`` contents, sha256 over the
   tensor bytes in order) sent through the broker to every worker.
4. every ``learner.save_adapter_every`` versions (and at the end), :func:`write_adapter_dir` writes
   ``<run_dir>/learner/adapters/v000012/{adapter_config.json, adapter_model.safetensors}``: files written and
   fsynced in a temporary directory, then renamed into place, so a reader never sees half an adapter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from common.durable import fsync_path
from common.framing import frames_sha256
from common.protocol import AdapterUpdate
from learner.model import Policy

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_DIR_PATTERN = re.compile(r"^v(\d+)$")


@dataclass(slots=True, kw_only=True)
class AdapterSnapshot:
    """One adapter version on rank 0: PEFT-named CPU tensors in a fixed order and their description."""

    version: int
    step: int
    tensors: list[tuple[str, torch.Tensor]]
    adapter_config: dict[str, Any]
    sha256: str
    base_model: str

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    def update(self) -> AdapterUpdate:
        return AdapterUpdate(version=self.version, step=self.step, sha256=self.sha256,
                             adapter_config=self.adapter_config, base_model=self.base_model,
                             created_unix=time.time())


def tensors_sha256(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 over the raw bytes of the tensors in order, as their frames carry them (names not hashed)."""
    return frames_sha256([t.detach().contiguous().view(torch.uint8).reshape(-1).numpy() for _, t in tensors])


def adapter_config_dict(lora_config: LoraConfig) -> dict[str, Any]:
    """The contents of adapter_config.json as PEFT writes it (sets as sorted lists), for inference."""
    raw = lora_config.to_dict()
    for key, value in raw.items():
        if isinstance(value, set):
            raw[key] = sorted(value)
    raw["inference_mode"] = True
    return json.loads(json.dumps(raw))  # plain str / list / dict values (enums become their strings)


def gather_adapter(policy: Policy, *, is_main: bool) -> list[tuple[str, torch.Tensor]] | None:
    """Collective: the LoRA tensors with PEFT names on rank 0 (fp32, CPU); None on other ranks."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(policy.model, options=options)
    if not is_main:
        return None
    peft_state = get_peft_model_state_dict(policy.model, state_dict=state)
    return [(name, tensor.detach().contiguous()) for name, tensor in peft_state.items()]


def snapshot(policy: Policy, *, version: int, step: int, is_main: bool) -> AdapterSnapshot | None:
    """Collective: gather and describe adapter ``version`` (on rank 0; None elsewhere)."""
    tensors = gather_adapter(policy, is_main=is_main)
    if tensors is None:
        return None
    return AdapterSnapshot(version=version, step=step, tensors=tensors,
                           adapter_config=adapter_config_dict(policy.lora_config),
                           sha256=tensors_sha256(tensors), base_model=str(policy.model_dir))


def adapter_dir_name(version: int) -> str:
    return f"v{version:06d}"


def newest_adapter_version(root: Path) -> int:
    """The highest version of a complete adapter directory under ``root`` (0 if none)."""
    if not root.is_dir():
        return 0
    found = [int(m.group(1)) for p in root.iterdir() if (m := _DIR_PATTERN.match(p.name)) and p.is_dir()]
    return max(found, default=0)


def write_adapter_dir(root: Path, snap: AdapterSnapshot) -> Path:
    """Write ``root/v{version}`` atomically: files in a temporary dir, fsynced, then renamed into place."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    target = root / adapter_dir_name(snap.version)
    tmp = root / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(dict(snap.tensors), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(snap.adapter_config, indent=2, sort_keys=True))
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        fsync_path(tmp / name)
    fsync_path(tmp)
    if target.exists():  # the same version written again (a run restarted without its broker): replace it
        old = root / f".old-{target.name}-{os.getpid()}"
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    fsync_path(root)
    return target


def clean_partial_dirs(root: Path) -> None:
    """Remove temporary directories a crashed writer left behind."""
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(path, ignore_errors=True)
