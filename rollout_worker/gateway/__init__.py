"""The agent gateway: an OpenAI-compatible HTTP API in front of the worker's own engine, recording exact tokens.

Any harness written against the OpenAI client (``worker.agent``, or another process driving sessions over
HTTP) produces trajectories that are trainable as they are: token in, token out, never a re-tokenization.

- :mod:`.server`: the HTTP routes (aiohttp, one daemon thread), auth, OpenAI error bodies
- :mod:`.openai_api`: request checks and response bodies (pure)
- :mod:`.engine`: requests queued to the worker's thread and batched into the backend chunk by chunk
- :mod:`.session`: one episode's append-only trajectory and the prefix rule (``tito_divergence{reason}``)
- :mod:`.tools`: tool-call parsers (``worker.tool_parser``)
- :mod:`.stream_text`: a streamed call's text, decoded a window at a time (SSE)
- :mod:`.episodes`: leased groups played by the harness (:class:`AgentRollouts`, the worker loop's hook)
"""
