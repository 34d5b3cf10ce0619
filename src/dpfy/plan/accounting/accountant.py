"""The one interface every accountant offers: compose events, then ask for ε(δ) or δ(ε).

Concrete accountants (``rdp.RdpAccountant``, ``pld.PldAccountant``) register themselves under a
short name so the CLI, calibration and the ledger pick one by name without if/elif chains.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from dpfy._validate import check_count, check_delta, check_range
from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    NeighbouringRelation,
    SelfComposedEvent,
)
from dpfy.plan.accounting.truncation import split_truncation, truncated_delta, truncated_epsilon


class UnsupportedEventError(ValueError):
    """The accountant has no sound bound for this event (the message says which one does)."""


class Accountant(abc.ABC):
    """Accumulates events under one neighbouring relation and converts them to (ε, δ)."""

    name: ClassVar[str]

    def __init__(
        self, relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE
    ) -> None:
        self.relation = NeighbouringRelation.parse(relation)
        self._composed: list[tuple[DpEvent, int]] = []
        #: Σ P[a truncated Poisson sample was cut] over the composed steps, charged in δ
        #: (:mod:`dpfy.plan.accounting.truncation`); the steps themselves compose as Poisson.
        self._truncation = 0.0

    # -- composition -------------------------------------------------------------------------
    @abc.abstractmethod
    def unsupported_reason(self, event: DpEvent) -> str | None:
        """Why this accountant cannot bound ``event`` under its relation, or None if it can."""

    def supports(self, event: DpEvent) -> bool:
        """Whether ``compose(event)`` would be accepted."""
        return self.unsupported_reason(event) is None

    def compose(
        self,
        event: DpEvent,
        count: int = 1,
        *,
        relation: NeighbouringRelation | str | None = None,
    ) -> Accountant:
        """Add ``count`` adaptive runs of ``event``; ``relation`` states what the event assumed.

        Events derived under another neighbouring relation are refused: ε under different
        relations cannot be combined or compared (guide §2.1).
        """
        if relation is not None and NeighbouringRelation.parse(relation) is not self.relation:
            raise ValueError(
                f"neighbouring relation mismatch: this accountant accounts under "
                f"'{self.relation.value}' but the event was derived under "
                f"'{NeighbouringRelation.parse(relation).value}'; use one relation for the whole "
                "run (a separate accountant per relation), never mix them"
            )
        if not isinstance(event, DpEvent):
            raise ValueError(f"event must be a DpEvent, got {type(event).__name__}")
        count = check_count("count", count)
        reason = self.unsupported_reason(event)  # a truncated sample: its accountant's word
        if reason is not None:
            raise UnsupportedEventError(reason)
        if count:
            event, slack = split_truncation(event)
            self._composed.append((event, count))
            self._truncation += slack * count
            self._invalidate()
        return self

    def for_search(self) -> Accountant:
        """An empty accountant of this kind tuned for speed in root finding (still sound)."""
        return type(self)(self.relation)

    def for_bound(self) -> Accountant:
        """An empty accountant of this kind whose ε, for any composition, is at least this one's
        for every composition it dominates event by event (up to discretisation noise).

        What a budget guard plans ahead with: this accountant's ε grows with each event's cost
        (exact accountants are their own bound); one that coarsens many events says how.
        """
        return type(self)(self.relation)

    def running(self) -> Any:
        """A running state that adds events one at a time and answers "ε with one more event"
        cheaply (``add(event, count)``, ``add_all(counts)``, ``epsilon_with(event, count,
        delta)``, and ``tie``: the
        relative distance from a target within which its answer may differ from a fresh
        accountant's by rounding), or None if this accountant keeps none (only accountants whose
        events add exactly can)."""
        return None

    def _invalidate(self) -> None:  # noqa: B027 - an optional hook, not an abstract method
        """Drop cached results after the composition changed (subclasses override)."""

    @property
    def event(self) -> DpEvent:
        """Everything composed so far, as one event."""
        return ComposedEvent(
            tuple(e if c == 1 else SelfComposedEvent(e, c) for e, c in self._composed)
        )

    # -- queries -----------------------------------------------------------------------------
    def epsilon(self, delta: float) -> float:
        """The smallest ε this accountant can certify at ``delta`` (0 when nothing composed)."""
        delta = check_delta(delta)
        if not self._composed:
            return 0.0
        return truncated_epsilon(self._epsilon, delta, self._truncation)

    def delta(self, epsilon: float) -> float:
        """The smallest δ this accountant can certify at ``epsilon``."""
        epsilon = check_range("epsilon", epsilon, 0.0, float("inf"), low_open=False)
        if not self._composed:
            return 0.0
        return truncated_delta(self._delta, epsilon, self._truncation)

    @abc.abstractmethod
    def _epsilon(self, delta: float) -> float: ...

    @abc.abstractmethod
    def _delta(self, epsilon: float) -> float: ...


A = TypeVar("A", bound=type[Accountant])

ACCOUNTANTS: dict[str, type[Accountant]] = {}


def register_accountant(cls: A) -> A:
    """Class decorator: make an accountant available by its ``name``."""
    ACCOUNTANTS[cls.name] = cls
    return cls


def make_accountant(
    name: str, relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE
) -> Accountant:
    """Build an accountant by name ('pld' or 'rdp'), with an error that lists the choices."""
    key = str(name).strip().lower()
    if key not in ACCOUNTANTS:
        raise ValueError(
            f"accountant must be one of {', '.join(sorted(ACCOUNTANTS))}; got {name!r}"
        )
    return ACCOUNTANTS[key](relation)


def compute_epsilon(
    event: DpEvent,
    delta: float,
    accountant: str = "pld",
    relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE,
) -> float:
    """One-shot ε(δ) of ``event``: the function planning tools call thousands of times."""
    return make_accountant(accountant, relation).compose(event).epsilon(delta)


EpsilonFunction = Callable[[float], float]
