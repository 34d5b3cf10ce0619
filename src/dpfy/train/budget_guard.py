"""The budget guard: refuses a step that would take ε past the target, before it is applied.

Apart from the record store so that what may run is decided in one place, from what the store
says happened: a step that would exceed the budget is refused before it changes anything.
Checking a step must be cheap — it runs before every step — so the guard keeps caches the
store knows nothing about: how many more steps like the last one fit (counted down as they are
recorded), a certificate covering a σ or q schedule (:mod:`dpfy.train.budget_certificate`), and
an additive accountant's running state. The ledger
tells the guard of every record it stores (:meth:`BudgetGuard.recorded_step`,
:meth:`BudgetGuard.recorded_event`), and the guard keeps each cache exact or drops it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpfy._validate import check_positive
from dpfy.plan.accounting.calibrate import largest_fitting_count
from dpfy.plan.accounting.events import DpEvent, NeighbouringRelation, NoOpEvent
from dpfy.train.budget_certificate import (
    FIRST_GUESS,
    MARGIN,
    Certificate,
    ceiling_for,
    certified_room,
    sampled_gaussian,
)
from dpfy.train.budget_exhausted import BudgetExhausted
from dpfy.train.ledger_store import LedgerStore
from dpfy.train.step_record import StepRecord

__all__ = ["BudgetGuard"]

# The guard's search never looks further than this many steps ahead; when a run uses them all it
# simply searches again. 2³⁰ steps is beyond any real training run.
_SEARCH_CAP = 1 << 30


@dataclass
class _Headroom:
    """Cached answer to "how many more steps like ``step`` fit the target from here".

    ``exact``: the room is the largest that fits (0 then means refuse); otherwise it is only
    known to fit (0 then means ask again).
    """

    step: StepRecord
    room: int
    exact: bool = True


class BudgetGuard:
    """Guards the total ε of ``store`` — training plus every labelled event — at ``target_epsilon``
    (None: no guard, every step fits), at the store's δ."""

    def __init__(self, store: LedgerStore, target_epsilon: float | None) -> None:
        self.store = store
        self.target_epsilon = target_epsilon

    @property
    def target_epsilon(self) -> float | None:
        """The target ε (None: unguarded)."""
        return self._target

    @target_epsilon.setter
    def target_epsilon(self, value: float | None) -> None:
        """A new target; every cache was sized against the old one, so all are dropped."""
        self._target = None if value is None else check_positive("target_epsilon", value)
        self.reset()

    def reset(self) -> None:
        """Drop every cache: the store's records were replaced, or the target changed."""
        self._headroom: _Headroom | None = None
        self.certificate: Certificate | None = None
        self._certificate_guess = FIRST_GUESS
        self._near_limit = False
        #: The accountant's running state, if it keeps one (additive accountants: RDP), built
        #: at the first guarded step and kept up to date by every record after it.
        self._running: Any = None

    # -- the store's records -------------------------------------------------------------------
    def recorded_step(self, step: StepRecord, event: DpEvent) -> None:
        """One step (its record without the realised size) was kept: keep each cache exact."""
        if self._running is not None:
            self._running.add(event, 1)
        if self._headroom is not None and self._headroom.step == step:
            self._headroom.room -= 1  # exactly one of the counted steps is now spent
        elif not isinstance(event, NoOpEvent):  # a no-op adds nothing: the count stays exact
            self._headroom = None
        self._spend_certificate(event)

    def recorded_event(self, event: DpEvent, count: int) -> None:
        """A labelled release was kept: the running state adds it, the other caches are dropped."""
        if self._running is not None:
            self._running.add(event, count)
        self._headroom = None
        self.certificate = None

    # -- checking ------------------------------------------------------------------------------
    def check(self, step: StepRecord, relation: NeighbouringRelation | str | None) -> None:
        """Raise :class:`BudgetExhausted` if one more ``step`` would exceed the target.

        Changes nothing but the caches. Cheap: the number of steps like ``step`` that still fit
        is searched once (see :meth:`remaining`) and counted down by :meth:`recorded_step`; when
        steps differ from one to the next (σ or q schedules), a certificate covers a whole range
        of them (:mod:`dpfy.train.budget_certificate`), and within a small margin of the target
        each step is checked with the accountant. An accountant whose events add exactly (RDP)
        keeps a running state instead, and each step is one conversion of it; only a tie within
        rounding of the target asks a fresh accountant.
        """
        event = self.store.validate_step(step, relation)
        target = self._target
        if target is None or isinstance(event, NoOpEvent):
            return  # a step that releases nothing cannot take ε past any target
        if self._running is None:
            self._running = self.store.probe.running()
            if self._running is not None:
                self._running.add_all(self.store.event_counts(None, poisson=False))
        if self._running is not None:  # ε with this step, from the running state: one conversion
            value = self._running.epsilon_with(event, 1, self.store.delta)
            tie = target * self._running.tie  # rounding against a fresh accountant
            if value <= target - tie:
                return
            if value > target + tie:
                raise self._refusal(step, target)
        headroom = self._headroom
        if headroom is not None and headroom.step == step and (headroom.exact or headroom.room):
            if headroom.room >= 1:
                return
            raise self._refusal(step, target)
        certificate = self.certificate
        if certificate is not None and certificate.room >= 1 and certificate.covers(event):
            return
        last = self.store.last_step()
        if last is not None and last != step and sampled_gaussian(event) is not None:
            if self._fits_by_certificate(event, target) or self._fits_alone(step, event, target):
                return
            raise self._refusal(step, target)
        if self._room(step, event, target) < 1:
            raise self._refusal(step, target)

    def remaining(self, step: StepRecord) -> int:
        """How many more steps like ``step`` keep the total ε within the target (capped at 2³⁰).

        Cache logic: the answer m* = max{m : ε(ledger + m × step) ≤ target} is found by doubling
        then bisection (about 2·log₂ m* accountant queries) and cached with the step. Each
        record of that same step lowers the cached count by one, which keeps it exact:
        after k such records the ledger is "ledger + k × step" and m* − k more steps fit. Any
        other change — a different step, a labelled event, a load — drops the cache, except a step
        whose event is a no-op (it adds nothing to ε, so the count stays exact). Every m
        the search returns was itself checked with the accountant (the lower end of the
        bisection is always a verified fit), and ε never decreases as steps are added, so no
        cached count can admit an over-budget step.
        """
        target = self._target
        if target is None:
            raise ValueError("this ledger has no target_epsilon, so every step fits")
        return self._room(step, self.store.validate_step(step, None), target)

    def _refusal(self, step: StepRecord, target: float) -> BudgetExhausted:
        """The refusal of ``step``, stating ε spent so far."""
        spent = self.store.epsilon(None, False, None)
        return BudgetExhausted(spent, target, self.store.delta, step.describe())

    # -- how many steps like this one fit ------------------------------------------------------
    def _room(self, step: StepRecord, event: DpEvent, target: float) -> int:
        """The cached headroom for ``step`` (its realised batch size takes no part in equality)."""
        cached = self._headroom
        if cached is None or cached.step != step or not cached.exact:
            cached = self._headroom = _Headroom(step, self._search_room(event, target))
        return max(cached.room, 0)

    def _search_room(self, event: DpEvent, target: float) -> int:
        """max{m ≤ cap : ε(ledger + m × event) ≤ target}; the accountant's fast variant guides
        the search and the full accountant decides every answer."""
        base = self.store.event_counts(None, poisson=False)

        def predicate(search: bool) -> Callable[[int], bool]:
            def fits(m: int) -> bool:
                counts = dict(base)
                counts[event] = counts.get(event, 0) + m
                return self.store.compose(counts, search=search).epsilon(self.store.delta) <= (
                    target
                )

            return fits

        return largest_fitting_count(predicate(False), guide=predicate(True), cap=_SEARCH_CAP)

    def _fits_alone(self, step: StepRecord, event: DpEvent, target: float) -> bool:
        """One accountant query: does the ledger plus this one step stay within the target?"""
        counts = self.store.event_counts(None, poisson=False)
        counts[event] = counts.get(event, 0) + 1
        if self.store.compose(counts).epsilon(self.store.delta) > target:
            return False
        self._headroom = _Headroom(step, 1, exact=False)
        return True

    # -- certificates --------------------------------------------------------------------------
    def _fits_by_certificate(self, event: DpEvent, target: float) -> bool:
        """Try to cover ``event`` with a new certificate; False near the limit.

        Invariant, why a certificate is safe: it was made when the ledger was L₀, and the bound
        variant of the accountant verified ε(L₀ + m × s*) ≤ target·(1 − MARGIN) for its ceiling
        s* and room m. Each recorded step it covers lowers m by one and anything else
        (another step, a labelled event, a load) drops it, so while it holds the ledger is L₀
        plus at most m steps each dominated by s*, whose ε is at most the verified one: domination
        survives composition, the bound variant is at least the accountant on every composition
        it dominates, and unvaried coordinates are pinned so the accountant's coarsening of many
        steps cannot change. Noise between such ε (discretisation) is far below the margin.
        """
        if self._near_limit:
            return False
        certificate = ceiling_for(event, self.store.recorded_events())
        if certificate is None:
            return False
        base = self.store.event_counts(None, poisson=False)
        ceiling, limit = certificate.ceiling, target * (1 - MARGIN)

        def fits(m: int) -> bool:
            counts = dict(base)
            counts[ceiling] = counts.get(ceiling, 0) + m
            return self.store.compose(counts, bound=True).epsilon(self.store.delta) <= limit

        certificate.room = certified_room(fits, self._certificate_guess)
        if certificate.room < 1:
            self._near_limit = True  # ε only grows: from here on each step is checked alone
            return False
        self.certificate = certificate
        return True

    def _spend_certificate(self, event: DpEvent) -> None:
        """A recorded step spends one unit of the certificate covering it, or ends it."""
        certificate = self.certificate
        if certificate is None or isinstance(event, NoOpEvent):
            return
        if certificate.room >= 1 and certificate.covers(event):
            certificate.room -= 1
            certificate.used += 1
            if certificate.room == 0:  # used up: the next one may cover more of the run
                self._certificate_guess = max(FIRST_GUESS, 2 * certificate.used)
        else:  # the run left the ceiling's range: size the next one by what this one covered
            self._certificate_guess = max(FIRST_GUESS, 2 * certificate.used)
            self.certificate = None
