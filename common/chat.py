"""Prompts to token ids, end-of-turn ids, and turns appended through the chat template: one place for every role.

A prompt is TRL's: a string (used as is) or a conversation, a list of ``{"role", "content"}`` messages::

    "47+38="                                         -> tokenizer("47+38=").input_ids
    [{"role": "system", "content": "Be brief."},     -> the tokenizer's own chat template,
     {"role": "user", "content": "47+38="}]             apply_chat_template(..., add_generation_prompt=True)

:class:`ChatFormat` wraps one Hugging Face tokenizer and is what the rollout backends (``hf``, ``vllm``), the
held-out evaluation (:mod:`loraflow.deploy.evaluate`) and the multi-turn environments use, so training, evaluation and
generation see the same tokens. Template keyword arguments (``enable_thinking = false`` for Qwen3) come from
``model.chat_template_kwargs``. Messages given to a tokenizer without a chat template are a config error
(:class:`ChatTemplateMissing`), never a silent fallback to some other format.

Rendering is ``apply_chat_template(..., tokenize=False)`` and then the tokenizer on that text without adding
special tokens, which is what ``apply_chat_template(..., tokenize=True)`` does inside (the template writes the
BOS itself); the tests check the two agree token for token on every model family of :mod:`loraflow.common.model_zoo`.

Multi-turn: a tool reply joins the sequence as a new message through the template (:meth:`ChatFormat.append_turn`).
The tokens already held (prompt, the model's sampled turn) are never re-tokenized: the whole conversation is
re-rendered, and only the part after the held tokens is appended, after checking that the re-rendered
prefix equals them token for token. Re-rendering is known to disagree with what was sampled (a model's
tokenization of its own text that BPE would merge otherwise, a turn cut at a stop string before its
end-of-turn token, a template that rewrites earlier turns); then the held tokens are kept, the suffix comes from
the text after the held text, and the mismatch is returned with its reason for the caller to count.

End of turn (:func:`end_of_turn_ids`) is the union of the tokenizer's eos id, every id of the model's
``generation_config.eos_token_id`` (Qwen2.5-Instruct lists two, Llama-3 three) and ``worker.stop_token_ids``.
A tokenizer without a pad token pads with the first eos id (:func:`pad_token_id`, logged once).

Completions of conversational prompts reach rewards as text and in TRL's form (:func:`completion_for`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.common.logging import get_logger

log = get_logger("chat")

Message = dict[str, str]
Prompt = str | list[Message]

#: why a re-rendered conversation disagreed with the held tokens (metric label ``reason``)
MISMATCH_TOKENS = "tokens"  # same text, other tokens (the sampled tokenization is not the canonical one)
MISMATCH_TEXT = "text"  # the template rendered earlier turns differently (e.g. stripped reasoning)


class ChatTemplateMissing(ValueError):
    """Conversational prompts for a tokenizer that has no chat template."""


def is_conversational(prompt: Any) -> bool:
    """True for a list of messages (TRL's conversational format), False for a plain string."""
    return isinstance(prompt, list)


def check_prompt(prompt: Any, where: str = "prompt") -> Prompt:
    """``prompt`` if it is a string or a list of ``{"role": str, "content": str}``; else ValueError naming it."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        for i, message in enumerate(prompt):
            if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"{where}: message {i} must be {{\"role\": str, \"content\": str}}, got "
                                 f"{str(message)[:80]!r}")
        return prompt
    raise ValueError(f"{where} must be a string or a non-empty list of chat messages, got {type(prompt).__name__}")


def assistant_message(text: str) -> list[Message]:
    """A completion in TRL's conversational form."""
    return [{"role": "assistant", "content": text}]


def completion_for(prompt: Prompt, text: str) -> str | list[Message]:
    """What a TRL-style reward receives as the completion: the text for a string prompt, else a message list."""
    return assistant_message(text) if is_conversational(prompt) else text


# -- end of turn ---------------------------------------------------------------------------------------------------


def token_ids(value: Any) -> list[int]:
    """An ``eos_token_id``-style value (an int, a list of ints, None) as a list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def generation_eos_ids(model_dir: str | os.PathLike) -> list[int]:
    """Every ``eos_token_id`` of a model directory's generation_config.json (else config.json), without torch."""
    for name in ("generation_config.json", "config.json"):
        try:
            data = json.loads((Path(model_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        ids = token_ids(data.get("eos_token_id"))
        if ids:
            return ids
    return []


def end_of_turn_ids(tokenizer: Any, model_dir: str | os.PathLike | None = None,
                    extra: Iterable[int] = ()) -> tuple[int, ...]:
    """The ids that end a model turn: the tokenizer's eos first, then generation_config's, then ``extra``."""
    ordered = [*token_ids(getattr(tokenizer, "eos_token_id", None)),
               *(generation_eos_ids(model_dir) if model_dir is not None else []), *extra]
    ids = tuple(dict.fromkeys(int(i) for i in ordered))
    if not ids:
        raise ValueError(f"model {model_dir}: neither the tokenizer nor generation_config.json names an eos token; "
                         "set worker.stop_token_ids")
    return ids


def pad_token_id(tokenizer: Any, eos_ids: Sequence[int]) -> int:
    """The tokenizer's pad id, or the first end-of-turn id when it has none (logged)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    log.info("pad_token_fallback", pad_token_id=eos_ids[0], why="the tokenizer has no pad token; padding with eos")
    return int(eos_ids[0])


# -- rendering -----------------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Appended:
    """The ids to append after a tool reply, and why the re-rendered prefix disagreed ("" = it did not)."""

    token_ids: list[int]
    mismatch: str = ""


class ChatFormat:
    """Prompt rendering, decoding and turn appends over one Hugging Face tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, *, template_kwargs: Mapping[str, Any] | None = None,
                 name: str = "the model") -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.name = name
        self.num_decodable = len(tokenizer)  # ids at or above (a padded model vocab) decode to nothing

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The conversation as the template writes it (text, special tokens included); ``tools``: OpenAI-style
        tool schemas, passed to the template (which renders them or not)."""
        if not self.has_template:
            raise ChatTemplateMissing(
                f"{self.name} has no chat template, but the prompts are chat messages: use a model whose "
                "tokenizer_config.json (or chat_template.jinja) has one, or give string prompts")
        extra = {"tools": list(tools)} if tools else {}
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **extra, **self.template_kwargs)

    def encode_text(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special``: with the tokenizer's own added tokens (a BOS for a string prompt)."""
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string as the tokenizer encodes it, messages through the chat template."""
        if isinstance(prompt, str):
            return self.encode_text(prompt)
        return self.encode_text(self.render(check_prompt(prompt)), special=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens and ids beyond the tokenizer (padded vocab) dropped."""
        limit = self.num_decodable
        return self.tokenizer.decode([t for t in token_ids if 0 <= t < limit], skip_special_tokens=True)

    def append_turn(self, conversation: list[Message], held_ids: Sequence[int], turn_text: str,
                    reply: Message) -> Appended:
        """The ids that follow ``held_ids`` once the model's turn and ``reply`` join ``conversation``.

        ``conversation``: the messages so far, whose rendering with a generation prompt began the model's turn;
        it is extended in place by the assistant turn and the reply. ``held_ids``: every token of the sequence
        (prompt and all turns), kept as they are. The result ends with the template's generation prompt, so the
        model speaks next."""
        before = self.render(conversation)
        conversation += [*assistant_message(turn_text), reply]
        return self.join(held_ids, before + turn_text, self.render(conversation))

    def join(self, held_ids: Sequence[int], held_text: str, after: str,
             after_ids: Sequence[int] | None = None) -> Appended:
        """The ids that follow ``held_ids`` (whose text is about ``held_text``) in the rendering ``after``: the
        rest of ``after``'s ids when they start with ``held_ids``, else (counted by the caller) the ids of the
        text after ``held_text``, or after the longest common text prefix (see the module docstring).
        ``after_ids``: ``after``'s ids, when the caller has encoded it already."""
        if after_ids is None:
            after_ids = self.encode_text(after, special=False)
        held = list(held_ids)
        if list(after_ids[:len(held)]) == held:
            return Appended(token_ids=list(after_ids[len(held):]))
        if after.startswith(held_text):
            suffix = self.encode_text(after[len(held_text):], special=False)
            if held and suffix and suffix[0] == held[-1]:
                suffix = suffix[1:]  # the held turn already ends with the end-of-turn token the template writes
            return Appended(token_ids=suffix, mismatch=MISMATCH_TOKENS)
        common = os.path.commonprefix([after, held_text])
        return Appended(token_ids=self.encode_text(after[len(common):], special=False), mismatch=MISMATCH_TEXT)
