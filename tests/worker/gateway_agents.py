"""Agent harnesses the gateway tests load through ``worker.agent`` (each an ``async run_episode(client, row)``)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from loraflow.deploy.agents.calculator_agent import run_episode as calculator  # noqa: F401 - loaded by name
from loraflow.deploy.agents.calculator_agent import run_text_episode as calculator_text  # noqa: F401

_episodes = itertools.count()


async def sometimes_failing(client: Any, row: dict[str, Any]) -> float:
    """The n-th episode started plays row["kinds"][n % len]: raise, hang, block its loop, never call the model
    (idle), or call it once (play)."""
    kind = row["kinds"][next(_episodes) % len(row["kinds"])]
    model = (await client.models.list()).data[0].id
    if kind == "raise":
        raise RuntimeError("the harness broke")
    if kind == "hang":
        await asyncio.sleep(3600)
    if kind == "block":
        time.sleep(3600)  # a harness that blocks its own event loop
    if kind == "idle":
        return 1.0
    await client.completions.create(model=model, prompt=str(row["prompt"]), max_tokens=4)
    return 0.5


async def finish_over_http(client: Any, row: dict[str, Any]) -> None:
    """Calls the model, then ends its episode with POST .../finish and returns nothing."""
    model = (await client.models.list()).data[0].id
    await client.completions.create(model=model, prompt=str(row["prompt"]), max_tokens=4)
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    response = await client._client.post(f"{base}/finish", json={"reward": 0.25, "metrics": {"steps": 2}})
    assert response.status_code == 200, response.text


async def changes_the_system_prompt(client: Any, row: dict[str, Any]) -> float:
    """Two calls; the second rewrites the system prompt, so its rendering diverges from the held tokens."""
    model = (await client.models.list()).data[0].id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+4?"}]
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Sure?"}]
    messages[0] = {"role": "system", "content": "Be very brief."}
    await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    return 1.0


async def reports_odd_metrics(client: Any, row: dict[str, Any]) -> dict[str, Any]:
    """Calls the model once and returns its reward with metrics a group cannot carry beside one it can."""
    model = (await client.models.list()).data[0].id
    await client.completions.create(model=model, prompt=str(row["prompt"]), max_tokens=4)
    return {"reward": 0.5, "steps": 3, "nan": float("nan"), "inf": float("inf"), 7: 1.0, "flag": True}


async def one_call(client: Any, row: dict[str, Any]) -> float:
    """A single completion call: every token of the episode is generated (no context tokens after the prompt)."""
    model = (await client.models.list()).data[0].id
    await client.completions.create(model=model, prompt=str(row["prompt"]), max_tokens=12)
    return 1.0
