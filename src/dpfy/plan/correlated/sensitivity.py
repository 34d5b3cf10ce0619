"""Sensitivity of a correlated-noise strategy: how far one example can move C x.

The mechanism releases C x + σ z, where row t of x is step t's sum of clipped gradients (clip
norm 1). Under add/remove (or zero-out) adjacency one example adds the vector g_i (‖g_i‖ ≤ 1) to
the steps i of an allowed pattern π, so C x moves by Σ_{i∈π} C[:, i] g_iᵀ and

    Δ² = max_π max_{‖g_i‖≤1} Σ_{i,j∈π} X_ij ⟨g_i, g_j⟩ ≤ max_π Σ_{i,j∈π} |X_ij|,   X = CᵀC,

with equality when X_π ≥ 0 entrywise (all g_i equal) (Choquette-Choo et al. 2022, "Multi-epoch
matrix factorization mechanisms", §3). What is computed here, and when it is exact:

* one participation: Δ² = the largest squared column norm (exact);
* columns an allowed pattern can touch have disjoint supports (banded C with bands ≤ separation):
  Δ² = the largest sum of squared column norms over allowed patterns (exact; dynamic program);
* Toeplitz C with non-negative, non-increasing coefficients: the earliest packed pattern
  {0, s, 2s, …} is the worst (exact; Kalinin & Lampert 2024, "Banded square root matrix
  factorization", Thm. 2 — each X_ij only grows as a pattern is packed to the left);
* any other Toeplitz C: the same formula on the majorant ĉ_m = max_{m'≥m} |c_{m'}| — an UPPER
  bound, since |X_ij| ≤ X̂_ij;
* any other dense C: the row-wise dynamic-programming bound (Choquette-Choo et al. 2023,
  "(Amplified) Banded Matrix Factorization", VecSens): an UPPER bound.

Never anything below the true sensitivity: a bound is labelled ``exact=False``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.signal import convolve

from dpfy._validate import check_count
from dpfy.plan.correlated.participation import (
    CyclicPoisson,
    Participation,
    check_participation,
)
from dpfy.plan.correlated.toeplitz import as_coefficients

Vector = NDArray[np.float64]


@dataclass(frozen=True)
class Sensitivity:
    """Δ² of a strategy under a schema, whether it is exact, and which rule gave it."""

    squared: float
    exact: bool
    method: str

    @property
    def norm(self) -> float:
        """Δ itself."""
        return float(np.sqrt(self.squared))


def max_separated_sum(weights: ArrayLike, largest: int, separation: int) -> float:
    """max Σ_{i∈π} w_i over sets π of ≤ ``largest`` indices, any two ≥ ``separation`` apart.

    Dynamic program over (first index, picks left), O(len(w) · largest); the empty set gives 0.
    """
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    largest = check_count("largest", largest)
    separation = check_count("separation", separation, minimum=1)
    n = w.size
    # best[i, j]: the best sum using indices ≥ i and at most j picks (rows past n are 0).
    best = np.zeros((n + separation + 1, largest + 1))
    for i in range(n - 1, -1, -1):
        best[i] = best[i + 1]
        best[i, 1:] = np.maximum(best[i, 1:], w[i] + best[i + separation, :-1])
    return float(best[0, largest])


def column_norm_squared(coefficients: ArrayLike, n: int) -> float:
    """The largest squared column norm of the n×n Toeplitz T(c): column 0's, ‖c[:n]‖²."""
    c = as_coefficients(coefficients, n)
    return float(np.dot(c, c))


def majorant(coefficients: ArrayLike) -> tuple[Vector, NDArray[np.int64]]:
    """ĉ_m = max_{m' ≥ m} |c_{m'}| (non-negative, non-increasing, ≥ |c|) and the argmax m'."""
    c = np.abs(as_coefficients(coefficients))
    reverse = c[::-1]
    running = np.maximum.accumulate(reverse)
    where = np.maximum.accumulate(np.where(reverse >= running, np.arange(c.size), 0))
    return running[::-1].copy(), (c.size - 1 - where)[::-1].copy()


def _support(c: Vector) -> int:
    """Index of the last non-zero coefficient, plus one (the number of bands)."""
    nonzero = np.flatnonzero(c)
    return int(nonzero[-1]) + 1 if nonzero.size else 0


def _packed(c: Vector, n: int, count: int, separation: int) -> tuple[float, Vector]:
    """‖Σ_{a<count} C[:, a·separation]‖² for C = T(c) (n×n), and its gradient in c."""
    comb = np.zeros(n)
    comb[: count * separation : separation] = 1.0
    column = as_coefficients(c, n)
    v = convolve(column, comb)[:n]
    grad = 2.0 * convolve(v[::-1], comb)[:n][::-1]  # ∂/∂c_m = 2 Σ_a v[m + a·separation]
    out = np.zeros(c.size)
    out[: min(c.size, n)] = grad[: c.size]
    return float(np.dot(v, v)), out


