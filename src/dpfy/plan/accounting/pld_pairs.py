"""Dominating pairs for PLD accounting and their exact privacy curves, in both directions of
Poisson subsampling (Zhu, Dong & Wang 2022, "Optimal accounting of differential privacy via
characteristic function")."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import numpy as np
from scipy.special import expit, ndtr


# ---------------------------------------------------------------------------------------------
# Base pairs: P₁ (with the record) against P₀ (without), scalar output, monotone likelihood ratio
# ---------------------------------------------------------------------------------------------
class LikelihoodRatioPair(abc.ABC):
    """A pair (P₁, P₀) whose log likelihood ratio L = log(dP₁/dP₀) is monotone in the output."""

    @abc.abstractmethod
    def upper(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(P₁(L > τ), P₀(L > τ)), elementwise."""

    @abc.abstractmethod
    def lower(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(P₁(L ≤ τ), P₀(L ≤ τ)), elementwise, computed without cancellation."""

    @property
    @abc.abstractmethod
    def log_ratio_range(self) -> tuple[float, float]:
        """The smallest and largest values L takes (±inf when unbounded)."""


@dataclass(frozen=True)
class GaussianPair(LikelihoodRatioPair):
    """P₁ = N(μ, 1), P₀ = N(0, 1) with μ = sensitivity / σ; L = μx − μ²/2."""

    mu: float

    def _threshold(self, tau: np.ndarray) -> np.ndarray:
        return tau / self.mu + self.mu / 2

    def upper(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = self._threshold(tau)
        return ndtr(self.mu - x), ndtr(-x)

    def lower(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = self._threshold(tau)
        return ndtr(x - self.mu), ndtr(x)

    @property
    def log_ratio_range(self) -> tuple[float, float]:
        return -math.inf, math.inf


@dataclass(frozen=True)
class LaplacePair(LikelihoodRatioPair):
    """P₁ = Lap(a, 1), P₀ = Lap(0, 1) with a = sensitivity / scale; L = |x| − |x − a| ∈ [−a, a]."""

    a: float

    def _parts(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tau = np.asarray(tau, dtype=float)
        inside = (tau >= -self.a) & (tau < self.a)
        x = np.clip((tau + self.a) / 2, 0.0, self.a)
        return tau, inside, x

    def upper(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tau, inside, x = self._parts(tau)
        below = tau < -self.a
        s1 = np.where(inside, -0.5 * np.expm1(x - self.a) + 0.5, np.where(below, 1.0, 0.0))
        s0 = np.where(inside, 0.5 * np.exp(-x), np.where(below, 1.0, 0.0))
        return s1, s0

    def lower(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tau, inside, x = self._parts(tau)
        above = tau >= self.a
        f1 = np.where(inside, 0.5 * np.exp(x - self.a), np.where(above, 1.0, 0.0))
        f0 = np.where(inside, 1.0 - 0.5 * np.exp(-x), np.where(above, 1.0, 0.0))
        return f1, f0

    @property
    def log_ratio_range(self) -> tuple[float, float]:
        return -self.a, self.a


@dataclass(frozen=True)
class PureDpPair(LikelihoodRatioPair):
    """The two-point pair that dominates every ε₀-DP mechanism (Kairouz, Oh & Viswanath 2015)."""

    epsilon: float

    def upper(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tau = np.asarray(tau, dtype=float)
        p = expit(self.epsilon)
        mid = (tau >= -self.epsilon) & (tau < self.epsilon)
        below = tau < -self.epsilon
        s1 = np.where(below, 1.0, np.where(mid, p, 0.0))
        s0 = np.where(below, 1.0, np.where(mid, 1.0 - p, 0.0))
        return s1, s0

    def lower(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tau = np.asarray(tau, dtype=float)
        p = expit(self.epsilon)
        mid = (tau >= -self.epsilon) & (tau < self.epsilon)
        above = tau >= self.epsilon
        f1 = np.where(above, 1.0, np.where(mid, 1.0 - p, 0.0))
        f0 = np.where(above, 1.0, np.where(mid, p, 0.0))
        return f1, f0

    @property
    def log_ratio_range(self) -> tuple[float, float]:
        return -self.epsilon, self.epsilon


# ---------------------------------------------------------------------------------------------
# The two directions of a Poisson-subsampled pair, as exact privacy curves
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Direction:
    """One direction of the (possibly subsampled) pair: the curve δ(ε) and its loss tails."""

    pair: LikelihoodRatioPair
    sampling_rate: float
    removal: bool

    def hockey_stick(self, eps: np.ndarray) -> np.ndarray:
        """δ(ε) = E_P[(1 − e^{ε−L})₊] for this direction, exactly."""
        return (_remove_curve if self.removal else _add_curve)(self.pair, self.sampling_rate, eps)

    def lower_tail(self, eps: np.ndarray) -> np.ndarray:
        """P(L ≤ ε) under this direction's first distribution."""
        q = self.sampling_rate
        eps = np.asarray(eps, dtype=float)
        if self.removal:
            t = (np.expm1(eps) + q) / q
            tau = np.log(np.where(t > 0, t, 1.0))
            f1, f0 = self.pair.lower(tau)
            return np.where(t > 0, (1 - q) * f0 + q * f1, 0.0)
        t = (np.expm1(-eps) + q) / q
        tau = np.log(np.where(t > 0, t, 1.0))
        # P₀(r ≥ t): just below τ the lower tail excludes an atom at τ itself.
        _, f0 = self.pair.lower(np.nextafter(tau, -np.inf))
        return np.where(t > 0, 1.0 - f0, 1.0)

    def loss_range(self) -> tuple[float, float]:
        """The smallest and largest privacy loss of this direction."""
        lo, hi = self.pair.log_ratio_range
        q = self.sampling_rate
        log_mix_lo = _log_mixture(q, lo)
        log_mix_hi = _log_mixture(q, hi)
        if self.removal:
            return log_mix_lo, log_mix_hi
        return -log_mix_hi, -log_mix_lo


def _log_mixture(q: float, log_r: float) -> float:
    """log(1 − q + q·e^{log_r}), the privacy loss of the removal direction at likelihood ratio r."""
    if log_r == -math.inf:
        return math.log1p(-q) if q < 1 else -math.inf
    if log_r == math.inf:
        return math.inf
    return float(np.logaddexp(math.log1p(-q) if q < 1 else -math.inf, math.log(q) + log_r))


def _remove_curve(pair: LikelihoodRatioPair, q: float, eps: np.ndarray) -> np.ndarray:
    """δ of ((1−q)P₀ + qP₁ ‖ P₀) at ε: q·(P₁(r > t) − t·P₀(r > t)), t = (e^ε − 1 + q)/q."""
    eps = np.asarray(eps, dtype=float)
    t = (np.expm1(eps) + q) / q
    positive = t > 0
    tau = np.log(np.where(positive, t, 1.0))
    s1, s0 = pair.upper(tau)
    curve = q * (s1 - np.where(positive, t, 0.0) * s0)
    return np.clip(np.where(positive, curve, -np.expm1(eps)), 0.0, 1.0)


def _add_curve(pair: LikelihoodRatioPair, q: float, eps: np.ndarray) -> np.ndarray:
    """δ of (P₀ ‖ (1−q)P₀ + qP₁) at ε: e^ε·q·(t·P₀(r ≤ t) − P₁(r ≤ t)), t = (e^{−ε} − 1 + q)/q."""
    eps = np.asarray(eps, dtype=float)
    t = (np.expm1(-eps) + q) / q
    positive = t > 0
    tau = np.log(np.where(positive, t, 1.0))
    f1, f0 = pair.lower(tau)
    curve = np.exp(eps) * q * (np.where(positive, t, 0.0) * f0 - f1)
    return np.clip(np.where(positive, curve, 0.0), 0.0, 1.0)
