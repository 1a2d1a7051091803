"""The generation backend interface: adapter versions in, sampled tokens with behaviour log-probs out.

A backend owns one model and the adapter versions resident in it. The worker's rollout loop is its only caller,
from one thread::

    backend.add_adapter(adapter)     make a received version servable (v0, the base model, always is)
    backend.retain(versions)         drop resident versions not in the set (never v0)
    backend.generate(requests)       one chunk per request, each request under its own version
    backend.served(version)          what the engine serves a version with (the evidence, below)

and, on a backend whose ``streaming`` is True (vllm), a continuously fed engine::

    backend.submit(id, request)      add a request to the running batch (a whole turn: max_tokens is its budget)
    backend.advance()                wait for the engine's next step: the new tokens of each request it advanced
    backend.abort(ids)               stop requests where they are (an adapter swap, a returned lease)

The engine keeps stepping between calls (vLLM's engine core runs in its own process), so it never waits for the
caller's scoring or bookkeeping while a request is in it. A streamed request reports its tokens, behaviour
log-probs and evidence exactly as ``generate`` does, a few at a time (:class:`GenDelta`); ``generate`` must not
be called while requests stream.

:meth:`Backend.generate` samples at most ``request.max_tokens`` new tokens after ``request.token_ids`` (the whole
sequence so far: prompt, earlier chunks, environment replies) and returns, per request, the new token ids,
their behaviour log-probs and whether the chunk ended the turn with one of the model's end-of-turn ids
(``eos_token_ids``: the tokenizer's eos, every id of ``generation_config.eos_token_id`` and
``worker.stop_token_ids``; the id is included).
Because every chunk is a fresh continuation of the sequence, the next chunk of a sample may run under another
version: that is how partial rollouts swap adapters (see :mod:`loraflow.rollout_worker.rollout`).

Behaviour log-probs mean exactly what :mod:`loraflow.common.logprobs` says: ``log_softmax(logits / temperature)`` of
the sampled token in float32, before top-p. Greedy decoding (evaluation and tests only) reports them at
temperature 1. Every version keeps its own adapter slot, never reused for a different version while that
version is resident, so a new version can never be served by the weights of the previous one.

Evidence (:class:`loraflow.common.protocol.ServedAdapter`, checked by the learner: :mod:`loraflow.common.integrity`). Each backend
records at load time what its engine holds, read back from the engine and never copied from the
:class:`ReceivedAdapter` it was asked to load: the engine's name for the adapter, an int id that no other load
in this process gets (:meth:`Backend.new_lora_id`), the sha256 of the tensor bytes the engine loaded (computed
as ``AdapterUpdate.sha256``, so a truncated or swapped file shows) and the engine's compute dtype. Each
:class:`GenOutput` carries what the engine reports for that request; a report that disagrees with the load
record (another adapter, none) is kept as the version's evidence from then on. v0 is the base entry
(no adapter, id 0, no sha256).
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from loraflow.common.chat import ChatFormat, Prompt, end_of_turn_ids, pad_token_id
from loraflow.common.protocol import ServedAdapter
from loraflow.rollout_worker.adapters import ReceivedAdapter

#: ends the run's part of a generation key or request id on a shared engine ("r<slot>|<the run's key>",
#: rollout_worker/backends/shared.py); group ids ("<epoch>:<index>") never hold it
RUN_KEY_SEP = "|"


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
    served: ServedAdapter | None = None  # what the engine reports it served the request with (None: served())


@dataclass(slots=True, kw_only=True)
class GenDelta:
    """What one engine step added to a streamed request (:meth:`Backend.advance`)."""

    request_id: str
    token_ids: list[int]  # the new tokens (possibly none)
    logprobs: list[float]
    done: bool  # the request left the engine: an end-of-turn id, or its max_tokens
    finished: bool  # ended with end-of-sequence (the last token is EOS)
    served: ServedAdapter | None = None  # what the engine reports it served the request with


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """How tokens are drawn (from ``worker.temperature`` / ``worker.top_p``)."""

    temperature: float = 1.0
    top_p: float = 1.0


class Backend(abc.ABC):
    """A model that generates under any resident adapter version."""

    name: ClassVar[str]
    streaming: ClassVar[bool] = False  # submit / advance / abort work (a continuously fed engine)
    eos_token_id: int  # the tokenizer's own eos (the first of eos_token_ids)
    eos_token_ids: tuple[int, ...]  # every id that ends a turn
    vocab_size: int  # the model's (may exceed the tokenizer's: a padded vocabulary)
    chat: ChatFormat | None = None  # prompt rendering; None: the backend has no tokenizer (sim)
    engine_dtype: str = "float32"  # the engine's compute dtype, one of loraflow.common.codes.ENGINE_DTYPES

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.adapters: dict[int, ReceivedAdapter] = {}  # resident versions (v0 is implicit)
        self._loaded: dict[int, ServedAdapter] = {}  # resident version -> what the engine loaded for it
        self._disputed: dict[int, ServedAdapter] = {}  # version -> the first engine report that disagreed
        self._lora_ids = itertools.count(1)
        self.load_phases_ms: dict[str, float] = {}  # where the last load's time went, by phase (empty: not said)
        self._streams: dict[str, tuple[GenRequest, bool]] = {}  # request id -> (request, greedy) while streaming

    # -- tokens ------------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string with the tokenizer's own special tokens, messages through the chat
        template (:mod:`loraflow.common.chat`)."""

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
            self._drop(adapter.version)
        loaded = self._load(adapter)
        self.adapters[adapter.version] = adapter
        if loaded is not None:
            self._loaded[adapter.version] = loaded

    def retain(self, versions: Collection[int]) -> list[int]:
        """Unload every resident version not in ``versions``; returns the versions removed."""
        removed = sorted(v for v in self.adapters if v not in versions)
        for version in removed:
            self._drop(version)
        return removed

    def _drop(self, version: int) -> None:
        self._unload(version)
        del self.adapters[version]
        self._loaded.pop(version, None)
        self._disputed.pop(version, None)

    def new_lora_id(self) -> int:
        """An int id for one load: never handed out twice in this process (vLLM caches weights by it)."""
        return next(self._lora_ids)

    @abc.abstractmethod
    def _load(self, adapter: ReceivedAdapter) -> ServedAdapter | None:
        """Load the adapter's weights into a slot of its own; returns what the engine now holds for it, read back
        from the engine (None: the backend reports nothing, and :meth:`served` says so)."""

    @abc.abstractmethod
    def _unload(self, version: int) -> None:
        """Free the slot of a resident version."""

    # -- evidence ----------------------------------------------------------------------------------------------

    def _recorded(self, version: int) -> ServedAdapter:
        """The load record of a resident version; the base entry for v0 and for a version without one."""
        return self._loaded.get(version) or ServedAdapter(version=version, dtype=self.engine_dtype)

    def served(self, version: int) -> ServedAdapter:
        """What the engine serves ``version`` with: the first engine report that disagreed with the load, else
        the load record (see the module docstring)."""
        return self._disputed.get(version) or self._recorded(version)

    def keep_served(self, held: dict[int, ServedAdapter], served: ServedAdapter) -> None:
        """Add one report to a group's evidence ``held`` (version -> ServedAdapter): a version's first report,
        replaced by a later one only while it equals the load record, so a disagreeing report stays."""
        known = held.get(served.version)
        if known is None or (known != served and known == self._recorded(served.version)):
            held[served.version] = served

    # -- generation --------------------------------------------------------------------------------------------

    def _check(self, request: GenRequest) -> None:
        if not self.has_version(request.version):
            raise KeyError(f"adapter version {request.version} is not resident in the {self.name} backend "
                           f"(resident: {sorted(self.adapters)})")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")

    def _evidence(self, version: int, reported: ServedAdapter | None) -> ServedAdapter:
        """The evidence of one engine report for a request of ``version`` (None: the engine reports nothing); a
        report that disagrees with the load record becomes the version's evidence (see the module docstring)."""
        assert reported is None or reported.version == version, "evidence of another version"
        if reported is None:
            return self.served(version)
        if reported != self._recorded(version):
            self._disputed.setdefault(version, reported)
        return reported

    def generate(self, requests: Sequence[GenRequest], *, greedy: bool = False) -> list[GenOutput]:
        """One chunk per request (see the module docstring); outputs in request order."""
        for request in requests:
            self._check(request)
        if not requests:
            return []
        outputs = self._generate(requests, greedy)
        for request, output in zip(requests, outputs, strict=True):
            output.served = self._evidence(request.version, output.served)
        return outputs

    # -- streaming (a continuously fed engine; see the module docstring) ---------------------------------------

    def submit(self, request_id: str, request: GenRequest, *, greedy: bool = False) -> None:
        """Add one request to the running engine; its tokens come back from :meth:`advance`."""
        if not self.streaming:
            raise NotImplementedError(f"the {self.name} backend does not stream (use generate)")
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already in the engine")
        self._check(request)
        self._streams[request_id] = (request, greedy)
        try:
            self._submit(request_id, request, greedy)
        except BaseException:
            del self._streams[request_id]
            raise

    def abort(self, request_ids: Collection[str]) -> None:
        """Stop requests in the engine; the tokens :meth:`advance` reported for them are all they generated."""
        ids = [r for r in request_ids if self._streams.pop(r, None) is not None]
        if ids:
            self._abort(ids)

    def abort_all(self) -> None:
        """Stop every request in the engine (a caller that drops its rollouts)."""
        self.abort(list(self._streams))

    @property
    def num_streams(self) -> int:
        """Requests in the engine (submitted, not finished or aborted)."""
        return len(self._streams)

    def advance(self) -> list[GenDelta]:
        """Wait for the engine's next step and return the new tokens of every request it advanced (at least one
        step's worth while any request is in the engine; nothing, at once, when none is)."""
        if not self._streams:
            return []
        deltas = [d for d in self._advance() if d.request_id in self._streams]  # an aborted request's: dropped
        for delta in deltas:
            request, _ = self._streams[delta.request_id]
            delta.served = self._evidence(request.version, delta.served)
            if delta.done:
                del self._streams[delta.request_id]
        return deltas

    def _submit(self, request_id: str, request: GenRequest, greedy: bool) -> None:
        raise NotImplementedError

    def _abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def _advance(self) -> list[GenDelta]:
        raise NotImplementedError

    @abc.abstractmethod
    def _generate(self, requests: Sequence[GenRequest], greedy: bool) -> list[GenOutput]: ...

    def sampling_problem(self, sampling: Sampling) -> str:
        """Why this engine cannot sample a run of a shared engine as ``sampling`` says ("" when it can)."""
        return ""

    def describe(self) -> dict[str, Any]:
        """A few facts for logs and stats."""
        return {"backend": self.name, "vocab_size": self.vocab_size, "resident": sorted(self.adapters)}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model (engine processes, memory)."""


class TokenizerMixin:
    """The token methods of a backend over a Hugging Face tokenizer: hf and vllm, both through :mod:`loraflow.common.chat`."""

    chat: ChatFormat
    eos_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    def _init_tokens(self, tokenizer: Any, model_dir: str | Path, *, chat_template_kwargs: Mapping[str, Any],
                     stop_token_ids: Sequence[int], vocab_size: int) -> None:
        """Prompt rendering, the end-of-turn ids and the pad id for ``tokenizer`` and the model in ``model_dir``."""
        self.chat = ChatFormat(tokenizer, template_kwargs=chat_template_kwargs, name=f"model {model_dir}")
        self.eos_token_ids = end_of_turn_ids(tokenizer, model_dir, stop_token_ids)
        self.eos_token_id = self.eos_token_ids[0]
        self.pad_token_id = pad_token_id(tokenizer, self.eos_token_ids)
        bad = [i for i in self.eos_token_ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"end-of-turn ids {bad} are outside the model's vocabulary [0, {vocab_size}) "
                             "(worker.stop_token_ids, or the model's generation_config.json)")

    def encode(self, prompt: Prompt) -> list[int]:
        return self.chat.encode_prompt(prompt)

    def encode_continuation(self, text: str) -> list[int]:
        return self.chat.encode_text(text, special=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.chat.decode(token_ids)


def cut_at_eos(token_ids: Sequence[int], eos_token_ids: Collection[int], max_tokens: int) -> tuple[list[int], bool]:
    """The first ``max_tokens`` ids up to and including the first end-of-turn id; and whether one ended them."""
    ids = list(token_ids[:max_tokens])
    for end, token in enumerate(ids, start=1):
        if token in eos_token_ids:
            return ids[:end], True
    return ids, False
