"""The lr × C sweep at fixed noise (guide §5.4.1 step 3, fig. 2).

After σ is set, tune the learning rate and clip norm together: the guide's sweep shows a diagonal
of near-equal accuracy along which lr·C is roughly constant (for SGD, the update scales with
lr·C once most gradients are clipped). The result holds the full accuracy grid for the heatmap
(:func:`dpfy.tune.plots.plot_lr_clip_heatmap`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpfy._validate import check_positive
from dpfy.tune.search import accuracy_rank, best_by_accuracy, check_grid, trial_at
from dpfy.tune.trial import TrialConfig, TrialResult

DEFAULT_LR_GRID = (0.001, 0.003, 0.01, 0.03, 0.1)
DEFAULT_SWEEP_CLIPS = (0.1, 0.3, 1.0, 3.0)


@dataclass(frozen=True)
class SweepGrid:
    """Accuracy over lr (rows) × C (columns); NaN where a pair was not run."""

    lrs: tuple[float, ...]
    clips: tuple[float, ...]
    accuracy: np.ndarray
    chosen: tuple[float, float]  # (lr, C)

    def to_dict(self) -> dict[str, object]:
        """Plain JSON (NaN as None)."""
        return {
            "lrs": list(self.lrs),
            "clips": list(self.clips),
            "accuracy": [[None if np.isnan(v) else float(v) for v in row] for row in self.accuracy],
            "chosen": {"lr": self.chosen[0], "max_grad_norm": self.chosen[1]},
        }


@dataclass(frozen=True)
class LrClipSweep:
    """Every (lr, C) pair of two grids, at one σ, for a short schedule."""

    lrs: Sequence[float] = DEFAULT_LR_GRID
    clips: Sequence[float] = DEFAULT_SWEEP_CLIPS
    noise_multiplier: float = 1.0
    epochs: float = 2.0
    batch_size: int = 128
    model: str = "mlp"
    optimizer: str = "sgd"
    seed: int | None = None  # every trial's sampling and noise; None: OS entropy
    name: str = "lr-clip"

    def __post_init__(self) -> None:
        object.__setattr__(self, "lrs", check_grid("learning rate", self.lrs))
        object.__setattr__(self, "clips", check_grid("clip norm", self.clips))
        check_positive("noise_multiplier", self.noise_multiplier)

    def candidates(self) -> list[TrialConfig]:
        """One short run per (lr, C)."""
        return [trial_at(self, c, lr) for lr in self.lrs for c in self.clips]

    def grid(self, results: Sequence[TrialResult], chosen: TrialResult) -> SweepGrid:
        """Mean accuracy per (lr, C) run, with the chosen pair."""
        table = np.full((len(self.lrs), len(self.clips)), np.nan)
        sums: dict[tuple[int, int], list[float]] = {}
        for result in results:
            key = (self.lrs.index(result.config.lr), self.clips.index(result.config.max_grad_norm))
            sums.setdefault(key, []).append(result.accuracy)
        for (i, j), values in sums.items():
            table[i, j] = float(np.mean(values))
        return SweepGrid(
            tuple(self.lrs),
            tuple(self.clips),
            table,
            (chosen.config.lr, chosen.config.max_grad_norm),
        )

    def choose(self, results: Sequence[TrialResult]) -> TrialResult:
        """The most accurate pair (ties: smaller C, then smaller lr)."""
        return best_by_accuracy(results)

    def rank_key(self, result: TrialResult) -> tuple[float, ...]:
        """Fixed order: accuracy, then smaller C, then smaller lr."""
        return accuracy_rank(result)


__all__ = ["DEFAULT_LR_GRID", "DEFAULT_SWEEP_CLIPS", "LrClipSweep", "SweepGrid"]
