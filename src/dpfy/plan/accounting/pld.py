"""Privacy-loss-distribution (PLD) accountant: dpfy's default, tight and a valid upper bound.

How it works, and why each choice keeps ε an upper bound:

1. **Dominating pairs.** Every supported leaf is a pair of one-dimensional distributions with a
   monotone likelihood ratio (Gaussian, Laplace, the pure-ε pair), optionally Poisson-subsampled.
   Under add-or-remove adjacency the subsampled pair is ``((1−q)P₀ + qP₁, P₀)`` for removal and
   ``(P₀, (1−q)P₀ + qP₁)`` for addition (Zhu, Dong & Wang 2022, "Optimal accounting of
   differential privacy via characteristic function"); the two directions are composed separately
   and the worse one is reported. A balls-in-bins epoch (random allocation) is a leaf with one
   dominating discrete pair per direction (``random_allocation``), composed the same way.
2. **Exact privacy curves.** For each direction the hockey-stick divergence δ(ε) has a closed form
   in the base pair's tail probabilities (``pld_pairs._remove_curve`` / ``_add_curve``).
3. **Pessimistic discretisation by "connecting the dots"** (Doroshenko, Ghazi, Kamath, Kumar &
   Manurangsi 2022, "Connect the Dots: Tighter Discrete Approximations of Privacy Loss
   Distributions"): δ(ε) is convex in e^ε, so the chord through its values at grid points
   ``iΔ`` lies above it. That piecewise-linear curve is itself the privacy curve of a discrete
   PLD on the grid, which therefore dominates the true pair for *any* composition. Mass beyond
   the upper truncation point is moved to +∞ (it is counted in δ in full).
4. **FFT composition whose cost does not grow with the number of steps**: the discrete PLDs are
   transformed once, raised to their counts in the Fourier domain and transformed back (Koskela,
   Jälkö & Honkela 2020, "Computing tight differential privacy guarantees using FFT"). The
   output window comes from Chernoff bounds on the discrete PLDs themselves; the mass outside it
   (bounded rigorously by the same Chernoff bounds) is added to δ.

The grid spacing adapts to the composition (finer than a tenth of a step's loss spread, at least
2¹⁵ points over the window), so accuracy does not degrade for long runs.

Where each part lives: steps 1–2 in pld_pairs, steps 3–4 in pld_discrete; this module turns
events into leaves and holds the accountant.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfy.plan.accounting.accountant import Accountant, register_accountant
from dpfy.plan.accounting.events import (
    BallsInBinsEpochEvent,
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
    tree_aggregation_reason,
)
from dpfy.plan.accounting.pld_compose import compose_directions
from dpfy.plan.accounting.pld_discrete import (
    DEFAULT_PRECISION,
    SEARCH_PRECISION,
    DiscretePld,
    PldPrecision,
)
from dpfy.plan.accounting.pld_pairs import (
    Direction,
    GaussianPair,
    LaplacePair,
    LikelihoodRatioPair,
    PureDpPair,
)
from dpfy.plan.accounting.pld_rounding import MANY_LEAVES, dominating_gaussians
from dpfy.plan.accounting.random_allocation import RandomAllocationLeaf
from dpfy.plan.accounting.truncation import split_truncation

# ---------------------------------------------------------------------------------------------
# Events → leaves
# ---------------------------------------------------------------------------------------------
#: Each leaf event's pair, as (pair class, its parameter from the event and the sensitivity).
_PAIRS = {
    GaussianEvent: (GaussianPair, lambda e, factor: factor / e.noise_multiplier),
    LaplaceEvent: (LaplacePair, lambda e, factor: factor / e.noise_multiplier),
    PureDpEvent: (PureDpPair, lambda e, factor: e.epsilon),
}

_RDP_ONLY = (RepeatAndSelectEvent, FixedSizeSampledEvent)

_REPLACE_ONE_POISSON = (
    "Poisson sampling is accounted under add-or-remove or zero-out adjacency; under "
    "replace-one use fixed-size sampling (FixedSizeSampledEvent) with accountant='rdp'"
)


_REPLACE_ONE_BALLS_IN_BINS = (
    "balls-in-bins epochs are accounted under add-or-remove or zero-out adjacency (the "
    "random-allocation pair); under replace-one no bound is implemented"
)


@dataclass(frozen=True)
class _Leaf:
    """A base pair run on a Poisson sample of rate q (q = 1: the whole dataset)."""

    pair: LikelihoodRatioPair
    sampling_rate: float


#: A leaf before its pair is built: (pair class, pair parameter, sampling rate). Flattening
#: thousands of distinct steps into such tuples is cheap; pairs are made once per distinct key.
_Key = tuple[type, float, float]


class _Unsupported(Exception):
    """Internal: carries the reason an event cannot be accounted by PLD."""


def _leaves(
    event: DpEvent, relation: NeighbouringRelation, out: dict[_Key, int], times: int
) -> None:
    """Flatten ``event`` into leaf key → count, raising _Unsupported with a reason if impossible."""
    kind = type(event)
    if kind is PoissonSampledEvent and type(event.event) is GaussianEvent:  # DP-SGD: fast path
        if relation is NeighbouringRelation.REPLACE_ONE:
            raise _Unsupported(_REPLACE_ONE_POISSON)
        key = (
            GaussianPair,
            relation.sensitivity_factor / event.event.noise_multiplier,
            event.sampling_rate,
        )
        out[key] = out.get(key, 0) + times
    elif isinstance(event, NoOpEvent):
        return
    elif isinstance(event, SelfComposedEvent):
        _leaves(event.event, relation, out, times * event.count)
    elif isinstance(event, ComposedEvent):
        for inner in event.events:
            _leaves(inner, relation, out, times)
    elif isinstance(event, PoissonSampledEvent):
        key = _sampled_leaf(event, relation)
        out[key] = out.get(key, 0) + times
    elif isinstance(event, TreeAggregationEvent):  # a Gaussian of noise σ/√depth (App. D)
        reason = tree_aggregation_reason(relation)
        if reason is not None:
            raise _Unsupported(reason)
        mu = relation.sensitivity_factor * math.sqrt(event.depth) / event.noise_multiplier
        key = (GaussianPair, mu, 1.0)
        out[key] = out.get(key, 0) + times
    elif kind is BallsInBinsEpochEvent:  # random allocation, 1 of t (random_allocation)
        if relation is NeighbouringRelation.REPLACE_ONE:
            raise _Unsupported(_REPLACE_ONE_BALLS_IN_BINS)
        t = event.steps_per_epoch
        mu = relation.sensitivity_factor / event.noise_multiplier
        key = (GaussianPair if t == 1 else RandomAllocationLeaf(t), mu, 1.0)
        out[key] = out.get(key, 0) + times
    elif kind in _PAIRS:
        pair, parameter = _PAIRS[kind]
        key = (pair, parameter(event, relation.sensitivity_factor), 1.0)
        out[key] = out.get(key, 0) + times
    elif isinstance(event, _RDP_ONLY):
        raise _Unsupported(
            f"the PLD accountant has no bound for {type(event).__name__}; "
            "use the RDP accountant (accountant='rdp'), which implements it"
        )
    else:
        raise _Unsupported(f"the PLD accountant does not know {type(event).__name__}")


def _sampled_leaf(event: PoissonSampledEvent, relation: NeighbouringRelation) -> _Key:
    """Collapse nested Poisson sampling into one rate and check the inner mechanism is a leaf."""
    if relation is NeighbouringRelation.REPLACE_ONE:
        raise _Unsupported(_REPLACE_ONE_POISSON)
    rate, inner = event.sampling_rate, event.event
    while isinstance(inner, PoissonSampledEvent):
        rate, inner = rate * inner.sampling_rate, inner.event
    if type(inner) not in _PAIRS:
        raise _Unsupported(
            f"the PLD accountant supports Poisson sampling of Gaussian, Laplace or pure-DP "
            f"mechanisms, not of {type(inner).__name__}"
        )
    pair, parameter = _PAIRS[type(inner)]
    return (pair, parameter(inner, relation.sensitivity_factor), rate)


def _leaf_counts(keys: dict[_Key, int], points: int) -> dict[_Leaf, int]:
    """Distinct leaf keys → leaves, each pair made once (a lattice-built pair on ``points``)."""
    return {
        _Leaf(pair(parameter, points) if getattr(pair, "takes_points", False) else pair(parameter),
              rate): n
        for (pair, parameter, rate), n in keys.items()
    }  # fmt: skip


@register_accountant
class PldAccountant(Accountant):
    """Tight (ε, δ) by composing privacy-loss distributions; the default accountant."""

    name = "pld"

    def __init__(
        self,
        relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE,
        precision: PldPrecision = DEFAULT_PRECISION,
    ):
        super().__init__(relation)
        self.precision = precision
        self._cache: tuple[DiscretePld, ...] | None = None
        self._infinite = False  # a leaf beyond floating point (see composed)

    def for_search(self) -> PldAccountant:
        """A coarser PLD accountant for root finding (its answers are still upper bounds)."""
        return PldAccountant(self.relation, SEARCH_PRECISION)

    def for_bound(self) -> PldAccountant:
        """This accountant rounding every varying sampled Gaussian, however few (pld_rounding):
        it dominates this accountant on every composition whose fixed coordinates it shares."""
        return PldAccountant(self.relation, dataclasses.replace(self.precision, round_always=True))

    def unsupported_reason(self, event: DpEvent) -> str | None:
        event = split_truncation(event)[0]  # truncation is charged in δ (accountant.compose)
        if type(event) is PoissonSampledEvent and type(event.event) is GaussianEvent:
            replace = self.relation is NeighbouringRelation.REPLACE_ONE
            return _REPLACE_ONE_POISSON if replace else None  # DP-SGD steps: fast path
        try:
            _leaves(event, self.relation, {}, 1)
        except _Unsupported as err:
            return str(err)
        return None

    def _invalidate(self) -> None:
        self._cache = None

    def composed(self) -> tuple[DiscretePld, ...]:
        """The composed discrete PLD of each direction (removal first), computed once.

        Empty when a leaf's noise is so small that its distance overflows (σ below ~1e-308):
        its privacy loss is beyond floating point and cannot be discretised, so ε = ∞ and δ = 1
        are the only bounds that stay upper bounds.
        """
        if self._cache is None:
            keys: dict[_Key, int] = {}
            for event, count in self._composed:
                _leaves(event, self.relation, keys, count)
            self._infinite = any(not math.isfinite(parameter) for _, parameter, _ in keys)
            self._cache = () if self._infinite else tuple(_compose_leaves(keys, self.precision))
        return self._cache

    def _epsilon(self, delta: float) -> float:
        plds = self.composed()
        return math.inf if self._infinite else max(pld.epsilon(delta) for pld in plds)

    def _delta(self, epsilon: float) -> float:
        plds = self.composed()
        return 1.0 if self._infinite else max(pld.delta(epsilon) for pld in plds)


def _rounded(keys: dict[_Key, int], precision: PldPrecision) -> dict[_Key, int]:
    """Many distinct Gaussian leaves replaced by fewer dominating ones (pld_rounding)."""
    if not precision.round_always and len(keys) <= MANY_LEAVES:
        return keys
    out = {key: n for key, n in keys.items() if key[0] is not GaussianPair}
    gaussian = {(key[1], key[2]): n for key, n in keys.items() if key[0] is GaussianPair}
    rounded = dominating_gaussians(gaussian, precision.rounding_resolution)
    for (mu, q), n in rounded.items():
        out[(GaussianPair, mu, q)] = out.get((GaussianPair, mu, q), 0) + n
    return out


def _compose_leaves(keys: dict[_Key, int], precision: PldPrecision) -> list[DiscretePld]:
    """Both directions' composed PLDs; one suffices when nothing is subsampled (symmetric pairs)."""
    leaves = _leaf_counts(_rounded(keys, precision), precision.max_points)
    if not leaves:
        return [DiscretePld(1.0, 0, np.ones(1), 0.0)]
    directions = [True]
    if any(leaf.sampling_rate < 1 or _directed(leaf.pair) for leaf in leaves):
        directions.append(False)
    return [
        compose_directions(
            {_direction(lf, way): c for lf, c in leaves.items()},
            precision,
        )
        for way in directions
    ]


def _directed(pair: object) -> bool:
    """Whether a leaf builds its own direction per way (balls-in-bins epochs)."""
    return hasattr(pair, "direction")


def _direction(leaf: _Leaf, removal: bool) -> Direction:
    """The direction a leaf composes: a directed leaf's own, else its pair at its rate."""
    pair: Any = leaf.pair
    if _directed(pair):
        return pair.direction(removal)
    return Direction(pair, leaf.sampling_rate, removal)
