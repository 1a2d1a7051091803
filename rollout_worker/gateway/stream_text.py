"""A streamed call's text, step by step (SSE), decoding only the last tokens, never the whole turn again.

Decoding a turn's tokens again at every engine step costs O(tokens) a step, O(tokens²) a turn. Instead each
step decodes a small window, as vLLM's and TGI's detokenizers do::

    ids:   ... | prefix ........ read | new tokens |
                 \\- decoded last time -/
    new text = decode(ids[prefix:]) minus decode(ids[prefix:read])

The tokens before ``read`` are decoded with the new ones so that the new text is what the whole decode gives
there: a SentencePiece word's leading space (dropped when a decode starts at that word) and a byte-level token
that ends inside a multi-byte character (its bytes decode to U+FFFD until the rest arrive) come out whole. A
window whose text ends in U+FFFD waits for the next token. A SentencePiece tokenizer's byte-fallback tokens
(``<0xNN>``) wait until a token of another kind follows: its decoder turns a run of byte tokens that is not valid
UTF-8 as a whole into one U+FFFD per byte, so a byte that decoded to a character alone (``<0x3A>``, ":") is
taken back by an invalid byte after it (``<0xBD>``). With stop strings, the last ``hold`` characters
(the longest stop string minus one) wait too: a stop string completed by the next token removes them from the
turn, and text already sent cannot be taken back.

The caller checks at the end that what it sent is where the whole decode begins (:meth:`TextStream.rest`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from typing import Any

BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def byte_fallback_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of a tokenizer's byte-fallback tokens (``<0x00>`` .. ``<0xFF>``; none in a byte-level BPE)."""
    return frozenset(i for token, i in tokenizer.get_vocab().items() if BYTE_FALLBACK.fullmatch(token))


class TextStream:
    """The text of a growing token list, handed out in pieces that add up to a prefix of its whole decode."""

    __slots__ = ("_decode", "_hold", "_bytes", "_prefix", "_read", "_pending", "_sent")

    def __init__(self, decode: Callable[[Sequence[int]], str], *, hold: int = 0,
                 byte_ids: Collection[int] = frozenset()) -> None:
        self._decode = decode
        self._hold = hold
        self._bytes = byte_ids  # byte-fallback ids: text that a following byte can still take back
        self._prefix = self._read = 0  # token offsets: the window starts at prefix; read: decoded up to here
        self._pending = ""  # decoded, not yet handed out (held back for a stop string)
        self._sent: list[str] = []

    def push(self, token_ids: Sequence[int]) -> str:
        """The new text now that the call's tokens are ``token_ids`` (all of them so far; "" when none is ready)."""
        end = len(token_ids)
        while end > self._read and token_ids[end - 1] in self._bytes:  # a run of byte tokens may go on
            end -= 1
        if end > self._read:
            before = self._decode(token_ids[self._prefix:self._read]) if self._read > self._prefix else ""
            now = self._decode(token_ids[self._prefix:end])
            if len(now) > len(before) and not now.endswith("\ufffd"):
                self._pending += now[len(before):]
                self._prefix, self._read = self._read, end
        ready = len(self._pending) - self._hold
        if ready <= 0:
            return ""
        out, self._pending = self._pending[:ready], self._pending[ready:]
        self._sent.append(out)
        return out

    @property
    def sent(self) -> str:
        return "".join(self._sent)

    def rest(self, text: str) -> str | None:
        """What is left to send of the turn's whole text ``text``; None when the pieces sent are not its start
        (a tokenizer whose windowed decode disagrees with its whole decode: the caller counts it)."""
        sent = self.sent
        return text[len(sent):] if text.startswith(sent) else None
