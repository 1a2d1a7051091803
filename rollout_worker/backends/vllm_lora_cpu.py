"""LoRA matmuls for vLLM's CPU platform grouped by adapter: one GEMM per adapter in the step, not a gather per token.

vLLM's CPU punica wrapper (``vllm.lora.punica_wrapper.punica_cpu``) applies LoRA with its torch ops
(``vllm.lora.ops.torch_ops``), which gather each token's adapter weights (``weights[token_indices]``: a
``[num_tokens, out, in]`` copy per projection and slice) and contract them token by token. With the tiny model and
rank 16 that costs ~0.4 ms per token, prefill or decode alike, about 7x the base model's prefill: it is what made an
adapter swap's re-prefill expensive on CPU (BENCHMARKS.md, generation). The weights of a step belong to one or two
adapters, so the same products are a GEMM per adapter over that adapter's rows (``x[rows] @ W[a].T``), with the
same inputs, weights, scaling and dtype casts; results agree with the torch ops to float rounding
(tests/worker/test_vllm_lora_cpu.py).

Rows whose index is -1 (a request without an adapter: punica's "no LoRA") get no LoRA term. vLLM's torch ops index
the weights with -1 as Python does, i.e. they apply the *last* adapter slot to base-model tokens of a decode step
(zeros while that slot is empty); the grouped ops apply nothing, which is what punica's index convention says.

How it gets into the engine: :class:`WorkerExtension` is passed to vLLM as ``worker_extension_cls`` (its qualname).
vLLM imports this module in its worker process, which runs :func:`install` at import and replaces the six op names
``punica_cpu`` calls (the module's globals: they are looked up at each call). The extension's one method lets the
caller ask the worker whether the grouped ops are in place (``collective_rpc``). Nothing changes on other platforms:
the backend passes the extension only when vLLM's platform is the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: the names punica_cpu imports from vllm.lora.ops.torch_ops, replaced by :func:`install`
OP_NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


@dataclass(frozen=True, slots=True)
class RowGroups:
    """Which rows of a step each adapter slot serves: ``single`` is the slot of every row (-1: none) when one
    serves them all; else ``order`` lists the rows that have a slot, grouped by slot, and ``bounds`` gives each
    slot's (slot, start, end) range in ``order`` (rows of -1 are in none)."""

    num_rows: int
    single: int | None
    order: torch.Tensor | None = None
    bounds: tuple[tuple[int, int, int], ...] = ()


