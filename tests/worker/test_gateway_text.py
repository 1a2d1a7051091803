"""The gateway's streamed text (rollout_worker/gateway/stream_text.py) against the whole decode, on real tokenizers.

Byte-level BPE (llama3, qwen2: characters outside the trained corpus split into byte tokens), SentencePiece with
byte fallback (gemma: ``▁`` spaces, ``<0xNN>`` tokens) and the tiny model's byte tokenizer; token ids from text
with multi-byte characters and random ids (invalid UTF-8, special ids, ids beyond the tokenizer), pushed one at a
time and in uneven steps. The pieces must add up to the whole decode, each a prefix of it, and no push may decode
more than a window of tokens (the old way decoded the whole turn at every step: quadratic).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loraflow.common.chat import ChatFormat
from loraflow.rollout_worker.gateway.stream_text import TextStream, byte_fallback_ids

TEXT = "héllo wörld, naïve café 世界 🎉🎉 the end\n\n  x = 3 ≥ 2 «ok» Ωmega 𝔘nicode\t!"


@pytest.fixture(scope="module", params=["llama3", "qwen2", "gemma", "tiny"])
def chat(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ChatFormat:
    directory = tmp_path_factory.mktemp(f"tok-{request.param}")
    if request.param == "tiny":
        from loraflow.common.tiny_model import build_tiny_model

        build_tiny_model(directory, seed=0)
    else:
        from loraflow.common.model_zoo import FAMILIES, build_tokenizer

        build_tokenizer(FAMILIES[request.param], directory)
    return ChatFormat(AutoTokenizer.from_pretrained(str(directory)))


def sequences(chat: ChatFormat) -> list[list[int]]:
    rng = random.Random(0)
    text_ids = chat.encode_text(TEXT, special=False)
    vocab = chat.num_decodable
    return [text_ids,
            [rng.randrange(vocab + 8) for _ in range(300)],  # invalid UTF-8, special ids, ids past the tokenizer
            [t for _ in range(3) for t in text_ids] + [rng.randrange(vocab) for _ in range(40)] + text_ids]


def play(chat: ChatFormat, ids: Sequence[int], *, hold: int, steps: list[int]) -> tuple[TextStream, list[str], int]:
    """Push ``ids`` in ``steps``-sized slices; returns the stream, its pieces and the tokens decoded in all."""
    decoded = 0

    def decode(window: Sequence[int]) -> str:
        nonlocal decoded
        decoded += len(window)
        return chat.decode(window)

    stream, pieces, at = TextStream(decode, hold=hold, byte_ids=byte_fallback_ids(chat.tokenizer)), [], 0
    whole = chat.decode(ids)
    for step in steps:
        at = min(len(ids), at + step)
        piece = stream.push(ids[:at])
        pieces.append(piece)
        assert whole.startswith("".join(pieces)), (at, "".join(pieces)[-20:], whole)
        assert len(stream.sent) <= max(0, len(chat.decode(ids[:at])) - hold)  # the last ``hold`` characters wait
        if at == len(ids):
            break
    return stream, pieces, decoded


@pytest.mark.parametrize("hold", [0, 3])
def test_streamed_pieces_add_up_to_the_whole_decode(chat: ChatFormat, hold: int) -> None:
    rng = random.Random(hold)
    for ids in sequences(chat):
        for steps in ([1] * len(ids), [rng.randint(1, 5) for _ in range(len(ids))]):
            stream, pieces, _ = play(chat, ids, hold=hold, steps=steps)
            whole = chat.decode(ids)
            rest = stream.rest(whole)
            assert rest is not None
            assert "".join(pieces) + rest == whole
            assert len(rest) >= min(hold, len(whole))  # the held-back tail waits for the end


def test_a_push_decodes_a_window_not_the_whole_turn(chat: ChatFormat) -> None:
    ids = [t for _ in range(40) for t in chat.encode_text(TEXT, special=False)]  # ~1-2k tokens
    _, _, decoded = play(chat, ids, hold=0, steps=[1] * len(ids))
    assert decoded < 12 * len(ids), (decoded, len(ids))  # the whole decode at every step: ~len(ids)**2 / 2


def test_a_split_character_waits_for_its_bytes(tmp_path: Path) -> None:
    from loraflow.common.model_zoo import FAMILIES, build_tokenizer

    build_tokenizer(FAMILIES["qwen2"], tmp_path)
    chat = ChatFormat(AutoTokenizer.from_pretrained(str(tmp_path)))
    ids = chat.encode_text("a🎉", special=False)
    assert len(ids) >= 3  # "a" + the emoji's bytes in more than one token (not in the trained vocabulary)
    stream = TextStream(chat.decode)
    assert [stream.push(ids[:n]) for n in range(1, len(ids) + 1)] == ["a", *[""] * (len(ids) - 2), "🎉"]
