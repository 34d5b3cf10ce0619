"""What every search offers the tuner: candidate configurations and how to pick among results.

A search proposes a fixed list of :class:`~dpfy.tune.trial.TrialConfig` (fixed before any
private data is seen — a requirement of the exponential mechanism and of repeat-and-select) and
two ways to choose: :meth:`Search.choose`, its own rule over all results (used when every trial's
output is accounted, so any rule is post-processing), and :meth:`Search.rank_key`, a fixed total
order on single results (what Papernot & Steinke 2022 release: the best run by a fixed order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from dpfy._validate import check_range
from dpfy.tune.trial import TrialConfig, TrialResult


class Search(Protocol):
    """A hyperparameter search the tuner can run and account."""

    name: str

    def candidates(self) -> list[TrialConfig]:
        """The configurations to try, fixed before any data is seen."""
        ...

    def choose(self, results: Sequence[TrialResult]) -> TrialResult:
        """The search's own rule over every result."""
        ...

    def rank_key(self, result: TrialResult) -> tuple[float, ...]:
        """A fixed total order on single results: larger is better."""
        ...


class Schedule(Protocol):
    """The settings every candidate of one search shares; only C and the learning rate vary."""

    noise_multiplier: float
    epochs: float
    batch_size: int
    model: str
    optimizer: str
    seed: int | None


def trial_at(schedule: Schedule, max_grad_norm: float, lr: float) -> TrialConfig:
    """The candidate at (C, lr) on the search's shared schedule."""
    return TrialConfig(
        max_grad_norm=max_grad_norm,
        lr=lr,
        noise_multiplier=schedule.noise_multiplier,
        epochs=schedule.epochs,
        batch_size=schedule.batch_size,
        model=schedule.model,
        optimizer=schedule.optimizer,
        seed=schedule.seed,
    )


def check_tolerance(tolerance: float) -> float:
    """A relative tolerance lies strictly inside (0, 1)."""
    try:
        return check_range("tolerance", tolerance, 0.0, 1.0)
    except ValueError:
        raise ValueError(
            f"tolerance must lie in (0, 1), got {tolerance!r}: it is the relative utility loss "
            "accepted for a smaller clip norm, e.g. 0.02 for 'within 2% of the best accuracy'"
        ) from None


def check_grid(name: str, values: Sequence[float]) -> tuple[float, ...]:
    """A grid is a non-empty sequence of distinct positive finite numbers, returned sorted."""
    grid = tuple(float(v) for v in values)
    if not grid:
        raise ValueError(f"{name} grid is empty: give at least one value, e.g. 0.1,0.3,1,3")
    bad = [v for v in grid if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"{name} grid values must be positive finite numbers, got {bad}")
    if len(set(grid)) != len(grid):
        raise ValueError(f"{name} grid has repeated values: {list(grid)}")
    return tuple(sorted(grid))


def best_by_accuracy(results: Sequence[TrialResult]) -> TrialResult:
    """The highest validation accuracy; ties go to the smaller C, then the smaller lr."""
    if not results:
        raise ValueError("no trial results to choose from")
    return max(results, key=lambda r: (r.accuracy, -r.config.max_grad_norm, -r.config.lr))


def accuracy_rank(result: TrialResult) -> tuple[float, ...]:
    """Fixed order: accuracy, then smaller C, then smaller lr."""
    return (result.accuracy, -result.config.max_grad_norm, -result.config.lr)


__all__ = [
    "Schedule",
    "Search",
    "accuracy_rank",
    "best_by_accuracy",
    "check_grid",
    "check_tolerance",
    "trial_at",
]
