"""A training history that says which of its numbers may be published.

The trainer's history rows mix two kinds of number. The running loss and accuracy on the training
batches are computed from the private data without noise: they are not covered by the DP
guarantee and are for diagnosing the run only. Test metrics come from the held-out test split,
and ε from the accountant, so they are what a run reports beside its guarantee. ``history.json``
states this split in fields of its own, and the training plot labels its curves from the same
rule, so neither presents a private-data figure as a released one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dpfy._safe_io import atomic_write_text

HISTORY_FORMAT = "dpfy.history"
NOT_PRIVATE_TAG = "private data, not DP"
NOT_PRIVATE_NOTE = (
    "computed on the private training data without noise: NOT covered by the DP guarantee; use "
    "them to diagnose the run and leave them out of anything published"
)
RELEASED_NOTE = (
    "test metrics are measured on the held-out test split, not on the private training data, "
    "and ε is the accountant's bound after that step: these are what the run reports beside its "
    "guarantee (the DP guarantee protects the training data, not the test split)"
)
_PUBLIC_KEYS = ("step", "epoch", "epsilon")


def is_released(key: str) -> bool:
    """Whether a history field may be published: schedule, ε and test metrics, nothing else.

    Any other field (train loss, train accuracy, or a key dpfy does not know) counts as computed
    on the private data, so an unfamiliar metric is never presented as a released one.
    """
    return key in _PUBLIC_KEYS or key.startswith("test_")


def history_fields(history: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every field of the rows, in first-seen order."""
    return list(dict.fromkeys(key for row in history for key in row))


def series_label(key: str) -> str:
    """A curve's legend label; fields computed on private data carry the not-DP tag."""
    name = "train loss" if key == "loss" else key.replace("_", " ")
    return name if is_released(key) else f"{name} ({NOT_PRIVATE_TAG})"


def history_document(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON object ``history.json`` holds: which fields are not private, which are released,
    and the rows as the trainer recorded them."""
    fields = history_fields(history)
    return {
        "format": HISTORY_FORMAT,
        "not_private": {
            "fields": [k for k in fields if not is_released(k)],
            "why": NOT_PRIVATE_NOTE,
        },
        "released": {"fields": [k for k in fields if is_released(k)], "why": RELEASED_NOTE},
        "rows": [dict(row) for row in history],
    }


def write_history(path: str | os.PathLike[str], history: Sequence[Mapping[str, Any]]) -> Path:
    """Write :func:`history_document` as indented JSON."""
    target = Path(path)
    atomic_write_text(target, json.dumps(history_document(history), indent=2) + "\n")
    return target


def read_history(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a ``history.json``: a labelled document, or the bare list older runs wrote."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(data, list):
        return data
    if isinstance(data, dict) and data.get("format") == HISTORY_FORMAT:
        return list(data["rows"])
    raise ValueError(
        f"{path} is not a dpfy history: expected a JSON object with format {HISTORY_FORMAT!r} "
        "or a list of rows"
    )


__all__ = [
    "HISTORY_FORMAT",
    "NOT_PRIVATE_NOTE",
    "NOT_PRIVATE_TAG",
    "RELEASED_NOTE",
    "history_document",
    "history_fields",
    "is_released",
    "read_history",
    "series_label",
    "write_history",
]
