"""Rényi-DP accounting: the RDP curve ε(α) of every event, and its conversion to (ε, δ).

An RDP curve is a vector of upper bounds on the Rényi divergence of order α between the outputs
on neighbouring datasets, one entry per order of a fixed grid (Mironov 2017, Def. 4). Curves of
sequential runs add (Mironov 2017, Prop. 1), so composing events is summing vectors; the (ε, δ)
guarantee is the best conversion over the grid. Each event type has one small rule (its curve and
why it might be refused), registered in a dict keyed by the event class.

Pure numpy/scipy: this module never imports torch.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize, special

from dpfy._validate import check_delta, check_range
from dpfy.plan.accounting.accountant import Accountant, UnsupportedEventError, register_accountant
from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    FixedSizeSampledEvent,
    GaussianEvent,
    LaplaceEvent,
    NeighbouringRelation,
    NoOpEvent,
    PoissonSampledEvent,
    PureDpEvent,
    RepeatAndSelectEvent,
    SelfComposedEvent,
    TreeAggregationEvent,
    TrialDistribution,
    tree_aggregation_reason,
)

__all__ = [
    "DEFAULT_ORDERS",
    "GridEdgeWarning",
    "RdpAccountant",
    "RdpEpsilon",
    "check_orders",
    "delta_from_rdp",
    "epsilon_from_rdp",
    "rdp_curve",
    "rdp_unsupported_reason",
]

DEFAULT_ORDERS: tuple[float, ...] = (
    *(round(1 + i / 100, 2) for i in range(1, 10)),
    *(round(1 + i / 10, 1) for i in range(1, 100)),
    *(float(i) for i in range(11, 64)),
    128.0,
    256.0,
    512.0,
    1024.0,
)
"""Orders 1.01–1.09 (step 0.01), 1.1–10.9 (step 0.1), 11–63, 128, 256, 512, 1024.

A superset of the grid most RDP tools use, with extra orders near 1 for very large budgets.
"""


class GridEdgeWarning(UserWarning):
    """The best order was the smallest or largest of the grid: a wider grid may give a smaller ε."""


@dataclass(frozen=True)
class RdpEpsilon:
    """One (ε, δ) guarantee read off an RDP curve, with the order that certified it."""

    epsilon: float
    delta: float
    order: float
    on_grid_edge: bool


# -- validation ----------------------------------------------------------------------------------
def check_orders(orders: Sequence[float] | np.ndarray | None) -> np.ndarray:
    """A sorted, duplicate-free grid of finite orders above 1 (None gives ``DEFAULT_ORDERS``)."""
    if orders is None:
        return np.array(DEFAULT_ORDERS, dtype=float)
    values = [check_range("orders", o, 1.0, math.inf) for o in np.atleast_1d(np.asarray(orders))]
    if not values:
        raise ValueError("orders must hold at least one order in (1, inf), got an empty grid")
    return np.unique(np.array(values, dtype=float))


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


# -- numerics shared by several rules ------------------------------------------------------------
def _log_expm1(x: np.ndarray | float) -> np.ndarray:
    """log(eˣ − 1) for x ≥ 0 without overflow for large x or cancellation for small x."""
    x = np.asarray(x, dtype=float)
    with np.errstate(divide="ignore"):
        return x + np.log(-np.expm1(-x))


def _log_abs_expm1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log|eˣ − 1| and its sign, for any real x (−∞ with sign 0 at x = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        positive = _log_expm1(np.maximum(x, 0.0))
        negative = np.log(-np.expm1(np.minimum(x, 0.0)))
    return np.where(x > 0, positive, negative), np.sign(x)


def _log_abs_binom(alpha: float, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log|C(α, k)| and its sign for real α > 0 and whole k ≥ 0 (the generalised binomial)."""
    log_abs = special.gammaln(alpha + 1) - special.gammaln(k + 1) - special.gammaln(alpha - k + 1)
    return log_abs, special.gammasgn(alpha - k + 1)


