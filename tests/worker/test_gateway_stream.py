"""The gateway on a streaming engine (vllm): each call's whole turn goes into the running batch as it arrives.

- a call admitted while another generates joins the engine's batch at once (the first call's request is never
  resubmitted) and each ends on its own: the short one is answered while the long one still generates;
- what the sessions record is exactly what the engine streamed (token ids, log-probs), one engine request per
  call, with the engine's report as the call's evidence; an SSE response's deltas add up to the recorded text;
- a session closed mid-call takes its request out of the engine (``Backend.abort``), and the call gets its error.

The engine is driven on the test's thread (the worker's part), its replies delivered on an event loop the test
runs (the HTTP server's part); the session's one vLLM engine is shared with the other vllm tests.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from loraflow.common.config import WorkerConfig
from loraflow.common.metrics import Metrics
from loraflow.rollout_worker.backends.base import Backend
from loraflow.rollout_worker.gateway import openai_api as api
from loraflow.rollout_worker.gateway.engine import GatewayEngine, Job
from loraflow.rollout_worker.gateway.session import Session
from tests.worker.gateway_support import Spy

pytestmark = pytest.mark.vllm

MAX_STEPS = 2000  # bounds every loop on a misbehaving engine


class Replies:
    """Jobs for the engine and the event loop their replies are delivered on (the server's, in a worker)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def job(self, session_id: str, prompt: str, max_tokens: int, *, stream: bool = False) -> Job:
        params = api.parse("completion", {"model": "loraflow", "prompt": prompt, "max_tokens": max_tokens,
                                          "stream": stream}, models=["loraflow"], default_max_tokens=64,
                           temperature=1.0, top_p=1.0)
        return Job(kind="completion", session_id=session_id, params=params, loop=self.loop,
                   future=self.loop.create_future(), events=asyncio.Queue() if stream else None)

    def deliver(self) -> None:
        self.loop.run_until_complete(asyncio.sleep(0))

    @staticmethod
    def events(job: Job) -> list[Any]:
        assert job.events is not None
        out = []
        while not job.events.empty():
            out.append(job.events.get_nowait())
        return out

    def close(self) -> None:
        self.loop.close()


@pytest.fixture
def engine(vllm_session_backend: Backend) -> Iterator[GatewayEngine]:
    vllm_session_backend.abort_all()
    vllm_session_backend.retain(set())
    yield GatewayEngine(vllm_session_backend, WorkerConfig(max_new_tokens=64, chunk_tokens=4), max_seq_len=256,
                        models=["loraflow"], metrics=Metrics(), wake=threading.Event())
    vllm_session_backend.abort_all()


@pytest.fixture
def replies() -> Iterator[Replies]:
    out = Replies()
    yield out
    out.close()


def step_until(engine: GatewayEngine, replies: Replies, done: Any) -> None:
    for _ in range(MAX_STEPS):
        if done():
            return
        engine.round()
        replies.deliver()
    raise AssertionError("the engine did not get there")


def test_a_call_joins_the_running_batch_and_each_ends_on_its_own(engine: GatewayEngine, replies: Replies) -> None:
    backend = engine.backend
    spy = Spy(backend)
    try:
        for attempt in range(5):  # the long call may end at a sampled EOS before the short one: play again
            long, short = Session(id=f"long{attempt}"), Session(id=f"short{attempt}")
            mark = len(spy.seen)  # this attempt's requests start here
            engine.open(long)
            engine.open(short)
            first = replies.job(long.id, "12+34=", 48, stream=True)
            engine.submit(first)
            engine.pump(gather=True)
            assert backend.num_streams == 1
            step_until(engine, replies, lambda: not engine.calls or engine.calls[0].token_ids)
            second = replies.job(short.id, "7+8=", 2)
            engine.submit(second)
            engine.pump(gather=True)
            long_running = any(c.session is long for c in engine.calls)
            assert backend.num_streams == len(engine.calls) == 1 + long_running  # joined, nothing resubmitted
            step_until(engine, replies, second.future.done)
            long_running = long_running and any(c.session is long for c in engine.calls)
            step_until(engine, replies, lambda: not engine.calls)
            if long_running:
                break
        else:
            raise AssertionError("the long call ended before the short one in 5 attempts")
    finally:
        spy.close()
    assert backend.num_streams == 0
    status, body = second.future.result()
    assert status == 200 and body["usage"]["completion_tokens"] == len(short.calls[0].token_ids) <= 2
    # each call is one engine request fed the recorded prompt, and records exactly what the engine streamed
    assert len(spy.seen) == mark + 2
    for session, (ids, output) in zip((long, short), spy.seen[mark:], strict=True):
        (call,) = session.calls
        assert ids == call.prompt_ids == session.prompt_ids
        assert call.token_ids == output.token_ids and call.logprobs == pytest.approx(output.logprobs, abs=1e-6)
        assert session.completion_ids == call.token_ids and session.loss_mask == [1] * len(call.token_ids)
        assert session.versions == [0] * len(call.token_ids) and call.served == output.served == backend.served(0)
    assert any({long.id, short.id} <= batch for batch in spy.batches)  # steps that advanced both
    events = replies.events(first)
    assert events[-1][0] == "done" and events[-1][1] == 200
    (call,) = long.calls
    text = backend.decode(call.token_ids[:-1] if call.finish_reason == "stop" else call.token_ids)
    assert "".join(e[1] for e in events[:-1]) == text == events[-1][2]["choices"][0]["text"]


def test_a_session_closed_mid_call_takes_its_request_out_of_the_engine(engine: GatewayEngine,
                                                                       replies: Replies) -> None:
    backend = engine.backend
    for attempt in range(5):  # a sampled EOS may end the call before it is closed: play again
        session = Session(id=f"closed{attempt}")
        engine.open(session)
        job = replies.job(session.id, "99+1=", 48)
        engine.submit(job)
        engine.pump()
        step_until(engine, replies, lambda: not engine.calls or engine.calls[0].token_ids)
        if engine.calls:
            break
    else:
        raise AssertionError("every call ended before its first step's tokens were taken")
    assert backend.num_streams == 1
    engine.close(session.id)
    assert backend.num_streams == 0 and not engine.calls and engine.versions_in_use() == set()
    replies.deliver()
    status, body = job.future.result()
    assert status == 409 and body["error"]["code"] == "session_finished"
    engine.round()  # nothing in the engine: returns at once
    assert not session.calls
