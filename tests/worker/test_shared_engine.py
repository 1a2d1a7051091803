"""One engine, several runs (rollout_worker/backends/shared.py), on the hf and sim backends:

- two runs' v1 are two adapters: each run's view generates with its own (the reference's greedy tokens of that
  adapter on hf) and reports its own version and sha256 as evidence; the engine holds them apart;
- a view's retain unloads only its run's versions; releasing a view unloads them and aborts its requests;
- each run samples as its own config says (greedy here, sampled there, in one engine);
- a streaming engine's step feeds every run: the view that waits keeps its deltas and files the others'
  (their wake set), with their own request ids and versions (a streaming double of the sim backend);
- a version past the engine's range per run is refused.
The vLLM engine's shared test is in tests/worker/test_vllm_stream.py (one engine per session)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from loraflow.common.config import SimConfig
from loraflow.rollout_worker.adapters import AdapterStore
from loraflow.rollout_worker.backends.base import Backend, GenDelta, GenRequest, Sampling
from loraflow.rollout_worker.backends.shared import MAX_RUN_VERSION, RUN_SHIFT, SharedEngine
from loraflow.rollout_worker.backends.sim import SimBackend
from tests.worker.helpers import Adapter, Reference, receive

PROMPT = [5, 17, 42, 8]


@pytest.fixture(params=["hf", "sim"])
def engine(request: pytest.FixtureRequest) -> SharedEngine:
    backend: Backend = request.getfixturevalue(f"{request.param}_session_backend")
    backend.retain(set())
    return SharedEngine(backend)


def two_runs(engine: SharedEngine, tmp_path: Path, adapters: list[Adapter]):
    a = engine.view("a", sampling=Sampling(), wake=threading.Event())
    b = engine.view("b", sampling=Sampling(), wake=threading.Event())
    a.add_adapter(receive(AdapterStore(tmp_path / "a"), adapters[0], version=1))
    b.add_adapter(receive(AdapterStore(tmp_path / "b"), adapters[1], version=1))
    return a, b


def test_each_run_generates_with_its_own_v1(engine: SharedEngine, tmp_path: Path, adapters: list[Adapter],
                                            reference: Reference) -> None:
    a, b = two_runs(engine, tmp_path, adapters)
    assert sorted(engine.backend.adapters) == [a.slot << RUN_SHIFT | 1, b.slot << RUN_SHIFT | 1]
    assert a.newest_version == b.newest_version == 1
    out_a, = a.generate([GenRequest(token_ids=PROMPT, max_tokens=6, version=1, key="0:0/0")], greedy=True)
    out_b, = b.generate([GenRequest(token_ids=PROMPT, max_tokens=6, version=1, key="0:0/0")], greedy=True)
    assert (out_a.served.version, out_a.served.sha256) == (1, adapters[0].update.sha256)
    assert (out_b.served.version, out_b.served.sha256) == (1, adapters[1].update.sha256)
    assert a.served(1).sha256 == adapters[0].update.sha256 and b.served(1).sha256 == adapters[1].update.sha256
    if engine.backend.name == "hf":  # the tokens are the adapter's own, not the other run's
        eos = engine.backend.eos_token_id
        assert out_a.token_ids == reference.greedy(adapters[0], PROMPT, len(out_a.token_ids), eos)
        assert out_b.token_ids == reference.greedy(adapters[1], PROMPT, len(out_b.token_ids), eos)
        assert out_a.token_ids != out_b.token_ids
    base, = b.generate([GenRequest(token_ids=PROMPT, max_tokens=4, version=0, key="k")], greedy=True)
    assert (base.served.version, base.served.sha256) == (0, "")  # v0, the base model, is every run's


def test_retain_and_release_touch_only_their_run(engine: SharedEngine, tmp_path: Path,
                                                 adapters: list[Adapter]) -> None:
    a, b = two_runs(engine, tmp_path, adapters)
    b.add_adapter(receive(AdapterStore(tmp_path / "b"), adapters[2], version=2))
    assert a.retain({2}) == [1]  # a's v1 goes; b's v1 and v2 stay
    assert not a.has_version(1) and b.has_version(1) and b.has_version(2)
    assert sorted(engine.backend.adapters) == [b.slot << RUN_SHIFT | 1, b.slot << RUN_SHIFT | 2]
    engine.release(b)
    assert engine.backend.adapters == {} and list(engine.views) == [a.slot]
    with pytest.raises(KeyError, match="not resident"):
        a.generate([GenRequest(token_ids=PROMPT, max_tokens=2, version=1)])


def test_each_run_samples_its_own_way(engine: SharedEngine, tmp_path: Path, adapters: list[Adapter]) -> None:
    a, b = two_runs(engine, tmp_path, adapters)
    b.sampling = Sampling(temperature=0.5, top_p=0.9)
    a.generate([GenRequest(token_ids=PROMPT, max_tokens=2, version=1, key="x")])
    assert engine.backend.sampling == Sampling()
    b.generate([GenRequest(token_ids=PROMPT, max_tokens=2, version=1, key="x")])
    assert engine.backend.sampling == Sampling(temperature=0.5, top_p=0.9)


def test_a_version_past_the_range_is_refused(engine: SharedEngine) -> None:
    a = engine.view("a", sampling=Sampling(), wake=threading.Event())
    assert a.engine_version(MAX_RUN_VERSION) >> RUN_SHIFT == a.slot
    with pytest.raises(ValueError, match="beyond a shared engine"):
        a.engine_version(MAX_RUN_VERSION + 1)


class StreamingSim(SimBackend):
    """The sim backend fed continuously: each advance gives every request in it one more token (a test double
    of a streaming engine's steps, for the filing of deltas between runs)."""

    streaming = True

    def __init__(self) -> None:
        super().__init__(SimConfig(tokens_per_s=1e6, mean_tokens=3, length_sigma=0.0, vocab_size=259),
                         sampling=Sampling())
        self.running: dict[str, GenRequest] = {}
        self.num_steps = 0

    def _submit(self, request_id: str, request: GenRequest, greedy: bool) -> None:
        self.running[request_id] = request

    def _abort(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self.running.pop(r)

    def _advance(self) -> list[GenDelta]:
        self.num_steps += 1
        deltas = []
        for request_id, request in list(self.running.items()):
            out, = self._generate([GenRequest(token_ids=request.token_ids, max_tokens=1, version=request.version,
                                              key=request.key, num_generated=request.num_generated)], True)
            request.num_generated += 1
            done = out.finished or request.num_generated >= request.max_tokens
            if done:
                del self.running[request_id]
            deltas.append(GenDelta(request_id=request_id, token_ids=out.token_ids, logprobs=out.logprobs,
                                   done=done, finished=out.finished))
        return deltas


def drain(view: Backend) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for _ in range(100):
        if not view.num_streams:
            return got
        for delta in view.advance():
            got.setdefault(delta.request_id, []).extend(delta.token_ids)
            assert delta.served.version in (0, 1)
    raise AssertionError("requests never finished")


def test_a_streaming_step_feeds_every_run(tmp_path: Path, adapters: list[Adapter]) -> None:
    engine = SharedEngine(StreamingSim())
    a, b = two_runs(engine, tmp_path, adapters)
    a.submit("g/0", GenRequest(token_ids=PROMPT, max_tokens=3, version=1, key="g/0"), greedy=True)
    b.submit("g/0", GenRequest(token_ids=PROMPT, max_tokens=3, version=1, key="g/0"), greedy=True)
    b.submit("g/1", GenRequest(token_ids=PROMPT, max_tokens=3, version=0, key="g/1"), greedy=True)
    first = a.advance()  # one engine step: a's delta returned, b's two filed for b
    assert [(d.request_id, d.served.version) for d in first] == [("g/0", 1)]
    assert b.wake.is_set() and sorted(d.request_id for d in b.filed) == ["g/0", "g/1"]
    steps = engine.backend.num_steps
    assert sorted(d.request_id for d in b.advance()) == ["g/0", "g/1"]
    assert engine.backend.num_steps == steps  # b took what was filed: no engine step of its own
    b.abort(["g/1"])
    tokens_a, tokens_b = drain(a), drain(b)
    assert len(first[0].token_ids) + len(tokens_a.get("g/0", [])) == 3
    assert set(tokens_b) <= {"g/0"} and a.num_streams == b.num_streams == engine.backend.num_streams == 0
    a.submit("h", GenRequest(token_ids=PROMPT, max_tokens=3, version=1, key="h"), greedy=True)
    engine.release(a)  # its request aborted in the engine, its adapter unloaded
    assert engine.backend.num_streams == 0 and sorted(engine.backend.adapters) == [b.slot << RUN_SHIFT | 1]



@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 3.0)])
def test_runs_share_the_engine_by_weight(tmp_path: Path, adapters: list[Adapter], weights: tuple[float, float]) -> None:
    """Two runs' threads generating as fast as they can through one engine (sim at 20,000 tokens/s, chunks of
    16 tokens x 4 samples): each gets tokens in proportion to its weight, within 15 %."""
    engine = SharedEngine(SimBackend(SimConfig(tokens_per_s=20_000, mean_tokens=16, length_sigma=0.0,
                                               vocab_size=259), sampling=Sampling()))
    views = [engine.view(run, sampling=Sampling(), wake=threading.Event(), weight=w)
             for run, w in zip("ab", weights, strict=True)]
    stop = threading.Event()

    def generate(view: Backend) -> None:
        while not stop.is_set():
            view.generate([GenRequest(token_ids=PROMPT, max_tokens=16, version=0, key=f"k{i}") for i in range(4)])

    threads = [threading.Thread(target=generate, args=(view,)) for view in views]
    for thread in threads:
        thread.start()
    stop.wait(2.0)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    a, b = (engine.shares()[run]["tokens"] for run in "ab")
    expected = weights[1] / sum(weights)
    assert abs(b / (a + b) - expected) / expected <= 0.15, engine.shares()
    assert a + b > 10_000  # the engine kept generating (2 s at 20,000 tokens/s, less the bookkeeping)


