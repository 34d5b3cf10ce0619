"""What a mechanism did, as small immutable events that every accountant consumes.

An event describes the privacy-relevant shape of a computation — the noise distribution, how data
was sampled, how often it ran — and nothing else. Accountants turn events into ε; they never learn
where an event came from. The algebra follows the guide's §2.2–§4.2 vocabulary.

Noise is always *decoupled*: ``GaussianEvent(noise_multiplier=σ)`` means Gaussian
noise of standard deviation ``σ · Δ`` added to a query whose per-record contribution is bounded by
``Δ`` (the clip norm ``C`` in DP-SGD). Accountants never see ``σ · C`` as "the noise".
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from dpfy._validate import check_count, check_positive, check_range, check_sampling_rate


class NeighbouringRelation(enum.Enum):
    """Which datasets count as neighbours (guide §2.1).

    ``ADD_OR_REMOVE``: one dataset has one extra record. ``ZERO_OUT``: one record is replaced by a
    null record that contributes nothing (numerically the same accounting as add-or-remove for the
    events here). ``REPLACE_ONE``: one record is swapped for another, which doubles the sensitivity
    of a sum of clipped contributions; ε under different relations is never comparable.
    """

    ADD_OR_REMOVE = "add-or-remove"
    ZERO_OUT = "zero-out"
    REPLACE_ONE = "replace-one"

    @property
    def sensitivity_factor(self) -> float:
        """How much one neighbour can move a sum of per-record contributions bounded by Δ, in Δ."""
        return 2.0 if self is NeighbouringRelation.REPLACE_ONE else 1.0

    @classmethod
    def parse(cls, value: NeighbouringRelation | str) -> NeighbouringRelation:
        """Accept the enum or its hyphenated name, with an error that lists the choices."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower().replace("_", "-"))
        except ValueError:
            choices = ", ".join(r.value for r in cls)
            raise ValueError(
                f"neighbouring relation must be one of {choices}; got {value!r}"
            ) from None


class DpEvent:
    """Base of all events: immutable, hashable, comparable by value."""

    __slots__ = ()


@dataclass(frozen=True)
class GaussianEvent(DpEvent):
    """Gaussian noise of std ``noise_multiplier · Δ`` on a query of per-record sensitivity Δ."""

    noise_multiplier: float

    def __post_init__(self) -> None:
        check_positive("noise_multiplier", self.noise_multiplier)


@dataclass(frozen=True)
class LaplaceEvent(DpEvent):
    """Laplace noise of scale ``noise_multiplier · Δ₁`` on a query of ℓ₁ sensitivity Δ₁."""

    noise_multiplier: float

    def __post_init__(self) -> None:
        check_positive("noise_multiplier", self.noise_multiplier)


@dataclass(frozen=True)
class PureDpEvent(DpEvent):
    """A mechanism that is ε-DP under the accountant's relation (exponential mechanism, RR)."""

    epsilon: float

    def __post_init__(self) -> None:
        check_positive("epsilon", self.epsilon)


@dataclass(frozen=True)
class NoOpEvent(DpEvent):
    """A computation that touched no private data: costs nothing, kept for the record."""


@dataclass(frozen=True)
class PoissonSampledEvent(DpEvent):
    """``event`` run on a Poisson sample: each record enters independently with rate q."""

    sampling_rate: float
    event: DpEvent

    def __post_init__(self) -> None:
        check_sampling_rate(self.sampling_rate)
        _check_event("event", self.event)


@dataclass(frozen=True)
class TruncatedPoissonSampledEvent(DpEvent):
    """``event`` on a Poisson sample at rate q cut to at most ``max_batch_size`` records.

    Identical to ``PoissonSampledEvent(q, event)`` except when the sample exceeds the cap; every
    accountant charges that chance in δ (:mod:`dpfy.plan.accounting.truncation`).
    """

    sampling_rate: float
    dataset_size: int
    max_batch_size: int
    event: DpEvent

    def __post_init__(self) -> None:
        check_sampling_rate(self.sampling_rate)
        check_count("dataset_size", self.dataset_size, minimum=1)
        check_count("max_batch_size", self.max_batch_size, minimum=1)
        _check_event("event", self.event)


