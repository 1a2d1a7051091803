"""What a rollout worker checks before it connects to the broker or loads a model.

Everything here is a config-class failure (:class:`loraflow.common.config.ConfigError`: one line, exit 2, never
restarted, see :func:`loraflow.common.cli.run_main`) found in a fraction of a second, where it used to surface only after
the connection and the model load, and then again at every restart:

- ``worker.reward``, ``worker.rewards`` and ``worker.env`` import and are a callable / an Environment;
- ``model.path`` (:func:`loraflow.common.startup.resolve_model`) and the form of ``worker.device`` (not for the
  ``sim`` backend, which loads no model);
- ``run.run_dir`` and ``worker.adapter_dir`` can be written, ``worker.metrics_port`` is free;
- the key files of ``security.client_key`` (:func:`loraflow.common.security.check_keys`).

``loraflow config`` and ``loraflow run`` call :func:`check_user_code` too, before they start anything.
"""

from __future__ import annotations

from loraflow.common.config import Config, WorkerConfig
from loraflow.common.security import check_keys
from loraflow.common.startup import (
    check_device,
    check_port_free,
    check_run_dir,
    check_writable,
    resolve_model,
)
from loraflow.rollout_worker.envs import check_env
from loraflow.rollout_worker.rewards import load_rewards


def check_user_code(worker: WorkerConfig) -> None:
    """``worker.reward`` and ``worker.env`` name code this process can import (nothing is instantiated)."""
    load_rewards(worker)
    if worker.env:
        check_env(worker.env)


def check(config: Config) -> Config:
    """The config a worker runs with (``builtin:demo`` pinned to its directory); raises ConfigError."""
    check_user_code(config.worker)
    if config.worker.backend != "sim":
        config = resolve_model(config)
        check_device("worker.device", config.worker.device)
    check_run_dir(config)
    check_keys(config, "worker")
    check_port_free("worker.metrics_port", config.worker.metrics_port)
    if config.worker.adapter_dir:
        check_writable("worker.adapter_dir", config.worker.adapter_dir)
    return config
