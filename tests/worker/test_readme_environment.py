"""README.md's environment example, as printed there: saved as ``my_envs.py``, named by ``worker.env`` the way the
README names it, and run through the worker's real Rollouts scheduler over a scripted backend (tool call, reply,
answer; the reply's tokens masked out of the loss)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loraflow.rollout_worker.envs import check_env
from tests.support import REPO
from tests.worker.helpers import lease
from tests.worker.test_rollout import EOS, ScriptedBackend, make_rollouts, run_to_end, samples

SPEC = "my_envs:Calculator"  # README: worker.env = "my_envs:Calculator"


@pytest.fixture
def readme_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    text = (REPO / "README.md").read_text()
    (code,) = re.findall(r"<!-- readme example: environment -->\n```python\n(.*?)```", text, flags=re.S)
    assert code.startswith("# my_envs.py\n") and f'worker.env = "{SPEC}"' in text
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    check_env(SPEC)  # what a worker's start-up check does with it
    return SPEC


def test_the_readme_environment_calls_its_tool_and_scores_the_answer(readme_env: str) -> None:
    script = {(0, 0): ("calc: 12*7\nzz", False), (0, 1): ("84", True),  # asks the tool, then answers right
              (1, 0): ("85", True)}  # answers at once, wrongly
    rollouts = make_rollouts(ScriptedBackend(lambda i, t: script[i, t]), env=readme_env)
    rollouts.add(lease(prompt="12*7=", answer="84", group_size=2))
    (finished,) = run_to_end(rollouts)
    assert finished.group.rewards == [1.0, 0.0]
    first = samples(finished)[0]
    call, reply, answer = list(b"calc: 12*7\n"), list(b"= 84\n"), [*b"84", EOS]
    assert first["completion_ids"] == call + reply + answer  # the turn ended right after its stop string
    assert first["loss_mask"] == [1] * len(call) + [0] * len(reply) + [1] * len(answer)
