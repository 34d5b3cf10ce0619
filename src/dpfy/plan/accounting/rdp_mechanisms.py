"""RDP of the leaf mechanisms in closed form: Gaussian, Laplace and pure DP (Mironov 2017), and
DP-FTRL tree aggregation (Kairouz et al. 2021)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from dpfy.plan.accounting.events import (
    BallsInBinsEpochEvent,
    DpEvent,
    GaussianEvent,
    LaplaceEvent,
    NeighbouringRelation,
    NoOpEvent,
    PureDpEvent,
    TreeAggregationEvent,
    tree_aggregation_reason,
)
from dpfy.plan.accounting.rdp_composition import _rule
from dpfy.plan.accounting.rdp_numerics import _half_square


# -- leaf mechanisms -----------------------------------------------------------------------------
@_rule(NoOpEvent)
def _noop_curve(event: NoOpEvent, relation: NeighbouringRelation, orders: np.ndarray) -> np.ndarray:
    """Touching no private data costs nothing at every order."""
    return np.zeros_like(orders)


@_rule(GaussianEvent)
def _gaussian_curve(
    event: GaussianEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """α·s²/(2σ²) with s the relation's sensitivity factor (Mironov 2017, Table II)."""
    return orders * _half_square(relation.sensitivity_factor / event.noise_multiplier)


@_rule(LaplaceEvent)
def _laplace_curve(
    event: LaplaceEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """Laplace of scale λ = b/s (Mironov 2017, Prop. 6), evaluated in log space.

    ε(α) = log(α/(2α−1)·e^{(α−1)/λ} + (α−1)/(2α−1)·e^{−α/λ}) / (α−1), capped at its α → ∞
    limit 1/λ (the pure-DP ε) against rounding.
    """
    inverse_scale = relation.sensitivity_factor / event.noise_multiplier
    log_moment = np.logaddexp(
        np.log(orders / (2 * orders - 1)) + (orders - 1) * inverse_scale,
        np.log((orders - 1) / (2 * orders - 1)) - orders * inverse_scale,
    )
    return np.clip(log_moment / (orders - 1), 0.0, inverse_scale)


@_rule(PureDpEvent)
def _pure_dp_curve(
    event: PureDpEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """The tightest RDP of any ε-DP mechanism: that of randomised response with e^ε odds.

    Randomised response is the worst case among ε-DP pairs (Asoodeh, Liao, Calmon, Kosut &
    Sankar 2021, "Three variants of differential privacy: lossless conversion and applications";
    Steinke 2023, differentialprivacy.org "Tight RDP & zCDP bounds from pure DP"):
    ε(α) = log((e^{αε} + e^{(1−α)ε}) / (1 + e^ε)) / (α−1). It is never above the classic bounds
    ε (pure DP is (∞, ε)-RDP and D_α grows with α; Mironov 2017, §III) and αε²/2 (Bun & Steinke
    2016, Prop. 3.3); the minimum with them only guards against rounding.
    """
    eps = event.epsilon
    randomised_response = (
        np.logaddexp(orders * eps, (1 - orders) * eps) - np.logaddexp(0.0, eps)
    ) / (orders - 1)
    bound = np.minimum(randomised_response, np.minimum(eps, orders * eps**2 / 2))
    return np.maximum(bound, 0.0)


_PURE_EPSILON: dict[type[DpEvent], Callable[[Any, NeighbouringRelation], float]] = {
    NoOpEvent: lambda event, relation: 0.0,
    LaplaceEvent: lambda event, relation: relation.sensitivity_factor / event.noise_multiplier,
    PureDpEvent: lambda event, relation: event.epsilon,
}


def _pure_epsilon(event: DpEvent, relation: NeighbouringRelation) -> float:
    """The RDP at order ∞ (pure-DP ε) of a leaf event, ∞ when it has none (e.g. Gaussian)."""
    rule = _PURE_EPSILON.get(type(event))
    return math.inf if rule is None else rule(event, relation)


# -- balls-in-bins epochs: refused, with where to go ---------------------------------------------
_BALLS_IN_BINS = (
    "the RDP accountant has no bound for a balls-in-bins epoch (random allocation); the PLD "
    "accountant has one: use accountant='pld'"
)


@_rule(BallsInBinsEpochEvent, lambda event, relation: _BALLS_IN_BINS)
def _balls_in_bins_curve(
    event: BallsInBinsEpochEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:  # pragma: no cover - the reason above refuses every such event first
    raise ValueError(_BALLS_IN_BINS)


# -- DP-FTRL tree aggregation (Kairouz et al. 2021, App. D) --------------------------------------
@_rule(TreeAggregationEvent, lambda event, relation: tree_aggregation_reason(relation))
def _tree_aggregation_curve(
    event: TreeAggregationEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """α·depth·s²/(2σ²): one record sits in at most ``depth`` nodes, each with noise σ·Δ."""
    scale = relation.sensitivity_factor / event.noise_multiplier
    return orders * event.depth * _half_square(scale)
