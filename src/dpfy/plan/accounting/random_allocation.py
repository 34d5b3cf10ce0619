"""One epoch of balls-in-bins (random allocation, 1 of t steps) with the Gaussian mechanism, as a
pair of dominating discrete privacy-loss distributions that the PLD accountant composes.

**The pair.** In an epoch of t steps each example sits in exactly one step, chosen uniformly at
random and independently of everything else. For DP-SGD's adaptive Gaussian steps (noise σ on
sums of contributions of norm ≤ 1), Chua et al. ("Balls-and-Bins Sampling for DP-SGD",
AISTATS 2025: the tightly dominating pair (P_B, Q_B) they give for ABLQ_B, adaptive batch
linear queries on balls-and-bins batches) and Feldman & Shenfeld ("Privacy amplification by
random allocation", arXiv 2502.08202, whose numerical bounds for the Gaussian mechanism are
stated for the same pair) reduce one epoch, under add-or-remove adjacency, to

    P = (1/t) Σ_j N(μ e_j, I_t)   against   Q = N(0, I_t),        μ = 1/σ,

removal being (P ‖ Q) and addition (Q ‖ P). Both directions are covered, separately.

**Everything is a function of one sum.** dP/dQ(x) = S(x)/t with S = Σ_j exp(μ x_j − μ²/2). Under
Q, S is a sum of t independent log-normals Y = exp(μZ − μ²/2); under P, one of them (by symmetry,
any) is replaced by W = exp(μZ + μ²/2). So

* removal: privacy loss L = log(S/t) with S = W + Y₂ + … + Y_t  (its law under P);
* addition: privacy loss L = log(t/S) with S = Y₁ + … + Y_t      (its law under Q).

With t = 1 both are the Gaussian mechanism's own pair (the accountant then uses its Gaussian
leaf, exactly).

**A pessimistic discretisation, so ε stays an upper bound.** Each coordinate is rounded on the
lattice hℤ: *up* for removal (ceil(Y/h)·h ≥ Y) and *down* for addition (floor(Y/h)·h ≤ Y,
values above the top are floored to it). Removal's log-normal coordinates have heavy right
tails (exp(Z/σ)), so it splits on a threshold c: while no coordinate exceeds c all are on the
lattice; when exactly one does, it and the others' sum are rounded up on geometric grids;
two or more go to +∞ (mass ≤ 1e-13); see :func:`_removal_law`. Coupled draw by
draw, the rounded sum is ≥ S (removal) or ≤ S (addition), so every privacy loss is rounded
*up*: the discrete PLD is the original one with mass moved to larger losses (and to +∞), which is
again a valid PLD and dominates it, under composition too (Meiser & Mohammadi 2018; Zhu, Dong &
Wang 2022, Thm. 10). The law of the rounded sum is the t-fold convolution of the rounded
coordinate's law, computed with FFTs by repeated squaring. Each partial sum is kept on a
window of the lattice around its bulk (plus room for one heavy coordinate in removal), and what
falls outside is rounded the same way: below the window up to its start (removal) or to loss +∞
(addition), above it to +∞ (removal) or down to its end (addition). Negative float round-off
of the FFT is clipped to 0 (its size, ~1e-16 per point, is that of the accountant's own FFT
composition). Tightness only — never soundness — depends on the lattice and the windows: the
loss moves up by at most log(1 + t·h/S) ≈ t·h/S per epoch.

Two more roundings, both of the loss upwards: addition's rounded sum 0 (every coordinate
below h) is replaced by max_j Y_j ≤ S, rounded down on a geometric grid (P[max ≤ y] = F(y)^t);
and the stored log likelihood ratios sit on a grid of LOSS_STEP, rounded up (removal) or down
(addition, whose loss is their negative).

**What each part rests on.** (1) The dominating pair, removal (P ‖ Q) and addition (Q ‖ P):
Chua et al. 2025 (their dominating pair for ABLQ_B), the pair Feldman & Shenfeld 2025 compute
their Gaussian bounds for. (2) The reduction to the law of S: elementary (δ(ε) of a pair
depends only on the law of its likelihood ratio), derived above. (3) Rounding every loss up
gives a dominating PLD (the pessimistic discretisation of Meiser & Mohammadi 2018; Doroshenko,
Ghazi, Kamath, Kumar & Manurangsi 2022), and domination survives composition (Zhu, Dong & Wang
2022, Thm. 10) — with the other epochs and with any other leaf of the run, direction by
direction. (4) The accountant then discretises these pairs by connect-the-dots and composes
them like every leaf (:mod:`dpfy.plan.accounting.pld`); each direction's curve is capped by
the Gaussian mechanism's, which dominates the epoch too (:class:`CappedDirection`), so an epoch
is never charged more than before. k = N // B is fixed by the plan (a public number of steps),
the same on neighbouring datasets.

Not a Monte Carlo estimate: no sampling is involved anywhere. Poisson-subsampled steps at
q = 1/t are the natural comparison (Feldman & Shenfeld 2025: random allocation is close to it;
Feldman & Shenfeld, "Efficient privacy loss accounting for subsampling and random allocation",
arXiv 2602.17284, find it at least as good for the Gaussian mechanism — as the tests see too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import scipy.fft
from scipy.special import ndtr, ndtri

from dpfy.plan.accounting.pld_pairs import Direction, GaussianPair, LikelihoodRatioPair

__all__ = [
    "DEFAULT_POINTS",
    "SEARCH_POINTS",
    "AllocationPairs",
    "DiscreteLossPair",
    "RandomAllocationLeaf",
    "allocation_pairs",
]

#: Lattice points of the sum S for the reported ε, and the fewest any accountant gets (root
#: finding asks for 2^16; 2^18 keeps its answers within ~10 % of the reported ones).
DEFAULT_POINTS = 1 << 20
SEARCH_POINTS = 1 << 18
#: The large-coordinate threshold never exceeds W's (1 − TAIL_MASS) quantile.
TAIL_MASS = 1e-12
#: Standard deviations of a partial sum that its lattice window covers on each side.
_BULK_STDS = 12.0


class DiscreteLossPair(LikelihoodRatioPair):
    """A pair (P₁, P₀) on finitely many log likelihood ratios v_k, plus P₁-mass at +∞ and
    P₀-mass at −∞ (whatever of each law the finite atoms leave over).

    ``p1[k] = e^{v_k} · p0[k]``: the caller passes both, consistent. ``removal`` says which
    direction the pair serves: its loss range is that of v under P₁ (removal) or under P₀
    (addition), the measure the privacy loss is drawn from.
    """

    def __init__(
        self, log_ratios: np.ndarray, p1: np.ndarray, p0: np.ndarray, removal: bool
    ) -> None:
        self.removal = removal
        keep = (p1 > 0) | (p0 > 0)
        self.values = np.asarray(log_ratios, dtype=float)[keep]
        self._p1, self._p0 = np.asarray(p1, dtype=float)[keep], np.asarray(p0, dtype=float)[keep]
        self.p1_infinity = max(0.0, 1.0 - math.fsum(self._p1))
        self.p0_minus_infinity = max(0.0, 1.0 - math.fsum(self._p0))
        zero = np.zeros(1)
        # prefix[i] = Σ_{k<i}, suffix[i] = Σ_{k≥i}: each side summed from its own tail.
        self._prefix1 = np.concatenate([zero, np.cumsum(self._p1)])
        self._prefix0 = np.concatenate([zero, np.cumsum(self._p0)])
        self._suffix1 = np.concatenate([np.cumsum(self._p1[::-1])[::-1], zero])
        self._suffix0 = np.concatenate([np.cumsum(self._p0[::-1])[::-1], zero])

    def upper(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = np.searchsorted(self.values, np.asarray(tau, dtype=float), side="right")
        return self.p1_infinity + self._suffix1[i], self._suffix0[i]

    def lower(self, tau: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """P₀ from below and as 1 − its upper tail, whichever is larger: float round-off then
        only raises δ, and beyond the support the tail 1 − P₀(L ≤ τ) is exactly 0."""
        i = np.searchsorted(self.values, np.asarray(tau, dtype=float), side="right")
        p0 = np.maximum(self.p0_minus_infinity + self._prefix0[i], 1.0 - self._suffix0[i])
        return self._prefix1[i], p0

    @property
    def log_ratio_range(self) -> tuple[float, float]:
        """The range of v on the support of the measure this direction's loss is drawn from."""
        if self.removal:
            support = self.values[self._p1 > 0]
            lo = support[0] if support.size else math.inf
            hi = math.inf if self.p1_infinity > 0 or not support.size else support[-1]
        else:
            support = self.values[self._p0 > 0]
            lo = -math.inf if self.p0_minus_infinity > 0 or not support.size else support[0]
            hi = support[-1] if support.size else -math.inf
        return float(lo), float(hi)


