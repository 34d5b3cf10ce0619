"""Discrete PLDs on a grid: pessimistic connect-the-dots discretisation (Doroshenko et al. 2022)
and FFT composition (Koskela, Jälkö & Honkela 2020), so ε stays an upper bound."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.fft

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


DEFAULT_PRECISION = PldPrecision()
#: For root finding: within ~1 % of the default, several times faster.
SEARCH_PRECISION = PldPrecision(spacing_per_std=0.4, min_points=2**12, max_points=2**16)
#: Losses above this are treated as infinite (e^ε must stay a finite double).
MAX_LOSS = 200.0


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
        solution = math.log((self.infinity_mass + tail_mass[j - 1] - delta) / tail_weight[j - 1])
        return float(min(max(solution, losses[j - 1]), losses[j]))


def _bisect(predicate, lo: float, hi: float, iterations: int = 40) -> float:
    """The boundary of a monotone predicate that is False at lo and True at hi."""
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if predicate(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _upper_truncation(direction: Direction, tail: float) -> float:
    """A loss above which δ(ε) ≤ tail: beyond it, mass is sent to +∞."""
    lo, hi = direction.loss_range()
    if hi <= MAX_LOSS:
        return hi

    def small(e: float) -> bool:
        return float(direction.hockey_stick(np.array([e]))[0]) <= tail

    start = max(lo, 0.0)
    step = 1.0
    while not small(start + step) and start + step < MAX_LOSS:
        step *= 2
    top = min(start + step, MAX_LOSS)
    if not small(top):
        return top
    return _bisect(small, start, top)


def _lower_truncation(direction: Direction, tail: float) -> float:
    """A loss below which at most ``tail`` mass lies (that mass is rounded up, pessimistically)."""
    lo, hi = direction.loss_range()
    if lo > -math.inf:
        return lo

    def small(e: float) -> bool:
        return float(direction.lower_tail(np.array([e]))[0]) <= tail

    start = min(hi, 0.0)
    step = 1.0
    while not small(start - step):
        step *= 2
        if step > 1e6:  # pragma: no cover - no supported pair has such tails
            raise RuntimeError("privacy loss distribution has an unbounded lower tail")
    return -_bisect(lambda e: small(-e), -start, -(start - step))


def truncation(direction: Direction, tail: float) -> tuple[float, float]:
    """The loss range [bottom, top] kept for a leaf: below it at most ``tail`` mass (rounded up),
    above it δ ≤ ``tail`` (sent to +∞)."""
    return _lower_truncation(direction, tail), _upper_truncation(direction, tail)


def discretize(direction: Direction, spacing: float, bounds: tuple[float, float]) -> DiscretePld:
    """Connect-the-dots discretisation on the grid iΔ over ``bounds``: a dominating discrete PLD."""
    bottom, top = bounds
    i_lo = math.floor(bottom / spacing)
    i_hi = max(math.ceil(top / spacing), i_lo + 1)
    grid = np.arange(i_lo, i_hi + 1) * spacing
    curve = direction.hockey_stick(grid)
    infinity_mass = float(curve[-1])
    # Chord slopes of δ against x = e^ε: B_i between grid points i and i+1, anchored at (0, 1).
    gaps = np.exp(grid[:-1]) * math.expm1(spacing)
    slopes = np.concatenate([[(1.0 - curve[0]) / math.exp(grid[0])], -np.diff(curve) / gaps, [0.0]])
    pmf = np.exp(grid) * (slopes[:-1] - slopes[1:])
    pmf = np.clip(pmf, 0.0, None)
    infinity_mass += max(0.0, 1.0 - infinity_mass - float(pmf.sum()))
    return DiscretePld(spacing, i_lo, pmf, min(infinity_mass, 1.0))


# ---------------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------------
_T_GRID = np.geomspace(1e-3, 1e4, 48)


def _chernoff_window(
    parts: list[tuple[DiscretePld, int]], tail: float
) -> tuple[float, float, float]:
    """Losses (lo, hi) outside which the composed finite mass is ≤ ``tail`` per side, and the
    Chernoff exponent t that gave ``hi``."""
    log_tail = math.log(tail)
    up = sum(count * pld.log_mgf(_T_GRID) for pld, count in parts)
    down = sum(count * pld.log_mgf(-_T_GRID) for pld, count in parts)
    his = (up - log_tail) / _T_GRID
    lo = float(np.max(-(down - log_tail) / _T_GRID))
    best = int(np.argmin(his))
    return lo, float(his[best]), float(_T_GRID[best])


def _upper_tail_bound(parts: list[tuple[DiscretePld, int]], hi: float, t: float) -> float:
    """A rigorous Chernoff bound on the composed finite mass above the loss ``hi``.

    Any t > 0 gives a valid bound; a few values near the coarse optimum keep it tight and cheap.
    """
    ts = t * np.array([0.5, 0.8, 1.0, 1.25, 2.0])
    up = sum(count * pld.log_mgf(ts) for pld, count in parts)
    return float(min(1.0, np.exp(np.min(up - ts * hi))))


def _step_std(pld: DiscretePld) -> float:
    """Standard deviation of one step's finite privacy loss."""
    mass = pld.pmf.sum()
    mean = float(np.dot(pld.pmf, pld.losses) / mass)
    var = float(np.dot(pld.pmf, (pld.losses - mean) ** 2) / mass)
    return math.sqrt(max(var, 0.0))


