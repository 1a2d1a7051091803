"""Adapter out: the LoRA tensors gathered to rank 0, named as PEFT names them, checksummed, written atomically.

Publishing version v+1 (every ``learner.publish_every`` steps):

1. every rank: the trainable (LoRA) tensors' local shards, packed into one flat buffer, travel in a single
   ``all_gather``; rank 0 cuts every rank's part back into rows and stacks them into the full tensors on the
   CPU (:func:`gather_trainable`). One collective instead of one per tensor: a 7B model with rank-16 LoRA on
   every linear layer has ~400 of them. Placements other than FSDP2's ``Shard(0)`` on a 1-D mesh go through
   ``get_model_state_dict(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)`` instead (a
   gather per tensor). The base model never moves.
2. rank 0: ``peft.get_peft_model_state_dict`` maps them to PEFT names
   (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), the names
   ``PeftModel.from_pretrained``, ``set_peft_model_state_dict`` and vLLM's LoRA loader expect; cast to the
   publishing dtype (``learner.adapter_dtype``, auto = the compute dtype: half the bytes in bf16 on GPUs).
3. :class:`AdapterSnapshot` -> ``AdapterUpdate`` (PEFT names, ``adapter_config.json`` contents, sha256 over the
   tensor bytes in order) sent through the broker to every worker.
4. every ``learner.save_adapter_every`` versions (and at the end), :func:`write_adapter_dir` writes
   ``<run_dir>/learner/adapters/v000012/{adapter_config.json, adapter_model.safetensors}``: files written and
   fsynced in a temporary directory, then renamed into place, so a reader never sees half an adapter.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from loraflow.common.durable import fsync_path
from loraflow.common.framing import frames_sha256
from loraflow.common.protocol import AdapterUpdate
from loraflow.learner.model import Policy

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
    """Collective: the LoRA tensors with PEFT names on rank 0 (CPU, in ``policy.adapter_dtype``: the fp32 master
    weights rounded to bf16 on GPUs, ``learner.adapter_dtype``); None on other ranks."""
    state = gather_trainable(policy.model, is_main=is_main)
    if state is None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(policy.model, options=options)
    if not is_main:
        return None
    peft_state = get_peft_model_state_dict(policy.model, state_dict=state)
    return [(name, tensor.detach().to(policy.adapter_dtype).contiguous()) for name, tensor in peft_state.items()]


def gather_trainable(model: torch.nn.Module, *, is_main: bool) -> dict[str, torch.Tensor] | None:
    """Collective: name -> full CPU tensor of every trainable parameter on rank 0 ({} elsewhere), in one
    ``all_gather``; None when the parameters are not all dim-0 shards of one 1-D mesh with one dtype (then on
    every rank alike: the check reads only placements, meshes and dtypes, which all ranks share)."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not params or not all(_is_row_shard(p, params[0][1]) for _, p in params):
        return None
    mesh = params[0][1].device_mesh
    world, me = mesh.size(), mesh.get_local_rank()
    rows = [[_shard_rows(p.shape[0], world, r) for _, p in params] for r in range(world)]  # [rank][param]
    numels = [[n * math.prod(p.shape[1:]) for n, (_, p) in zip(row, params, strict=True)] for row in rows]
    local = [p.to_local().detach().reshape(-1) for _, p in params]
    if [t.numel() for t in local] != numels[me]:
        raise RuntimeError("LoRA shards are not torch.chunk row blocks; this torch's FSDP2 lays them out "
                           "differently (report it with `pip show torch`)")
    size = max(sum(n) for n in numels)
    flat = torch.zeros(size, dtype=local[0].dtype, device=local[0].device)
    torch.cat(local, out=flat[:sum(numels[me])])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat, group=mesh.get_group())
    if not is_main:
        return {}
    pieces = [part.cpu().split([*numels[r], size - sum(numels[r])])[:-1] for r, part in enumerate(parts)]
    return {name: torch.cat([pieces[r][i].view(rows[r][i], *p.shape[1:]) for r in range(world)])
            for i, (name, p) in enumerate(params)}


def _is_row_shard(param: torch.Tensor, first: torch.Tensor) -> bool:
    """A DTensor sharded along dim 0 on the same 1-D mesh and with the same dtype as ``first``."""
    return (isinstance(param, DTensor) and param.device_mesh.ndim == 1 and param.placements == (Shard(0),)
            and param.device_mesh == first.device_mesh and param.dtype == first.dtype and param.ndim >= 1)


def _shard_rows(num_rows: int, world: int, rank: int) -> int:
    """Rows of dim 0 that ``rank`` holds: torch.chunk's blocks of ceil(num_rows / world), the last ones short or
    empty (FSDP2's Shard(0) layout)."""
    block = -(-num_rows // world)
    return max(0, min(block, num_rows - rank * block))


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
