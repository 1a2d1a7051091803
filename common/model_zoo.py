"""Small random-init models of real architectures with realistic tokenizers, built offline in about a second.

Each family is written the way its Hugging Face release is laid out, so everything that reads a model (the
rollout backends, vLLM, the learner, peft, the evaluation) meets what it will meet with the real one:

============  =================  ========================================================================
family        architecture       what is particular to it
============  =================  ========================================================================
``llama3``    LlamaForCausalLM   BOS added by the tokenizer and written by the template, no pad token,
                                 ``<|eot_id|>`` ends a turn, generation_config lists three eos ids
``qwen2``     Qwen2ForCausalLM   attention bias, tied embeddings, vocab padded beyond the tokenizer, a
                                 default system prompt, tool replies as ``<tool_response>`` user turns,
                                 eos ``<|im_end|>`` + ``<|endoftext|>``
``qwen3``     Qwen3ForCausalLM   q/k norm, explicit head_dim, padded vocab, ``enable_thinking`` in the
                                 template (an empty ``<think></think>`` when false), reasoning stripped
                                 from earlier assistant turns
``gemma``     GemmaForCausalLM   SentencePiece-style BPE (``▁`` for spaces, byte fallback), tied and
                                 scaled embeddings, no system role (folded into the first user turn), a
                                 ``model`` role, the tokenizer's eos is ``<eos>`` but a turn ends with
                                 ``<end_of_turn>`` (generation_config lists both)
============  =================  ========================================================================

Tokenizers are BPE models trained with ``tokenizers`` on a small corpus made here (:func:`corpus`): byte-level
with each family's pre-tokenizer regex for Llama-3 and Qwen, SentencePiece-style for Gemma. Every model has
hidden size 128 with 2 heads of head_dim 64 (which vLLM's CPU attention supports), 1 KV head, 2 layers.

``python -m loraflow.common.model_zoo qwen2 DIR`` writes one; :func:`build_model` is what tests and benches call.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GPT4_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

QWEN2_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

QWEN3_TEMPLATE = """{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = messages|length - 1 - loop.index0 %}
{%- if message.role == 'user' and ns.last_query == messages|length - 1 and not message.content.startswith('<tool_response>') %}
{%- set ns.last_query = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'system' or message.role == 'user' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- if loop.index0 > ns.last_query %}
{%- set content = '<think>\\n' + reasoning + '\\n</think>\\n\\n' + content %}
{%- endif %}
{%- endif %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

GEMMA_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set first_user_prefix = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
{%- set role = 'model' if message['role'] == 'assistant' else 'user' %}
{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<start_of_turn>model\\n' }}
{%- endif %}"""


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """How one model family's tokenizer, template and config look."""

    name: str
    model_type: str  # transformers config class key
    tokenizer: str  # "bytelevel" or "sentencepiece"
    split: str = ""  # byte-level pre-tokenizer regex
    special: tuple[str, ...]  # special tokens (skipped when decoding)
    added: tuple[str, ...] = ()  # added tokens that are not special (Qwen's <think>, <tool_call>)
    bos: str | None = None
    eos: str  # the tokenizer's eos_token
    pad: str | None = None
    unk: str | None = None
    add_bos: bool = False  # the tokenizer prepends bos to a plain string
    generation_eos: tuple[str, ...]  # generation_config.eos_token_id, in the release's order
    template: str
    vocab_multiple: int = 0  # pad config.vocab_size to a multiple of this, beyond the tokenizer (0 = no padding)
    config: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "llama3": Family(
        name="llama3", model_type="llama", tokenizer="bytelevel", split=GPT4_SPLIT,
        special=("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                 "<|eot_id|>", "<|python_tag|>"),
        bos="<|begin_of_text|>", eos="<|eot_id|>", add_bos=True,
        generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), template=LLAMA3_TEMPLATE,
        config={"rope_theta": 500000.0, "tie_word_embeddings": False}),
    "qwen2": Family(
        name="qwen2", model_type="qwen2", tokenizer="bytelevel", split=QWEN_SPLIT,
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        eos="<|im_end|>", pad="<|endoftext|>", generation_eos=("<|im_end|>", "<|endoftext|>"),
        template=QWEN2_TEMPLATE, vocab_multiple=128, config={"tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen3": Family(
        name="qwen3", model_type="qwen3", tokenizer="bytelevel", split=QWEN_SPLIT,
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
        eos="<|im_end|>", pad="<|endoftext|>", generation_eos=("<|im_end|>", "<|endoftext|>"),
        template=QWEN3_TEMPLATE, vocab_multiple=128,
        config={"tie_word_embeddings": False, "head_dim": 64, "rope_theta": 1e6}),
    "gemma": Family(
        name="gemma", model_type="gemma", tokenizer="sentencepiece",
        special=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True,
        generation_eos=("<eos>", "<end_of_turn>"), template=GEMMA_TEMPLATE,
        config={"head_dim": 64, "hidden_activation": "gelu_pytorch_tanh"}),
}

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 1024}
TRAINED_VOCAB = 640  # BPE vocabulary learned from the corpus (before special tokens)
WORDS = ("the a of and to in is you that it he was for on are as with his they at be this have from or one "
         "had by word but not what all were we when your can said there use an each which she do how their "
         "if will up other about out many then them these so some her would make like him into time has "
         "look two more write go see number no way could people my than first water been call who oil its "
         "now find long down day did get come made may part answer question step think calculate total system user "
         "assistant model tool brief helpful")


def corpus(seed: int = 0, num_lines: int = 600) -> list[str]:
    """A small deterministic corpus: sentences, word problems, arithmetic, tool calls (what prompts look like)."""
    rng = random.Random(seed)
    names = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo"]
    things = ["apples", "books", "coins", "marbles", "pencils", "stamps", "cookies", "tickets"]
    verbs = ["buys", "gives away", "finds", "sells", "loses", "collects"]
    words = WORDS.split()
    lines = []
    for i in range(num_lines):
        kind = i % 5
        if kind == 0:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + ".")
        elif kind == 1:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            name, thing, verb = rng.choice(names), rng.choice(things), rng.choice(verbs)
            lines.append(f"{name} has {a} {thing} and {verb} {b}. How many {thing} does {name} have now?")
        elif kind == 2:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"{a}+{b}={a + b}. {a}*{b % 10}={a * (b % 10)}. #### {a + b}")
        elif kind == 3:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"<calc>{a}*{b}</calc> ={a * b}\nThe answer is \\boxed{{{a * b}}}.")
        else:
            lines.append(f"Let me think step by step.\nFirst, {rng.choice(words)} {rng.randint(1, 50)}; "
                         f"then {rng.choice(words)} {rng.randint(1, 50)}.\n\n")
    return lines


