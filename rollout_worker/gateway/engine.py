"""The gateway's engine side: HTTP requests queued to the worker's thread, fed to the backend's engine.

    HTTP handlers (server thread)  --Job-->  inbox (thread-safe queue) ---- wake event ----+
                                                                                           v
    worker thread: pump()  checks the session, renders the messages (session.py), admits a Call; on a streaming
                           backend (vllm) the call's whole turn goes into the running engine at once
                           (``Backend.submit``)
                   round() streaming: one engine step (``Backend.advance``): every call it advanced gets its new
                           tokens (an SSE response its text); chunked (hf): one backend.generate for every
                           admitted Call at once (<= worker.chunk_tokens each);
                           a Call ends at an end-of-turn id, a stop string or its max_tokens; then its tokens
                           join the session and the reply (or the last SSE event) goes back to the server loop

The engine owns the sessions and every tokenizer use, so nothing but the worker's thread touches the backend,
a tokenizer or a trajectory; handlers only parse JSON and wait for their reply. Calls of concurrent episodes
(and of several groups) share the engine's batch, as Rollouts' samples do.

Streaming backend: a call joins the running batch at the engine's next step and leaves it when it ends, each on
its own (a stop string takes it out with ``Backend.abort``); nothing waits for a round boundary, so nothing is
gathered. Chunked backend: a call that ends leaves at the next chunk boundary; before a round, a burst of
arriving requests is gathered for up to 20 ms (until 2 ms pass without one), so the calls a previous round
answered start together again instead of splitting into two half batches (measured in bench/gateway.py: without
it, 64 sessions ran at half the batch).
Replies leave through an :class:`Outbox`: one wake-up of the server's loop per round, not one per call.

Each call runs under the newest adapter version when it was admitted, for all its tokens (those versions are
pinned: :meth:`GatewayEngine.versions_in_use`); the next call of the same episode may run under a newer one, so
a trajectory's per-token versions can change between turns.
A call's ``max_tokens`` defaults to ``worker.max_new_tokens`` and is capped by it (``gateway_max_tokens_capped``)
and by the room left under ``model.max_seq_len``.

Evidence (issue 14): each chunk's ``GenOutput.served`` (or each step's ``GenDelta.served``: the engine's report of
that very request) is kept per call and in the session's ``served`` (its group's evidence) as the report comes,
with ``Backend.keep_served``; a call's record keeps its report; context tokens a call adds are stamped with the
version it runs under and noted with ``backend.served`` of it, as :mod:`loraflow.rollout_worker.samples` notes
environment tokens.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraflow.common.config import WorkerConfig
from loraflow.common.logging import get_logger
from loraflow.common.metrics import Metrics
from loraflow.common.protocol import ServedAdapter
from loraflow.rollout_worker.backends.base import Backend, GenDelta, GenRequest
from loraflow.rollout_worker.gateway import openai_api as api
from loraflow.rollout_worker.gateway.session import ACTIVE, FINISHED, PrefixDivergence, Session
from loraflow.rollout_worker.gateway.stream_text import TextStream, byte_fallback_ids
from loraflow.rollout_worker.gateway.tools import PARSERS, template_messages

log = get_logger("gateway")

MAX_FINISHED_REMEMBERED = 4096  # finished session ids kept to tell "finished" from "unknown"
BATCH_QUIET_S = 0.002  # a burst of requests is over when none came for this long
BATCH_MAX_S = 0.02  # the longest a round waits to gather a burst


@dataclass(slots=True, kw_only=True)
class Job:
    """One HTTP request handed to the worker's thread; the reply goes back through ``loop``."""

    kind: str  # chat, completion, finish, trajectory, claim
    session_id: str | None
    params: api.Params | None = None
    body: dict[str, Any] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    events: asyncio.Queue | None = None  # streaming: text deltas, then the final reply

    def reply(self, status: int, body: dict[str, Any], outbox: Outbox | None = None) -> None:
        def deliver() -> None:
            if self.events is not None:
                self.events.put_nowait(("done", status, body))
            elif not self.future.done():
                self.future.set_result((status, body))
        (outbox or Outbox()).post(self.loop, deliver)

    def fail(self, error: api.ApiError) -> None:
        self.reply(error.status, error.body())

    def delta(self, text: str, outbox: Outbox | None = None) -> None:
        if self.events is not None and text:
            (outbox or Outbox()).post(self.loop, lambda: self.events.put_nowait(("delta", text)))


