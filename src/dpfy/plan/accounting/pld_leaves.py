"""One leaf's discrete PLD: where to truncate it, and its pessimistic connect-the-dots
discretisation (Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022).

Truncation is searched for all leaves of one direction together (one vectorised bisection), so
a run with thousands of distinct steps costs a few dozen numpy calls rather than thousands.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from dpfy.plan.accounting.pld_pairs import Direction, GaussianPair

#: Losses above this are treated as infinite (e^ε must stay a finite double).
MAX_LOSS = 200.0


def _bisect(predicate: Callable[[np.ndarray], np.ndarray], lo, hi, iterations: int = 40):
    """The boundary of monotone predicates, elementwise: False at lo, True at hi."""
    lo, hi = np.array(lo, dtype=float), np.array(hi, dtype=float)
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        true = predicate(mid)
        hi, lo = np.where(true, mid, hi), np.where(true, lo, mid)
    return hi


def _batch(directions: list[Direction]) -> Direction:
    """The directions as one whose pair and rate are arrays (all GaussianPair, one way)."""
    mu = np.array([d.pair.mu for d in directions], dtype=float)
    rate = np.array([d.sampling_rate for d in directions], dtype=float)
    return Direction(GaussianPair(mu), rate, directions[0].removal)  # type: ignore[arg-type]


def _ranges(directions: list[Direction]) -> tuple[np.ndarray, np.ndarray]:
    """Each direction's smallest and largest privacy loss."""
    bounds = np.array([d.loss_range() for d in directions], dtype=float).reshape(-1, 2)
    return bounds[:, 0], bounds[:, 1]


def _upper(batch: Direction, lo: np.ndarray, hi: np.ndarray, tail: float) -> np.ndarray:
    """Losses above which δ(ε) ≤ tail (mass beyond them is sent to +∞), or MAX_LOSS."""

    def small(e: np.ndarray) -> np.ndarray:
        return batch.hockey_stick(e) <= tail

    start = np.maximum(lo, 0.0)
    step = np.ones_like(start)
    grow = ~small(start + step) & (start + step < MAX_LOSS)
    while grow.any():
        step = np.where(grow, 2 * step, step)
        grow = grow & ~small(start + step) & (start + step < MAX_LOSS)
    top = np.minimum(start + step, MAX_LOSS)
    found = small(top)
    cut = _bisect(small, start, np.where(found, top, start + 1.0))
    return np.where(hi <= MAX_LOSS, hi, np.where(found, cut, top))


def _lower(batch: Direction, lo: np.ndarray, hi: np.ndarray, tail: float) -> np.ndarray:
    """Losses below which at most ``tail`` mass lies (that mass is rounded up, pessimistically)."""

    def small(e: np.ndarray) -> np.ndarray:
        return batch.lower_tail(e) <= tail

    start = np.minimum(hi, 0.0)
    step = np.ones_like(start)
    grow = ~small(start - step)
    while grow.any():
        step = np.where(grow, 2 * step, step)
        if np.max(step) > 1e6:  # pragma: no cover - no supported pair has such tails
            raise RuntimeError("privacy loss distribution has an unbounded lower tail")
        grow = grow & ~small(start - step)
    cut = -_bisect(lambda e: small(-e), -start, -(start - step))
    return np.where(lo > -math.inf, lo, cut)


def truncations(directions: list[Direction], tail: float) -> list[tuple[float, float]]:
    """Each direction's kept loss range [bottom, top]: below it at most ``tail`` mass (rounded
    up), above it δ ≤ ``tail`` (sent to +∞). Gaussian pairs are searched together."""
    out: list[tuple[float, float] | None] = [None] * len(directions)
    for removal in (True, False):
        group = [
            i
            for i, d in enumerate(directions)
            if d.removal is removal and isinstance(d.pair, GaussianPair)
        ]
        others = [
            i
            for i, d in enumerate(directions)
            if d.removal is removal and not isinstance(d.pair, GaussianPair)
        ]
        batches = [(group, _batch([directions[i] for i in group]))] if group else []
        batches += [([i], directions[i]) for i in others]
        for indices, batch in batches:
            lo, hi = _ranges([directions[i] for i in indices])
            bottom, top = _lower(batch, lo, hi, tail), _upper(batch, lo, hi, tail)
            for j, i in enumerate(indices):
                out[i] = (float(bottom[j]), float(top[j]))
    return [b for b in out if b is not None]


def connect_the_dots(
    direction: Direction, spacing: float, points: np.ndarray
) -> tuple[np.ndarray, float]:
    """The dominating discrete PLD on the losses ``points``·Δ: its pmf there and its mass at +∞.

    δ(ε) is convex in x = e^ε, so the chord through its values at the grid points lies above it
    and is itself the privacy curve of a discrete PLD on them. Chord slopes between consecutive
    points, anchored at (0, 1); the atom at each point is x·(slope before − slope after); the
    last point's δ is the mass at +∞.
    """
    grid = points * spacing
    curve = direction.hockey_stick(grid)
    infinity_mass = float(curve[-1])
    gaps = np.exp(grid[:-1]) * np.expm1(np.diff(grid))
    slopes = np.concatenate([[(1.0 - curve[0]) / math.exp(grid[0])], -np.diff(curve) / gaps, [0]])
    pmf = np.clip(np.exp(grid) * (slopes[:-1] - slopes[1:]), 0.0, None)
    infinity_mass += max(0.0, 1.0 - infinity_mass - float(pmf.sum()))
    return pmf, min(infinity_mass, 1.0)