def build_tokenizer(family: Family, directory: Path, *, seed: int = 0) -> Any:
    """Train the family's BPE on :func:`corpus` and save it with its special tokens and chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    text = corpus(seed)
    if family.tokenizer == "bytelevel":
        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(family.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        core.decoder = decoders.ByteLevel()
        core.train_from_iterator(text, BpeTrainer(vocab_size=TRAINED_VOCAB, show_progress=False,
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    else:  # SentencePiece-style: spaces as ▁, merges across them, bytes as <0xNN> for anything unseen
        learner = Tokenizer(models.BPE())
        learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
        learner.train_from_iterator(text, BpeTrainer(vocab_size=TRAINED_VOCAB, show_progress=False))
        trained = json.loads(learner.to_str())["model"]
        ordered = [*family.special, *(f"<0x{b:02X}>" for b in range(256)),
                   *sorted(trained["vocab"], key=trained["vocab"].get)]
        vocab = {token: i for i, token in enumerate(dict.fromkeys(ordered))}
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
        core = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=family.unk,
                                    fuse_unk=True))
        core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
        core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    if family.add_bos:
        bos = family.bos
        core.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                            special_tokens=[(bos, core.token_to_id(bos))])
    tokens = {k: v for k, v in {"bos_token": family.bos, "eos_token": family.eos, "pad_token": family.pad,
                                "unk_token": family.unk}.items() if v is not None}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **tokens,
                                        additional_special_tokens=[t for t in family.special
                                                                   if t not in tokens.values()])
    tokenizer.chat_template = family.template
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def model_config(family: Family, tokenizer: Any) -> Any:
    """The transformers config of the family, shaped small (:data:`SHAPE`), ids from the tokenizer."""
    from transformers import AutoConfig

    vocab_size = len(tokenizer)
    if family.vocab_multiple:  # as Qwen's releases: room beyond the tokenizer, rounded up
        vocab_size = (vocab_size // family.vocab_multiple + 2) * family.vocab_multiple
    generation_eos = [tokenizer.convert_tokens_to_ids(t) for t in family.generation_eos]
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": generation_eos if len(generation_eos) > 1
           else generation_eos[0], "pad_token_id": tokenizer.pad_token_id}
    return AutoConfig.for_model(family.model_type, vocab_size=vocab_size, **SHAPE, **ids, **family.config,
                                torch_dtype="float32")


def build_model(family_name: str, directory: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write tokenizer, chat template, config, generation_config and random fp32 weights; returns ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family_name not in FAMILIES:
        raise ValueError(f"unknown model family {family_name!r}; choose one of {sorted(FAMILIES)}")
    family = FAMILIES[family_name]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family, directory, seed=seed)
    config = model_config(family, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in family.generation_eos])
    model.save_pretrained(str(directory), safe_serialization=True)
    (directory / "loraflow_model.json").write_text(json.dumps({"kind": "zoo", "family": family_name, "seed": seed}))
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loraflow.common.model_zoo", description=__doc__.split("\n")[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_model(args.family, args.directory, seed=args.seed))


if __name__ == "__main__":
    main()
