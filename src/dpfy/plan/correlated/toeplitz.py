"""Lower-triangular Toeplitz algebra: the language every streaming factorisation is written in.

A lower-triangular Toeplitz n×n matrix T(c) has T[i, j] = c_{i−j} for i ≥ j: one coefficient
sequence describes it. Products of such matrices are truncated convolutions of their sequences
and the inverse is the power-series inverse of c, so a factorisation of the prefix-sum workload
A = T(1, 1, …, 1) as A = B C with Toeplitz C (Choquette-Choo et al. 2023, "(Amplified) Banded
Matrix Factorization"; Dvijotham, McMahan et al. 2024, BLT) is costed in O(n·bands) or
O(n log n) without forming an n×n matrix:

    A C⁻¹ = T(s) with s = cumsum(d), d = c⁻¹ (series), and ‖T(s)‖_F² = Σ_m (n − m) s_m².
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.signal import convolve, lfilter

from dpfy._validate import check_count

Vector = NDArray[np.float64]


def as_coefficients(coefficients: ArrayLike, n: int | None = None) -> Vector:
    """A finite 1-D float64 copy of the sequence, truncated (or zero-padded) to ``n`` if given."""
    c = np.array(coefficients, dtype=np.float64).reshape(-1)
    if c.size == 0 or not np.all(np.isfinite(c)):
        raise ValueError("coefficients must be a non-empty sequence of finite numbers")
    if n is None:
        return c
    n = check_count("n", n, minimum=1)
    out = np.zeros(n)
    out[: min(n, c.size)] = c[:n]
    return out


def toeplitz_matrix(coefficients: ArrayLike, n: int) -> Vector:
    """The dense n×n lower-triangular Toeplitz matrix T(c) (for tests and small problems)."""
    c = as_coefficients(coefficients, n)
    i, j = np.indices((n, n))
    return np.where(i >= j, c[np.clip(i - j, 0, n - 1)], 0.0)


def multiply(a: ArrayLike, b: ArrayLike, n: int) -> Vector:
    """Coefficients of T(a)·T(b), i.e. the convolution a ∗ b truncated to n terms."""
    a, b = as_coefficients(a, n), as_coefficients(b, n)
    return np.asarray(convolve(a, b)[:n], dtype=np.float64)


def inverse_coefficients(coefficients: ArrayLike, n: int) -> Vector:
    """The first n coefficients d of the series inverse of c (T(c)⁻¹ = T(d)); c_0 must be ≠ 0.

    Forward substitution d_m = −(Σ_{j=1..m} c_j d_{m−j}) / c_0, run as the impulse response of
    the recursive filter 1/c(x): O(n · len(c)).
    """
    n = check_count("n", n, minimum=1)
    c = as_coefficients(coefficients)[:n]
    if c[0] == 0.0:
        raise ValueError("the leading coefficient c_0 must be non-zero for T(c) to be invertible")
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return np.asarray(lfilter([1.0], c, impulse), dtype=np.float64)


def prefix_sum_error(inverse: ArrayLike, n: int) -> float:
    """‖A C⁻¹‖_F² from the coefficients d of C⁻¹: Σ_m (n − m) s_m² with s = cumsum(d).

    The prefix-sum workload's total squared error per unit of noise (Denisov et al. 2022's
    objective): A C⁻¹ = T(cumsum(d)), and coefficient m of an n×n Toeplitz matrix appears
    n − m times.
    """
    d = as_coefficients(inverse, n)
    s = np.cumsum(d)
    weights = n - np.arange(n, dtype=np.float64)
    return float(np.dot(weights, s * s))


def prefix_sum_error_gradient(
    coefficients: ArrayLike, n: int, inverse: ArrayLike | None = None
) -> tuple[float, Vector]:
    """‖A T(c)⁻¹‖_F² and its gradient in every c_j (j < min(len(c), n)).

    With d = c⁻¹: ∂d_m/∂c_j = −(d ∗ d)_{m−j}, and ∂E/∂d_k = 2 Σ_{m ≥ k} (n − m) s_m, so
    ∂E/∂c_j = −Σ_{m ≥ j} (∂E/∂d_m) (d ∗ d)_{m−j}: one convolution, O(n log n). ``inverse``
    (the first n coefficients of d) saves the series inversion when the caller has it in closed
    form. A C⁻¹ that overflows gives an infinite error and a NaN gradient.
    """
    n = check_count("n", n, minimum=1)
    c = as_coefficients(coefficients)[:n]
    with np.errstate(all="ignore"):
        d = inverse_coefficients(c, n) if inverse is None else np.asarray(inverse, dtype=float)[:n]
        s = np.cumsum(d)
        weights = n - np.arange(n, dtype=np.float64)
        error = float(np.dot(weights, s * s))
        grad_d = 2.0 * np.cumsum((weights * s)[::-1])[::-1]
    if not (np.isfinite(error) and np.all(np.isfinite(grad_d))):
        return math.inf, np.full(c.size, np.nan)
    dd = convolve(d, d)[:n]
    # Σ_{m ≥ j} g_m dd_{m−j} is entry n−1−j of (reversed g) ∗ dd.
    correlation = convolve(grad_d[::-1], dd)[:n][::-1]
    return error, -np.asarray(correlation[: c.size], dtype=np.float64)


class ToeplitzStrategy(Protocol):
    """What every strategy offers: C's and C⁻¹'s coefficients, and its bands (None: unbanded)."""

    @property
    def bands(self) -> int | None: ...

    def toeplitz(self, n: int) -> Vector: ...

    def inverse_toeplitz(self, n: int) -> Vector: ...
