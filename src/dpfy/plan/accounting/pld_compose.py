"""FFT composition of one direction's discrete PLDs (Koskela, Jälkö & Honkela 2020), sized by
Chernoff bounds so that ε stays an upper bound, for a few leaves or for thousands.

Each leaf is discretised pessimistically (pld_leaves), transformed once, raised to its count in
the Fourier domain and multiplied in, so the cost grows with the number of *distinct* leaves,
not of steps. The output window comes from Chernoff bounds on the discrete PLDs; the mass above
it is bounded rigorously by the same bounds on the final discretisation and counted in δ, and
the mass below it aliases into the window, which can only overstate δ. The window and grid
only decide tightness and cost, never soundness.

Two setups choose the window and the grid spacing from a 2048-point look at each leaf. For a
few distinct leaves the spacing is a fraction of the smallest step's loss spread; for many
(a schedule), of the median step's, and the window uses fewer Chernoff exponents.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.fft

from dpfy.plan.accounting.pld_discrete import (
    _T_GRID,
    DEFAULT_PRECISION,
    LEAF_TAIL_MASS,
    WINDOW_TAIL_MASS,
    DiscretePld,
    PldPrecision,
    chernoff_window,
    discretize,
    step_std,
    summed_log_mgf,
)
from dpfy.plan.accounting.pld_leaves import truncations
from dpfy.plan.accounting.pld_pairs import Direction
from dpfy.plan.accounting.pld_rounding import MANY_LEAVES

#: Points of the first look at each leaf.
_COARSE_POINTS = 2048
#: Chernoff exponents of the cheaper set-up's window.
_CHEAP_T_GRID = np.geomspace(1e-2, 1e3, 8)
#: Chernoff exponents, relative to the window's, of the bound on the mass above the window:
#: any t > 0 gives a valid bound, and the window's own optimum keeps it tight and cheap.
_TAIL_TS = np.array([1.0])
#: Most grid points one leaf is discretised on: bounds the accountant's time and memory however
#: small σ is (a coarser grid is still a dominating, pessimistic discretisation).
MAX_LEAF_POINTS = 1 << 20
#: Fewest points of the composed window (a coarsened grid can make it very short).
_MIN_WINDOW_POINTS = 64
#: Leaf spectra computed together (bounds the FFT buffers at a few tens of MB).
_FFT_BUFFER = 1 << 21


def compose_directions(
    leaves: dict[Direction, int], precision: PldPrecision = DEFAULT_PRECISION
) -> DiscretePld:
    """Compose one direction's leaves (direction → count) into a single discrete PLD."""
    directions = list(leaves)
    counts = [leaves[d] for d in directions]
    bounds = truncations(directions, LEAF_TAIL_MASS / max(sum(counts), 1))
    many = len(directions) > MANY_LEAVES
    lo, hi, t_hi, spacing = (_many_leaves if many else _few_leaves)(
        directions, counts, bounds, precision
    )
    spacing = _bounded_leaf_spacing(spacing, bounds)
    size = max(round(max(hi - lo, 1e-9) * 1.1 / spacing), _MIN_WINDOW_POINTS)
    # The window in grid indices; the mass above it is bounded rigorously and counted in δ.
    start = math.floor((lo - 0.05 * (hi - lo)) / spacing)
    ts = t_hi * _TAIL_TS
    spectrum, offset, finite_mass, log_mgf = _compose(directions, counts, bounds, spacing, size, ts)
    above = float(min(1.0, np.exp(np.min(log_mgf - ts * (start + size - 1) * spacing))))
    composed = np.roll(scipy.fft.irfft(spectrum, size), -((start - offset) % size))
    infinity_mass = min(1.0, 1.0 - finite_mass + above)
    return DiscretePld(spacing, start, np.clip(composed, 0.0, None), infinity_mass)


Setup = tuple[float, float, float, float]


def _bounded_leaf_spacing(spacing: float, bounds: list[tuple[float, float]]) -> float:
    """``spacing``, coarsened where a leaf's kept loss range would need more than
    :data:`MAX_LEAF_POINTS` grid points.

    A tiny σ (e.g. calibrated for a δ near 1) makes a step's privacy loss range span hundreds
    of nats while its typical spread, which sets the spacing, is minute: at σ = 0.008 the leaf
    grid held 10⁸–10⁹ points (a minute and gigabytes for three steps). Connect-the-dots on any
    lattice dominates the true pair (Doroshenko et al. 2022), so a coarser grid only loosens the
    bound: ε is never under-reported.
    """
    widest = max((top - bottom for bottom, top in bounds), default=0.0)
    return max(spacing, widest / MAX_LEAF_POINTS)


