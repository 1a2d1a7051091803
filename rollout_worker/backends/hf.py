"""The transformers backend: ``generate`` on CPU or GPU, adapters hot-swapped through peft slots.

The base model is loaded once. The first adapter turns it into a ``PeftModel`` (LoRA layers injected into the
existing modules); every version then lives in a named peft adapter *slot*. A new version's weights are copied
into the LoRA parameters of a free slot, or a new slot is added when none is free or the LoRA shape changed;
the base weights are never reloaded. A slot is free once :meth:`retain` drops the version it held, so
a resident version is never overwritten: a generation pinned to an old version (``partial_policy = "finish"``)
keeps its weights, and a new version never serves the previous one's. A slot's LoRA parameters are views of one
buffer laid out in the adapter file's tensor order (:class:`_SlotLayout`), so a load moves the file's data
section in one copy and reads the slot back in one, however many tensors the adapter has.

v0 is the base model with the adapter disabled (``PeftModel.disable_adapter``), identical to a zero adapter.

Evidence (:mod:`.base`): a load's sha256 is computed over the bytes read back from the slot's LoRA parameters
after the copy, in the file's tensor order and dtype, so it equals the published checksum only if the slot holds
the published weights (when the slot's dtype is narrower than the file's, holding them means equalling the file's
tensors rounded to it; the file's bytes are then hashed); its id is a load number. Each generation reports the slot its LoRA layers have active
(read from a layer, as the forward pass does), or none when they are disabled.

Prompts, end-of-turn ids and the pad id come from :mod:`loraflow.common.chat` (``TokenizerMixin``): a row stops at any of
``eos_token_ids``. Requests are grouped by version; each group is left-padded into one batch and decoded by
:mod:`.hf_decode`, which keeps each generation's KV cache from one chunk to the next (a chunk reads only its new
tokens; a prefix computed under another version, or no longer the start of the request, is read again) and
takes the behaviour log-prob (:func:`loraflow.common.logprobs.token_logprobs` of the raw fp32 logits) of each step's
sampled token, never keeping a chunk's logits. ``kv_cache=False`` is the reference path: transformers'
``generate`` over the whole sequence every chunk with ``output_logits=True`` (batch x chunk x vocab fp32
logits); for the same requests and seed both give the same tokens, and log-probs equal to float rounding.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from msgspec.structs import replace
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from loraflow.common.framing import frames_sha256
from loraflow.common.hf_generation import generation_config, neutralise
from loraflow.common.logging import get_logger
from loraflow.common.logprobs import token_logprobs
from loraflow.common.protocol import ServedAdapter
from loraflow.rollout_worker.adapters import (
    SAFETENSORS_DTYPES,
    WEIGHTS_FILE,
    ReceivedAdapter,
    StoredTensor,
    read_tensors,
)
from loraflow.rollout_worker.backends.base import (
    RUN_KEY_SEP,
    Backend,
    GenOutput,
    GenRequest,
    Sampling,
    TokenizerMixin,
    cut_at_eos,
)
from loraflow.rollout_worker.backends.hf_decode import DecodeSettings, Prefix, Row, decode

log = get_logger("backend.hf")

#: adapter_config keys that do not change the shape or meaning of the LoRA layers
_CONFIG_NOISE = {"base_model_name_or_path", "revision", "inference_mode", "task_type", "peft_version"}


class _PhaseClock:
    """Milliseconds between successive laps, by name (an adapter load's phases: ``Backend.load_phases_ms``)."""

    def __init__(self) -> None:
        self.laps_ms: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps_ms[name] = round((now - self._last) * 1000, 2)
        self._last = now


@dataclass(slots=True, kw_only=True)
class _SlotLayout:
    """A slot's LoRA parameters made views of one flat buffer, in the order of an adapter file's tensors: a load
    is one copy into the buffer and one read back, a handful of torch calls whatever the number of tensors. (One
    copy per tensor made a 1.5B model's load, 392 tensors, take 1.4-7 s on an H200 beside two more workers and the
    learner, against 0.15 s alone: each torch call gives up the GIL, and a busy thread of the worker then holds
    it for up to the 5-ms switch interval; bench/adapter_load.py.)"""

    names: list[str]  # PEFT names in buffer order
    shapes: list[tuple[int, ...]]
    flat: torch.Tensor

    @classmethod
    def of(cls, params: Mapping[str, torch.nn.Parameter], names: Sequence[str]) -> _SlotLayout:
        """Lay ``params`` out in ``names``' order: each parameter's data becomes its view of a new buffer."""
        first = params[names[0]]
        assert all(params[n].dtype == first.dtype for n in names), "peft made a slot of several dtypes"
        flat = torch.empty(sum(params[n].numel() for n in names), dtype=first.dtype, device=first.device)
        offset = 0
        with torch.no_grad():
            for name in names:
                param = params[name]
                view = flat[offset:offset + param.numel()].view(param.shape)
                view.copy_(param)
                param.data = view
                offset += param.numel()
        return cls(names=list(names), shapes=[tuple(params[n].shape) for n in names], flat=flat)


def _packed(stored: Sequence[StoredTensor], num_bytes: int) -> bool:
    """The file's tensors fill its data section back to back, in one dtype, each its shape's bytes."""
    if not stored or {t.dtype for t in stored} - set(SAFETENSORS_DTYPES) or len({t.dtype for t in stored}) != 1 \
            or stored[-1].end != num_bytes:
        return False
    itemsize = getattr(torch, stored[0].dtype).itemsize
    return all(t.start == (stored[i - 1].end if i else 0) and t.end - t.start == math.prod(t.shape) * itemsize
               for i, t in enumerate(stored))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class HfBackend(TokenizerMixin, Backend):
    name = "hf"

    def __init__(self, model_dir: str | Path, *, sampling: Sampling, device: str = "auto", dtype: str = "float32",
                 seed: int = 0, chat_template_kwargs: Mapping[str, Any] | None = None,
                 stop_token_ids: Sequence[int] = (), kv_cache: bool = True) -> None:
        super().__init__(sampling)
        self.kv_cache = kv_cache  # False: generate() re-reads every sequence each chunk (the reference path)
        self.device = resolve_device(device)
        self.dtype = getattr(torch, dtype)
        torch.manual_seed(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype)
        base.to(self.device).eval()
        base.requires_grad_(False)
        neutralise(base)  # the directory's sampling defaults would change the tokens, not the log-probs
        self.model: Any = base  # a PeftModel once the first adapter arrives
        self.engine_dtype = str(base.dtype).removeprefix("torch.")
        self.vocab_size = int(base.config.vocab_size)
        self._init_tokens(self.tokenizer, model_dir, chat_template_kwargs=chat_template_kwargs or {},
                          stop_token_ids=stop_token_ids, vocab_size=self.vocab_size)
        self._slot_of: dict[int, str] = {}  # resident version -> slot
        self._slot_keys: dict[str, str] = {}  # slot -> LoRA shape key
        self._layouts: dict[str, _SlotLayout] = {}  # slot -> its LoRA parameters as views of one buffer
        self._slot_loads: dict[str, ServedAdapter] = {}  # slot -> what its last load put in it
        self._lora_layer: Any = None  # one LoRA layer of the model: which slot it serves
        self._free_slots: list[str] = []
        self._num_slots = 0
        self._configs: dict[tuple[bool, int, Sampling], GenerationConfig] = {}
        self._prefixes: dict[str, Prefix] = {}  # generation key -> what its last chunk fed (see .hf_decode)
        self.num_prefix_tokens_reused = 0  # tokens not read again thanks to a held prefix (stats, the bench)
        self.num_tokens_read = 0  # tokens fed to the model before a chunk's first new token

    # -- adapters ----------------------------------------------------------------------------------------------

    def _load(self, adapter: ReceivedAdapter) -> ServedAdapter:
        from peft import LoraConfig, get_peft_model
        from peft.tuners.tuners_utils import BaseTunerLayer

        clock = _PhaseClock()
        config = LoraConfig.from_pretrained(str(adapter.path))
        config.inference_mode = True
        key = json.dumps({k: v for k, v in sorted(config.to_dict().items()) if k not in _CONFIG_NOISE}, default=str)
        slot = next((s for s in self._free_slots if self._slot_keys[s] == key), None)
        if slot is not None:
            self._free_slots.remove(slot)
        else:
            slot = f"slot{self._num_slots}"
            if self._num_slots == 0:  # the first slot: inject LoRA layers into the base model's modules
                self.model = get_peft_model(self.model, config, adapter_name=slot)
                self._lora_layer = next(m for m in self.model.modules() if isinstance(m, BaseTunerLayer))
            else:
                self.model.add_adapter(slot, config)
            self._num_slots += 1
            self._slot_keys[slot] = key
            self._drop_unusable_slots(key)
        clock.lap("slot")
        stored, data = read_tensors(adapter.path / WEIGHTS_FILE)
        clock.lap("read")
        layout = self._layout(slot, stored, len(data), adapter.version)
        file_dtype = getattr(torch, stored[0].dtype)
        with torch.no_grad():
            published = torch.frombuffer(data, dtype=torch.uint8)
            values = published.to(self.device).view(file_dtype)  # one copy to the engine's device
            layout.flat.copy_(values)  # every LoRA parameter of the slot at once, in the slot's dtype
            clock.lap("copy")
            held = layout.flat.to(file_dtype).view(torch.uint8).cpu()  # what the slot holds, as the file's bytes
            clock.lap("read_back")
            # a slot narrower than the file (a bf16 engine, an fp32 adapter) rounds on the copy, and then holding
            # the file's weights means holding them as the engine's dtype rounds: the file's bytes are hashed
            as_loaded = torch.equal(held, published) or torch.equal(layout.flat, values.to(layout.flat.dtype))
        self._slot_of[adapter.version] = slot
        loaded = ServedAdapter(version=adapter.version, adapter=slot, lora_id=self.new_lora_id(),
                               sha256=frames_sha256([(published if as_loaded else held).numpy()]),
                               dtype=self.engine_dtype)
        clock.lap("checksum")
        self.load_phases_ms = clock.laps_ms
        self._slot_loads[slot] = loaded
        log.debug("adapter_loaded", version=adapter.version, slot=slot, lora_id=loaded.lora_id)
        return loaded

    def _layout(self, slot: str, stored: list[StoredTensor], num_bytes: int, version: int) -> _SlotLayout:
        """The slot's flat layout for an adapter file whose tensors are ``stored`` (``num_bytes`` of data): laid
        out again when the file orders its tensors otherwise than the slot's last. Raises ValueError (the slot
        freed again) when the file does not fit the model: other names or shapes, several dtypes, or a data
        section that is not exactly its tensors back to back (the learner always publishes one dtype)."""
        layout = self._layouts.get(slot)
        names = [t.name for t in stored]
        if layout is None or layout.names != names:
            params = self._parameters_of(slot)
            unexpected, missing = sorted(set(names) - set(params)), sorted(set(params) - set(names))
            other_shapes = [t.name for t in stored if t.name in params and tuple(params[t.name].shape) != t.shape]
            if unexpected or missing or other_shapes:
                self._free_slots.append(slot)
                raise ValueError(f"adapter v{version} does not fit the model: unexpected tensors {unexpected[:3]}, "
                                 f"missing {missing[:3]} (PEFT names of the same base model?), other shapes "
                                 f"{other_shapes[:3]} (learner.lora_rank?)")
            layout = _SlotLayout.of(params, names)
        if layout.shapes != [t.shape for t in stored] or not _packed(stored, num_bytes):
            self._free_slots.append(slot)
            raise ValueError(f"adapter v{version} does not fit the model: its file is not the model's LoRA tensors "
                             "back to back in one dtype")
        self._layouts[slot] = layout
        return layout

    def _parameters_of(self, slot: str) -> dict[str, torch.nn.Parameter]:
        """PEFT name (as published: the slot's name left out) -> the slot's LoRA parameter."""
        from peft import get_peft_model_state_dict

        inner, last = f".{slot}.", f".{slot}"
        params = {(name.replace(inner, ".") if inner in name else name.removesuffix(last)): p
                  for name, p in self.model.named_parameters() if inner in name or name.endswith(last)}
        assert set(params) == set(get_peft_model_state_dict(self.model, adapter_name=slot)), "peft renamed its weights"
        return params

    def _drop_unusable_slots(self, key: str) -> None:
        """Free slots shaped for another LoRA config will not be reused: delete them."""
        for slot in [s for s in self._free_slots if self._slot_keys[s] != key]:
            self._free_slots.remove(slot)
            self.model.delete_adapter(slot)
            del self._slot_keys[slot]
            self._layouts.pop(slot, None)
            self._slot_loads.pop(slot, None)

    def _engine_report(self, version: int) -> ServedAdapter:
        """What the LoRA layers serve now, for a request of ``version``: the active slot's load, or none."""
        layer = self._lora_layer
        if layer is None or layer.disable_adapters:
            return ServedAdapter(version=version, dtype=self.engine_dtype)
        slots = list(layer.active_adapters)
        loaded = self._slot_loads.get(slots[0]) if len(slots) == 1 else None
        if loaded is None:
            return ServedAdapter(version=version, adapter=",".join(slots)[:128], dtype=self.engine_dtype)
        return replace(loaded, version=version)

    def _unload(self, version: int) -> None:
        self._free_slots.append(self._slot_of.pop(version))
        self._prefixes = {k: p for k, p in self._prefixes.items() if p.version != version}

    @contextlib.contextmanager
    def _using(self, version: int):
        if version == 0:
            with self.model.disable_adapter() if self._num_slots else contextlib.nullcontext():
                yield
        else:
            self.model.set_adapter(self._slot_of[version])
            yield

    # -- generation --------------------------------------------------------------------------------------------

    def _generation_config(self, greedy: bool, max_new_tokens: int) -> GenerationConfig:
        key = (greedy, max_new_tokens, self.sampling)  # a shared engine's runs sample each their own way
        if key not in self._configs:
            self._configs[key] = generation_config(
                greedy=greedy, max_new_tokens=max_new_tokens, eos_token_ids=self.eos_token_ids,
                pad_token_id=self.pad_token_id, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                output_logits=True, return_dict_in_generate=True)
        return self._configs[key]

    @torch.inference_mode()
    def _generate(self, requests: Sequence[GenRequest], greedy: bool) -> list[GenOutput]:
        outputs: list[GenOutput | None] = [None] * len(requests)
        by_version: dict[int, list[int]] = {}
        for index, request in enumerate(requests):
            by_version.setdefault(request.version, []).append(index)
        # a prefix not asked for in this call is dropped; on a shared engine only one of the call's run's
        # (keys "r<slot>|...", rollout_worker/backends/shared.py): the other runs' calls come in between
        callers = {_namespace(r.key) for r in requests}
        held = self._prefixes
        self._prefixes = {k: p for k, p in held.items() if _namespace(k) not in callers}
        for version, indices in by_version.items():
            with self._using(version):
                batch = [requests[i] for i in indices]
                served = self._engine_report(version)
                generated = (self._decode_batch(batch, greedy, held) if self.kv_cache
                             else self._generate_batch(batch, greedy))
                for i, out in zip(indices, generated, strict=True):
                    out.served = served
                    outputs[i] = out
        return [out for out in outputs if out is not None]

    def _decode_batch(self, requests: Sequence[GenRequest], greedy: bool,
                      held: dict[str, Prefix]) -> list[GenOutput]:
        rows = []
        for request in requests:
            prefix = held.pop(request.key, None) if request.key else None
            if prefix is not None and not prefix.serves(request.token_ids, request.version):
                prefix = None
            rows.append(Row(token_ids=request.token_ids, max_tokens=request.max_tokens, prefix=prefix))
            reused = len(prefix.token_ids) if prefix else 0
            self.num_prefix_tokens_reused += reused
            self.num_tokens_read += len(request.token_ids) - reused
        settings = DecodeSettings(greedy=greedy, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                  eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id)
        results = []
        for request, row in zip(requests, decode(self.model, rows, requests[0].version, settings, self.device),
                                strict=True):
            ids, finished = cut_at_eos(row.token_ids, self.eos_token_ids, request.max_tokens)
            if request.key and row.prefix is not None:
                self._prefixes[request.key] = row.prefix
            results.append(GenOutput(token_ids=ids, logprobs=row.logprobs[:len(ids)], finished=finished))
        return results

    def _generate_batch(self, requests: Sequence[GenRequest], greedy: bool) -> list[GenOutput]:
        """The reference path (``kv_cache=False``): ``generate`` over the whole sequences, logits kept."""
        width = max(len(r.token_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):
            ids = torch.as_tensor(list(request.token_ids), dtype=torch.long)
            input_ids[row, width - len(ids):] = ids
            attention_mask[row, width - len(ids):] = 1
        self.num_tokens_read += sum(len(r.token_ids) for r in requests)
        config = self._generation_config(greedy, max(r.max_tokens for r in requests))
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                  generation_config=config)
        new_tokens = out.sequences[:, width:]
        temperature = 1.0 if greedy else self.sampling.temperature
        logprobs = token_logprobs(torch.stack(out.logits, dim=1), new_tokens, temperature).cpu()
        results = []
        for row, request in enumerate(requests):
            ids, finished = cut_at_eos(new_tokens[row].tolist(), self.eos_token_ids, request.max_tokens)
            results.append(GenOutput(token_ids=ids, logprobs=logprobs[row, :len(ids)].tolist(), finished=finished))
        return results

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "device": str(self.device), "slots": self._num_slots,
                "kv_cache": self.kv_cache, "held_prefixes": len(self._prefixes)}


def _namespace(key: str) -> str:
    """The run a generation key belongs to on a shared engine ("" for a worker of one run)."""
    return key.partition(RUN_KEY_SEP)[0] if RUN_KEY_SEP in key else ""
