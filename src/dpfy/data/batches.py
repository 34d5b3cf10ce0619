"""Reading and cutting collated batches whatever their structure (tensors, dicts, tuples, lists)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def batch_length(batch: Any) -> int:
    """The number of examples in a collated batch (its first tensor's leading dimension)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return batch_length(next(iter(batch.values())))
    if isinstance(batch, Sequence) and not isinstance(batch, str) and batch:
        return batch_length(batch[0])
    raise ValueError(f"cannot find the batch dimension of a {type(batch).__name__}")


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor a collated batch holds, in order (any Mapping, e.g. a tokenizer's
    ``BatchEncoding``, and any sequence), so a step can check it is given these tensors."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in batch_tensors(value)]
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return [t for value in batch for t in batch_tensors(value)]
    return []


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Examples ``start:stop`` of a collated batch, keeping its structure."""
    return _map_rows(batch, lambda rows: rows[start:stop])


def take_batch(batch: Any, order: torch.Tensor) -> Any:
    """The examples of a collated batch in ``order`` (a permutation of its rows)."""
    positions = order.tolist()

    def pick(rows: Any) -> Any:
        return rows[order] if isinstance(rows, torch.Tensor) else [rows[i] for i in positions]

    return _map_rows(batch, pick)


def _map_rows(batch: Any, rows_of: Any) -> Any:
    """Apply ``rows_of`` to every batch-first leaf (tensors and lists of items)."""
    if isinstance(batch, torch.Tensor):
        return rows_of(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: _map_rows(v, rows_of) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map_rows(v, rows_of) for v in batch))
    if isinstance(batch, list) and batch and not holds_batches(batch):
        return rows_of(batch)  # a list of per-example items (e.g. strings)
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return type(batch)(_map_rows(v, rows_of) for v in batch)
    return batch


def holds_batches(items: list[Any]) -> bool:
    """Whether a collated list is a container of batches rather than a batch of items."""
    return all(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in items)
