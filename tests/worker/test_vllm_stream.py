"""The vLLM backend as a continuously fed engine (``submit`` / ``advance`` / ``abort``) and the rollouts on it.

- streamed requests give exactly the tokens, log-probs and evidence of one ``generate`` call; an aborted one
  keeps a prefix of them and leaves the engine;
- a lease granted while others generate joins the running batch (no round boundary in between);
- an adapter swap under each partial policy: ``continue`` splits each sample once, at the tokens it had, and the
  rest is the new adapter's greedy continuation of them (the reference says so token by token, with log-probs);
  ``finish`` keeps the old version to the end; ``abort`` restarts under the new one;
- after a swap the shortest prefix is resubmitted first and alone, the others once it has a new-version token;
- a stop string ends a turn mid-stream and takes the request out of the engine; a returned lease does too;
- the engine's socket files live in a directory of the process, removed when it exits.

All tests share the session's one engine (tests/worker/conftest.py): it starts in ~25 s.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow.common.config import WorkerConfig
from loraflow.rollout_worker import rollout
from loraflow.rollout_worker.adapters import AdapterStore
from loraflow.rollout_worker.backends.base import Backend, GenRequest, Sampling
from loraflow.rollout_worker.backends.shared import SharedEngine
from loraflow.rollout_worker.backends.vllm import private_rpc_dir
from loraflow.rollout_worker.envs import EnvResolver
from loraflow.rollout_worker.rollout import Rollouts
from loraflow.rollout_worker.samples import DONE, GENERATING, READY
from tests.worker.helpers import Adapter, Reference, lease, receive

pytestmark = pytest.mark.vllm

PROMPTS = ["12+34=", "7+8=", "99+1="]
MAX_STEPS = 2000  # bounds every loop on a misbehaving engine


@pytest.fixture
def vllm(vllm_session_backend: Backend) -> Iterator[Backend]:
    vllm_session_backend.abort_all()
    vllm_session_backend.retain(set())
    yield vllm_session_backend
    vllm_session_backend.abort_all()


def drain(backend: Backend, request_ids: list[str]) -> dict[str, tuple[list[int], list[float], bool]]:
    got: dict[str, tuple[list[int], list[float], bool]] = {r: ([], [], False) for r in request_ids}
    for _ in range(MAX_STEPS):
        if not backend.num_streams:
            break
        for delta in backend.advance():
            ids, logprobs, _ = got[delta.request_id]
            got[delta.request_id] = (ids + delta.token_ids, logprobs + delta.logprobs, delta.finished)
    assert backend.num_streams == 0
    return got


def run(rollouts: Rollouts) -> list:
    finished = []
    for _ in range(MAX_STEPS):
        if not rollouts.num_groups:
            return finished
        finished += rollouts.step() if rollouts.has_ready() else rollouts.poll()
    raise AssertionError("the rollouts did not finish")


def test_streamed_requests_equal_one_generate_call(vllm: Backend, store: AdapterStore,
                                                   adapters: list[Adapter]) -> None:
    vllm.add_adapter(receive(store, adapters[0]))
    requests = [GenRequest(token_ids=vllm.encode(p), max_tokens=n, version=v)
                for p, n, v in zip(PROMPTS, (7, 20, 30), (1, 0, 1), strict=True)]
    expected = vllm.generate(requests, greedy=True)
    for i, request in enumerate(requests):
        vllm.submit(f"r{i}", request, greedy=True)
    with pytest.raises(ValueError, match="already in the engine"):
        vllm.submit("r0", requests[0])
    with pytest.raises(RuntimeError, match="stream"):
        vllm.generate(requests[:1])
    got = drain(vllm, ["r0", "r1", "r2"])
    for i, output in enumerate(expected):
        ids, logprobs, finished = got[f"r{i}"]
        assert ids == output.token_ids and finished == output.finished
        assert max(abs(a - b) for a, b in zip(logprobs, output.logprobs, strict=True)) < 1e-5
    # the evidence: the load of each request's version, as the engine's outputs name it
    assert vllm.served(1).lora_id and vllm.served(1).sha256 == adapters[0].update.sha256

    vllm.submit("cut", requests[2], greedy=True)
    ids: list[int] = []
    while len(ids) < 3 and vllm.num_streams:
        ids += [t for d in vllm.advance() for t in d.token_ids]
    vllm.abort(["cut"])
    assert vllm.num_streams == 0 and vllm.advance() == []
    assert ids == expected[2].token_ids[:len(ids)]
    assert not vllm.llm.llm_engine.has_unfinished_requests()


def test_a_new_lease_joins_the_running_batch(vllm: Backend) -> None:
    config = WorkerConfig(max_new_tokens=64, chunk_tokens=4)
    rollouts = Rollouts(vllm, EnvResolver(), config, worker_id="w", max_seq_len=256, greedy=True)
    rollouts.add(lease("1:0", prompt=PROMPTS[0], group_size=2))
    while not all(s.completion_ids for s in rollouts.groups["lease-1:0"].samples):
        rollouts.step()
    rollouts.add(lease("1:1", prompt=PROMPTS[1], group_size=1))
    rollouts.step()
    generating = [s for g in rollouts.groups.values() for s in g.samples if s.status == GENERATING]
    first = rollouts.groups["lease-1:0"].samples
    # the first lease's samples kept their requests: never resubmitted while the second joined
    assert all(s.request_id.endswith(("/1", "/2")) for s in first if s.status == GENERATING)
    assert vllm.num_streams == len(generating) >= 2
    rollouts.remove("lease-1:0")
    assert vllm.num_streams == len([s for s in rollouts.groups["lease-1:1"].samples if s.status == GENERATING])
    finished = run(rollouts)
    assert [f.group.group_id for f in finished] == ["1:1"]
    assert vllm.num_streams == 0


@pytest.mark.parametrize("policy", ["continue", "finish", "abort", "continue near the end", "continue keep within"])
def test_an_adapter_swap_under_each_partial_policy(vllm: Backend, store: AdapterStore, adapters: list[Adapter],
                                                   reference: Reference, policy: str) -> None:
    """("continue near the end": worker.finish_within_tokens covers the whole turn, so it ends under v1; "continue
    keep within": worker.keep_version_within = 1, v2 is one version ahead, so the turn keeps v1.)"""
    a1, a2 = adapters[0], adapters[1]
    vllm.add_adapter(receive(store, a1))
    near_end, keep_within = policy == "continue near the end", policy == "continue keep within"
    config = WorkerConfig(max_new_tokens=24, chunk_tokens=4, partial_policy=policy.split()[0],
                          finish_within_tokens=24 if near_end else 0, keep_version_within=int(keep_within))
    rollouts = Rollouts(vllm, EnvResolver(), config, worker_id="w", max_seq_len=256, greedy=True)
    rollouts.add(lease("2:0", prompt=PROMPTS[2], group_size=2))
    samples = rollouts.groups["lease-2:0"].samples
    while min(len(s.completion_ids) for s in samples) < 2:
        rollouts.step()
    before = [len(s.completion_ids) for s in samples]
    vllm.add_adapter(receive(store, a2))
    vllm.retain({2} | rollouts.versions_in_use())  # as the worker does after a load
    assert 1 in vllm.adapters or policy not in ("finish", "continue keep within")
    (group,) = run(rollouts)
    tensors = dict(group.tensors)
    prompt = vllm.encode(PROMPTS[2])
    eos = vllm.eos_token_id
    offset = 0
    for index, k in enumerate(before):
        num = group.group.completion_lens[index]
        ids = tensors["completion_ids"][offset:offset + num].tolist()
        versions = tensors["versions"][offset:offset + num].tolist()
        logprobs = tensors["logprobs"][offset:offset + num].tolist()
        if policy == "finish" or near_end or keep_within:
            assert ids == reference.greedy(a1, prompt, 24, eos) and versions == [1] * num
        elif policy == "abort":
            assert ids == reference.greedy(a2, prompt, 24, eos) and versions == [2] * num
        else:
            head = reference.greedy(a1, prompt, k, eos)
            tail = reference.greedy(a2, prompt + head, 24 - k, eos)
            assert ids == head + tail and versions == [1] * k + [2] * len(tail)
            expected = reference.logprobs(a1, prompt, head) + reference.logprobs(a2, prompt + head, tail)
            assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) < 1e-4
        offset += num
    served = {s.version: s for s in group.group.served}
    assert set(served) == set(tensors["versions"].tolist())
    for version, served_as in served.items():
        assert served_as == vllm.served(version) and served_as.sha256 == adapters[version - 1].update.sha256
    moved = rollouts.metrics.total("requests_moved")
    assert (moved == 0) if policy == "finish" or near_end or keep_within else (moved == 2)
    assert rollouts.metrics.total("turns_kept_version") == (2 if near_end or keep_within else 0)
    assert rollouts.metrics.total("samples_aborted") == (2 if policy == "abort" else 0)