def _grid(width: float, spread: float, precision: PldPrecision) -> float:
    """Spacing: a fraction of the smallest step spread, with enough (power-of-two) points."""
    spacing = min(precision.spacing_per_std * spread, width / precision.min_points)
    size = min(int(2 ** math.ceil(math.log2(width / spacing))), precision.max_points)
    return width / size


def _looks(
    directions: list[Direction],
    counts: list[int],
    bounds: list[tuple[float, float]],
    points: int,
) -> list[tuple[DiscretePld, int]]:
    """Each leaf discretised on ``points`` points over its kept range, with its count."""
    return [
        (discretize(d, max(b[1] - b[0], 1e-12) / points, b), c)
        for d, b, c in zip(directions, bounds, counts, strict=True)
    ]


def _few_leaves(
    directions: list[Direction],
    counts: list[int],
    bounds: list[tuple[float, float]],
    precision: PldPrecision,
) -> Setup:
    """A 2048-point look at each leaf gives the window and the smallest step spread."""
    coarse = _looks(directions, counts, bounds, _COARSE_POINTS)
    lo, hi, t_hi = chernoff_window(coarse, WINDOW_TAIL_MASS, _T_GRID)
    width = max(hi - lo, 1e-9) * 1.1
    spread = min((s for s in (step_std(p) for p, _ in coarse) if s > 0), default=width)
    return lo, hi, t_hi, _grid(width, spread, precision)


def _many_leaves(
    directions: list[Direction],
    counts: list[int],
    bounds: list[tuple[float, float]],
    precision: PldPrecision,
) -> Setup:
    """A 2048-point look at each leaf with fewer Chernoff exponents gives the window; the
    spread is the median step spread, weighted by count (each step resolved to a fraction of
    the typical step's spread: a much narrower one is a much cheaper step, whose extra
    discretisation pessimism costs little)."""
    coarse = _looks(directions, counts, bounds, _COARSE_POINTS)
    lo, hi, t_hi = chernoff_window(coarse, WINDOW_TAIL_MASS, _CHEAP_T_GRID)
    width = max(hi - lo, 1e-9) * 1.1
    spreads = np.array([step_std(p) for p, _ in coarse])
    weights = np.array(counts, dtype=float)[spreads > 0]
    spreads = spreads[spreads > 0]
    if spreads.size == 0:
        return lo, hi, t_hi, _grid(width, width, precision)
    order = np.argsort(spreads)
    cumulative = np.cumsum(weights[order])
    median = float(spreads[order][np.searchsorted(cumulative, cumulative[-1] / 2)])
    return lo, hi, t_hi, _grid(width, median, precision)


def _compose(
    directions: list[Direction],
    counts: list[int],
    bounds: list[tuple[float, float]],
    spacing: float,
    size: int,
    ts: np.ndarray,
) -> tuple[np.ndarray, int, float, np.ndarray]:
    """Discretise each leaf on the lattice of ``spacing`` and fold it in, a batch at a time.

    Returns Π spectrum^count, the summed offsets, the finite mass Π(1 − p_∞)^count and the
    composition's log MGF at ``ts`` (for the rigorous bound on the mass above the window).
    Index arithmetic is mod ``size``: a leaf longer than the window wraps around harmlessly.
    Nothing is kept per leaf, so memory does not grow with the number of leaves.
    """
    spectrum = np.ones(size // 2 + 1, dtype=complex)
    offset, finite_mass, log_mgf = 0, 1.0, np.zeros(ts.size)
    rows = max(1, _FFT_BUFFER // size)
    items = list(zip(directions, bounds, counts, strict=True))
    for first in range(0, len(items), rows):
        batch = [(discretize(d, spacing, b), c) for d, b, c in items[first : first + rows]]
        log_mgf += summed_log_mgf(batch, ts)
        wrapped = np.zeros((len(batch), size))
        for row, (pld, count) in enumerate(batch):
            wrapped[row] = np.bincount(
                np.arange(pld.pmf.size) % size, weights=pld.pmf, minlength=size
            )
            offset += count * pld.offset
            finite_mass *= (1.0 - pld.infinity_mass) ** count
        for row, transformed in enumerate(scipy.fft.rfft(wrapped, axis=1)):
            spectrum *= _power(transformed, batch[row][1])
    return spectrum, offset, finite_mass, log_mgf


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
