"""Chat-template conformance of the agent gateway: does re-rendering a conversation keep the generated tokens?

    .venv/bin/python -m bench.gateway_conformance

For each family of :mod:`loraflow.common.model_zoo` (built offline into a temporary directory) and each scenario below,
a gateway session (:class:`loraflow.rollout_worker.gateway.session.Session`) plays a multi-turn episode whose model turns
are fixed texts "generated" as the model would (their tokens, then the template's end-of-turn id). The harness
sends each turn back as an OpenAI client does and adds a tool result or a user turn. Two numbers per cell:

- ``div``: calls whose rendering did not start with the held tokens (``tito_divergence``, the gateway's
  count; the held tokens were kept, so training is still exact);
- ``drift``: what a pipeline that re-tokenizes the final conversation would train: the number of generated
  tokens that differ from (or are missing in) ``apply_chat_template`` of the whole conversation.

Scenarios: ``plain`` (three user/assistant turns), ``tool`` (assistant turns answered by ``tool`` messages),
``tool_calls`` (the harness sends back parsed ``tool_calls`` with ``content: null``), ``think`` (a
``<think>`` block, then a user turn: Qwen3's template strips earlier reasoning), ``spaces`` (a turn ending in
whitespace that templates ``trim``), ``length`` (a turn cut by max_tokens, without its end-of-turn id).

Besides the zoo's own templates, ``qwen2.5`` is the qwen2 zoo tokenizer with Qwen2.5-Instruct's chat template as
published (tools in the system prompt, ``tool_calls`` rendered as ``<tool_call>`` JSON), written here from
that release's Jinja; its episodes pass the calculator schema as ``tools``.

The JSON line's value is the share of (family, scenario) cells the gateway served without divergence;
reference 1.0. Divergent cells are the templates' doing and are counted, not hidden.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench import harness
from bench.report import report

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
        parsed = parse_hermes(text)
        if parsed.tool_calls:  # as an OpenAI client sends it back
            messages.append({"role": "assistant", "content": None, "tool_calls": parsed.tool_calls})
        else:
            messages.append({"role": "assistant", "content": text})
        if follow is not None:
            messages.append(dict(follow))
    final = chat.encode_text(chat.render(template_messages(messages), add_generation_prompt=False, tools=tools),
                             special=False)
    drift = sum(1 for at, turn in generated for i, t in enumerate(turn) if at + i >= len(final) or final[at + i] != t)
    return sum(session.divergences.values()), drift, dict(session.divergences)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--families", default="", help="comma-separated model_zoo families (default: all, and qwen2.5)")
    args = harness.parse(parser, None, families="qwen2")
    from transformers import AutoTokenizer

    from loraflow.common.chat import ChatFormat
    from loraflow.common.model_zoo import FAMILIES, build_model

    rows, clean, cells = [], 0, 0
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
            cells_of = {}
            for name, turns in SCENARIOS.items():
                div, drift, reasons = play(chat, end_id, turns, tools)
                cells_of[name] = (div, drift, reasons)
                clean += div == 0
                cells += 1
            rows.append((family, cells_of))
    header = "| family | " + " | ".join(SCENARIOS) + " | prefix-preserving |"
    print(header)
    print("|" + "---|" * (len(SCENARIOS) + 2))
    for family, cells_of in rows:
        text = []
        for name in SCENARIOS:
            div, drift, reasons = cells_of[name]
            why = "" if not reasons else " (" + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")"
            text.append(f"div {div}{why} / drift {drift}")
        preserving = sum(cells_of[n][0] == 0 for n in SCENARIOS)
        print(f"| {family} | " + " | ".join(text) + f" | {preserving}/{len(SCENARIOS)} |")
    report("gateway_conformance", "prefix_preserving_share", clean / cells, "fraction", 1.0,
           cells=cells, families=len(rows))


if __name__ == "__main__":
    main()
