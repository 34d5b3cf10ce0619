"""Which rows of a static-shape batch are examples and which are padding: one public type.

Truncated Poisson sampling (:class:`~dpfy.data.sampling.TruncatedPoissonSampler`) hands out
every batch with exactly M rows, so shapes never change (what ``torch.compile``, CUDA graphs and
memory planning need). The sampler states how many rows are examples; the loader publishes that
with the batch (:class:`~dpfy.data.provenance.DrawnBatch` ``padding``); the optimizer passes it,
cut to the physical chunk, to the engine, which gives padding rows a clip factor of exactly 0 and
counts only the examples. Padding rows are always the last rows, so a padded batch's examples are
``batch[:real]`` whatever its structure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpfy._validate import check_count

__all__ = ["PAD_INDEX", "Padding"]

#: The dataset index a padding row is read from: a fixed position, whatever the batch holds. Its
#: content reaches the forward and backward passes but never the update (its clip factor is 0).
PAD_INDEX = 0


@dataclass(frozen=True)
class Padding:
    """A batch of ``rows`` rows whose first ``real`` rows are examples and the rest padding."""

    rows: int
    real: int

    def __post_init__(self) -> None:
        check_count("rows", self.rows)
        check_count("real", self.real)
        if self.real > self.rows:
            raise ValueError(f"a padded batch of {self.rows} rows cannot hold {self.real} examples")

    @property
    def padded(self) -> int:
        """How many rows are padding."""
        return self.rows - self.real

    def mask(self) -> torch.Tensor:
        """True for the rows that are examples (bool, one entry per row)."""
        return torch.arange(self.rows) < self.real

    def chunk(self, start: int, stop: int) -> Padding:
        """Rows ``start:stop`` of this batch (a physical chunk of the logical batch)."""
        if not 0 <= start <= stop <= self.rows:
            raise ValueError(f"rows {start}:{stop} are not inside a batch of {self.rows}")
        return Padding(stop - start, min(max(self.real - start, 0), stop - start))

    def check_rows(self, rows: int) -> None:
        """The batch that reached the engine must have the rows the loader padded it to."""
        if rows != self.rows:
            raise ValueError(
                f"the loader padded this batch to {self.rows} rows but the step saw {rows}; "
                "pass each padded loader batch to the model whole and unchanged (the padding "
                "marks say which rows are examples only for the batch as it was handed out)"
            )

    def check_finite(self, norms: torch.Tensor) -> None:
        """A padding row whose gradient is not finite would turn its zero weight into NaN."""
        if norms.numel() and not bool(torch.isfinite(norms).all()):
            raise ValueError(
                f"a padding row (a copy of dataset[{PAD_INDEX}]) has a NaN or infinite gradient, "
                "which its zero weight cannot remove; the step was not applied — make "
                f"dataset[{PAD_INDEX}] an example whose loss is finite"
            )