@dataclass(frozen=True, eq=False)
class AllocationPairs:
    """One epoch's two dominating pairs: ``removal`` is used as (P₁ ‖ P₀), ``addition`` as
    (P₀ ‖ P₁) — the PLD accountant's two directions of an unsampled leaf — and μ = 1/σ, the
    Gaussian mechanism that also dominates the epoch (each example is in one step of it)."""

    removal: DiscreteLossPair
    addition: DiscreteLossPair
    mu: float

    def directed(self, removal: bool) -> DiscreteLossPair:
        """The pair the accountant's ``removal`` (True) or addition (False) direction uses."""
        return self.removal if removal else self.addition

    def direction(self, removal: bool) -> Direction:
        """The accountant's direction: this pair's curve, capped by the Gaussian's."""
        return CappedDirection(self.directed(removal), 1.0, removal, self.mu)


@dataclass(frozen=True)
class CappedDirection(Direction):
    """A direction whose curve is never above the Gaussian mechanism's (μ = ``gaussian``).

    Both pairs dominate the epoch, so the true curve δ(ε) — convex in x = e^ε, with δ = 1 at
    x = 0 — lies below both at every point; hence below the lower convex hull (in x) of
    (0, 1) and the points (x_i, min(δ_pair, δ_Gauss)(ε_i)) asked for, and below the chords
    between them. That hull is itself convex, so connect-the-dots on its values is a valid
    dominating PLD (Doroshenko et al. 2022): at small σ, where the lattice is coarse, the epoch
    is never charged more than one Gaussian of σ.
    """

    gaussian: float = math.inf

    @property
    def _plain(self) -> Direction:
        return Direction(GaussianPair(self.gaussian), 1.0, self.removal)

    def loss_range(self) -> tuple[float, float]:
        """Both curves' ranges: the grid must reach wherever either one is the lower."""
        own, plain = super().loss_range(), self._plain.loss_range()
        return min(own[0], plain[0]), max(own[1], plain[1])

    def lower_tail(self, eps: np.ndarray) -> np.ndarray:
        """The larger of both lower tails (where the grid starts only decides tightness)."""
        return np.maximum(super().lower_tail(eps), self._plain.lower_tail(eps))

    def hockey_stick(self, eps: np.ndarray) -> np.ndarray:
        eps = np.asarray(eps, dtype=float)
        own = super().hockey_stick(eps)
        plain = self._plain.hockey_stick(eps)
        lowest = np.minimum(own, plain)
        if lowest.size < 2:
            return lowest
        order = np.argsort(eps, kind="stable")
        hull = np.empty_like(lowest)
        hull[order] = _lower_hull(eps[order], lowest[order])
        return hull


