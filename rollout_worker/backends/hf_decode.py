"""The hf backend's decode loop: one chunk per request, each sample's KV cache kept from one chunk to the next.

The chunked callers (the rollout loop, the gateway) ask for every generation in flight once per round, each
request carrying the whole sequence so far (``GenRequest.token_ids``). Re-reading that prefix every chunk makes
a chunk's cost grow with the sample's length; instead the backend keeps, per generation (``GenRequest.key``), the
keys and values of every token it has fed (:class:`Prefix`) and a chunk feeds only what is new: the sampled
token of the previous chunk, an environment reply, or a whole prompt for a sample the cache does not hold.

A held prefix is used only when all of these hold, else it is dropped and the whole sequence is read again:

- the request has the version the prefix was computed under (under ``partial_policy = "continue"`` the next
  chunk of a sample runs under the new adapter, and keys and values of the old one would give the new tokens
  other log-probs than the learner's check computes: the prefix is re-read under the new adapter);
- the request's tokens start with the prefix's tokens (a caller that kept fewer tokens than it was given, a
  stop string cut, a new turn: anything else is read afresh);
- the version is still resident: unloading a version (:meth:`Backend.retain`, or a version number re-published
  with other weights) drops its prefixes.

A prefix lives until the next call: prefixes of generations not asked for again, and of rows that ended with an
end-of-turn id, are dropped, so the cache holds at most one round's batch.

A round's batch is laid out per row as ``[pad | held prefix | pad | new tokens]``, left-padded so that every
row's next token is in the last column; the attention mask hides the padding and the position ids count only a
row's real tokens (as ``generate`` does with left padding), so a row's keys, values and logits are those it
would have alone. When a few rows feed many new tokens (a prompt, a prefix re-read after a swap) beside rows
that feed one, that padding would make every row pay for the longest: past ``MAX_PADDED_POSITIONS`` padded
positions the long rows are read first in a forward of their own, all but their last tokens
(:func:`_read_long_rows_first`), and join the round with that as their held prefix. Sampling is ``generate``'s
own (:func:`loraflow.common.hf_generation.sampling_warpers`, ``torch.multinomial`` over the warped softmax for the whole
batch every step, pad fed to rows that ended, stop when every row ended or after the largest ``max_tokens``), so
for the same requests and seed the tokens are
those ``generate`` draws, and the log-probs (:func:`loraflow.common.logprobs.token_logprobs` of the sampled token, from
the step's fp32 logits of the last position only) equal the uncached path's to float rounding. Nothing of size
``[B, chunk, V]`` is kept: each step's ``[B, V]`` logits are dropped once its token and log-prob are taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from loraflow.common.hf_generation import sampling_warpers
from loraflow.common.logprobs import token_logprobs


@dataclass(slots=True, kw_only=True)
class Prefix:
    """The keys and values of the tokens a generation has fed so far, under one version."""

    token_ids: list[int]  # the tokens held, in order (the request's tokens, then all but its last sampled one)
    version: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), [1, kv_heads, len, head_dim]

    def serves(self, token_ids: Sequence[int], version: int) -> bool:
        """Whether it is the start of ``token_ids`` under ``version``, leaving at least one token to feed."""
        held = len(self.token_ids)
        return version == self.version and held < len(token_ids) and list(token_ids[:held]) == self.token_ids


@dataclass(slots=True, kw_only=True)
class Row:
    token_ids: Sequence[int]  # the whole sequence so far
    max_tokens: int
    prefix: Prefix | None  # the held start of token_ids (None: read it all)


@dataclass(slots=True, kw_only=True)
class RowOutput:
    token_ids: list[int]  # all the steps' tokens (pad after an end-of-turn id); the caller cuts them
    logprobs: list[float]
    prefix: Prefix | None  # the start to hold for the next chunk (None: the row ended)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeSettings:
    greedy: bool
    temperature: float
    top_p: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int


#: padded positions a round's first forward may compute for rows with a held prefix before their long new rows
#: are read in a forward of their own first (:func:`decode`)
MAX_PADDED_POSITIONS = 128


@dataclass(slots=True, kw_only=True)
class _Layout:
    """A batch laid out as ``[pad | held prefix | pad | new tokens]`` per row, and its cache of the held parts."""

    held: list[int]
    new: list[int]
    input_ids: torch.Tensor  # [B, width_new]
    mask: torch.Tensor  # [B, width_held + width_new]
    positions: torch.Tensor  # [B, width_new]
    cache: DynamicCache

    @property
    def width_held(self) -> int:
        return max(self.held)

    @property
    def width_new(self) -> int:
        return max(self.new)


def _layout(rows: Sequence[Row], pad_token_id: int, device: torch.device) -> _Layout:
    held = [len(r.prefix.token_ids) if r.prefix else 0 for r in rows]
    new = [len(r.token_ids) - h for r, h in zip(rows, held, strict=True)]
    width_held, width_new, batch = max(held), max(new), len(rows)
    input_ids = torch.full((batch, width_new), pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, width_held + width_new), dtype=torch.long)
    positions = torch.zeros((batch, width_new), dtype=torch.long)
    for i, (row, h, n) in enumerate(zip(rows, held, new, strict=True)):
        input_ids[i, width_new - n:] = torch.as_tensor(list(row.token_ids[h:]), dtype=torch.long)
        mask[i, width_held - h:width_held] = 1
        mask[i, width_held + width_new - n:] = 1
        positions[i, width_new - n:] = torch.arange(h, h + n)
    cache = DynamicCache(ddp_cache_data=_batched(rows, held, width_held, device) if width_held else None)
    return _Layout(held=held, new=new, input_ids=input_ids.to(device), mask=mask.to(device),
                   positions=positions.to(device), cache=cache)


def _read_long_rows_first(model: Any, rows: Sequence[Row], version: int, pad_token_id: int,
                          device: torch.device) -> list[Row]:
    """``rows`` with the long new parts already read: when rows with many new tokens (a prompt, a re-read after a
    swap) share the round with rows that feed one or a few, the round's first forward would pad every row to the
    longest (``[B, width_new]``); past MAX_PADDED_POSITIONS padded positions the long rows are read in a forward of
    their own (all but their last token, whose logits the round's first step needs), and come back with that as
    their held prefix. The same keys and values, so the same tokens and log-probs to float rounding."""
    new = [len(r.token_ids) - (len(r.prefix.token_ids) if r.prefix else 0) for r in rows]
    short = max(1, min(new))
    long = [i for i, n in enumerate(new) if n > short]
    if not long or (len(rows) - len(long)) * (max(new) - short) <= MAX_PADDED_POSITIONS:
        return list(rows)
    first = [Row(token_ids=rows[i].token_ids[:len(rows[i].token_ids) - short], max_tokens=0, prefix=rows[i].prefix)
             for i in long]
    layout = _layout(first, pad_token_id, device)
    model(input_ids=layout.input_ids, attention_mask=layout.mask, position_ids=layout.positions,
          past_key_values=layout.cache, use_cache=True, logits_to_keep=1)
    out = list(rows)
    width = layout.width_held + layout.width_new
    for j, i in enumerate(long):
        out[i] = Row(token_ids=rows[i].token_ids, max_tokens=rows[i].max_tokens, prefix=Prefix(
            token_ids=list(first[j].token_ids), version=version,
            layers=_row_layers(layout.cache, j, layout.held[j], layout.width_held, layout.new[j], width, 0)))
    return out


@torch.inference_mode()
def decode(model: Any, rows: Sequence[Row], version: int, settings: DecodeSettings,
           device: torch.device) -> list[RowOutput]:
    """One chunk for every row under the active adapter (``version`` labels the prefixes it returns)."""
    rows = _read_long_rows_first(model, rows, version, settings.pad_token_id, device)
    layout = _layout(rows, settings.pad_token_id, device)
    held, new, cache, batch = layout.held, layout.new, layout.cache, len(rows)
    width_held, width_new = layout.width_held, layout.width_new
    warpers = None if settings.greedy else sampling_warpers(settings.temperature, settings.top_p)
    temperature = 1.0 if settings.greedy else settings.temperature
    eos = torch.as_tensor(settings.eos_token_ids, device=device)
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    mask, positions, step_ids = layout.mask, layout.positions, layout.input_ids
    tokens: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    for _ in range(max(r.max_tokens for r in rows)):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].to(dtype=torch.float32)  # [B, V], this step's only
        del out
        if warpers is None:
            token = torch.argmax(logits, dim=-1)
        else:
            token = torch.multinomial(torch.softmax(warpers(None, logits), dim=-1), num_samples=1).squeeze(1)
        token = token * unfinished + settings.pad_token_id * (1 - unfinished)
        tokens.append(token)
        logprobs.append(token_logprobs(logits, token, temperature))
        unfinished = unfinished & ~torch.isin(token, eos)
        if not int(unfinished.max()):
            break
        step_ids = token[:, None]
        mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
        positions = positions[:, -1:] + 1
    all_tokens = torch.stack(tokens, dim=1).cpu()
    all_logprobs = torch.stack(logprobs, dim=1).cpu()
    outputs = []
    for i, row in enumerate(rows):
        ids = all_tokens[i].tolist()
        kept = _kept_steps(ids, settings.eos_token_ids, row.max_tokens)
        prefix = None
        if kept is not None:
            fed = list(row.token_ids) + ids[:kept - 1]
            prefix = Prefix(token_ids=fed, version=version,
                            layers=_row_layers(cache, i, held[i], width_held, new[i], width_held + width_new,
                                               kept - 1))
        outputs.append(RowOutput(token_ids=ids, logprobs=all_logprobs[i].tolist(), prefix=prefix))
    return outputs


def _kept_steps(ids: list[int], eos_token_ids: Sequence[int], max_tokens: int) -> int | None:
    """How many of a row's tokens the caller keeps, or None when an end-of-turn id ends them (no next chunk)."""
    if any(token in eos_token_ids for token in ids[:max_tokens]):
        return None
    return min(len(ids), max_tokens)


def _batched(rows: Sequence[Row], held: list[int], width: int, device: torch.device) -> list[tuple[Any, Any]]:
    """The rows' held keys and values, left-padded to ``width``: per layer ([B, kv, width, hd], same)."""
    sample = next(r.prefix for r in rows if r.prefix is not None)
    layers = []
    for layer, (keys, _) in enumerate(sample.layers):
        shape = (len(rows), keys.shape[1], width, keys.shape[3])
        both = []
        for part in (0, 1):
            batched = keys.new_zeros(shape, device=device)
            for i, row in enumerate(rows):
                if row.prefix is not None:
                    batched[i, :, width - held[i]:] = row.prefix.layers[layer][part][0]
            both.append(batched)
        layers.append((both[0], both[1]))
    return layers


def _row_layers(cache: DynamicCache, row: int, held: int, held_end: int, new: int, new_end: int,
                num_decoded: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``row``'s real keys and values after a round, compacted (no padding): its ``held`` prefix (ending at
    column ``held_end``), its ``new`` tokens (ending at ``new_end``) and the ``num_decoded`` tokens fed after
    them; per layer ([1, kv, len, hd], same)."""
    out = []
    for layer in cache.layers:
        pair = []
        for tensor in (layer.keys, layer.values):
            fed = tensor[row:row + 1, :, new_end - new:new_end + num_decoded]
            pair.append(torch.cat([tensor[row:row + 1, :, held_end - held:held_end], fed], dim=2) if held
                        else fed.clone())
        out.append((pair[0], pair[1]))
    return out
