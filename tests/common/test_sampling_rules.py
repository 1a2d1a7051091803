"""Sampling settings whose behaviour log-probs would break common/logprobs.py's promise are refused at load.

The promise: a behaviour log-prob is ``log_softmax(logits / temperature)[token]``, before top-p. The hf backend
computes it from ``generate``'s raw logits whatever the settings; vLLM gives it at temperature 1
(``raw_logprobs``) or with top_p 1 (``processed_logprobs``: after temperature, nothing truncated), but not both
changed at once, and it samples at no temperature below 0.01.
"""

from __future__ import annotations

import pytest

from loraflow.common.config import ConfigError, load_config


@pytest.mark.parametrize(("backend", "temperature", "top_p"), [
    ("vllm", 1.0, 1.0),
    ("vllm", 1.0, 0.9),  # raw log-probs are exact whatever top_p
    ("vllm", 0.7, 1.0),  # processed log-probs: after temperature, nothing truncated
    ("vllm", 0.01, 1.0),
    ("vllm", 2.5, 1.0),
    ("hf", 0.7, 0.9),  # generate's raw logits: exact for any combination
    ("hf", 0.001, 0.5),
    ("sim", 0.5, 0.5),
])
def test_sampling_accepted(backend: str, temperature: float, top_p: float) -> None:
    config = load_config(None, [f'worker.backend="{backend}"', f"worker.temperature={temperature}",
                                f"worker.top_p={top_p}"])
    assert (config.worker.temperature, config.worker.top_p) == (temperature, top_p)


@pytest.mark.parametrize(("temperature", "top_p", "names"), [
    (0.7, 0.9, ["worker.top_p = 0.9", "worker.temperature = 0.7", 'worker.backend = "vllm"',
                "Set worker.top_p = 1 or worker.temperature = 1"]),
    (1.5, 0.95, ["worker.top_p = 0.95", "worker.temperature = 1.5", "full-vocabulary log-probs"]),
    (0.005, 1.0, ["worker.temperature = 0.005 is below 0.01", "use worker.temperature >= 0.01"]),
    (1e-6, 1.0, ["worker.temperature = 1e-06", "greedily"]),
])
def test_sampling_refused_names_the_settings(temperature: float, top_p: float, names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ['worker.backend="vllm"', f"worker.temperature={temperature}", f"worker.top_p={top_p}"])
    for name in names:
        assert name in str(info.value), str(info.value)


def test_the_rule_applies_to_config_files_too(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[worker]\nbackend = "vllm"\ntemperature = 0.8\ntop_p = 0.9\n')
    with pytest.raises(ConfigError, match="worker.top_p = 0.9 with worker.temperature = 0.8"):
        load_config(path)
    load_config(path, ["worker.top_p=1.0"])  # the fix the message names