class Outbox:
    """Replies for the server's event loop, handed over in one ``call_soon_threadsafe`` per loop: a round that
    answers 64 calls wakes the server's loop once, not 64 times (each a write to its self-pipe, on the worker's
    thread). Without a :meth:`flush` (a throwaway outbox) every reply goes at once."""

    def __init__(self, *, hold: bool = False) -> None:
        self.hold = hold
        self._held: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}

    def post(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[], None]) -> None:
        if not self.hold:
            loop.call_soon_threadsafe(deliver)
        else:
            self._held.setdefault(loop, []).append(deliver)

    def flush(self) -> None:
        held, self._held = self._held, {}
        for loop, delivers in held.items():
            loop.call_soon_threadsafe(_deliver_all, delivers)


def _deliver_all(delivers: list[Callable[[], None]]) -> None:
    for deliver in delivers:
        deliver()


@dataclass(slots=True, kw_only=True)
class Call:
    """A chat or completion call being generated."""

    job: Job
    session: Session
    prompt_ids: list[int]
    version: int
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stream: TextStream | None = None  # a streamed response's text (SSE), decoded step by step
    key: str = ""  # the request's name (streaming: its request id in the engine)
    served: dict[int, ServedAdapter] = field(default_factory=dict)  # the engine's report of this call's chunks
    last_report: ServedAdapter | None = None  # the report kept last: an equal one after it changes nothing


