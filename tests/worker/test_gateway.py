"""The agent gateway with the real ``openai`` client: exact trajectories, tool calls, streaming, failing harnesses.

Every test runs AgentRollouts behind a loop thread that is the backend's only caller (as the worker's), with the
real HTTP server on loopback; the engine's outputs are recorded by a spy and compared token for token with
what the group submits.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from loraflow.common import codec
from loraflow.rollout_worker.adapters import AdapterStore, ReceivedAdapter
from loraflow.rollout_worker.backends.base import Backend, GenOutput, GenRequest, Sampling, TokenizerMixin
from loraflow.rollout_worker.gateway.tools import parse_hermes
from tests.worker.gateway_support import Driver, Spy, check_exact, gateway_config, lease, sample_arrays
from tests.worker.helpers import receive

QUESTION = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 3+4?"}]


@pytest.fixture(scope="module")
def qwen2_backend(zoo_model) -> Backend:
    from loraflow.rollout_worker.backends.hf import HfBackend

    return HfBackend(zoo_model("qwen2"), sampling=Sampling(), device="cpu", seed=0)


def http(url: str, body: bytes | None = None, *, method: str = "POST",
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- tool-call parsing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "calls", "content", "malformed"), [
    ("7", [], "7", False),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>',
     [("calculator", {"expression": "3+4"})], "", False),
    ('Let me see. <tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call><tool_call>{"name": "b"}'
     '</tool_call>', [("a", {"x": 1}), ("b", {})], "Let me see.", False),
    ("<tool_call>{not json}</tool_call>", [], "<tool_call>{not json}</tool_call>", True),
    ('<tool_call>{"arguments": {}}</tool_call>', [], None, True),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', [], None, True),
    ('<tool_call>{"name": "a"}', [], None, True),
])
def test_hermes_parser(text: str, calls: list, content: str | None, malformed: bool) -> None:
    parsed = parse_hermes(text)
    assert parsed.malformed is malformed
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == calls
    assert parsed.content == (text if content is None else content)


# -- exact trajectories on the real engine -------------------------------------------------------------------


def test_text_agent_on_demo_model_trains_exactly_the_generated_tokens(tiny_model_dir: Path, hf_session_backend,
                                                                      adapters, tmp_path: Path) -> None:
    """Two groups of three calculator episodes over completions, the second after adapter v1 arrived."""
    backend = hf_session_backend
    backend.retain(set())
    spy = Spy(backend)
    config = gateway_config(tiny_model_dir, tmp_path, "tests.worker.gateway_agents:calculator_text")
    driver = Driver(config, backend)
    try:
        driver.add(lease("g0", "3+4=", answer="7"))
        driver.wait_groups(1)
        driver.add_adapter(receive(AdapterStore(tmp_path / "adapters"), adapters[0]))
        driver.add(lease("g1", "5+6=", answer="11"))
        groups = driver.wait_groups(2)
    finally:
        driver.close()
        spy.close()
        backend.retain(set())
    for group, version in zip(groups, (0, 1), strict=True):
        assert check_exact(group, spy) == 3 * 3  # three model turns per episode, three episodes
        for s in sample_arrays(group):
            assert set(s["versions"]) == {version}
            assert 0 in s["loss_mask"] and 1 in s["loss_mask"]  # calculator lines are context
        assert group.group.min_version == group.group.max_version == version
    # random bytes re-tokenize otherwise (invalid UTF-8, sampled special tokens): counted, the held tokens kept
    assert driver.metrics.total("tito_divergence") == sum(g.group.metrics["tito_divergence"] for g in groups)
    assert driver.metrics.total("gateway_sampling_ignored") == 0


def test_chat_agent_on_qwen2_is_exact_and_counts_divergence(qwen2_backend, zoo_model, tmp_path: Path) -> None:
    """A multi-turn tool agent through Qwen2's chat template: 2 groups x 3 episodes in parallel."""
    spy = Spy(qwen2_backend)
    config = gateway_config(zoo_model("qwen2"), tmp_path, "tests.worker.gateway_agents:calculator")
    driver = Driver(config, qwen2_backend)
    try:
        driver.add(lease("c0", QUESTION))
        driver.add(lease("c1", QUESTION))
        groups = driver.wait_groups(2)
    finally:
        driver.close()
        spy.close()
    assert sum(check_exact(g, spy) for g in groups) == 2 * 3 * 3
    assert max(len(b) for b in spy.batches) >= 4  # episodes of both groups shared generate calls
    chat = qwen2_backend.chat
    for group in groups:
        for s in sample_arrays(group):
            assert s["prompt_ids"] == chat.encode_prompt(QUESTION)  # the zoo templates do not render tools
            context = chat.decode([t for t, m in zip(s["completion_ids"], s["loss_mask"], strict=True) if not m])
            assert context.count("Check it with the calculator tool.") + context.count("tool_response") >= 2
    divergence = sum(g.group.metrics["tito_divergence"] for g in groups)
    assert driver.metrics.total("tito_divergence") == divergence
    assert all(set(g.group.rewards) <= {0.0, 1.0} for g in groups)


