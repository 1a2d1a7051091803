"""Where each process of ``loraflow run`` runs on this machine: its GPUs, its metrics port, and the evaluation's GPU.

:func:`plan` is a pure function of the config and the devices the launcher sees, so the policy is tested with
fake device lists (``tests/deploy/test_devices.py``); :func:`placement` feeds it this machine's devices.

GPUs
    The devices split are the ones the launcher sees: an inherited ``CUDA_VISIBLE_DEVICES`` (Slurm, a container,
    an operator) lists them by index or UUID, in its order (:func:`visible_devices`); without one, every GPU
    torch counts. A role is on GPUs when its device setting is ``cuda`` (or ``cuda:0``), or ``auto`` and any GPU
    is visible; the ``sim`` backend never is. With R learner ranks and W workers on GPUs:

    1. the learner's ranks take the first R devices, one each (NCCL allows one rank per GPU); fewer than R
       visible devices is refused, naming ``launch.learner_ranks``;
    2. the workers take one device each from the rest, in order;
    3. fewer devices left than workers: with ``launch.share_gpus`` (the default) the workers are dealt
       round-robin over the devices left (over every device, the learner's too, when the learner takes them
       all: one GPU runs the whole demo); vLLM workers sharing a GPU must fit together
       (k x ``worker.vllm.gpu_memory_utilization`` <= 1, since each engine reserves that share of the whole GPU
       when it starts). With ``launch.share_gpus = false``, refused, naming the settings that fix it;
    4. a process not on GPUs (the broker, a CPU or sim role) gets ``CUDA_VISIBLE_DEVICES=""`` when the machine
       has GPUs, so it never creates a context on GPU 0 by accident; on a machine without GPUs nothing is set.

    Each process sees only its own devices, numbered from 0 (so each learner rank takes ``cuda:LOCAL_RANK``).
    A ``cuda:N`` with N >= 1 would name a device the process cannot see, and is refused here: choose the GPUs
    with ``CUDA_VISIBLE_DEVICES`` instead.

Held-out evaluation (``eval.device``)
    It runs in the launcher and must not land on a vLLM worker's GPU: vLLM sizes its KV cache from the memory
    free when it profiles (at start, and again after every restart), so a second copy of the model there shrinks
    the cache or fails the engine's start. ``auto`` takes the first device no process was given, else the first
    device the learner or an hf worker uses that no vLLM worker uses, else the CPU; ``cpu``; or a device id from
    the visible list (that device, whoever uses it: the operator's choice). On a GPU the model is loaded in bf16
    (``deploy/evaluate.py``); it is released after each measurement.

Metrics ports
    Worker i (1-based) serves ``worker.metrics_port + i - 1`` (0 = none): several workers on one machine never
    share a port. The broker's and the learner's ports must lie outside that range (:func:`metrics_ports` lists
    every port of the run, :func:`check_ports` refuses a collision).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loraflow.common.config import Config, ConfigError

#: an entry CUDA accepts in CUDA_VISIBLE_DEVICES: an index, or a GPU / MIG UUID; anything else ends the list
CUDA_ID = re.compile(r"\d+|(GPU|MIG)-[\w.:/-]+")


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """The GPUs of every process of one ``loraflow run`` (device ids as in the visible list)."""

    visible: tuple[str, ...] = ()
    learner: tuple[str, ...] = ()  # one per rank; empty: the learner runs on the CPU
    workers: tuple[tuple[str, ...], ...] = ()  # worker i's devices at [i - 1]; empty: on the CPU
    eval_device: str = "cpu"  # torch's name in the launcher: cpu or cuda:K (K = the device's place in visible)

    def devices(self, process: str) -> tuple[str, ...]:
        if process == "learner":
            return self.learner
        if process.startswith("worker-"):
            index = int(process.removeprefix("worker-"))
            return self.workers[index - 1] if index <= len(self.workers) else ()
        return ()

    def describe(self) -> str:
        """One line for the launcher's terminal: which GPUs each process got, and where the evaluation runs."""
        names = ["learner", *(f"worker-{i}" for i in range(1, len(self.workers) + 1))]
        parts = [f"{name} {','.join(self.devices(name)) or 'cpu'}" for name in names]
        where = self.eval_device
        if where != "cpu":
            where = f"GPU {self.visible[int(where.partition(':')[2])]}"
        return f"GPUs ({', '.join(self.visible)}): {'; '.join(parts)}; evaluation {where}"

    def env(self, process: str) -> dict[str, str]:
        """The environment ``process`` (broker, learner, worker-i) starts with: nothing on a machine without GPUs."""
        if not self.visible:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.devices(process))}


