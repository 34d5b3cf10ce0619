"""Batches taken in order: each epoch visits every example at most once, in ``N // B`` batches.

DP-FTRL needs no sampling assumption (Kairouz et al. 2021; guide §4.3, tab. 3): any order chosen
independently of the data will do, as long as an example enters each tree at most once. Its
samplers cut each epoch (a fresh permutation, or ``0..N-1`` every time) into ``N // B`` batches of
exactly B; the ``N mod B`` examples left over sit out that epoch (in a fixed order, always the
same ones — they are never trained on). Their records say "no sampling assumption".

Matrix-factorisation noise (BandMF, BLT) is accounted for one order kept every epoch, so that
an example's steps are exactly ``N // B`` apart (min-separation participation):
:class:`RepeatedOrderSampler` draws one permutation before the first batch, independently of the
data, and cuts every epoch from it; the ``N mod B`` examples at its end are never trained on.
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


class RepeatedOrderSampler(ShuffleSampler):
    """One permutation drawn before the first batch, cut into the same batches every epoch.

    Its record describes the order only (kind ``fixed-order-epochs``, no event of its own): the
    matrix-factorisation mechanism accounts the steps by their participation schema. The
    permutation is part of the sampler state, so a resumed run keeps the order.
    """

    kind = SamplingKind.FIXED_ORDER_EPOCHS

    @property
    def record(self) -> SamplingRecord:
        """Fixed-size batches in one repeated order; the noise mechanism states their cost."""
        return SamplingRecord(
            self.kind, self.batch_size / self.dataset_size, self.dataset_size, self.batch_size
        )

    def _draw(self) -> torch.Tensor:
        if self._permutation is None:
            self._permutation = self._source.permutation(self.dataset_size)
            self._offset = 0
        elif self._offset >= self.batches_per_epoch:
            self._offset = 0  # the next epoch: the same order again
        start = self._offset * self.batch_size
        self._offset += 1
        return self._permutation[start : start + self.batch_size]