class ScriptedBackend(TokenizerMixin, Backend):
    """A backend over a zoo tokenizer that 'generates' fixed texts, turn by turn per session (tool-call flow)."""

    name = "scripted"

    def __init__(self, model_dir: Path, turns: Sequence[str]) -> None:
        super().__init__(Sampling())
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = len(tokenizer)
        self._init_tokens(tokenizer, model_dir, chat_template_kwargs={}, stop_token_ids=(),
                          vocab_size=self.vocab_size)
        self.turns = [self.chat.encode_text(t, special=False) + [self.eos_token_id] for t in turns]
        self.turn_of: dict[str, int] = {}

    def _load(self, adapter: ReceivedAdapter) -> None:
        pass

    def _unload(self, version: int) -> None:
        pass

    def _generate(self, requests: Sequence[GenRequest], greedy: bool) -> list[GenOutput]:
        outputs = []
        for r in requests:
            session = r.key.rsplit("/", 1)[0]
            turn = self.turn_of.setdefault(r.key, sum(k.startswith(session + "/") for k in self.turn_of))
            ids = self.turns[min(turn, len(self.turns) - 1)][r.num_generated:r.num_generated + r.max_tokens]
            outputs.append(GenOutput(token_ids=ids, logprobs=[-0.5] * len(ids),
                                     finished=bool(ids) and ids[-1] == self.eos_token_id))
        return outputs


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tool_calls_parsed_and_the_template_prefix_is_kept(zoo_model, tmp_path: Path, family: str) -> None:
    """The model calls the calculator, the harness sends back tool_calls with content null and the result; the
    next call's rendering starts with the held tokens (no divergence) and the final answer is scored."""
    backend = ScriptedBackend(zoo_model(family), [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>', "The answer is 7",
        "7"])
    spy = Spy(backend)
    config = gateway_config(zoo_model(family), tmp_path, "tests.worker.gateway_agents:calculator")
    driver = Driver(config, backend)
    try:
        driver.add(lease("t0", QUESTION, group_size=2))
        [group] = driver.wait_groups(1)
    finally:
        driver.close()
    assert group.group.rewards == [1.0, 1.0]
    assert group.group.metrics["agent_tool_calls"] == 1.0
    assert group.group.metrics["tito_divergence"] == 0
    assert driver.metrics.total("tool_calls_parsed") == 2
    assert check_exact(group, spy) == 2 * 3
    for s in sample_arrays(group):
        context = backend.chat.decode([t for t, m in zip(s["completion_ids"], s["loss_mask"], strict=True) if not m])
        assert "<tool_response>\n7\n</tool_response>" in context


# -- streaming, failures, finish, external harnesses -------------------------------------------------------------


