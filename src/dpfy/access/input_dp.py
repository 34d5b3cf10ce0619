"""Input-level DP (guide §3.2): a local randomiser privatises each record before any training.

Each record is randomised on its own, so the *data itself* carries the guarantee — local DP, per
record: whatever is trained on the randomised records, by anyone, is post-processing (guide
§2.2), and the curator need not be trusted with the model. The price is noise on every record.

A record's features are first clipped into public bounds ``[low_j, high_j]`` (constants published
with the dataset, never computed from it), which bounds how far apart any two records can be:

- Laplace: ℓ₁ distance at most Δ₁ = Σ_j (high_j − low_j), so Laplace noise of scale Δ₁/ε_x on
  every feature is ε_x-LDP (Dwork & Roth 2014, Thm 3.6);
- Gaussian: ℓ₂ distance at most Δ₂ = ‖high − low‖₂, and N(0, σ²) with σ from the analytic
  calibration (Balle & Wang 2018) is (ε_x, δ)-LDP;
- the label, a categorical value, goes through k-ary randomised response at ε_y (Warner 1965).

Features and label compose sequentially on the record: ε = ε_x + ε_y (δ only from the Gaussian).
Unbounded features have no finite sensitivity and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpfy._validate import check_delta, check_positive, check_range
from dpfy.plan.mechanisms import (
    analytic_gaussian_sigma,
    gaussian_mechanism,
    laplace_mechanism,
    randomized_response,
)

__all__ = ["INPUT_MECHANISMS", "FeatureBounds", "InputRandomiser", "RandomisedRecords"]

#: The feature randomisers offered: Laplace (pure ε) or Gaussian (ε, δ).
INPUT_MECHANISMS = ("laplace", "gaussian")


@dataclass(frozen=True)
class FeatureBounds:
    """Public per-feature bounds of a record, and where they come from (stated in the report)."""

    low: np.ndarray
    high: np.ndarray
    source: str

    @classmethod
    def uniform(cls, low: float, high: float, features: int, source: str) -> FeatureBounds:
        """The same public range for every feature (pixels, or features scaled into [-1, 1])."""
        return cls(np.full(features, float(low)), np.full(features, float(high)), source)

    def __post_init__(self) -> None:
        low, high = np.asarray(self.low, float).ravel(), np.asarray(self.high, float).ravel()
        if low.shape != high.shape or not low.size:
            raise ValueError("bounds need one (low, high) pair per feature")
        if not (np.all(np.isfinite(low)) and np.all(np.isfinite(high))):
            raise ValueError(
                "input-level DP needs a finite public bound on every feature: an unbounded "
                "feature has no finite sensitivity; clip it to published bounds first"
            )
        if np.any(high <= low):
            raise ValueError("each feature's upper bound must exceed its lower bound")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    @property
    def l1_width(self) -> float:
        """Δ₁: the largest ℓ₁ distance between two records inside the bounds."""
        return float(np.sum(self.high - self.low))

    @property
    def l2_width(self) -> float:
        """Δ₂: the largest ℓ₂ distance between two records inside the bounds."""
        return float(np.linalg.norm(self.high - self.low))


@dataclass(frozen=True)
class RandomisedRecords:
    """The privatised records, and the noise actually used (what the report states)."""

    features: np.ndarray
    labels: np.ndarray | None
    noise_scale: float  # Laplace scale b, or Gaussian σ, per feature
    sensitivity: float  # Δ₁ (Laplace) or Δ₂ (Gaussian) of one record's features


@dataclass(frozen=True)
class InputRandomiser:
    """Privatise records at ε per record: ``label_share`` of ε goes to the label's RR.

    ``label_share = 0`` leaves labels untouched (then only the features are protected, which the
    report must say); otherwise ε_y = share·ε and ε_x = ε − ε_y.
    """

    bounds: FeatureBounds
    epsilon: float
    mechanism: str = "laplace"
    delta: float | None = None
    label_share: float = 0.5

    def __post_init__(self) -> None:
        check_positive("epsilon", self.epsilon)
        check_range("label_share", self.label_share, 0.0, 1.0, low_open=False)
        if self.mechanism not in INPUT_MECHANISMS:
            raise ValueError(
                f"input mechanism must be one of {', '.join(INPUT_MECHANISMS)}; "
                f"got {self.mechanism!r}"
            )
        if self.mechanism == "gaussian":
            if self.delta is None:
                raise ValueError("the Gaussian randomiser needs delta (it is (ε, δ)-DP)")
            check_delta(self.delta)

    @property
    def feature_epsilon(self) -> float:
        """ε_x: the part of the record's ε spent on its features."""
        return self.epsilon * (1.0 - self.label_share)

    @property
    def label_epsilon(self) -> float:
        """ε_y: the part spent on its label (0: labels not randomised)."""
        return self.epsilon * self.label_share

    @property
    def sensitivity(self) -> float:
        """Δ of one record's features under the chosen noise (ℓ₁ for Laplace, ℓ₂ Gaussian)."""
        return self.bounds.l1_width if self.mechanism == "laplace" else self.bounds.l2_width

    @property
    def noise_scale(self) -> float:
        """Laplace scale Δ₁/ε_x, or the analytic Gaussian σ for (Δ₂, ε_x, δ)."""
        if self.mechanism == "laplace":
            return self.sensitivity / self.feature_epsilon
        assert self.delta is not None
        return analytic_gaussian_sigma(self.sensitivity, self.feature_epsilon, self.delta)

    def __call__(
        self,
        features: np.ndarray,
        labels: np.ndarray | None = None,
        num_classes: int | None = None,
        rng: np.random.Generator | None = None,
    ) -> RandomisedRecords:
        """Clip each record into the bounds, add its noise, and randomise its label."""
        x = np.asarray(features, dtype=float).reshape(len(features), -1)
        if x.shape[1] != self.bounds.low.size:
            raise ValueError(
                f"records have {x.shape[1]} features but the bounds name {self.bounds.low.size}"
            )
        clipped = np.clip(x, self.bounds.low, self.bounds.high)
        if self.mechanism == "laplace":
            released = laplace_mechanism(clipped, self.sensitivity, self.feature_epsilon, rng)
        else:
            released = gaussian_mechanism(
                clipped, self.sensitivity, self.feature_epsilon, self.delta, rng
            )
        noisy_labels = None
        if labels is not None and self.label_share > 0:
            if num_classes is None:
                raise ValueError("num_classes is needed to randomise the labels")
            noisy_labels = randomized_response(labels, num_classes, self.label_epsilon, rng).output
        elif labels is not None:
            noisy_labels = np.asarray(labels)
        return RandomisedRecords(
            np.asarray(released.output).reshape(np.shape(features)),
            noisy_labels,
            self.noise_scale,
            self.sensitivity,
        )
