"""Rows longer than the token budget, trained in segments of at most ``learner.micro_batch_tokens`` positions.

A micro-batch packs rows (longest first) while rows x longest row fits the budget (:mod:`loraflow.learner.data`); a single
row longer than the budget is cut into n = ceil(L / budget) near-equal segments s_0 .. s_{n-1}. Causal attention
lets segment i read the keys and values (K, V) of segments 0 .. i, which depend on the LoRA parameters, so the
loss of segment i has gradients through the K, V of every earlier segment. The passes of such a row::

    pass 1 (no grad)   for i = 0 .. n-2:   forward s_i, past = K, V of s_0..s_{i-1}  ->  K_i, V_i kept (every layer)
    pass 2 (grad)      for i = n-1 .. 0:   forward s_i again, past = K, V of s_0..s_{i-1} as leaf tensors;
                                           head on s_i's trained positions (loraflow.learner.head), loss_i;
                                           backward from loss_i and from s_i's own K_i, V_i with dK_i, dV_i
                                           (what the later segments sent back); the leaves' gradients are
                                           added to dK, dV of s_0..s_{i-1}

so the gradient of every parameter is the sum over segments of exactly the terms the unsplit row's backward
sums: the same log-probs, loss and gradients (to rounding; tests/learner/test_segments.py checks 1e-5 in fp32).
The RNG state of each segment's pass-1 forward is restored for its pass-2 forward, so LoRA dropout draws the
same masks in both.

What a segment holds: its own activations (one budget's worth, or one layer's with activation checkpointing),
its attention over past + own keys, and for the whole row K, V of every layer in the compute dtype plus their
gradient accumulators in fp32: 2 x layers x kv_heads x head_dim values per token, 8 bytes each in bf16 (with the
running segment's leaf gradient): 112 KiB per token for the Qwen2-1.5B shape, 3.5 GiB for a 32k-token row,
against ~80 GiB of activations unsplit without checkpointing (BENCHMARKS.md "Learner memory"). The cost is
time: pass 1 is n - 1 extra no-grad forwards of the row's segments.

Every forward is collective under FSDP2, so every rank must run the same sequence of passes. A rank's work is
a list of *no-grad forwards* (N: the KL reference's forward, pass 1) and *forward+backward* (G) passes;
:func:`aligned` merges the ranks' lists (an N wherever some rank needs one, else a G) and gives each rank a
one-position empty pass where it has nothing of that kind to run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

NO_GRAD, GRAD = "N", "G"


def segment_bounds(length: int, budget_tokens: int) -> tuple[int, ...]:
    """(0, b_1, .., length): n = ceil(length / budget) near-equal segments, each of at most ``budget_tokens``."""
    num = max(1, math.ceil(length / budget_tokens))
    return tuple(round(i * length / num) for i in range(num + 1))


def pass_kinds(num_segments: int, with_reference: bool) -> list[str]:
    """The passes of one micro-batch: the reference forwards (KL), pass 1, pass 2."""
    reference = [NO_GRAD] * num_segments if with_reference else []
    return reference + [NO_GRAD] * (num_segments - 1) + [GRAD] * num_segments


def aligned(kinds_per_rank: Sequence[Sequence[str]], rank: int) -> list[tuple[str, int | None]]:
    """The common pass sequence of all ranks, as (kind, index into ``kinds_per_rank[rank]`` or None for an empty
    pass). At each step, if any rank's next pass is a no-grad forward, every rank runs one (theirs or an empty
    one); else every rank runs a forward+backward. Each rank's passes keep their order."""
    position = [0] * len(kinds_per_rank)
    out: list[tuple[str, int | None]] = []
    while any(p < len(k) for p, k in zip(position, kinds_per_rank, strict=True)):
        nexts = [k[p] if p < len(k) else None for p, k in zip(position, kinds_per_rank, strict=True)]
        kind = NO_GRAD if NO_GRAD in nexts else GRAD
        out.append((kind, position[rank] if nexts[rank] == kind else None))
        for r, n in enumerate(nexts):
            position[r] += n == kind
    return out


