"""One private step as it happened: how its batch was drawn, the noise multiplier σ, and the
event its noise mechanism charges when the mechanism, not the sampling, states the cost.

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
    """One private step as it happened: how its batch was drawn and the noise multiplier σ.

    ``batch_size`` is the realised batch size, kept for diagnostics only (a running total); it
    takes no part in accounting, grouping or equality. ``charged`` is the event the noise
    mechanism states for this step (:meth:`NoiseMechanism.step_event
    <dpfy.train.noise.mechanisms.NoiseMechanism.step_event>`: a correlated mechanism's share of
    its run's cost), or None when the step costs what its sampling record says.
    """

    sampling: SamplingRecord
    noise_multiplier: float
    batch_size: int | None = dataclasses.field(default=None, compare=False)
    charged: DpEvent | None = None

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
        if self.charged is not None and not isinstance(self.charged, DpEvent):
            raise ValueError(
                f"charged must be a DpEvent (the mechanism's), got {type(self.charged).__name__}"
            )

    @functools.cached_property
    def event(self) -> DpEvent:
        """The event accounted for this step: the mechanism's when it charged one, else the
        sampling record's at σ (made once: the fields it depends on are frozen)."""
        if self.charged is not None:
            return self.charged
        return self.sampling.event(self.noise_multiplier)

    def describe(self) -> str:
        """A short phrase for messages: kind, q and σ."""
        return (
            f"{self.sampling.kind.value} sampling, q={self.sampling.sampling_rate:.6g}, "
            f"σ={self.noise_multiplier:.6g}"
        )
