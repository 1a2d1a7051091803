"""The vLLM backend: one ``LLM`` engine with LoRA enabled; every policy version is its own LoRA adapter.

Adapters are loaded by path from the PEFT directories :mod:`loraflow.rollout_worker.adapters` writes. Each version gets
a fresh ``LoRARequest(name, int id, path)`` with an id never used before in this process: vLLM caches adapters
by int id, and re-using an id for new weights serves the old ones (FACTS.md, FIELD.md). Versions are added
with the engine core's ``add_lora`` as they arrive (so the first token under them does not pay the load) and
removed with ``remove_lora`` when the worker retains them no more; the engine is sized for ``vllm.max_loras``
(default ``max_staleness + 2``) resident adapters. The engine core runs such calls between two of its steps, after
the steps already in flight (async scheduling keeps one or two), so each blocking call costs a step or two of
waiting: a load sends ``add_lora`` and ``list_loras`` together and waits once, and a removal is sent without
waiting (the core runs calls and requests in the order sent; a refused removal is logged at the next call).

On the CPU platform the engine's LoRA matmuls are replaced by one GEMM per adapter in a step
(:mod:`.vllm_lora_cpu`, through vLLM's ``worker_extension_cls``; ``grouped_lora_ops=False`` keeps vLLM's own
per-token ops): vLLM's gather the adapter weights for every token, which made a prefill token cost ~5x more with an
adapter than without, and an adapter swap's re-read of every prefix in flight cost as many seconds.

Evidence (:mod:`.base`): a load records the ``LoRARequest``'s name and int id once the engine lists the id
(``list_loras``), and the sha256 of the ``adapter_model.safetensors`` it read from ``lora_path``, hashed right
after ``add_lora`` returned (vLLM reads the file inside the call). Each generation reports the ``lora_request``
the engine's ``RequestOutput`` names: the load that id belongs to (whatever version it was loaded for), or none.

Behaviour log-probs (:mod:`loraflow.common.logprobs`) come from vLLM's sampler with ``SamplingParams(logprobs=0)``, the
log-prob of each sampled token. Which of vLLM's ``logprobs_mode`` gives them depends on the sampling settings,
fixed when the engine starts:

- temperature 1: ``raw_logprobs`` (log-softmax of the raw logits), exact whatever top_p;
- top_p 1: ``processed_logprobs`` (log-softmax after temperature; no truncation happens);
- temperature != 1 and top_p < 1: ``raw_logprobs`` of the whole vocabulary (``logprobs=-1``), rescored here
  with the temperature (:func:`rescale_logprob`). Exact but slow for large vocabularies.

Every end-of-turn id (:func:`loraflow.common.chat.end_of_turn_ids`) is passed as ``stop_token_ids``, and a completion whose
``finish_reason`` is ``"stop"`` ended its turn (the stop id is its last token). Each request continues from its
full token sequence (``prompt_token_ids``), so a later one may run under another adapter; vLLM's prefix cache
is keyed by adapter, never mixing versions.

Streaming (:mod:`.base`): ``submit`` is ``LLMEngine.add_request`` with ``RequestOutputKind.DELTA`` (each output
carries only the new tokens and their log-probs), ``advance`` one ``LLMEngine.step`` (it waits for the next
outputs of the engine core, which runs in its own process and keeps stepping in between), ``abort``
``LLMEngine.abort_request`` (outputs the core had already sent for it are dropped by the engine). The evidence
of each delta is the ``lora_request`` its ``RequestOutput`` names, as for ``generate``.

The engine core's ZeroMQ socket files (``ipc://`` paths) go into a directory of this process that is removed when
it exits (:func:`private_rpc_dir`), not loose into the temp directory.
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loraflow.common.logging import get_logger
from loraflow.common.protocol import ServedAdapter
from loraflow.rollout_worker.adapters import WEIGHTS_FILE, ReceivedAdapter, tensors_sha256
from loraflow.rollout_worker.backends.base import (
    Backend,
    GenDelta,
    GenOutput,
    GenRequest,
    Sampling,
    TokenizerMixin,
)

log = get_logger("backend.vllm")

#: tokens per engine step on the CPU platform (vLLM's own default elsewhere): with the grouped LoRA ops a prefill
#: token costs ~1/4 of a decode token, so the re-read of every prefix after an adapter swap goes fastest in large
#: steps (bench/generation.py: 256 -> 1024 took a swap every 64 steps from 0.42 to 0.74-0.79 of one call; 2048 gave
#: no more); the rollouts keep the step that makes the new version's first token short (SWAP_FIRST_STEP_TOKENS)
CPU_STEP_TOKENS = 1024

#: vLLM's worker_extension_cls on the CPU platform: LoRA as one GEMM per adapter in a step (vllm_lora_cpu)
GROUPED_LORA_EXTENSION = "loraflow.rollout_worker.backends.vllm_lora_cpu.WorkerExtension"

#: LoRA ranks vLLM accepts for max_lora_rank
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def logprobs_plan(sampling: Sampling) -> tuple[str, int]:
    """(vLLM logprobs_mode, SamplingParams.logprobs) that yield loraflow.common.logprobs' definition."""
    if sampling.temperature == 1.0:
        return "raw_logprobs", 0
    if sampling.top_p == 1.0:
        return "processed_logprobs", 0
    return "raw_logprobs", -1