def test_streaming_gives_the_recorded_text(qwen2_backend, zoo_model, tmp_path: Path) -> None:
    config = gateway_config(zoo_model("qwen2"), tmp_path, "external")
    driver = Driver(config, qwen2_backend)
    try:
        driver.add(lease("s0", QUESTION, group_size=1))
        status, claimed = http(f"{driver.url}/sessions/claim", b"{}")
        assert status == 200 and claimed["row"]["difficulty"] == 2

        async def play() -> tuple[str, str, dict]:
            async with openai.AsyncOpenAI(base_url=claimed["base_url"], api_key="x", max_retries=0) as client:
                stream = await client.chat.completions.create(model="loraflow", messages=QUESTION, stream=True,
                                                              max_tokens=20, stream_options={"include_usage": True})
                parts, usage = [], None
                async for event in stream:
                    if event.choices:
                        parts.append(event.choices[0].delta.content or "")
                    usage = event.usage or usage
                text = await client.completions.create(model="loraflow", prompt="12+3=", max_tokens=8, stream=True)
                chunks = [c.choices[0].text async for c in text]
                return "".join(parts), "".join(chunks), usage.model_dump()

        streamed, _, usage = asyncio.run(play())
        status, trajectory = http(f"{driver.url}/sessions/{claimed['session_id']}/trajectory", method="GET")
        assert status == 200
        first = trajectory["calls"][0]
        assert usage["completion_tokens"] == len(first["token_ids"]) and usage["prompt_tokens"] == len(first["prompt_ids"])
        ids = first["token_ids"][:-1] if first["finish_reason"] == "stop" else first["token_ids"]
        assert streamed == qwen2_backend.decode(ids)
        assert http(f"{claimed['base_url'].removesuffix('/v1')}/finish", b'{"reward": 1.5}')[0] == 200
        [group] = driver.wait_groups(1)
    finally:
        driver.close()
    assert group.group.rewards == [1.5]


def test_failing_harnesses_score_zero_and_block_nothing(tiny_model_dir: Path, hf_session_backend,
                                                        tmp_path: Path) -> None:
    kinds = ["raise", "hang", "block", "idle", "play"]
    config = gateway_config(tiny_model_dir, tmp_path, "tests.worker.gateway_agents:sometimes_failing",
                            "worker.agent_timeout_s=4")
    driver = Driver(config, hf_session_backend)
    try:
        lease_ = lease("f0", "1+2=", group_size=len(kinds))
        lease_.columns = {"kinds": kinds}
        driver.add(lease_)
        [group] = driver.wait_groups(1, timeout_s=60)
    finally:
        driver.close()
    assert sorted(group.group.rewards) == [0.0, 0.0, 0.0, 0.0, 0.5]
    assert group.group.num_reward_failures == 4
    assert sorted(group.group.finish_reasons) == ["error"] * 4 + ["length"]  # max_tokens 4
    m = driver.metrics
    assert (m.counter("agent_failures", reason="exception"), m.counter("agent_failures", reason="timeout"),
            m.counter("agent_failures", reason="no_calls")) == (1, 2, 1)


def test_an_episode_can_finish_over_http(tiny_model_dir: Path, hf_session_backend, tmp_path: Path) -> None:
    config = gateway_config(tiny_model_dir, tmp_path, "tests.worker.gateway_agents:finish_over_http")
    driver = Driver(config, hf_session_backend)
    try:
        driver.add(lease("h0", "1+2=", group_size=2))
        [group] = driver.wait_groups(1)
    finally:
        driver.close()
    assert group.group.rewards == [0.25, 0.25] and group.group.metrics["agent_steps"] == 2.0