def test_a_run_busy_elsewhere_holds_nobody_back(tmp_path: Path, adapters: list[Adapter]) -> None:
    """The share is work-conserving: a run that is not calling the engine now (scoring, waiting for leases) does
    not hold back a run far ahead of it, so the engine never idles for fairness' sake."""
    engine = SharedEngine(SimBackend(SimConfig(tokens_per_s=1e6, mean_tokens=16, length_sigma=0.0, vocab_size=259),
                                     sampling=Sampling()))
    a = engine.view("a", sampling=Sampling(), wake=threading.Event())
    b = engine.view("b", sampling=Sampling(), wake=threading.Event())
    b.generate([GenRequest(token_ids=PROMPT, max_tokens=1, version=0, key="b")])  # b called just now, then idles
    for i in range(20):  # a runs hundreds of weighted tokens ahead of b
        a.generate([GenRequest(token_ids=PROMPT, max_tokens=16, version=0, key=f"a{i}") for _ in range(4)])
    assert engine.shares()["a"]["tokens"] >= 20 * 4 * 16 - 100 and a.held_s < 0.1, engine.shares()


def test_the_hf_engine_keeps_the_other_runs_prefixes_and_only_theirs() -> None:
    """hf drops the held KV prefixes a call did not ask for, except other runs' on a shared engine: a key's run
    is what precedes RUN_KEY_SEP, never the epoch of a group id ("0:12"), so a worker of one run drops them all."""
    from loraflow.rollout_worker.backends.hf import _namespace

    assert _namespace("0:12/0/0/0") == _namespace("1:3/1/0/0") == ""  # one run, two epochs: one namespace
    assert _namespace("r1|0:12/0/0/0") == "r1" != _namespace("r2|0:12/0/0/0")
