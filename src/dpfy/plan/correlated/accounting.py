"""The privacy event a correlated-noise run produces, and σ calibrated to a target (ε, δ).

The run releases (adaptively) C x + σ z with z ~ N(0, I): training step t adds
σ · clip · (C⁻¹ z)_t to its clipped gradient sum, so step 1's noise is DP-SGD's σ · clip (c_0 = 1).

``MinSeparation`` (no sampling): the whole run is ONE Gaussian mechanism of noise multiplier
σ/Δ(C), Δ from :mod:`.sensitivity` (Denisov et al. 2022 for adaptivity; Choquette-Choo et al.
2022 for multiple participations). Derived with the stream's order fixed in advance, so the
neighbour replaces an example's gradients by zero (zero-out); replace-one doubles Δ, which the
accountants apply themselves.

``CyclicPoisson(b)`` with a C of at most b bands and a known sampling rate q̃ (= expected batch
/ group size), by the amplification theorem of Choquette-Choo et al. 2023 ("(Amplified) Banded
Matrix Factorization") for cyclic Poisson sampling: an example's ⌈n/b⌉ possible steps touch
disjoint rows of C, so the run is ⌈n/b⌉ composed Poisson-subsampled Gaussians with noise
multiplier σ / (largest column norm of C) (every column's norm is bounded by the largest: an
upper bound on the cost when later columns are shorter). Add-or-remove adjacency; groups fixed
independently of the data.

Anything else under ``CyclicPoisson`` (more bands than groups, a BLT, no sampling rate) is
charged without amplification, as ``MinSeparation(⌈n/b⌉, b)``: sound (sampling only removes
participations; the hockey-stick divergence is jointly convex), never optimistic.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpfy._validate import check_count, check_positive, check_sampling_rate
from dpfy.plan.accounting.calibrate import smallest_noise_multiplier
from dpfy.plan.accounting.events import (
    DpEvent,
    GaussianEvent,
    NeighbouringRelation,
    PoissonSampledEvent,
    SelfComposedEvent,
)
from dpfy.plan.correlated.participation import (
    CyclicPoisson,
    Participation,
    check_participation,
)
from dpfy.plan.correlated.sensitivity import (
    Sensitivity,
    amplification_applies,
    column_norm_squared,
    toeplitz_sensitivity_squared,
)
from dpfy.plan.correlated.toeplitz import ToeplitzStrategy


def min_separation_event(noise_multiplier: float, sensitivity: float) -> GaussianEvent:
    """The whole run as one Gaussian mechanism: noise multiplier σ / Δ."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    return GaussianEvent(sigma / check_positive("sensitivity", sensitivity))


def amplified_banded_event(
    noise_multiplier: float, column_norm: float, rounds: int, sampling_rate: float
) -> DpEvent:
    """``rounds`` composed Poisson(q̃)-sampled Gaussians of noise multiplier σ / column norm."""
    sigma = check_positive("noise_multiplier", noise_multiplier)
    inner = GaussianEvent(sigma / check_positive("column_norm", column_norm))
    sampled = PoissonSampledEvent(check_sampling_rate(sampling_rate), inner)
    return SelfComposedEvent(sampled, check_count("rounds", rounds, minimum=1))


@dataclass(frozen=True)
class CorrelatedAccounting:
    """What a run is charged: the event, the sensitivity behind it, and the relation assumed."""

    event: DpEvent
    sensitivity: Sensitivity
    amplified: bool
    relation: NeighbouringRelation


def correlated_accounting(
    strategy: ToeplitzStrategy, participation: Participation, steps: int, noise_multiplier: float
) -> CorrelatedAccounting:
    """The event of ``steps`` steps of ``strategy`` under ``participation`` at noise σ."""
    steps = check_count("steps", steps, minimum=1)
    schema = check_participation(participation)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    coefficients = strategy.toeplitz(steps)
    if (
        isinstance(schema, CyclicPoisson)
        and amplification_applies(strategy.bands, schema)
        and schema.sampling_rate is not None
    ):
        squared = column_norm_squared(coefficients, steps)
        sensitivity = Sensitivity(squared, True, "amplified rounds: the largest column norm")
        event = amplified_banded_event(
            sigma, sensitivity.norm, schema.rounds(steps), schema.sampling_rate
        )
        return CorrelatedAccounting(event, sensitivity, True, NeighbouringRelation.ADD_OR_REMOVE)
    sensitivity = toeplitz_sensitivity_squared(coefficients, steps, schema)
    event = min_separation_event(sigma, sensitivity.norm)
    return CorrelatedAccounting(event, sensitivity, False, NeighbouringRelation.ZERO_OUT)


def correlated_event(
    strategy: ToeplitzStrategy, participation: Participation, steps: int, noise_multiplier: float
) -> DpEvent:
    """Just the event of :func:`correlated_accounting`."""
    return correlated_accounting(strategy, participation, steps, noise_multiplier).event


def calibrate_correlated_noise(
    strategy: ToeplitzStrategy,
    participation: Participation,
    steps: int,
    target_epsilon: float,
    delta: float,
    *,
    accountant: str = "pld",
    relation: NeighbouringRelation | str | None = None,
    rtol: float = 1e-3,
) -> float:
    """The smallest σ (within ``rtol``) whose run meets (ε, δ); its ε is never above the target.

    Reuses dpfy's calibration (root finding, then confirmed with the full accountant, moved to
    the safe side). ``relation`` defaults to the one the event was derived under.
    """
    first = correlated_accounting(strategy, participation, steps, 1.0)
    return smallest_noise_multiplier(
        lambda sigma: correlated_event(strategy, participation, steps, sigma),
        target_epsilon,
        delta,
        accountant=accountant,
        relation=first.relation if relation is None else relation,
        rtol=rtol,
    )
