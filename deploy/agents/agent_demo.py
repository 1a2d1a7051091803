"""The agent demo's harness: calculator problems solved through a tool that is as slow as real tools are.

``worker.agent = "loraflow.deploy.agents.agent_demo:run_episode"`` (``deploy/configs/agent-demo.toml``), written against
the ``openai`` client like any agent. Each episode sends the row's problem (``"47*23+512="``, the built-in
``calculator`` task) as the user message with one tool, ``calc``; each tool call the model makes (Hermes
``<tool_call>{"name": "calc", "arguments": {"expression": "..."}}</tool_call>``, parsed by the gateway into
``tool_calls``) is answered with the expression's value after a wait drawn from the tool's latency
(:class:`ToolLatency`), and the episode ends at the first reply without a tool call (the answer), after
``MAX_TURNS`` model turns, or when the conversation outgrows the model's context (the gateway's
``context_length_exceeded``). Reward 1 when the answer's last number is the row's answer, else 0.

The latency is lognormal, so episodes take very different times, as with real tools and sandboxes: with the
default median 0.2 s and sigma 1.5, 6 % of calls take over 10x the median and 0.5 % over 50x (capped at
``max_factor`` x the median). Set it per run through the environment, which ``loraflow run`` passes to the
workers: ``LORAFLOW_AGENT_TOOL_MEDIAN_S``, ``LORAFLOW_AGENT_TOOL_SIGMA``, ``LORAFLOW_AGENT_TOOL_MAX_FACTOR``
(median 0 = no wait).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import openai

from loraflow.deploy.agents.calculator_agent import calculate, score

MAX_TURNS = 3
MAX_TOKENS = 40  # a calc call is ~27 tokens on the demo base's tokenizer, an answer ~5
TOOL_NAME = "calc"
CALC = {"type": "function", "function": {
    "name": TOOL_NAME, "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@dataclass(frozen=True, slots=True)
class ToolLatency:
    """How long one tool call takes: ``median_s * exp(sigma * N(0, 1))``, at most ``max_factor * median_s``."""

    median_s: float = 0.2
    sigma: float = 1.5
    max_factor: float = 50.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ToolLatency:
        env = os.environ if env is None else env
        default = cls()
        return cls(median_s=float(env.get("LORAFLOW_AGENT_TOOL_MEDIAN_S", default.median_s)),
                   sigma=float(env.get("LORAFLOW_AGENT_TOOL_SIGMA", default.sigma)),
                   max_factor=float(env.get("LORAFLOW_AGENT_TOOL_MAX_FACTOR", default.max_factor)))

    def draw(self, rng: random.Random) -> float:
        return self.median_s * min(self.max_factor, math.exp(self.sigma * rng.gauss(0.0, 1.0)))


def run_tool(call: Any) -> str:
    """The result of one tool call (an OpenAI ``tool_calls`` entry), or an error text the model sees."""
    if call.function.name != TOOL_NAME:
        return f"error: no tool named {call.function.name!r}"
    try:
        expression = json.loads(call.function.arguments).get("expression", "")
    except (ValueError, AttributeError):
        return "error: the arguments are not a JSON object"
    return calculate(str(expression))


async def run_episode(client: Any, row: dict[str, Any]) -> dict[str, float]:
    """One episode (see the module docstring): reward, tool calls made and seconds spent waiting on the tool."""
    latency, rng = ToolLatency.from_env(), random.Random()
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(row["prompt"])}]
    reply, num_tool_calls, waited_s = "", 0, 0.0
    for _ in range(MAX_TURNS):
        try:
            response = await client.chat.completions.create(model="loraflow", messages=messages, tools=[CALC],
                                                            max_tokens=MAX_TOKENS)
        except openai.BadRequestError as exc:
            if exc.code != "context_length_exceeded":
                raise
            reply = ""  # the conversation outgrew model.max_seq_len: no answer
            break
        message = response.choices[0].message
        reply = message.content or ""
        if not message.tool_calls:
            break
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in message.tool_calls]})
        for call in message.tool_calls:
            num_tool_calls += 1
            seconds = latency.draw(rng)
            waited_s += seconds
            await asyncio.sleep(seconds)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    else:
        reply = ""  # the last turn was a tool call: no answer
    return {"reward": score(reply, row), "tool_calls": float(num_tool_calls), "tool_wait_s": waited_s}