def toeplitz_sensitivity_and_gradient(
    coefficients: ArrayLike, n: int, participation: Participation
) -> tuple[Sensitivity, Vector]:
    """Δ² of the n×n Toeplitz T(c) under the schema (see the module's rules) and ∂Δ²/∂c.

    ``CyclicPoisson(b)`` is taken without its sampling: min-separation b, ⌈n/b⌉ participations
    (every pattern it allows is one of those). The gradient is that of the value returned (the
    majorant's, where the value is the majorant bound), for optimisers.
    """
    n = check_count("n", n, minimum=1)
    schema = check_participation(participation)
    if isinstance(schema, CyclicPoisson):
        schema = schema.as_min_separation(n)
    c = as_coefficients(coefficients)
    head = c[:n]
    count, separation = schema.participations(n), schema.separation
    if count == 1:
        value, grad = _packed(c, n, 1, separation)
        return Sensitivity(value, True, "one participation: the first column is the longest"), grad
    if _support(head) <= separation:
        value, grad = _packed(c, n, count, separation)
        return Sensitivity(value, True, "bands <= separation: disjoint columns"), grad
    if np.all(head >= 0) and np.all(np.diff(head) <= 0):
        value, grad = _packed(c, n, count, separation)
        method = "non-negative non-increasing Toeplitz: earliest packed pattern is the worst"
        return Sensitivity(value, True, method), grad
    hat, where = majorant(head)
    value, grad_hat = _packed(hat, n, count, separation)
    grad = np.zeros(c.size)
    np.add.at(grad, where, grad_hat[: head.size] * np.sign(head[where]))
    method = "upper bound: packed pattern of the non-increasing majorant of |c|"
    return Sensitivity(value, False, method), grad


def toeplitz_sensitivity_squared(
    coefficients: ArrayLike, n: int, participation: Participation
) -> Sensitivity:
    """Δ² of the n×n lower-triangular Toeplitz T(c) under ``participation`` (no sampling)."""
    return toeplitz_sensitivity_and_gradient(coefficients, n, participation)[0]


def amplification_applies(bands: int | None, participation: Participation) -> bool:
    """Whether the cyclic-Poisson amplification theorem covers this strategy (bands ≤ groups).

    Choquette-Choo et al. 2023 ("(Amplified) Banded Matrix Factorization"): a C with at most b
    bands under b cyclic Poisson groups releases, per example, ⌈n/b⌉ independent
    Poisson-subsampled Gaussian mechanisms whose sensitivities are its columns' norms.
    """
    return (
        isinstance(participation, CyclicPoisson)
        and bands is not None
        and bands <= participation.groups
    )


def accounted_sensitivity_and_gradient(
    coefficients: ArrayLike, n: int, participation: Participation, bands: int | None
) -> tuple[Sensitivity, Vector]:
    """The sensitivity the accounting charges, and its gradient in c.

    Under the amplification theorem that is the largest column norm (each round's sensitivity);
    otherwise the min-separation sensitivity of :func:`toeplitz_sensitivity_and_gradient`.
    """
    if amplification_applies(bands, participation):
        c = as_coefficients(coefficients)
        value, grad = _packed(c, check_count("n", n, minimum=1), 1, 1)
        return Sensitivity(value, True, "amplified rounds: the largest column norm"), grad
    return toeplitz_sensitivity_and_gradient(coefficients, n, participation)


def matrix_sensitivity_squared(matrix: ArrayLike, participation: Participation) -> Sensitivity:
    """Δ² of a dense C (any number of rows, n columns = steps): exact where a rule says so.

    Exact: one participation; allowed patterns touching pairwise-orthogonal columns; a cyclic
    group whose Gram block is entrywise ≥ 0. Otherwise an UPPER bound: Σ|X| over the group
    (cyclic), or the row-wise dynamic program (min-separation): Σ_{i,j∈π}|X_ij| ≤ Σ_{i∈π} r_i
    with r_i = max_π' Σ_{j∈π'} |X_ij|, then the best pattern for r.
    """
    c = np.asarray(matrix, dtype=np.float64)
    if c.ndim != 2 or not np.all(np.isfinite(c)):
        raise ValueError("matrix must be a finite 2-D array (rows × steps)")
    schema = check_participation(participation)
    n = c.shape[1]
    gram = c.T @ c
    count = schema.participations(n)
    if count == 1:
        return Sensitivity(float(np.max(np.diag(gram))), True, "one participation")
    if isinstance(schema, CyclicPoisson):
        best, exact = 0.0, True
        for group in range(min(schema.groups, n)):
            block = gram[group :: schema.groups, group :: schema.groups]
            best = max(best, float(np.abs(block).sum()))
            exact = exact and bool(np.all(block >= 0))
        method = "whole cyclic group" if exact else "upper bound: sum of |X| over a cyclic group"
        return Sensitivity(best, exact, method)
    separation = schema.separation
    distance = np.abs(np.subtract.outer(np.arange(n), np.arange(n)))
    if np.all(gram[distance >= separation] == 0):
        value = max_separated_sum(np.diag(gram), count, separation)
        return Sensitivity(value, True, "orthogonal columns within every allowed pattern")
    rows = np.array([max_separated_sum(r, count, separation) for r in np.abs(gram)])
    value = max_separated_sum(rows, count, separation)
    return Sensitivity(value, False, "upper bound: row-wise dynamic program on |CᵀC|")


def brute_force_sensitivity_squared(matrix: ArrayLike, participation: Participation) -> float:
    """The test oracle: max over every allowed pattern π and signs u ∈ {±1}^π of uᵀ X_π u.

    That is the sensitivity for scalar contributions; it equals the vector-valued Δ² whenever the
    worst pattern's Gram block is ≥ 0 (then u = 1). Exponential: small n only.
    """
    c = np.asarray(matrix, dtype=np.float64)
    gram = c.T @ c
    best = 0.0
    for pattern in check_participation(participation).patterns(c.shape[1]):
        block = gram[np.ix_(pattern, pattern)]
        if np.all(block >= 0):
            best = max(best, float(block.sum()))
            continue
        for signs in itertools.product((1.0, -1.0), repeat=len(pattern) - 1):
            u = np.array((1.0, *signs))
            best = max(best, float(u @ block @ u))
    return best
