"""The greedy evaluator: decoding matches a plain argmax loop, scoring follows the task, adapters apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraflow.common.tasks import ArithTask, load_task
from loraflow.deploy.evaluate import evaluate, evaluate_dir, greedy_completions, load_model


def argmax_decode(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[str, bool]:
    ids = tokenizer(prompt).input_ids
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            token = int(logits.argmax())
            if token == tokenizer.eos_token_id:
                return tokenizer.decode(out), True
            out.append(token)
    return tokenizer.decode(out), False


def test_greedy_matches_an_argmax_loop_across_prompt_lengths(tiny_model_dir: Path) -> None:
    model, tokenizer = load_model(tiny_model_dir)
    prompts = ["12+34=", "7*8+100=", "99+1=", "ab", "12+34=", "3*4+5="]  # lengths differ; one repeats
    got = greedy_completions(model, tokenizer, prompts, max_new_tokens=5, batch_size=2)
    assert got == [argmax_decode(model, tokenizer, p, 5) for p in prompts]


class ScriptedModel:
    """Stands in for a causal LM: ``generate`` appends a scripted reply to each prompt."""

    def __init__(self, tokenizer, replies: dict[str, list[int]]) -> None:
        self.tokenizer, self.replies, self.device = tokenizer, replies, torch.device("cpu")

    def generate(self, input_ids, generation_config, **_):
        max_new_tokens, pad_token_id = generation_config.max_new_tokens, generation_config.pad_token_id
        rows = []
        for row in input_ids.tolist():
            reply = self.replies[self.tokenizer.decode(row)][:max_new_tokens]
            rows.append(row + reply + [pad_token_id] * (max_new_tokens - len(reply)))
        return torch.tensor(rows)


def test_scoring_needs_the_exact_answer_and_an_end(tiny_model_dir: Path) -> None:
    _, tokenizer = load_model(tiny_model_dir)
    task = ArithTask(seed=1)
    items = [task.item(i, "eval") for i in range(6)]
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text).input_ids

    replies = {
        items[0].prompt: ids(items[0].answer) + [eos],               # right
        items[1].prompt: ids(items[1].answer) + [eos, 5, 6],         # right; what follows EOS is ignored
        items[2].prompt: ids(items[2].answer),                       # right digits but never ended
        items[3].prompt: ids(items[3].answer + "0") + [eos],         # wrong
        items[4].prompt: ids(" " + items[4].answer) + [eos],         # surrounding space: the task strips it
        items[5].prompt: [eos],                                      # empty
    }
    result = evaluate(ScriptedModel(tokenizer, replies), tokenizer, task, num_prompts=6, max_new_tokens=5)
    assert result.correct == [True, True, False, False, True, False]
    assert result.num_correct == 3 and result.accuracy == 0.5
    assert result.prompts == [item.prompt for item in items]
    assert result.completions[1] == items[1].answer


def test_num_prompts_must_be_positive(tiny_model_dir: Path) -> None:
    model, tokenizer = load_model(tiny_model_dir)
    with pytest.raises(ValueError, match="eval.num_prompts"):
        evaluate(model, tokenizer, load_task("arith"), num_prompts=0, max_new_tokens=4)


def test_adapter_directories_are_applied(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = evaluate_dir(tiny_model_dir, task="arith", num_prompts=16, max_new_tokens=4)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    lora.save_pretrained(str(tmp_path / "zero"))  # freshly initialised LoRA: B = 0, the base function
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    lora.save_pretrained(str(tmp_path / "moved"))
    zero = evaluate_dir(tiny_model_dir, tmp_path / "zero", task="arith", num_prompts=16, max_new_tokens=4)
    moved = evaluate_dir(tiny_model_dir, tmp_path / "moved", task="arith", num_prompts=16, max_new_tokens=4)
    assert zero.completions == base.completions
    assert moved.completions != base.completions
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        load_model(tiny_model_dir, tmp_path)


def test_the_model_directory_sampling_defaults_do_not_apply(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A generation_config.json with a repetition penalty and top-k changes neither greedy evaluation nor the hf
    backend's sampling: loraflow samples from log_softmax(logits / T) and nothing else."""
    from transformers import GenerationConfig

    from loraflow.common.hf_generation import generation_config, neutralise

    model, tokenizer = load_model(tiny_model_dir)
    expected = greedy_completions(model, tokenizer, ["12+34=", "7*8+100="], max_new_tokens=5)
    model.generation_config = GenerationConfig(repetition_penalty=50.0, top_k=1, no_repeat_ngram_size=1,
                                               min_new_tokens=5, eos_token_id=model.generation_config.eos_token_id)
    assert greedy_completions(model, tokenizer, ["12+34=", "7*8+100="], max_new_tokens=5) == expected
    assert model.generation_config.eos_token_id is not None  # the special ids survive
    config = generation_config(greedy=False, max_new_tokens=4, eos_token_ids=[1], pad_token_id=0, temperature=0.7)
    neutralise(model)
    merged, _ = model._prepare_generation_config(config)
    assert merged.top_k == 0 and merged.repetition_penalty in (None, 1.0)
    processors = model._get_logits_processor(generation_config=merged, input_ids_seq_length=3,
                                             encoder_input_ids=None, prefix_allowed_tokens_fn=None,
                                             logits_processor=None, device="cpu")
    assert [type(p).__name__ for p in processors] == ["TemperatureLogitsWarper"]
