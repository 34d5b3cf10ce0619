"""Discrete PLDs on a grid, their pessimistic connect-the-dots discretisation (Doroshenko et al.
2022) and the Chernoff bounds that size their FFT composition (pld_compose)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpfy.plan.accounting.pld_leaves import connect_the_dots
from dpfy.plan.accounting.pld_pairs import Direction

#: Mass allowed outside the composed window on each side (added to δ in full).
WINDOW_TAIL_MASS = 1e-15
#: Total mass a single leaf may move to +∞ by truncation, summed over all its repetitions.
LEAF_TAIL_MASS = 1e-15


@dataclass(frozen=True)
class PldPrecision:
    """How finely losses are discretised; coarser is faster and still a valid upper bound."""

    #: Grid spacing as a fraction of one step's privacy-loss standard deviation.
    spacing_per_std: float = 0.1
    #: Fewest and most grid points over the composed window (FFT sizes, powers of two).
    min_points: int = 2**15
    max_points: int = 2**20
    #: Relative step of the grid that many distinct sampled Gaussians are rounded up to
    #: (pld_rounding); ``round_always`` rounds every one of them, however few.
    rounding_resolution: float = 2**-8
    round_always: bool = False


DEFAULT_PRECISION = PldPrecision()
#: For root finding: within ~1 % of the default, several times faster.
SEARCH_PRECISION = PldPrecision(spacing_per_std=0.4, min_points=2**12, max_points=2**16)


# ---------------------------------------------------------------------------------------------
# Discrete PLDs on the grid iΔ
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiscretePld:
    """A sub-probability mass function on losses ``(offset + i)·Δ`` plus a mass at +∞."""

    spacing: float
    offset: int
    pmf: np.ndarray
    infinity_mass: float

    @property
    def losses(self) -> np.ndarray:
        """The loss value of each pmf entry."""
        return (self.offset + np.arange(self.pmf.size)) * self.spacing

    def log_mgf(self, t: np.ndarray) -> np.ndarray:
        """log Σ pmf·e^{t·loss} for each t (finite part only), computed stably."""
        support = self.pmf > 0
        logp = np.log(self.pmf[support])
        losses = self.losses[support]
        exponents = np.outer(t, losses) + logp
        peak = exponents.max(axis=1)
        return peak + np.log(np.exp(exponents - peak[:, None]).sum(axis=1))

    def delta(self, epsilon: float) -> float:
        """δ(ε) = p_∞ + Σ_{loss > ε} p·(1 − e^{ε − loss})."""
        losses = self.losses
        above = losses > epsilon
        tail = np.sum(self.pmf[above] * -np.expm1(epsilon - losses[above]))
        return float(min(1.0, self.infinity_mass + tail))

    def epsilon(self, delta: float) -> float:
        """The smallest ε ≥ 0 with δ(ε) ≤ delta (inf when the mass at +∞ alone exceeds it)."""
        if self.infinity_mass > delta:
            return math.inf
        if self.delta(0.0) <= delta:
            return 0.0
        losses = self.losses
        keep = losses >= 0
        losses, pmf = losses[keep], self.pmf[keep]
        if losses.size == 0 or losses[0] > 0:  # a zero-mass breakpoint at ε = 0
            losses, pmf = np.concatenate([[0.0], losses]), np.concatenate([[0.0], pmf])
        # Suffix sums over strictly larger losses: S_j = Σ_{k>j} p_k, E_j = Σ_{k>j} p_k e^{−ℓ_k}.
        tail_mass = np.concatenate([np.cumsum(pmf[::-1])[::-1][1:], [0.0]])
        # e^{−ℓ} may underflow for huge losses: that only shrinks E, which overstates δ.
        tail_weight = np.concatenate([np.cumsum((pmf * np.exp(-losses))[::-1])[::-1][1:], [0.0]])
        with np.errstate(divide="ignore"):
            curve = self.infinity_mass + tail_mass - np.exp(np.log(tail_weight) + losses)
        j = int(np.argmax(curve <= delta))  # the last point has δ = p_∞ ≤ delta
        if j == 0:
            return 0.0
        if tail_weight[j - 1] <= 0:  # e^{−ℓ} underflowed (ε > 700): answer the grid point
            return float(losses[j])
        # On [ℓ_{j−1}, ℓ_j) the curve is p_∞ + S_{j−1} − e^ε·E_{j−1}; solve δ(ε) = delta there.
        with np.errstate(over="ignore"):  # a tiny tail weight: the answer is ℓ_j, no warning
            ratio = (self.infinity_mass + tail_mass[j - 1] - delta) / tail_weight[j - 1]
        solution = math.log(ratio) if math.isfinite(ratio) else math.inf
        return float(min(max(solution, losses[j - 1]), losses[j]))


def discretize(direction: Direction, spacing: float, bounds: tuple[float, float]) -> DiscretePld:
    """Connect-the-dots discretisation on the lattice iΔ over ``bounds``: a dominating discrete
    PLD."""
    bottom, top = bounds
    i_lo = math.floor(bottom / spacing)
    i_hi = max(math.ceil(top / spacing), i_lo + 1)
    pmf, infinity_mass = connect_the_dots(direction, spacing, np.arange(i_lo, i_hi + 1))
    return DiscretePld(spacing, i_lo, pmf, infinity_mass)


# ---------------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------------
_T_GRID = np.geomspace(1e-3, 1e4, 48)


def summed_log_mgf(parts: list[tuple[DiscretePld, int]], t: np.ndarray) -> np.ndarray:
    """Σ count·log Σ pmf·e^{t·loss} over the parts, for each t: the log MGF of their composition.

    Each part's sum is scaled by e^{t·ℓ*} with ℓ* its largest loss for t > 0 (smallest for
    t < 0), so no term overflows; a term that underflows is below 1e-308 of that scale, and
    where the scaled sum itself is under 1e-250 (such terms could then matter) the part is
    recomputed with every term shifted by the largest exponent.
    """
    total = np.zeros(t.size)
    for pld, count in parts:
        support = np.flatnonzero(pld.pmf > 0)
        if support.size == 0:
            continue
        p = pld.pmf[support]
        losses = (pld.offset + support) * pld.spacing
        anchor = np.where(t > 0, losses[-1], losses[0])
        scaled = np.einsum("tx,x->t", np.exp(np.outer(t, losses) - (t * anchor)[:, None]), p)
        with np.errstate(divide="ignore"):
            log_mgf = np.log(scaled) + t * anchor
        tiny = scaled < 1e-250
        if tiny.any():
            log_mgf[tiny] = pld.log_mgf(t[tiny])
        total += count * log_mgf
    return total


def chernoff_window(
    parts: list[tuple[DiscretePld, int]], tail: float, t_grid: np.ndarray = _T_GRID
) -> tuple[float, float, float]:
    """Losses (lo, hi) outside which the composed finite mass is ≤ ``tail`` per side, and the
    Chernoff exponent t that gave ``hi``."""
    log_tail = math.log(tail)
    up = summed_log_mgf(parts, t_grid)
    down = summed_log_mgf(parts, -t_grid)
    his = (up - log_tail) / t_grid
    lo = float(np.max(-(down - log_tail) / t_grid))
    best = int(np.argmin(his))
    return lo, float(his[best]), float(t_grid[best])


def step_std(pld: DiscretePld) -> float:
    """Standard deviation of one step's finite privacy loss (in grid units about the mode)."""
    index = np.arange(pld.pmf.size) - int(np.argmax(pld.pmf))
    mass = pld.pmf.sum()
    mean = float(np.einsum("i,i->", pld.pmf, index) / mass)
    second = float(np.einsum("i,i,i->", pld.pmf, index, index) / mass)
    return pld.spacing * math.sqrt(max(second - mean * mean, 0.0))
