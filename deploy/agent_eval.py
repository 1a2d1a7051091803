"""Held-out accuracy of an agent config: its own harness plays each eval prompt through a real gateway, greedily.

A multi-turn agent is measured the way it is trained, not by one greedy completion of the prompt
(:mod:`loraflow.deploy.evaluate`, which runs no tools). The first ``num_prompts`` prompts of the task's ``eval`` split
become leases of one episode each; ``worker.agent``'s ``run_episode`` plays them with a real ``openai`` client
against an in-process gateway: the same :class:`loraflow.rollout_worker.gateway.episodes.AgentRollouts`, engine and HTTP
server a worker runs, over the hf backend with the base model (plus the adapter) decoding greedily. The
accuracy is the share of episodes whose reward is >= 1; a harness that fails or times out
(``worker.agent_timeout_s``) scores 0, as in training.

At most ``MAX_EPISODES`` episodes are in flight, a new one started as each ends, so a slow tool call holds up
only its own episode; the calls of those in flight batch together in the engine. :func:`evaluate_agent` is the
only caller of the backend, on the calling thread (the worker loop's part: pump, generate a round, collect), with
torch's threads set as a worker's (``worker.num_threads``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loraflow.common.config import Config
from loraflow.common.protocol import PromptLease
from loraflow.common.task_base import TaskItem
from loraflow.common.tasks import load_task
from loraflow.deploy.evaluate import EvalResult

MAX_EPISODES = 64
IDLE_WAIT_S = 0.05


def greedy_backend(model_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None, *, device: str,
                   config: Config) -> Any:
    """The hf backend on ``model_dir`` (plus the adapter as version 1), every generation greedy."""
    from loraflow.rollout_worker.adapters import ReceivedAdapter
    from loraflow.rollout_worker.backends.base import Sampling
    from loraflow.rollout_worker.backends.hf import HfBackend, resolve_device

    class GreedyHfBackend(HfBackend):
        def _generate(self, requests: Any, greedy: bool) -> Any:
            return super()._generate(requests, True)

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    on_gpu = resolve_device(device).type == "cuda"
    backend = GreedyHfBackend(model_dir, sampling=Sampling(), device=device,
                              dtype="bfloat16" if on_gpu else "float32", seed=config.run.seed,
                              chat_template_kwargs=config.model.chat_template_kwargs,
                              stop_token_ids=config.worker.stop_token_ids)
    if adapter_dir is not None:
        path = Path(adapter_dir)
        if not (path / "adapter_config.json").is_file():
            raise ValueError(f"{adapter_dir} is not a PEFT adapter directory (no adapter_config.json)")
        backend.add_adapter(ReceivedAdapter(version=1, sha256=str(path), path=path, config={}, num_bytes=0,
                                            received_unix=time.time()))
    return backend


def eval_lease(index: int, item: TaskItem, config: Config) -> PromptLease:
    return PromptLease(lease_id=f"eval-{index}", group_id=str(index), prompt_index=index, epoch=0,
                       task=config.run.task[:128], group_size=1, deadline_s=config.worker.agent_timeout_s + 60.0,
                       **item.lease_fields())


def evaluate_agent(config: Config, adapter_dir: str | os.PathLike | None = None, *, num_prompts: int,
                   device: str = "auto") -> EvalResult:
    """Greedy accuracy of ``config.model.path`` (plus ``adapter_dir``) with ``config.worker.agent`` as the
    harness on the first ``num_prompts`` eval prompts (see the module docstring)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts} (eval.num_prompts)")
    start = time.perf_counter()
    task = load_task(config.run.task, config.run.seed, config.data)
    items = [task.item(i, "eval") for i in range(num_prompts)]
    with worker_threads(config):
        return _play(config, adapter_dir, items, device=device, start=start)


@contextlib.contextmanager
def worker_threads(config: Config) -> Iterator[None]:
    """torch's CPU threads as a worker sets them (``worker.num_threads``; 0 = torch's default), then back: OpenMP
    threads spinning beside the harness threads on a small machine starve the harness's calls past their timeout."""
    import torch

    threads = torch.get_num_threads()
    if config.worker.num_threads:
        torch.set_num_threads(config.worker.num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _play(config: Config, adapter_dir: str | os.PathLike | None, items: list[TaskItem], *, device: str,
          start: float) -> EvalResult:
    from loraflow.common.metrics import Metrics
    from loraflow.rollout_worker.gateway.episodes import AgentRollouts

    num_prompts = len(items)
    backend = greedy_backend(config.model.path, adapter_dir, device=device, config=config)
    wake = threading.Event()
    rollouts = AgentRollouts(config, backend, worker_id="eval", metrics=Metrics(), wake=wake)
    rewards: dict[int, float] = {}
    texts: dict[int, str] = {}
    waiting = deque(enumerate(items))
    try:
        while waiting or rollouts.num_groups:
            while waiting and rollouts.num_groups < MAX_EPISODES:
                rollouts.add(eval_lease(*waiting.popleft(), config))
            wake.clear()
            finished = rollouts.step() if rollouts.has_ready() else rollouts.poll()
            if not finished and not rollouts.has_ready():
                wake.wait(IDLE_WAIT_S)
            for done in finished:
                index = int(done.group.group_id)
                rewards[index] = done.group.rewards[0]
                texts[index] = backend.decode(dict(done.tensors)["completion_ids"].tolist())
    finally:
        rollouts.close()
        backend.close()
    correct = [rewards[i] >= 1.0 for i in range(num_prompts)]
    return EvalResult(accuracy=sum(correct) / num_prompts, num_prompts=num_prompts, num_correct=sum(correct),
                      seconds=time.perf_counter() - start, prompts=[str(item.prompt) for item in items],
                      completions=[texts[i] for i in range(num_prompts)], correct=correct)
