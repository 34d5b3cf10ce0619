"""Private aggregation of teacher votes: GNMax and Confident-GNMax (Papernot et al. 2018).

Sensitivity, stated per neighbouring relation (guide §2.1). Teachers are trained on disjoint
partitions fixed per record (:mod:`dpfy.access.prediction_partition`), so adding or removing one
record changes one teacher's training set and at most that teacher's vote: the vote histogram
loses 1 in one class and gains 1 in another, an L2 change of at most √2, and the largest count
moves by at most 1. Replacing a record may move it to another partition, so two teachers change:
twice both bounds — the accountants' replace-one factor of 2 says exactly that.

Accounting is data-independent, as Gaussian events in dpfy's algebra (decoupled: std = σ · Δ):

* GNMax, noise N(0, σ²) on every count, then argmax: ``GaussianEvent(σ/√2)`` per query (Δ = √2;
  its RDP is λ/σ², the paper's Proposition 8).
* Confident-GNMax: the check ``max_j n_j + N(0, σ₁²) ≥ T`` is a Gaussian on a count of
  sensitivity 1, ``GaussianEvent(σ₁)``, and runs on every query; the answer is GNMax with σ₂.
  Every query is charged both, answered or not: the released pair (passed, answer-if-passed) is
  post-processing of the check and of a GNMax answer computed every time, so this charge is sound
  whatever the check says, and the ε of ``k`` queries is fixed before any data is seen.

The paper's data-dependent analysis (smooth sensitivity of the per-query RDP) is not
implemented: a data-dependent ε is itself a function of the private votes, and releasing it needs
that extra smooth-sensitivity mechanism to be sound. The ε dpfy releases is the data-independent
one; it is larger, never smaller, than what the paper reports for the same σ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dpfy._validate import check_count, check_positive
from dpfy.plan.accounting import ComposedEvent, DpEvent, GaussianEvent
from dpfy.train.noise.source import NoiseSource

#: The class ``ConfidentGNMax`` returns for a query whose noisy threshold check failed.
UNANSWERED = -1

_SQRT2 = math.sqrt(2.0)


def vote_histogram(votes: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Counts per class of ``votes`` (teachers × queries): the (queries × classes) histogram."""
    num_classes = check_count("num_classes", num_classes, minimum=2)
    if votes.dim() != 2:
        raise ValueError(f"votes must be (teachers, queries), got shape {tuple(votes.shape)}")
    if votes.numel() and (int(votes.min()) < 0 or int(votes.max()) >= num_classes):
        raise ValueError(f"every vote must be a class in [0, {num_classes}); got one outside")
    counts = torch.zeros(votes.shape[1], num_classes, dtype=torch.float64)
    counts.scatter_add_(1, votes.t().long(), torch.ones(counts.shape[0], votes.shape[0]).double())
    return counts


@dataclass(frozen=True)
class GNMax:
    """Noisy argmax with Gaussian noise of std σ on each vote count."""

    noise_multiplier: float

    def __post_init__(self) -> None:
        check_positive("noise_multiplier", self.noise_multiplier)

    def query_event(self) -> DpEvent:
        """One query's cost: a Gaussian of noise multiplier σ/√2 (L2 sensitivity √2)."""
        return GaussianEvent(self.noise_multiplier / _SQRT2)

    def aggregate(self, histogram: torch.Tensor, noise: NoiseSource) -> torch.Tensor:
        """Each query's label: argmax of its counts plus fresh N(0, σ²) noise."""
        noisy = histogram + noise.normal(histogram, self.noise_multiplier)
        return noisy.argmax(dim=1)

    def spec(self) -> dict[str, Any]:
        """Plain-JSON settings: what a saved ledger is bound to."""
        return {"kind": "gnmax", "noise_multiplier": self.noise_multiplier}


@dataclass(frozen=True)
class ConfidentGNMax:
    """Answer only when the noisy top count clears ``threshold``; then GNMax with σ₂."""

    threshold: float
    threshold_noise: float
    noise_multiplier: float

    def __post_init__(self) -> None:
        check_positive("threshold", self.threshold)
        check_positive("threshold_noise", self.threshold_noise)
        check_positive("noise_multiplier", self.noise_multiplier)

    def query_event(self) -> DpEvent:
        """One query's cost, answered or not: the check (σ₁, Δ = 1) and the answer (σ₂, Δ = √2)."""
        return ComposedEvent(
            (GaussianEvent(self.threshold_noise), GaussianEvent(self.noise_multiplier / _SQRT2))
        )

    def aggregate(self, histogram: torch.Tensor, noise: NoiseSource) -> torch.Tensor:
        """Each query's label, or :data:`UNANSWERED` where the noisy check failed."""
        top = histogram.max(dim=1).values
        passed = top + noise.normal(top, self.threshold_noise) >= self.threshold
        labels = GNMax(self.noise_multiplier).aggregate(histogram, noise)
        return torch.where(passed, labels, torch.full_like(labels, UNANSWERED))

    def spec(self) -> dict[str, Any]:
        """Plain-JSON settings: what a saved ledger is bound to."""
        return {
            "kind": "confident-gnmax",
            "threshold": self.threshold,
            "threshold_noise": self.threshold_noise,
            "noise_multiplier": self.noise_multiplier,
        }


Aggregator = GNMax | ConfidentGNMax


def aggregator_from_spec(spec: Any) -> Aggregator:
    """The aggregator a :meth:`spec` dict describes; a ValueError naming the problem if none."""
    if not isinstance(spec, dict) or spec.get("kind") not in ("gnmax", "confident-gnmax"):
        raise ValueError(
            f"aggregator settings must name kind 'gnmax' or 'confident-gnmax'; got {spec!r}"
        )
    settings = {k: v for k, v in spec.items() if k != "kind"}
    kind = GNMax if spec["kind"] == "gnmax" else ConfidentGNMax
    try:
        return kind(**settings)
    except TypeError as err:
        raise ValueError(
            f"aggregator settings {spec!r} do not fit {kind.__name__}: {err}"
        ) from None
