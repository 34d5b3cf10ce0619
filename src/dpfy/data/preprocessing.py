"""What was done to a dataset's features, and whether it looked at the private training data.

A statistic fitted on the private training split (a mean, a standard deviation, a vocabulary) is
itself a release about that data that DP-SGD does not cover (guide §5.5.1, tab. 5). dpfy's loaders
prefer fixed public constants; where they do fit, the :class:`Preprocessing` record says so, and
the report card flags it unless the user declared the statistics public.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Preprocessing", "Standardizer", "fit_standardizer"]


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