def _is_integer(order: float) -> bool:
    """Integer orders have exact finite expansions; fractional ones need series or interpolation."""
    return float(order).is_integer()


# -- the rule registry ---------------------------------------------------------------------------
CurveRule = Callable[[Any, NeighbouringRelation, np.ndarray], np.ndarray]
ReasonRule = Callable[[Any, NeighbouringRelation], "str | None"]


def _always_supported(event: DpEvent, relation: NeighbouringRelation) -> str | None:
    """Leaf events with a closed-form curve are accepted under every relation."""
    return None


@dataclass(frozen=True)
class _Rule:
    """How one event type is accounted: its RDP curve, and why it could be refused."""

    curve: CurveRule
    reason: ReasonRule


_RULES: dict[type[DpEvent], _Rule] = {}


def _rule(
    event_type: type[DpEvent], reason: ReasonRule = _always_supported
) -> Callable[[CurveRule], CurveRule]:
    """Decorator: register ``curve`` (and its refusal reason) as the RDP rule of ``event_type``."""

    def register(curve: CurveRule) -> CurveRule:
        _RULES[event_type] = _Rule(curve, reason)
        return curve

    return register


def rdp_unsupported_reason(event: DpEvent, relation: NeighbouringRelation | str) -> str | None:
    """Why no sound RDP bound is implemented for ``event`` under ``relation``, or None."""
    relation = NeighbouringRelation.parse(relation)
    rule = _RULES.get(type(event))
    if rule is None:
        return f"the RDP accountant has no bound for {type(event).__name__}"
    return rule.reason(event, relation)


