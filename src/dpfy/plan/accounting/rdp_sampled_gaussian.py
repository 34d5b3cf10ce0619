"""RDP of the Poisson-sampled Gaussian for many (q, σ) at once (Mironov, Talwar & Zhang 2019).

ε(α) = log A_α/(α−1), A_α = E_{x∼N(0,1)}[(1 + u(x))^α], u(x) = q·(e^{μx − μ²/2} − 1), μ = 1/σ:
the divergence of the mixture ``(1−q)N(0,σ²) + qN(1,σ²)`` from ``N(0,σ²)``, which MTZ 2019
(§3) show dominates the reverse direction. Both paths below compute A_α − 1, never A_α itself,
so values within 1e-16 of 1 (tiny q) keep their digits.

* Integer α: the finite binomial expansion A_α − 1 = Σ_{k≥2} C(α,k)(1−q)^{α−k} q^k
  expm1((k²−k)/(2σ²)), every term positive, summed in log space — exact up to rounding.
* Fractional α: the defining integral by the trapezoidal rule on a uniform grid. The integrand
  is analytic in the strip |Im x| < πσ (its only singularities are the branch points where
  1 + u = 0), so the rule converges geometrically in 1/h (Trefethen & Weideman 2014, "The
  exponentially convergent trapezoidal rule", Thm. 5.1); the step is chosen for a relative error
  far below 1e-12, and tests check the result against adaptive quadrature of the same integral.
  The integrand e^{αL} − 1 − α(e^L − 1), L = log1p(u), is non-negative (Bernoulli's
  inequality) and is summed without cancellation: by its Taylor series in L where |αL| is small
  (as moments of L, one matrix product for all orders) and directly elsewhere.

Every array is laid out one row per (q, σ), one column per order, so a schedule of 10⁴
distinct steps costs a few numpy passes rather than 10⁴ Python loops.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

__all__ = ["sampled_gaussian_curves"]

#: Largest exponent (k² − k)/(2σ²) the expansion may hold: beyond it ε_α exceeds 1e297 at
#: best, infinite for every purpose, and the float arithmetic would overflow into NaN.
_LOG_MAX_EXPONENT = math.log(1e300)
#: Rows computed together: bounds the temporaries at a few tens of MB.
_CHUNK_ELEMENTS = 1 << 21
#: Exponent of the trapezoid rule's relative error bound (see _step).
_STRIP_EXPONENT = 36.0
#: Half-width, in standard deviations, of the integration range beyond the integrand's peak.
_TAIL = 9.0
#: Where |L| is below min(_SERIES_LIMIT, _SERIES_REACH / α) the integrand is summed by its
#: Taylor series in L; elsewhere directly (conditioned within a factor ~2/|L| there).
_SERIES_LIMIT = 0.5
_SERIES_REACH = 5.5
#: Taylor terms L² … L^40: with |αL| ≤ 5.5 the next one is below 1e-18 of the sum.
_SERIES_TERMS = np.arange(2, 41)


def negligible_noise(sigma: np.ndarray, top_order: float) -> np.ndarray:
    """Whether the exponents for the largest order overflow: σ too small for a finite bound."""
    top = top_order + 256.0  # margin kept from the series this module replaced
    return 2 * math.log(top) - math.log(2.0) - 2 * np.log(sigma) > _LOG_MAX_EXPONENT


def sampled_gaussian_curves(
    q: np.ndarray, sigma: np.ndarray, orders: np.ndarray, top_order: float | None = None
) -> np.ndarray:
    """ε(α) of the Poisson-sampled Gaussian, one row per (q[i], σ[i]), one column per order.

    q = 1 is the plain Gaussian α/(2σ²). σ so small that the expansion's exponents would
    overflow a float at ``top_order`` (the grid's largest order, default the largest asked)
    gives +∞ at every order: no finite guarantee, whichever orders are asked.
    """
    q = np.asarray(q, dtype=float).reshape(-1)
    sigma = np.asarray(sigma, dtype=float).reshape(-1)
    orders = np.asarray(orders, dtype=float).reshape(-1)
    curves = np.empty((q.size, orders.size))
    infinite = negligible_noise(sigma, float(orders.max() if top_order is None else top_order))
    full = (q == 1.0) & ~infinite
    with np.errstate(over="ignore"):
        curves[full] = orders[None, :] * (0.5 / sigma[full] ** 2)[:, None]
    curves[infinite] = np.inf
    rest = np.flatnonzero(~infinite & ~full)
    if rest.size:
        integer = orders == np.round(orders)
        log_moment = np.empty((rest.size, orders.size))
        if integer.any():
            log_moment[:, integer] = _log_moments_integer(q[rest], sigma[rest], orders[integer])
        if (~integer).any():
            log_moment[:, ~integer] = _log_moments_fractional(
                q[rest], sigma[rest], orders[~integer]
            )
        curves[rest] = np.maximum(log_moment, 0.0) / (orders - 1)
    return curves


# -- integer orders: the binomial expansion ------------------------------------------------------
def _log_moments_integer(q: np.ndarray, sigma: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """log A_α at integer α ≥ 2 for each row, from the positive terms k = 2 … α (MTZ 2019, §3).

    log of a term = log C(α,k) + α·log(1−q) + k·log(q/(1−q)) + log expm1((k²−k)/(2σ²)); the
    α·log(1−q) part is shared by a whole order and added after the log-sum-exp.
    """
    alphas = alphas.astype(int)
    lengths = alphas - 1
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    k = np.concatenate([np.arange(2, a + 1) for a in alphas]).astype(float)
    alpha_of_term = np.repeat(alphas.astype(float), lengths)
    log_binom = (
        special.gammaln(alpha_of_term + 1) - special.gammaln(k + 1)
        - special.gammaln(alpha_of_term - k + 1)
    )  # fmt: skip
    top = int(alphas.max())
    ks = np.arange(top + 1, dtype=float)
    out = np.empty((q.size, alphas.size))
    rows = max(1, _CHUNK_ELEMENTS // max(k.size, 1))
    index = k.astype(int)
    for lo in range(0, q.size, rows):
        sl = slice(lo, lo + rows)
        log_odds = np.log(q[sl]) - np.log1p(-q[sl])
        with np.errstate(divide="ignore"):
            exponent = (ks * ks - ks)[None, :] / (2 * sigma[sl, None] ** 2)
            log_growth = exponent + np.log(-np.expm1(-exponent))  # log expm1, stable
        terms = np.take(log_growth, index, axis=1)
        terms += log_binom
        terms += log_odds[:, None] * k
        peak = np.maximum.reduceat(terms, starts, axis=1)
        terms -= np.repeat(peak, lengths, axis=1)
        np.exp(terms, out=terms)
        log_sum = np.log(np.add.reduceat(terms, starts, axis=1)) + peak
        log_am1 = log_sum + alphas[None, :] * np.log1p(-q[sl])[:, None]
        out[sl] = np.logaddexp(0.0, log_am1)
    return out


# -- fractional orders: the defining integral ----------------------------------------------------
def _step(sigma: float) -> float:
    """Trapezoid spacing for the smallest σ of a group.

    The integrand is analytic for |Im x| < πσ; on a strip of half-width a = min(0.8πσ, 4) the
    Gaussian weight grows by e^{a²/2}, so the rule's relative error is about
    exp(−2πa/h + a²/2): h = 2πa/(36 + a²/2) keeps it near e^{−36} ≈ 2e-16.
    """
    width = min(0.8 * math.pi * sigma, 4.0)
    return 2 * math.pi * width / (_STRIP_EXPONENT + width * width / 2)


def _log_moments_fractional(q: np.ndarray, sigma: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """log A_α at fractional α for each row, by the trapezoidal rule.

    Rows are taken in order of σ (then q), so that a group shares one grid: its spacing suits
    the group's smallest σ (within 25% of the largest) and its range the group's largest μ.
    """
    out = np.empty((q.size, alphas.size))
    order = np.lexsort((q, sigma))
    bands = _bands(alphas)
    position = 0
    while position < order.size:
        first = sigma[order[position]]
        stop = position + int(np.searchsorted(sigma[order[position:]], first * 1.25, "right"))
        step = _step(float(first))
        count = math.ceil((float(alphas.max()) / first + 2 * _TAIL) / step) + 1
        nodes = -_TAIL + step * np.arange(count)
        per_row = nodes.size * max(alphas.size, _SERIES_TERMS.size)
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // per_row)
        for lo in range(position, stop, rows_per_chunk):
            rows = order[lo : min(lo + rows_per_chunk, stop)]
            out[rows] = _trapezoid(q[rows], sigma[rows], alphas, bands, nodes, step)
        position = stop
    return out


def _bands(alphas: np.ndarray) -> list[np.ndarray]:
    """Orders grouped by the powers of two their max(α, 2) falls in: each band's integrand ends
    near its largest order's peak, so small orders skip the nodes only large ones need."""
    key = np.ceil(np.log2(np.maximum(alphas, 2.0)))
    return [np.flatnonzero(key == value) for value in np.unique(key)]


def _loss(q: np.ndarray, t: np.ndarray) -> np.ndarray:
    """L = log(1 + u) for u = q·(e^t − 1): accurate near u = 0 and free of overflow.

    Below t = 30, log1p(q·expm1(t)) keeps every digit of a tiny L; above it L is
    logaddexp(log(1−q), log q + t), whose terms no longer cancel.
    """
    moderate = t < 30.0
    near = np.log1p(q * np.expm1(np.where(moderate, t, 0.0)))
    return np.where(moderate, near, np.logaddexp(np.log1p(-q), np.log(q) + t))


def _trapezoid(
    q: np.ndarray,
    sigma: np.ndarray,
    alphas: np.ndarray,
    bands: list[np.ndarray],
    nodes: np.ndarray,
    step: float,
) -> np.ndarray:
    """log A_α = log1p(∫ φ(x)·h_α(L(x)) dx), h_α(L) = e^{αL} − 1 − α(e^L − 1), on the nodes.

    Every h is ≥ 0, so sums over nodes never cancel. Where |L| is small h is its Taylor series
    Σ_{n≥2} (αⁿ − α)Lⁿ/n!, integrated as moments of L (one matrix product for all orders);
    elsewhere h = e^L·expm1((α−1)L) − (α−1)·expm1(L), well conditioned even for α near 1
    (within a factor 2/|L|), in log space where e^{αL} could overflow.
    """
    mu = 1.0 / sigma[:, None]
    log_weight = math.log(step) - 0.5 * math.log(2 * math.pi) - 0.5 * nodes * nodes
    weight = np.exp(log_weight)
    loss = _loss(q[:, None], mu * nodes[None, :] - 0.5 * mu * mu)
    limit = min(_SERIES_LIMIT, _SERIES_REACH / float(alphas.max()))
    # Direct nodes: any row's |L| reaches the limit there; a row whose |L| is still tiny at
    # such a node (below limit/64) keeps it in its series instead, for conditioning.
    columns = np.flatnonzero(np.any(np.abs(loss) >= limit, axis=0))
    direct = np.zeros(loss.shape, dtype=bool)
    direct[:, columns] = np.abs(loss[:, columns]) >= limit / 64
    with np.errstate(divide="ignore"):
        log_total = np.log(np.maximum(_series_part(loss, weight, ~direct, alphas), 0.0))
    if columns.size:
        # The order (in units of μ) whose integrand still needs each node: x ≤ max(α,2)μ + tail.
        reach = (nodes - _TAIL) / float(mu.max())
        log_direct = _direct_part(loss, log_weight, direct, columns, alphas, bands, reach)
        log_total = np.logaddexp(log_total, log_direct)
    return np.logaddexp(0.0, log_total)


def _series_part(
    loss: np.ndarray, weight: np.ndarray, mask: np.ndarray, alphas: np.ndarray
) -> np.ndarray:
    """Σ_x w·h over the masked nodes via Σ_n (αⁿ − α)/n! · M_n, M_n = Σ_x w·Lⁿ."""
    term = np.where(mask, loss, 0.0)
    running = weight[None, :] * term * term
    moments = np.empty((loss.shape[0], _SERIES_TERMS.size))
    for i in range(_SERIES_TERMS.size):
        moments[:, i] = running.sum(axis=1)
        running *= term
    coefficients = (
        alphas[:, None]
        * np.expm1((_SERIES_TERMS[None, :] - 1) * np.log(alphas)[:, None])
        / special.factorial(_SERIES_TERMS)[None, :]
    )
    return np.einsum("rn,on->ro", moments, coefficients)


def _direct_part(
    loss: np.ndarray,
    log_weight: np.ndarray,
    mask: np.ndarray,
    columns: np.ndarray,
    alphas: np.ndarray,
    bands: list[np.ndarray],
    reach: np.ndarray,
) -> np.ndarray:
    """log Σ_x w·h over the masked nodes (rows × orders), band by band of orders.

    A band stops at the nodes ``reach`` marks for its largest order: the integrand beyond
    max(α, 2)·μ + 9 is below e^{−40} of its peak.
    """
    out = np.empty((loss.shape[0], alphas.size))
    for band in bands:
        a = alphas[band]
        cut = columns[reach[columns] <= max(float(a.max()), 2.0)]
        if cut.size == 0:
            out[:, band] = -np.inf
            continue
        keep = mask[:, cut]
        y = np.where(keep, loss[:, cut], 0.0)
        lw = np.where(keep, log_weight[cut][None, :], -np.inf)
        if float(a.max()) * float(np.max(y)) < 600.0:  # nothing below can overflow
            w = np.exp(lw)
            beta = (a - 1.0)[None, :, None]
            first = np.einsum("rox,rx->ro", np.expm1(beta * y[:, None, :]), np.exp(lw + y))
            second = (a - 1.0)[None, :] * (w * np.expm1(y)).sum(axis=1)[:, None]
            with np.errstate(divide="ignore"):
                out[:, band] = np.log(np.maximum(first - second, 0.0))
        else:
            out[:, band] = _direct_logspace(y, lw, a)
    return out


def _direct_logspace(y: np.ndarray, log_weight: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """log of the direct sum in log space, for nodes where e^{αL} could overflow a float."""
    beta = (alphas - 1.0)[None, :, None]
    yy = y[:, None, :]
    exponent = alphas[None, :, None] * yy
    with np.errstate(over="ignore", invalid="ignore"):
        h = np.exp(np.minimum(yy, 600.0)) * np.expm1(np.minimum(beta * yy, 600.0)) - beta * (
            np.expm1(np.minimum(yy, 600.0))
        )
    with np.errstate(divide="ignore"):
        log_h = np.where(exponent > 600.0, exponent, np.log(np.maximum(h, 0.0)))
    return special.logsumexp(log_h + log_weight[:, None, :], axis=2)
