"""Built-in tasks are deterministic with disjoint splits; the tiny model loads offline everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraflow.common.tasks import ArithTask, CalculatorTask, load_task
from loraflow.common.tiny_model import model_vocab_size, resolve_model


@pytest.mark.parametrize("task_cls", [ArithTask, CalculatorTask])
def test_items_are_deterministic_and_splits_disjoint(task_cls) -> None:
    task = task_cls(seed=3)
    assert task.item(5) == task_cls(seed=3).item(5)
    train = {task.item(i).prompt for i in range(300)}
    held_out = {task.item(i, "eval").prompt for i in range(100)}
    assert not train & held_out
    assert len(held_out) > 50
    item = task.item(0)
    assert eval(item.prompt.rstrip("=")) == int(item.answer)  # noqa: S307 - our own arithmetic


def test_arith_scoring_requires_the_exact_answer_and_a_proper_end() -> None:
    task = ArithTask()
    assert task.score("57", "57", finished=True) == 1.0
    assert task.score("57", "57", finished=False) == 0.0
    assert task.score("571", "57", finished=True) == 0.0


def test_jsonl_task(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(20)))
    task = load_task(str(path))
    assert task.size == 18 and task.item(0, "eval").prompt == "q0" and task.item(0).prompt == "q2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        load_task(str(bad))
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        load_task("nope")


def test_tiny_model_loads_offline_with_matching_vocab(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert len(tokenizer) == model.config.vocab_size == model_vocab_size(tiny_model_dir) == 259
    text = "12+34=46 ✓"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer("1+1=").input_ids])).logits
    assert logits.shape[-1] == 259 and torch.isfinite(logits).all()
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # vLLM's CPU attention needs it


def test_resolve_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="builtin:demo is prepared by `loraflow run`"):
        resolve_model("builtin:demo")
    assert model_vocab_size(tmp_path) == 0
