"""Virtual batching: a logical Poisson batch processed in physical chunks that fit in memory.

Privacy is decided per *logical* batch: the optimizer clips every chunk, but noises, accounts and
updates once, when the chunk that closes the logical batch has been processed. The loader tells
it which chunk that is through a shared :class:`~dpfy.train.optim.BatchBoundary`. A clipping unit of
several examples (a microbatch, a user) is never split between chunks: its average is clipped
as a whole, so the batch is ordered by unit and cut only between units.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from dpfy._validate import check_count
from dpfy.data.batches import batch_length, slice_batch, take_batch
from dpfy.data.loader import DPDataLoader
from dpfy.train.optim import BatchBoundary

__all__ = [
    "AccumulationPieces",
    "VirtualBatchLoader",
    "batch_length",
    "chunk_bounds",
    "slice_batch",
]


def chunk_bounds(units: torch.Tensor | None, examples: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk: at most ``size`` examples, cut only between units.

    ``units`` (sorted) holds each example's unit; a unit larger than ``size`` is one chunk of its
    own. An empty batch is one empty chunk, so its step (noise only) still happens.
    """
    if examples == 0:
        return [(0, 0)]
    if units is None:
        return [(s, min(s + size, examples)) for s in range(0, examples, size)]
    _, counts = torch.unique_consecutive(units, return_counts=True)
    bounds, start, stop = [], 0, 0
    for count in counts.tolist():
        if stop > start and stop + count - start > size:
            bounds.append((start, stop))
            start = stop
        stop += count
    bounds.append((start, stop))
    return bounds


class VirtualBatchLoader:
    """Yields physical chunks of at most ``max_physical_batch_size`` examples per logical batch."""

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
        for batch in self.loader:
            units = self.loader.provenance.current.units
            if units is not None:
                order = torch.argsort(units, stable=True)
                batch = take_batch(batch, order)
                units = self.loader.provenance.reorder(order)
            bounds = chunk_bounds(units, batch_length(batch), self.max_physical_batch_size)
            for i, (start, stop) in enumerate(bounds):
                self.boundary.closes_batch = i == len(bounds) - 1
                self.boundary.chunk = (start, stop)
                yield slice_batch(batch, start, stop)
        self.boundary.closes_batch, self.boundary.chunk = True, None

    def __len__(self) -> int:
        """The number of logical batches (steps) in one pass."""
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        """Everything else (sampling_rate, state_dict, …) is the logical loader's."""
        return getattr(self.loader, name)


class AccumulationPieces:
    """Each private batch cut into ``pieces`` consecutive parts (some may be empty).

    For a trainer that counts one optimizer step per ``pieces`` batches it draws (Hugging Face's
    ``gradient_accumulation_steps``, Lightning's ``accumulate_grad_batches``): every logical
    batch yields exactly that many pieces, whatever its Poisson size. The trainer calls
    ``optimizer.accumulate()`` after each piece's backward pass and ``optimizer.step()`` once
    (:mod:`dpfy.train.accumulation`); clipping units of several examples are not supported here
    (the optimizer refuses a microbatch- or user-clipped batch cut this way).
    """

    def __init__(self, loader: Any, pieces: int) -> None:
        self.loader = loader
        self.pieces = check_count("pieces", pieces, minimum=1)

    def __len__(self) -> int:
        """Pieces in one pass: the loader's batches times the pieces of each."""
        return len(self.loader) * self.pieces

    def __iter__(self) -> Iterator[Any]:
        """The pieces of each batch, in order."""
        for batch in self.loader:
            size = batch_length(batch)
            cuts = [size * i // self.pieces for i in range(self.pieces + 1)]
            for start, stop in itertools.pairwise(cuts):
                yield slice_batch(batch, start, stop)
