"""Decoding msgpack headers straight into the typed records of :mod:`loraflow.common.protocol`, in C (msgspec).

A record is a ``msgspec.Struct`` whose field annotations carry their bounds (``Annotated[int, Meta(ge=1)]``):
msgspec checks types, ranges, lengths and enum values while it decodes, so a valid header costs one C call and
no Python per field. What msgspec cannot say, this module adds:

- **Unknown fields** (sent by a newer client of the same protocol version) are ignored, and the decode says
  there were some, so the receiver can count them. Records forbid unknown fields, so the common case is one
  strict decode; only a header the strict decode refuses is decoded again with a *lenient twin* of the record
  type (the same fields, unknown ones ignored). If the twin accepts it, the only fault was unknown fields: the
  known ones are re-encoded and decoded strictly (the real record, its checks included). Otherwise the twin's
  error is the answer.
- **Free-form values** (``Any``: a lease's ``meta``, an adapter's ``adapter_config``) have no type to bound
  them: each record type names where it keeps them (``free_form``), and :func:`check_depth` walks those values
  (without recursion) after the decode: at most :data:`MAX_DEPTH` levels, string keys only. A value nested
  deeper than Python's recursion limit makes msgspec itself raise ``RecursionError``; the header is then read
  by msgpack (which does not recurse) only to name the field that was too deep.
- **Error text** a user can act on: ``"Hello.capacity: must be >= 1"`` rather than msgspec's
  ``"Expected `int` >= 1 - at `$.capacity`"`` (:func:`explain`).
"""

from __future__ import annotations

import functools
import operator
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any

import msgpack
import msgspec

from loraflow.common import framing

MAX_DEPTH = 32  # levels a free-form value may nest (a map inside a list inside a map is 3)
MAX_KEY_LEN = 64  # characters of each key of a map of numbers (Heartbeat.counters, RolloutGroup.metrics)
FLOAT_MAX = sys.float_info.max
#: a finite float: NaN and +-inf fail both bounds (msgspec has no "finite" constraint)
Finite = Annotated[float, msgspec.Meta(ge=-FLOAT_MAX, le=FLOAT_MAX)]
#: free-form values of a record, as (path, value) pairs
FreeForm = Callable[[Any], Iterable[tuple[str, Any]]]


class Record(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, repr_omit_defaults=True):
    """Base of every wire record (messages and their parts): keyword-only, unknown fields refused by the strict
    decode (and then ignored by the lenient twin, see above)."""


