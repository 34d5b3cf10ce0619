"""RDP of subsampled mechanisms, where sampling amplifies privacy: Poisson (Mironov, Talwar &
Zhang 2019) and fixed-size without replacement (Wang, Balle & Kasiviswanathan 2019)."""

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
from dpfy.plan.accounting.rdp_numerics import (
    _half_square,
    _is_integer,
    _log_abs_binom,
    _log_abs_expm1,
    _log_expm1,
)

# -- Poisson-sampled Gaussian (Mironov, Talwar & Zhang 2019) ------------------------------------
_SERIES_BLOCK = 256
_SERIES_MAX_TERMS = 8192
_SERIES_LOG_RTOL = -30.0


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


def _log_moment_integer(q: float, sigma: float, alpha: int) -> float:
    """log A_α at integer α from the binomial expansion (MTZ 2019, §3), for q < 1.

    A_α = Σ_k C(α,k) (1−q)^{α−k} q^k e^{(k²−k)/(2σ²)}; the k = 0, 1 exponents vanish and the
    binomial weights sum to 1, so A_α − 1 is the sum over k ≥ 2 of weights times expm1(·): all
    terms positive, no cancellation even for q = 1e-6.
    """
    k = np.arange(2, alpha + 1, dtype=float)
    log_binom, _ = _log_abs_binom(alpha, k)
    log_terms = (
        log_binom
        + (alpha - k) * math.log1p(-q)
        + k * math.log(q)
        + _log_expm1((k * k - k) / (2 * sigma**2))
    )
    return float(np.logaddexp(0.0, special.logsumexp(log_terms)))


def _fractional_terms(
    q: float, sigma: float, alpha: np.ndarray, z0: float, k: np.ndarray, minus_one: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Signed log terms k of the two series of MTZ 2019 §3 (split of the integral at z₀).

    First series (z ≤ z₀): C(α,k) (1−q)^{α−k} q^k e^{(k²−k)/(2σ²)} Φ((z₀−k)/σ); second series
    (z > z₀), j = α−k: C(α,k) (1−q)^k q^j e^{(j²−j)/(2σ²)} Φ((j−z₀)/σ). With ``minus_one`` the
    first series' terms become weight·(e^{…}Φ − 1), which sums to A_α − 1 because the binomial
    weights sum to 1 for q < 1/2: the value stays accurate when A_α is within 1e-16 of 1.
    ``alpha`` (a column) and ``k`` (a row) broadcast to one row of terms per order.
    """
    log_binom, sign = _log_abs_binom(alpha, k)
    log_q, log_1mq = math.log(q), math.log1p(-q)
    two_var = 2 * sigma**2
    log_weight = log_binom + (alpha - k) * log_1mq + k * log_q
    log_first = (k * k - k) / two_var + special.log_ndtr((z0 - k) / sigma)
    if minus_one:
        log_factor, factor_sign = _log_abs_expm1(log_first)
        first, first_sign = log_weight + log_factor, sign * factor_sign
    else:
        first, first_sign = log_weight + log_first, sign
    j = alpha - k
    second = (
        log_binom
        + k * log_1mq
        + j * log_q
        + (j * j - j) / two_var
        + special.log_ndtr((j - z0) / sigma)
    )
    return np.concatenate([first, second], axis=-1), np.concatenate([first_sign, sign], axis=-1)


def _log_moments_fractional(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A_α at fractional orders: both convergent series summed in signed log space.

    Beyond k > α the terms alternate in sign and decay (polynomially far out), so each order
    sums block by block until a block adds less than e⁻³⁰ of its running total, which bounds the
    truncation error; all orders still running share one vectorised block.
    """
    z0 = sigma**2 * (math.log1p(-q) - math.log(q)) + 0.5
    minus_one = q < 0.5
    total = np.full(alphas.shape, -np.inf)
    total_sign = np.zeros(alphas.shape)
    running = np.arange(alphas.size)
    for start in range(0, _SERIES_MAX_TERMS, _SERIES_BLOCK):
        alpha = alphas[running, None]
        k = np.arange(start, start + _SERIES_BLOCK, dtype=float)[None, :]
        block_logs, block_signs = _fractional_terms(q, sigma, alpha, z0, k, minus_one)
        new_total, new_sign = special.logsumexp(
            np.concatenate([total[running, None], block_logs], axis=1),
            b=np.concatenate([total_sign[running, None], block_signs], axis=1),
            axis=1,
            return_sign=True,
        )
        total[running], total_sign[running] = new_total, new_sign
        largest = np.max(np.where(block_signs != 0, block_logs, -np.inf), axis=1)
        converged = (start + _SERIES_BLOCK > alpha[:, 0] + 1) & (
            (largest == -np.inf) | (largest < new_total + _SERIES_LOG_RTOL)
        )
        running = running[~converged]
        if running.size == 0:
            break
    if not minus_one:
        return total
    with np.errstate(over="ignore"):
        shifted = total_sign * np.minimum(
            np.exp(total), np.where(total_sign < 0, 1 - 1e-16, np.inf)
        )
    return np.log1p(shifted)


#: Largest exponent (k² − k)/(2σ²) the series may hold: beyond it ε_α exceeds 1e297 at best,
#: infinite for every purpose, and the float arithmetic would overflow into NaN.
_LOG_MAX_EXPONENT = math.log(1e300)


def _negligible_noise(sigma: float, orders: np.ndarray) -> bool:
    """Whether the exponents for the largest order overflow: σ too small for a finite bound."""
    top = float(np.max(orders)) + _SERIES_BLOCK  # the fractional series run past α
    return 2 * math.log(top) - math.log(2.0) - 2 * math.log(sigma) > _LOG_MAX_EXPONENT


@functools.lru_cache(maxsize=512)
def _sampled_gaussian_cached(q: float, sigma: float, orders: tuple[float, ...]) -> np.ndarray:
    """The sampled-Gaussian curve, cached: calibration asks for the same (q, σ) many times."""
    grid = np.array(orders, dtype=float)
    integer = np.array([_is_integer(a) for a in orders], dtype=bool)
    log_moment = np.empty_like(grid)
    log_moment[integer] = [_log_moment_integer(q, sigma, int(a)) for a in grid[integer]]
    log_moment[~integer] = _log_moments_fractional(q, sigma, grid[~integer])
    curve = np.maximum(log_moment, 0.0) / (grid - 1)
    curve.flags.writeable = False
    return curve


def _sampled_gaussian_curve(q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """RDP of the Poisson-sampled Gaussian, sensitivity 1, under add-or-remove (MTZ 2019).

    ε(α) = log A_α/(α−1) with A_α = E_{z∼N(0,σ²)}[((1−q) + q·e^{(2z−1)/(2σ²)})^α], the divergence
    of the mixture from N(0,σ²); MTZ 2019 (§3) show this direction dominates the reverse one,
    so it is the add-or-remove RDP. q = 1 is the plain Gaussian α/(2σ²). Where the series'
    exponents (k² − k)/(2σ²) would overflow a float the noise is negligible: the curve is +∞.
    """
    if _negligible_noise(sigma, orders):
        return np.full(np.shape(orders), np.inf)
    if q == 1.0:
        return orders * _half_square(1.0 / sigma)
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