def _lower_hull(eps: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The lower convex hull in x = e^ε of (0, 1) and (e^{ε_i}, values_i), at each x_i (sorted
    ε), by the monotone chain (Andrew 1979): a point on or above the segment joining its
    neighbours is dropped. x stays below e^{200}, far from overflow in the cross products.
    """
    x = np.concatenate([[0.0], np.exp(eps)])
    y = np.concatenate([[1.0], values])
    keep: list[int] = []
    for i in range(x.size):
        while len(keep) >= 2:
            a, b = keep[-2], keep[-1]
            # b lies on or above the segment a → i: drop it (cross product ≤ 0)
            if (x[b] - x[a]) * (y[i] - y[a]) - (y[b] - y[a]) * (x[i] - x[a]) <= 0:
                keep.pop()
            else:
                break
        keep.append(i)
    vertices = np.array(keep)
    return np.interp(x[1:], x[vertices], y[vertices])


@dataclass(frozen=True)
class RandomAllocationLeaf:
    """The PLD accountant's leaf factory for epochs of ``steps`` steps: called with μ = 1/σ (times
    the relation's sensitivity factor) and the accountant's lattice size, it gives the pairs."""

    steps: int
    takes_points = True  # the accountant passes its lattice size (see pld._leaf_counts)

    def __call__(self, mu: float, points: int = DEFAULT_POINTS) -> AllocationPairs:
        return allocation_pairs(mu, self.steps, max(int(points), SEARCH_POINTS))


# ---------------------------------------------------------------------------------------------
# The law of one rounded coordinate, and of the rounded sum
# ---------------------------------------------------------------------------------------------
#: A law on the lattice: (index of its first entry, masses); index i stands for the value i·h.
_Law = tuple[int, np.ndarray]


@dataclass(frozen=True)
class _Lattice:
    """The lattice hℤ and, for a sum of m coordinates, the window of indices it keeps.

    The window spans the bulk of the sum, [m − b·√(m·E[Y²]), m + b·√m·sd(Y)] (b = _BULK_STDS;
    below it a sum of non-negative terms has mass ≤ e^{−b²/2}, the sub-Gaussian lower tail),
    plus ``room`` above it for one heavy coordinate. Whatever falls outside is rounded in the
    direction of the lattice — ``up``: mass below moves up to the window's start, mass above is
    dropped (privacy loss +∞, counted in δ); down: mass below is dropped (loss +∞ for addition)
    and mass above is floored to the window's end — so nothing outside ever lowers a loss. The
    window only decides tightness and cost, never soundness.
    """

    mu: float
    steps: int
    points: int
    room: float
    up: bool

    def _edges(self, m: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """The window's value range for sums of m coordinates (m may be an array)."""
        second = math.exp(min(self.mu * self.mu, 700.0))
        spread = _BULK_STDS * np.sqrt(m) * math.sqrt(second - 1.0)
        low = np.maximum(0.0, m - _BULK_STDS * np.sqrt(m * second))
        return low, m + spread + self.room

    @property
    def h(self) -> float:
        """The spacing: every window of m ≤ t coordinates fits in ``points`` entries."""
        return _spacing(self.mu, self.steps, self.points, self.room)

    def window(self, m: int) -> tuple[int, int]:
        """First and last index kept for a sum of ``m`` coordinates."""
        low, _ = self._edges(float(m))
        first = math.floor(float(low) / self.h)
        return first, first + self.points - 1

    def coordinate(self, shift: float, last: int | None = None) -> _Law:
        """One coordinate exp(μZ + shift), rounded up (ceil) or down (floor) on the lattice;
        rounded up, only its values up to ``last``·h (the rest is left out: +∞, or another
        branch's)."""
        if last is None:
            _, last = self.window(1)
        k = np.arange(0, last + 1, dtype=float)  # edges k·h, k = 0..last
        with np.errstate(divide="ignore"):
            x = (np.log(k * self.h) - shift) / self.mu
        below, above = ndtr(x), ndtr(-x)
        # P[Y ∈ ((k−1)h, kh]] for k = 1..last, from whichever tail does not cancel.
        cells = np.where(x[1:] <= 0, below[1:] - below[:-1], above[:-1] - above[1:])
        cells = np.clip(cells, 0.0, None)
        if self.up:  # ceil: index k for ((k−1)h, kh]; above the last edge → +∞ (left out)
            return 0, np.concatenate([[0.0], cells])
        # floor: index k for [kh, (k+1)h); above the last edge floored to it
        return 0, np.concatenate([cells, [float(above[-1])]])

    def add(self, a: _Law, b: _Law, m: int) -> _Law:
        """The law of the sum (FFT convolution, round-off clipped at 0), cut to m's window."""
        (oa, pa), (ob, pb) = a, b
        size = pa.size + pb.size - 1
        full = scipy.fft.next_fast_len(size, real=True)
        spectrum = scipy.fft.rfft(pa, full)
        spectrum *= spectrum if pb is pa else scipy.fft.rfft(pb, full)  # squaring: one transform
        out = scipy.fft.irfft(spectrum, full)[:size]
        out = np.clip(out, 0.0, None)
        offset = oa + ob
        first, last = self.window(m)
        lo, hi = max(first - offset, 0), min(last - offset, size - 1)
        if lo > hi:  # pragma: no cover - the window always meets the sum's bulk
            raise RuntimeError("the random-allocation lattice missed the sum")
        kept = out[lo : hi + 1].copy()
        if self.up:
            kept[0] += out[:lo].sum()  # below the window: rounded up to its start
        else:
            kept[-1] += out[hi + 1 :].sum()  # above the window: floored to its end
        return offset + lo, kept

    def sum_of(self, law: _Law, count: int) -> _Law:
        """The law of ``count`` ≥ 1 independent copies' sum (repeated squaring)."""
        result: _Law | None = None
        done, base, size = 0, law, 1
        while count:
            if count & 1:
                done += size
                result = base if result is None else self.add(result, base, done)
            count >>= 1
            if count:
                size *= 2
                base = self.add(base, base, size)
        assert result is not None
        return result


@lru_cache(maxsize=64)
def _spacing(mu: float, steps: int, points: int, room: float) -> float:
    """h such that the widest window over m = 1..t fits in ``points`` entries."""
    lattice = _Lattice(mu, steps, points, room, up=True)
    low, high = lattice._edges(np.arange(1, steps + 1, dtype=float))
    return float(np.max(high - low)) / (points - 1)


@lru_cache(maxsize=16)
def allocation_pairs(mu: float, steps: int, points: int = DEFAULT_POINTS) -> AllocationPairs:
    """The two dominating discrete pairs of one epoch of ``steps`` steps at μ = 1/σ."""
    if steps < 2:
        raise ValueError("an epoch of one step is the Gaussian mechanism itself; use its pair")
    half = mu * mu / 2
    sums, removal = _removal_law(mu, steps, points)
    # Addition: S = Y₁ + … + Y_t, every coordinate rounded down, the law under Q (no room:
    # what lies above the window is floored to it).
    down_lattice = _Lattice(mu, steps, max(points // 2, 1024), 0.0, up=False)
    add_offset, addition = down_lattice.sum_of(down_lattice.coordinate(-half), steps)
    add_sums = (add_offset + np.arange(addition.size)) * down_lattice.h
    if add_offset == 0:
        # The rounded sum 0 is the event max_j Y_j < h, on which S ≥ max_j Y_j: that maximum,
        # rounded down on a geometric grid, replaces it (its law is P[max ≤ y] = F(y)^t).
        bottom, bottom_mass = _maximum_below(mu, steps, down_lattice.h)
        add_sums = np.concatenate([bottom, add_sums[1:]])
        addition = np.concatenate([bottom_mass, addition[1:]])
    add_q = addition
    # Log likelihood ratios log(S/t), rounded onto a grid of LOSS_STEP in the direction that
    # raises each direction's loss (up for removal, down for addition: its loss is −v).
    up = np.ceil(np.log(sums / steps) / LOSS_STEP)
    down = np.floor(np.log(add_sums / steps) / LOSS_STEP)
    removal_v, removal_p1 = _merged(up, removal)
    addition_v, addition_p0 = _merged(down, add_q)
    return AllocationPairs(
        removal=DiscreteLossPair(
            removal_v, removal_p1, removal_p1 * np.exp(-removal_v), removal=True
        ),
        addition=DiscreteLossPair(
            addition_v, addition_p0 * np.exp(addition_v), addition_p0, removal=False
        ),
        mu=mu,
    )


#: Mass of "two or more coordinates above the threshold", sent to +∞ in removal (bound).
PAIR_MASS = 1e-13
#: Geometric step (in log) of the grids on which one large coordinate, and the sum of the
#: others beside it, are rounded up.
_BIG_STEP = 1e-2
#: The threshold is at least this many bulk widths of the sum (cells, and work, stay few).
_BIG_OVER_BULK = 10.0


def _geometric_up(values: np.ndarray, masses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positive ``values`` rounded up on the grid v₀·e^{i·_BIG_STEP} (v₀ the smallest), with
    their masses summed per grid value."""
    levels = np.ceil(np.log(values / values[0]) / _BIG_STEP).astype(np.int64)
    summed = np.bincount(levels, weights=masses)
    keep = np.flatnonzero(summed > 0)
    return values[0] * np.exp(keep * _BIG_STEP), summed[keep]


def _threshold(mu: float, steps: int) -> float:
    """c: above it a coordinate is "large". At least _BIG_OVER_BULK bulk widths, and high
    enough that two large coordinates have mass ≤ PAIR_MASS; never above W's (1 − TAIL_MASS)
    quantile (the lattice's room without this branch)."""
    half = mu * mu / 2
    bulk = 2 * _BULK_STDS * math.sqrt(steps * math.expm1(min(mu * mu, 700.0)))
    top = half - mu * float(ndtri(TAIL_MASS))  # log of W's quantile

    def pairs(log_c: float) -> float:
        w = float(ndtr(-(log_c - half) / mu))
        y = float(ndtr(-(log_c + half) / mu))
        return w * (steps - 1) * y + (steps - 1) * (steps - 2) / 2 * y * y

    lo, hi = math.log(max(_BIG_OVER_BULK * bulk, 1.0)), top
    if lo >= hi or pairs(lo) <= PAIR_MASS:
        return math.exp(min(lo, hi))
    for _ in range(60):  # pairs() decreases in c
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pairs(mid) <= PAIR_MASS else (mid, hi)
    return math.exp(hi)


def _above(mu: float, shift: float, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Upper edges e_i = c·e^{i·step} and P[exp(μZ + shift) ∈ (e_{i−1}, e_i]] above c, up to
    where the tail is below 1e-18 (beyond: left out, +∞)."""
    log_c = math.log(threshold)
    log_end = max(shift - mu * float(ndtri(1e-18)), log_c + _BIG_STEP)
    logs = log_c + _BIG_STEP * np.arange(math.ceil((log_end - log_c) / _BIG_STEP) + 1)
    tail = ndtr(-(logs - shift) / mu)
    return np.exp(logs[1:]), np.clip(tail[:-1] - tail[1:], 0.0, None)


def _removal_law(mu: float, steps: int, points: int) -> tuple[np.ndarray, np.ndarray]:
    """Values of S rounded up (all > 0) and their masses under P, for removal.

    Split on the coordinates above a threshold c (a lattice point): none — every coordinate
    rounded up on the lattice, summed (windowed); exactly one — that coordinate rounded up on
    a geometric grid above c, plus the sum of the others (their law computed the same way,
    restricted to ≤ c) rounded up on a geometric grid; two or more — left out (+∞, mass
    ≤ PAIR_MASS). Each branch's value is ≥ S on its event, and the events are
    disjoint, so every privacy loss is rounded up.
    """
    half = mu * mu / 2
    threshold = _threshold(mu, steps)
    lattice = _Lattice(mu, steps, points, threshold, up=True)
    h = lattice.h
    cut = max(math.floor(threshold / h), 1)  # c on the lattice: "large" means > cut·h
    threshold = cut * h
    small_y = lattice.coordinate(-half, cut)
    small_w = lattice.coordinate(half, cut)
    rest = lattice.sum_of(small_y, steps - 2) if steps > 2 else (0, np.ones(1))
    without_w = lattice.add(rest, small_y, steps - 1)  # Y₂ … Y_t, all ≤ c
    without_y = lattice.add(rest, small_w, steps - 1)  # W and t − 2 of the Y, all ≤ c
    offset, none = lattice.add(without_w, small_w, steps)
    values = [(offset + np.arange(none.size)) * h]
    masses = [none]
    for (law_offset, law), shift, ways in ((without_w, half, 1), (without_y, -half, steps - 1)):
        # The others' sum, rounded up on a geometric grid, beside the large coordinate's cells.
        index = np.flatnonzero(law > 0)
        index = index[law_offset + index > 0]  # the value 0 holds only FFT round-off: dropped
        others, weights = _geometric_up((law_offset + index) * h, law[index])
        edges, cells = _above(mu, shift, threshold)
        values.append((edges[:, None] + others[None, :]).ravel())
        masses.append(ways * (cells[:, None] * weights[None, :]).ravel())
    sums, mass = np.concatenate(values), np.concatenate(masses)
    return sums[sums > 0], mass[sums > 0]  # the lattice's 0 holds no mass: each Y ≥ h


#: Grid of the stored log likelihood ratios: rounding a privacy loss up by at most this much
#: keeps the pair dominating and its arrays ~10x shorter than the lattice.
LOSS_STEP = 1e-4


def _merged(indices: np.ndarray, masses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The masses summed per grid index: (the grid values, their masses), ascending."""
    offset = int(indices.min())
    summed = np.bincount((indices - offset).astype(np.int64), weights=masses)
    keep = np.flatnonzero(summed > 0)
    return (keep + offset) * LOSS_STEP, summed[keep]


#: Geometric step of the grid on which addition's smallest sums are rounded down (in log).
_BOTTOM_STEP = 0.01
#: Below the grid's bottom, the maximum's mass (F(y)^t) is sent to loss +∞; at most this much.
_BOTTOM_MASS = 1e-30


def _maximum_below(mu: float, steps: int, spacing: float) -> tuple[np.ndarray, np.ndarray]:
    """Values y_{i+1} < y_i = h·e^{−i·step} and P[max_j Y_j ∈ [y_{i+1}, y_i)] (the maximum
    rounded down), down to where F(y)^t ≤ _BOTTOM_MASS (that rest is left out: loss +∞)."""
    shift = -mu * mu / 2
    log_top = math.log(spacing)
    # log F(y)^t = t·log Φ((log y − shift)/μ) ≤ log(_BOTTOM_MASS) below this y:
    z = float(ndtri(math.exp(math.log(_BOTTOM_MASS) / steps)))
    log_bottom = min(mu * z + shift, log_top - _BOTTOM_STEP)
    count = math.ceil((log_top - log_bottom) / _BOTTOM_STEP)
    logs = log_top - _BOTTOM_STEP * np.arange(count + 1)
    cdf_power = np.exp(steps * np.log(np.clip(ndtr((logs - shift) / mu), 1e-300, None)))
    masses = np.clip(cdf_power[:-1] - cdf_power[1:], 0.0, None)
    return np.exp(logs[1:])[::-1], masses[::-1]
