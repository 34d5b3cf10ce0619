"""Virtual batching: a logical Poisson batch processed in physical chunks that fit in memory.

Privacy is decided per *logical* batch: the optimizer clips every chunk, but noises, accounts and
updates once, when the chunk that closes the logical batch has been processed. The loader tells
it which chunk that is through a shared :class:`~dpfy.optim.BatchBoundary`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from dpfy._validate import check_count
from dpfy.data.loader import DPDataLoader
from dpfy.optim import BatchBoundary


def batch_length(batch: Any) -> int:
    """The number of examples in a collated batch (its first tensor's leading dimension)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return batch_length(next(iter(batch.values())))
    if isinstance(batch, Sequence) and not isinstance(batch, str) and batch:
        return batch_length(batch[0])
    raise ValueError(f"cannot find the batch dimension of a {type(batch).__name__}")


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Examples ``start:stop`` of a collated batch, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({k: slice_batch(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(slice_batch(v, start, stop) for v in batch))
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return type(batch)(slice_batch(v, start, stop) for v in batch)
    return batch


class VirtualBatchLoader:
    """Yields physical chunks of at most ``max_physical_batch_size`` examples per logical batch.

    An empty logical batch yields one empty chunk, so the step (noise only) still happens.
    """

    def __init__(
        self, loader: DPDataLoader, max_physical_batch_size: int, boundary: BatchBoundary
    ) -> None:
        self.loader = loader
        self.max_physical_batch_size = check_count(
            "max_physical_batch_size", max_physical_batch_size, minimum=1
        )
        self.boundary = boundary

    def __iter__(self) -> Iterator[Any]:
        """Chunks of each logical batch, the boundary set before each one is handed out."""
        size = self.max_physical_batch_size
        for batch in self.loader:
            n = batch_length(batch)
            starts = list(range(0, n, size)) or [0]
            for i, start in enumerate(starts):
                self.boundary.closes_batch = i == len(starts) - 1
                yield slice_batch(batch, start, min(start + size, n))
        self.boundary.closes_batch = True

    def __len__(self) -> int:
        """The number of logical batches (steps) in one pass."""
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        """Everything else (sampling_rate, state_dict, …) is the logical loader's."""
        return getattr(self.loader, name)