def test_harness_metrics_that_cannot_travel_are_left_out(tiny_model_dir: Path, hf_session_backend,
                                                         tmp_path: Path) -> None:
    """A NaN, an inf, a non-string name or a bool among a harness's metrics would make the broker refuse the
    whole group (its metrics must be finite numbers): they are left out, the group keeps the rest."""
    config = gateway_config(tiny_model_dir, tmp_path, "tests.worker.gateway_agents:reports_odd_metrics")
    driver = Driver(config, hf_session_backend)
    try:
        driver.add(lease("m0", "1+2=", group_size=2))
        [group] = driver.wait_groups(1)
    finally:
        driver.close()
    assert group.group.rewards == [0.5, 0.5] and group.group.metrics["agent_steps"] == 3.0
    assert not {"agent_nan", "agent_inf", "agent_7", "agent_flag"} & set(group.group.metrics)
    codec.decode(codec.encode(group.group, group.tensors))  # what the broker's decode accepts


# -- bad input ---------------------------------------------------------------------------------------------------


def test_bad_input_gets_openai_errors_and_the_gateway_keeps_serving(tiny_model_dir: Path, hf_session_backend,
                                                                    tmp_path: Path) -> None:
    config = gateway_config(tiny_model_dir, tmp_path, "external", "worker.gateway_max_request_bytes=4096")
    driver = Driver(config, hf_session_backend)
    try:
        driver.add(lease("b0", "1+2=", group_size=1))
        status, claimed = http(f"{driver.url}/sessions/claim", b"{}")
        assert status == 200
        base, url = claimed["base_url"], driver.url
        ok = json.dumps({"model": "loraflow", "prompt": "1+2=", "max_tokens": 2}).encode()
        cases = [
            (f"{base}/completions", b"{not json", 400, "invalid_json"),
            (f"{base}/completions", b"[1, 2]", 400, None),
            (f"{url}/sessions/nope/v1/completions", ok, 404, "session_not_found"),
            (f"{base}/completions", json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "model_not_found"),
            (f"{base}/completions", json.dumps({"model": "loraflow", "prompt": "x", "n": 2}).encode(), 400,
             "n_unsupported"),
            (f"{base}/completions", json.dumps({"model": "loraflow", "prompt": "x" * 5000}).encode(), 413,
             "request_too_large"),
            (f"{base}/completions", json.dumps({"model": "loraflow", "prompt": "x", "max_tokens": -1}).encode(), 400,
             None),
            (f"{base}/chat/completions", json.dumps({"model": "loraflow", "messages": QUESTION}).encode(), 400, None),
            (f"{url}/v2/nothing", ok, 404, "not_found"),
        ]
        for target, body, status, code in cases:
            got, reply = http(target, body)
            assert (got, reply["error"]["code"]) == (status, code), (target, body[:60], reply)
            assert reply["error"]["message"]
        assert http(f"{base}/completions", ok)[0] == 200
        assert http(f"{base.removesuffix('/v1')}/finish", b'{"reward": "high"}')[0] == 400
        assert http(f"{base.removesuffix('/v1')}/finish", b'{"reward": 1}')[0] == 200
        got, reply = http(f"{base}/completions", ok)  # the episode has finished
        assert (got, reply["error"]["code"]) == (409, "session_finished")
        driver.wait_groups(1)
        assert http(f"{url}/v1/completions", ok)[0] == 200  # unrecorded calls still served
        assert http(f"{url}/sessions/claim", b"{}")[0] == 204
    finally:
        driver.close()


