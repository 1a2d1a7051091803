"""The agent demo's base model: the tiny model taught to use a calculator tool, half-heartedly; built once, cached.

The agent demo (``deploy/configs/agent-demo.toml``) plays the built-in ``calculator`` task (``"47*23+512="``)
through the harness ``deploy/agents/agent_demo.py``: the model may call the tool ``calc`` in the Hermes format,
gets its result as a tool message, and answers. A 1M-parameter model cannot multiply, so it scores only by
calling the tool with the problem's expression and then copying the result. The base is prepared like the
arithmetic demo's (``deploy/demo_base.py``, whose warm-up loop and cache conventions it reuses): a model that
first learned the whole skill, then a sloppier habit that leaves RL a reachable target:

1. ``correct``: every problem as a full episode (tool call, tool result, answer), at least ``min_correct_steps``
   and then until the first turn is the exact tool call on the train split (``call_learned_accuracy``), at
   most ``max_correct_steps``;
2. ``sloppy``: ``sloppy_steps`` more where, for problems whose first factor is ``trusted_below`` or more, a
   fraction ``drop_fraction`` of the labels answer at once without the tool (with the problem's last number,
   always wrong), the learning rate decaying linearly to 10 %.

So the base calls the tool correctly on problems with a small first factor and answers the others from
"memory" (greedy), while sampling still calls the tool on those now and then: the signal RL amplifies. The
checks (greedy, held-out eval split, first turn only, :func:`first_turn_accuracy`) want the small-factor
problems handled (``min_trusted_accuracy``) and the overall share of correct tool calls in
``accuracy_window``; while not, the sloppy phase runs ``extra_steps`` more, at most ``max_extra_rounds`` times.

The model is the built-in tiny Llama (:mod:`loraflow.common.tiny_model`) with two additions a real chat model has:

- a chat template (:data:`CHAT_TEMPLATE`): ``tools: calc`` when tools are given, then ``U:``/``T:``/``S:``
  lines for user, tool and system messages and ``A:`` + the assistant's text (its ``tool_calls`` written as
  ``<tool_call>{json}</tool_call>``, as the model generates them) + ``</s>``; it never re-renders an earlier
  turn otherwise, so the gateway's trajectories stay prefix-consistent;
- the tool-call markup as added tokens (:data:`ADDED_TOKENS`; Qwen2.5's tokenizer has ``<tool_call>`` as one
  token too), so a call is ~27 tokens instead of ~80 bytes: shorter episodes to train and to generate.

Seeded and single-threaded as the arithmetic demo's base, so a seed gives the same base on one machine; built
in a temporary directory renamed into ``<cache>/agent-demo-s<seed>-<recipe hash>``.
``python -m loraflow.deploy.agent_base --seed 0`` builds ahead of time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.common.logging import get_logger
from loraflow.common.tasks import CalculatorTask
from loraflow.common.tiny_model import build_tiny_model, default_cache_dir
from loraflow.deploy.agents.agent_demo import CALC, TOOL_NAME
from loraflow.deploy.demo_base import (
    METADATA_FILE,
    DemoBaseError,
    Recipe,
    _WarmUp,
    build_into,
    quick_cache_dir,
    read_metadata,
)

log = get_logger("agent_base")

BUILTIN_NAME = "builtin:agent-demo"
ADDED_TOKENS = ("<tool_call>", "</tool_call>", '{"name": ', '"arguments": ', '{"expression": ')

CHAT_TEMPLATE = """
{%- if tools %}{{- 'tools:' }}{%- for tool in tools %}{{- ' ' + (tool.function.name if tool.function is defined
else tool.name) }}{%- endfor %}{{- '\\n' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}{{- 'A:' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}{%- set f = call.function if call.function is defined else call %}
{{- '<tool_call>' + ({'name': f.name, 'arguments': f.arguments} | tojson) + '</tool_call>' }}
{%- endfor %}{{- eos_token }}
{%- elif message.role == 'tool' %}{{- 'T:' + message.content + '\\n' }}
{%- elif message.role == 'system' %}{{- 'S:' + message.content + '\\n' }}
{%- else %}{{- 'U:' + message.content + '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'A:' }}{%- endif %}"""


@dataclass(frozen=True, slots=True)
class AgentRecipe:
    """How the agent demo base is trained and what it must achieve; part of the cache key."""

    batch_size: int = 32
    lr: float = 1.5e-3  # 3e-3 had learned no copy of the expression after 400 steps, 1.5e-3 91 % after 300
    warmup_steps: int = 30
    grad_clip: float = 1.0
    min_correct_steps: int = 200
    max_correct_steps: int = 800
    call_learned_accuracy: float = 0.9
    check_every: int = 50
    trusted_below: int = 30
    sloppy_steps: int = 100
    drop_fraction: float = 0.8
    extra_steps: int = 50
    max_extra_rounds: int = 4
    min_trusted_accuracy: float = 0.9
    accuracy_window: tuple[float, float] = (0.15, 0.45)
    num_eval_prompts: int = 200
    max_new_tokens: int = 40
    num_threads: int = 1

    fingerprint = Recipe.fingerprint  # a hash of the fields, as the arithmetic demo's recipe


#: an agent base for the code paths, not the figures (as :data:`loraflow.deploy.demo_base.QUICK_RECIPE`): it
#: already writes the tool call's format; the suite's agent runs and ``bench.agent_demo --quick`` train on it
QUICK_AGENT_RECIPE = AgentRecipe(min_correct_steps=150, max_correct_steps=150, sloppy_steps=0, max_extra_rounds=0,
                                 min_trusted_accuracy=0.0, accuracy_window=(0.0, 1.0), num_eval_prompts=20)


# -- the episode's text ------------------------------------------------------------------------------------------


def operands(prompt: str) -> tuple[int, int, int]:
    """(a, b, c) of a calculator prompt ``"a*b+c="``."""
    product, _, c = prompt.removesuffix("=").partition("+")
    a, _, b = product.partition("*")
    return int(a), int(b), int(c)


def trusted(prompt: str, recipe: AgentRecipe) -> bool:
    """Whether the sloppy base still calls the tool on this problem (its first factor is small)."""
    return operands(prompt)[0] < recipe.trusted_below


def tool_call_text(expression: str) -> str:
    """The first turn that solves a problem: the Hermes tool call, exactly as the template writes it."""
    return "<tool_call>" + json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}}) + "</tool_call>"


def episode(prompt: str, answer: str, *, direct: bool) -> list[dict[str, Any]]:
    """A played episode's messages: the tool call, its result and the answer; or (``direct``) an answer from
    memory, the problem's last number."""
    user = {"role": "user", "content": prompt}
    if direct:
        return [user, {"role": "assistant", "content": str(operands(prompt)[2])}]
    call = {"type": "function", "function": {"name": TOOL_NAME,
                                             "arguments": {"expression": prompt.removesuffix("=")}}}
    return [user, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]


def segments(chat: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
             ) -> list[tuple[str, bool]]:
    """The conversation's text cut into (text, is an assistant turn): each assistant turn is what the template
    adds to the conversation before it rendered with a generation prompt (its text and end-of-turn)."""
    out: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat.render(messages[:i], tools=tools)
        after = chat.render(messages[:i + 1], add_generation_prompt=False, tools=tools)
        assert before.startswith(done) and after.startswith(before), "the template re-rendered an earlier turn"
        out += [(before[len(done):], False), (after[len(before):], True)]
        done = after
    return out


def first_turn_accuracy(model: Any, tokenizer: Any, task: CalculatorTask, recipe: AgentRecipe, split: str
                        ) -> dict[str, float]:
    """Greedy first turns on ``split``: the share that is the problem's exact tool call, overall and for trusted
    (small first factor) and other problems."""
    from loraflow.common.chat import ChatFormat
    from loraflow.deploy.evaluate import greedy_completions

    chat = ChatFormat(tokenizer)
    items = [task.item(i, split) for i in range(recipe.num_eval_prompts)]
    prompts = [chat.render([{"role": "user", "content": item.prompt}], tools=[CALC]) for item in items]
    turns = greedy_completions(model, tokenizer, prompts, recipe.max_new_tokens)
    hits = [finished and text == tool_call_text(item.prompt.removesuffix("="))
            for item, (text, finished) in zip(items, turns, strict=True)]
    kinds = [trusted(item.prompt, recipe) for item in items]

    def share(want: bool | None) -> float:
        chosen = [h for h, k in zip(hits, kinds, strict=True) if want is None or k == want]
        return sum(chosen) / max(1, len(chosen))

    return {"accuracy": share(None), "trusted_accuracy": share(True), "other_accuracy": share(False)}


# -- the build ---------------------------------------------------------------------------------------------------


def agent_base_dir(seed: int, cache_dir: str | os.PathLike | None = None, recipe: AgentRecipe = AgentRecipe()
                   ) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"agent-demo-s{seed}-{recipe.fingerprint()}"


def is_built(seed: int, cache_dir: str | os.PathLike | None = None, recipe: AgentRecipe = AgentRecipe()) -> bool:
    return (agent_base_dir(seed, cache_dir, recipe) / METADATA_FILE).is_file()


def ensure_agent_base(seed: int = 0, cache_dir: str | os.PathLike | None = None,
                      recipe: AgentRecipe = AgentRecipe()) -> Path:
    """The cached agent demo base for ``seed``, built first if it is not there yet."""
    target = agent_base_dir(seed, cache_dir, recipe)
    if not (target / METADATA_FILE).is_file():
        build_into(target, lambda directory: build_agent_base(directory, seed=seed, recipe=recipe))
    return target


def ensure_quick_agent_base(seed: int = 0) -> Path:
    """The cached :data:`QUICK_AGENT_RECIPE` base for ``seed``, beside the quick demo bases."""
    return ensure_agent_base(seed, quick_cache_dir(), QUICK_AGENT_RECIPE)


def build_tokenizer_and_model(directory: Path, seed: int) -> tuple[Any, Any]:
    """The tiny model with the chat template and the added tokens (its embeddings grown to fit them)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny_model(directory, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    tokenizer.add_tokens(list(ADDED_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return AutoTokenizer.from_pretrained(str(directory)), model


def build_agent_base(directory: str | os.PathLike, *, seed: int, recipe: AgentRecipe = AgentRecipe()
                     ) -> dict[str, Any]:
    """Build the model in ``directory``, warm it up, check it, save it; returns the metadata written."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    directory = Path(directory)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.num_threads)
    try:
        with torch.random.fork_rng():
            tokenizer, model = build_tokenizer_and_model(directory, seed)
            trainer = _AgentWarmUp(model, tokenizer, CalculatorTask(seed), recipe,
                                   random.Random(f"agent-demo-base/{seed}"))
            metadata = trainer.run()
        model.save_pretrained(str(directory), safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
    metadata.update(kind="agent-demo", seed=seed, recipe=dataclasses.asdict(recipe),
                    build_s=round(time.perf_counter() - start, 1))
    (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=1))
    log.info("agent_base_ready", tool_call_accuracy=metadata["base_accuracy"], build_s=metadata["build_s"])
    return metadata


class _AgentWarmUp(_WarmUp):
    """The arithmetic demo's warm-up loop (optimizer, schedule, steps) on agent episodes, with its own phases."""

    def __init__(self, model: Any, tokenizer: Any, task: CalculatorTask, recipe: AgentRecipe,
                 rng: random.Random) -> None:
        from loraflow.common.chat import ChatFormat

        super().__init__(model, tokenizer, task, recipe, rng)  # type: ignore[arg-type]
        self.chat = ChatFormat(tokenizer)
        self.tools = [CALC]

    def run(self) -> dict[str, Any]:
        recipe = self.recipe
        self.model.train()
        train = {"accuracy": 0.0}
        while self.num_steps < recipe.max_correct_steps:
            self.train(recipe.check_every if self.num_steps >= recipe.min_correct_steps
                       else recipe.min_correct_steps - self.num_steps, drop_fraction=0.0)
            train = self.measure("train")
            log.info("agent_base_correct_phase", step=self.num_steps, train_accuracy=train["accuracy"])
            if train["accuracy"] >= recipe.call_learned_accuracy:
                break
        correct_steps = self.num_steps
        self.train(recipe.sloppy_steps, drop_fraction=recipe.drop_fraction, decay=True)
        low, high = recipe.accuracy_window
        for extra_round in range(recipe.max_extra_rounds + 1):
            result = self.measure("eval")
            log.info("agent_base_check", step=self.num_steps, **result)
            if result["trusted_accuracy"] >= recipe.min_trusted_accuracy and low <= result["accuracy"] <= high:
                break
            if extra_round == recipe.max_extra_rounds:
                raise DemoBaseError(
                    f"the agent demo base warm-up did not converge after {self.num_steps} steps: held-out tool "
                    f"calls {result['accuracy']:.1%} right (wanted {low:.0%}-{high:.0%}), on trusted problems "
                    f"{result['trusted_accuracy']:.1%} (wanted >= {recipe.min_trusted_accuracy:.0%}); try another "
                    "run.seed or pass a model directory as model.path")
            self.train(recipe.extra_steps, drop_fraction=recipe.drop_fraction, decay=True)
        return {"base_accuracy": result["accuracy"], "trusted_accuracy": result["trusted_accuracy"],
                "other_accuracy": result["other_accuracy"], "train_accuracy_after_correct": train["accuracy"],
                "correct_steps": correct_steps, "sloppy_steps": self.num_steps - correct_steps,
                "num_eval_prompts": recipe.num_eval_prompts, "trusted_below": recipe.trusted_below}

    def batch(self, drop_fraction: float) -> tuple[Any, Any]:
        """(input_ids, labels) of ``batch_size`` train episodes; the loss covers the assistant turns only."""
        import torch

        rows, targets = [], []
        pad = self.tokenizer.pad_token_id
        for _ in range(self.recipe.batch_size):
            item = self.task.item(self.rng.randrange(1 << 40), "train")
            direct = (drop_fraction > 0 and not trusted(item.prompt, self.recipe)
                      and self.rng.random() < drop_fraction)
            ids: list[int] = []
            labels: list[int] = []
            for text, trained_turn in segments(self.chat, episode(item.prompt, item.answer, direct=direct),
                                               self.tools):
                piece = self.chat.encode_text(text, special=False)
                ids += piece
                labels += piece if trained_turn else [-100] * len(piece)
            rows.append(ids)
            targets.append(labels)
        width = max(map(len, rows))
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
        return input_ids, labels

    def measure(self, split: str) -> dict[str, float]:  # type: ignore[override]
        self.model.eval()
        try:
            return first_turn_accuracy(self.model, self.tokenizer, self.task, self.recipe, split)
        finally:
            self.model.train()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraflow.deploy.agent_base", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default="", help="default: $LORAFLOW_CACHE or ~/.cache/loraflow")
    args = parser.parse_args(argv)
    from loraflow.common.logging import setup_logging

    setup_logging("agent_base")
    path = ensure_agent_base(args.seed, args.cache_dir or None)
    meta = read_metadata(path)
    print(f"{path}\nfirst turns that are the right tool call: {meta['base_accuracy']:.1%} (first factor below "
          f"{meta['trusted_below']}: {meta['trusted_accuracy']:.1%}, others {meta['other_accuracy']:.1%}; built "
          f"in {meta['build_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
