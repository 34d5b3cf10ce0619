"""What was done to a dataset's features, and whether it looked at the private training data.

A statistic fitted on the private training split (a mean, a standard deviation, a vocabulary) is
itself a release about that data that DP-SGD does not cover (guide §5.5.1, tab. 5). dpfy's loaders
use fixed public constants only (:class:`PublicRangeScaler` for tabular data); where a caller
fits, the :class:`Preprocessing` record says so, and
the report card flags it unless the user declared the statistics public.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Preprocessing", "PublicRangeScaler", "Standardizer", "fit_standardizer"]


@dataclass(frozen=True)
class Preprocessing:
    """The preprocessing steps of a loaded dataset and whether any was fitted on private data.

    ``fitted_on_private_data`` is True when any statistic was computed from the training split
    this run trains on; ``declared_public`` records the user's statement that those statistics are
    public anyway (e.g. they match a published source). :attr:`is_pitfall` is what a report flags.
    """

    steps: tuple[str, ...]
    fitted_on_private_data: bool
    declared_public: bool = False

    @property
    def is_pitfall(self) -> bool:
        """True when statistics came from the private data and nobody declared them public."""
        return self.fitted_on_private_data and not self.declared_public

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary for the privacy report."""
        return {
            "steps": list(self.steps),
            "fitted_on_private_data": self.fitted_on_private_data,
            "declared_public": self.declared_public,
            "pitfall": self.is_pitfall,
        }


@dataclass(frozen=True)
class Standardizer:
    """Per-feature ``(x - mean) / std``; a constant feature (std 0) is only centred."""

    mean: np.ndarray
    std: np.ndarray

    def __call__(self, features: np.ndarray) -> np.ndarray:
        """Apply the same shift and scale to any split (fitted once, applied everywhere)."""
        return ((features - self.mean) / self.std).astype(np.float32)


def fit_standardizer(features: np.ndarray) -> Standardizer:
    """Fit mean and std per column of ``features`` — on private data this is the §5.5.1 pitfall."""
    features = np.asarray(features, dtype=np.float64)
    mean = features.mean(axis=0)
    std = features.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    return Standardizer(mean=mean, std=std)


@dataclass(frozen=True)
class PublicRangeScaler:
    """Scale each feature into [-1, 1] on a log scale between public bounds; nothing is fitted.

    Tabular measurements (areas, counts, money) are non-negative and right-skewed, so each value
    ``x``, clipped to its feature's published range ``[low, high]`` (clipping to a fixed bound
    depends on no other row), maps to ``log(x + s)`` with ``s = (high - low) / 10``, rescaled so
    that ``low`` goes to -1 and ``high`` to +1. The offset ``s`` keeps zeros finite and the
    scale gentle near the bottom of the range. All constants are the bounds: no statistic of the
    data being scaled enters, so this is no release about it.
    """

    low: np.ndarray
    high: np.ndarray

    def __post_init__(self) -> None:
        low, high = np.asarray(self.low, dtype=np.float64), np.asarray(self.high, dtype=np.float64)
        if low.shape != high.shape or low.ndim != 1:
            raise ValueError("low and high must be 1-d arrays of one bound per feature")
        if not (np.all(np.isfinite(low)) and np.all(np.isfinite(high))):
            raise ValueError("the bounds must be finite numbers")
        if np.any(low < 0) or np.any(high <= low):
            raise ValueError("each range must satisfy 0 <= low < high (a log scale needs x >= 0)")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    @classmethod
    def from_ranges(cls, ranges: tuple[tuple[float, float], ...]) -> PublicRangeScaler:
        """From one ``(low, high)`` pair per feature."""
        bounds = np.asarray(ranges, dtype=np.float64).reshape(-1, 2)
        return cls(bounds[:, 0], bounds[:, 1])

    def __call__(self, features: np.ndarray) -> np.ndarray:
        """Scale ``features`` (rows of one value per feature) into [-1, 1]."""
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.low.size:
            raise ValueError(
                f"expected rows of {self.low.size} features, got an array of shape {x.shape}"
            )
        shift = (self.high - self.low) / 10.0
        bottom, top = np.log(self.low + shift), np.log(self.high + shift)
        scaled = np.log(np.clip(x, self.low, self.high) + shift)
        return 2.0 * (scaled - bottom) / (top - bottom) - 1.0
