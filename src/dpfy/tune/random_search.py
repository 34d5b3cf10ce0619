"""Random search: configurations drawn log-uniformly from lr and C ranges, fixed by a seed.

The draw happens before any data is seen (from the seed alone), so the candidate set does not
depend on the private data — as the exponential mechanism and repeat-and-select require.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpfy._validate import check_count, check_positive
from dpfy.jobs.config import public_seed
from dpfy.tune.search import accuracy_rank, best_by_accuracy, trial_at
from dpfy.tune.trial import TrialConfig, TrialResult


def _check_span(name: str, span: tuple[float, float]) -> tuple[float, float]:
    """A (low, high) range of positive numbers with low ≤ high."""
    low, high = (check_positive(f"{name} range", v) for v in span)
    if low > high:
        raise ValueError(f"{name} range must be (low, high) with low <= high, got {span}")
    return low, high


@dataclass(frozen=True)
class RandomSearch:
    """``count`` configurations with lr and C log-uniform in the given ranges."""

    count: int = 10
    lr_range: tuple[float, float] = (1e-3, 1e-1)
    clip_range: tuple[float, float] = (0.03, 3.0)
    noise_multiplier: float = 1.0
    epochs: float = 2.0
    batch_size: int = 128
    model: str = "mlp"
    optimizer: str = "adam"
    seed: int | None = None  # every trial's sampling and noise; None: OS entropy
    name: str = "random"

    def __post_init__(self) -> None:
        check_count("count", self.count, minimum=1)
        _check_span("lr", self.lr_range)
        _check_span("clip", self.clip_range)

    def candidates(self) -> list[TrialConfig]:
        """``count`` log-uniform draws, reproducible from ``seed`` (fixed at 0 when unset).

        The draw sees no data, so it is public and stays reproducible (``public_seed``) even when
        the trials' sampling and noise come from OS entropy.
        """
        rng = np.random.default_rng(public_seed(self.seed))
        logs = np.log([self.lr_range, self.clip_range])
        draws = rng.uniform(logs[:, 0], logs[:, 1], size=(self.count, 2))
        return [
            trial_at(self, float(f"{np.exp(c):.4g}"), float(f"{np.exp(lr):.4g}")) for lr, c in draws
        ]

    def choose(self, results: Sequence[TrialResult]) -> TrialResult:
        """The most accurate run."""
        return best_by_accuracy(results)

    def rank_key(self, result: TrialResult) -> tuple[float, ...]:
        """Fixed order: accuracy, then smaller C, then smaller lr."""
        return accuracy_rank(result)


__all__ = ["RandomSearch"]
