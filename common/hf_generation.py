"""transformers ``generate`` under loraflow's sampling settings and nothing else.

A model directory often ships a ``generation_config.json`` with its own sampling defaults (top_k, top_p,
temperature, repetition_penalty, no_repeat_ngram_size, min_length, ...), and transformers merges them into every
``generate`` call whose own config leaves a field unset; unset, ``top_k`` is 50 even without one. Any of them
would change which tokens are sampled while the behaviour log-probs (:mod:`loraflow.common.logprobs`: log-softmax of the
raw logits / temperature) say nothing about it, so the learner's importance ratios would be silently wrong.

:func:`neutralise` replaces a loaded model's generation defaults with transformers' bare ones (keeping only its
bos / eos / pad ids), and :func:`generation_config` builds the config of
one call from loraflow's settings, with top-k switched off explicitly. The hf backend and the held-out
evaluation both generate through these two. :func:`sampling_warpers` is the same sampling for a decode loop of
one's own (the hf backend's KV-cached chunks, :mod:`loraflow.rollout_worker.backends.hf_decode`): the warpers
``generate`` applies under :func:`generation_config`, in its order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def neutralise(model: Any) -> None:
    """Drop the model's own sampling defaults (from its ``generation_config.json``; a PeftModel's base's), keeping
    its special token ids (the end-of-turn ids are read from there)."""
    from transformers import GenerationConfig

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = getattr(inner, "generation_config", None)
    if own is None:  # not a transformers model: it has no defaults to drop
        return
    inner.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id,
                                               pad_token_id=own.pad_token_id)


def generation_config(*, greedy: bool, max_new_tokens: int, eos_token_ids: Sequence[int], pad_token_id: int,
                      temperature: float = 1.0, top_p: float = 1.0, **outputs: Any) -> Any:
    """One ``generate`` call's config: greedy, or sampling at ``temperature`` with ``top_p`` and no top-k.

    ``outputs`` passes output options through (``output_logits=True, return_dict_in_generate=True``).
    """
    from transformers import GenerationConfig

    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}
    return GenerationConfig(do_sample=not greedy, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                            eos_token_id=list(eos_token_ids), **sampling, **outputs)


def sampling_warpers(temperature: float, top_p: float) -> Any:
    """The logits warpers ``generate`` applies when sampling under :func:`generation_config` (temperature, then
    top-p; no top-k), as one ``LogitsProcessorList``: ``warpers(None, logits)`` -> the scores to softmax."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers
