"""`loraflow config`: the reference covers every setting, and the README's copy of it is current."""

from __future__ import annotations

import dataclasses

from loraflow.common.config import Config, load_config
from loraflow.deploy import config_cmd
from tests.support import REPO

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def readme_reference() -> str:
    text = (REPO / "README.md").read_text()
    return text[text.index(START) + len(START):text.index(END)].strip()


def test_reference_lists_every_setting() -> None:
    markdown = config_cmd.reference_markdown()
    for section, cls in config_cmd.sections():
        assert f"#### `[{section}]`" in markdown
        for field in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(field.type) and not isinstance(field.default_factory, type):
                assert f"| `{field.name}` |" in markdown, f"{section}.{field.name} missing"
    assert [name for name, _ in config_cmd.sections()] == [
        "run", "data", "model", "broker", "worker", "worker.sim", "worker.vllm", "learner", "eval", "security",
        "integrity", "launch"]
    assert "| `max_staleness` | int | `1` |  | >= 0, <= 1000 |" in markdown


def test_readme_reference_is_generated_from_the_code() -> None:
    assert readme_reference() == config_cmd.reference_markdown().strip(), (
        "README.md's configuration reference is out of date: run "
        "`.venv/bin/python -m loraflow.deploy.config_cmd --update-readme README.md`")


def test_resolved_config_round_trips(tmp_path, capsys) -> None:
    assert config_cmd.main([str(REPO / "deploy/configs/demo.toml"), "--seed", "7"]) == 0
    path = tmp_path / "resolved.toml"
    path.write_text(capsys.readouterr().out)
    resolved = load_config(path)
    assert resolved.run.seed == 7
    assert dataclasses.replace(resolved, run=dataclasses.replace(resolved.run, seed=0)) == \
        load_config(REPO / "deploy/configs/demo.toml")
    assert isinstance(resolved, Config)