def rescale_logprob(raw_logprobs: Sequence[float], index: int, temperature: float) -> float:
    """log_softmax(raw / temperature)[index] from a full raw log-softmax vector (shift-invariant)."""
    scaled = [x / temperature for x in raw_logprobs]
    top = max(scaled)
    return scaled[index] - (top + math.log(sum(math.exp(x - top) for x in scaled)))


@functools.cache
def private_rpc_dir() -> str | None:
    """Point vLLM's ZeroMQ socket files (``VLLM_RPC_BASE_PATH``: a few ``ipc://`` paths per engine) at a directory
    of this process, removed at exit; returns it (None: the user set the variable, which is kept). By default vLLM
    puts them loose into the temp directory, and a process that ends without closing its sockets (the worker's
    ``os._exit``, a kill) leaves them there: a few files per worker start, thousands on a machine that restarts
    workers. The atexit handler also runs on the worker's ``os._exit`` path (``end_process``); a SIGKILL leaves the
    directory (one per kill, not a few files per start). Once per process: vLLM may cache its environment after
    the first engine starts."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        return None
    path = tempfile.mkdtemp(prefix="loraflow-vllm-")
    os.environ["VLLM_RPC_BASE_PATH"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # after vLLM's own exit handlers (registered later)
    return path


def lora_rank_cap(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of ``rank``."""
    for cap in VLLM_LORA_RANKS:
        if cap >= rank:
            return cap
    raise ValueError(f"learner.lora_rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


class VllmBackend(TokenizerMixin, Backend):
    name = "vllm"
    streaming = True

    def __init__(self, model_dir: str | Path, *, sampling: Sampling, max_loras: int, max_lora_rank: int,
                 dtype: str = "float32", max_model_len: int = 512, max_num_seqs: int = 64,
                 kv_cache_gib: float = 1.0, gpu_memory_utilization: float = 0.85, enforce_eager: bool = True,
                 seed: int = 0, chat_template_kwargs: Mapping[str, Any] | None = None,
                 stop_token_ids: Sequence[int] = (), max_num_batched_tokens: int | None = None,
                 grouped_lora_ops: bool = True, async_scheduling: bool | None = None) -> None:
        super().__init__(sampling)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_gib))))
        private_rpc_dir()
        from vllm import LLM, SamplingParams

        self._sampling_params_cls = SamplingParams
        self.logprobs_mode, self._num_logprobs = logprobs_plan(sampling)
        if self._num_logprobs == -1:
            log.warning("vllm_full_vocab_logprobs", temperature=sampling.temperature, top_p=sampling.top_p,
                        hint="temperature != 1 with top_p < 1 rescoring needs full-vocabulary log-probs (slow)")
        self.max_lora_rank = lora_rank_cap(max_lora_rank)
        from vllm.platforms import current_platform

        extra: dict[str, Any] = {}
        if current_platform.is_cpu():
            if max_num_batched_tokens is None:
                max_num_batched_tokens = max(CPU_STEP_TOKENS, 2 * max_num_seqs)
            if grouped_lora_ops:  # imported by vLLM in its worker process (see vllm_lora_cpu)
                extra["worker_extension_cls"] = GROUPED_LORA_EXTENSION
        if max_num_batched_tokens:
            extra["max_num_batched_tokens"] = max_num_batched_tokens
        if async_scheduling is not None:  # None: vLLM's choice (on where the executor supports it)
            extra["async_scheduling"] = async_scheduling
        self.llm = LLM(model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, enable_lora=True,
                       max_lora_rank=self.max_lora_rank, max_loras=max_loras, max_cpu_loras=max_loras + 2,
                       max_model_len=max_model_len, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
                       gpu_memory_utilization=gpu_memory_utilization, seed=seed, logprobs_mode=self.logprobs_mode,
                       **extra)
        self.grouped_lora_ops = "worker_extension_cls" in extra and all(
            self.llm.collective_rpc("loraflow_grouped_lora_ops"))
        self.tokenizer = self.llm.get_tokenizer()
        self.engine_dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        config = self.llm.llm_engine.model_config.hf_config
        self.vocab_size = int(config.vocab_size)
        self._init_tokens(self.tokenizer, model_dir, chat_template_kwargs=chat_template_kwargs or {},
                          stop_token_ids=stop_token_ids, vocab_size=self.vocab_size)
        self._stop_token_ids = list(self.eos_token_ids)
        self._requests: dict[int, Any] = {}  # resident version -> LoRARequest
        self._loads: dict[int, ServedAdapter] = {}  # LoRA int id -> what that load put in the engine
        self._params: dict[tuple[int, bool, bool], Any] = {}
        self._removals: list[Any] = []  # remove_lora calls sent to the engine core, results not seen yet

    # -- adapters ----------------------------------------------------------------------------------------------

    def _load(self, adapter: ReceivedAdapter) -> ServedAdapter:
        from vllm.lora.request import LoRARequest

        rank = int(adapter.config.get("r", 0))
        if rank > self.max_lora_rank:
            raise ValueError(f"adapter v{adapter.version} has rank {rank} > the engine's max_lora_rank "
                             f"{self.max_lora_rank}; set learner.lora_rank consistently for every role")
        lora_id = self.new_lora_id()  # vLLM caches weights by int id: a fresh one for every load
        request = LoRARequest(lora_name=f"v{adapter.version}-id{lora_id}", lora_int_id=lora_id,
                              lora_path=str(adapter.path))
        added, listed = self._engine_calls(("add_lora", request), ("list_loras",))
        if not added or lora_id not in listed:
            raise ValueError(f"vLLM refused adapter v{adapter.version} from {adapter.path}")
        try:
            sha256 = tensors_sha256(Path(request.lora_path) / WEIGHTS_FILE)
        except ValueError:
            self.llm.llm_engine.remove_lora(lora_id)
            raise
        self._requests[adapter.version] = request
        loaded = ServedAdapter(version=adapter.version, adapter=request.lora_name, lora_id=lora_id, sha256=sha256,
                               dtype=self.engine_dtype)
        self._loads[lora_id] = loaded
        log.debug("adapter_loaded", version=adapter.version, lora_id=lora_id)
        return loaded

    def _unload(self, version: int) -> None:
        request = self._requests.pop(version)
        self._loads.pop(request.lora_int_id, None)
        self._removals += self._engine_calls(("remove_lora", request.lora_int_id), wait=False)

    def _engine_calls(self, *calls: tuple[Any, ...], wait: bool = True) -> list[Any]:
        """Call engine-core utility methods (``(name, *args)``) back to back: the core runs each between two of
        its steps, so calls sent together wait for the steps in flight once, not once each. ``wait=False``
        returns the futures (the core runs the calls in order, before any request sent after them)."""
        self._check_removals()
        core = self.llm.llm_engine.engine_core
        send = getattr(core, "_send_input", None)
        results = getattr(core, "utility_results", None)
        if send is None or not isinstance(results, dict):  # an in-process core: a plain call is a direct call
            done = [getattr(self.llm.llm_engine, name)(*args) for name, *args in calls]
            return done if wait else []
        import uuid
        from concurrent.futures import Future

        from vllm.v1.engine import EngineCoreRequestType

        futures: list[Future[Any]] = []
        for name, *args in calls:  # what SyncMPClient.call_utility does, without waiting in between
            call_id = uuid.uuid1().int >> 64
            futures.append(Future())
            results[call_id] = futures[-1]
            send(EngineCoreRequestType.UTILITY, (0, call_id, name, tuple(args)))
        return [f.result() for f in futures] if wait else futures

    def _check_removals(self) -> None:
        """Log adapter removals the engine refused (they were sent without waiting)."""
        pending = []
        for future in self._removals:
            if not future.done():
                pending.append(future)
            elif future.exception() is not None or not future.result():
                log.warning("vllm_remove_lora_failed", error=str(future.exception() or "returned False"))
        self._removals = pending

    def _engine_report(self, version: int, lora_request: Any) -> ServedAdapter:
        """What a RequestOutput says served a request of ``version``: the load its lora_request names, or none."""
        if lora_request is None:
            return ServedAdapter(version=version, dtype=self.engine_dtype)
        loaded = self._loads.get(lora_request.lora_int_id)
        if loaded is None or loaded.adapter != lora_request.lora_name:
            return ServedAdapter(version=version, adapter=str(lora_request.lora_name)[:128],
                                 lora_id=int(lora_request.lora_int_id), dtype=self.engine_dtype)
        return ServedAdapter(version=version, adapter=loaded.adapter, lora_id=loaded.lora_id, sha256=loaded.sha256,
                             dtype=self.engine_dtype)

    # -- generation --------------------------------------------------------------------------------------------

    def _params_for(self, max_tokens: int, greedy: bool, stream: bool = False) -> Any:
        key = (max_tokens, greedy, stream, self.sampling)  # a shared engine's runs sample each their own way
        if key not in self._params:
            from vllm.sampling_params import RequestOutputKind

            kind = {"output_kind": RequestOutputKind.DELTA} if stream else {}
            if greedy:
                params = self._sampling_params_cls(temperature=0.0, max_tokens=max_tokens, logprobs=0,
                                                   detokenize=False, stop_token_ids=self._stop_token_ids, **kind)
            else:
                params = self._sampling_params_cls(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                                   top_k=0, max_tokens=max_tokens, logprobs=self._num_logprobs,
                                                   detokenize=False, stop_token_ids=self._stop_token_ids, **kind)
            self._params[key] = params
        return self._params[key]

    def sampling_problem(self, sampling: Sampling) -> str:
        if logprobs_plan(sampling) == (self.logprobs_mode, self._num_logprobs):
            return ""
        return (f"temperature {sampling.temperature:g} / top_p {sampling.top_p:g} need vLLM logprobs_mode "
                f"{logprobs_plan(sampling)[0]}; this engine runs {self.logprobs_mode} (the pool's worker.temperature "
                f"{self.sampling.temperature:g} / top_p {self.sampling.top_p:g}), so its log-probs would not be the "
                "behaviour log-probs")

    def _logprobs(self, ids: Sequence[int], entries: Sequence[Any], greedy: bool) -> list[float]:
        """The behaviour log-probs of the sampled ``ids`` from vLLM's per-token logprob entries."""
        if greedy or self._num_logprobs != -1:
            return [float(entry[token].logprob) for token, entry in zip(ids, entries, strict=True)]
        return [rescale_logprob([entry[i].logprob for i in range(self.vocab_size)], token, self.sampling.temperature)
                for token, entry in zip(ids, entries, strict=True)]

    def _generate(self, requests: Sequence[GenRequest], greedy: bool) -> list[GenOutput]:
        if self._streams:
            raise RuntimeError(f"generate() while {len(self._streams)} requests stream through the engine")
        prompts = [{"prompt_token_ids": list(r.token_ids)} for r in requests]
        params = [self._params_for(r.max_tokens, greedy) for r in requests]
        loras = [self._requests[r.version] if r.version else None for r in requests]
        results = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        outputs = []
        for request, result in zip(requests, results, strict=True):
            completion = result.outputs[0]
            ids = list(completion.token_ids)
            finished = completion.finish_reason == "stop"  # an end-of-turn id (no stop strings are passed)
            outputs.append(GenOutput(token_ids=ids, logprobs=self._logprobs(ids, completion.logprobs, greedy),
                                     finished=finished,
                                     served=self._engine_report(request.version, result.lora_request)))
        return outputs

    # -- streaming: the engine's request API (LLMEngine.add_request / step / abort_request) --------------------

    def _submit(self, request_id: str, request: GenRequest, greedy: bool) -> None:
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(request.token_ids)},
                                        self._params_for(request.max_tokens, greedy, stream=True),
                                        lora_request=self._requests[request.version] if request.version else None)

    def _abort(self, request_ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(request_ids)

    def _advance(self) -> list[GenDelta]:
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():  # step() would wait for ever
            raise RuntimeError(f"{len(self._streams)} requests streaming, but the engine holds none")
        deltas = []
        for result in engine.step():  # blocks until the engine core sends its next step's outputs
            held = self._streams.get(result.request_id)
            if held is None:
                continue  # aborted after the engine had sent it
            request, greedy = held
            completion = result.outputs[0]
            ids = list(completion.token_ids)
            deltas.append(GenDelta(request_id=result.request_id, token_ids=ids,
                                   logprobs=self._logprobs(ids, completion.logprobs or [], greedy),
                                   done=result.finished, finished=completion.finish_reason == "stop",
                                   served=self._engine_report(request.version, result.lora_request)))
        return deltas

    def close(self) -> None:
        self.abort_all()
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(engine, "engine_core", None)
        if shutdown is not None and hasattr(shutdown, "shutdown"):
            shutdown.shutdown()
