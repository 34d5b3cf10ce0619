"""What a ledger says about its run, as one typed object the report and the CLI read.

Typed rather than a free dict so that a report can only state what the ledger recorded: every
field is named once here, and the report's JSON round-trips through the same classes.
Torch-free, like the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpfy.plan.sampling import SamplingRecord

__all__ = ["LedgerSummary", "SampledSteps"]


@dataclass(frozen=True)
class SampledSteps:
    """Training steps the ledger accounted with one sampling record (its prose is derived)."""

    sampling: SamplingRecord
    steps: int

    @property
    def description(self) -> str:
        """The record's report sentence."""
        return self.sampling.description


@dataclass(frozen=True)
class LedgerSummary:
    """The ledger's settings, its steps by sampling record, whether they held, and ε per label.

    ``groups`` counts the run-length-encoded entries; ``examples_seen`` totals the realised batch
    sizes (diagnostics only, None if the steps did not report them); ``epsilon_under_poisson_
    assumption`` is given only when some sampling did not meet the Poisson assumption.
    """

    accountant: str
    relation: str
    delta: float
    target_epsilon: float | None
    steps: int
    groups: int
    sampling: tuple[SampledSteps, ...]
    noise_multipliers: tuple[float, ...]
    assumptions_met: bool
    epsilon: dict[str, float]  # "training", one entry per other label, and "total"
    labelled_events: dict[str, int]  # releases other than training steps, counted by label
    examples_seen: int | None = None
    epsilon_under_poisson_assumption: float | None = None

    @property
    def total_epsilon(self) -> float:
        """ε of training and every labelled event together, at the ledger's δ."""
        return self.epsilon["total"]
