"""learner.target_modules: "all-linear" or a list; names checked against the model's own modules at start-up.

The checks read the model on the meta device (:mod:`loraflow.common.lora_targets`), so the table below runs on config
files alone: Llama (untied head), Qwen2 (attention bias, tied embeddings) and GPT-2 (transformers' Conv1D
layers, a tied head named lm_head). One real learner process trains with "all-linear" against the scripted
broker, and one is refused for a target vLLM cannot serve.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraflow.common.config import ConfigError, load_config, to_toml
from loraflow.common.lora_targets import (
    ALL_LINEAR,
    TargetModulesError,
    check_model_dir,
    meta_model,
    resolve_target_modules,
)
from tests.learner.scripted import ScriptedBroker
from tests.learner.test_learner_runs import learner_argv
from tests.support import Processes

ATTENTION_AND_MLP = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _write_config(directory: Path, family: str) -> Path:
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    shapes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 300}
    config = {
        "llama": lambda: LlamaConfig(**shapes, tie_word_embeddings=False),
        "qwen2": lambda: Qwen2Config(**shapes, tie_word_embeddings=True),
        "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=300),
    }[family]()
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)  # config.json only: no weights are needed to check names
    return directory


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("configs")
    return {family: _write_config(root / family, family) for family in ("llama", "qwen2", "gpt2")}


# -- resolution ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("family", "targets", "expected"), [
    ("llama", ALL_LINEAR, ATTENTION_AND_MLP),
    ("qwen2", ALL_LINEAR, ATTENTION_AND_MLP),  # the tied lm_head is left out
    ("qwen2", "ALL-LINEAR", ATTENTION_AND_MLP),  # peft's shorthand is case-insensitive
    ("gpt2", ALL_LINEAR, ["c_attn", "c_fc", "c_proj"]),  # Conv1D layers count as linear, as in peft
    ("llama", ["q_proj", "v_proj"], ["q_proj", "v_proj"]),
    ("llama", ["layers.0.self_attn.q_proj"], ["layers.0.self_attn.q_proj"]),  # a path: kept as given
    ("gpt2", ["c_attn"], ["c_attn"]),
])
def test_targets_resolve(model_dirs: dict[str, Path], family: str, targets, expected: list[str]) -> None:
    assert check_model_dir(targets, model_dirs[family]) == expected


@pytest.mark.parametrize(("family", "targets", "message"), [
    ("llama", ["no_such_proj"], "'no_such_proj' matches no module of LlamaForCausalLM; its linear layers are "
                                f"{ATTENTION_AND_MLP}"),
    ("llama", ["q_proj", "qproj"], "'qproj' matches no module"),
    ("llama", ["embed_tokens"], "selects model.embed_tokens (Embedding, not a linear layer)"),
    ("llama", ["lm_head"], "selects lm_head (the output head)"),
    ("qwen2", ["lm_head"], "selects lm_head (the output head)"),  # tied to the embeddings
    ("gpt2", ["lm_head"], "selects lm_head (the output head)"),
    ("gpt2", ["wte"], "selects transformer.wte (Embedding"),
    ("llama", ["self_attn"], "selects model.layers.0.self_attn (LlamaAttention, not a linear layer)"),
    ("llama", ["input_layernorm"], "(LlamaRMSNorm, not a linear layer)"),
    ("qwen2", ["q_proj", "norm"], "selects model.norm (Qwen2RMSNorm"),
])
def test_targets_refused_name_the_model_modules(model_dirs: dict[str, Path], family: str, targets: list[str],
                                                message: str) -> None:
    with pytest.raises(TargetModulesError) as info:
        check_model_dir(targets, model_dirs[family])
    text = str(info.value)
    assert text.startswith("learner.target_modules") and message in text, text
    if "matches no module" not in text:
        assert "choose from" in text and "'all-linear'" in text


def test_all_linear_selects_what_peft_selects(model_dirs: dict[str, Path]) -> None:
    """Our expansion of "all-linear" puts LoRA on exactly the modules peft's own expansion does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    def lora_modules(directory: Path, targets) -> set[str]:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
        peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=targets))
        return {n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")}

    for family, directory in model_dirs.items():
        ours = lora_modules(directory, resolve_target_modules(ALL_LINEAR, meta_model(directory)))
        assert ours and ours == lora_modules(directory, ALL_LINEAR), family


def test_meta_model_holds_no_weights(model_dirs: dict[str, Path]) -> None:
    model = meta_model(model_dirs["llama"])
    assert {p.device.type for p in model.parameters()} == {"meta"}


# -- the config setting ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("override", "expected"), [
    ('learner.target_modules="all-linear"', "all-linear"),
    ("learner.target_modules=all-linear", "all-linear"),  # a bare word on the command line
    ('learner.target_modules=["q_proj", "v_proj"]', ["q_proj", "v_proj"]),
])
def test_config_takes_a_string_or_a_list(override: str, expected) -> None:
    config = load_config(None, [override])
    assert config.learner.target_modules == expected
    assert f"target_modules = {json.dumps(expected)}" in to_toml(config)  # the resolved copy reloads the same