def compose_directions(
    leaves: dict[Direction, int], precision: PldPrecision = DEFAULT_PRECISION
) -> DiscretePld:
    """Compose one direction's leaves (direction → count) into a single discrete PLD."""
    leaf_tail = LEAF_TAIL_MASS / max(sum(leaves.values()), 1)
    bounds = {d: truncation(d, leaf_tail) for d in leaves}
    # 1. A coarse look at each leaf (a few thousand points) gives its loss spread and the window.
    coarse = [
        (discretize(d, max(bounds[d][1] - bounds[d][0], 1e-12) / 2048, bounds[d]), c)
        for d, c in leaves.items()
    ]
    lo, hi, t_hi = _chernoff_window(coarse, WINDOW_TAIL_MASS)
    width = max(hi - lo, 1e-9) * 1.1
    # 2. Grid spacing: a fraction of the smallest step spread, and enough points over the window.
    spread = min((s for s in (_step_std(p) for p, _ in coarse) if s > 0), default=width)
    spacing = min(precision.spacing_per_std * spread, width / precision.min_points)
    size = min(int(2 ** math.ceil(math.log2(width / spacing))), precision.max_points)
    spacing = width / size
    fine = [(discretize(d, spacing, bounds[d]), c) for d, c in leaves.items()]
    # 3. The window in grid indices; the mass above it is bounded rigorously and counted in δ.
    start = math.floor((lo - 0.05 * (hi - lo)) / spacing)
    above = _upper_tail_bound(fine, (start + size - 1) * spacing, t_hi)
    # 4. FFT composition: index arithmetic is mod size, so a leaf may wrap around harmlessly; the
    #    mass below the window aliases into it, which can only overstate δ.
    spectrum = np.ones(size // 2 + 1, dtype=complex)
    offset = 0
    finite_mass = 1.0
    for pld, count in fine:
        wrapped = np.bincount(np.arange(pld.pmf.size) % size, weights=pld.pmf, minlength=size)
        spectrum *= _power(scipy.fft.rfft(wrapped), count)
        offset += count * pld.offset
        finite_mass *= (1.0 - pld.infinity_mass) ** count
    composed = np.roll(scipy.fft.irfft(spectrum, size), -((start - offset) % size))
    infinity_mass = min(1.0, 1.0 - finite_mass + above)
    return DiscretePld(spacing, start, np.clip(composed, 0.0, None), infinity_mass)


def _power(z: np.ndarray, exponent: int) -> np.ndarray:
    """z**exponent elementwise by repeated squaring: ~log₂(k) products, faster than complex pow."""
    result = np.ones_like(z)
    base = z.copy()
    while exponent:
        if exponent & 1:
            result *= base
        exponent >>= 1
        if exponent:
            base *= base
    return result
