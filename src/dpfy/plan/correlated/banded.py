"""BandMF: a banded lower-triangular Toeplitz C, optimised for the prefix-sum workload.

Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization: A unified approach to
private training", and McKenna 2024, "Scaling up the banded matrix factorization mechanism":
C has b bands, so (C⁻¹ z)_t needs only the last b − 1 noise outputs, its columns are disjoint
when examples are ≥ b steps apart (exact sensitivity), and under b cyclic Poisson groups it keeps
DP-SGD's amplification. b = 1 is DP-SGD. This module holds the Toeplitz variant (McKenna 2024):
b coefficients c_0 = 1, c_1, …, c_{b−1} describe C for any number of steps.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import minimize

from dpfy._validate import check_count
from dpfy.plan.correlated._threads import single_threaded
from dpfy.plan.correlated.participation import (
    CyclicPoisson,
    MinSeparation,
    Participation,
    check_participation,
)
from dpfy.plan.correlated.sensitivity import accounted_sensitivity_and_gradient
from dpfy.plan.correlated.toeplitz import (
    inverse_coefficients,
    prefix_sum_error_gradient,
    toeplitz_matrix,
)

Vector = NDArray[np.float64]


@dataclass(frozen=True)
class BandedStrategy:
    """C = T(1, c_1, …, c_{b−1}): ``coefficients[0]`` must be 1 (the scale of C cancels)."""

    coefficients: tuple[float, ...]

    def __post_init__(self) -> None:
        c = tuple(float(x) for x in np.asarray(self.coefficients, dtype=np.float64).reshape(-1))
        if not c or not np.all(np.isfinite(c)):
            raise ValueError("coefficients must be a non-empty sequence of finite numbers")
        if c[0] != 1.0:
            raise ValueError(f"coefficients[0] must be 1 (divide C by its diagonal), got {c[0]!r}")
        object.__setattr__(self, "coefficients", c)

    @classmethod
    def identity(cls) -> BandedStrategy:
        """C = I: independent noise every step, i.e. DP-SGD (one band)."""
        return cls((1.0,))

    @property
    def bands(self) -> int:
        """b: how many steps one noise draw reaches (state: b − 1 past outputs)."""
        return len(self.coefficients)

    def toeplitz(self, n: int) -> Vector:
        """The first n Toeplitz coefficients of C (zero past the bands)."""
        out = np.zeros(check_count("n", n, minimum=1))
        out[: min(n, self.bands)] = self.coefficients[:n]
        return out

    def inverse_toeplitz(self, n: int) -> Vector:
        """The first n Toeplitz coefficients of C⁻¹ (not banded)."""
        return inverse_coefficients(self.coefficients, n)

    def matrix(self, n: int) -> Vector:
        """The dense n×n C (tests, small n)."""
        return toeplitz_matrix(self.coefficients, n)


def square_root_coefficients(count: int) -> Vector:
    """The first coefficients of A^{1/2} = T(binom(2m, m)/4^m): the banded-square-root start
    (Kalinin & Lampert 2024), optimal for one participation as n → ∞ (Fichtenberger et al. 2023).
    """
    m = np.arange(1, check_count("count", count, minimum=1))
    return np.concatenate(([1.0], np.cumprod((2 * m - 1) / (2 * m))))


def banded_loss(
    free: ArrayLike, n: int, participation: Participation, bands: int
) -> tuple[float, Vector]:
    """log(‖A C⁻¹‖_F² · Δ(C)²) for C = T(1, *free) and its gradient in ``free``.

    Δ is the sensitivity the accounting charges (:func:`accounted_sensitivity_and_gradient`), so
    minimising this minimises the expected squared error at a fixed privacy level.
    """
    c = np.concatenate(([1.0], np.asarray(free, dtype=np.float64)))
    with np.errstate(all="ignore"):  # a C⁻¹ that blows up is simply a bad point
        error, error_grad = prefix_sum_error_gradient(c, n)
        sensitivity, sensitivity_grad = accounted_sensitivity_and_gradient(
            c, n, participation, bands
        )
        value = np.log(error) + np.log(sensitivity.squared)
        grad = error_grad[1:] / error + sensitivity_grad[1:] / sensitivity.squared
    if not (np.isfinite(value) and np.all(np.isfinite(grad))):
        return float("inf"), np.zeros(c.size - 1)
    return float(value), grad


def optimise_banded(
    n: int, bands: int, participation: Participation, *, max_iterations: int = 1000
) -> BandedStrategy:
    """The b-banded Toeplitz C minimising ‖A C⁻¹‖_F² · Δ(C)² over n steps (L-BFGS-B).

    Starts from the truncated square root, half of it, and the identity, and keeps the best, so
    the result is never worse than DP-SGD (b = 1). Deterministic. Under ``CyclicPoisson(g)``
    the amplification theorem needs bands ≤ g, and the objective charges the largest column norm.
    """
    n = check_count("n", n, minimum=1)
    bands = check_count("bands", bands, minimum=1)
    participation = check_participation(participation)
    if bands > n:
        raise ValueError(f"bands must be at most n = {n} (C is n×n), got {bands}")
    if isinstance(participation, CyclicPoisson) and bands > participation.groups:
        raise ValueError(
            f"amplified BandMF needs bands <= groups ({participation.groups}), got {bands}: lower "
            "the bands, or use MinSeparation for a strategy without amplification"
        )
    if bands == 1:
        return BandedStrategy.identity()
    root = square_root_coefficients(bands)[1:]
    starts = [root, 0.5 * root, np.zeros(bands - 1)]
    if isinstance(participation, MinSeparation) and participation.participations(n) > 1:
        # More bands than the separation make columns overlap, and the landscape rougher:
        # also start from the best strategy whose columns stay disjoint, so more bands never
        # end worse than that one.
        inner = min(bands, participation.separation)
        if inner < bands:
            padded = np.zeros(bands - 1)
            padded[: inner - 1] = optimise_banded(n, inner, participation).coefficients[1:]
            starts.append(padded)
    best_value, best = np.inf, np.zeros(bands - 1)
    with single_threaded():
        for start in starts:
            result = minimize(
                banded_loss,
                start,
                args=(n, participation, bands),
                jac=True,
                method="L-BFGS-B",
                options={"maxiter": max_iterations},
            )
            value, _ = banded_loss(result.x, n, participation, bands)
            if value < best_value:
                best_value, best = value, result.x
    return BandedStrategy((1.0, *best))


class BandedNoise:
    """Reference stream of w = C⁻¹ z for a banded C: w_t = z_t − Σ_{m=1}^{b−1} c_m w_{t−m}.

    Forward substitution on C w = z (c_0 = 1) keeps only the last b − 1 outputs — the memory
    BandMF costs (McKenna 2024). ``step`` takes the fresh N(0, I) draw z_t of any shape.
    """

    def __init__(self, strategy: BandedStrategy) -> None:
        self.strategy = strategy
        self._tail = np.asarray(strategy.coefficients[1:], dtype=np.float64)
        self._history: collections.deque[Vector] = collections.deque(maxlen=strategy.bands - 1)
        self.steps = 0

    def step(self, z: ArrayLike) -> Vector:
        """w_t for this step's fresh noise z_t (a new array)."""
        w = np.array(z, dtype=np.float64)
        for coefficient, past in zip(self._tail, self._history, strict=False):
            if past.shape != w.shape:
                raise ValueError(f"z has shape {w.shape}, earlier steps had {past.shape}")
            w -= coefficient * past
        self._history.appendleft(w.copy())
        self.steps += 1
        return w

    def reset(self) -> None:
        """Forget the history: the next step is step 0 again."""
        self._history.clear()
        self.steps = 0
