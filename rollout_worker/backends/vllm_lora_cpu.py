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

from typing import Any

import torch

#: the names punica_cpu imports from vllm.lora.ops.torch_ops, replaced by :func:`install`
OP_NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def lora_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """``[num_rows, out]``: row i is ``inputs[i] @ weights[indices[i]].T`` in ``dtype`` (zero where the index is -1).

    ``weights`` is ``[num_slots, out, in]`` or ``[num_slots, 1, out, in]`` (vLLM's stacked LoRA A or B)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype=dtype)
    first = int(indices[0]) if indices.numel() else -1
    if indices.numel() and bool((indices == first).all()):  # one adapter for the whole step: one GEMM, no masks
        if first < 0:
            return inputs.new_zeros(inputs.shape[0], weights.shape[-2])
        return inputs @ weights[first].to(dtype=dtype).t()
    out = inputs.new_zeros(inputs.shape[0], weights.shape[-2])
    for slot in indices.unique().tolist():
        if slot < 0:
            continue
        rows = (indices == slot).nonzero(as_tuple=True)[0]
        out[rows] = inputs[rows] @ weights[slot].to(dtype=dtype).t()
    return out


def _rows_match(inputs: torch.Tensor, indices: torch.Tensor) -> bool:
    """The torch ops' shapes the grouped ops handle: one index per input row (else the torch op runs)."""
    return inputs.dim() == 2 and inputs.shape[0] == indices.shape[0] and indices.numel() > 0


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    if not _rows_match(inputs, lora_indices_tensor):
        return _stock.bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, :outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    if not _rows_match(inputs, lora_indices_tensor):
        return _stock.bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])  # the adapter and the model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    if not _rows_match(inputs, lora_indices_tensor):
        return _stock.bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset,
                                        slice_size, add_inputs)
    outputs = lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset:slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset:slice_offset + slice_size] = outputs


def _token_indices(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> torch.Tensor:
    """Prefill metadata (one adapter index per sequence) as one index per token, as the torch ops expand it."""
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs: torch.Tensor, lora_a_weights: torch.Tensor, output_tensor: torch.Tensor,
                b_seq_start_loc: torch.Tensor, seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int, scaling: float) -> None:
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _token_indices(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                b_seq_start_loc: torch.Tensor, seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                batches: int, max_seq_length: int, token_nums: int, add_inputs: bool = False) -> None:
    bgmv_expand(inputs, lora_b_weights, output_tensor, _token_indices(lora_indices_tensor, seq_len_tensor),
                add_inputs)


def sgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      b_seq_start_loc: torch.Tensor, seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                      batches: int, max_seq_length: int, token_nums: int, slice_offset: int, slice_size: int,
                      add_inputs: bool = False) -> None:
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, _token_indices(lora_indices_tensor, seq_len_tensor),
                      slice_offset, slice_size, add_inputs)


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