def rdp_curve(
    event: DpEvent,
    relation: NeighbouringRelation | str,
    orders: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """Upper bounds on the RDP ε(α) of ``event`` at each order; refuses unsupported events."""
    relation = NeighbouringRelation.parse(relation)
    orders = check_orders(orders)
    if not isinstance(event, DpEvent):
        raise ValueError(f"event must be a DpEvent, got {type(event).__name__}")
    reason = rdp_unsupported_reason(event, relation)
    if reason is not None:
        raise UnsupportedEventError(reason)
    return _curve(event, relation, orders)


def _curve(event: DpEvent, relation: NeighbouringRelation, orders: np.ndarray) -> np.ndarray:
    """Dispatch to the registered rule; callers have already checked support."""
    return _RULES[type(event)].curve(event, relation, orders)


# -- leaf mechanisms -----------------------------------------------------------------------------
@_rule(NoOpEvent)
def _noop_curve(event: NoOpEvent, relation: NeighbouringRelation, orders: np.ndarray) -> np.ndarray:
    """Touching no private data costs nothing at every order."""
    return np.zeros_like(orders)


def _half_square(scale: float) -> float:
    """scale²/2, or +∞ where that overflows a float: noise so small gives no finite guarantee."""
    with np.errstate(over="ignore"):
        return float(np.float64(scale) ** 2 / 2.0)


@_rule(GaussianEvent)
def _gaussian_curve(
    event: GaussianEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """α·s²/(2σ²) with s the relation's sensitivity factor (Mironov 2017, Table II)."""
    return orders * _half_square(relation.sensitivity_factor / event.noise_multiplier)


@_rule(LaplaceEvent)
def _laplace_curve(
    event: LaplaceEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """Laplace of scale λ = b/s (Mironov 2017, Prop. 6), evaluated in log space.

    ε(α) = log(α/(2α−1)·e^{(α−1)/λ} + (α−1)/(2α−1)·e^{−α/λ}) / (α−1), capped at its α → ∞
    limit 1/λ (the pure-DP ε) against rounding.
    """
    inverse_scale = relation.sensitivity_factor / event.noise_multiplier
    log_moment = np.logaddexp(
        np.log(orders / (2 * orders - 1)) + (orders - 1) * inverse_scale,
        np.log((orders - 1) / (2 * orders - 1)) - orders * inverse_scale,
    )
    return np.clip(log_moment / (orders - 1), 0.0, inverse_scale)


@_rule(PureDpEvent)
def _pure_dp_curve(
    event: PureDpEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """The tightest RDP of any ε-DP mechanism: that of randomised response with e^ε odds.

    Randomised response is the worst case among ε-DP pairs (Asoodeh, Liao, Calmon, Kosut &
    Sankar 2021, "Three variants of differential privacy: lossless conversion and applications";
    Steinke 2023, differentialprivacy.org "Tight RDP & zCDP bounds from pure DP"):
    ε(α) = log((e^{αε} + e^{(1−α)ε}) / (1 + e^ε)) / (α−1). It is never above the classic bounds
    ε (pure DP is (∞, ε)-RDP and D_α grows with α; Mironov 2017, §III) and αε²/2 (Bun & Steinke
    2016, Prop. 3.3); the minimum with them only guards against rounding.
    """
    eps = event.epsilon
    randomised_response = (
        np.logaddexp(orders * eps, (1 - orders) * eps) - np.logaddexp(0.0, eps)
    ) / (orders - 1)
    bound = np.minimum(randomised_response, np.minimum(eps, orders * eps**2 / 2))
    return np.maximum(bound, 0.0)


_PURE_EPSILON: dict[type[DpEvent], Callable[[Any, NeighbouringRelation], float]] = {
    NoOpEvent: lambda event, relation: 0.0,
    LaplaceEvent: lambda event, relation: relation.sensitivity_factor / event.noise_multiplier,
    PureDpEvent: lambda event, relation: event.epsilon,
}


def _pure_epsilon(event: DpEvent, relation: NeighbouringRelation) -> float:
    """The RDP at order ∞ (pure-DP ε) of a leaf event, ∞ when it has none (e.g. Gaussian)."""
    rule = _PURE_EPSILON.get(type(event))
    return math.inf if rule is None else rule(event, relation)


# -- DP-FTRL tree aggregation (Kairouz et al. 2021, App. D) --------------------------------------
@_rule(TreeAggregationEvent, lambda event, relation: tree_aggregation_reason(relation))
def _tree_aggregation_curve(
    event: TreeAggregationEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """α·depth·s²/(2σ²): one record sits in at most ``depth`` nodes, each with noise σ·Δ."""
    scale = relation.sensitivity_factor / event.noise_multiplier
    return orders * event.depth * _half_square(scale)


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


# -- composition ---------------------------------------------------------------------------------
def _self_composed_reason(event: SelfComposedEvent, relation: NeighbouringRelation) -> str | None:
    """A repeated event is supported exactly when the event is."""
    return rdp_unsupported_reason(event.event, relation)


@_rule(SelfComposedEvent, _self_composed_reason)
def _self_composed_curve(
    event: SelfComposedEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """RDP adds under adaptive composition (Mironov 2017, Prop. 1): count × the curve."""
    if event.count == 0:
        return np.zeros_like(orders)
    return event.count * _curve(event.event, relation, orders)


def _composed_reason(event: ComposedEvent, relation: NeighbouringRelation) -> str | None:
    """A sequence is supported when every member is; the first refusal explains why."""
    for member in event.events:
        reason = rdp_unsupported_reason(member, relation)
        if reason is not None:
            return reason
    return None


@_rule(ComposedEvent, _composed_reason)
def _composed_curve(
    event: ComposedEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """Heterogeneous runs compose by summing their curves (Mironov 2017, Prop. 1)."""
    total = np.zeros_like(orders)
    for member in event.events:
        total = total + _curve(member, relation, orders)
    return total


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


# -- randomised number of trials (Papernot & Steinke 2022) --------------------------------------
def _repeat_reason(event: RepeatAndSelectEvent, relation: NeighbouringRelation) -> str | None:
    """Repeat-and-select needs only the base mechanism's RDP curve."""
    return rdp_unsupported_reason(event.event, relation)


def _poisson_trials_curve(base: np.ndarray, orders: np.ndarray, mean: float) -> np.ndarray:
    """K ~ Poisson(μ): Papernot & Steinke 2022, Theorem 6.

    ε'(λ) = ε(λ) + μ·δ̂ + log(μ)/(λ−1), where the base is (ε̂, δ̂)-DP with ε̂ = log(1 + 1/(λ−1));
    δ̂ is read off the base curve with the conversion of ``delta_from_rdp``.
    """
    eps_hat = np.log1p(1.0 / (orders - 1))
    if np.any(base > 0):
        log_delta_hat = np.min(_log_delta_per_order(base, orders, eps_hat), axis=1)
        delta_hat = np.exp(np.minimum(log_delta_hat, 0.0))
    else:
        delta_hat = np.zeros_like(orders)
    return np.maximum(base + mean * delta_hat + math.log(mean) / (orders - 1), 0.0)


def _log_u_over_one_minus_exp(u: float) -> float:
    """log(u / (1 − e^{−u})), continuous through u = 0 where it is 0."""
    if u == 0:
        return 0.0
    if u > 0:
        return math.log(u) - math.log(-math.expm1(-u))
    return math.log(-u) - float(_log_expm1(-u))


def _log_tnb_mean(t: float, shape: float) -> float:
    """log E[K] of the truncated negative binomial with γ = e^{−t} (Papernot & Steinke 2022, §2).

    E[K] = η(1−γ)/(γ(1−γ^η)) = (e^t − 1)/t · ηt/(1 − e^{−ηt}); the η → 0 limit (logarithmic
    distribution, (1/γ − 1)/log(1/γ)) is the same expression with the last factor equal to 1.
    """
    return float(_log_expm1(t)) - math.log(t) + _log_u_over_one_minus_exp(shape * t)


def _log_inverse_gamma(mean: float, shape: float) -> float:
    """Solve E[K] = mean for t = log(1/γ); E[K] rises from 1 (t → 0) to ∞ (t → ∞)."""
    target = math.log(mean)

    def gap(t: float) -> float:
        return _log_tnb_mean(t, shape) - target

    low, high = 1e-12, 1.0
    if gap(low) >= 0:
        return low  # mean within 1e-12 of 1: a larger t only loosens the bound
    while gap(high) < 0:
        high *= 2.0
    return float(optimize.brentq(gap, low, high, xtol=1e-15, rtol=1e-15))


def _tnb_trials_curve(
    base: np.ndarray, orders: np.ndarray, mean: float, shape: float
) -> np.ndarray:
    """K ~ truncated negative binomial(η, γ): Papernot & Steinke 2022, Theorem 2.

    ε'(λ) = ε(λ) + (1+η)(1 − 1/λ̂)ε(λ̂) + (1+η)·log(1/γ)/λ̂ + log(E[K])/(λ−1), minimised over λ̂
    in the grid (the minimum does not depend on λ). γ is solved from the mean.
    """
    log_inv_gamma = _log_inverse_gamma(mean, shape)
    with np.errstate(invalid="ignore"):
        hat_terms = (1 + shape) * ((1 - 1 / orders) * base + log_inv_gamma / orders)
    best_hat = float(np.nanmin(np.where(np.isnan(hat_terms), np.inf, hat_terms)))
    return np.maximum(base + best_hat + math.log(mean) / (orders - 1), 0.0)


_TRIAL_RULES: dict[TrialDistribution, Callable[[np.ndarray, np.ndarray, Any], np.ndarray]] = {
    TrialDistribution.POISSON: lambda base, orders, e: _poisson_trials_curve(base, orders, e.mean),
    **dict.fromkeys(
        (
            TrialDistribution.TRUNCATED_NEGATIVE_BINOMIAL,
            TrialDistribution.GEOMETRIC,
            TrialDistribution.LOGARITHMIC,
        ),
        lambda base, orders, e: _tnb_trials_curve(base, orders, e.mean, e.shape),
    ),
}


@_rule(RepeatAndSelectEvent, _repeat_reason)
def _repeat_and_select_curve(
    event: RepeatAndSelectEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """Run the base a random number of times, release the best (Papernot & Steinke 2022)."""
    base = _curve(event.event, relation, orders)
    return _TRIAL_RULES[event.distribution](base, orders, event)


# -- the accountant ------------------------------------------------------------------------------
def _edge_message(details: RdpEpsilon, orders: np.ndarray) -> str:
    """Name the edge order and the direction in which to widen the grid."""
    smallest = details.order == orders[0]
    side, hint = (
        ("smallest", f"orders between 1 and {orders[0]:g}")
        if smallest
        else ("largest", f"orders above {orders[-1]:g}")
    )
    return (
        f"the best RDP order ({details.order:g}) is the {side} of the grid; the bound may be "
        f"loose — pass a wider grid to RdpAccountant(orders=...) that adds {hint}"
    )


@register_accountant
class RdpAccountant(Accountant):
    """Rényi-DP accountant: sums RDP curves over a grid of orders, converts to (ε, δ).

    Looser than PLD accounting for DP-SGD, but it alone covers sampling without replacement
    (replace-one) and randomised numbers of tuning trials.
    """

    name = "rdp"

    def __init__(
        self,
        relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE,
        orders: Sequence[float] | np.ndarray | None = None,
    ) -> None:
        super().__init__(relation)
        self._orders = check_orders(orders)
        self._rdp: np.ndarray | None = None

    @property
    def orders(self) -> np.ndarray:
        """The grid of orders (a copy)."""
        return self._orders.copy()

    @property
    def rdp(self) -> np.ndarray:
        """The RDP of everything composed so far, one entry per order (a copy)."""
        if self._rdp is None:
            total = np.zeros_like(self._orders)
            for event, count in self._composed:
                total = total + count * _curve(event, self.relation, self._orders)
            self._rdp = total
        return self._rdp.copy()

    def unsupported_reason(self, event: DpEvent) -> str | None:
        """Why this accountant cannot bound ``event`` under its relation, or None if it can."""
        return rdp_unsupported_reason(event, self.relation)

    def _invalidate(self) -> None:
        """A new event changes the curve; recompute it on the next query."""
        self._rdp = None

    def epsilon_details(self, delta: float) -> RdpEpsilon:
        """ε at ``delta`` with the certifying order; warns when that order is on the grid edge."""
        delta = check_delta(delta)
        details = epsilon_from_rdp(self.rdp, self._orders, delta)
        self._warn_on_edge(details)
        return details

    def delta_details(self, epsilon: float) -> RdpEpsilon:
        """δ at ``epsilon`` with the certifying order; warns when that order is on the grid edge."""
        epsilon = check_range("epsilon", epsilon, 0.0, math.inf, low_open=False)
        details = delta_from_rdp(self.rdp, self._orders, epsilon)
        self._warn_on_edge(details)
        return details

    def _warn_on_edge(self, details: RdpEpsilon) -> None:
        """A grid-edge optimum means ε could shrink with more orders: say so, never silently."""
        if details.on_grid_edge:
            warnings.warn(GridEdgeWarning(_edge_message(details, self._orders)), stacklevel=3)

    def _epsilon(self, delta: float) -> float:
        """The base-class hook: ε of the best order (warning on a grid-edge optimum)."""
        return self.epsilon_details(delta).epsilon

    def _delta(self, epsilon: float) -> float:
        """The base-class hook: δ of the best order (warning on a grid-edge optimum)."""
        return self.delta_details(epsilon).delta