class GatewayEngine:
    """Sessions, queued requests and the calls being generated (see the module docstring)."""

    def __init__(self, backend: Backend, config: WorkerConfig, *, max_seq_len: int, models: list[str],
                 metrics: Metrics, wake: threading.Event) -> None:
        if backend.chat is None:
            raise ValueError(f"worker.agent needs a backend with a tokenizer (hf or vllm), not {backend.name}")
        self.backend = backend
        self.chat = backend.chat
        self.config = config
        self.max_seq_len = max_seq_len
        self.models = models
        self.metrics = metrics
        self.wake = wake
        self.parse_tools = PARSERS[config.tool_parser]
        self.byte_ids = byte_fallback_ids(self.chat.tokenizer)  # streamed text waits for a run of them to end
        self.inbox: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.sessions: dict[str, Session] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.calls: list[Call] = []
        self.streaming = backend.streaming  # calls go into the running engine (submit / advance / abort)
        self._streams: dict[str, Call] = {}  # request id -> its call, while in the engine (streaming)
        self.on_finish: Callable[[Session, dict[str, Any]], str | None] | None = None  # external finish
        self.on_claim: Callable[[], dict[str, Any] | None] | None = None  # an external harness asks for work
        self._num_calls = 0

    # -- any thread --------------------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        self.inbox.put(job)
        self.wake.set()

    # -- the worker's thread -----------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.calls) or not self.inbox.empty()

    def open(self, session: Session) -> None:
        self.sessions[session.id] = session

    def close(self, session_id: str) -> Session | None:
        """End a session: its calls in flight get an error, later calls ``session_finished``."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return None
        session.state = FINISHED
        self.finished[session_id] = None
        while len(self.finished) > MAX_FINISHED_REMEMBERED:
            self.finished.popitem(last=False)
        gone = [c for c in self.calls if c.session is session]
        self._drop(gone)
        for call in gone:
            call.job.fail(_finished(session_id))
        return session

    def _drop(self, calls: list[Call]) -> None:
        """Calls leave (streaming: their requests leave the engine where they are)."""
        for call in calls:
            self.calls.remove(call)
        streamed = [c.key for c in calls if self._streams.pop(c.key, None) is not None]
        if streamed:
            self.backend.abort(streamed)

    def versions_in_use(self) -> set[int]:
        return {c.version for c in self.calls}

    def pump(self, *, gather: bool = False) -> None:
        """Answer or admit every queued request. ``gather`` (before a round): when requests are arriving, keep
        admitting until none came for ``BATCH_QUIET_S`` (at most ``BATCH_MAX_S``), so that a burst of calls
        (the episodes of a group, clients answered in the same round) starts in one batch, not split across two
        rounds. A streaming backend gathers nothing: a call joins the running batch at the engine's next step."""
        gather = gather and not self.streaming
        deadline = time.monotonic() + BATCH_MAX_S
        admitted = False
        while True:
            try:
                if admitted and gather and time.monotonic() < deadline:
                    job = self.inbox.get(timeout=BATCH_QUIET_S)
                else:
                    job = self.inbox.get_nowait()
            except queue.Empty:
                return
            admitted = admitted or job.kind in ("chat", "completion")
            try:
                self._handle(job)
            except api.ApiError as exc:
                self.metrics.inc("gateway_errors", code=exc.code or str(exc.status))
                job.fail(exc)
            except Exception as exc:  # noqa: BLE001 - a request never takes the worker down
                log.warning("gateway_request_failed", kind=job.kind, error=f"{type(exc).__name__}: {exc}"[:300])
                self.metrics.inc("gateway_errors", code="internal")
                job.fail(api.ApiError(500, f"{type(exc).__name__}: {exc}"[:500], type="server_error"))

    def _session(self, session_id: str | None) -> Session | None:
        if session_id is None:
            return None
        session = self.sessions.get(session_id)
        if session is not None:
            return session
        if session_id in self.finished:
            raise _finished(session_id)
        raise api.ApiError(404, f"no session '{session_id[:80]}' on this worker (sessions exist while their "
                           "episode runs)", code="session_not_found")

    def _handle(self, job: Job) -> None:
        if job.kind == "claim":
            claimed = self.on_claim() if self.on_claim is not None else None
            job.reply(200 if claimed else 204, claimed or {})
            return
        session = self._session(job.session_id)
        if job.kind == "trajectory":
            assert session is not None
            job.reply(200, session.trajectory())
            return
        if job.kind == "finish":
            assert session is not None
            error = self.on_finish(session, job.body) if self.on_finish is not None else "no episodes here"
            if error:
                raise api.ApiError(400, error, param="reward")
            job.reply(200, {"session_id": session.id, "state": FINISHED})
            return
        self._admit(job, session)

    def _admit(self, job: Job, session: Session | None) -> None:
        params = job.params
        assert params is not None
        for name in params.ignored:
            self.metrics.inc("gateway_sampling_ignored", param=name)
        version = self.backend.newest_version
        recorded = session is not None
        session = session or Session(id="")  # an unrecorded call: a throwaway trajectory
        num_held = len(session.completion_ids)
        try:
            messages = template_messages(params.messages) if params.messages is not None else None
            ids, reason = session.context(self.chat, messages=messages, prompt=params.prompt, tools=params.tools,
                                          version=version, refuse=self.config.tito_divergence == "refuse")
        except PrefixDivergence as exc:
            self.metrics.inc("tito_divergence", reason=exc.reason)
            self.metrics.inc("tito_refused")
            raise api.ApiError(400, str(exc), param="messages", code="prefix_divergence") from exc
        except (ValueError, TypeError, KeyError) as exc:  # the template refused the messages (jinja errors too)
            raise api.ApiError(400, f"the chat template could not render these messages: {exc}"[:500],
                               param="messages") from exc
        except Exception as exc:  # jinja2's TemplateError is not a ValueError
            raise api.ApiError(400, f"the chat template could not render these messages: {exc}"[:500],
                               param="messages") from exc
        if recorded and len(session.completion_ids) > num_held:  # new context tokens, stamped ``version``
            self.backend.keep_served(session.served, self.backend.served(version))
        if reason:
            self.metrics.inc("tito_divergence", reason=reason)
            log.debug("tito_divergence", session=session.id, reason=reason)
        room = self.max_seq_len - len(ids)
        if room < 1:
            raise api.ApiError(400, f"the prompt holds {len(ids)} tokens; model.max_seq_len = {self.max_seq_len} "
                               "leaves no room to generate", code="context_length_exceeded")
        if params.max_tokens > self.config.max_new_tokens:
            self.metrics.inc("gateway_max_tokens_capped")
        self._num_calls += 1
        call = Call(job=job, session=session, prompt_ids=ids, version=version,
                    max_tokens=min(params.max_tokens, self.config.max_new_tokens, room),
                    key=f"gw/{session.id}/{self._num_calls}")
        if job.events is not None and not params.parse_tools:  # SSE text as it comes (tool calls: at the end)
            call.stream = TextStream(self.backend.decode, hold=max(map(len, params.stop), default=1) - 1,
                                     byte_ids=self.byte_ids)
        if self.streaming:  # the whole turn into the running batch; it leaves the engine when it ends
            self.backend.submit(call.key, GenRequest(token_ids=call.prompt_ids, max_tokens=call.max_tokens,
                                                     version=version, key=call.key))
            self._streams[call.key] = call
        session.in_flight += 1
        self.calls.append(call)
        self.metrics.inc("gateway_calls", kind=job.kind, recorded=str(recorded).lower())

    def round(self) -> None:
        """Streaming: one engine step; chunked: one chunk for every call being generated. Finished calls are
        recorded and answered."""
        if not self.calls:
            return
        outbox = Outbox(hold=True)
        try:
            if self.streaming:
                self._step(self.backend.advance(), outbox)
            else:
                self._chunk(outbox)
        finally:
            outbox.flush()

    def _chunk(self, outbox: Outbox) -> None:
        chunk = self.config.chunk_tokens
        calls = list(self.calls)
        requests = [GenRequest(token_ids=c.prompt_ids + c.token_ids, version=c.version, key=c.key,
                               max_tokens=min(chunk, c.max_tokens - len(c.token_ids)), num_generated=len(c.token_ids))
                    for c in calls]
        outputs = self.backend.generate(requests)
        num_tokens = 0
        for call, output in zip(calls, outputs, strict=True):
            assert output.served is not None  # Backend.generate fills it
            added, end = self._extend(call, output.token_ids, output.logprobs, output.finished, output.served)
            num_tokens += added
            if end:
                self.calls.remove(call)
            self._answer(call, end, outbox)
        self.metrics.inc("gateway_tokens_generated", num_tokens)

    def _step(self, deltas: list[GenDelta], outbox: Outbox) -> None:
        """One engine step's tokens: each call it advanced takes its delta; a call the engine ended, or a stop
        string ended, leaves (the latter aborted in the engine)."""
        num_tokens = 0
        for delta in deltas:
            call = self._streams.get(delta.request_id)
            if call is None:
                continue  # its session closed after the engine had sent the step
            assert delta.served is not None  # Backend.advance fills it
            added, end = self._extend(call, delta.token_ids, delta.logprobs, delta.finished, delta.served)
            num_tokens += added
            if delta.done:
                del self._streams[call.key]
                self.calls.remove(call)
                end = end or "length"  # the engine ended it short of the budget: its own limit (the context)
            elif end:  # a stop string: the engine would go on
                self._drop([call])
            self._answer(call, end, outbox)
        self.metrics.inc("gateway_tokens_generated", num_tokens)

    def _extend(self, call: Call, token_ids: list[int], logprobs: list[float], eos: bool,
                served: ServedAdapter) -> tuple[int, str]:
        """A call's new tokens and the engine's report of them; returns how many it kept and how it ended ("":
        not yet): stop (an end-of-turn id), stop_string or length."""
        start = len(call.token_ids)
        call.token_ids += token_ids
        call.logprobs += logprobs
        if served != call.last_report:  # keep_served is idempotent: a step's report is most often the last one's
            self.backend.keep_served(call.served, served)
            self.backend.keep_served(call.session.served, served)
            call.last_report = served
        end = "stop" if eos else ""
        params = call.job.params
        assert params is not None
        if not end and params.stop and self._cut_at_stop(call, params.stop, start):
            end = "stop_string"
        if not end and len(call.token_ids) >= call.max_tokens:
            end = "length"
        return len(call.token_ids) - start, end

    def _answer(self, call: Call, end: str, outbox: Outbox) -> None:
        """A call that ended is recorded and answered; a streamed response (SSE) gets its new text (decoded from
        the last tokens only: :mod:`.stream_text`)."""
        if end:
            self._finish(call, end, outbox)
        elif call.stream is not None:
            call.job.delta(call.stream.push(call.token_ids), outbox)

    def _cut_at_stop(self, call: Call, stops: list[str], start: int) -> bool:
        """Keep the tokens up to the first stop string (the tokens after it are not part of the turn)."""
        # one ending in the new tokens starts at most 4 tokens per character (a byte-level vocabulary) before
        # them: decode only that tail (a streamed call is checked at every step)
        tail = call.token_ids[max(0, start - 4 * max(map(len, stops)) - 8):]
        if not any(s in self.backend.decode(tail) for s in stops):
            return False
        for length in range(max(1, start), len(call.token_ids) + 1):
            if any(s in self.backend.decode(call.token_ids[:length]) for s in stops):
                del call.token_ids[length:], call.logprobs[length:]
                return True
        return True

    def _finish(self, call: Call, end: str, outbox: Outbox) -> None:
        params, session, ids = call.job.params, call.session, call.token_ids
        assert params is not None
        text = self.backend.decode(ids[:-1] if end == "stop" else ids)
        if end == "stop_string":
            text = text[:min(i for i in (text.find(s) for s in params.stop) if i >= 0)]
        finish_reason = "length" if end == "length" else "stop"
        session.in_flight -= 1
        served = call.served[call.version]  # every call took at least one chunk or engine step
        session.record(self.chat, prompt_ids=call.prompt_ids, token_ids=ids, logprobs=call.logprobs,
                       version=call.version, finish_reason=finish_reason, turn_text=text, served=served)
        tokens = [self.backend.decode([t]) for t in ids] if params.logprobs else []
        rid = api.new_id(params.kind)
        if params.kind == "completion":
            body = api.completion_response(
                id=rid, model=params.model, text=text, finish_reason=finish_reason,
                logprobs=api.completion_logprobs(tokens, call.logprobs) if params.logprobs else None,
                prompt_tokens=len(call.prompt_ids), completion_tokens=len(ids))
        else:
            content: str | None = text
            tool_calls: list[dict[str, Any]] = []
            if params.parse_tools:
                parsed = self.parse_tools(text)
                if parsed.malformed:
                    self.metrics.inc("tool_call_parse_failures", parser=self.config.tool_parser)
                elif parsed.tool_calls:
                    content, tool_calls = parsed.content or None, parsed.tool_calls
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                    self.metrics.inc("tool_calls_parsed", len(tool_calls))
            body = api.chat_response(
                id=rid, model=params.model, content=content, tool_calls=tool_calls, finish_reason=finish_reason,
                logprobs=api.chat_logprobs(tokens, call.logprobs) if params.logprobs else None,
                prompt_tokens=len(call.prompt_ids), completion_tokens=len(ids))
        if call.stream is not None:
            rest = call.stream.rest(text)
            if rest is None:  # never seen on the tokenizers the tests build (tests/worker/test_gateway_text.py)
                self.metrics.inc("gateway_stream_text_mismatch")
                log.warning("gateway_stream_text_mismatch", session=session.id, sent=call.stream.sent[-80:],
                            text=text[-80:])
            call.job.delta(rest or "", outbox)
        call.job.reply(200, body, outbox)

    def fail_all(self, message: str) -> None:
        """Answer every queued and admitted request with an error (the worker is stopping)."""
        error = api.ApiError(503, message, type="server_error", code="worker_stopping")
        calls = list(self.calls)
        self._drop(calls)
        for call in calls:
            call.job.fail(error)
        while True:
            try:
                self.inbox.get_nowait().fail(error)
            except queue.Empty:
                return


def _finished(session_id: str) -> api.ApiError:
    return api.ApiError(409, f"session '{session_id[:80]}' has finished its episode; a new episode has a new "
                        "session", code="session_finished")


__all__ = ["ACTIVE", "Call", "GatewayEngine", "Job"]
