"""The trainable policy: a frozen Hugging Face causal LM with a peft LoRA adapter, sharded with FSDP2.

Built so that no rank ever holds the whole base model (the torchtitan recipe):

1. the model and its adapter are built on the meta device from ``config.json`` (parameters only: buffers such
   as the rotary frequencies are computed for real), ``target_modules`` checked against it and
   ``"all-linear"`` expanded (:mod:`loraflow.common.lora_targets`: a name that selects nothing, an embedding or the
   output head is a config error, exit 2); the adapter's size is checked against ``broker.max_message_bytes``
   here too, before any weight is read;
2. the input embedding and the output head (frozen, tied or not) are replaced by row-sharded forms outside
   FSDP2 (:mod:`loraflow.learner.vocab`): a rank keeps V / R rows and a use walks the ranks' rows a piece at a time, so
   the vocabulary matrix (467 MB at the 1.5B shape) is never gathered whole;
   ``fully_shard`` on each decoder layer (the classes the model lists in ``_no_split_modules``), then on the
   root, over the 1-D mesh of :mod:`loraflow.learner.parallel`; ``to_empty`` gives each rank storage for its shards
   only;
3. rank 0 reads the safetensors files one decoder layer at a time and broadcasts them
   (``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``): every rank keeps only its
   rows of each tensor, and rank 0's host memory holds one layer of full tensors beyond its shards; the
   embedding / head rows are read by rank 0 a slice at a time and sent to their rank;
4. the LoRA tensors are drawn on every rank from one seeded generator (``lora_A`` ~ U(+-1/sqrt(in)), peft's
   kaiming-uniform; ``lora_B`` = 0), so the untrained policy is exactly the base model: version 0.

Dtypes: the frozen base is stored in the compute dtype (``learner.mixed_precision``: ``auto`` is bf16 on GPUs
that support it, fp32 elsewhere; ``bf16`` forces it, also on CPU; ``fp32`` turns it off), so a bf16 run never
holds an fp32 copy of the base. The LoRA parameters, their gradients and the AdamW state are fp32; FSDP2's
``MixedPrecisionPolicy`` casts them to the compute dtype for the forward pass and reduces gradients in fp32.

Activation checkpointing (``learner.activation_checkpointing``): each decoder layer's forward runs under
non-reentrant ``torch.utils.checkpoint``, inside FSDP2's hooks (as torchtitan wraps its blocks), so a layer
keeps only its input for backward and recomputes the rest. Module names do not change, so checkpoints and
published adapters are the same either way.

Logits only where they are trained: :meth:`Policy.trained_logprobs` runs the decoder once and applies the output
head to the selected positions only, chunk by chunk (:mod:`loraflow.learner.head`), inside the root module's FSDP2
forward (``register_fsdp_forward_method``), where the root's parameters (the final norm) are gathered.
With ``past`` (:func:`loraflow.learner.segments.past_cache`) it runs one segment of a row longer than the token budget. The reference policy for the KL penalty is the same model with the adapter disabled
(:meth:`Policy.reference`), so no second copy of the base is held.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from loraflow.common.config import ConfigError, LearnerConfig
from loraflow.common.lora_targets import resolve_target_modules
from loraflow.learner import head, vocab
from loraflow.learner.parallel import Parallel

#: the bytes a message needs besides the tensors (header with every tensor's name and spec, adapter config)
MESSAGE_OVERHEAD_BYTES = 64 << 10
HEADER_BYTES_PER_TENSOR = 256
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


@dataclass(slots=True)
class Policy:
    """The sharded peft model and what publishing and checkpointing need to know about it."""

    model: nn.Module  # the PeftModel, wrapped by fully_shard (an FSDPModule)
    lora_config: LoraConfig
    model_dir: Path
    compute_dtype: torch.dtype
    vocab_size: int
    adapter_dtype: torch.dtype = torch.float32  # what publishing sends (learner.adapter_dtype)
    activation_checkpointing: bool = False

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] int64 -> logits [B, L, V] (compute dtype): every position; for tests and tools."""
        return self.model(input_ids=input_ids, use_cache=False).logits

    def trained_logprobs(self, input_ids: torch.Tensor, select: torch.Tensor, targets: torch.Tensor,
                         temperature: float = 1.0, *, with_entropy: bool = True,
                         past: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, L], select [B, L] bool, targets [T] (the selected positions' next tokens) ->
        (log p(target) [T] fp32 with gradient, entropy [T] fp32 detached) under softmax(logits / temperature).
        ``past``: the keys and values of the row's earlier positions (:func:`loraflow.learner.segments.past_cache`); the
        input is then the row's next segment, at the positions after them."""
        return self.model.trained_logprobs(input_ids, select, targets, float(temperature), with_entropy, past)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The base policy: the adapter disabled for the duration (the KL reference).

        peft's ``disable_adapter`` also turns the LoRA parameters' ``requires_grad`` off; they are turned back on
        inside (a disabled adapter is in no graph, so nothing changes for gradients). FSDP2 fixes a group's
        mixed-precision dtypes at the group's first forward from the parameters that require grad then: a first
        forward under the reference (the KL term's, before the policy's own) left the reduce dtype unset, and
        the first backward failed assigning bf16 gradients to the fp32 master weights."""
        peft_model: PeftModel = self.model  # type: ignore[assignment]
        trainable = self.trainable_parameters()
        with peft_model.disable_adapter():
            for param in trainable:
                param.requires_grad_(True)
            yield


def _trained_logprobs(peft_model: PeftModel, input_ids: torch.Tensor, select: torch.Tensor, targets: torch.Tensor,
                      temperature: float, with_entropy: bool, past: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of :meth:`Policy.trained_logprobs`, run as a forward method of the FSDP2 root."""
    causal_lm = peft_model.get_base_model()
    if past is not None and "sliding_attention" in (getattr(causal_lm.config, "layer_types", None) or ()):
        raise ValueError(f"{causal_lm.config.model_type}: rows longer than learner.micro_batch_tokens are split "
                         "into segments, which loraflow does not do for sliding-window attention yet; raise "
                         "learner.micro_batch_tokens above the longest row")
    hidden = causal_lm.get_decoder()(input_ids=input_ids, past_key_values=past,
                                     use_cache=past is not None).last_hidden_state             # [B, L, H]
    rows = causal_lm.get_output_embeddings().vocab_rows                                       # [V / R, H]
    return head.trained_logprobs(hidden[select], rows, targets, temperature, with_entropy=with_entropy)


def resolve_compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """learner.mixed_precision -> the dtype forward/backward run in (and the frozen base is stored in)."""
    if setting == "bf16":
        return torch.bfloat16
    if setting == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def resolve_adapter_dtype(setting: str, compute_dtype: torch.dtype) -> torch.dtype:
    """learner.adapter_dtype -> the dtype adapters are published in (auto = the compute dtype)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(setting, compute_dtype)


def resolve_activation_checkpointing(setting: str, device: torch.device) -> bool:
    """learner.activation_checkpointing: auto = on for GPUs (memory is what limits there; on this CPU it only
    costs time, see BENCHMARKS.md "Learner memory"), off on CPU."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def lora_config_for(learner: LearnerConfig, model_dir: Path, target_modules: list[str]) -> LoraConfig:
    """The adapter's peft config; ``target_modules`` as :func:`loraflow.common.lora_targets.resolve_target_modules` gave."""
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


def check_output_head(hf_config: Any) -> None:
    """Refuse models whose logits are not ``lm_head(hidden)``: the chunked head (loraflow.learner.head) computes only that."""
    for key in ("final_logit_softcapping", "logit_scale"):
        if getattr(hf_config, key, None):
            raise ValueError(f"model.path: {hf_config.model_type} models transform their logits ({key} = "
                             f"{getattr(hf_config, key)}), which loraflow's learner does not reproduce yet; "
                             "use a model whose logits are lm_head(hidden) (Llama, Qwen2/3, Gemma 1, Mistral)")


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def adapter_message_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of an AdapterUpdate carrying the model's LoRA tensors in ``dtype`` (works on the meta device)."""
    params = lora_parameters(model)
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for _, p in params) * size + HEADER_BYTES_PER_TENSOR * len(params) + MESSAGE_OVERHEAD_BYTES


