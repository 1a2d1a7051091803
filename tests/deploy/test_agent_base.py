"""The agent demo base's pure parts: problems, episodes, the chat template's segments, labels, the cache key.

The full build (warm-up and checks) runs in tests/e2e/test_agent_demo.py; these take seconds: the tokenizer and
an untrained tiny model, no training step.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from loraflow.common.chat import ChatFormat
from loraflow.common.tasks import CalculatorTask
from loraflow.deploy.agent_base import (
    ADDED_TOKENS,
    AgentRecipe,
    _AgentWarmUp,
    agent_base_dir,
    build_tokenizer_and_model,
    episode,
    is_built,
    operands,
    segments,
    tool_call_text,
    trusted,
)
from loraflow.deploy.agents.agent_demo import CALC, TOOL_NAME
from loraflow.deploy.demo_base import METADATA_FILE
from loraflow.rollout_worker.gateway.tools import parse_hermes


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(tokenizer, model) as the build makes them, before any warm-up."""
    return build_tokenizer_and_model(tmp_path_factory.mktemp("agent-base"), seed=0)


@pytest.mark.parametrize(("prompt", "parts", "is_trusted"), [
    ("2*3+1=", (2, 3, 1), True),
    ("29*99+999=", (29, 99, 999), True),
    ("30*2+5=", (30, 2, 5), False),  # trusted_below = 30: the first factor decides
    ("99*99+100=", (99, 99, 100), False),
])
def test_operands_and_which_problems_the_base_trusts(prompt: str, parts: tuple[int, int, int],
                                                     is_trusted: bool) -> None:
    assert operands(prompt) == parts
    assert trusted(prompt, AgentRecipe()) is is_trusted
    assert trusted(prompt, AgentRecipe(trusted_below=100)) is True


def test_the_tool_call_text_is_what_the_hermes_parser_reads_back() -> None:
    parsed = parse_hermes(tool_call_text("47*23+512"))
    assert not parsed.malformed and not parsed.content
    (call,) = parsed.tool_calls
    assert call["function"]["name"] == TOOL_NAME
    assert json.loads(call["function"]["arguments"]) == {"expression": "47*23+512"}


def test_episodes_call_the_tool_or_answer_from_memory() -> None:
    tool_turns = episode("47*23+512=", "1593", direct=False)
    assert [m["role"] for m in tool_turns] == ["user", "assistant", "tool", "assistant"]
    (call,) = tool_turns[1]["tool_calls"]
    assert call["function"] == {"name": TOOL_NAME, "arguments": {"expression": "47*23+512"}}
    assert tool_turns[2]["content"] == tool_turns[3]["content"] == "1593"
    direct = episode("47*23+512=", "1593", direct=True)
    assert direct == [{"role": "user", "content": "47*23+512="}, {"role": "assistant", "content": "512"}]


def test_the_template_appends_turns_and_writes_the_tool_call_as_generated(built: tuple[Any, Any]) -> None:
    tokenizer, _ = built
    chat = ChatFormat(tokenizer)
    messages = episode("47*23+512=", "1593", direct=False)
    parts = segments(chat, messages, [CALC])
    assert [trained for _, trained in parts] == [False, True, False, True]
    eos = tokenizer.eos_token
    assert [text for text, trained in parts if trained] == [tool_call_text("47*23+512") + eos, "1593" + eos]
    assert parts[0][0] == f"tools: {TOOL_NAME}\nU:47*23+512=\nA:"
    assert parts[2][0] == "T:1593\nA:"
    assert "".join(text for text, _ in parts) == chat.render(messages, add_generation_prompt=False, tools=[CALC])


def test_the_tool_call_markup_is_added_tokens(built: tuple[Any, Any]) -> None:
    tokenizer, model = built
    chat = ChatFormat(tokenizer)
    for token in ADDED_TOKENS:
        assert len(chat.encode_text(token, special=False)) == 1, token
    text = tool_call_text("47*23+512")
    assert len(chat.encode_text(text, special=False)) < len(text.encode()) // 2
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)


def test_labels_cover_only_assistant_turns_and_sloppy_labels_skip_the_tool(built: tuple[Any, Any]) -> None:
    """drop_fraction 1: every untrusted problem is labelled with the answer from memory, every trusted one with
    the tool episode; drop_fraction 0: all tool episodes. Labels are the input ids on assistant turns only."""
    tokenizer, model = built
    recipe = AgentRecipe(batch_size=24)
    warm_up = _AgentWarmUp(model, tokenizer, CalculatorTask(0), recipe, random.Random(0))
    chat = ChatFormat(tokenizer)
    for drop_fraction in (0.0, 1.0):
        input_ids, labels = warm_up.batch(drop_fraction)
        kinds = set()
        for row_ids, row_labels in zip(input_ids.tolist(), labels.tolist(), strict=True):
            assert all(label in (-100, t) for t, label in zip(row_ids, row_labels, strict=True))
            match = re.search(r"U:(\d+)\*(\d+)\+(\d+)=", tokenizer.decode(row_ids))
            assert match is not None
            a, b, c = map(int, match.groups())
            prompt = f"{a}*{b}+{c}="
            direct = drop_fraction == 1.0 and not trusted(prompt, recipe)
            kinds.add(direct)
            expected = [text for text, is_turn in segments(chat, episode(prompt, str(a * b + c), direct=direct),
                                                             [CALC]) if is_turn]
            trained = [t for t, label in zip(row_ids, row_labels, strict=True) if label != -100]
            assert tokenizer.decode(trained) == "".join(expected)
        assert kinds == ({False, True} if drop_fraction else {False})


def test_the_cache_directory_names_the_seed_and_the_recipe(tmp_path: Path) -> None:
    recipe = AgentRecipe()
    other = dataclasses.replace(recipe, sloppy_steps=recipe.sloppy_steps + 1)
    assert agent_base_dir(0, tmp_path) != agent_base_dir(1, tmp_path)
    assert agent_base_dir(0, tmp_path, recipe) != agent_base_dir(0, tmp_path, other)
    assert agent_base_dir(0, tmp_path) == agent_base_dir(0, tmp_path, AgentRecipe())  # a stable hash
    assert agent_base_dir(0, tmp_path).name.startswith("agent-demo-s0-")
    assert not is_built(0, tmp_path)
    agent_base_dir(0, tmp_path).mkdir()
    assert not is_built(0, tmp_path)  # a directory without metadata is a build that did not finish
    (agent_base_dir(0, tmp_path) / METADATA_FILE).write_text("{}")
    assert is_built(0, tmp_path) and not is_built(0, tmp_path, other)
