"""The generation backend interface: adapter versions in, sampled tokens with behaviour log-probs out.

A backend owns one model and the adapter versions resident in it. The worker's rollout loop is its only caller,
from one thread::

    backend.add_adapter(adapter)     make a received version servable (v0, the base model, always is)
    backend.retain(versions)         drop resident versions not in the set (never v0)
    backend.generate(requests)       one chunk per request, each request under its own version

:meth:`Backend.generate` samples at most ``request.max_tokens`` new tokens after ``request.token_ids`` (the whole
sequence so far: prompt, earlier chunks, environment replies) and returns, per request, the new token ids,
their behaviour log-probs and whether the chunk ended with end-of-sequence (the EOS token is included).
Because every chunk is a fresh continuation of the sequence, the next chunk of a sample may run under another
version: that is how partial rollouts swap adapters (see :mod:`rollout_worker.rollout`).

Behaviour log-probs mean exactly what :mod:`common.logprobs` says: ``log_softmax(logits / temperature)`` of
the sampled token in float32, before top-p. Greedy decoding (evaluation and tests only) reports them at
temperature 1. Every version keeps its own adapter slot, never reused for a different version while that
version is resident, so a new version can never be served by the weights of the previous one.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rollout_worker.adapters import ReceivedAdapter


@dataclass(slots=True, kw_only=True)
class GenRequest:
    """Continue ``token_ids`` by at most ``max_tokens`` tokens under adapter ``version``."""

    token_ids: Sequence[int]
    max_tokens: int
    version: int
    key: str = ""  # stable name of this generation (group, sample, turn); seeds backends that need one
    num_generated: int = 0  # tokens already generated in this turn (earlier chunks)


@dataclass(slots=True, kw_only=True)
class GenOutput:
    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended with end-of-sequence (the last token is EOS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """How tokens are drawn (from ``worker.temperature`` / ``worker.top_p``)."""

    temperature: float = 1.0
    top_p: float = 1.0


class Backend(abc.ABC):
    """A model that generates under any resident adapter version."""

    name: ClassVar[str]
    eos_token_id: int
    vocab_size: int

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.adapters: dict[int, ReceivedAdapter] = {}  # resident versions (v0 is implicit)

    # -- tokens ------------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as a prompt (the tokenizer's own special-token handling)."""

    @abc.abstractmethod
    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of ``text`` appended mid-sequence (no special tokens), e.g. an environment reply."""

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens dropped."""

    # -- adapters ----------------------------------------------------------------------------------------------

    def has_version(self, version: int) -> bool:
        return version == 0 or version in self.adapters

    @property
    def newest_version(self) -> int:
        return max(self.adapters, default=0)

    def add_adapter(self, adapter: ReceivedAdapter) -> None:
        """Make ``adapter.version`` servable; a version already resident with the same checksum is kept."""
        held = self.adapters.get(adapter.version)
        if held is not None and held.sha256 == adapter.sha256:
            return
        if held is not None:
            self._unload(adapter.version)
            del self.adapters[adapter.version]
        self._load(adapter)
        self.adapters[adapter.version] = adapter

    def retain(self, versions: Collection[int]) -> list[int]:
        """Unload every resident version not in ``versions``; returns the versions removed."""
        removed = sorted(v for v in self.adapters if v not in versions)
        for version in removed:
            self._unload(version)
            del self.adapters[version]
        return removed

    @abc.abstractmethod
    def _load(self, adapter: ReceivedAdapter) -> None:
        """Load the adapter's weights into a slot of its own."""

    @abc.abstractmethod
    def _unload(self, version: int) -> None:
        """Free the slot of a resident version."""

    # -- generation --------------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenRequest], *, greedy: bool = False) -> list[GenOutput]:
        """One chunk per request (see the module docstring); outputs in request order."""
        for request in requests:
            if not self.has_version(request.version):
                raise KeyError(f"adapter version {request.version} is not resident in the {self.name} backend "
                               f"(resident: {sorted(self.adapters)})")
            if request.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if not requests:
            return []
        return self._generate(requests, greedy)

    @abc.abstractmethod
    def _generate(self, requests: Sequence[GenRequest], greedy: bool) -> list[GenOutput]: ...

    def describe(self) -> dict[str, Any]:
        """A few facts for logs and stats."""
        return {"backend": self.name, "vocab_size": self.vocab_size, "resident": sorted(self.adapters)}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model (engine processes, memory)."""


class TokenizerMixin:
    """The token methods of a backend over a Hugging Face tokenizer (``self.tokenizer``): hf and vllm."""

    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def encode_continuation(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


def cut_at_eos(token_ids: Sequence[int], eos_token_id: int, max_tokens: int) -> tuple[list[int], bool]:
    """The first ``max_tokens`` ids up to and including the first EOS; and whether an EOS ended them."""
    ids = list(token_ids[:max_tokens])
    if eos_token_id in ids:
        end = ids.index(eos_token_id) + 1
        return ids[:end], True
    return ids, False