def check_adapter_fits(model: nn.Module, dtype: torch.dtype, learner: LearnerConfig, max_message_bytes: int) -> None:
    """ConfigError (exit 2) when an adapter version would not fit one broker message."""
    need = adapter_message_bytes(model, dtype)
    if max_message_bytes and need > max_message_bytes:
        dtype_name = str(dtype).removeprefix("torch.")
        raise ConfigError(
            f"the adapter at learner.lora_rank = {learner.lora_rank} ({len(lora_parameters(model))} tensors in "
            f"{dtype_name}) needs a {need / 2**20:.1f} MiB message, above broker.max_message_bytes = "
            f"{max_message_bytes} ({max_message_bytes / 2**20:.1f} MiB): raise broker.max_message_bytes to at "
            f"least {need}, lower learner.lora_rank, narrow learner.target_modules, or publish in bf16 "
            '(learner.adapter_dtype = "bfloat16")')


def shard(model: nn.Module, layers: list[nn.Module], parallel: Parallel, compute_dtype: torch.dtype,
          ignored: set[nn.Parameter] | None = None) -> None:
    """FSDP2 over ``parallel.mesh``: each decoder layer its own group, then the root; below fp32 the parameters are
    gathered in ``compute_dtype`` and gradients reduced in fp32. ``ignored``: parameters FSDP2 leaves as they are
    (a :class:`SharedBase`'s frozen tensors)."""
    options: dict[str, Any] = {"mesh": parallel.mesh, "ignored_params": ignored}
    if compute_dtype != torch.float32:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)


