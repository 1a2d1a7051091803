"""The start-up checks of every role, run by ``loraflow run`` before it starts anything and by ``loraflow config``.

Each role checks its own settings when it starts (:mod:`loraflow.common.startup`, :mod:`loraflow.rollout_worker.startup`, the
broker's and the learner's ``main``); a failure is a :class:`loraflow.common.config.ConfigError`, one line and exit code
2. Running the same checks here means that ``loraflow run`` refuses a config that cannot work at once, before it
creates a run directory, builds a model or starts a process (a worker's wrong ``worker.reward`` used to be found
by each worker after the broker connection and the model load, then again after every restart), and that
``loraflow config`` answers "would this start?" for a file. ``builtin:demo`` is not looked up: ``loraflow run``
builds it, and ``loraflow config`` describes the config as written.

Key files (``security.enabled``) are checked for the roles that will run here: under ``loraflow run`` every one
(the broker's pair and authorised keys, the learner's and the workers' pairs, and the observer pair its progress
line uses), and, the broker's keys dir being the clients' too, that the learner's and the workers' keys are
authorised for those roles. ``loraflow config`` does not know which roles a machine runs (a worker machine holds no broker
secret), so it checks none; each role checks its own when it starts.

User code is imported the way the children will import it: ``loraflow run`` starts them with ``python -m``
in the current directory, which puts that directory first on their module path.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from loraflow.common.config import Config, ConfigError
from loraflow.common.security import authorized_keys, check_keys
from loraflow.common.startup import check_device, check_port_free, check_run_dir, check_task, resolve_model
from loraflow.deploy import devices
from loraflow.rollout_worker.startup import check_user_code

#: the roles ``loraflow run`` starts on this machine, by the key pair each uses (the observer: its progress line)
RUN_ROLES = ("broker", "learner", "worker", "observer")


@contextlib.contextmanager
def children_module_path() -> Iterator[None]:
    """The current directory first on ``sys.path`` for the duration, as in a ``python -m`` child."""
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        sys.path.remove(cwd)  # the first occurrence: the one inserted above


def check(config: Config, *, starting: bool = False) -> None:
    """Every role's start-up checks that do not depend on a running process; raises ConfigError.

    ``starting``: ``loraflow run`` is about to start every role on this machine, so every role's key files must
    be here, the metrics ports must be free and distinct (worker i serves ``worker.metrics_port + i - 1``), and
    every process's GPUs must be there to give (:mod:`loraflow.deploy.devices`)."""
    with children_module_path():
        check_user_code(config.worker)
    resolve_model(config, demo_by_caller=True)  # the learner loads the model whatever the workers' backend
    check_device("learner.device", config.learner.device, probe_cuda=starting)  # the launcher imports torch anyway
    if config.worker.backend != "sim":
        check_device("worker.device", config.worker.device)
    check_run_dir(config)
    check_task(config)
    if not starting:
        return
    for role in RUN_ROLES:
        check_keys(config, role)
    check_roles_authorised(config)
    for setting, port in devices.check_ports(config):  # worker i: worker.metrics_port + i - 1, none shared
        check_port_free(setting, port)
    devices.placement(config)  # every process's GPUs can be given (deploy/devices.py)


def check_roles_authorised(config: Config) -> None:
    """Under ``loraflow run`` the broker's keys dir is the clients' too, so it can tell whether the learner's and the
    workers' keys are authorised for their roles (the broker refuses a hello by another role's key as
    ``forbidden``: the learner would crash and restart until max_restarts). One ``security.client_key`` for every
    client cannot be: a key is authorised for one role."""
    if not config.security.enabled:
        return
    keys_dir = config.security.keys_dir
    authorised = authorized_keys(keys_dir)
    for role in ("learner", "worker"):
        name = config.security.client_key or role
        if name in authorised[role]:
            continue
        other = next((r for r, names in authorised.items() if name in names), "")
        why = f"it is authorised as a {other}" if other else f"no {keys_dir}/authorized/{role}/{name}.key"
        if config.security.client_key:
            raise ConfigError(f"security.client_key = {name!r}: under `loraflow run` every client process uses that "
                              f"key, but the broker would refuse the {role}'s ({why}); leave security.client_key "
                              f"unset under `loraflow run`, so that each role uses the pair named after it "
                              f"(`loraflow keys {keys_dir} --worker worker --learner learner` makes them)")
        raise ConfigError(f"the {role} key pair {name!r} in security.keys_dir = {keys_dir!r} is not authorised as a "
                          f"{role} ({why}); authorise it with `loraflow keys {keys_dir} --{role} {name}`")
