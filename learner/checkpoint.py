"""Learner checkpoints with torch.distributed.checkpoint (DCP): exact resume, crash-safe, keep-last-k.

A checkpoint is a directory ``<run_dir>/learner/checkpoints/step_00000040/``:

- DCP files (``.metadata``, ``__<rank>_0.distcp``): the LoRA parameters (sharded DTensors; the frozen base is
  not saved, it is reloaded from the model directory), the optimizer state (AdamW moments and step counts,
  param groups with their lr), and each rank's torch RNG state (CPU, and CUDA when used) under its own key;
- ``learner_state.json`` (rank 0): step, policy version, scheduler state, world size, the ids of every
  group trained so far (the learner never trains a group twice, across restarts too), and the version ranges
  withdrawn by earlier resumes (never trained on, see :mod:`loraflow.common.versions`).

Crash safety: everything is written into ``step_XXXXXXXX.partial`` (DCP fsyncs its files), then rank 0
writes ``learner_state.json``, fsyncs it and the directory, and renames the directory to its final name. Only
directories with the final name count, so a crash mid-save leaves the previous checkpoint as the newest.
Older checkpoints are removed only after the new one is in place, keeping ``learner.keep_checkpoints``.

Resume (:meth:`Checkpointer.load`) restores all of it, so the next step is bit-identical to the one an
uninterrupted run would have taken on the same batch. A different world size also resumes (DCP reshards the
tensors; ranks without a saved RNG state take rank ``r % saved_world_size``'s).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from loraflow.common.durable import fsync_path
from loraflow.common.logging import get_logger
from loraflow.learner.model import Policy
from loraflow.learner.parallel import Parallel

log = get_logger("learner.checkpoint")

STATE_FILE = "learner_state.json"
FORMAT_VERSION = 1
_DIR_PATTERN = re.compile(r"^step_(\d{8})$")


@dataclass(slots=True, kw_only=True)
class LearnerState:
    """The loop's counters that a checkpoint carries besides tensors."""

    step: int = 0
    version: int = 0
    trained_group_ids: set[str] = field(default_factory=set)
    checkpoint_version: int = 0  # newest version covered by a durable checkpoint
    withdrawn: list[tuple[int, int]] = field(default_factory=list)  # versions rolled back by resumes (inclusive)


class Checkpointer:
    """Saves and loads learner checkpoints under one directory (collective calls: every rank calls them)."""

    def __init__(self, directory: Path, *, keep: int, parallel: Parallel) -> None:
        self.directory = Path(directory)
        self.keep = keep
        self.parallel = parallel

    # -- finding ---------------------------------------------------------------------------------------------

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _DIR_PATTERN.match(p.name) and (p / STATE_FILE).is_file()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, as rank 0 sees it (the same path on every rank)."""
        found = self.complete() if self.parallel.is_main else []
        step = self.parallel.broadcast_int(int(_DIR_PATTERN.match(found[-1].name).group(1)) if found else -1)
        return None if step < 0 else self.directory / f"step_{step:08d}"

    # -- saving ----------------------------------------------------------------------------------------------

    def _tensor_state(self, policy: Policy, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        model_state = get_model_state_dict(policy.model, options=StateDictOptions(ignore_frozen_params=True))
        return {"model": model_state, "optim": get_optimizer_state_dict(policy.model, optimizer)}

    def _rng_state(self, rank: int) -> dict[str, torch.Tensor]:
        state = {f"rng.rank{rank}.cpu": torch.get_rng_state()}
        if self.parallel.device.type == "cuda":
            state[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state(self.parallel.device)
        return state

    def save(self, policy: Policy, optimizer: torch.optim.Optimizer, scheduler: Any, state: LearnerState) -> Path:
        """Write a checkpoint of ``state.step`` (collective); returns its directory."""
        started = time.monotonic()
        final = self.directory / f"step_{state.step:08d}"
        partial = self.directory / f"{final.name}.partial"
        if self.parallel.is_main:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        self.parallel.barrier()
        tensors = self._tensor_state(policy, optimizer)
        tensors.update(self._rng_state(self.parallel.rank))
        dcp.save(tensors, checkpoint_id=str(partial))
        if self.parallel.is_main:
            meta = {
                "format": FORMAT_VERSION,
                "step": state.step,
                "version": state.version,
                "world_size": self.parallel.world_size,
                "device": self.parallel.device.type,
                "scheduler": scheduler.state_dict(),
                "trained_group_ids": sorted(state.trained_group_ids),
                "withdrawn_versions": [list(r) for r in state.withdrawn],
                "created_unix": time.time(),
            }
            state_path = partial / STATE_FILE
            state_path.write_text(json.dumps(meta))
            fsync_path(state_path)
            fsync_path(partial)
            if final.exists():  # the same step saved again after a resume: swap, never leaving none
                old = self.directory / f"{final.name}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                os.rename(partial, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(partial, final)
            fsync_path(self.directory)
            for old in self.complete()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint_saved", step=state.step, version=state.version, path=str(final),
                     seconds=round(time.monotonic() - started, 3))
        self.parallel.barrier()
        return final

    # -- loading ---------------------------------------------------------------------------------------------

    def load(self, path: Path, policy: Policy, optimizer: torch.optim.Optimizer, scheduler: Any) -> LearnerState:
        """Restore parameters, optimizer, scheduler, RNG and counters from ``path`` (collective)."""
        meta = json.loads((path / STATE_FILE).read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"checkpoint {path} has format {meta.get('format')}, this learner reads "
                             f"{FORMAT_VERSION}; start a new run directory or resume with the release that wrote it")
        saved_rank = self.parallel.rank % int(meta["world_size"])
        tensors = self._tensor_state(policy, optimizer)
        rng = {k.replace(f"rank{self.parallel.rank}.", f"rank{saved_rank}."): v
               for k, v in self._rng_state(self.parallel.rank).items()
               if not k.endswith(".cuda") or meta.get("device") == "cuda"}
        tensors.update(rng)
        dcp.load(tensors, checkpoint_id=str(path))
        set_model_state_dict(policy.model, tensors["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(policy.model, optimizer, tensors["optim"])
        scheduler.load_state_dict(meta["scheduler"])
        torch.set_rng_state(tensors[f"rng.rank{saved_rank}.cpu"])
        if self.parallel.device.type == "cuda" and f"rng.rank{saved_rank}.cuda" in tensors:
            torch.cuda.set_rng_state(tensors[f"rng.rank{saved_rank}.cuda"], self.parallel.device)
        log.info("checkpoint_loaded", step=meta["step"], version=meta["version"], path=str(path))
        return LearnerState(step=int(meta["step"]), version=int(meta["version"]),
                            trained_group_ids=set(meta["trained_group_ids"]),
                            checkpoint_version=int(meta["version"]),
                            withdrawn=[(int(lo), int(hi)) for lo, hi in meta.get("withdrawn_versions", [])])

    def clean_partial(self) -> None:
        """Remove directories a crashed save left behind (rank 0)."""
        if self.parallel.is_main and self.directory.is_dir():
            for path in self.directory.iterdir():
                if path.name.endswith((".partial", ".old")):
                    shutil.rmtree(path, ignore_errors=True)
