"""The best RDP order without the whole curve: exact values where the optimum can be, bounds
elsewhere.

Converting an RDP curve to (ε, δ) takes the best order of the grid. For a sum of sampled-
Gaussian curves, most orders cannot be the best and need not be computed, because the curve
has shape that bounds it from below between computed orders:

* ε(α) never decreases with α (Rényi divergences grow with the order; van Erven & Harremoës
  2014, Thm. 3), so ε(α) ≥ ε at the nearest computed order below;
* K(α) = (α−1)·ε(α) is convex with K(1) = 0 (it is the cumulant generating function of the
  privacy loss; the sum of such functions is convex too), so K lies above the extensions of
  the chords between computed orders on either side.

An order is computed exactly when its lower bound could still beat the best order found; the
search stops when none can. The answer is therefore the exact minimum over the whole grid (the
bounds are loosened by a relative 1e-9 against rounding), at a fraction of the cost.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["FIRST_PROBES", "best_order"]

#: Orders computed first (the grid's nearest to each); later rounds add only candidates.
FIRST_PROBES = (1.05, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 11.0, 16.0, 24.0, 32.0, 48.0, 63.0)
#: Bounds are loosened by this relative amount, so rounding in the computed values never
#: removes an order that could be the best.
_SLACK = 1e-9


def best_order(
    orders: np.ndarray,
    exact: Callable[[np.ndarray], np.ndarray],
    known: np.ndarray,
    objective: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> tuple[int, np.ndarray]:
    """The index minimising ``objective`` over the grid, and the curve computed on the way.

    ``exact(indices)`` returns the convex, non-decreasing part of the curve at those orders;
    ``known`` is the rest of the curve (any shape) at every order; ``objective(indices, curve)``
    maps curve values to what is minimised and must not decrease as the curve grows. Entries of
    the returned curve that were never needed are NaN.
    """
    values = np.full(orders.shape, np.nan)
    todo = _nearest(orders, FIRST_PROBES)
    while todo.size:
        values[todo] = exact(todo)
        done = np.flatnonzero(~np.isnan(values))
        scores = objective(done, values[done] + known[done])
        best = float(np.min(scores))
        missing = np.flatnonzero(np.isnan(values))
        if missing.size == 0 or not np.isfinite(best):
            break
        bound = _lower_bound(orders, done, values[done], missing)
        could = objective(missing, bound + known[missing]) < best
        todo = missing[could]
    done = np.flatnonzero(~np.isnan(values))
    scores = objective(done, values[done] + known[done])
    return int(done[int(np.argmin(scores))]), values


def _nearest(orders: np.ndarray, targets: tuple[float, ...]) -> np.ndarray:
    """Grid indices nearest to each target, deduplicated."""
    return np.unique(np.abs(orders[None, :] - np.array(targets)[:, None]).argmin(axis=1))


def _lower_bound(
    orders: np.ndarray, done: np.ndarray, curve: np.ndarray, missing: np.ndarray
) -> np.ndarray:
    """A lower bound on the curve at ``missing`` from its values at ``done`` (sorted indices).

    Monotonicity gives the value at the nearest computed order below; convexity of
    K(α) = (α−1)ε(α), with the point (1, 0), gives the chord extensions of the neighbouring
    computed intervals. An infinite computed value bounds nothing beyond itself.
    """
    points = np.concatenate([[1.0], orders[done]])
    k = np.concatenate([[0.0], (orders[done] - 1) * curve])
    finite = np.isfinite(k)
    points, k = points[finite], k[finite]
    alpha = orders[missing]
    slot = np.searchsorted(points, alpha)  # points[slot-1] < alpha < points[slot]
    below = np.concatenate([[0.0], curve[np.isfinite(curve)]])
    bound_k = (alpha - 1) * below[np.clip(slot - 1, 0, below.size - 1)]
    slopes = np.diff(k) / np.diff(points)
    # The chord just left of the interval, extended right (needs two points left of alpha).
    left = slot - 2
    ok = left >= 0
    from_left = np.where(
        ok, k[np.clip(slot - 1, 0, None)] + slopes[np.clip(left, 0, None)] * (
            alpha - points[np.clip(slot - 1, 0, None)]
        ), -np.inf
    )  # fmt: skip
    # The chord just right of the interval, extended left (needs two points right of alpha).
    right = slot
    ok = right + 1 < points.size
    idx = np.clip(right, 0, points.size - 1)
    sidx = np.clip(right, 0, max(slopes.size - 1, 0))
    from_right = np.where(
        ok, k[idx] - slopes[sidx] * (points[idx] - alpha), -np.inf
    ) if slopes.size else np.full(alpha.shape, -np.inf)  # fmt: skip
    bound_k = np.maximum(bound_k, np.maximum(from_left, from_right))
    bound = np.maximum(bound_k, 0.0) / (alpha - 1)
    return bound * (1 - _SLACK)
