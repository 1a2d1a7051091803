"""The output head on trained positions only: log-probs and entropy from hidden states, a chunk of tokens at a time.

The loss needs, per trained token t, ``log_softmax(h_t W^T / temperature)[target_t]`` (and the entropy of the
same distribution as a metric), with h_t [H] the decoder's last hidden state and W [V, H] the frozen output
head. Computing ``[B, L, V]`` logits for every position of a micro-batch, prompt and padding included, and
then fp32 copies of them for the log-softmax, costs ``B x L x V x 4`` bytes several times over: with
``micro_batch_tokens = 32768`` and V = 151,936, ~20 GB per copy. :func:`trained_logprobs` instead takes the
T selected hidden states and walks them in chunks of :func:`chunk_tokens` tokens:

    forward   for each chunk c:  z_c = (h_c W^T).float() / temperature        [c, V] fp32, freed after the chunk
                                 lse_c = logsumexp(z_c);  logp_c = z_c[target] - lse_c;  entropy_c
              saved for backward: h [T, H], targets [T], lse [T]               (no [T, V] tensor survives)
    backward  for each chunk c:  z_c again, p_c = exp(z_c - lse_c)
                                 dz_c = g_c (onehot(target_c) - p_c) / temperature
                                 dh_c = dz_c W                                  [c, H]

so the peak is a few ``[chunk, V]`` fp32 tensors whatever T is. With several ranks W comes in pieces of V / R
rows (:mod:`loraflow.learner.vocab`: the head is row-sharded, never gathered whole); the logsumexp and the entropy are
merged piece by piece, and the backward walks the pieces again. The numbers are those of
:func:`loraflow.common.logprobs.token_logprobs` / :func:`loraflow.common.logprobs.token_entropy` on full logits (the matmul runs in
the compute dtype and is upcast, as ``logits.float()`` does), to rounding. W is frozen: loraflow never trains
the output head (:mod:`loraflow.common.lora_targets` refuses it), so no gradient is computed for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch.nn import functional as F

from loraflow.learner.vocab import VocabRows

#: the [chunk, V] fp32 logits of one chunk stay under this (a few such tensors are alive at once)
CHUNK_BYTES = 64 << 20


def chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one fp32 [chunk, V] tensor stays under ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """[c, H] x [V, H] -> [c, V] fp32 logits / temperature (the matmul in the compute dtype, then upcast)."""
    logits = F.linear(hidden, weight).float()
    return logits / temperature if temperature != 1.0 else logits


def _pieces(weight: torch.Tensor | VocabRows) -> Callable[[], Iterator[tuple[int, torch.Tensor]]]:
    if isinstance(weight, VocabRows):
        return weight.pieces
    return lambda: iter([(0, weight)])


class _TrainedLogprobs(torch.autograd.Function):
    """(hidden [T, H], targets [T]; the head's pieces) -> (logp [T] fp32 with gradient, entropy [T] fp32 detached).

    The vocabulary comes in pieces (a rank's rows of the head, :class:`loraflow.learner.vocab.VocabRows`; one piece, the
    whole head, on one rank): per token, the logsumexp and the entropy are merged piece by
    piece (``lse = logaddexp(lse, lse_piece)``), the target's logit comes from the piece that holds it."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int,
                with_entropy: bool, pieces: Callable[[], Iterator[tuple[int, torch.Tensor]]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = hidden.shape[0]
        lse = torch.full((num_tokens,), -math.inf, dtype=torch.float32, device=hidden.device)
        target_logit = torch.zeros_like(lse)
        entropy = torch.zeros_like(lse)  # of the pieces so far
        for index, (first, weight) in enumerate(pieces()):
            size = weight.shape[0]
            local = targets - first
            inside = (local >= 0) & (local < size)
            whole = bool(inside.all())  # every target in this piece (one rank: the whole head)
            local = local if whole else local.clamp(0, size - 1)
            for start in range(0, num_tokens, chunk):
                end = min(start + chunk, num_tokens)
                scaled = _chunk_logits(hidden[start:end], weight, temperature)                # [c, n]
                piece_lse = torch.logsumexp(scaled, dim=-1)                                  # [c]
                picked = scaled.gather(-1, local[start:end, None]).squeeze(-1)
                target_logit[start:end] += picked if whole else torch.where(inside[start:end], picked, 0.0)
                piece_entropy = None
                if with_entropy:
                    log_q = scaled.sub_(piece_lse[:, None])                                  # [c, n] in place
                    piece_entropy = -(log_q.exp() * log_q).sum(-1)                           # [c]
                if index == 0:  # the first piece (the whole head on one rank)
                    lse[start:end] = piece_lse
                    if with_entropy:
                        entropy[start:end] = piece_entropy
                    continue
                before = lse[start:end]
                merged = torch.logaddexp(before, piece_lse)
                if with_entropy:  # H = sum_pieces w (H_piece + lse - lse_piece), w = exp(lse_piece - lse)
                    entropy[start:end] = ((before - merged).exp() * (entropy[start:end] + merged - before)
                                          + (piece_lse - merged).exp() * (piece_entropy + merged - piece_lse))
                lse[start:end] = merged
                del scaled
        logp = target_logit - lse
        ctx.save_for_backward(hidden, targets, lse)
        ctx.temperature, ctx.chunk, ctx.pieces = temperature, chunk, pieces
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor | None):
        hidden, targets, lse = ctx.saved_tensors
        num_tokens = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden)  # the first piece's, then an fp32 sum over the pieces
        for index, (first, weight) in enumerate(ctx.pieces()):
            if index == 1:
                grad_hidden = grad_hidden.float()
            size = weight.shape[0]
            local = targets - first
            inside = (local >= 0) & (local < size)
            for start in range(0, num_tokens, ctx.chunk):
                end = min(start + ctx.chunk, num_tokens)
                g = grad_logp[start:end].float()                                             # [c]
                scaled = _chunk_logits(hidden[start:end], weight, ctx.temperature)           # [c, n]
                grad_logits = scaled.sub_(lse[start:end, None]).exp_().mul_(-g[:, None])     # -g p, in place
                hit = inside[start:end].nonzero().squeeze(-1)
                grad_logits[hit, local[start:end][hit]] += g[hit]                            # + g onehot
                if ctx.temperature != 1.0:
                    grad_logits /= ctx.temperature
                piece_grad = grad_logits.to(weight.dtype) @ weight                           # [c, H]
                if index == 0:
                    grad_hidden[start:end] = piece_grad
                else:
                    grad_hidden[start:end] += piece_grad
                del scaled, grad_logits
        return grad_hidden.to(hidden.dtype), None, None, None, None, None


def trained_logprobs(hidden: torch.Tensor, weight: torch.Tensor | VocabRows, targets: torch.Tensor,
                     temperature: float = 1.0, *, with_entropy: bool = True,
                     chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies under softmax(hidden W^T / temperature), chunk by chunk.

    hidden [T, H] (compute dtype, may require grad), weight [V, H] frozen (a tensor, or the rank's rows of it:
    collective then, in forward and in backward), targets [T] int -> (logp [T] fp32 with gradient to ``hidden``,
    entropy [T] fp32 without; zeros when ``with_entropy`` is False).
    """
    if isinstance(weight, torch.Tensor):
        assert not weight.requires_grad, "the output head is frozen (loraflow.common.lora_targets refuses lm_head)"
    vocab_size = weight.shape[0] if isinstance(weight, torch.Tensor) else weight.vocab_size
    chunk = chunk or chunk_tokens(vocab_size)
    return _TrainedLogprobs.apply(hidden, targets.long(), float(temperature), int(chunk), with_entropy,
                                  _pieces(weight))
