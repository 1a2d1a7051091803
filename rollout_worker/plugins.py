"""User code named in config as ``package.module:Name`` (environments, reward functions)."""

from __future__ import annotations

import importlib
from typing import Any


def load_object(spec: str, setting: str) -> Any:
    """The object ``spec`` names; a ValueError names ``setting`` and what is wrong."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{setting} = {spec!r}: expected package.module:Name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{setting} = {spec!r}: cannot import {module_name} ({exc}); is it on PYTHONPATH?") from None
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{setting} = {spec!r}: {module_name} has no attribute {attribute}") from None
    return obj
