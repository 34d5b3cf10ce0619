"""Per-example gradient rows kept in the batch slices they were formed in.

A convolution's per-example weight gradients are formed a few batch slices at a time
(:func:`dpfy.train.grads.layout.batch_slices`: the kernel's working buffers scale with the slice).
Joining the slices into one (B, F) tensor is a copy as large as all of them, with both copies
alive at once (its cost: docs/performance.md). The norms and the weighted sum of the clipped
sum read each slice where it is instead; the slices are joined only when a clipping unit spans
several examples.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from dpfy.train.grads.layout import Units
from dpfy.train.grads.norms import sq_norm

__all__ = ["Rows", "weighted_rows"]


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows (n, F) of per-example (or per-unit) gradients, as consecutive parts along dim 0."""

    parts: tuple[Tensor, ...]

    @classmethod
    def of(cls, rows: Tensor | Rows) -> Rows:
        """``rows`` as :class:`Rows` (a tensor becomes one part)."""
        return rows if isinstance(rows, Rows) else cls((rows,))

    def joined(self) -> Tensor:
        """All rows as one tensor (a copy when there are several parts)."""
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)

    def per_unit(self, units: Units) -> Rows:
        """Per-unit sums of the rows: the rows themselves when each unit is one example."""
        if units.width == 1 and units.slots is None:
            return self
        return Rows((units.sum_rows(self.joined()),))

    def sq_norms(self) -> Tensor:
        """Σ_f row² for each row, (n,)."""
        norms = [sq_norm(part, 1) for part in self.parts]
        return norms[0] if len(norms) == 1 else torch.cat(norms)

    def weighted_sum(self, weights: Tensor, into: Tensor | None = None) -> Tensor:
        """Σ_i weights[i] · row_i, (F,): one product per part.

        With ``into`` (a running sum holding F numbers, any shape, contiguous) the sum is added
        into it in place, one matrix-vector product per part, and ``into`` is returned.
        """
        if len(self.parts) == 1 and self.parts[0].shape[0] == weights.shape[0]:
            return weighted_rows(self.parts[0], weights, None if into is None else into.view(-1))
        flat = None if into is None else into.view(-1)
        total: Tensor | None = None
        start = 0
        for part in self.parts:
            w = weights[start : start + part.shape[0]]
            if flat is not None:
                weighted_rows(part, w, flat)
            else:
                term = weighted_rows(part, w)
                total = term if total is None else total.add_(term)
            start += part.shape[0]
        if into is not None:
            return into
        assert total is not None, "Rows without parts"
        return total


def weighted_rows(rows: Tensor, weights: Tensor, into: Tensor | None = None) -> Tensor:
    """Σ_u w_u rows_u: (U, F), (U,) → (F,), added into ``into`` ((F,)) in place when given."""
    w = weights if weights.dtype == rows.dtype else weights.to(rows.dtype)
    if into is None:
        return w @ rows
    if into.dtype != rows.dtype:
        return into.add_(w @ rows)
    return into.addmv_(rows.t(), w)
