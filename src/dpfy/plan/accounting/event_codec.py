"""DpEvents to plain JSON and back, so ledgers and reports survive a checkpoint exactly.

Events are frozen dataclasses; an event becomes ``{"type": "<ClassName>", <field>: <value>, ...}``
with nested events encoded the same way, tuples as lists and enums by value. Decoding only builds
classes defined in :mod:`dpfy.plan.accounting.events` and lets their own validation run, so a
corrupt
state fails with a ValueError instead of producing an event no accountant should trust.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from dpfy.plan.accounting import events as _events
from dpfy.plan.accounting.events import DpEvent


def _known_event_types() -> dict[str, type[DpEvent]]:
    """Every concrete event class of the events module, by name."""
    return {
        name: cls
        for name, cls in vars(_events).items()
        if isinstance(cls, type) and issubclass(cls, DpEvent) and dataclasses.is_dataclass(cls)
    }


_EVENT_TYPES = _known_event_types()


def encode_event(event: DpEvent) -> dict[str, Any]:
    """A JSON-able dict for ``event``; floats round-trip exactly through ``json``."""
    if type(event).__name__ not in _EVENT_TYPES or not dataclasses.is_dataclass(event):
        raise ValueError(f"cannot encode {type(event).__name__}: not a dpfy accounting event")
    data: dict[str, Any] = {"type": type(event).__name__}
    for field in dataclasses.fields(event):
        data[field.name] = _encode_value(getattr(event, field.name))
    return data


def _encode_value(value: Any) -> Any:
    """Events recurse, tuples become lists, enums their value; numbers and None stay."""
    if isinstance(value, DpEvent):
        return encode_event(value)
    if isinstance(value, tuple):
        return [_encode_value(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"cannot encode a {type(value).__name__} inside an event")


def decode_event(data: Any) -> DpEvent:
    """Inverse of :func:`encode_event`; anything malformed is a ValueError."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ValueError(f"an encoded event must be a dict with a 'type', got {data!r:.80}")
    cls = _EVENT_TYPES.get(data["type"])
    if cls is None:
        raise ValueError(f"unknown event type {data['type']!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names - {"type"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} for {data['type']}")
    kwargs = {k: _decode_value(v) for k, v in data.items() if k != "type"}
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"malformed {data['type']}: {err}") from None


def _decode_value(value: Any) -> Any:
    """Dicts with a type are events, lists are tuples; scalars pass through for validation."""
    if isinstance(value, dict):
        return decode_event(value)
    if isinstance(value, list):
        return tuple(_decode_value(v) for v in value)
    return value
