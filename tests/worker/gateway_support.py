"""Test support for the gateway: AgentRollouts driven by a loop thread like the worker's, and an engine spy.

:class:`Driver` runs the worker loop's part (``step`` when ready, else ``poll`` and wait for the wake event)
on a thread of its own, which is then the only thread calling the backend, as in a worker. :class:`Spy`
records every ``generate`` output (or streamed request) of the real backend, so tests compare trajectories with what the engine
really produced.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from loraflow.common.config import Config, load_config
from loraflow.common.metrics import Metrics
from loraflow.common.protocol import PromptLease
from loraflow.rollout_worker.adapters import ReceivedAdapter
from loraflow.rollout_worker.backends.base import Backend, GenDelta, GenOutput, GenRequest
from loraflow.rollout_worker.gateway.episodes import AgentRollouts
from loraflow.rollout_worker.samples import FinishedGroup


class Spy:
    """Wraps ``backend._generate`` (a streaming backend: ``_submit`` and ``_advance``, the engine's raw outputs):
    (request token ids, output) of every generation, in order; a streamed request's output collects its steps'
    tokens and log-probs as the engine gives them."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.seen: list[tuple[list[int], GenOutput]] = []
        self.batches: list[set[str]] = []  # the sessions of each generate call (streaming: each engine step)
        self._open: dict[str, GenOutput] = {}  # streaming: request id -> its output so far
        self._inner = backend._generate
        backend._generate = self._generate  # type: ignore[method-assign]
        self._inner_submit, self._inner_advance = backend._submit, backend._advance
        if backend.streaming:
            backend._submit = self._submit  # type: ignore[method-assign]
            backend._advance = self._advance  # type: ignore[method-assign]

    def _generate(self, requests: list[GenRequest], greedy: bool) -> list[GenOutput]:
        outputs = self._inner(requests, greedy)
        self.seen += [(list(r.token_ids), o) for r, o in zip(requests, outputs, strict=True)]
        self.batches.append({r.key.split("/")[1] for r in requests if r.key.startswith("gw/")})
        return outputs

    def _submit(self, request_id: str, request: GenRequest, greedy: bool) -> None:
        self._inner_submit(request_id, request, greedy)
        self._open[request_id] = GenOutput(token_ids=[], logprobs=[], finished=False)
        self.seen.append((list(request.token_ids), self._open[request_id]))

    def _advance(self) -> list[GenDelta]:
        deltas = self._inner_advance()
        for delta in deltas:
            out = self._open.get(delta.request_id)
            if out is not None:
                out.token_ids += delta.token_ids
                out.logprobs += delta.logprobs
                out.finished, out.served = delta.finished, delta.served  # the engine's own report
        self.batches.append({d.request_id.split("/")[1] for d in deltas if d.request_id.startswith("gw/")})
        return deltas

    def close(self) -> None:
        self.backend._generate = self._inner  # type: ignore[method-assign]
        if self.backend.streaming:
            self.backend._submit = self._inner_submit  # type: ignore[method-assign]
            self.backend._advance = self._inner_advance  # type: ignore[method-assign]


def gateway_config(model_dir: Path, run_dir: Path, agent: str, *overrides: str) -> Config:
    return load_config(None, [f'model.path="{model_dir}"', f'run.run_dir="{run_dir}"', f'worker.agent="{agent}"',
                              "worker.chunk_tokens=8", "worker.max_new_tokens=64", "model.max_seq_len=512",
                              *overrides])


class Driver:
    """AgentRollouts and the loop thread that drives it (see the module docstring)."""

    def __init__(self, config: Config, backend: Backend) -> None:
        self.metrics = Metrics()
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.rollouts = AgentRollouts(config, backend, worker_id="w-test", metrics=self.metrics, wake=self.wake,
                                      info_path=config.run_dir / "gateway.json")
        self.finished: list[FinishedGroup] = []
        self.error: BaseException | None = None
        self._leases: list[PromptLease | ReceivedAdapter] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="test-worker-loop")
        self._thread.start()

    @property
    def url(self) -> str:
        return self.rollouts.server.url

    def add(self, lease: PromptLease) -> None:
        with self._lock:
            self._leases.append(lease)
        self.wake.set()

    def add_adapter(self, adapter: ReceivedAdapter) -> None:
        """Loaded by the loop thread before the leases added after it (the worker loads between rounds)."""
        self.add(adapter)  # type: ignore[arg-type]

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                self.wake.clear()
                with self._lock:
                    leases, self._leases = self._leases, []
                for item in leases:
                    if isinstance(item, ReceivedAdapter):
                        self.rollouts.backend.add_adapter(item)
                    else:
                        self.rollouts.add(item)
                if self.rollouts.has_ready():
                    done = self.rollouts.step()
                else:
                    done = self.rollouts.poll()
                    if not done:
                        self.wake.wait(0.05)
                self.finished += done
        except BaseException as exc:  # noqa: BLE001 - reported by wait()
            self.error = exc

    def wait_groups(self, count: int, timeout_s: float = 120.0) -> list[FinishedGroup]:
        deadline = time.monotonic() + timeout_s
        while len(self.finished) < count:
            assert self.error is None, f"the loop thread failed: {self.error!r}"
            assert time.monotonic() < deadline, f"{len(self.finished)} of {count} groups finished in {timeout_s} s"
            time.sleep(0.02)
        return self.finished[:count]

    def close(self) -> None:
        self.stop.set()
        self.wake.set()
        self._thread.join(10)
        self.rollouts.close()
        assert self.error is None, f"the loop thread failed: {self.error!r}"


