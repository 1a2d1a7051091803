"""The output head on trained positions only: log-probs and entropy from hidden states, a chunk of tokens at a time.

The loss needs, per trained token t, ``log_softmax(h_t W^T / temperature)[target_t]`` (and the entropy of the
same distribution as a metric), with h_t [H] the decoder's last hidden state and W [V, H] the frozen output
head. Computing ``[B, L, V]`` logits for every position of a micro-batch, prompt and padding included, and
then fp32 copies of them for the log-softmax, costs ``B x L x V x 4`` bytes several times over: with
``micro_batch_tokens = 32768`` and V = 151,936, ~20 GB per copy. :func:`trained_logprobs` instead takes the
T selected hidden states and walks them in chunks of :func:`chunk_tokens` tokens:

    forward   for each chunk c:  z_c = (h_c W^T).float() / temperature        [c, V] fp32, freed after the chunk
                                 lse_c = logsumexp(z_c);  logp_c = z_c[target] - lse_c;  entropy_c
              saved for backward: h [T, H], W, targets [T], lse [T]            (no [T, V] tensor survives)
    backward  for each chunk c:  z_c again, p_c = exp(z_c - lse_c)
                                 dz_c = g_c (onehot(target_c) - p_c) / temperature
                                 dh_c = dz_c W                                  [c, H]

so the peak is a few ``[chunk, V]`` fp32 tensors whatever T is. The numbers are those of
:func:`common.logprobs.token_logprobs` / :func:`common.logprobs.token_entropy` on full logits (the matmul runs in
the compute dtype and is upcast, as ``logits.float()`` does), to rounding. W is frozen: loraflow never trains
the output head (:mod:`common.lora_targets` refuses it), so no gradient is computed for it.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

#: the [chunk, V] fp32 logits of one chunk stay under this (a few such tensors are alive at once)
CHUNK_BYTES = 64 << 20


def chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one fp32 [chunk, V] tensor stays under ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[c, H] x [V, H] -> [c, V] fp32 logits / temperature (the matmul in the compute dtype, then upcast)."""
    logits = F.linear(hidden, weight).float()
    return logits / temperature if temperature != 1.0 else logits


class _TrainedLogprobs(torch.autograd.Function):
    """(hidden [T, H], weight [V, H], targets [T]) -> (logp [T] fp32 with gradient, entropy [T] fp32 detached)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = hidden.shape[0]
        logp = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            scaled = _chunk_logits(hidden[start:end], weight, temperature)                # [c, V]
            chunk_lse = torch.logsumexp(scaled, dim=-1)                                  # [c]
            lse[start:end] = chunk_lse
            logp[start:end] = scaled.gather(-1, targets[start:end, None]).squeeze(-1) - chunk_lse
            if with_entropy:
                log_probs = scaled.sub_(chunk_lse[:, None])                              # [c, V] in place
                entropy[start:end] = -(log_probs.exp() * log_probs).sum(-1)
            del scaled
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor | None):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        rows = torch.arange(min(ctx.chunk, hidden.shape[0]), device=hidden.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            g = grad_logp[start:end].float()                                             # [c]
            scaled = _chunk_logits(hidden[start:end], weight, ctx.temperature)           # [c, V]
            grad_logits = scaled.sub_(lse[start:end, None]).exp_().mul_(-g[:, None])     # -g p, in place
            grad_logits[rows[:end - start], targets[start:end]] += g                     # + g onehot
            if ctx.temperature != 1.0:
                grad_logits /= ctx.temperature
            grad_hidden[start:end] = grad_logits.to(weight.dtype) @ weight               # [c, H]
            del scaled, grad_logits
        return grad_hidden, None, None, None, None, None


def trained_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *,
                     with_entropy: bool = True, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies under softmax(hidden W^T / temperature), chunk by chunk.

    hidden [T, H] (compute dtype, may require grad), weight [V, H] frozen, targets [T] int -> (logp [T] fp32 with
    gradient to ``hidden``, entropy [T] fp32 without; zeros when ``with_entropy`` is False).
    """
    assert not weight.requires_grad, "the output head is frozen (common.lora_targets refuses lm_head)"
    chunk = chunk or chunk_tokens(weight.shape[0])
    return _TrainedLogprobs.apply(hidden, weight, targets.long(), float(temperature), int(chunk), with_entropy)
