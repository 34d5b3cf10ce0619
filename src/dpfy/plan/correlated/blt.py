"""BLT: buffered linear Toeplitz noise, near-optimal correlation with a few buffers per parameter.

Dvijotham, McMahan, Pillutla, Steinke & Thakurta 2024, "Efficient and near-optimal noise
generation for streaming differential privacy", and McMahan et al. 2024 (BLT-based DP-FTRL in
Gboard). A BLT with d buffers, decays θ_j and weights ω_j is the lower-triangular Toeplitz

    T(1, Σ_j ω_j, Σ_j ω_j θ_j, Σ_j ω_j θ_j², …),  i.e. c_m = Σ_j ω_j θ_j^{m−1} for m ≥ 1,

whose product with a stream needs only d running sums: y_t = x_t + Σ_j ω_j s_{j,t},
s_{j,t+1} = θ_j s_{j,t} + x_t. Its generating function is rational of degree d, N(x)/P(x), so
its inverse is a BLT with d buffers too, P(x)/N(x).

Which matrix is parametrised: C, the strategy, with θ_j ∈ (0, 1) and ω_j ≥ 0 (as the papers do).
C's coefficients are then positive and decreasing from m = 1, so with Σω ≤ 1 they are
non-increasing and the min-separation sensitivity is exact (:mod:`.sensitivity`). The noise
generator needs C⁻¹; its decays are the roots of 1 + Σ_j ω_j/(y − θ_j), which interlace the θ_j
(one in each gap, one below the smallest), so they are real and below 1, and its weights are
residues 1/h'(θ̂) < 0: the generator subtracts decayed past noise, as the square root does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import minimize, nnls
from scipy.signal import lfilter

from dpfy._validate import check_count
from dpfy.plan.correlated._threads import single_threaded
from dpfy.plan.correlated.banded import square_root_coefficients
from dpfy.plan.correlated.participation import Participation, check_participation
from dpfy.plan.correlated.sensitivity import accounted_sensitivity_and_gradient
from dpfy.plan.correlated.toeplitz import prefix_sum_error_gradient, toeplitz_matrix

Vector = NDArray[np.float64]


@dataclass(frozen=True)
class Blt:
    """T(1, Σω, Σωθ, Σωθ², …): d buffers with decays |θ_j| < 1 and real weights ω_j."""

    decays: tuple[float, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        decays = tuple(float(x) for x in np.asarray(self.decays, dtype=np.float64).reshape(-1))
        weights = tuple(float(x) for x in np.asarray(self.weights, dtype=np.float64).reshape(-1))
        if len(decays) != len(weights):
            raise ValueError(f"{len(decays)} decays but {len(weights)} weights: one per buffer")
        if not all(math.isfinite(x) for x in decays + weights):
            raise ValueError("decays and weights must be finite numbers")
        if any(abs(x) >= 1 for x in decays):
            raise ValueError(f"decays must lie in (-1, 1) for a stable stream, got {decays}")
        object.__setattr__(self, "decays", decays)
        object.__setattr__(self, "weights", weights)

    @property
    def buffers(self) -> int:
        """d: running sums kept per parameter."""
        return len(self.decays)

    @property
    def bands(self) -> int | None:
        """None: a BLT is not banded (every past step keeps some weight)."""
        return None

    def rational(self) -> tuple[Vector, Vector]:
        """(N, P), ascending polynomial coefficients with N(0) = P(0) = 1: C(x) = N(x)/P(x).

        P = Π_j (1 − θ_j x), N = P + Σ_j ω_j x Π_{i≠j} (1 − θ_i x).
        """
        factors = [np.array([1.0, -theta]) for theta in self.decays]
        denominator = functools.reduce(np.convolve, factors, np.array([1.0]))
        numerator = np.concatenate((denominator, [0.0]))
        for j, weight in enumerate(self.weights):
            others = functools.reduce(np.convolve, factors[:j] + factors[j + 1 :], np.array([1.0]))
            numerator[1 : others.size + 1] += weight * others
        return numerator[: denominator.size], denominator

    def toeplitz(self, n: int) -> Vector:
        """The first n Toeplitz coefficients: 1, then Σ_j ω_j θ_j^{m−1}."""
        n = check_count("n", n, minimum=1)
        out = np.zeros(n)
        out[0] = 1.0
        powers = np.arange(n - 1)
        for theta, weight in zip(self.decays, self.weights, strict=True):
            out[1:] += weight * np.power(theta, powers)
        return out

    def inverse_toeplitz(self, n: int) -> Vector:
        """The first n Toeplitz coefficients of the inverse, P(x)/N(x), in O(n·d)."""
        numerator, denominator = self.rational()
        impulse = np.zeros(check_count("n", n, minimum=1))
        impulse[0] = 1.0
        return np.asarray(lfilter(denominator, numerator, impulse), dtype=np.float64)

    def inverse(self) -> Blt:
        """The inverse matrix as a BLT: decays = roots of 1 + Σ_j ω_j/(y − θ_j), weights = residues.

        Equal decays are merged and zero weights dropped first (they cancel between N and P).
        Refuses an inverse whose decays are complex or not inside (−1, 1).
        """
        merged: dict[float, float] = {}
        for theta, weight in zip(self.decays, self.weights, strict=True):
            merged[theta] = merged.get(theta, 0.0) + weight
        kept = {theta: w for theta, w in merged.items() if w != 0.0}
        if not kept:
            return Blt((), ())
        simple = Blt(tuple(kept), tuple(kept.values()))
        numerator, denominator = simple.rational()
        # In y = 1/x the polynomials reverse: q(y) = y^d N(1/y), p(y) = y^d P(1/y).
        q, p = numerator, denominator  # ascending in x = descending in y
        roots = np.roots(q)
        if np.any(np.abs(roots.imag) > 1e-9 * np.maximum(1.0, np.abs(roots))):
            raise ValueError(f"the inverse of {self} has complex decays {roots}")
        roots = roots.real
        if np.any(np.abs(roots) >= 1.0):
            raise ValueError(f"the inverse of {self} is unstable (decays {roots})")
        residues = np.polyval(p, roots) / np.polyval(np.polyder(q), roots)
        order = np.argsort(roots)
        return Blt(tuple(roots[order]), tuple(residues[order]))

    def matrix(self, n: int) -> Vector:
        """The dense n×n matrix (tests, small n)."""
        return toeplitz_matrix(self.toeplitz(n), n)


def _timescales_to_decays(log_scales: Vector) -> Vector:
    """θ = 1 − e^{−v}: the optimiser works in log time scales, where θ near 1 is well spread."""
    return -np.expm1(-log_scales)


def blt_loss(params: ArrayLike, n: int, participation: Participation) -> tuple[float, Vector]:
    """log(‖A C⁻¹‖_F² · Δ(C)²) for C = Blt(1 − e^{−v}, ω), params = (v, ω), and its gradient.

    C⁻¹'s coefficients come from the rational form in O(n·d); the gradient reaches every c_m
    (:func:`prefix_sum_error_gradient`) and then (θ, ω) through c_m = Σ_j ω_j θ_j^{m−1}.
    """
    params = np.asarray(params, dtype=np.float64)
    d = params.size // 2
    log_scales, weights = params[:d], params[d:]
    decays = _timescales_to_decays(log_scales)
    strategy = Blt(tuple(decays), tuple(weights))
    c = strategy.toeplitz(n)
    with np.errstate(all="ignore"):
        error, error_grad = prefix_sum_error_gradient(c, n, strategy.inverse_toeplitz(n))
        sensitivity, sensitivity_grad = accounted_sensitivity_and_gradient(
            c, n, participation, None
        )
        value = math.log(error) + math.log(sensitivity.squared)
        grad_c = error_grad / error + sensitivity_grad / sensitivity.squared
        m = np.arange(n - 1, dtype=np.float64)  # exponent m − 1 for c_m, m = 1..n−1
        powers = np.power.outer(decays, m)  # (d, n−1): θ_j^{m−1}
        grad_weights = powers @ grad_c[1:]
        slopes = weights[:, None] * m * np.power.outer(decays, np.maximum(m - 1, 0))
        grad_decays = slopes @ grad_c[1:]
        grad = np.concatenate((grad_decays * (1.0 - decays), grad_weights))
    if not (math.isfinite(value) and np.all(np.isfinite(grad))):
        return math.inf, np.zeros(params.size)
    return value, grad


def _starts(n: int, buffers: int) -> list[Vector]:
    """Deterministic starting points: decays log-spread up to a time scale, weights fitted.

    The weights are non-negative least squares of Σ_j ω_j θ_j^{m−1} against the square root's
    coefficients (the one-participation optimum's shape), then scaled down for the
    multi-participation optimum, which correlates less.
    """
    target = square_root_coefficients(n)[1:]
    m = np.arange(n - 1, dtype=np.float64)
    starts = []
    for longest in sorted({max(2.0, n), max(2.0, n / 8), max(2.0, math.sqrt(n))}):
        scales = np.geomspace(1.5, longest, buffers)
        decays = 1.0 - 1.0 / scales
        basis = np.power.outer(decays, m).T
        weights, _ = nnls(basis, target)
        for shrink in (1.0, 0.5, 0.2):
            starts.append(np.concatenate((np.log(scales), shrink * weights)))
    return starts


def optimise_blt(
    n: int, buffers: int, participation: Participation, *, max_iterations: int = 500
) -> Blt:
    """The d-buffer BLT C minimising ‖A C⁻¹‖_F² · Δ(C)² over n steps (L-BFGS-B, restarts).

    θ_j = 1 − e^{−v_j} with time scales e^{v_j} in [1, 10⁴·n], ω_j in [0, 1]. Several
    deterministic starts (:func:`_starts`); the best end point is returned.
    """
    n = check_count("n", n, minimum=2)
    buffers = check_count("buffers", buffers, minimum=1)
    participation = check_participation(participation)
    bounds = [(1e-3, math.log(1e4 * n))] * buffers + [(0.0, 1.0)] * buffers
    best_value, best = math.inf, None
    with single_threaded():
        for start in _starts(n, buffers):
            result = minimize(
                blt_loss,
                np.clip(start, [lo for lo, _ in bounds], [hi for _, hi in bounds]),
                args=(n, participation),
                jac=True,
                method="L-BFGS-B",
                bounds=bounds,
                options={"maxiter": max_iterations},
            )
            value, _ = blt_loss(result.x, n, participation)
            if value < best_value:
                best_value, best = value, result.x
    if best is None:
        raise ValueError(f"no finite BLT found for n = {n}, buffers = {buffers}")
    order = np.argsort(best[:buffers])
    decays = _timescales_to_decays(best[:buffers][order])
    return Blt(tuple(decays), tuple(best[buffers:][order]))


class BltNoise:
    """Reference stream of w = C⁻¹ z for a BLT strategy C, with d buffers of state.

    w_t = z_t + Σ_j ω̂_j s_{j,t}, then s_{j,t+1} = θ̂_j s_{j,t} + z_t, where (θ̂, ω̂) is
    ``strategy.inverse()`` (Dvijotham et al. 2024). ``step`` takes the fresh N(0, I) draw.
    """

    def __init__(self, strategy: Blt) -> None:
        self.strategy = strategy
        inverse = strategy.inverse()
        self._decays = np.asarray(inverse.decays, dtype=np.float64)
        self._weights = np.asarray(inverse.weights, dtype=np.float64)
        self._buffers: Vector | None = None
        self.steps = 0

    def step(self, z: ArrayLike) -> Vector:
        """w_t for this step's fresh noise z_t (a new array)."""
        z = np.array(z, dtype=np.float64)
        if self._buffers is None:
            self._buffers = np.zeros((self._decays.size, *z.shape))
        elif self._buffers.shape[1:] != z.shape:
            raise ValueError(f"z has shape {z.shape}, earlier steps had {self._buffers.shape[1:]}")
        w = z + np.tensordot(self._weights, self._buffers, axes=(0, 0))
        shape = (-1,) + (1,) * z.ndim
        self._buffers = self._decays.reshape(shape) * self._buffers + z
        self.steps += 1
        return w

    def reset(self) -> None:
        """Empty the buffers: the next step is step 0 again."""
        self._buffers = None
        self.steps = 0