@dataclass(slots=True)
class SharedBase:
    """The frozen base that every run's policy in one pool learner holds (:mod:`loraflow.learner.pool_learner`).

    The first policy built over it reads the weights; each later one takes these tensors into its own module tree
    and adds only its LoRA tensors (and, in the learner, their optimizer state), so N runs hold one base. The
    frozen tensors stay outside FSDP2 (one rank: nothing to shard), which manages each run's LoRA parameters as in
    a learner of one run, with the same mixed-precision casts."""

    model_dir: Path
    parameters: dict[str, nn.Parameter] = field(default_factory=dict)  # weights-file name -> the one tensor
    vocab_rows: dict[str, vocab.VocabRows] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one policy built at a time

    def held_by(self, model: nn.Module) -> bool:
        """Whether every frozen parameter of ``model`` is this base's tensor (not a copy)."""
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        return bool(frozen) and all(self.parameters.get(_base_key(n)) is p for n, p in frozen)


def build_policy(model_dir: Path, learner: LearnerConfig, parallel: Parallel, *, seed: int,
                 max_message_bytes: int = 0, shared: SharedBase | None = None) -> Policy:
    """The sharded policy, built as the module docstring says; identical on every rank (collective). With
    ``shared`` (one rank only) its frozen base is that base's tensors: read from ``model_dir`` by the first policy
    built over it, taken as they are by the others."""
    if shared is None:
        return _build_policy(model_dir, learner, parallel, seed=seed, max_message_bytes=max_message_bytes)
    if parallel.world_size > 1:
        raise ValueError("a shared base (one learner for several runs) is built on one rank; under torchrun each "
                         "run has its own learner")
    if shared.model_dir != model_dir:
        raise ValueError(f"model.path {model_dir}: this learner's shared base is {shared.model_dir}")
    with shared.lock:
        return _build_policy(model_dir, learner, parallel, seed=seed, max_message_bytes=max_message_bytes,
                             shared=shared)


def _build_policy(model_dir: Path, learner: LearnerConfig, parallel: Parallel, *, seed: int,
                  max_message_bytes: int, shared: SharedBase | None = None) -> Policy:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(str(model_dir))
    check_output_head(hf_config)
    compute_dtype = resolve_compute_dtype(learner.mixed_precision, parallel.device)
    with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary frequencies) for real
        base = AutoModelForCausalLM.from_config(hf_config, dtype=compute_dtype)
        target_modules = resolve_target_modules(learner.target_modules, base)
        base.eval()  # as from_pretrained leaves it: no dropout in the base; LoRA dropout follows lora_dropout
        base.config.use_cache = False
        base.requires_grad_(False)
        lora_config = lora_config_for(learner, model_dir, target_modules)
        model = get_peft_model(base, lora_config)  # LoRA parameters in fp32 (peft's autocast_adapter_dtype)
    reuse = shared is not None and bool(shared.parameters)
    vocab_rows = vocab.shard_vocab(base, hf_config, dtype=compute_dtype, parallel=parallel,
                                   rows=shared.vocab_rows if reuse else None)
    held = _take_base(model, shared) if reuse else set()
    adapter_dtype = resolve_adapter_dtype(learner.adapter_dtype, compute_dtype)
    check_adapter_fits(model, adapter_dtype, learner, max_message_bytes)
    layers = decoder_layers(base)
    use_checkpointing = resolve_activation_checkpointing(learner.activation_checkpointing, parallel.device)
    if use_checkpointing:
        for layer in layers:
            layer.forward = functools.partial(_checkpointed, layer.forward)
    frozen = {p for p in model.parameters() if not p.requires_grad} if shared is not None else None
    shard(model, layers, parallel, compute_dtype, ignored=frozen)
    model.trained_logprobs = functools.partial(_trained_logprobs, model)
    register_fsdp_forward_method(model, "trained_logprobs")
    _materialize(model, parallel.device, keep=held)
    if not reuse:
        load_base_weights(model, model_dir, compute_dtype, is_main=parallel.is_main, vocab_rows=vocab_rows)
    if shared is not None and not reuse:
        shared.parameters.update((_base_key(n), p) for n, p in model.named_parameters() if not p.requires_grad)
        shared.vocab_rows.update(vocab_rows)
    init_lora(model, seed=seed, shared=shared is not None)
    return Policy(model=model, lora_config=lora_config, model_dir=model_dir, compute_dtype=compute_dtype,
                  vocab_size=int(hf_config.vocab_size), adapter_dtype=adapter_dtype,
                  activation_checkpointing=use_checkpointing)


