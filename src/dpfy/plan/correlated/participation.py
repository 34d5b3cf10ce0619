"""Participation schemas: which steps one example can touch, the input to every sensitivity.

Correlated noise is only as private as the worst set of steps one example can appear in
(Choquette-Choo et al. 2022, "Multi-epoch matrix factorization mechanisms"). Two schemas cover
the papers' settings:

``MinSeparation(k, separation)``
    the example is in at most k steps, any two at least ``separation`` steps apart (the "b-min-sep"
    participation of Choquette-Choo et al. 2023). Multi-epoch training over a data order fixed
    in advance and kept every epoch gives k = epochs, separation = steps per epoch. A fresh
    shuffle each epoch does NOT: an example can then sit at the end of one epoch and the start of
    the next (separation 1).
``CyclicPoisson(groups)``
    the data is split once, independently of the data, into ``groups`` fixed groups; step t draws
    a Poisson sample (rate ``sampling_rate``) from group t mod groups, so an example can only take
    part in steps of one residue class: every ``groups`` steps at most (the amplified BandMF
    schema of Choquette-Choo et al. 2023).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from dpfy._validate import check_count, check_sampling_rate


@dataclass(frozen=True)
class MinSeparation:
    """At most ``max_participations`` steps per example, any two ≥ ``separation`` steps apart."""

    max_participations: int
    separation: int

    def __post_init__(self) -> None:
        check_count("max_participations", self.max_participations, minimum=1)
        check_count("separation", self.separation, minimum=1)

    @classmethod
    def epochs(cls, epochs: int, steps_per_epoch: int) -> MinSeparation:
        """Fixed-order multi-epoch training: once per epoch, ``steps_per_epoch`` apart."""
        return cls(check_count("epochs", epochs, minimum=1), steps_per_epoch)

    def participations(self, n: int) -> int:
        """The most steps one example can really take part in among n: min(k, ⌈n/separation⌉)."""
        n = check_count("n", n, minimum=1)
        return min(self.max_participations, -(-n // self.separation))

    def allows(self, steps: tuple[int, ...]) -> bool:
        """Whether one example may take part in exactly these (sorted, 0-based) steps."""
        gaps = all(b - a >= self.separation for a, b in itertools.pairwise(steps))
        return len(steps) <= self.max_participations and gaps

    def patterns(self, n: int) -> Iterator[tuple[int, ...]]:
        """Every non-empty allowed set of steps in [0, n): the brute-force oracle's search space."""
        yield from _separated_subsets(range(n), self.separation, self.participations(n))


@dataclass(frozen=True)
class CyclicPoisson:
    """``groups`` fixed groups; step t Poisson-samples group t mod groups at ``sampling_rate``.

    ``sampling_rate`` q̃ = expected batch size / group size; it matters only to accounting, which
    refuses to amplify without it.
    """

    groups: int
    sampling_rate: float | None = None

    def __post_init__(self) -> None:
        check_count("groups", self.groups, minimum=1)
        if self.sampling_rate is not None:
            object.__setattr__(self, "sampling_rate", check_sampling_rate(self.sampling_rate))

    def rounds(self, n: int) -> int:
        """Steps of the busiest group among n: ⌈n / groups⌉ (group 0 holds steps 0, b, 2b, …)."""
        return -(-check_count("n", n, minimum=1) // self.groups)

    def as_min_separation(self, n: int) -> MinSeparation:
        """The min-separation schema that contains every pattern this one allows (no sampling)."""
        return MinSeparation(self.rounds(n), self.groups)

    def participations(self, n: int) -> int:
        """The most steps one example can take part in among n."""
        return self.rounds(n)

    def allows(self, steps: tuple[int, ...]) -> bool:
        """Whether the steps all fall in one residue class mod ``groups``."""
        return len({s % self.groups for s in steps}) <= 1

    def patterns(self, n: int) -> Iterator[tuple[int, ...]]:
        """Every non-empty subset of one residue class of [0, n)."""
        for group in range(min(self.groups, n)):
            members = range(group, n, self.groups)
            for size in range(1, len(members) + 1):
                yield from itertools.combinations(members, size)


Participation = MinSeparation | CyclicPoisson


def check_participation(participation: object) -> Participation:
    """A schema of this module, or one error naming both."""
    if not isinstance(participation, (MinSeparation, CyclicPoisson)):
        raise ValueError(
            "participation must be MinSeparation(k, separation) or CyclicPoisson(groups), got "
            f"{type(participation).__name__}"
        )
    return participation


def _separated_subsets(steps: range, separation: int, largest: int) -> Iterator[tuple[int, ...]]:
    """Non-empty subsets of ``steps`` of size ≤ ``largest`` whose gaps are all ≥ separation."""

    def extend(prefix: tuple[int, ...], start: int) -> Iterator[tuple[int, ...]]:
        for step in range(start, steps.stop):
            pattern = (*prefix, step)
            yield pattern
            if len(pattern) < largest:
                yield from extend(pattern, step + separation)

    if largest >= 1:
        yield from extend((), steps.start)
