"""A calculator-tool agent written against the ``openai`` client: loraflow trains it through the worker's gateway.

``worker.agent = "loraflow.deploy.agents.calculator_agent:run_episode"`` (chat models with a template), or
``...:run_text_episode`` for a model without one (plain completions). Each episode asks the row's problem, runs
every ``calculator`` tool call the model makes and hands back the result, nudges a model that answered without
the tool, and stops after ``MAX_TURNS`` model turns. Reward 1 when the last reply's last number is the row's
``answer`` (for a GSM8K-style worked solution, its number after ``####``).

Nothing here knows about tokens: the gateway records what the model generated, whatever this harness does.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

MAX_TURNS = 3
MAX_TOKENS = 64  # a Hermes tool call is ~30-60 tokens

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an error text (never raises)."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("unsupported expression")
    try:
        result = value(ast.parse(expression[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def score(reply: str, row: dict[str, Any]) -> float:
    """1.0 when the reply's last number is the row's answer (a GSM8K-style answer's number after '####')."""
    expected = str(row.get("answer", "")).split("####")[-1].strip().replace(",", "")
    numbers = re.findall(r"-?\d+(?:\.\d+)?", reply.replace(",", ""))
    return float(bool(expected) and bool(numbers) and numbers[-1] == expected)


def _question(row: dict[str, Any]) -> list[dict[str, Any]]:
    prompt = row["prompt"]
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


async def run_episode(client: Any, row: dict[str, Any]) -> dict[str, float]:
    """A chat agent: tool calls answered, several turns; reward = the answer in the last reply."""
    messages = _question(row)
    model = (await client.models.list()).data[0].id
    reply, num_tool_calls = "", 0
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR],
                                                        max_tokens=MAX_TOKENS, temperature=1.0)
        message = response.choices[0].message
        reply = message.content or ""
        messages.append({"role": "assistant", "content": message.content,
                         **({"tool_calls": [c.model_dump() for c in message.tool_calls]} if message.tool_calls else {})})
        if message.tool_calls:
            for call in message.tool_calls:
                num_tool_calls += 1
                try:
                    expression = json.loads(call.function.arguments).get("expression", "")
                except (ValueError, AttributeError):
                    expression = ""
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
        else:
            messages.append({"role": "user", "content": "Check it with the calculator tool."})
    return {"reward": score(reply, row), "tool_calls": float(num_tool_calls)}


async def run_text_episode(client: Any, row: dict[str, Any]) -> float:
    """The same loop over plain completions: the text grows by each reply and a calculator line."""
    model = (await client.models.list()).data[0].id
    text, reply = str(row["prompt"]), ""
    for _ in range(MAX_TURNS):
        response = await client.completions.create(model=model, prompt=text, max_tokens=MAX_TOKENS, stop=["\n"])
        reply = response.choices[0].text
        text += reply + f"\ncalculator: {calculate(reply.strip() or '0')}\n"
    return score(reply, row)
