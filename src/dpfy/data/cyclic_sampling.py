"""Cyclic Poisson sampling, the batches of amplified BandMF (Choquette-Choo et al. 2023).

The examples are split once into b groups, before the first batch and independently of the data
(a random permutation, example i of it in group i mod b); step t takes every example of group
t mod b independently with probability q = b·B/N, so a group's expected batch is about B and
an example can only take part every b steps. Batch sizes vary and empty batches are steps too,
as with Poisson sampling. The record describes the sampling only: the BandMF mechanism states
what each step costs (:class:`~dpfy.plan.correlated_events.CyclicCharges`). The split is part of
the sampler state, so a resumed run keeps its groups.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch

from dpfy._validate import check_count, check_sampling_rate
from dpfy.data.sampling import DpBatchSampler
from dpfy.plan.sampling import SamplingKind, SamplingRecord

__all__ = ["CyclicPoissonSampler"]


class CyclicPoissonSampler(DpBatchSampler):
    """Step t Poisson-samples group t mod ``groups`` at ``sampling_rate``; groups fixed once."""

    kind = SamplingKind.CYCLIC_POISSON

    def __init__(
        self,
        dataset_size: int,
        groups: int,
        sampling_rate: float,
        steps: int | Fraction,
        generator: torch.Generator | None = None,
        *,
        secure: bool = False,
        total: int | None = None,
    ) -> None:
        self.groups = check_count("groups", groups, minimum=1)
        if self.groups > dataset_size:
            raise ValueError(f"groups ({groups}) must be at most the dataset size ({dataset_size})")
        self._sampling_rate = check_sampling_rate(sampling_rate)
        self._order: torch.Tensor | None = None  # the permutation the groups are cut from
        super().__init__(dataset_size, steps, generator, secure=secure, total=total)

    @property
    def record(self) -> SamplingRecord:
        """Cyclic Poisson at rate q within the step's group; its mechanism states the cost."""
        return SamplingRecord(self.kind, self._sampling_rate, self.dataset_size)

    def epoch_position(self, position: int) -> int:
        """The group (0-based) the stream's batch ``position`` (1-based) was drawn from."""
        return (position - 1) % self.groups

    def group(self, index: int) -> torch.Tensor:
        """The examples of group ``index`` (the split is drawn at the first batch)."""
        if self._order is None:
            self._order = self._source.permutation(self.dataset_size)
        return self._order[index :: self.groups]

    def _draw(self) -> torch.Tensor:
        members = self.group(self._position % self.groups)
        return members[self._source.bernoulli_indices(members.numel(), self._sampling_rate)]

    def _identity(self) -> dict[str, Any]:
        return {**super()._identity(), "groups": self.groups}

    def _context(self) -> dict[str, Any]:
        return {"order": self._order}

    def _restore_context(self, state: dict[str, Any]) -> None:
        order = state["order"]
        if order is not None:
            if not isinstance(order, torch.Tensor) or order.shape != (self.dataset_size,):
                raise ValueError(f"the group split must be a tensor of {self.dataset_size} indices")
            order = order.to(torch.int64)
        self._order = order