def _materialize(model: nn.Module, device: torch.device, keep: set[nn.Parameter] = frozenset()) -> None:
    """Storage for this rank's shards (``to_empty``); the buffers computed at build time are kept, and so are the
    parameters in ``keep`` (a shared base's tensors: out of the tree while the rest gets its storage)."""
    buffers = [(module, name, buf) for module in model.modules() for name, buf in module._buffers.items()
               if buf is not None]
    kept = [(module, name, p) for module in model.modules() for name, p in module._parameters.items() if p in keep]
    for module, name, _ in kept:
        module._parameters[name] = None
    model.to_empty(device=device)
    for module, name, buf in buffers:
        module._buffers[name] = buf.to(device)
    for module, name, param in kept:
        module._parameters[name] = param


def _take_base(model: nn.Module, shared: SharedBase) -> set[nn.Parameter]:
    """Put the shared base's tensors in place of ``model``'s frozen (meta) parameters; returns them."""
    taken = set()
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.requires_grad:
                continue
            key = _base_key(f"{module_name}.{name}" if module_name else name)
            tensor = shared.parameters.get(key)
            if tensor is None or tensor.shape != param.shape or tensor.dtype != param.dtype:
                raise ValueError(f"{key}: the shared base has no tensor of shape {tuple(param.shape)} and dtype "
                                 f"{param.dtype}; every run of a pool learner trains over the same base")
            module._parameters[name] = tensor
            taken.add(tensor)
    return taken


def _base_key(name: str) -> str:
    """PeftModel parameter name -> the name in the model's safetensors files."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (a single file, or the index of a sharded model)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"model.path {model_dir}: no model.safetensors (or its index); the learner reads "
                         "safetensors weights only (re-save the model with save_pretrained)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def load_base_weights(model: nn.Module, model_dir: Path, dtype: torch.dtype, *, is_main: bool,
                      vocab_rows: dict[str, vocab.VocabRows]) -> None:
    """Collective: the frozen base's weights from ``model_dir`` into every rank's shards, one decoder layer at a
    time read by rank 0 and broadcast (the others receive one tensor at a time and keep their rows); then the
    embedding / head (``vocab_rows``: weights-file name -> rows), read by rank 0, each rank sent its rows."""
    from safetensors import safe_open

    files = _weight_files(model_dir)  # every rank reads the headers: a missing tensor fails on all of them
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    missing = [_base_key(n) for n in frozen if _base_key(n) not in files] + [k for k in vocab_rows if k not in files]
    if missing:
        raise ValueError(f"model.path {model_dir}: the weights files lack {len(missing)} tensors of the model "
                         f"(first: {missing[:3]}); the directory does not match its config.json")
    groups: dict[int, list[str]] = {}
    for name in frozen:
        match = _LAYER_INDEX.search(name)
        groups.setdefault(int(match.group(1)) if match else -1, []).append(name)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    for _, names in sorted(groups.items()):
        full: dict[str, torch.Tensor] = {}
        if is_main:
            by_file: dict[Path, list[str]] = {}
            for name in names:
                by_file.setdefault(files[_base_key(name)], []).append(name)
            for path, in_file in by_file.items():
                with safe_open(str(path), framework="pt") as f:
                    for name in in_file:
                        full[name] = f.get_tensor(_base_key(name)).to(dtype)
        set_model_state_dict(model, full, options=options)
        del full
    for key, rows in vocab_rows.items():
        if not is_main:
            vocab.load_vocab_rows(rows, None)
            continue
        vocab.load_vocab_rows(rows, lambda start, end, k=key: vocab.read_rows(files[k], k, start, end).to(dtype))


def init_lora(model: nn.Module, *, seed: int, shared: bool = False) -> None:
    """The adapter's initial values on every rank from one seeded generator: ``lora_A`` ~ U(-1/sqrt(in),
    1/sqrt(in)) (peft's kaiming-uniform with a = sqrt(5)), ``lora_B`` = 0, so the policy starts as the base."""
    generator = torch.Generator().manual_seed(seed)
    full: dict[str, torch.Tensor] = {}
    for name, param in lora_parameters(model):
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(param.shape[1])
            full[name] = torch.empty(param.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        else:
            full[name] = torch.zeros(param.shape, dtype=torch.float32)
    if not shared:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    # set_model_state_dict writes every parameter (the frozen ones onto themselves): on a shared base those are
    # another run's, maybe inside its backward, so each LoRA tensor is written alone (one rank: the whole tensor)
    with torch.no_grad():
        for name, param in lora_parameters(model):
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(full[name].to(local.device))
