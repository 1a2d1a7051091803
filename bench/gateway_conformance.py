"""Chat-template conformance of the agent gateway: does re-rendering a conversation keep the generated tokens?

    .venv/bin/python -m bench.gateway_conformance

For each :mod:`loraflow.common.model_zoo` family (built offline) and each of :data:`SCENARIOS`, a gateway
:class:`~loraflow.rollout_worker.gateway.session.Session` plays a multi-turn episode whose model turns are fixed
texts "generated" as their tokens plus the template's end-of-turn id, sent back as an OpenAI client does. Per
cell: ``div``, calls whose rendering did not start with the held tokens (the gateway's ``tito_divergence``;
training stays exact), and ``drift``, generated tokens a pipeline re-tokenizing the final conversation with
``apply_chat_template`` would train differently or not at all. ``qwen2.5``: the qwen2 tokenizer with
Qwen2.5-Instruct's published template (tools in the system prompt, ``tool_calls`` as ``<tool_call>`` JSON).
Value: the share of cells served without divergence; reference 1.0.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench import harness

END_OF_TURN = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>", "gemma": "<end_of_turn>"}
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>'

#: scenario -> list of (generated turn text, ended by end-of-turn, the harness's next message)
SCENARIOS: dict[str, list[tuple[str, bool, dict[str, Any] | None]]] = {
    "plain": [("Let me think about it.", True, {"role": "user", "content": "Go on."}),
              ("It is 7.", True, {"role": "user", "content": "Sure?"}), ("Yes, 7.", True, None)],
    "tool": [("I will use the calculator: 3+4", True, {"role": "tool", "content": "7"}),
             ("The answer is 7.", True, None)],
    "tool_calls": [(TOOL_CALL, True, {"role": "tool", "content": "7"}), ("The answer is 7.", True, None)],
    "think": [("<think>\n3 plus 4\n</think>\n\nIt is 7.", True, {"role": "user", "content": "And 5+6?"}),
              ("<think>\n5 plus 6\n</think>\n\nIt is 11.", True, None)],
    "spaces": [("It is 7.  \n", True, {"role": "user", "content": "Thanks."}), ("Welcome.", True, None)],
    "length": [("It is seven, because three plus", False, {"role": "user", "content": "Finish."}),
               ("Four.", True, None)],
}
QWEN25_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}
QUESTION = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 3+4?"}]


def play(chat: Any, end_id: int, turns: list[tuple[str, bool, dict[str, Any] | None]],
         tools: list[dict[str, Any]] | None = None) -> tuple[int, int, dict]:
    """(divergent calls, drifted tokens under re-tokenization, divergence reasons) of one episode."""
    from loraflow.common.protocol import ServedAdapter
    from loraflow.rollout_worker.gateway.session import Session
    from loraflow.rollout_worker.gateway.tools import parse_hermes, template_messages

    session = Session(id="bench")
    messages = [dict(m) for m in QUESTION]
    generated: list[tuple[int, list[int]]] = []  # (position in the sequence, ids) of each generated turn
    for text, ended, follow in turns:
        ids, _ = session.context(chat, messages=template_messages(messages), tools=tools, version=0, refuse=False)
        turn = chat.encode_text(text, special=False) + ([end_id] if ended else [])
        generated.append((len(ids), turn))
        session.record(chat, prompt_ids=ids, token_ids=turn, logprobs=[0.0] * len(turn), version=0,
                       finish_reason="stop" if ended else "length", turn_text=text, served=ServedAdapter(version=0))
        tool_calls = parse_hermes(text).tool_calls  # sent back as an OpenAI client does
        messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls} if tool_calls
                        else {"role": "assistant", "content": text})
        if follow is not None:
            messages.append(dict(follow))
    final = chat.encode_text(chat.render(template_messages(messages), add_generation_prompt=False, tools=tools),
                             special=False)
    drift = sum(1 for at, turn in generated for i, t in enumerate(turn) if at + i >= len(final) or final[at + i] != t)
    return sum(session.divergences.values()), drift, dict(session.divergences)


def main() -> None:
    args = harness.parse(harness.flags(harness.parser(__doc__), {"families": (
        "", "comma-separated model_zoo families (default: all, and qwen2.5)")}), None, families="qwen2")
    from transformers import AutoTokenizer

    from loraflow.common.chat import ChatFormat
    from loraflow.common.model_zoo import FAMILIES, build_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(",") if args.families else [*FAMILIES, "qwen2.5"]:
            base = "qwen2" if family == "qwen2.5" else family
            model_dir = Path(tmp) / base
            if not model_dir.exists():
                build_model(base, model_dir, seed=0)
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            tools = None
            if family == "qwen2.5":
                tokenizer.chat_template, tools = QWEN25_TEMPLATE, [CALCULATOR]
            chat = ChatFormat(tokenizer, name=family)
            end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN[base])
            rows.append((family, {name: play(chat, end_id, turns, tools) for name, turns in SCENARIOS.items()}))

    def cell(div: int, drift: int, reasons: dict) -> str:
        why = " (" + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")" if reasons else ""
        return f"div {div}{why} / drift {drift}"

    clean, cells = sum(c[n][0] == 0 for _, c in rows for n in SCENARIOS), len(rows) * len(SCENARIOS)
    harness.table(["family", *SCENARIOS, "prefix-preserving"],
                  [(family, *(cell(*c[n]) for n in SCENARIOS), f"{sum(c[n][0] == 0 for n in SCENARIOS)}/{len(SCENARIOS)}")
                   for family, c in rows])
    harness.report("gateway_conformance", "prefix_preserving_share", clean / cells, "fraction", 1.0, cells=cells,
                   families=len(rows))


if __name__ == "__main__":
    main()
