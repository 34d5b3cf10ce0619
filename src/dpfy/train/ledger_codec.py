"""The ledger's checkpoint format: a versioned plain-JSON dict, one item per run of steps.

Decoding re-validates every part (a sampling record, an event) with the same checks as when it
was first recorded, so a corrupt state is a ValueError rather than an ε no one should trust.
A training step whose noise mechanism charged its own event keeps it under ``"charged"``;
entries without it (every ledger written before mechanisms charged events) decode as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dpfy._validate import check_count
from dpfy.plan.accounting.event_codec import decode_event, encode_event
from dpfy.plan.accounting.events import DpEvent
from dpfy.plan.sampling import SamplingRecord
from dpfy.train.step_record import StepRecord

LEDGER_FORMAT = "dpfy.privacy-ledger"
LEDGER_VERSION = 1

__all__ = [
    "LEDGER_FORMAT",
    "LEDGER_VERSION",
    "check_format",
    "decode_entry",
    "encode_entry",
    "entries_of",
]


def check_format(state: dict[str, Any]) -> None:
    """Refuse anything but a ledger state of this version."""
    if state.get("format") != LEDGER_FORMAT or state.get("version") != LEDGER_VERSION:
        raise ValueError(
            f"not a version-{LEDGER_VERSION} dpfy ledger state (format={state.get('format')!r}, "
            f"version={state.get('version')!r})"
        )


def entries_of(state: dict[str, Any]) -> Iterable[Any]:
    """The state's list of entries."""
    entries = state["entries"]
    if not isinstance(entries, list):
        raise ValueError("entries must be a list")
    return entries


def encode_entry(label: str, count: int, step: StepRecord | None, event: DpEvent) -> dict[str, Any]:
    """One run of ``count`` identical records: a training step's record, or a labelled event."""
    item: dict[str, Any] = {"label": label, "count": count}
    if step is not None:
        item["sampling"] = step.sampling.to_dict()
        item["noise_multiplier"] = step.noise_multiplier
        if step.charged is not None:
            item["charged"] = encode_event(step.charged)
    else:
        item["event"] = encode_event(event)
    return item


def decode_entry(
    index: int, item: Any, training: str
) -> tuple[str, int, StepRecord | None, DpEvent | None]:
    """Inverse of :func:`encode_entry`: (label, count, step or None, event or None)."""
    if not isinstance(item, dict):
        raise ValueError(f"entries[{index}] must be a dict")
    label = item["label"]
    count = check_count(f"entries[{index}].count", item["count"], minimum=1)
    if "sampling" in item:
        if label != training:
            raise ValueError(f"entries[{index}] is a training step labelled {label!r}")
        charged = decode_event(item["charged"]) if "charged" in item else None
        step = StepRecord(
            SamplingRecord.from_dict(item["sampling"]), item["noise_multiplier"], charged=charged
        )
        return label, count, step, None
    return label, count, None, decode_event(item["event"])
