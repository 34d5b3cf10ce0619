"""Plain JSON for the facts, and typed dataclasses rebuilt from it with every problem named.

A saved facts.json is read by people and edited by mistake: :func:`build` refuses unknown or
missing fields and values of the wrong JSON type, naming the field, so an error says what to
restore. Non-finite floats (an unbounded ε) travel as the strings 'inf', '-inf' and 'nan'.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable
from typing import Any

_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def json_safe(value: Any) -> Any:
    """Plain JSON: tuples become lists, enums their values, non-finite floats 'inf'/'-inf'/'nan'."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_restore(value: Any) -> Any:
    """Inverse of :func:`json_safe` for the non-finite floats (containers stay lists)."""
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, dict):
        return {k: json_restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_restore(v) for v in value]
    return value


def asdict(facts: Any) -> dict[str, Any]:
    """``dataclasses.asdict`` (tuples stay tuples; :func:`json_safe` makes them lists)."""
    return dataclasses.asdict(facts)


def build(
    cls: type,
    data: Any,
    nested: dict[str, Callable[[Any], Any]] | None = None,
    where: str | None = None,
) -> Any:
    """A dataclass from a dict with exactly its fields; ``nested`` converts sub-objects.

    Every problem names the field (``where``), so a hand-edited file says what to restore.
    """
    at, prefix = (f" at {where}", f"{where}.") if where else ("", "")
    if not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__} must be a dict, got {type(data).__name__}")
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields{at}: {sorted(unknown)}")
    required = {
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = required - set(data)
    if missing:
        named = ", ".join(prefix + name for name in sorted(missing))
        raise ValueError(f"malformed {cls.__name__}{at}: missing field(s) {named}")
    converters = nested or {}
    values = {}
    for key, value in data.items():
        values[key] = converters[key](value) if key in converters else value
        check_type(f"{prefix}{key}", values[key], _field_types(cls)[key])
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"malformed {cls.__name__}{at}: {err}") from None


def _field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of each field (the facts modules use postponed annotations)."""
    if cls not in _FIELD_TYPES:
        _FIELD_TYPES[cls] = typing.get_type_hints(cls)
    return _FIELD_TYPES[cls]


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def check_type(where: str, value: Any, hint: Any) -> None:
    """Refuse a value of the wrong JSON type before it reaches a renderer (a str as a count…)."""
    if hint is Any:
        return
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        ok = isinstance(value, hint)
    elif origin is tuple:
        ok = isinstance(value, (tuple, list))
        if ok:
            for i, item in enumerate(value):
                check_type(f"{where}[{i}]", item, args[0])
    elif origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
        if ok:
            for key, item in value.items():
                check_type(f"{where}.{key}", item, args[1])
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        wanted = getattr(hint, "__name__", str(hint))
        raise ValueError(f"{where} must be {wanted}, got {type(value).__name__} {value!r:.60}")


def tuple_of(
    cls: type, where: str | None = None, convert: Callable[[Any, str], Any] | None = None
) -> Callable[[Any], tuple[Any, ...]]:
    """Converter for a list of dataclass dicts (``convert(item, where)`` builds one item)."""
    one = convert or (lambda item, at: build(cls, item, where=at))

    def converter(items: Any) -> tuple[Any, ...]:
        name = where or cls.__name__
        if not isinstance(items, list):
            raise ValueError(f"{name} must be a list, got {type(items).__name__}")
        return tuple(one(item, f"{name}[{i}]") for i, item in enumerate(items))

    return converter


def list_as_tuple(value: Any) -> Any:
    """A JSON list as a tuple; anything else is left for the type check to name."""
    return tuple(value) if isinstance(value, list) else value


def optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Converter that passes None through."""
    return lambda value: None if value is None else convert(value)


__all__ = [
    "asdict",
    "build",
    "check_type",
    "json_restore",
    "json_safe",
    "list_as_tuple",
    "optional",
    "tuple_of",
]