@dataclass(frozen=True)
class FixedSizeSampledEvent(DpEvent):
    """``event`` run on ``batch_size`` records drawn uniformly without replacement.

    Sound bounds exist under replace-one adjacency only (Wang, Balle & Kasiviswanathan 2019), and
    only the RDP accountant implements them. Shuffled epochs are *not* this event: a shuffled
    pass has no standard amplification bound (guide §4.3).
    """

    dataset_size: int
    batch_size: int
    event: DpEvent

    def __post_init__(self) -> None:
        check_count("dataset_size", self.dataset_size, minimum=1)
        check_count("batch_size", self.batch_size, minimum=1)
        if self.batch_size > self.dataset_size:
            raise ValueError(
                f"batch_size must be at most dataset_size ({self.dataset_size}), "
                f"got {self.batch_size}"
            )
        _check_event("event", self.event)

    @property
    def sampling_rate(self) -> float:
        """The fraction of the dataset in one batch."""
        return self.batch_size / self.dataset_size


@dataclass(frozen=True)
class BallsInBinsEpochEvent(DpEvent):
    """One epoch of balls-in-bins sampling: each record in one of ``steps_per_epoch`` Gaussian
    steps of noise multiplier σ, chosen uniformly at random (random allocation, 1 of t).

    Chua et al. 2025 ("Balls-and-Bins Sampling for DP-SGD"); the PLD accountant bounds it by the
    random-allocation pair of :mod:`dpfy.plan.accounting.random_allocation` (Feldman & Shenfeld
    2025). With one step per epoch it is ``GaussianEvent(σ)``.
    """

    noise_multiplier: float
    steps_per_epoch: int

    def __post_init__(self) -> None:
        check_positive("noise_multiplier", self.noise_multiplier)
        steps = check_count("steps_per_epoch", self.steps_per_epoch, minimum=1)
        object.__setattr__(self, "steps_per_epoch", steps)


@dataclass(frozen=True)
class SelfComposedEvent(DpEvent):
    """``event`` run ``count`` times in sequence (adaptively)."""

    event: DpEvent
    count: int

    def __post_init__(self) -> None:
        _check_event("event", self.event)
        object.__setattr__(self, "count", check_count("count", self.count, minimum=0))


@dataclass(frozen=True)
class ComposedEvent(DpEvent):
    """Several events run in sequence (adaptively); heterogeneous σ or q are fine."""

    events: tuple[DpEvent, ...]

    def __post_init__(self) -> None:
        events = tuple(self.events)
        for i, event in enumerate(events):
            _check_event(f"events[{i}]", event)
        object.__setattr__(self, "events", events)


@dataclass(frozen=True)
class TreeAggregationEvent(DpEvent):
    """One epoch of DP-FTRL tree aggregation: Gaussian noise on every node of one or more trees.

    Kairouz, McMahan, Song, Thakkar, Thakurta & Xu 2021 ("Practical and Private (Deep) Learning
    without Sampling or Shuffling", App. D): a binary tree over a stream of ``steps`` clipped
    gradient sums gets N(0, σ²Δ²) on each node; the tree is restarted after each entry of
    ``step_counts``, and every record enters **at most once across all these trees**. One record
    then sits in at most ``depth = ⌈log₂(max(step_counts) + 1)⌉`` nodes, so the whole release is a
    Gaussian mechanism of noise multiplier σ/√depth. Several epochs compose (a self-composed
    event). The stream's order is fixed whatever the data, so neighbours replace a record by a
    null one (zero-out) or by another (replace-one); add-or-remove would shift the stream and is
    refused by the accountants.
    """

    noise_multiplier: float
    step_counts: tuple[int, ...]

    def __post_init__(self) -> None:
        check_positive("noise_multiplier", self.noise_multiplier)
        counts = self.step_counts
        if isinstance(counts, int) and not isinstance(counts, bool):
            counts = (counts,)
        if not isinstance(counts, (tuple, list)) or not counts:
            raise ValueError(
                "step_counts must be a non-empty sequence of tree sizes (steps between restarts), "
                f"got {self.step_counts!r}"
            )
        counts = tuple(check_count("step_counts[i]", c, minimum=1) for c in counts)
        object.__setattr__(self, "step_counts", counts)

    @property
    def depth(self) -> int:
        """Nodes one record can touch: ⌈log₂(T+1)⌉ for the largest tree (T.bit_length())."""
        return max(self.step_counts).bit_length()


