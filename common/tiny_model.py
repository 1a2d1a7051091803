"""The built-in tiny model: a byte-level tokenizer and a small random-init Llama, built offline.

Nothing is downloaded. :func:`build_tiny_model` writes a directory that ``AutoTokenizer.from_pretrained``,
``AutoModelForCausalLM.from_pretrained``, peft and vLLM all load like any Hugging Face model:

- tokenizer: BPE with no merges over the 256 byte-level symbols plus ``<pad>``, ``<s>``, ``</s>``; so every
  string round-trips and ``vocab_size == len(tokenizer)`` (no logits for ids that decode to nothing);
- model: Llama, hidden 128, intermediate 512, 4 layers, 4 heads (head_dim 32, which vLLM's CPU attention
  supports), 2 KV heads, ~1 M parameters.

The weights are random: such a model cannot do any task. The demo gives it a short supervised warm-up
(``deploy/demo_base.py``); tests that only need *a* model use it as it is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


@dataclass(frozen=True, slots=True)
class TinyShape:
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512


def build_tokenizer(directory: str | os.PathLike) -> None:
    """Write a byte-level tokenizer loadable by ``AutoTokenizer.from_pretrained(directory)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.add_special_tokens({"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"})
    tokenizer.save_pretrained(str(directory))


def build_tiny_model(directory: str | os.PathLike, *, seed: int = 0, shape: TinyShape = TinyShape()) -> Path:
    """Write tokenizer + random-init Llama weights (fp32 safetensors) to ``directory``; returns it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(directory), safe_serialization=True)
    (directory / "loraflow_model.json").write_text(json.dumps({"kind": "tiny", "seed": seed}))
    return directory


def default_cache_dir() -> Path:
    return Path(os.environ.get("LORAFLOW_CACHE", Path.home() / ".cache" / "loraflow"))


def demo_base_link(seed: int, cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache>/demo-s<seed>``: a symlink to the demo base ``deploy/demo_base.py`` last built or found for
    ``seed`` (whose directory name carries its recipe's fingerprint, which only deploy/ knows)."""
    return Path(cache_dir or default_cache_dir()) / f"demo-s{seed}"


def find_demo_base(seed: int, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The demo base directory for ``seed`` if one was prepared on this machine, else None (never builds)."""
    link = demo_base_link(seed, cache_dir)
    if not (link / "loraflow_model.json").is_file():
        return None
    return link.resolve()


def resolve_model(path: str, cache_dir: str = "") -> Path:
    """A model directory for ``model.path``: ``builtin:tiny`` is built once (atomically) into the cache."""
    if path != "builtin:tiny":
        if path.startswith("builtin:"):
            raise ValueError(f"model.path {path!r}: only builtin:tiny is built here; builtin:demo is prepared "
                             "by `loraflow run` (or pass a model directory)")
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"model.path {path!r} is not a Hugging Face model directory (no config.json)")
        return Path(path)
    target = Path(cache_dir or default_cache_dir()) / "tiny"
    if not (target / "config.json").is_file():
        import shutil
        import tempfile

        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="tiny-", dir=target.parent))
        build_tiny_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_vocab_size(directory: str | os.PathLike) -> int:
    """``vocab_size`` from a model directory's config.json without importing torch; 0 if unknown."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0)
    return int(size) if isinstance(size, int) else 0