@pytest.mark.parametrize(("override", "message"), [
    ("learner.target_modules=q_proj", "a single string must be 'all-linear'"),
    ("learner.target_modules=[]", "learner.target_modules is empty"),
    ("learner.target_modules=7", "learner.target_modules: expected str or list[str], got int 7"),
    ("learner.target_modules=[1, 2]", "learner.target_modules: expected str or list[str], got list"),
])
def test_config_refuses_other_values(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [override])


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(to_toml(load_config(None, ["learner.target_modules=all-linear"])))
    assert load_config(path).learner.target_modules == "all-linear"


# -- the real learner ------------------------------------------------------------------------------------------

def test_learner_trains_all_linear_and_publishes_the_expanded_list(procs: Processes, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    broker = ScriptedBroker(seed=3)
    try:
        proc = procs.spawn("learner", learner_argv(tmp_path / "run", broker.endpoint, tiny_model_dir,
                                                   "run.num_steps=2", "learner.checkpoint_every=0",
                                                   'learner.target_modules="all-linear"'))
        assert proc.wait(240) == 0, proc.log()[-3000:]
    finally:
        broker.close()
    assert [p.version for p in broker.published] == [1, 2]
    published = broker.published[-1]
    assert sorted(published.adapter_config["target_modules"]) == ATTENTION_AND_MLP
    layers = {name.split(".layers.")[1].split(".")[0] for name in published.tensors}
    assert len(layers) == 4  # every decoder layer of the tiny model
    kinds = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in published.tensors}
    assert sorted(kinds) == ATTENTION_AND_MLP and not any("embed" in n or "lm_head" in n for n in published.tensors)


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_learner_refuses_a_module_vllm_cannot_serve_with_exit_2(procs: Processes, tiny_model_dir: Path,
                                                                tmp_path: Path, target: str) -> None:
    proc = procs.spawn("learner-bad", learner_argv(tmp_path / "run", "tcp://127.0.0.1:1", tiny_model_dir,
                                                   f'learner.target_modules=["q_proj", "{target}"]'))
    assert proc.wait(120) == 2, proc.log()[-3000:]
    log = proc.log()
    assert "config error: learner.target_modules" in log and f"{target!r} selects" in log and "q_proj" in log
    assert "Traceback" not in log


def test_target_check_runs_without_loading_weights(tmp_path: Path) -> None:
    """A directory holding only config.json is enough: the check reads no weight file."""
    directory = _write_config(tmp_path / "only-config", "llama")
    assert sorted(p.name for p in directory.iterdir()) == ["config.json"]
    assert check_model_dir(["o_proj"], directory) == ["o_proj"]
