"""Batches for DP-FTRL: each epoch visits every example at most once, shuffled or in a fixed order.

DP-FTRL needs no sampling assumption (Kairouz et al. 2021; guide §4.3, tab. 3): any order chosen
independently of the data will do, as long as an example enters each tree at most once. These
samplers cut each epoch (a fresh permutation, or ``0..N-1`` every time) into ``N // B`` batches of
exactly B; the ``N mod B`` examples left over sit out that epoch (in a fixed order, always the
same ones — they are never trained on). Their records say "no sampling assumption".
"""

from __future__ import annotations

import torch

from dpfy.data.sampling import ShuffleSampler
from dpfy.plan.sampling import SamplingKind, SamplingRecord


class OrderedSampler(ShuffleSampler):
    """One pass per epoch in shuffled (``shuffle=True``) or fixed order, recorded for DP-FTRL."""

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        *,
        shuffle: bool = True,
        secure: bool = False,
        total: int | None = None,
    ) -> None:
        self.shuffle = bool(shuffle)
        self.kind = SamplingKind.TREE_SHUFFLE if self.shuffle else SamplingKind.TREE_FIXED_ORDER
        super().__init__(dataset_size, batch_size, steps, generator, secure=secure, total=total)

    @property
    def record(self) -> SamplingRecord:
        """Fixed-size batches in the stated order; DP-FTRL's accounting assumes no sampling."""
        return SamplingRecord(
            self.kind, self.batch_size / self.dataset_size, self.dataset_size, self.batch_size
        )

    def _draw(self) -> torch.Tensor:
        if self.shuffle:
            return super()._draw()
        if self._permutation is None or self._offset >= self.batches_per_epoch:
            self._permutation = torch.arange(self.dataset_size)
            self._offset = 0
        start = self._offset * self.batch_size
        self._offset += 1
        return self._permutation[start : start + self.batch_size]
