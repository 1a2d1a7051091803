"""The OpenAI wire format of the gateway: request checks and response bodies (pure functions, no I/O).

Requests are checked here once, before anything reaches the engine; a bad one raises :class:`ApiError`, which
the server answers with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` and its status.

Sampling is the worker's: every token is drawn at ``worker.temperature`` / ``worker.top_p`` so that its
behaviour log-prob is the one the learner corrects against. A request's own ``temperature`` / ``top_p`` / ``seed``
are accepted and, when they differ, not applied (counted as ``gateway_sampling_ignored{param}``). ``n`` must be 1
(one trajectory per session call); ``top_logprobs`` lists are empty (only the sampled token's log-prob is kept).
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4


class ApiError(Exception):
    """A request the gateway refuses: an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(slots=True, kw_only=True)
class Params:
    """A checked request: a chat call (``messages``) or a text completion (``prompt``)."""

    kind: str  # "chat" or "completion"
    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    ignored: list[str] = field(default_factory=list)  # sampling params given but not applied


def _int(body: dict[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"'{name}' must be an integer >= {low}, got {value!r:.40}", param=name)
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number, got {value!r:.40}", param=name)
    return float(value)


def parse(kind: str, body: Any, *, models: list[str], default_max_tokens: int, temperature: float,
          top_p: float) -> Params:
    """Check a decoded JSON body of ``/v1/chat/completions`` (``kind`` "chat") or ``/v1/completions``."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required (GET /v1/models lists the served model)", param="model")
    if model not in models:
        raise ApiError(404, f"the model '{model[:100]}' does not exist; this gateway serves {models}",
                       param="model", code="model_not_found", type="invalid_request_error")
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise ApiError(400, f"n = {n} is not supported: each call of a session is one trajectory; make n calls "
                       "(one session each) instead", param="n", code="n_unsupported")
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1) or default_max_tokens
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings",
                       param="stop")
    ignored = []
    for name, own in (("temperature", temperature), ("top_p", top_p)):
        value = _number(body, name)
        if value is not None and abs(value - own) > 1e-9:
            ignored.append(name)
    if _int(body, "seed", -(1 << 63)) is not None:
        ignored.append("seed")
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise ApiError(400, "'stream' must be a boolean and 'stream_options' an object", param="stream")
    params = Params(kind=kind, model=model, max_tokens=max_tokens, stop=stop, stream=stream,
                    include_usage=bool(options.get("include_usage")), ignored=ignored)
    logprobs = body.get("logprobs")
    if kind == "chat":
        params.logprobs = bool(logprobs)
        params.messages = _messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ApiError(400, "'tools' must be a list of tool objects", param="tools")
        choice = body.get("tool_choice", "auto")
        params.tools = tools or None
        params.parse_tools = bool(tools) and choice != "none"
        if choice == "none":
            params.tools = None
    else:
        params.logprobs = logprobs is not None and logprobs is not False
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (one prompt per call)", param="prompt")
        params.prompt = prompt
    return params


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a 'role' in {list(ROLES)}",
                           param=f"messages[{i}]")
        content = m.get("content")
        if not (content is None or isinstance(content, str | list)):
            raise ApiError(400, f"messages[{i}].content must be a string, a list of parts or null",
                           param=f"messages[{i}].content")
    return messages


# -- responses -----------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}"


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs, strict=True)]}


def completion_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def chat_response(*, id: str, model: str, content: str | None, tool_calls: list[dict[str, Any]],  # noqa: A002
                  finish_reason: str, logprobs: dict[str, Any] | None, prompt_tokens: int,
                  completion_tokens: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_response(*, id: str, model: str, text: str, finish_reason: str,  # noqa: A002
                        logprobs: dict[str, Any] | None, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(kind: str, *, id: str, model: str, text: str = "", finish_reason: str | None = None,  # noqa: A002
          tool_calls: list[dict[str, Any]] | None = None, first: bool = False,
          usage_value: dict[str, int] | None = None) -> dict[str, Any]:
    """One SSE event of a streamed response (a usage-only event has no choices)."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    event: dict[str, Any] = {"id": id, "object": obj, "created": int(time.time()), "model": model,
                             "choices": [] if usage_value is not None else [choice]}
    if usage_value is not None:
        event["usage"] = usage_value
    return event