def test_a_stop_string_ends_the_turn_mid_stream(vllm: Backend, store: AdapterStore, adapters: list[Adapter],
                                                reference: Reference) -> None:
    vllm.add_adapter(receive(store, adapters[0]))
    prompt = vllm.encode(PROMPTS[0])
    greedy = reference.greedy(adapters[0], prompt, 40, vllm.eos_token_id)
    # a character the greedy turn first shows a few tokens in: the turn must end right after that token
    end = next(i for i in range(2, len(greedy)) if (c := vllm.decode(greedy[i:i + 1])).isascii() and c.isalnum()
               and c not in vllm.decode(greedy[:i]))
    stop = vllm.decode(greedy[end:end + 1])
    config = WorkerConfig(max_new_tokens=40, chunk_tokens=4, stop_strings=(stop,))
    rollouts = Rollouts(vllm, EnvResolver(), config, worker_id="w", max_seq_len=256, greedy=True)
    rollouts.add(lease("3:0", prompt=PROMPTS[0], group_size=1))
    (group,) = run(rollouts)
    assert dict(group.tensors)["completion_ids"].tolist() == greedy[:end + 1]
    assert vllm.num_streams == 0 and not vllm.llm.llm_engine.has_unfinished_requests()


def test_after_a_swap_the_shortest_prefix_goes_first(vllm: Backend, store: AdapterStore, adapters: list[Adapter],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """continue: the moved sample with the shortest prefix is resubmitted alone; the others wait for its first token
    under the new version (the engine's next step stays short), then all continue, each split once."""
    monkeypatch.setattr(rollout, "SWAP_FIRST_STEP_TOKENS", 1)  # these prefixes are short: only the shortest first
    vllm.add_adapter(receive(store, adapters[0]))
    config = WorkerConfig(max_new_tokens=48, chunk_tokens=4, partial_policy="continue")
    rollouts = Rollouts(vllm, EnvResolver(), config, worker_id="w", max_seq_len=256, greedy=True)
    rollouts.add(lease("5:0", prompt=PROMPTS[0], group_size=2))
    old = rollouts.groups["lease-5:0"].samples
    for _ in range(MAX_STEPS):
        if min(len(s.completion_ids) for s in old) >= 8:
            break
        rollouts.step()
    rollouts.add(lease("5:1", prompt=PROMPTS[1], group_size=1))
    (young,) = rollouts.groups["lease-5:1"].samples
    for _ in range(MAX_STEPS):
        if young.completion_ids:
            break
        rollouts.step()
    assert all(s.status == GENERATING for s in [*old, young])
    prompts = [len(rollouts.groups[f"lease-5:{i}"].prompt_ids) for i in (0, 1)]
    assert prompts[1] + len(young.completion_ids) < min(prompts[0] + len(s.completion_ids) for s in old)
    vllm.add_adapter(receive(store, adapters[1]))
    vllm.retain({2} | rollouts.versions_in_use())
    rollouts.step()
    assert young.status == GENERATING and young.request_version == 2 and vllm.num_streams == 1
    held = [s for s in old if s.status != DONE]
    assert held and all(s.status != GENERATING for s in held)
    for _ in range(MAX_STEPS):  # the held samples wait until the young one has a token of v2
        if 2 in young.versions:
            break
        rollouts.step()
        assert all(s.status != GENERATING for s in held) or 2 in young.versions
    rollouts.step()
    assert all(s.status != READY for s in held)  # in the engine (or done) one step after that token
    run(rollouts)
    for sample in [*old, young]:
        k = sample.versions.index(2) if 2 in sample.versions else len(sample.versions)
        assert sample.versions == [1] * k + [2] * (len(sample.versions) - k) and k >= 1
    assert rollouts.metrics.total("requests_moved") == 3


def test_the_engines_socket_files_live_in_a_directory_of_this_process(vllm: Backend) -> None:
    """vLLM's ipc:// socket files go into private_rpc_dir (the suite sets no VLLM_RPC_BASE_PATH), not loose into
    the temp directory, where a worker ended by os._exit or a kill left a few per start."""
    path = private_rpc_dir()
    assert path is not None and os.environ["VLLM_RPC_BASE_PATH"] == path
    sockets = [p for p in Path(path).iterdir() if stat.S_ISSOCK(p.stat().st_mode)]
    assert sockets, "the engine core's ZeroMQ sockets"


@pytest.mark.parametrize("preset", ["", "/run/user-chosen"])
def test_the_private_socket_directory_is_removed_at_exit(tmp_path: Path, preset: str) -> None:
    """Even by the worker's way out (atexit handlers, then os._exit); a VLLM_RPC_BASE_PATH the user set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"} | {"TMPDIR": str(tmp_path)}
    if preset:
        env["VLLM_RPC_BASE_PATH"] = preset
    code = ("import os, sys\nfrom loraflow.rollout_worker.backends.vllm import private_rpc_dir\n"
            "path = private_rpc_dir()\nassert private_rpc_dir() == path\n"
            "print(path, os.environ['VLLM_RPC_BASE_PATH'], flush=True)\n"
            "if path: open(os.path.join(path, 'socket'), 'w').close()\n"
            "from loraflow.rollout_worker.worker import end_process\nend_process(0)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    path, variable = done.stdout.split()
    if preset:
        assert (path, variable) == ("None", preset)
    else:
        assert Path(path).parent == tmp_path and variable == path
        assert not Path(path).exists() and not list(tmp_path.iterdir())


def test_two_runs_stream_through_one_engine(vllm: Backend, tmp_path: Path, adapters: list[Adapter]) -> None:
    """A pool worker's engine (rollout_worker/backends/shared.py): two runs' v1 are two adapters, each run's
    thread streams its requests through one engine and gets its own adapter's tokens, ids and evidence."""
    engine = SharedEngine(vllm)
    views = [engine.view(run, sampling=Sampling(), wake=threading.Event()) for run in ("a", "b")]
    for view, adapter in zip(views, adapters[:2], strict=True):
        view.add_adapter(receive(AdapterStore(tmp_path / view.run), adapter, version=1))
    requests = [GenRequest(token_ids=vllm.encode(p), max_tokens=12, version=v) for p, v in zip(PROMPTS, (1, 1, 0), strict=True)]
    expected = {view.run: view.generate(requests, greedy=True) for view in views}
    assert expected["a"][0].token_ids != expected["b"][0].token_ids  # two adapters, two continuations
    got: dict[str, dict] = {}

    def stream(view: Backend, run: str) -> None:
        for i, request in enumerate(requests):
            view.submit(f"q{i}", request, greedy=True)
        got[run] = drain(view, [f"q{i}" for i in range(len(requests))])

    threads = [threading.Thread(target=stream, args=(view, view.run)) for view in views]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for view, adapter in zip(views, adapters[:2], strict=True):
        assert [got[view.run][f"q{i}"][0] for i in range(len(requests))] == \
            [out.token_ids for out in expected[view.run]]
        assert (view.served(1).version, view.served(1).sha256) == (1, adapter.update.sha256)
        engine.release(view)
    assert vllm.adapters == {} and vllm.num_streams == 0
