"""Greedy held-out accuracy of a base model, or of a base model plus a PEFT adapter directory.

One definition of "accuracy" serves the demo base check (``deploy/demo_base.py``), the launcher's
``base accuracy`` / ``final accuracy`` lines and its periodic measurements, and the time-to-accuracy benchmark:

- prompts are the task's ``eval`` split, indices ``0 .. num_prompts-1`` (disjoint from training prompts);
- a prompt is encoded exactly as the rollout workers encode it (:class:`loraflow.common.chat.ChatFormat`: a string with
  the tokenizer, messages through the chat template with ``model.chat_template_kwargs``);
- decoding is greedy, at most ``max_new_tokens`` tokens, stopping at any end-of-turn id
  (:func:`loraflow.common.chat.end_of_turn_ids`: the tokenizer's eos and every ``generation_config.eos_token_id``);
- the completion is scored by the task's own check (``Task.score``: the exact answer followed by EOS).

Prompts of equal token length are batched together, so no padding (and no position-id subtlety) enters the
measurement. This is a single-turn measurement: a multi-turn task's tools are not run, so it measures whether
the model answers directly. A config with an agent harness (``worker.agent``) is measured by playing its
episodes instead; :func:`loraflow.deploy.results.evaluate_run` chooses, for the launcher.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow.common.chat import ChatFormat, Prompt, end_of_turn_ids, pad_token_id, token_ids
from loraflow.common.config import DataConfig
from loraflow.common.hf_generation import generation_config, neutralise
from loraflow.common.task_base import Task
from loraflow.common.tasks import load_task


@dataclass(slots=True, kw_only=True)
class EvalResult:
    """Greedy accuracy over ``num_prompts`` held-out prompts, with each prompt's outcome."""

    accuracy: float
    num_prompts: int
    num_correct: int
    seconds: float
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)


def load_model(model_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None = None, *,
               device: str = "auto") -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from a HF directory, with a PEFT adapter applied when given.

    ``device`` "auto" is the first GPU when there is one, else the CPU. fp32 weights on the CPU (the demo's
    measurements, equal to the workers' fp32 engines); bf16 on a GPU, where the evaluation shares a machine with
    the run's processes (``loraflow run`` places it with deploy/devices.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    if adapter_dir is not None:
        from peft import PeftModel

        if not (Path(adapter_dir) / "adapter_config.json").is_file():
            raise ValueError(f"{adapter_dir} is not a PEFT adapter directory (no adapter_config.json)")
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.to(device).eval()
    return model, tokenizer


def greedy_completions(model: Any, tokenizer: Any, prompts: list[Prompt], max_new_tokens: int,
                       batch_size: int = 256, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                       stop_token_ids: Sequence[int] = ()) -> list[tuple[str, bool]]:
    """(completion text, ended its turn) for each prompt, greedy; same-length prompts share a batch."""
    import torch

    chat = ChatFormat(tokenizer, template_kwargs=chat_template_kwargs)
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = end_of_turn_ids(tokenizer, extra=[*token_ids(generation_eos), *stop_token_ids])
    pad_id = pad_token_id(tokenizer, eos_ids)
    encoded = [chat.encode_prompt(p) for p in prompts]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_length[len(ids)].append(i)
    neutralise(model)  # greedy means greedy: no repetition penalty or min length from the model's directory
    config = generation_config(greedy=True, max_new_tokens=max_new_tokens, eos_token_ids=eos_ids, pad_token_id=pad_id)
    out: list[tuple[str, bool]] = [("", False)] * len(prompts)
    with torch.inference_mode():
        for indices in by_length.values():
            for start in range(0, len(indices), batch_size):
                chunk = indices[start:start + batch_size]
                input_ids = torch.tensor([encoded[i] for i in chunk], dtype=torch.long, device=model.device)
                generated = model.generate(
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                )[:, input_ids.shape[1]:]
                for row, i in zip(generated.tolist(), chunk, strict=True):
                    end = next((k for k, t in enumerate(row) if t in eos_ids), None)
                    out[i] = (chat.decode(row if end is None else row[:end]), end is not None)
    return out


def evaluate(model: Any, tokenizer: Any, task: Task, *, num_prompts: int, max_new_tokens: int,
             split: str = "eval", chat_template_kwargs: Mapping[str, Any] | None = None) -> EvalResult:
    """Greedy accuracy of a loaded model on ``task``'s first ``num_prompts`` prompts of ``split``."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts} (eval.num_prompts)")
    start = time.perf_counter()
    items = [task.item(i, split) for i in range(num_prompts)]
    results = greedy_completions(model, tokenizer, [item.prompt for item in items], max_new_tokens,
                                 chat_template_kwargs=chat_template_kwargs)
    correct = [task.score(text, item.answer, finished=finished) >= 1.0
               for item, (text, finished) in zip(items, results, strict=True)]
    return EvalResult(accuracy=sum(correct) / len(correct), num_prompts=len(correct), num_correct=sum(correct),
                      seconds=time.perf_counter() - start, prompts=[item.prompt for item in items],
                      completions=[text for text, _ in results], correct=correct)


def evaluate_dir(model_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None = None, *,
                 task: str = "arith", seed: int = 0, num_prompts: int = 200, max_new_tokens: int = 6,
                 chat_template_kwargs: Mapping[str, Any] | None = None, data: DataConfig | None = None,
                 device: str = "auto") -> EvalResult:
    """Load the model (plus adapter) from disk and measure its greedy held-out accuracy (``data``: how a dataset
    task is read, ``[data]``; ``device``: as :func:`load_model`)."""
    model, tokenizer = load_model(model_dir, adapter_dir, device=device)
    on_gpu = model.device.type == "cuda"
    try:
        return evaluate(model, tokenizer, load_task(task, seed, data), num_prompts=num_prompts,
                        max_new_tokens=max_new_tokens, chat_template_kwargs=chat_template_kwargs)
    finally:
        del model  # the GPU's memory goes back between measurements (torch would keep it cached for this process)
        if on_gpu:
            import torch

            torch.cuda.empty_cache()
