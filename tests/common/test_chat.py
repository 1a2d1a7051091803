"""loraflow.common.chat on the model zoo's four families: rendering equals apply_chat_template, end-of-turn ids, the pad
fallback, tool turns appended by suffix with the prefix checked, and the errors a user sees."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loraflow.common.chat import (
    MISMATCH_TEXT,
    MISMATCH_TOKENS,
    ChatFormat,
    ChatTemplateMissing,
    check_prompt,
    completion_for,
    end_of_turn_ids,
    pad_token_id,
)
from loraflow.common.model_zoo import FAMILIES
from loraflow.rollout_worker.backends.base import cut_at_eos

CONVERSATIONS = [
    [{"role": "user", "content": "47+38="}],
    [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "Ada has 3 apples."}],
    [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "12*7?"},
     {"role": "assistant", "content": "<calc>12*7</calc>"}, {"role": "tool", "content": "=84"}],
]


def tokenizer_of(zoo_model, family: str):
    return AutoTokenizer.from_pretrained(str(zoo_model(family)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prompts_are_rendered_exactly_as_apply_chat_template(zoo_model, family: str) -> None:
    tokenizer = tokenizer_of(zoo_model, family)
    chat = ChatFormat(tokenizer)
    for messages in CONVERSATIONS:
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        assert chat.encode_prompt(messages) == list(expected)
    text = "Ada has 3 apples and buys 4."
    assert chat.encode_prompt(text) == tokenizer(text).input_ids  # a string is used as is
    assert chat.decode(chat.encode_prompt(text)) == text


def test_template_kwargs_reach_the_template(zoo_model) -> None:
    tokenizer = tokenizer_of(zoo_model, "qwen3")
    messages = CONVERSATIONS[0]
    thinking = ChatFormat(tokenizer).render(messages)
    direct = ChatFormat(tokenizer, template_kwargs={"enable_thinking": False}).render(messages)
    assert thinking.endswith("<|im_start|>assistant\n")
    assert direct == thinking + "<think>\n\n</think>\n\n"


def test_messages_without_a_template_are_a_config_error(tiny_model_dir: Path) -> None:
    chat = ChatFormat(AutoTokenizer.from_pretrained(str(tiny_model_dir)), name=f"model {tiny_model_dir}")
    assert chat.encode_prompt("12+34=")  # strings still work
    with pytest.raises(ChatTemplateMissing, match="has no chat template.*give string prompts"):
        chat.encode_prompt(CONVERSATIONS[0])


def test_prompt_shapes_are_checked() -> None:
    assert check_prompt("x") == "x"
    assert check_prompt(CONVERSATIONS[1]) == CONVERSATIONS[1]
    for bad, match in (([], "non-empty list"), (3, "got int"), ([{"role": "user"}], "message 0"),
                       ([{"role": "user", "content": 5}], "message 0")):
        with pytest.raises(ValueError, match=match):
            check_prompt(bad, "row 7 column prompt")
    assert completion_for("a+b=", "5") == "5"
    assert completion_for(CONVERSATIONS[0], "85") == [{"role": "assistant", "content": "85"}]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_end_of_turn_is_every_eos_id(zoo_model, family: str) -> None:
    model_dir = zoo_model(family)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    spec = FAMILIES[family]
    ids = end_of_turn_ids(tokenizer, model_dir)
    expected = {tokenizer.convert_tokens_to_ids(t) for t in (spec.eos, *spec.generation_eos)}
    assert ids[0] == tokenizer.eos_token_id and set(ids) == expected and len(ids) == len(expected) >= 2
    assert end_of_turn_ids(tokenizer, model_dir, [7, ids[0]]) == (*ids, 7)  # stop_token_ids join, no repeats
    a, b, c = [i for i in range(100, 120) if i not in ids][:3]
    assert cut_at_eos([a, b, ids[1], c], ids, 10) == ([a, b, ids[1]], True)  # not only the tokenizer's eos
    assert cut_at_eos([a, b, c], ids, 2) == ([a, b], False)


def test_a_missing_pad_token_falls_back_to_eos(zoo_model, caplog) -> None:
    tokenizer = tokenizer_of(zoo_model, "llama3")  # Llama-3 ships without a pad token
    assert tokenizer.pad_token_id is None
    ids = end_of_turn_ids(tokenizer, zoo_model("llama3"))
    with caplog.at_level(logging.INFO):
        assert pad_token_id(tokenizer, ids) == ids[0]
    assert pad_token_id(tokenizer_of(zoo_model, "qwen2"), ids) == tokenizer_of(zoo_model, "qwen2").pad_token_id


def test_a_padded_vocabulary_decodes_what_the_tokenizer_knows(zoo_model) -> None:
    from transformers import AutoConfig

    model_dir = zoo_model("qwen2")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    vocab_size = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    assert vocab_size > len(tokenizer)
    chat = ChatFormat(tokenizer)
    ids = chat.encode_prompt("Ada has 3 apples.")
    assert chat.decode([*ids[:2], vocab_size - 1, len(tokenizer), *ids[2:]]) == "Ada has 3 apples."


def tool_turn(zoo_model, family: str, turn: str, *, end: bool, canonical: bool = True):
    """(chat, conversation, held ids, the re-rendered full conversation's ids) after a model turn."""
    tokenizer = tokenizer_of(zoo_model, family)
    chat = ChatFormat(tokenizer)
    conversation = [dict(m) for m in CONVERSATIONS[1]]
    prompt_ids = chat.encode_prompt(conversation)
    turn_ids = chat.encode_text(turn, special=False)
    if not canonical:  # the model sampled the same text in smaller pieces than BPE would merge
        turn_ids = [i for t in turn_ids for i in chat.encode_text(tokenizer.decode([t])[:1], special=False)
                    + chat.encode_text(tokenizer.decode([t])[1:], special=False)]
        assert chat.decode(turn_ids) == turn and turn_ids != chat.encode_text(turn, special=False)
    eot = tokenizer.convert_tokens_to_ids({"llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}.get(family,
                                                                                                 "<|im_end|>"))
    held = prompt_ids + turn_ids + ([eot] if end else [])
    full = [*conversation, {"role": "assistant", "content": turn}, {"role": "tool", "content": "=84"}]
    expected = list(tokenizer.apply_chat_template(full, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return chat, conversation, held, expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("end", [True, False], ids=["eos", "stop-string"])
def test_a_tool_reply_appends_only_the_suffix(zoo_model, family: str, end: bool) -> None:
    chat, conversation, held, expected = tool_turn(zoo_model, family, "<calc>12*7</calc>", end=end)
    appended = chat.append_turn(conversation, held, "<calc>12*7</calc>", {"role": "tool", "content": "=84"})
    assert appended.mismatch == ""
    assert held + appended.token_ids == expected  # exactly what the template gives for the whole conversation
    assert [m["role"] for m in conversation][-2:] == ["assistant", "tool"]


def test_a_non_canonical_turn_keeps_its_tokens_and_is_counted(zoo_model) -> None:
    turn = "The answer is 84 apples"
    chat, conversation, held, expected = tool_turn(zoo_model, "qwen2", turn, end=True, canonical=False)
    appended = chat.append_turn(conversation, held, turn, {"role": "tool", "content": "=84"})
    assert appended.mismatch == MISMATCH_TOKENS
    tokens = held + appended.token_ids
    assert tokens[:len(held)] == held and tokens != expected
    assert chat.tokenizer.decode(tokens) == chat.tokenizer.decode(expected)  # the same conversation as text


def test_a_template_that_rewrites_the_turn_is_counted(zoo_model) -> None:
    turn = "<think>12 times 7</think>answer"  # Qwen3's template re-renders reasoning with its own newlines
    chat, conversation, held, _ = tool_turn(zoo_model, "qwen3", turn, end=True)
    appended = chat.append_turn(conversation, held, turn, {"role": "tool", "content": "=84"})
    assert appended.mismatch == MISMATCH_TEXT
    assert chat.tokenizer.decode(appended.token_ids).endswith("<tool_response>\n=84\n</tool_response><|im_end|>\n"
                                                              "<|im_start|>assistant\n")
