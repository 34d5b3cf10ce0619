"""ClipSearch: the smallest clip norm C that costs little utility (guide §5.4.1 step 2).

Short runs over a grid of C — with zero noise, as the guide recommends, when the tuning data is
public; with the run's σ when it is private and accounted — and the pick is the smallest C whose
validation accuracy is within a relative ``tolerance`` of the best: ``acc(C) ≥ (1 − tol)·best``.
The guide says to err on the small side: a C above the typical per-example gradient norm makes
the noise σC swamp the gradient (§5.4.1, fig. 2). The per-example gradient norms the trials saw
are kept so the choice can be seen against their distribution (:func:`~dpfy.tune.plots`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpfy._validate import check_positive
from dpfy.tune.search import check_grid, check_tolerance, trial_at
from dpfy.tune.trial import TrialConfig, TrialResult

DEFAULT_CLIP_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


@dataclass(frozen=True)
class ClipChoice:
    """The chosen C, the accuracy per C, and the unclipped gradient-norm quantiles seen."""

    max_grad_norm: float
    accuracy_by_clip: dict[float, float]
    best_accuracy: float
    tolerance: float
    norm_quantiles: dict[str, float]
    rule_choice: float | None = None  # what the search's own rule picks, if the tuner chose else

    @property
    def indistinct(self) -> bool:
        """Whether every C tried is within the tolerance of the best: the trials did not tell
        the clip norms apart (too short or too noisy), so the rule just takes the smallest."""
        return min(self.accuracy_by_clip.values()) >= (1 - self.tolerance) * self.best_accuracy

    def statement(self) -> str:
        """One sentence: what was chosen and by which rule."""
        if self.rule_choice is not None and self.rule_choice != self.max_grad_norm:
            return (
                f"C = {self.max_grad_norm:g}, chosen by the accounting method's selection rule "
                f"(validation accuracy {self.accuracy_by_clip[self.max_grad_norm]:.4f}); "
                f"ClipSearch's own rule (smallest C within {self.tolerance:.0%} of the best, "
                f"{self.best_accuracy:.4f}) would pick C = {self.rule_choice:g}"
            )
        return (
            f"C = {self.max_grad_norm:g}: the smallest clip norm whose validation accuracy "
            f"({self.accuracy_by_clip[self.max_grad_norm]:.4f}) is within {self.tolerance:.0%} "
            f"of the best ({self.best_accuracy:.4f}); median unclipped per-example gradient norm "
            f"{self.norm_quantiles.get('median', math.nan):.3g}"
        )


def choose_clip(accuracy_by_clip: dict[float, float], tolerance: float) -> tuple[float, float]:
    """(smallest C with accuracy ≥ (1 − tolerance)·best, best accuracy)."""
    tolerance = check_tolerance(tolerance)
    if not accuracy_by_clip:
        raise ValueError("no clip norm was tried: the grid is empty")
    best = max(accuracy_by_clip.values())
    floor = (1.0 - tolerance) * best
    chosen = min(c for c, acc in accuracy_by_clip.items() if acc >= floor)
    return chosen, best


def norm_quantiles(norms: np.ndarray) -> dict[str, float]:
    """The distribution of unclipped per-example gradient norms, summarised."""
    if norms.size == 0:
        return {}
    p10, p25, p50, p75, p90 = np.quantile(norms, [0.1, 0.25, 0.5, 0.75, 0.9])
    return {
        "p10": float(p10),
        "p25": float(p25),
        "median": float(p50),
        "p75": float(p75),
        "p90": float(p90),
        "max": float(norms.max()),
        "count": float(norms.size),
    }


@dataclass(frozen=True)
class ClipSearch:
    """Short runs over a C grid at one lr and one σ (0: the guide's zero-noise sweep)."""

    grid: Sequence[float] = DEFAULT_CLIP_GRID
    tolerance: float = 0.02
    lr: float = 0.01
    noise_multiplier: float = 0.0
    epochs: float = 2.0
    batch_size: int = 128
    model: str = "mlp"
    optimizer: str = "adam"
    seed: int | None = None  # every trial's sampling and noise; None: OS entropy
    name: str = "clip"

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", check_grid("clip norm", self.grid))
        check_tolerance(self.tolerance)
        check_positive("lr", self.lr)

    def candidates(self) -> list[TrialConfig]:
        """One short run per C in the grid."""
        return [trial_at(self, c, self.lr) for c in self.grid]

    def summarise(self, results: Sequence[TrialResult], chosen: float | None = None) -> ClipChoice:
        """Mean accuracy per C tried, the chosen C and the gradient-norm distribution.

        ``chosen`` is the C the tuner actually selected when its accounting method chose by
        another rule (a fixed order, the exponential mechanism); by default the search's own.
        """
        by_clip: dict[float, list[float]] = {}
        for result in results:
            by_clip.setdefault(result.config.max_grad_norm, []).append(result.accuracy)
        accuracy = {c: float(np.mean(v)) for c, v in sorted(by_clip.items())}
        norms = [r.norms for r in results if r.norms.size]
        all_norms = np.concatenate(norms) if norms else np.zeros(0)
        rule, best = choose_clip(accuracy, self.tolerance)
        return ClipChoice(
            rule if chosen is None else chosen,
            accuracy,
            best,
            self.tolerance,
            norm_quantiles(all_norms),
            rule_choice=rule,
        )

    def choose(self, results: Sequence[TrialResult]) -> TrialResult:
        """The first run of the chosen C (the smallest within tolerance of the best)."""
        chosen = self.summarise(results).max_grad_norm
        return next(r for r in results if r.config.max_grad_norm == chosen)

    def rank_key(self, result: TrialResult) -> tuple[float, ...]:
        """Fixed order for random trials: accuracy bucket of relative width ``tolerance``, then
        the smaller C.

        Two accuracies in the same bucket differ by less than the tolerance (relatively), so the
        smaller C wins among near-equal runs, as the search's own rule intends — but the order is
        fixed in advance, as repeat-and-select requires (Papernot & Steinke 2022).
        """
        acc = max(result.accuracy, 1e-12)
        bucket = math.floor(math.log(acc) / -math.log1p(-self.tolerance))
        return (float(bucket), -result.config.max_grad_norm, -result.config.lr)


__all__ = ["DEFAULT_CLIP_GRID", "ClipChoice", "ClipSearch", "choose_clip", "norm_quantiles"]
