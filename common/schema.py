"""Typed records from untrusted mappings: the validator behind config files and the persisted broker state.

(Wire messages are ``msgspec`` Structs decoded and validated in C, :mod:`loraflow.common.wire`; config stays here
because its records carry a documentation, a unit and a range per field for the generated reference
(:func:`describe`), and its errors name TOML paths and reject unknown keys, so that typos are caught.)

A record is a ``@dataclass(slots=True, kw_only=True)`` whose fields are declared with :func:`rule`, which
records the field's documentation, unit and allowed range next to its type::

    @dataclass(slots=True, kw_only=True)
    class Hello:
        capacity: int = rule(1, ge=1, le=1024, doc="leases the worker can hold at once")

:func:`build` turns a mapping (a decoded msgpack header, a TOML table) into such a record. It checks every
field against its annotation and rule and raises :class:`SchemaError` naming the path of the first bad
value (``"hello.capacity: must be >= 1, got 0"``); unknown keys are rejected so that typos in config files
are caught. :func:`dump` goes the other way, to plain msgpack/TOML
friendly values.

Supported annotations: ``int``, ``float``, ``str``, ``bool``, ``bytes``, ``list[T]``, ``dict[str, Any]``,
``T | None``, unions of those (``str | list[str]``: the first that fits) and nested record classes. ``bool`` is never accepted for ``int``; ``int`` is accepted for
``float``. ``dict[str, V]`` (``V`` not ``Any``) checks every key (at most :data:`MAX_KEY_LEN` characters) and
value; a free-form value (``Any``, ``dict[str, Any]``) is walked without recursion and may nest at most
``max_depth`` levels (default :data:`MAX_DEPTH`, :func:`loraflow.common.wire.check_depth`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import MISSING
from functools import cache
from typing import Any, TypeVar

from loraflow.common.wire import MAX_DEPTH, MAX_KEY_LEN, check_depth

T = TypeVar("T")



class SchemaError(ValueError):
    """A mapping does not fit its record; the message names the field path and what is wrong."""


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """Constraints and documentation of one field (kept in the dataclass field's metadata)."""

    doc: str = ""
    unit: str = ""
    ge: float | None = None
    le: float | None = None
    gt: float | None = None
    max_len: int | None = None
    choices: tuple[Any, ...] | None = None
    finite: bool = True
    max_depth: int | None = None  # free-form values: levels of nesting allowed (None: MAX_DEPTH)


def rule(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    doc: str = "",
    unit: str = "",
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    max_len: int | None = None,
    choices: tuple[Any, ...] | None = None,
    finite: bool = True,
    max_depth: int | None = None,
) -> Any:
    """A dataclass field carrying a :class:`Rule`; without a default the field is required."""
    meta = {"rule": Rule(doc, unit, ge, le, gt, max_len, choices, finite, max_depth)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def rule_of(field: dataclasses.Field) -> Rule:
    return field.metadata.get("rule", _NO_RULE)


_NO_RULE = Rule()


@cache
def _fields(cls: type) -> tuple[tuple[str, Any, Rule, bool], ...]:
    """(name, resolved annotation, rule, required) per field, cached per class."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is MISSING and f.default_factory is MISSING
        out.append((f.name, hints[f.name], rule_of(f), required))
    return tuple(out)


@cache
def _known(cls: type) -> frozenset[str]:
    return frozenset(name for name, *_ in _fields(cls))


def build(cls: type[T], mapping: Any, path: str) -> T:
    """Validate ``mapping`` against record class ``cls`` and return the record; raises SchemaError."""
    if not isinstance(mapping, dict):
        raise SchemaError(f"{path}: expected a table/map, got {type(mapping).__name__}")
    fields = _fields(cls)
    known = _known(cls)
    unknown = [k for k in mapping if k not in known]
    if unknown:
        raise SchemaError(f"{path}: unknown field(s) {sorted(map(str, unknown))}; known: {sorted(known)}")
    kwargs = {}
    for name, annotation, rule_, required in fields:
        if name in mapping:
            kwargs[name] = check_value(mapping[name], annotation, rule_, f"{path}.{name}")
        elif required:
            raise SchemaError(f"{path}.{name}: required field is missing")
    return cls(**kwargs)


def check_value(value: Any, annotation: Any, rule_: Rule, path: str) -> Any:
    """Check one value against its annotation and rule; returns it (nested records built)."""
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(annotation)
        if value is None:
            if type(None) in options:
                return None
            raise SchemaError(f"{path}: must not be empty (null)")
        inner = [a for a in options if a is not type(None)]
        if len(inner) == 1:
            return check_value(value, inner[0], rule_, path)
        errors = []
        for option in inner:  # ``str | list[str]``: the first option the value fits
            try:
                return check_value(value, option, rule_, path)
            except SchemaError as exc:
                errors.append(exc)
        fitting = [e for e in errors if str(e).startswith(f"{path}: ") and not str(e).startswith(f"{path}: expected ")]
        if fitting:  # the value has the right type for an option but breaks its rule (a NaN float): say that
            raise fitting[0]
        raise SchemaError(f"{path}: expected {' or '.join(map(_type_text, inner))}, got {_preview(value)}")
    if dataclasses.is_dataclass(annotation):
        return build(annotation, value, path)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list | tuple):
            raise SchemaError(f"{path}: expected a list, got {type(value).__name__}")
        _check_len(value, rule_, path)
        item_rule = dataclasses.replace(rule_, max_len=None)
        return [check_value(v, item_type, item_rule, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or annotation is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise SchemaError(f"{path}: expected a map with string keys, got {type(value).__name__}")
        _check_len(value, rule_, path)
        value_type = typing.get_args(annotation)[1] if typing.get_args(annotation) else Any
        if value_type is Any:
            _check_depth(value, rule_, path)
            return value
        item_rule = dataclasses.replace(rule_, max_len=None)
        out = {}
        for key, item in value.items():
            if len(key) > MAX_KEY_LEN:
                raise SchemaError(f"{path}: key {key[:MAX_KEY_LEN]!r}... is longer than {MAX_KEY_LEN} characters")
            out[key] = check_value(item, value_type, item_rule, f"{path}[{key!r}]")
        return out
    if annotation is Any:
        _check_depth(value, rule_, path)
        return value
    return _check_scalar(value, annotation, rule_, path)


def _check_depth(value: Any, rule_: Rule, path: str) -> None:
    """A free-form value nests at most ``rule_.max_depth`` (default MAX_DEPTH) levels (walked without recursion)."""
    problem = check_depth(value, MAX_DEPTH if rule_.max_depth is None else rule_.max_depth)
    if problem is not None:
        raise SchemaError(f"{path}: {problem}")


def _preview(value: Any) -> str:
    """``type value`` for an error message, short and safe for any decoded value (never a deep repr)."""
    if isinstance(value, str | bytes | int | float | bool) or value is None:
        return f"{type(value).__name__} {value!r:.40}"
    if isinstance(value, dict | list | tuple):
        return f"{type(value).__name__} of {len(value)} items"
    return type(value).__name__


def _check_scalar(value: Any, annotation: type, rule_: Rule, path: str) -> Any:
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaError(f"{path}: expected a number, got {_preview(value)}")
        value = float(value)
        if rule_.finite and not math.isfinite(value):
            raise SchemaError(f"{path}: must be a finite number, got {value}")
    elif annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{path}: expected an integer, got {_preview(value)}")
    elif annotation is bool:
        if not isinstance(value, bool):
            raise SchemaError(f"{path}: expected true/false, got {_preview(value)}")
    elif annotation is str:
        if not isinstance(value, str):
            raise SchemaError(f"{path}: expected a string, got {_preview(value)}")
        _check_len(value, rule_, path)
    elif annotation is bytes:
        if not isinstance(value, bytes | bytearray):
            raise SchemaError(f"{path}: expected bytes, got {type(value).__name__}")
        _check_len(value, rule_, path)
        value = bytes(value)
    else:  # pragma: no cover - a record declared an annotation this module does not support
        raise TypeError(f"{path}: unsupported annotation {annotation!r}")
    if rule_.choices is not None and value not in rule_.choices:
        raise SchemaError(f"{path}: must be one of {list(rule_.choices)}, got {_preview(value)}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if rule_.ge is not None and value < rule_.ge:
            raise SchemaError(f"{path}: must be >= {rule_.ge}, got {value}")
        if rule_.gt is not None and value <= rule_.gt:
            raise SchemaError(f"{path}: must be > {rule_.gt}, got {value}")
        if rule_.le is not None and value > rule_.le:
            raise SchemaError(f"{path}: must be <= {rule_.le}, got {value}")
    return value


def _check_len(value: Any, rule_: Rule, path: str) -> None:
    if rule_.max_len is not None and len(value) > rule_.max_len:
        raise SchemaError(f"{path}: at most {rule_.max_len} items/characters allowed, got {len(value)}")


_PLAIN_TYPES = frozenset({str, int, float, bool, bytes, type(None)})


@cache
def _record_field_names(cls: type) -> tuple[str, ...] | None:
    """Field names of a dataclass type, None for any other type (cached per type)."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


def dump(record: Any) -> Any:
    """A record (or nested values) as plain dicts/lists/scalars, dropping None fields."""
    kind = type(record)
    if kind in _PLAIN_TYPES:
        return record
    names = _record_field_names(kind)
    if names is not None:
        out = {}
        for name in names:
            value = getattr(record, name)
            if value is not None:
                out[name] = dump(value)
        return out
    if isinstance(record, list | tuple):
        return [dump(v) for v in record]
    if isinstance(record, dict):
        return {k: dump(v) for k, v in record.items()}
    return record


def describe(cls: type) -> list[tuple[str, str, Any, Rule]]:
    """(name, type text, default, rule) of each field, for generated config references."""
    rows = []
    for f in dataclasses.fields(cls):
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        rows.append((f.name, _type_text(typing.get_type_hints(cls)[f.name]), default, rule_of(f)))
    return rows


def _type_text(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")