def visible_devices(cuda_visible_devices: str | None, count: int) -> tuple[str, ...]:
    """The GPUs this process sees: ``CUDA_VISIBLE_DEVICES``'s entries (read as CUDA reads them: an entry that is
    not an index or UUID ends the list) or, without it, ``0 .. count-1``; at most ``count`` (what torch counts)."""
    if cuda_visible_devices is None:
        return tuple(str(i) for i in range(count))
    entries: list[str] = []
    for entry in cuda_visible_devices.split(","):
        if not CUDA_ID.fullmatch(entry.strip()):
            break
        entries.append(entry.strip())
    return tuple(entries[:count])


def on_gpu(device: str, num_visible: int) -> bool:
    return device.startswith("cuda") or (device == "auto" and num_visible > 0)


def plan(config: Config, visible: Sequence[str]) -> Placement:
    """Every process's GPUs and the evaluation's device under the policy above; raises ConfigError."""
    visible = tuple(visible)
    launch, worker, learner = config.launch, config.worker, config.learner
    where = f"{len(visible)} GPU(s) visible ({', '.join(visible) or 'none'})"
    workers_on_gpu = launch.num_workers > 0 and worker.backend != "sim" and on_gpu(worker.device, len(visible))
    learner_on_gpu = on_gpu(learner.device, len(visible))
    for setting, device, used in (("learner.device", learner.device, learner_on_gpu),
                                  ("worker.device", worker.device, workers_on_gpu)):
        if used and not visible:
            raise ConfigError(f"{setting} = {device!r} but no GPU is visible here; use auto or cpu")
        if used and device.partition(":")[2] not in ("", "0"):
            raise ConfigError(f"{setting} = {device!r}: under loraflow run each process sees only the GPUs it is "
                              f"given, as cuda:0..; set {setting} = \"cuda\" and choose the GPUs with "
                              "CUDA_VISIBLE_DEVICES")
    num_ranks = launch.learner_ranks if learner_on_gpu else 0
    if num_ranks > len(visible):
        raise ConfigError(f"launch.learner_ranks = {num_ranks} needs one GPU per rank, {where}: lower "
                          "launch.learner_ranks, make more GPUs visible (CUDA_VISIBLE_DEVICES), or set "
                          "learner.device = \"cpu\"")
    learner_ids, rest = visible[:num_ranks], visible[num_ranks:]
    num_gpu_workers = launch.num_workers if workers_on_gpu else 0
    if num_gpu_workers <= len(rest):
        pool = rest
    elif launch.share_gpus:
        pool = rest or visible
    else:
        raise ConfigError(f"launch.num_workers = {num_gpu_workers} GPU workers and {num_ranks} learner rank(s) need "
                          f"{num_gpu_workers + num_ranks} GPUs, {where}: lower launch.num_workers, make more GPUs "
                          "visible, or set launch.share_gpus = true (workers then share GPUs; lower "
                          "worker.vllm.gpu_memory_utilization so they fit)")
    worker_ids = tuple((pool[i % len(pool)],) for i in range(num_gpu_workers))
    if worker.backend == "vllm":
        check_vllm_sharing(config, worker_ids, learner_ids)
    vllm_ids = {d for ids in worker_ids for d in ids} if worker.backend == "vllm" else set()
    return Placement(visible=visible, learner=learner_ids,
                     workers=worker_ids + ((),) * (launch.num_workers - num_gpu_workers),
                     eval_device=eval_device(config.eval.device, visible, learner_ids, worker_ids, vllm_ids))


