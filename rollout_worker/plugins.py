"""User code named in config as ``package.module:Name`` (environments, reward functions).

:func:`load_object` imports it; every failure is a :class:`loraflow.common.config.ConfigError` naming the setting, so a
worker refuses a wrong path at start-up (``loraflow.rollout_worker.startup``), before it connects or loads a model.
"""

from __future__ import annotations

import importlib
from typing import Any

from loraflow.common.config import ConfigError


def load_object(spec: str, setting: str) -> Any:
    """The object ``spec`` names; a ConfigError names ``setting`` and what is wrong."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{setting} = {spec!r}: expected package.module:Name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{setting} = {spec!r}: cannot import {module_name} ({exc}); is the directory "
                          "that holds it on PYTHONPATH?") from None
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{setting} = {spec!r}: {module_name} has no attribute {attribute}") from None
    return obj
