"""What a run submitted to a pool may set, where its files lie, and its config built from the pool's.

A pool is one broker (and the processes around it) on one base model; runs are submitted to it while it serves
(:mod:`loraflow.broker.pool` holds one broker core per run). A run's directory is ``<pool run_dir>/runs/<id>/``::

    submitted.toml   the run's own settings, as ``loraflow submit`` wrote them (a TOML table per section)
    config.toml      the run's resolved config: the pool's with submitted.toml on top (written by the broker)
    cancelled        present once ``loraflow cancel`` asked the run to stop (its text: why)
    refused          present when the pool refused the run (its text: why), e.g. a setting only the pool owns
    run_state.json   what loraflow pool made of it: running, stopping, finished, cancelled, failed (with why)
    workers/<id>/failed   a shared worker stopped serving the run for a config-class error (its text: why)
    learner/ended    the shared learner's end of the run (JSON: exit code, why, steps), for the pool to read
    owner            the CURVE key that submitted it over the network (``observer:<name>``); absent: the pool's
    broker/          the run's ledger state and run token; the learner's and workers' files as in any run dir

A run may set its task, data, learner (optimizer, LoRA rank and targets, loss), evaluation, sampling and reward
settings, its group size, max_staleness and budget (``run.num_steps``, ``run.max_duration_s``). What the
processes of the pool share is the pool's: the base model, the broker, security, the launcher, the generation
backend and the devices (:data:`POOL_KEYS`); a run that sets one is refused with the key named.
"""

from __future__ import annotations

import json
import os
import re
import time
import tomllib
from pathlib import Path
from typing import Any

from loraflow.common.config import Config, ConfigError, from_raw
from loraflow.common.schema import dump
from loraflow.common.tasks import BUILTIN_TASKS

RUN_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,47}")
#: sections, or section.key, that belong to the pool: every run on it has the pool's value
POOL_KEYS = (
    "model", "broker", "security", "launch", "worker.backend", "worker.device", "worker.num_threads",
    "worker.vllm", "worker.sim", "worker.pool", "worker.max_runs", "worker.id", "worker.adapter_dir",
    "worker.metrics_port", "learner.device", "learner.pool", "learner.num_threads", "learner.metrics_port",
    "learner.mixed_precision", "eval.device", "run.run_dir", "run.pool_run", "run.name", "run.log_format",
    "run.log_level", "run.connect_timeout_s",
)
SUBMITTED = "submitted.toml"
RESOLVED = "config.toml"
CANCELLED = "cancelled"
REFUSED = "refused"
OWNER = "owner"
RUN_STATE = "run_state.json"
WORKER_FAILED = "failed"
LEARNER_ENDED = "ended"
ENDED = ("finished", "cancelled", "failed")


def learner_ended(directory: Path) -> Path:
    """Where the shared learner says it ended a run (JSON: code, reason, steps); ``directory``: the run's."""
    return directory / "learner" / LEARNER_ENDED


def runs_dir(pool: Config) -> Path:
    """Where the pool's submitted runs lie."""
    return pool.run_dir / "runs"


def run_dir(pool: Config, run_id: str) -> Path:
    return runs_dir(pool) / run_id


def check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run id {run_id!r}: 1-48 characters of a-z, 0-9, '-' and '_', starting with a letter "
                          "or digit")
    return run_id


def pool_keys_in(settings: dict[str, Any]) -> list[str]:
    """The keys of a run's settings (a TOML mapping) that only the pool may set, as ``section.key``."""
    found = []
    for section, table in settings.items():
        if section in POOL_KEYS:
            found.append(section)
        elif isinstance(table, dict):
            found.extend(f"{section}.{key}" for key in table if f"{section}.{key}" in POOL_KEYS)
    return found


def run_config(pool: Config, run_id: str, settings: dict[str, Any]) -> Config:
    """The config of run ``run_id``: the pool's, with the run's settings on top, its name and directory set.
    Raises ConfigError naming the key for a setting only the pool owns, or one the config rules refuse."""
    check_run_id(run_id)
    owned = pool_keys_in(settings)
    if owned:
        raise ConfigError(f"run {run_id}: {', '.join(owned)} {'is' if len(owned) == 1 else 'are'} the pool's "
                          f"(every run on it shares {'it' if len(owned) == 1 else 'them'}); remove "
                          f"{'it' if len(owned) == 1 else 'them'} from the run's config")
    raw = dump(pool)
    for section, table in settings.items():
        if not isinstance(table, dict):
            raise ConfigError(f"run {run_id}: {section} must be a table of settings (e.g. [learner] lr = 3e-4)")
        raw.setdefault(section, {}).update(table)
    raw["run"].update(name=run_id, pool_run=run_id, run_dir=str(run_dir(pool, run_id)))
    raw["security"].update(run_token="", run_token_file="")  # each run's learner proves itself with its own token
    return from_raw(raw, f"run {run_id}: ")