def test_security_requires_the_token(tiny_model_dir: Path, hf_session_backend, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    config = gateway_config(tiny_model_dir, tmp_path, "external", "security.enabled=true",
                            f'security.keys_dir="{keys}"')
    driver = Driver(config, hf_session_backend)
    try:
        info = json.loads((tmp_path / "gateway.json").read_text())
        assert info["url"] == driver.url and len(info["token"]) > 20
        assert (tmp_path / "gateway.json").stat().st_mode & 0o077 == 0
        got, reply = http(f"{driver.url}/v1/models", method="GET")
        assert (got, reply["error"]["code"]) == (401, "invalid_api_key")
        client = openai.OpenAI(base_url=f"{driver.url}/v1", api_key=info["token"], max_retries=0)
        assert [m.id for m in client.models.list().data][-1] == "loraflow"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{driver.url}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        driver.close()


@pytest.mark.vllm
def test_text_agent_on_vllm_trains_exactly_the_generated_tokens(tiny_model_dir: Path, vllm_session_backend,
                                                                tmp_path: Path) -> None:
    """The same harness on the vLLM backend (the session's shared engine): two groups batch together."""
    backend = vllm_session_backend
    backend.retain(set())
    spy = Spy(backend)
    config = gateway_config(tiny_model_dir, tmp_path, "tests.worker.gateway_agents:calculator_text",
                            "model.max_seq_len=256", "worker.max_new_tokens=24")
    driver = Driver(config, backend)
    try:
        driver.add(lease("v0", "3+4=", answer="7"))
        driver.add(lease("v1", "5+6=", answer="11"))
        groups = driver.wait_groups(2, timeout_s=300)
    finally:
        driver.close()
        spy.close()
    assert sum(check_exact(g, spy) for g in groups) == 2 * 3 * 3
    assert len(spy.seen) == 2 * 3 * 3  # streamed: one engine request per call, its whole turn
    assert max(len(ids) for ids, _ in spy.seen) <= 256


@pytest.mark.parametrize("mode", ["count", "refuse"])
def test_a_rewritten_history_is_counted_or_refused(qwen2_backend, zoo_model, tmp_path: Path, mode: str) -> None:
    spy = Spy(qwen2_backend)
    config = gateway_config(zoo_model("qwen2"), tmp_path, "tests.worker.gateway_agents:changes_the_system_prompt",
                            f'worker.tito_divergence="{mode}"')
    driver = Driver(config, qwen2_backend)
    try:
        driver.add(lease("d0", QUESTION, group_size=2))
        [group] = driver.wait_groups(1)
    finally:
        driver.close()
        spy.close()
    assert driver.metrics.counter("tito_divergence", reason="text") == 2
    if mode == "count":  # the held tokens stay; the second call still trains exactly what it generated
        assert group.group.rewards == [1.0, 1.0] and group.group.metrics["tito_divergence"] == 2
        assert check_exact(group, spy) == 2 * 2
    else:  # the second call is refused (400 prefix_divergence): the harness raised, the episode scores 0
        assert group.group.rewards == [0.0, 0.0] and driver.metrics.total("tito_refused") == 2
        assert driver.metrics.counter("agent_failures", reason="exception") == 2
        assert check_exact(group, spy) == 2  # only the first call's tokens


@pytest.mark.parametrize(("overrides", "words"), [
    (['worker.agent="m:f"', 'worker.reward="loraflow:exact_match"'], "worker.reward"),
    (['worker.agent="m:f"', 'worker.backend="sim"'], "worker.backend"),
    (['worker.agent="m:f"', 'worker.gateway_bind="0.0.0.0:8000"'], "security.enabled"),
    (['worker.agent="m:f"', 'worker.tool_parser="xml"'], "tool_parser"),
])
def test_gateway_config_errors_name_the_setting(overrides: list[str], words: str) -> None:
    from loraflow.common.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=words):
        load_config(None, overrides)


def test_an_episode_timeout_beyond_the_lease_timeout_is_valid() -> None:
    """Heartbeats renew the lease of a group whose episodes still run, so the two settings are independent: the
    defaults of ``loraflow run --set worker.agent=...`` (agent 120 s, the demo's lease 30 s) load as they are."""
    from loraflow.common.config import load_config
    from loraflow.deploy.launcher import DEMO_CONFIG

    config = load_config(DEMO_CONFIG, ['worker.agent="m:f"'])
    assert config.worker.agent_timeout_s > config.broker.lease_timeout_s


def test_a_harness_that_is_not_async_is_a_config_error(tiny_model_dir: Path, hf_session_backend,
                                                       tmp_path: Path) -> None:
    from loraflow.common.config import ConfigError

    config = gateway_config(tiny_model_dir, tmp_path, "loraflow.deploy.agents.calculator_agent:calculate")
    with pytest.raises(ConfigError, match="async function"):
        Driver(config, hf_session_backend)
