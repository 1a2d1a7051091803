"""config: defaults, TOML files, overrides, and errors that name the key to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraflow.common.config import Config, ConfigError, load_config, to_toml, write_resolved
from loraflow.common.schema import describe


def test_defaults_are_valid_and_derived_values_follow() -> None:
    config = load_config()
    assert isinstance(config, Config)
    assert config.capacity_groups == config.run.groups_per_step * (config.run.max_staleness + 1)
    assert config.bind_endpoint == config.broker.endpoint
    assert config.run_dir == Path("runs/demo")


def test_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[run]\nname = "x"\nmax_staleness = 0\n[worker]\nbackend = "sim"\n[worker.sim]\nmean_tokens = 5.0\n')
    config = load_config(path, ["worker.temperature=0.5", 'learner.target_modules=["q_proj"]', "run.task=arith",
                                "broker.bind=tcp://0.0.0.0:7000"])
    assert config.run.name == "x" and config.run.max_staleness == 0
    assert config.worker.backend == "sim" and config.worker.sim.mean_tokens == 5.0
    assert config.worker.temperature == 0.5 and config.learner.target_modules == ["q_proj"]
    assert config.bind_endpoint == "tcp://0.0.0.0:7000"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["worker.temprature=0.5"], r"worker: unknown field\(s\) \['temprature'\]"),
        (["worker.backend=tpu"], r"worker.backend: must be one of \['hf', 'vllm', 'sim'\]"),
        (["run.group_size=0"], "run.group_size: must be >= 1"),
        (["run.group_size=2.5"], "run.group_size: expected an integer"),
        (["worker.temperature=nan"], "worker.temperature: must be a finite number"),
        (["broker.capacity_groups=3"], r"broker.capacity_groups \(3\) must be >= run.groups_per_step"),
        (["learner.mask_low=3.0"], "mask_low .* must be < learner.mask_high"),
        (["broker.endpoint=localhost:5"], "must start with tcp://"),
        (["security.enabled=true"], "security.enabled needs security.keys_dir"),
        (["worker.keep_version_within=1"], r"worker.keep_version_within \(1\) must be below run.max_staleness \(1\)"),
        (["run.max_staleness=4", "worker.keep_version_within=2", "worker.vllm.max_loras=2"],
         r"worker.vllm.max_loras \(2\) must be > worker.keep_version_within \(2\)"),
        (["temperature=1"], "must look like section.key=value"),
        (["worker.sim=3"], "worker.sim: expected a table"),
    ],
)
def test_errors_name_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    typo = tmp_path / "typo.toml"
    typo.write_text("[lerner]\nlr = 1.0\n")
    with pytest.raises(ConfigError, match=r"typo.toml: unknown section\(s\) \['lerner'\]"):
        load_config(typo)


def test_resolved_config_reloads_identically(tmp_path: Path) -> None:
    config = load_config(None, ['run.name="r"', "worker.sim.length_sigma=0.5",
                                'model.path="/models/x y"', "learner.lr=2e-3"])
    path = tmp_path / "resolved.toml"
    write_resolved(config, path)
    assert load_config(path) == config
    assert "[worker.sim]" in to_toml(config)


def test_every_field_is_documented_or_self_explanatory() -> None:
    from loraflow.common import config as config_module

    for section in (config_module.RunConfig, config_module.BrokerConfig, config_module.WorkerConfig,
                    config_module.LearnerConfig, config_module.ModelConfig):
        for name, type_text, _default, rule in describe(section):
            assert type_text, name
            if name.endswith("_s"):
                assert rule.unit == "s", f"{section.__name__}.{name} is in seconds: say so in its rule"