def tree_aggregation_reason(relation: NeighbouringRelation) -> str | None:
    """Why tree aggregation has no bound under ``relation`` (add-or-remove), or None."""
    if relation is NeighbouringRelation.ADD_OR_REMOVE:
        return (
            "tree aggregation (DP-FTRL) is accounted with the stream's order fixed, so an example "
            "is replaced by a null example rather than removed (Kairouz et al. 2021, App. D): use "
            "relation='zero-out' (or 'replace-one'), not add-or-remove"
        )
    return None


class TrialDistribution(enum.Enum):
    """How the number of tuning trials is drawn (Papernot & Steinke 2022)."""

    POISSON = "poisson"
    TRUNCATED_NEGATIVE_BINOMIAL = "truncated-negative-binomial"
    GEOMETRIC = "geometric"
    LOGARITHMIC = "logarithmic"

    @classmethod
    def parse(cls, value: TrialDistribution | str) -> TrialDistribution:
        """Accept the enum or its name, with an error that lists the choices."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower().replace("_", "-"))
        except ValueError:
            choices = ", ".join(d.value for d in cls)
            raise ValueError(f"distribution must be one of {choices}; got {value!r}") from None


@dataclass(frozen=True)
class RepeatAndSelectEvent(DpEvent):
    """Run ``event`` a random number K of times and release only the best run.

    Papernot & Steinke (2022): K ~ Poisson(mean) or a truncated negative binomial with shape
    ``shape`` (η) and the given mean; η = 1 is the geometric distribution and η = 0 the
    logarithmic one. Only RDP accounting applies.
    """

    event: DpEvent
    mean: float
    distribution: TrialDistribution = TrialDistribution.POISSON
    shape: float | None = None

    def __post_init__(self) -> None:
        _check_event("event", self.event)
        dist = TrialDistribution.parse(self.distribution)
        object.__setattr__(self, "distribution", dist)
        shape = {
            TrialDistribution.GEOMETRIC: 1.0,
            TrialDistribution.LOGARITHMIC: 0.0,
        }.get(dist, self.shape)
        if dist is TrialDistribution.TRUNCATED_NEGATIVE_BINOMIAL:
            if shape is None:
                raise ValueError(
                    "shape (η) is required for the truncated negative binomial; it must lie "
                    "in (-1, inf): use 1 for geometric, 0 for logarithmic"
                )
            check_range("shape", shape, -1.0, math.inf)
        object.__setattr__(self, "shape", None if dist is TrialDistribution.POISSON else shape)
        minimum_mean = 0.0 if dist is TrialDistribution.POISSON else 1.0
        check_range("mean", self.mean, minimum_mean, math.inf)


def _check_event(name: str, event: object) -> None:
    """Composite events only nest events; anything else is a programming error made plain."""
    if not isinstance(event, DpEvent):
        raise ValueError(f"{name} must be a DpEvent, got {type(event).__name__}")


def _magnitude(count: int) -> str:
    """A count for a message: exact when short, as a power of ten when it has many digits."""
    digits = len(str(count))
    return str(count) if digits <= 15 else f"about 1e{digits - 1}"


#: The most DP-SGD steps :func:`dpsgd_event` accepts: a billion is beyond any training run, and
#: the accountants' grids overflow (or exhaust memory) not far above it.
MAX_STEPS = 10**9


def dpsgd_event(sampling_rate: float, noise_multiplier: float, steps: int) -> DpEvent:
    """The event of ``steps`` DP-SGD steps with Poisson sampling (guide alg. 1)."""
    steps = check_count("steps", steps)
    if steps > MAX_STEPS:
        raise ValueError(
            f"steps must be at most {MAX_STEPS:,} (the most the accountants compose), got "
            f"{_magnitude(steps)}; lower the number of steps"
        )
    return SelfComposedEvent(
        PoissonSampledEvent(sampling_rate, GaussianEvent(noise_multiplier)), steps
    )
