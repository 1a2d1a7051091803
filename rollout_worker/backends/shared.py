"""One engine, several runs: :class:`SharedEngine` owns a backend; each run drives it through a :class:`RunView`.

A pool worker (:mod:`loraflow.rollout_worker.pool_worker`) serves every running run of a pool from one model.
Each run's learner numbers its versions from 1, so two runs' v3 are different adapters. A run's view is the
whole :class:`~loraflow.rollout_worker.backends.base.Backend` interface over that run's own versions, and the
engine holds each adapter under a version of its own::

    engine version = run slot << RUN_SHIFT | version        v0, the base model, is every run's: 0
    request id, generation key = "r<slot>|" + the run's     (groups and samples of two runs never collide)

What comes back (a :class:`GenOutput` or :class:`GenDelta`, its evidence ``ServedAdapter``) carries the run's
own version again, so the run's learner checks each token's evidence against its own lineage exactly as for a
worker of one run: a token served by another run's adapter has that adapter's sha256, which no version of this
run's lineage has, and the learner refuses the group (``adapter_sha256``). A view's ``retain`` unloads only its
own run's versions; a view released (its run ended) aborts its requests and unloads its adapters.

Sampling (``worker.temperature``, ``worker.top_p``) is each run's: the view sets it on the backend for each call.

Fair share: each run has a weight (``run.weight``). The engine keeps each view's weighted tokens (tokens it
generated / its weight) and, before a view starts a chunk or submits a request, holds it while it is more than
``SLACK_TOKENS`` ahead of the least-served run that is contending now: one waiting for its own turn or inside a
call, or (a streaming engine) with requests in the engine. The rule is work-conserving: a run busy elsewhere
(scoring, waiting for leases) holds nobody back, so the engine never idles for fairness' sake. A run that joins
or comes back after ``IDLE_S`` without a call starts level with the others (not with a credit of everything it
missed). Waiting is bounded by ``MAX_WAIT_S``, so a run whose partner stalls mid-call never stops. Tokens per
weight are what is shared because they are what the engine spends; a streaming engine's share is settled at
submission (a turn's requests, once in, run out).

Threads: each run's :class:`~loraflow.rollout_worker.worker.Worker` drives its view from a thread of its own, and
``lock`` makes the engine's calls one at a time (a chunked engine, hf, runs one run's batch per call: grouping
per run). A streaming engine's step (vllm) reports every run's requests: the view that waits for the step keeps
its own deltas and files the others' for their views, setting their runs' wake events.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

from msgspec.structs import replace as replace_record

from loraflow.common.chat import Prompt
from loraflow.common.protocol import ServedAdapter
from loraflow.rollout_worker.adapters import ReceivedAdapter
from loraflow.rollout_worker.backends.base import (
    RUN_KEY_SEP,
    Backend,
    GenDelta,
    GenOutput,
    GenRequest,
    Sampling,
)

RUN_SHIFT = 20
MAX_RUN_VERSION = (1 << RUN_SHIFT) - 1  # a run's versions above this cannot be told from the next slot's
SLACK_TOKENS = 64.0  # weighted tokens a run may be ahead of the least-served run that wants to generate
IDLE_S = 0.5  # a run that made no call this long comes back level with the others
MAX_WAIT_S = 2.0  # the longest one call is held for the others


class SharedEngine:
    """The one backend of a pool worker, the views of the runs it serves and the deltas filed for them."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.lock = threading.RLock()
        self._turns = threading.Condition(self.lock)  # notified whenever a view's weighted tokens grow
        self.views: dict[int, RunView] = {}
        self._slots = itertools.count(1)

    def view(self, run: str, *, sampling: Sampling, wake: threading.Event, weight: float = 1.0) -> RunView:
        """A view for run ``run`` (a slot of its own, never reused in this process), sharing the engine by
        ``weight``."""
        problem = self.backend.sampling_problem(sampling)
        if problem:
            raise ValueError(f"run {run}: {problem}")
        with self.lock:
            view = RunView(self, run, slot=next(self._slots), sampling=sampling, wake=wake, weight=weight)
            self.views[view.slot] = view
            return view

    # -- fair share (see the module docstring) -------------------------------------------------------------

    def wait_turn(self, view: RunView) -> float:
        """Hold ``view`` while it is ahead of its share; returns the seconds it was held."""
        started = now = time.monotonic()
        with self._turns:
            view.pending = True
            others = self._contending(view)
            if now - view.asked_s > IDLE_S and others:  # back from idle: level
                view.weighted_tokens = max(view.weighted_tokens, min(o.weighted_tokens for o in others))
            while (others and view.weighted_tokens > min(o.weighted_tokens for o in others) + SLACK_TOKENS
                   and now - started < MAX_WAIT_S):
                self._turns.wait(0.05)
                now = time.monotonic()
                others = self._contending(view)
            view.asked_s = now
        view.held_s += now - started
        return now - started

    def end_turn(self, view: RunView, num_tokens: int = 0) -> None:
        """``view``'s call is done, ``num_tokens`` generated in it (a streaming engine's: charged per delta)."""
        with self._turns:
            view.pending = False
            self.charge(view, num_tokens)

    def charge(self, view: RunView, num_tokens: int) -> None:
        """``num_tokens`` generated for ``view``'s run."""
        with self._turns:
            view.num_tokens += num_tokens
            view.weighted_tokens += num_tokens / view.weight
            self._turns.notify_all()

    def _contending(self, view: RunView) -> list[RunView]:
        return [o for o in self.views.values() if o is not view and (o.pending or o.num_streams)]

    def shares(self) -> dict[str, dict[str, float]]:
        """Each served run's tokens, weight and seconds held for the others (logs and the pool bench)."""
        with self.lock:
            return {v.run: {"tokens": v.num_tokens, "weight": v.weight, "held_s": round(v.held_s, 3)}
                    for v in self.views.values()}

    def release(self, view: RunView) -> None:
        """The run is no longer served: its requests aborted, its adapters unloaded."""
        with self.lock:
            view.abort_all()
            self.backend.retain([v for v in self.backend.adapters if v >> RUN_SHIFT != view.slot])
            self.views.pop(view.slot, None)

    def level(self) -> float:
        """The weighted tokens of the least-served run (where a joining run starts)."""
        with self.lock:
            return min((v.weighted_tokens for v in self.views.values()), default=0.0)

    def advance_for(self, view: RunView) -> list[GenDelta]:
        """``view``'s deltas: those filed for it, else one engine step's (filing every other run's for it)."""
        with self.lock:
            if not view.filed:
                for delta in self.backend.advance():
                    prefix, _, request_id = delta.request_id.partition(RUN_KEY_SEP)
                    owner = self.views.get(int(prefix[1:]))
                    if owner is None:
                        continue  # a released run's request, aborted
                    owner.filed.append(owner.local_delta(delta, request_id))
                    self.charge(owner, len(delta.token_ids))
                    if owner is not view:
                        owner.wake.set()
            taken, view.filed = view.filed, []
            return taken