class _PastLayer(CacheLayerMixin):
    """One decoder layer's keys and values of the earlier segments, fixed: ``update`` returns them followed by
    the segment's own (recorded in ``new``) and stores nothing, so a checkpointed layer's recompute sees the
    same past."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        super().__init__()
        self.keys, self.values = keys, values        # [B, kv_heads, P, head_dim] or None
        self.is_initialized = keys is not None
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.new is None:  # the first call; a recompute (activation checkpointing) must not replace it
            self.new = (key_states, value_states)
        if self.keys is None:
            return key_states, value_states
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    def get_seq_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


def past_cache(past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None, num_layers: int) -> Cache:
    """A cache whose layer l holds ``past[l]`` (keys, values), or nothing for the first segment."""
    layers = [_PastLayer(*(past[n] if past is not None else (None, None))) for n in range(num_layers)]
    return Cache(layers=layers)


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


#: (input_ids [B, S], select [B, S], targets [T], past cache or None, with_entropy) -> (logp [T], entropy [T])
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Cache | None, bool], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True, kw_only=True)
class SplitRow:
    """The state of one row run in segments: pass 1's keys and values and pass 2's gradients for them."""

    input_ids: torch.Tensor   # [1, L]
    select: torch.Tensor      # [1, L] bool
    targets: torch.Tensor     # [1, L]
    bounds: tuple[int, ...]
    num_layers: int
    keys: list[torch.Tensor] = field(default_factory=list)        # [L] of [1, kv_heads, b_{n-1}, head_dim]
    values: list[torch.Tensor] = field(default_factory=list)
    grad_keys: list[torch.Tensor] = field(default_factory=list)   # the same, fp32
    grad_values: list[torch.Tensor] = field(default_factory=list)
    rng_states: dict[int, tuple] = field(default_factory=dict)    # segment -> its pass-1 RNG state
    logp: dict[int, torch.Tensor] = field(default_factory=dict)   # segment -> [T_i] detached (pass 2)
    ref_keys: list[torch.Tensor] = field(default_factory=list)    # the KL reference's, while it runs
    ref_values: list[torch.Tensor] = field(default_factory=list)
    ref_logp: list[torch.Tensor] = field(default_factory=list)    # segment by segment, [T_i]

    @property
    def num_segments(self) -> int:
        return len(self.bounds) - 1

    def token_range(self, i: int) -> tuple[int, int]:
        """The segment's trained tokens, as a slice of the row's [T] (row-major order)."""
        counts = self.select[0].cumsum(0)
        start, end = self.bounds[i], self.bounds[i + 1]
        return int(counts[start - 1]) if start else 0, int(counts[end - 1])

    def _piece(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        start, end = self.bounds[i], self.bounds[i + 1]
        select = self.select[:, start:end]
        return self.input_ids[:, start:end], select, self.targets[:, start:end][select]

    def _past(self, keys: list[torch.Tensor], values: list[torch.Tensor], i: int,
              leaves: bool) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if i == 0:
            return None
        end = self.bounds[i]
        if not leaves:
            return [(k[..., :end, :], v[..., :end, :]) for k, v in zip(keys, values, strict=True)]
        return [(k[..., :end, :].detach().requires_grad_(), v[..., :end, :].detach().requires_grad_())
                for k, v in zip(keys, values, strict=True)]

    def _keep(self, keys: list[torch.Tensor], values: list[torch.Tensor], cache: Cache, i: int) -> None:
        """Write segment i's recorded keys and values into the row's (allocated at the first segment)."""
        start, end = self.bounds[i], self.bounds[i + 1]
        width = self.bounds[-2]  # the last segment's own keys are never anyone's past
        for n, layer in enumerate(cache.layers):
            key, value = layer.new
            if len(keys) <= n:
                keys.append(key.new_empty(*key.shape[:-2], width, key.shape[-1]))
                values.append(value.new_empty(*value.shape[:-2], width, value.shape[-1]))
            keys[n][..., start:end, :] = key
            values[n][..., start:end, :] = value

    def reference_pass(self, forward: Forward, i: int) -> None:
        """Segment i (0 .. n-1) of the row's forward under the KL reference, no gradient: its log-probs into
        ``ref_logp`` (its own keys and values, freed after the last segment)."""
        with torch.no_grad():
            cache = past_cache(self._past(self.ref_keys, self.ref_values, i, leaves=False), self.num_layers)
            ids, select, targets = self._piece(i)
            logp, _ = forward(ids, select, targets, cache, False)
        self.ref_logp.append(logp)
        if i < self.num_segments - 1:
            self._keep(self.ref_keys, self.ref_values, cache, i)
        else:
            self.ref_keys, self.ref_values = [], []

    def first_pass(self, forward: Forward, i: int) -> None:
        """Pass 1 for segment i (0 .. n-2): its keys and values under the current parameters, no gradient."""
        self.rng_states[i] = _rng_state(self.input_ids.device)
        with torch.no_grad():
            cache = past_cache(self._past(self.keys, self.values, i, leaves=False), self.num_layers)
            ids, select, _ = self._piece(i)
            forward(ids, torch.zeros_like(select), self.targets.new_zeros(0), cache, False)
        self._keep(self.keys, self.values, cache, i)

    def second_pass(self, forward: Forward, i: int,
                    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Pass 2 for segment i (n-1 .. 0): forward with gradient, ``loss_of(logp, entropy)`` (a scalar), and one
        backward from it and from the segment's keys and values."""
        last = i == self.num_segments - 1
        if not last:
            _set_rng_state(self.input_ids.device, self.rng_states.pop(i))
        past = self._past(self.keys, self.values, i, leaves=True)
        cache = past_cache(past, self.num_layers)
        ids, select, targets = self._piece(i)
        logp, entropy = forward(ids, select, targets, cache, True)
        self.logp[i] = logp.detach()
        roots, grads = [loss_of(logp, entropy)], [None]
        if not last:
            start, end = self.bounds[i], self.bounds[i + 1]
            for layer, grad_key, grad_value in zip(cache.layers, self.grad_keys, self.grad_values, strict=True):
                for tensor, grad in zip(layer.new, (grad_key, grad_value), strict=True):
                    if tensor.requires_grad:
                        roots.append(tensor)
                        grads.append(grad[..., start:end, :].to(tensor.dtype))
        torch.autograd.backward(roots, grads)
        if past is None:
            return
        if not self.grad_keys:
            self.grad_keys = [torch.zeros_like(k, dtype=torch.float32) for k in self.keys]
            self.grad_values = [torch.zeros_like(v, dtype=torch.float32) for v in self.values]
        end = self.bounds[i]
        for (key, value), grad_key, grad_value in zip(past, self.grad_keys, self.grad_values, strict=True):
            if key.grad is not None:
                grad_key[..., :end, :] += key.grad
            if value.grad is not None:
                grad_value[..., :end, :] += value.grad

    def trained_logp(self) -> torch.Tensor:
        """[T] the row's log-probs from pass 2, in token order."""
        return torch.cat([self.logp[i] for i in range(self.num_segments)])
