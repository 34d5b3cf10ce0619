"""RDP of hyperparameter tuning with a random number of trials, releasing the best (Papernot &
Steinke 2022, "Hyperparameter tuning with Renyi differential privacy")."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy import optimize

from dpfy.plan.accounting.events import (
    NeighbouringRelation,
    RepeatAndSelectEvent,
    TrialDistribution,
)
from dpfy.plan.accounting.rdp_composition import _curve, _rule, rdp_unsupported_reason
from dpfy.plan.accounting.rdp_conversion import _log_delta_per_order
from dpfy.plan.accounting.rdp_numerics import _log_expm1


# -- randomised number of trials (Papernot & Steinke 2022) --------------------------------------
def _repeat_reason(event: RepeatAndSelectEvent, relation: NeighbouringRelation) -> str | None:
    """Repeat-and-select needs only the base mechanism's RDP curve."""
    return rdp_unsupported_reason(event.event, relation)


def _poisson_trials_curve(base: np.ndarray, orders: np.ndarray, mean: float) -> np.ndarray:
    """K ~ Poisson(μ): Papernot & Steinke 2022, Theorem 6.

    ε'(λ) = ε(λ) + μ·δ̂ + log(μ)/(λ−1), where the base is (ε̂, δ̂)-DP with ε̂ = log(1 + 1/(λ−1));
    δ̂ is read off the base curve with the conversion of ``delta_from_rdp``.
    """
    eps_hat = np.log1p(1.0 / (orders - 1))
    if np.any(base > 0):
        log_delta_hat = np.min(_log_delta_per_order(base, orders, eps_hat), axis=1)
        delta_hat = np.exp(np.minimum(log_delta_hat, 0.0))
    else:
        delta_hat = np.zeros_like(orders)
    return np.maximum(base + mean * delta_hat + math.log(mean) / (orders - 1), 0.0)


def _log_u_over_one_minus_exp(u: float) -> float:
    """log(u / (1 − e^{−u})), continuous through u = 0 where it is 0."""
    if u == 0:
        return 0.0
    if u > 0:
        return math.log(u) - math.log(-math.expm1(-u))
    return math.log(-u) - float(_log_expm1(-u))


def _log_tnb_mean(t: float, shape: float) -> float:
    """log E[K] of the truncated negative binomial with γ = e^{−t} (Papernot & Steinke 2022, §2).

    E[K] = η(1−γ)/(γ(1−γ^η)) = (e^t − 1)/t · ηt/(1 − e^{−ηt}); the η → 0 limit (logarithmic
    distribution, (1/γ − 1)/log(1/γ)) is the same expression with the last factor equal to 1.
    """
    return float(_log_expm1(t)) - math.log(t) + _log_u_over_one_minus_exp(shape * t)


def _log_inverse_gamma(mean: float, shape: float) -> float:
    """Solve E[K] = mean for t = log(1/γ); E[K] rises from 1 (t → 0) to ∞ (t → ∞)."""
    target = math.log(mean)

    def gap(t: float) -> float:
        return _log_tnb_mean(t, shape) - target

    low, high = 1e-12, 1.0
    if gap(low) >= 0:
        return low  # mean within 1e-12 of 1: a larger t only loosens the bound
    while gap(high) < 0:
        high *= 2.0
    return float(optimize.brentq(gap, low, high, xtol=1e-15, rtol=1e-15))


def _tnb_trials_curve(
    base: np.ndarray, orders: np.ndarray, mean: float, shape: float
) -> np.ndarray:
    """K ~ truncated negative binomial(η, γ): Papernot & Steinke 2022, Theorem 2.

    ε'(λ) = ε(λ) + (1+η)(1 − 1/λ̂)ε(λ̂) + (1+η)·log(1/γ)/λ̂ + log(E[K])/(λ−1), minimised over λ̂
    in the grid (the minimum does not depend on λ). γ is solved from the mean.
    """
    log_inv_gamma = _log_inverse_gamma(mean, shape)
    with np.errstate(invalid="ignore"):
        hat_terms = (1 + shape) * ((1 - 1 / orders) * base + log_inv_gamma / orders)
    best_hat = float(np.nanmin(np.where(np.isnan(hat_terms), np.inf, hat_terms)))
    return np.maximum(base + best_hat + math.log(mean) / (orders - 1), 0.0)


_TRIAL_RULES: dict[TrialDistribution, Callable[[np.ndarray, np.ndarray, Any], np.ndarray]] = {
    TrialDistribution.POISSON: lambda base, orders, e: _poisson_trials_curve(base, orders, e.mean),
    **dict.fromkeys(
        (
            TrialDistribution.TRUNCATED_NEGATIVE_BINOMIAL,
            TrialDistribution.GEOMETRIC,
            TrialDistribution.LOGARITHMIC,
        ),
        lambda base, orders, e: _tnb_trials_curve(base, orders, e.mean, e.shape),
    ),
}


@_rule(RepeatAndSelectEvent, _repeat_reason)
def _repeat_and_select_curve(
    event: RepeatAndSelectEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """Run the base a random number of times, release the best (Papernot & Steinke 2022)."""
    base = _curve(event.event, relation, orders)
    return _TRIAL_RULES[event.distribution](base, orders, event)
