"""RDP of subsampled mechanisms, where sampling amplifies privacy: Poisson (Mironov, Talwar &
Zhang 2019; computed in rdp_sampled_gaussian) and fixed-size without replacement (Wang, Balle &
Kasiviswanathan 2019)."""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import special

from dpfy.plan.accounting.events import (
    FixedSizeSampledEvent,
    GaussianEvent,
    NeighbouringRelation,
    PoissonSampledEvent,
)
from dpfy.plan.accounting.rdp_composition import _curve, _rule, rdp_unsupported_reason
from dpfy.plan.accounting.rdp_mechanisms import _pure_epsilon
from dpfy.plan.accounting.rdp_numerics import _log_abs_binom, _log_expm1
from dpfy.plan.accounting.rdp_sampled_gaussian import sampled_gaussian_curves


# -- Poisson-sampled Gaussian (Mironov, Talwar & Zhang 2019) ------------------------------------
def _poisson_reason(event: PoissonSampledEvent, relation: NeighbouringRelation) -> str | None:
    """Sampled-Gaussian RDP holds under add-or-remove and zero-out, for a Gaussian inside."""
    if relation is NeighbouringRelation.REPLACE_ONE:
        return (
            "Poisson sampling is accounted under add-or-remove or zero-out adjacency; under "
            "replace-one use FixedSizeSampledEvent (sampling without replacement) or an "
            "add-or-remove accountant"
        )
    if not isinstance(event.event, GaussianEvent):
        return (
            "the RDP accountant bounds Poisson sampling of a GaussianEvent only (Mironov, Talwar "
            f"& Zhang 2019); no sound RDP bound is implemented for a sampled "
            f"{type(event.event).__name__}"
        )
    return None


@functools.lru_cache(maxsize=512)
def _sampled_gaussian_cached(q: float, sigma: float, orders: tuple[float, ...]) -> np.ndarray:
    """The sampled-Gaussian curve, cached: calibration asks for the same (q, σ) many times."""
    grid = np.array(orders, dtype=float)
    curve = sampled_gaussian_curves(np.array([q]), np.array([sigma]), grid)[0]
    curve.flags.writeable = False
    return curve


def _sampled_gaussian_curve(q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """RDP of the Poisson-sampled Gaussian, sensitivity 1, under add-or-remove (MTZ 2019).

    The batched computation of :mod:`rdp_sampled_gaussian` for one (q, σ): q = 1 is the plain
    Gaussian α/(2σ²), and σ too small for the expansion to stay finite gives +∞.
    """
    return np.array(_sampled_gaussian_cached(float(q), float(sigma), tuple(map(float, orders))))


@_rule(PoissonSampledEvent, _poisson_reason)
def _poisson_sampled_curve(
    event: PoissonSampledEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """Sampled Gaussian mechanism; add-or-remove and zero-out share sensitivity 1."""
    return _sampled_gaussian_curve(event.sampling_rate, event.event.noise_multiplier, orders)


# -- sampling without replacement (Wang, Balle & Kasiviswanathan 2019) ---------------------------
def _fixed_size_reason(event: FixedSizeSampledEvent, relation: NeighbouringRelation) -> str | None:
    """Wang–Balle–Kasiviswanathan's bound is proved for replace-one neighbours only."""
    if relation is not NeighbouringRelation.REPLACE_ONE:
        return (
            "fixed-size sampling (without replacement) is accounted under replace-one adjacency "
            f"only (Wang, Balle & Kasiviswanathan 2019), not '{relation.value}'; use a "
            "replace-one accountant, or PoissonSampledEvent under add-or-remove"
        )
    return rdp_unsupported_reason(event.event, relation)


def _wbk_log_moment(gamma: float, alpha: int, inner: np.ndarray, pure_eps: float) -> float:
    """(α−1)·ε'(α) at integer α ≥ 2: WBK 2019, Theorem 9, in log space.

    ε'(α) ≤ log(1 + γ²C(α,2)·min{4(e^{ε(2)}−1), e^{ε(2)}·min{2, (e^{ε(∞)}−1)²}}
                  + Σ_{j=3}^{α} γ^j C(α,j) e^{(j−1)ε(j)} min{2, (e^{ε(∞)}−1)^j}) / (α−1),
    where ``inner[j−2]`` is the inner mechanism's ε(j) and ``pure_eps`` its ε(∞).
    """
    log_gamma = math.log(gamma)
    log_pure = float(_log_expm1(pure_eps)) if math.isfinite(pure_eps) else math.inf
    eps2 = float(inner[0])
    with np.errstate(divide="ignore"):
        second = min(
            math.log(4.0) + float(_log_expm1(eps2)), eps2 + min(math.log(2.0), 2 * log_pure)
        )
    log_terms = [2 * log_gamma + float(_log_abs_binom(alpha, np.array(2.0))[0]) + second]
    if alpha >= 3:
        j = np.arange(3, alpha + 1, dtype=float)
        log_binom, _ = _log_abs_binom(alpha, j)
        cap = np.minimum(math.log(2.0), j * log_pure)
        log_terms.extend(j * log_gamma + log_binom + (j - 1) * inner[1 : alpha - 1] + cap)
    return float(np.logaddexp(0.0, special.logsumexp(log_terms)))


@_rule(FixedSizeSampledEvent, _fixed_size_reason)
def _fixed_size_curve(
    event: FixedSizeSampledEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """Sampling without replacement under replace-one: WBK 2019, Theorem 9.

    The theorem holds at integer α ≥ 2. At a fractional α the bound linearly interpolates
    (α−1)ε(α) between the neighbouring integers (and between (1, 0) and α = 2): (α−1)D_α is the
    log-moment-generating function of the privacy loss, hence convex in α (Hölder; WBK 2019,
    Corollary 10), so the chord through upper bounds at the integers stays above it. That is
    sound and far tighter than ∞.
    The mechanism on the full data (no amplification) also bounds it, so the smaller is kept.
    """
    inner_at_orders = _curve(event.event, relation, orders)
    if event.batch_size == event.dataset_size:
        return inner_at_orders
    gamma = event.sampling_rate
    top = max(2, math.ceil(float(orders.max())))
    inner = _curve(event.event, relation, np.arange(2, top + 1, dtype=float))
    pure_eps = _pure_epsilon(event.event, relation)
    needed = {max(2, math.floor(a)) for a in orders} | {max(2, math.ceil(a)) for a in orders}
    log_moment = {a: _wbk_log_moment(gamma, a, inner, pure_eps) for a in sorted(needed)}
    curve = np.array([_interpolated_rdp(a, log_moment) for a in orders], dtype=float)
    return np.minimum(curve, inner_at_orders)


def _interpolated_rdp(alpha: float, log_moment: dict[int, float]) -> float:
    """ε(α) from the convex chord of (α−1)ε(α) through integer orders, (1, 0) included."""
    low, high = math.floor(alpha), math.ceil(alpha)
    if low == high:
        return log_moment[low] / (alpha - 1)
    if low < 2:
        return log_moment[2]  # chord from (1, 0) to (2, K(2)) gives K(α) = (α−1)·K(2)
    chord = (high - alpha) * log_moment[low] + (alpha - low) * log_moment[high]
    return chord / (alpha - 1)