def lease(group_id: str, prompt: Any, answer: str = "7", group_size: int = 3) -> PromptLease:
    messages = prompt if isinstance(prompt, list) else None
    return PromptLease(lease_id=f"lease-{group_id}", group_id=group_id, prompt_index=0, epoch=0, task="agent",
                       prompt="" if messages else prompt, prompt_messages=messages, answer=answer,
                       group_size=group_size, deadline_s=120.0, columns={"difficulty": 2})


def sample_arrays(group: FinishedGroup) -> list[dict[str, list]]:
    """Per-sample lists of a finished group's tensors."""
    t = dict(group.tensors)
    out, p, c = [], 0, 0
    for plen, clen in zip(group.group.prompt_lens, group.group.completion_lens, strict=True):
        out.append({"prompt_ids": t["prompt_ids"][p:p + plen].tolist(),
                    **{k: t[k][c:c + clen].tolist() for k in ("completion_ids", "logprobs", "versions", "loss_mask")}})
        p, c = p + plen, c + clen
    return out


def check_exact(group: FinishedGroup, spy: Spy) -> int:
    """Every trained token (loss mask 1) is exactly a token the engine generated, with its log-prob, in the
    order and at the positions it was generated; context tokens have mask 0. Returns the number of turns."""
    by_prefix: dict[tuple[int, ...], list[GenOutput]] = {}
    for ids, out in spy.seen:  # episodes of a group share their first prompt: several outputs per prefix
        by_prefix.setdefault(tuple(ids), []).append(out)
    num_turns = 0
    for s in sample_arrays(group):
        seq = s["prompt_ids"] + s["completion_ids"]
        plen = len(s["prompt_ids"])
        i = 0
        while i < len(s["completion_ids"]):
            if not s["loss_mask"][i]:
                assert s["logprobs"][i] == 0.0
                i += 1
                continue
            j = i
            while j < len(s["completion_ids"]) and s["loss_mask"][j]:
                j += 1
            # a run of trained tokens is one call: chunk by chunk, each chunk the engine's output for its prefix
            k = i
            while k < j:
                outs = by_prefix.get(tuple(seq[:plen + k]))
                assert outs, f"no engine call was fed the prefix before trained token {k}"
                n, out = max(((_common(s["completion_ids"][k:j], o.token_ids), o) for o in outs), key=lambda x: x[0])
                assert n >= 1, f"trained token {k} is not the token the engine generated after its prefix"
                assert all(abs(a - b) < 1e-6 for a, b in zip(s["logprobs"][k:k + n], out.logprobs[:n], strict=True))
                k += n
            num_turns += 1
            i = j
    return num_turns


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix (a call cut at a stop string keeps fewer tokens than the engine gave)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