def read_settings(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def read_state(directory: Path) -> dict[str, Any]:
    """A run's ``run_state.json`` ({} before the pool started it, or when it cannot be read)."""
    try:
        state = json.loads((directory / RUN_STATE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def write_state(directory: Path, state: str, reason: str = "") -> None:
    tmp = directory / f".{RUN_STATE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"state": state, "reason": reason, "time_unix": round(time.time(), 3)}) + "\n")
    os.replace(tmp, directory / RUN_STATE)


def running_runs(pool: Config) -> list[str]:
    """The runs loraflow pool is running now (accepted by the broker, started, not stopping or ended): the runs a
    shared worker serves."""
    try:
        directories = sorted(p for p in runs_dir(pool).iterdir() if p.is_dir())
    except FileNotFoundError:
        return []
    return [d.name for d in directories if read_state(d).get("state") == "running"
            and (d / RESOLVED).is_file() and not (d / CANCELLED).exists()]


def submit(pool: Config, settings: dict[str, Any], run_id: str = "", *, owner: str = "") -> str:
    """Write a run into the pool (``runs/<id>/submitted.toml``, and ``owner`` when a key submitted it); returns its
    id: ``run_id``, else the settings' ``run.name``, else run-N. Raises ConfigError, before anything is written,
    for an id in use or a setting the pool refuses."""
    run_table = settings.get("run") if isinstance(settings.get("run"), dict) else {}
    run_id = run_id or str(run_table.pop("name", "")) or _free_id(pool)
    directory = run_dir(pool, check_run_id(run_id))
    if directory.exists():
        raise ConfigError(f"run {run_id} exists in this pool already; choose another id")
    run_config(pool, run_id, settings)  # refuses here, before anything is written
    directory.mkdir(parents=True)
    if owner:
        (directory / OWNER).write_text(owner + "\n")
    tmp = directory / f".{SUBMITTED}.{os.getpid()}.tmp"
    tmp.write_text(settings_toml(settings))
    os.replace(tmp, directory / SUBMITTED)  # last: the broker takes a run once this file is there
    return run_id


USER_CODE_KEYS = ("reward", "rewards", "env", "agent")  # [worker] settings that name code the workers import


def check_tenant_code(pool: Config, settings: dict[str, Any]) -> None:
    """A network-submitted run may name code only from ``broker.tenant_code`` packages (its tenant does not own
    the pool's machines); raises ConfigError naming the setting."""
    worker = settings.get("worker") if isinstance(settings.get("worker"), dict) else {}
    allowed = pool.broker.tenant_code
    for key in USER_CODE_KEYS:
        values = worker.get(key, [])
        for value in values if isinstance(values, list) else [values]:
            package = str(value).split(":", 1)[0].split(".", 1)[0]
            if value and package not in allowed:
                raise ConfigError(f"worker.{key} = {value!r}: a run submitted over the network may name code of "
                                  f"{', '.join(allowed) or 'no package'} only (broker.tenant_code: it runs in the "
                                  "pool's workers)")


DATA_KEYS = (("run", "task"), ("data", "eval_path"))  # settings that name files the workers and learner read


def check_tenant_data(pool: Config, settings: dict[str, Any]) -> None:
    """A network-submitted run may read datasets only under ``broker.tenant_data`` directories (its tenant does
    not own the pool's files: a path is resolved, symlinks and '..' included, before it is compared); raises
    ConfigError naming the setting."""
    roots = [Path(root).expanduser().resolve() for root in pool.broker.tenant_data]
    for section, key in DATA_KEYS:
        table = settings.get(section) if isinstance(settings.get(section), dict) else {}
        value = table.get(key, "")
        if not value or (section, key) == ("run", "task") and value in BUILTIN_TASKS:
            continue
        path = Path(str(value)).expanduser().resolve()
        if not any(path.is_relative_to(root) for root in roots):
            where = ", ".join(map(str, roots)) if roots else "nowhere: the built-in tasks only"
            raise ConfigError(f"{section}.{key} = {value!r}: a run submitted over the network may read data under "
                              f"{where} (broker.tenant_data: the pool's files are not the tenant's)")


def cancel(pool: Config, run_id: str, reason: str) -> None:
    directory = run_dir(pool, check_run_id(run_id))
    if not (directory / SUBMITTED).is_file():
        raise ConfigError(f"the pool holds no run {run_id!r} (loraflow runs lists them)")
    (directory / CANCELLED).write_text(reason + "\n")


def owner_of(pool: Config, run_id: str) -> str:
    """The key that submitted the run ("" when the pool's side wrote it)."""
    try:
        return (run_dir(pool, run_id) / OWNER).read_text().strip()
    except OSError:
        return ""


def _free_id(pool: Config) -> str:
    n = 1
    while run_dir(pool, f"run-{n}").exists():
        n += 1
    return f"run-{n}"


def settings_toml(settings: dict[str, Any]) -> str:
    """TOML text of a run's settings: sections of keys, a key's table as its own [section.key]."""
    lines: list[str] = []

    def emit(table: dict[str, Any], name: str) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in table.items() if not isinstance(value, dict))
        for key, value in table.items():
            if isinstance(value, dict):
                emit(value, f"{name}.{key}")

    for section, table in settings.items():
        emit(table, section)
    return "\n".join(lines) + "\n"
