"""Poisson sampling split across ranks: each rank samples its own shard at the *global* rate.

With W ranks, rank r owns the indices ``r, r + W, r + 2W, …`` of the whole dataset and keeps each
one independently with probability q = B/N, N the size of the *whole* dataset. Inclusion
decisions are independent across indices — within a shard by construction, across shards because
every rank draws from its own, independently seeded stream — and the shards partition the
dataset, so the union of the W local batches is exactly a Poisson sample of the whole dataset at
rate q (guide alg. 1, §4.3). Its expected size is B; rank r's expected share is ``q·|shard_r|``.
The record the ledger sees is therefore the ordinary global one: Poisson, q, N.

Two ranks must never share a random stream: with equal shard sizes, the same seed would make
index ``r + kW`` join exactly when ``r' + kW`` does, and the union would not be a Poisson sample.
:func:`dpfy.train.distributed.derive_seed` gives each rank its own stream from one user seed.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch

from dpfy._validate import check_count
from dpfy.data.sampling import PoissonSampler


class ShardedPoissonSampler(PoissonSampler):
    """Rank ``rank`` of ``world_size``: Poisson-samples its strided shard at the global q."""

    def __init__(
        self,
        dataset_size: int,
        sampling_rate: float,
        steps: int | Fraction,
        rank: int,
        world_size: int,
        generator: torch.Generator | None = None,
        *,
        secure: bool = False,
        total: int | None = None,
    ) -> None:
        self.world_size = check_count("world_size", world_size, minimum=1)
        self.rank = check_count("rank", rank)
        if self.rank >= self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
        check_count("dataset_size", dataset_size, minimum=1)
        # Slicing, not arange(rank, N, W): a rank past the last example gets an empty shard.
        self.shard = torch.arange(dataset_size, dtype=torch.int64)[self.rank :: self.world_size]
        super().__init__(dataset_size, sampling_rate, steps, generator, secure=secure, total=total)

    @property
    def expected_local_batch_size(self) -> float:
        """q·|shard|: this rank's share of the expected global batch size B = qN."""
        return self.sampling_rate * len(self.shard)

    def _draw(self) -> torch.Tensor:
        kept = self._source.bernoulli_indices(len(self.shard), self.sampling_rate)
        return self.shard[kept]

    def _identity(self) -> dict[str, Any]:
        """A rank's sampler state only resumes the same rank of a world of the same size."""
        return {**super()._identity(), "rank": self.rank, "world_size": self.world_size}