class RunView(Backend):
    """The backend as one run sees it: its own versions, its own requests, its own sampling."""

    def __init__(self, engine: SharedEngine, run: str, *, slot: int, sampling: Sampling,
                 wake: threading.Event, weight: float) -> None:
        super().__init__(sampling)
        shared = engine.backend
        self.engine, self.run, self.slot, self.wake = engine, run, slot, wake
        self.name, self.streaming = shared.name, shared.streaming  # type: ignore[misc]
        self.eos_token_id, self.eos_token_ids = shared.eos_token_id, shared.eos_token_ids
        self.vocab_size, self.chat, self.engine_dtype = shared.vocab_size, shared.chat, shared.engine_dtype
        self.filed: list[GenDelta] = []  # this run's deltas of engine steps another view waited for
        self._prefix = f"r{slot}{RUN_KEY_SEP}"
        self.weight = weight
        self.num_tokens = 0  # generated for this run
        self.weighted_tokens = engine.level()  # num_tokens / weight, from where the others were when it joined
        self.asked_s = time.monotonic()  # when its last call began
        self.pending = False  # waiting for its turn or inside a call
        self.held_s = 0.0  # seconds held for the other runs' share

    # -- versions and ids ----------------------------------------------------------------------------------

    def engine_version(self, version: int) -> int:
        if not 0 <= version <= MAX_RUN_VERSION:
            raise ValueError(f"run {self.run}: version {version} is beyond a shared engine's {MAX_RUN_VERSION}")
        return version and self.slot << RUN_SHIFT | version

    def _local(self, served: ServedAdapter | None) -> ServedAdapter | None:
        if served is None:
            return None
        return replace_record(served, version=served.version & MAX_RUN_VERSION)

    def _engine_request(self, request: GenRequest) -> GenRequest:
        return dataclasses.replace(request, version=self.engine_version(request.version),
                                   key=self._prefix + request.key if request.key else "")

    def local_delta(self, delta: GenDelta, request_id: str) -> GenDelta:
        return dataclasses.replace(delta, request_id=request_id, served=self._local(delta.served))

    # -- tokens: the engine's tokenizer ---------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        return self.engine.backend.encode(prompt)

    def encode_continuation(self, text: str) -> list[int]:
        return self.engine.backend.encode_continuation(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.engine.backend.decode(token_ids)

    # -- adapters --------------------------------------------------------------------------------------------

    @property
    def load_phases_ms(self) -> dict[str, float]:  # type: ignore[override]
        return self.engine.backend.load_phases_ms

    @load_phases_ms.setter
    def load_phases_ms(self, _value: dict[str, float]) -> None:
        pass  # the engine's: Backend.__init__ sets it

    def _load(self, adapter: ReceivedAdapter) -> ServedAdapter | None:
        version = self.engine_version(adapter.version)
        with self.engine.lock:
            self.engine.backend.add_adapter(dataclasses.replace(adapter, version=version))
            return self._local(self.engine.backend.served(version))

    def _unload(self, version: int) -> None:
        with self.engine.lock:
            gone = self.engine_version(version)
            self.engine.backend.retain([v for v in self.engine.backend.adapters if v != gone])

    # -- generation ------------------------------------------------------------------------------------------

    def _generate(self, requests: Sequence[GenRequest], greedy: bool) -> list[GenOutput]:
        self.engine.wait_turn(self)
        outputs: list[GenOutput] = []
        try:
            with self.engine.lock:
                self.engine.backend.sampling = self.sampling
                outputs = self.engine.backend.generate([self._engine_request(r) for r in requests], greedy=greedy)
        finally:
            self.engine.end_turn(self, sum(len(o.token_ids) for o in outputs))
        for output in outputs:
            output.served = self._local(output.served)
        return outputs

    def _submit(self, request_id: str, request: GenRequest, greedy: bool) -> None:
        self.engine.wait_turn(self)
        try:
            with self.engine.lock:
                self.engine.backend.sampling = self.sampling
                self.engine.backend.submit(self._prefix + request_id, self._engine_request(request), greedy=greedy)
        finally:
            self.engine.end_turn(self)

    def _abort(self, request_ids: list[str]) -> None:
        with self.engine.lock:
            self.engine.backend.abort([self._prefix + r for r in request_ids])
            self.filed = [d for d in self.filed if d.request_id not in request_ids]

    def _advance(self) -> list[GenDelta]:
        return self.engine.advance_for(self)

    def abort_all(self) -> None:
        self.abort(list(self._streams))

    def describe(self) -> dict[str, Any]:
        return {**self.engine.backend.describe(), "run": self.run, "run_slot": self.slot, "weight": self.weight,
                "resident": sorted(self.adapters)}

    def close(self) -> None:
        self.engine.release(self)