class WireError(ValueError):
    """A header that is not a valid record. ``framing``: the fault is the message's shape (not msgpack, not a
    map, its tensor specs), not one of its fields."""

    def __init__(self, message: str, *, framing: bool = False) -> None:
        super().__init__(message)
        self.framing = framing


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> str | None:
    """What is wrong with a free-form value (nested deeper than ``max_depth`` maps and lists, or a map key that
    is not a string), or None. Walked with a stack, never recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if not all(type(k) is str for k in item):
                return "map keys must be strings"
            children: Iterable[Any] = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > max_depth:
            return f"nested more than {max_depth} levels deep (maps and lists in one another); flatten it"
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list | tuple))
    return None


def _not_msgpack(exc: msgspec.DecodeError) -> WireError:
    return WireError(f"header is not valid msgpack: {exc}", framing=True)


class WireDecoder:
    """Decodes one message kind's header: ``decode(data) -> (record, had_unknown_fields)``; raises WireError."""

    def __init__(self, name: str, record_type: Any, free_form: FreeForm | None = None) -> None:
        self.name = name
        self.record_type = record_type
        self._strict = msgspec.msgpack.Decoder(record_type)
        self._lenient = msgspec.msgpack.Decoder(_twin_type(record_type))
        self._free_form = free_form

    def decode(self, data: Any) -> tuple[Any, bool]:
        try:
            record, unknown = self._strict.decode(data), False
        except msgspec.ValidationError:
            record, unknown = self._decode_lenient(data), True
        except msgspec.DecodeError as exc:
            raise _not_msgpack(exc) from None
        except RecursionError:
            raise WireError(self._too_deep(data)) from None
        if self._free_form is not None:
            for path, value in self._free_form(record):
                problem = check_depth(value)
                if problem is not None:
                    raise WireError(f"{self.name}.{path}: {problem}")
        return record, unknown

    def _decode_lenient(self, data: Any) -> Any:
        try:
            known = self._lenient.decode(data)
        except msgspec.ValidationError as exc:
            text = str(exc)
            root = _TYPE.fullmatch(text)
            if root is not None and root["want"] == "object":
                raise WireError(f"header must be a msgpack map, got {root['got']}", framing=True) from None
            if "[...]`" in text:  # a map value is wrong: msgspec does not say under which key
                text = text.replace("[...]`", f"{_failing_key(self.record_type, data, text)}`", 1)
            raise WireError(explain(self.name, text), framing="- at `$.tensors" in text) from None
        except msgspec.DecodeError as exc:  # cut short after the unknown field the strict decode stopped at
            raise _not_msgpack(exc) from None
        except RecursionError:
            raise WireError(self._too_deep(data)) from None
        try:  # the known fields again, every check of the record applied (only unknown fields were wrong)
            return self._strict.decode(msgspec.msgpack.encode(known))
        except (msgspec.ValidationError, RecursionError) as exc:  # pragma: no cover - twin and record disagree
            raise WireError(explain(self.name, str(exc))) from None

    def _too_deep(self, data: Any) -> str:
        try:
            header = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception:  # nested past msgpack's own limit, or corrupt
            return f"{self.name}: nested too deeply to decode"
        path = _deep_path(self.record_type, header, "")
        return f"{self.name}{path}: nested more than {MAX_DEPTH} levels deep (maps and lists in one another)"


# -- lenient twins -------------------------------------------------------------------------------------------


@functools.cache
def _twin(cls: type) -> type:
    """A Struct type with the fields (types, bounds, defaults, tag) of ``cls`` that ignores unknown fields."""
    config = cls.__struct_config__
    fields = []
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, _twin_type(f.type), f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, _twin_type(f.type), msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, _twin_type(f.type)))
    return msgspec.defstruct(cls.__name__, fields, kw_only=True, tag=config.tag, tag_field=config.tag_field)


def _twin_type(annotation: Any) -> Any:
    """``annotation`` with every record type in it replaced by its lenient twin."""
    if isinstance(annotation, type) and issubclass(annotation, Record):
        return _twin(annotation)  # (framing's tensor specs are no Record: they never gain fields)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return Annotated[(_twin_type(args[0]), *annotation.__metadata__)]
    if origin in (types.UnionType, typing.Union):
        return functools.reduce(operator.or_, (_twin_type(a) for a in args))
    if origin is list:
        return list[_twin_type(args[0])]
    if origin is dict:
        return dict[args[0], _twin_type(args[1])]
    return annotation


# -- deep values and error text ------------------------------------------------------------------------------


