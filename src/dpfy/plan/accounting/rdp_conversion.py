"""RDP curve to (ε, δ): the best conversion over the grid of orders (Canonne, Kamath & Steinke
2020, Prop. 12)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpfy._validate import check_delta, check_range

__all__ = ["RdpEpsilon", "delta_from_rdp", "epsilon_from_rdp"]


@dataclass(frozen=True)
class RdpEpsilon:
    """One (ε, δ) guarantee read off an RDP curve, with the order that certified it."""

    epsilon: float
    delta: float
    order: float
    on_grid_edge: bool


def _check_curve(
    rdp: Sequence[float] | np.ndarray, orders: Sequence[float] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """An RDP curve must be non-negative (∞ allowed) and match its grid entry by entry."""
    orders = np.asarray(orders, dtype=float)
    rdp = np.asarray(rdp, dtype=float)
    if orders.ndim != 1 or rdp.shape != orders.shape or orders.size == 0:
        raise ValueError(
            f"rdp must be a vector with one entry per order; got shapes {rdp.shape} and "
            f"{orders.shape}"
        )
    if not (np.all(np.isfinite(orders)) and np.all(orders > 1)):
        raise ValueError("orders must lie in (1, inf)")
    if np.any(np.isnan(rdp)) or np.any(rdp < 0):
        raise ValueError("rdp must lie in [0, inf] at every order (no NaN)")
    return rdp, orders


# -- conversion to (ε, δ) (Canonne, Kamath & Steinke 2020, Prop. 12) ----------------------------
def _epsilon_per_order(rdp: np.ndarray, orders: np.ndarray, delta: float) -> np.ndarray:
    """ε at each order: ε_α + log(1 − 1/α) − (log δ + log α)/(α − 1)."""
    return rdp + np.log1p(-1.0 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)


def _log_delta_per_order(rdp: np.ndarray, orders: np.ndarray, epsilon: np.ndarray) -> np.ndarray:
    """log δ at each order (columns) for each ε (rows): the same bound solved for δ."""
    epsilon = np.atleast_1d(np.asarray(epsilon, dtype=float))[:, None]
    with np.errstate(invalid="ignore"):
        log_delta = (orders - 1) * (rdp - epsilon + np.log1p(-1.0 / orders)) - np.log(orders)
    return np.where(np.isnan(log_delta), np.inf, log_delta)


def _on_edge(index: int, orders: np.ndarray) -> bool:
    """Whether the optimum sits at an end of the grid, where a wider grid might do better."""
    return index in (0, orders.size - 1)


def epsilon_from_rdp(
    rdp: Sequence[float] | np.ndarray, orders: Sequence[float] | np.ndarray, delta: float
) -> RdpEpsilon:
    """The smallest ε over the grid such that the curve implies (ε, δ)-DP, clipped at 0.

    Canonne, Kamath & Steinke 2020 ("The discrete Gaussian for DP", Prop. 12; also Balle et
    al. 2020, "Hypothesis testing interpretations and Rényi DP", Thm. 21):
    ε = ε_α + log(1 − 1/α) − (log δ + log α)/(α − 1). The bound holds for negative ε too, so
    clipping at 0 is sound. A curve that is zero everywhere (nothing private) gives ε = 0.
    """
    delta = check_delta(delta)
    rdp, orders = _check_curve(rdp, orders)
    if not np.any(rdp > 0):
        return RdpEpsilon(0.0, delta, math.inf, False)
    if not np.any(np.isfinite(rdp)):  # no order bounds anything: ε is infinite, no edge to widen
        return RdpEpsilon(math.inf, delta, math.inf, False)
    per_order = _epsilon_per_order(rdp, orders, delta)
    index = int(np.argmin(per_order))
    return RdpEpsilon(
        max(0.0, float(per_order[index])), delta, float(orders[index]), _on_edge(index, orders)
    )


def delta_from_rdp(
    rdp: Sequence[float] | np.ndarray, orders: Sequence[float] | np.ndarray, epsilon: float
) -> RdpEpsilon:
    """The smallest δ over the grid such that the curve implies (ε, δ)-DP, capped at 1.

    The conversion of ``epsilon_from_rdp`` solved for δ:
    δ = exp((α−1)(ε_α − ε + log(1 − 1/α)) − log α).
    """
    epsilon = check_range("epsilon", epsilon, 0.0, math.inf, low_open=False)
    rdp, orders = _check_curve(rdp, orders)
    if not np.any(rdp > 0):
        return RdpEpsilon(epsilon, 0.0, math.inf, False)
    per_order = _log_delta_per_order(rdp, orders, epsilon)[0]
    index = int(np.argmin(per_order))
    delta = math.exp(min(0.0, float(per_order[index])))
    return RdpEpsilon(epsilon, delta, float(orders[index]), _on_edge(index, orders))