def check_vllm_sharing(config: Config, worker_ids: Sequence[tuple[str, ...]], learner_ids: Sequence[str]) -> None:
    """vLLM workers dealt onto one GPU must fit: each engine reserves gpu_memory_utilization of the whole GPU."""
    share = config.worker.vllm.gpu_memory_utilization
    for device, count in Counter(d for ids in worker_ids for d in ids).items():
        if count * share > 1.0:
            with_learner = " and the learner" if device in learner_ids else ""
            raise ConfigError(f"worker.vllm.gpu_memory_utilization = {share} with {count} vLLM workers{with_learner} "
                              f"on GPU {device} (launch.share_gpus): together they would reserve "
                              f"{count * share:.0%} of it; set worker.vllm.gpu_memory_utilization <= "
                              f"{int(90 / count) / 100} (less when the learner shares the GPU), or lower "
                              "launch.num_workers")


def eval_device(setting: str, visible: Sequence[str], learner_ids: Sequence[str],
                worker_ids: Sequence[tuple[str, ...]], vllm_ids: set[str]) -> str:
    """torch's device name, in the launcher, for the held-out evaluation (``eval.device``, see above)."""
    if setting == "cpu" or (setting == "auto" and not visible):
        return "cpu"
    if setting != "auto":
        if setting not in visible:
            raise ConfigError(f"eval.device = {setting!r} is not one of the GPUs loraflow run sees "
                              f"({', '.join(visible) or 'none'}): use auto, cpu or one of those ids")
        return f"cuda:{visible.index(setting)}"
    given = [*learner_ids, *(d for ids in worker_ids for d in ids)]
    candidates = [d for d in visible if d not in given] + given
    chosen = next((d for d in candidates if d not in vllm_ids), None)
    return "cpu" if chosen is None else f"cuda:{visible.index(chosen)}"


def placement(config: Config, environ: Mapping[str, str] = os.environ) -> Placement:
    """:func:`plan` for this machine's GPUs (as many as torch counts)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return plan(config, visible_devices(environ.get("CUDA_VISIBLE_DEVICES"), count))


def worker_metrics_port(config: Config, index: int) -> int:
    """The metrics port of worker ``index`` (1-based) under ``loraflow run``; 0 = none."""
    base = config.worker.metrics_port
    return base + index - 1 if base else 0


def metrics_ports(config: Config) -> list[tuple[str, int]]:
    """(what sets it, port) for every metrics server ``loraflow run`` starts; worker ports past the first are
    named as their offset from ``worker.metrics_port``."""
    ports = [("broker.metrics_port", config.broker.metrics_port), ("learner.metrics_port", config.learner.metrics_port)]
    for i in range(1, config.launch.num_workers + 1):
        setting = "worker.metrics_port" if i == 1 else f"worker.metrics_port + {i - 1} (worker-{i})"
        ports.append((setting, worker_metrics_port(config, i)))
    return [(setting, port) for setting, port in ports if port]


def check_ports(config: Config) -> list[tuple[str, int]]:
    """:func:`metrics_ports`, refusing two processes on one port; raises ConfigError."""
    ports = metrics_ports(config)
    if ports and max(port for _, port in ports) > 65535:
        raise ConfigError(f"worker.metrics_port = {config.worker.metrics_port} with launch.num_workers = "
                          f"{config.launch.num_workers} runs past port 65535; lower worker.metrics_port")
    taken: dict[int, str] = {}
    for setting, port in ports:
        if port in taken:
            span = ""
            if config.launch.num_workers > 1 and config.worker.metrics_port:
                last = worker_metrics_port(config, config.launch.num_workers)
                span = (f" (loraflow run gives worker i worker.metrics_port + i - 1: "
                        f"{config.worker.metrics_port}..{last})")
            raise ConfigError(f"{setting} = {port} is {taken[port]} too{span}: processes on one machine need their "
                              "own ports; move one (0 = no metrics server)")
        taken[port] = setting
    return ports
