"""Tool calls in a model's text -> OpenAI ``tool_calls``; one parser per model family (``worker.tool_parser``).

``hermes`` (Qwen2.5/Qwen3, Hermes, many fine-tunes): each call is ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``; the text outside the tags is the message content. ``none``: the text is always content.

A tag whose body is not a JSON object with a string ``name`` and an object (or JSON string) ``arguments``, or an
unclosed ``<tool_call>``, makes the whole turn plain content: the caller counts it
(``tool_call_parse_failures{parser}``). The parser never changes the tokens: what is trained is what was
generated, whatever the parse.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(slots=True, kw_only=True)
class Parsed:
    """A model turn as an OpenAI assistant message: content, tool calls, and whether a call was malformed."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{secrets.token_hex(8)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_hermes(text: str) -> Parsed:
    if "<tool_call>" not in text:
        return Parsed(content=text)
    calls = []
    for body in HERMES_CALL.findall(text):
        try:
            value = json.loads(body)
        except ValueError:
            return Parsed(content=text, malformed=True)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return Parsed(content=text, malformed=True)
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return Parsed(content=text, malformed=True)
        if not isinstance(arguments, dict):
            return Parsed(content=text, malformed=True)
        calls.append(_call(value["name"], arguments))
    rest = HERMES_CALL.sub("", text)
    if not calls or "<tool_call>" in rest:  # an unclosed tag
        return Parsed(content=text, malformed=True)
    return Parsed(content=rest.strip(), tool_calls=calls)


def parse_none(text: str) -> Parsed:
    return Parsed(content=text)


PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes, "none": parse_none}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI request messages as chat templates take them: text parts joined, ``content`` never None, a tool
    call's ``arguments`` JSON string as the mapping Hugging Face templates render (``| tojson``)."""
    out = []
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        m["content"] = content if isinstance(content, str) else ""
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    with contextlib.suppress(ValueError):
                        function["arguments"] = json.loads(function["arguments"])
                calls.append({**call, "function": function})
            m["tool_calls"] = calls
        out.append(m)
    return out