def row_groups(indices: torch.Tensor) -> RowGroups:
    """The rows per adapter slot of one index per row."""
    first = int(indices[0]) if indices.numel() else -1
    if not indices.numel() or bool((indices == first).all()):
        return RowGroups(num_rows=indices.numel(), single=first)
    order = torch.argsort(indices, stable=True)
    slots = indices[order]
    without = int((slots < 0).sum())  # sorted first: no LoRA term for them
    slots, counts = torch.unique_consecutive(slots[without:], return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    return RowGroups(num_rows=indices.numel(), single=None, order=order[without:],
                     bounds=tuple((slot, end - count, end)
                                  for slot, count, end in zip(slots.tolist(), counts.tolist(), ends, strict=True)))


class StepGroups:
    """Row groups computed once per content of the index tensors they come from, not once per op call.

    A forward pass calls the ops ~10 times per layer with the same indices (the punica wrapper's per-step
    buffers), and finding the rows of each slot (``unique``, ``nonzero``) costs more than a small GEMM. An entry is
    reused only for the same storage, offset and shape at the same version counter (any in-place write, as
    vLLM's ``update_metadata`` does each step the mapping changes, bumps it); it holds its source tensors, so
    their memory cannot be freed and reused by other tensors while it is kept. At most ``size`` entries. A tensor
    created under ``torch.inference_mode`` has no version counter: its groups are computed each call, uncached."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: dict[tuple, tuple[tuple[torch.Tensor, ...], tuple[int, ...], RowGroups]] = {}

    def get(self, sources: tuple[torch.Tensor, ...], compute: Callable[[], RowGroups]) -> RowGroups:
        if any(t.is_inference() for t in sources):
            return compute()
        key = tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in sources)
        versions = tuple(t._version for t in sources)
        entry = self._entries.get(key)
        if entry is not None and entry[1] == versions:
            return entry[2]
        if len(self._entries) >= self.size:
            self._entries.clear()
        groups = compute()
        self._entries[key] = (sources, versions, groups)
        return groups


_step_groups = StepGroups()


def decode_groups(indices: torch.Tensor) -> RowGroups:
    """Row groups of one index per row (the decode ops' metadata)."""
    return _step_groups.get((indices,), lambda: row_groups(indices))


def prefill_groups(lora_indices: torch.Tensor, seq_len: torch.Tensor) -> RowGroups:
    """Row groups of one index per sequence of ``seq_len`` rows (the prefill ops' metadata)."""
    return _step_groups.get((lora_indices, seq_len),
                            lambda: row_groups(torch.repeat_interleave(lora_indices, seq_len)))


def lora_products(inputs: torch.Tensor, weights: torch.Tensor, slot: int, dtype: torch.dtype) -> torch.Tensor:
    """``[num_rows, out]``: ``inputs @ weights[slot].T`` in ``dtype``, every row under one adapter slot (-1: none,
    zeros). ``weights`` is ``[num_slots, out, in]`` or ``[num_slots, 1, out, in]`` (vLLM's stacked LoRA A or B)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    if slot < 0:
        return inputs.new_zeros(inputs.shape[0], weights.shape[-2], dtype=dtype)
    return inputs.to(dtype=dtype) @ weights[slot].to(dtype=dtype).t()


def products_into(target: torch.Tensor, inputs: torch.Tensor, weights: torch.Tensor, rows: RowGroups, *,
                  add: bool, scaling: float = 1.0) -> None:
    """Rows under several adapters: ``target[i]`` (``[num_rows, width]``) set to, or with ``add`` increased by,
    ``scaling * inputs[i] @ weights[slot of i].T`` (its first ``width`` columns); rows of -1 get no LoRA term (set
    to 0, or left). One gather, one GEMM per slot on its contiguous rows, one scatter."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    assert rows.order is not None
    grouped = inputs.index_select(0, rows.order).to(dtype=target.dtype)
    products = grouped.new_empty(grouped.shape[0], weights.shape[-2])
    for slot, start, end in rows.bounds:
        torch.mm(grouped[start:end], weights[slot].to(dtype=target.dtype).t(), out=products[start:end])
    products = products[:, :target.shape[1]]
    if scaling != 1.0:
        products.mul_(scaling)
    if add:
        target.index_add_(0, rows.order, products)
        return
    if rows.order.numel() < rows.num_rows:
        target.zero_()
    target.index_copy_(0, rows.order, products)


def _rows_match(inputs: torch.Tensor, rows: RowGroups) -> bool:
    """The torch ops' shapes the grouped ops handle: one index per input row (else the torch op runs)."""
    return inputs.dim() == 2 and inputs.shape[0] == rows.num_rows > 0


def _shrink(inputs: torch.Tensor, weights: torch.Tensor, output_tensor: torch.Tensor, rows: RowGroups,
            scaling: float) -> None:
    width = weights.shape[-2]
    if rows.single is None:
        return products_into(output_tensor[:, :width], inputs, weights, rows, add=False, scaling=scaling)
    output_tensor[:, :width] = scaling * lora_products(inputs, weights, rows.single, output_tensor.dtype)


def _expand(inputs: torch.Tensor, weights: torch.Tensor, output_tensor: torch.Tensor, rows: RowGroups,
            add_inputs: bool) -> None:
    common = min(weights.shape[-2], output_tensor.shape[1])  # the adapter and the model may pad differently
    if rows.single is None and output_tensor.shape[0] == rows.num_rows:
        return products_into(output_tensor[:, :common], inputs, weights, rows, add=add_inputs)
    if rows.single is None:  # other row counts (the torch op's broadcasting rules below): the products first
        outputs = output_tensor.new_zeros(rows.num_rows, common)
        products_into(outputs, inputs, weights, rows, add=False)
    else:
        outputs = lora_products(inputs, weights, rows.single, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def _expand_slice(inputs: torch.Tensor, weights: torch.Tensor, output_tensor: torch.Tensor, rows: RowGroups,
                  slice_offset: int, slice_size: int, add_inputs: bool) -> None:
    target = output_tensor[:, slice_offset:slice_offset + slice_size]
    if rows.single is None:
        return products_into(target, inputs, weights, rows, add=add_inputs)
    outputs = lora_products(inputs, weights, rows.single, output_tensor.dtype)
    if add_inputs:
        target += outputs
    else:
        target[:] = outputs


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    rows = decode_groups(lora_indices_tensor)
    if not _rows_match(inputs, rows):
        return _stock.bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    _shrink(inputs, lora_b_weights, output_tensor, rows, scaling)


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    rows = decode_groups(lora_indices_tensor)
    if not _rows_match(inputs, rows):
        return _stock.bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    _expand(inputs, lora_b_weights, output_tensor, rows, add_inputs)


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    rows = decode_groups(lora_indices_tensor)
    if not _rows_match(inputs, rows):
        return _stock.bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
                                        slice_size, add_inputs)
    _expand_slice(inputs, lora_b_weights, output_tensor, rows, slice_offset, slice_size, add_inputs)


def sgmv_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor, output_tensor: torch.Tensor,
                b_seq_start_loc: torch.Tensor, seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int, scaling: float) -> None:
    rows = prefill_groups(lora_indices_tensor, seq_len_tensor)
    if not _rows_match(inputs, rows):
        return _stock.sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                                  lora_indices_tensor, batches, max_seq_length, token_nums, scaling)
    _shrink(inputs, lora_a_weights, output_tensor, rows, scaling)


def sgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                b_seq_start_loc: torch.Tensor, seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int, add_inputs: bool = False) -> None:
    rows = prefill_groups(lora_indices_tensor, seq_len_tensor)
    if not _rows_match(inputs, rows):
        return _stock.sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                                  lora_indices_tensor, batches, max_seq_length, token_nums, add_inputs)
    _expand(inputs, lora_b_weights, output_tensor, rows, add_inputs)


def sgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      b_seq_start_loc: torch.Tensor, seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                      batches: int, max_seq_length: int, token_nums: int, slice_offset: int, slice_size: int,
                      add_inputs: bool = False) -> None:
    rows = prefill_groups(lora_indices_tensor, seq_len_tensor)
    if not _rows_match(inputs, rows):
        return _stock.sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                                        lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset,
                                        slice_size, add_inputs)
    _expand_slice(inputs, lora_b_weights, output_tensor, rows, slice_offset, slice_size, add_inputs)


_stock: Any = None  # vllm.lora.ops.torch_ops, for shapes the grouped ops leave to it


def install() -> bool:
    """Point vLLM's CPU punica wrapper at the grouped ops; False where vLLM (or that wrapper) is not importable."""
    global _stock
    try:
        from vllm.lora.ops import torch_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    _stock = torch_ops
    for name in OP_NAMES:
        setattr(punica_cpu, name, globals()[name])
    return True


def installed() -> bool:
    """Whether punica_cpu calls the grouped ops in this process."""
    try:
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    return all(getattr(punica_cpu, name, None) is globals()[name] for name in OP_NAMES)


class WorkerExtension:
    """vLLM ``worker_extension_cls``: importing this module in the worker installs the grouped ops."""

    def loraflow_grouped_lora_ops(self) -> bool:
        """Whether the grouped ops are in place in this worker (``LLM.collective_rpc``)."""
        return installed()


INSTALLED_AT_IMPORT = install()  # importing this module in vLLM's worker process is what installs the ops
