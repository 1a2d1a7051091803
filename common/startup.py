"""Start-up checks of settings every role shares, run before a process connects to the broker or loads a model.

A config-class failure (a setting that cannot work on this machine: restarting will not help) raises
:class:`loraflow.common.config.ConfigError` with one line naming the setting and the fix; :func:`loraflow.common.cli.run_main`
turns it into that line on stderr and exit code 2, which ``loraflow run``'s supervisor and the systemd units
never restart. The checks are cheap (no torch, no network, nothing created) so ``loraflow config`` and
``loraflow run`` run them too, before starting anything. Each role adds its own (``loraflow.rollout_worker.startup``
for the worker's reward and environment; the broker's bind address is checked where it binds).

- :func:`resolve_model`: ``model.path`` is a Hugging Face model directory, ``builtin:tiny`` (built on first use
  by the roles that load it), or ``builtin:demo``, which is pinned to the demo base prepared on this machine
  for ``run.seed`` (``python -m loraflow.deploy.demo_base --seed N`` or ``loraflow run`` prepares it; a role never
  trains it itself: that is minutes of CPU, which every worker and the learner would race to spend);
- :func:`check_writable`: a directory setting (``run.run_dir``, ...) can be created and written here;
- :func:`check_task`: ``run.task`` names a built-in task or a dataset that reads;
- :func:`check_device`: ``*.device`` is auto, cpu, cuda or cuda:N (and, for the learner, there);
- :func:`check_port_free`: a ``*.metrics_port`` is not taken (a Prometheus server binds it after connecting).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from pathlib import Path

from loraflow.common.config import Config, ConfigError
from loraflow.common.task_base import Task
from loraflow.common.tasks import load_task
from loraflow.common.tiny_model import find_demo_base

BUILTIN_MODELS = ("builtin:tiny", "builtin:demo", "builtin:agent-demo")
PREPARED_BY_CALLER = ("builtin:demo", "builtin:agent-demo")  # bases `loraflow run` builds (deploy/)
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def demo_base_command(config: Config) -> str:
    """The command that prepares ``builtin:demo`` for this config's seed and cache."""
    cache = f" --cache-dir {config.model.cache_dir}" if config.model.cache_dir else ""
    return f"python -m loraflow.deploy.demo_base --seed {config.run.seed}{cache}"


def resolve_model(config: Config, *, demo_by_caller: bool = False) -> Config:
    """The config with ``model.path`` checked, and ``builtin:demo`` replaced by its directory when it is built.

    ``demo_by_caller``: the caller prepares ``builtin:demo`` / ``builtin:agent-demo`` itself (``loraflow run``) or
    only describes the config (``loraflow config``): it is left as it is."""
    path = config.model.path
    if path == "builtin:tiny" or (path in PREPARED_BY_CALLER and demo_by_caller):
        return config
    if path == "builtin:agent-demo":
        raise ConfigError(f"model.path = \"builtin:agent-demo\" is prepared by `loraflow run`; for a role started by "
                          f"hand build it with `python -m loraflow.deploy.agent_base --seed {config.run.seed}` and set "
                          "model.path to the directory it prints")
    if path == "builtin:demo":
        directory = find_demo_base(config.run.seed, config.model.cache_dir or None)
        if directory is None:
            raise ConfigError(f"model.path = \"builtin:demo\": no demo base for run.seed {config.run.seed} is built "
                              f"on this machine; build it once with `{demo_base_command(config)}` (about 2 min; "
                              "`loraflow run` builds it too), or set model.path to a model directory")
        return dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(directory)))
    if path.startswith("builtin:"):
        raise ConfigError(f"model.path = {path!r}: unknown built-in model; use one of {', '.join(BUILTIN_MODELS)} "
                          "or a model directory")
    if not (Path(path) / "config.json").is_file():
        what = "does not exist" if not Path(path).exists() else "is not a Hugging Face model directory (no config.json)"
        raise ConfigError(f"model.path = {path!r} {what}; set model.path (or --model) to a local model directory "
                          f"with config.json, or to {' / '.join(BUILTIN_MODELS)}")
    return config


def check_writable(setting: str, directory: str | os.PathLike, value: str | os.PathLike | None = None) -> None:
    """``directory`` exists as a writable directory, or could be created (its nearest existing ancestor is one).

    ``value``: what the setting says, when ``directory`` is derived from it (the parent of a file setting)."""
    shown = str(directory if value is None else value)
    existing = Path(directory)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{setting} = {shown!r}: {existing} is not a directory, so nothing can be created under it; "
                          f"set {setting} to a path in a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{setting} = {shown!r}: {existing} is not writable by this user; set {setting} to a path "
                          "this user may write, or fix the directory's permissions")


def check_run_dir(config: Config) -> None:
    check_writable("run.run_dir", config.run_dir)


def check_task(config: Config) -> Task:
    """The task ``run.task`` names, read as ``[data]`` says (a dataset is read and checked row by row)."""
    return load_task(config.run.task, config.run.seed, config.data)


def check_device(setting: str, device: str, *, probe_cuda: bool = False) -> None:
    """``device`` is auto, cpu, cuda or cuda:N; with ``probe_cuda``, a cuda device must be visible here.

    Only the learner probes (it uses torch in this process anyway); a worker's vLLM engine may start processes
    that must not inherit an initialised CUDA driver, so the worker leaves that to its backend."""
    if not DEVICE.fullmatch(device):
        raise ConfigError(f"{setting} = {device!r}: must be auto, cpu, cuda or cuda:N")
    if not (probe_cuda and device.startswith("cuda")):
        return
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= visible:
        where = f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}" if "CUDA_VISIBLE_DEVICES" in os.environ \
            else "this machine"
        raise ConfigError(f"{setting} = {device!r}: {visible} CUDA device(s) visible ({where}); use auto or cpu, "
                          "or a device that is there")


def check_port_free(setting: str, port: int, host: str = "0.0.0.0") -> None:
    """Nothing holds ``port`` (0 = off, nothing to check), so a Prometheus server can bind it later."""
    if not port:
        return
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"{setting} = {port}: the port cannot be bound here ({exc.strerror}); another process "
                              f"may serve metrics there: set {setting} to a free port, or 0 for none") from None
