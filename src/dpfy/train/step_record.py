"""One private step as it happened: how its batch was drawn, and the noise multiplier σ.

The ledger records these, never the realised batch size (which must not influence anything
privacy-relevant); torch-free, like the ledger.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from dpfy._validate import check_count, check_positive
from dpfy.plan.accounting.events import DpEvent
from dpfy.plan.sampling import SamplingRecord

__all__ = ["StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """One DP-SGD step as it happened: how its batch was drawn and the noise multiplier σ.

    ``batch_size`` is the realised batch size, kept for diagnostics only (a running total); it
    takes no part in accounting, grouping or equality.
    """

    sampling: SamplingRecord
    noise_multiplier: float
    batch_size: int | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingRecord):
            raise ValueError(
                f"sampling must be a SamplingRecord (take it from the sampler's .record), "
                f"got {type(self.sampling).__name__}"
            )
        object.__setattr__(
            self, "noise_multiplier", check_positive("noise_multiplier", self.noise_multiplier)
        )
        if self.batch_size is not None:
            object.__setattr__(self, "batch_size", check_count("batch_size", self.batch_size))

    @functools.cached_property
    def event(self) -> DpEvent:
        """The event accounted for this step (made once: both fields it depends on are frozen)."""
        return self.sampling.event(self.noise_multiplier)

    def describe(self) -> str:
        """A short phrase for messages: kind, q and σ."""
        return (
            f"{self.sampling.kind.value} sampling, q={self.sampling.sampling_rate:.6g}, "
            f"σ={self.noise_multiplier:.6g}"
        )
