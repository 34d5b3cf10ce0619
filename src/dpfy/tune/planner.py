"""The σC/B planner (guide §5.4.1 step 4): hold σ·C/B, find the (B, σ, steps) that meet ε.

When privacy and accuracy are both fixed, the guide suggests keeping σ·C/B — the standard
deviation of the noise on the averaged gradient — at the value that gave the target accuracy, and
choosing the batch size B (and with it σ = ratio·B/C) so that the run meets (ε, δ): a larger
batch buys privacy with compute. This rests on an assumption — that for large B accuracy depends
mainly on σC/B — which the guide attributes to earlier work and says must be checked. The plan
says so every time (a :class:`RatioAssumptionWarning` and the ``caveat`` text), and gives each
setting's compute cost so the price of privacy is visible. Built on
:func:`dpfy.plan.accounting.calibrate.settings_at_fixed_ratio`, which does the accounting.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from dpfy._validate import check_positive
from dpfy.plan.accounting.calibrate import FixedRatioSetting, settings_at_fixed_ratio

RATIO_CAVEAT = (
    "This plan assumes accuracy depends mainly on σ·C/B for large batches, an assumption the "
    "guide attributes to earlier work and says needs checking (§5.4.1 step 4): train one of the "
    "planned settings and confirm its accuracy matches the reference run before relying on it."
)


class RatioAssumptionWarning(UserWarning):
    """The σC/B plan rests on an unchecked assumption; confirm with one run."""


@dataclass(frozen=True)
class PlannedSetting:
    """One (B, σ, steps) at the fixed ratio with its ε and its compute cost."""

    epochs: float
    batch_size: int
    noise_multiplier: float
    steps: int
    sampling_rate: float
    epsilon: float
    meets_target: bool
    gradient_evaluations: int  # per-example gradients computed: steps × B (expected)
    relative_compute: float  # gradient evaluations ÷ those of the cheapest setting that meets ε
    estimated_seconds: float | None

    def as_dict(self) -> dict[str, float | int | bool | None]:
        """Plain JSON."""
        return asdict(self)


@dataclass(frozen=True)
class RatioPlan:
    """Every setting examined, and the caveat that must travel with it."""

    noise_to_batch_ratio: float
    clip_norm: float
    target_epsilon: float
    delta: float
    settings: tuple[PlannedSetting, ...]
    caveat: str = RATIO_CAVEAT

    @property
    def feasible(self) -> tuple[PlannedSetting, ...]:
        """The settings that meet the target ε, cheapest compute first."""
        return tuple(
            sorted(
                (s for s in self.settings if s.meets_target), key=lambda s: s.gradient_evaluations
            )
        )


def noise_to_batch_ratio(noise_multiplier: float, clip_norm: float, batch_size: float) -> float:
    """σ·C/B of a run that gave good accuracy: the noise std on the averaged gradient."""
    return (
        check_positive("noise_multiplier", noise_multiplier)
        * check_positive("clip_norm", clip_norm)
        / check_positive("batch_size", batch_size)
    )


def plan_at_fixed_ratio(
    ratio: float,
    clip_norm: float,
    dataset_size: int,
    target_epsilon: float,
    delta: float,
    *,
    epochs: Sequence[float] = (1, 2, 5, 10, 20),
    batch_sizes: Sequence[int] | None = None,
    accountant: str = "pld",
    seconds_per_gradient: float | None = None,
) -> RatioPlan:
    """Every (epochs, B) at σ = ratio·B/C, its ε and compute; warns about the ratio assumption.

    ``seconds_per_gradient`` (measured throughput, optional) turns gradient evaluations into an
    estimated wall time.
    """
    if not epochs:
        raise ValueError("epochs grid is empty: give at least one number of epochs, e.g. 1,5,20")
    if seconds_per_gradient is not None:
        check_positive("seconds_per_gradient", seconds_per_gradient)
    raw: list[tuple[float, FixedRatioSetting]] = []
    for count in epochs:
        for setting in settings_at_fixed_ratio(
            ratio, clip_norm, dataset_size, count, target_epsilon, delta, batch_sizes,
            accountant=accountant,
        ):  # fmt: skip
            raw.append((float(count), setting))
    cheapest = min((s.examples_processed for _, s in raw if s.meets_target), default=None)
    planned = tuple(
        PlannedSetting(
            epochs=count,
            batch_size=s.batch_size,
            noise_multiplier=s.noise_multiplier,
            steps=s.steps,
            sampling_rate=s.sampling_rate,
            epsilon=s.epsilon,
            meets_target=s.meets_target,
            gradient_evaluations=s.examples_processed,
            relative_compute=s.examples_processed / cheapest if cheapest else float("nan"),
            estimated_seconds=None
            if seconds_per_gradient is None
            else s.examples_processed * seconds_per_gradient,
        )
        for count, s in raw
    )
    warnings.warn(RATIO_CAVEAT, RatioAssumptionWarning, stacklevel=2)
    return RatioPlan(ratio, clip_norm, target_epsilon, delta, planned)


__all__ = [
    "RATIO_CAVEAT",
    "PlannedSetting",
    "RatioAssumptionWarning",
    "RatioPlan",
    "noise_to_batch_ratio",
    "plan_at_fixed_ratio",
]
