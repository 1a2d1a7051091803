"""What a behaviour log-prob means, stated once for every backend and the learner's loss.

The log-prob of a sampled token is ``log_softmax(logits / temperature)[token]``, computed in float32 from the
model's raw next-token logits, *before* any top-p / top-k truncation. That is the density the loss's
importance ratio compares against (``current / behaviour``): with ``temperature = 1`` and ``top_p = 1`` it is
exactly the sampling distribution; with truncation it is the untruncated distribution at the same
temperature, which the learner can reproduce from logits alone.

- ``hf`` backend: :func:`token_logprobs` on the logits ``generate`` returns.
- ``vllm`` backend: ``SamplingParams(logprobs=0)`` with ``logprobs_mode="raw_logprobs"`` at temperature 1,
  else the backend rescores the sampled tokens with its temperature.
- learner: :func:`token_logprobs` on the training forward pass, with ``worker.temperature``.

Environment tokens (loss mask 0) carry log-prob 0 and are never used by the loss.
"""

from __future__ import annotations

from typing import Any


def token_logprobs(logits: Any, tokens: Any, temperature: float = 1.0) -> Any:
    """log p(token) under softmax(logits / temperature).  logits [..., T, V], tokens [..., T] -> [..., T] fp32."""
    import torch

    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    picked = torch.gather(scaled, -1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def token_entropy(logits: Any, temperature: float = 1.0) -> Any:
    """Entropy of softmax(logits / temperature) per position: [..., T, V] -> [..., T] fp32."""
    import torch

    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(-1)