def _struct_members(annotation: Any) -> Iterator[type]:
    """The Struct types an annotation can hold (directly, in a list, or in a union)."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from _struct_members(arg)


def _plain(annotation: Any) -> Any:
    """The annotation without ``Annotated`` bounds and without ``None`` in a union."""
    while True:
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is Annotated:
            annotation = args[0]
        elif origin in (types.UnionType, typing.Union) and type(None) in args and len(args) == 2:
            annotation = next(a for a in args if a is not type(None))
        else:
            return annotation


def _failing_key(record_type: Any, data: Any, text: str) -> str:
    """``[<key>]`` of the first entry of the map at the error's path whose value does not fit its type, read
    again from the plain header (an error path only); ``[...]`` if that cannot be told."""
    try:
        path = text.rsplit("- at `$", 1)[1].split("[...]`", 1)[0]
        value, annotation = msgpack.unpackb(data, raw=False, strict_map_key=False), record_type
        for name, index in re.findall(r"\.(\w+)|\[(\d+)\]", path):
            if name:
                annotation = {f.name: f.type for m in _struct_members(annotation) for f in msgspec.structs.fields(m)
                              }[name]
                value = value[name]
            else:
                annotation = typing.get_args(_plain(annotation))[0]
                value = value[int(index)]
        value_type = typing.get_args(_plain(annotation))[1]
        for key, item in value.items():
            try:
                msgspec.convert(item, value_type)
            except msgspec.ValidationError:
                return f"[{key!r:.80}]"
    except Exception:  # the header does not have the shape the error implies: say what msgspec said
        pass
    return "[...]"


def _deep_path(annotation: Any, value: Any, path: str) -> str:
    """The path of the first field of a decoded header whose value nests too deeply (``""``: none found)."""
    members = list(_struct_members(annotation))
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _deep_path(annotation, item, f"{path}[{i}]")
            if found:
                return found
        return ""
    if not isinstance(value, dict) or not members:
        return path if check_depth(value) else ""
    fields = {f.name: f.type for m in members for f in msgspec.structs.fields(m)}
    for key, item in value.items():
        inner = fields.get(key) if isinstance(key, str) else None
        name = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r:.40}]"
        found = _deep_path(inner, item, name) if inner is not None else (name if check_depth(item) else "")
        if found:
            return found
    return ""


_AT = re.compile(r"(?P<detail>.*?)(?: - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`)?", re.S)
_BOUND = re.compile(r"Expected `(?P<type>[^`]+)`(?: of length)? (?P<op>>=|<=|>|<) (?P<bound>\S+)")
_TYPE = re.compile(r"Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`")
_SPEC_DTYPE = re.compile(r"\.tensors\[\d+\]\.dtype")
_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true/false",
               "array": "a list", "object": "a map", "int | float": "int or float"}


def explain(name: str, text: str) -> str:
    """msgspec's validation error ``text`` for record ``name`` as ``<record>.<field path>: <what is wrong>``."""
    match = _AT.fullmatch(text)
    assert match is not None  # the pattern matches any text
    detail, path = match["detail"], match["path"] or ""
    if match["key"]:
        bound, kind = _BOUND.fullmatch(detail), _TYPE.fullmatch(detail)
        if bound and bound["op"] == "<=":
            return f"{name}{path}: a key is longer than {bound['bound']} characters"
        return f"{name}{path}: map keys must be strings, got {kind['got']}" if kind else f"{name}{path}: {detail}"
    if _SPEC_DTYPE.fullmatch(path):
        return f"{name}{path.removesuffix('.dtype')}: dtype is not one of {sorted(framing.DTYPE_SIZES)} ({detail})"
    missing = re.fullmatch(r"Object missing required field `(.+)`", detail)
    if missing:
        return f"{name}{path}.{missing[1]}: required field is missing"
    own = re.match(r"([a-z_]+): ", detail)  # a check the record runs itself names its field
    if own:
        return f"{name}{path}.{detail}"
    if "1.7976931348623157e+308" in detail:
        detail = "must be a finite number"
    elif bound := _BOUND.fullmatch(detail):
        if bound["type"] in ("str", "array", "object") or " of length " in detail:
            unit = "characters" if bound["type"] == "str" else "items"
            detail = f"at most {bound['bound']} {unit} allowed" if bound["op"] == "<=" \
                else f"must have {bound['op']} {bound['bound']} {unit}"
        else:
            detail = f"must be {bound['op']} {bound['bound']}"
    elif kind := _TYPE.fullmatch(detail):
        detail = f"expected {_TYPE_NAMES.get(kind['want'], kind['want'])}, got {kind['got']}"
    elif detail.startswith("Invalid enum value"):
        detail = f"must be one of the allowed values (loraflow.common.protocol), got {detail.removeprefix('Invalid enum value ')}"
    return f"{name}{path}: {detail}"
