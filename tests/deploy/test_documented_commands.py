"""Every ``loraflow run`` / ``make run`` command the docs show passes the start-up checks ``loraflow run`` makes
before it starts anything (config load and validation, then every role's preflight), with nothing set beyond what
the command sets: the defaults of one command never contradict each other. Placeholders (``DIR``, ``N``,
``my.toml``) become a real model, a seed and a copy of the demo config."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from loraflow.common.cli import config_from_args, config_parser
from loraflow.deploy import preflight
from loraflow.deploy.launcher import DEMO_CONFIG, EXTRA_FLAGS
from tests.support import REPO

DOCS = ("README.md", "deploy/README.md", "BENCHMARKS.md")
COMMAND = re.compile(r"^(?:\S*/)?(?:loraflow run|make run)\b")
#: the issue-reported form: an agent on a model, every other setting at its default
EXTRA = ['loraflow run --model DIR --set worker.agent="loraflow.deploy.agents.calculator_agent:run_episode"']


def documented_commands() -> list[str]:
    """``loraflow run ...`` lines of fenced blocks (continuations joined, comments cut) and inline code spans."""
    found: list[str] = []
    for doc in DOCS:
        text = (REPO / doc).read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            found += [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
        found += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    commands = {c for c in found if COMMAND.match(c) and "[" not in c and ":" not in c.split()[1]}
    return sorted(commands) + EXTRA


def run_argv(command: str, model: Path, tmp_path: Path) -> list[str]:
    """The argv ``loraflow run`` gets from ``command``, placeholders replaced."""
    words = shlex.split(command)
    if words[0] == "make":
        words = shlex.split(next((w.removeprefix("ARGS=") for w in words if w.startswith("ARGS=")), ""))
    else:
        words = words[2:]
    my_config = tmp_path / "my.toml"
    shutil.copy(DEMO_CONFIG, my_config)
    placeholders = {"DIR": str(model), "M": str(model), "$MODEL": str(model), "N": "1", "my.toml": str(my_config),
                    "FILE": str(DEMO_CONFIG)}
    argv = [placeholders.get(w, w) for w in words]
    argv = [str(REPO / w) if w.startswith("deploy/configs/") else w for w in argv]
    if "--run-dir" not in argv:
        argv += ["--run-dir", str(tmp_path / "run")]
    else:
        argv[argv.index("--run-dir") + 1] = str(tmp_path / argv[argv.index("--run-dir") + 1])
    return argv


def test_the_docs_show_the_commands_this_test_checks() -> None:
    commands = documented_commands()
    assert "loraflow run" in commands and "make run" in commands
    assert any("agent-demo.toml" in c for c in commands) and any("--seed N" in c for c in commands)


@pytest.mark.parametrize("command", documented_commands())
def test_a_documented_command_passes_the_start_up_checks(command: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    parser = config_parser("loraflow run", "", EXTRA_FLAGS)
    args = parser.parse_args(run_argv(command, tiny_model_dir, tmp_path))
    if args.config is None:
        args.config = str(DEMO_CONFIG)
    config = config_from_args(args)  # loading validates every setting against the others
    preflight.check(config, starting=True)


def test_documented_bench_commands_run_a_bench_module() -> None:
    """A bench runs as ``python -m bench.NAME`` (``python bench/NAME.py`` cannot import ``bench``); every NAME the
    docs and the benches' own docstrings show is a module of bench/."""
    texts = {doc: (REPO / doc).read_text() for doc in DOCS}
    texts |= {str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "bench").glob("*.py"))}
    as_scripts = [f"{doc}: {m}" for doc, text in texts.items() for m in re.findall(r"python3? bench/\w+\.py", text)]
    assert not as_scripts, as_scripts
    names = {name for text in texts.values() for name in re.findall(r"python3? -m bench\.(\w+)", text)} - {"NAME"}
    assert names and not {n for n in names if not (REPO / "bench" / f"{n}.py").is_file()}
