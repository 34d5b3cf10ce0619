"""The privacy ledger: one event per step from what actually happened, and a budget guard.

The ledger accounts every step, empty ones included, from what the sampler reports; it guards
the budget, travels in checkpoints and counts tuning runs. Each DP-SGD step is recorded from the
sampler's :class:`~dpfy.plan.sampling.SamplingRecord` and the noise multiplier σ actually used —
never from the realised batch size, which must not influence anything privacy-relevant.
Tuning runs and other releases are recorded as labelled events and reported beside the training ε
(guide §5.4.2). The budget guard refuses a step *before* it is applied, and the whole
ledger travels in checkpoints as plain JSON.

Consecutive identical steps are stored run-length encoded, so a run of 10⁶ steps at one σ and one
q is one entry. ε is computed by the chosen accountant from the composed events; composition is
commutative, so identical events anywhere in the run are composed together as one
``count``-fold self-composition.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpfy._validate import check_count, check_delta, check_positive
from dpfy.plan.accounting.accountant import (
    ACCOUNTANTS,
    Accountant,
    UnsupportedEventError,
    make_accountant,
)
from dpfy.plan.accounting.calibrate import largest_fitting_count
from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    NeighbouringRelation,
    NoOpEvent,
    SelfComposedEvent,
)
from dpfy.plan.sampling import SamplingRecord
from dpfy.train.budget_guard import (
    FIRST_GUESS,
    MARGIN,
    Certificate,
    ceiling_for,
    certified_room,
    sampled_gaussian,
)
from dpfy.train.ledger_codec import (
    LEDGER_FORMAT,
    LEDGER_VERSION,
    check_format,
    decode_entry,
    encode_entry,
    entries_of,
)
from dpfy.train.ledger_summary import LedgerSummary, SampledSteps
from dpfy.train.step_record import StepRecord

TRAINING = "training"
TOTAL = "total"

# The guard's search never looks further than this many steps ahead; when a run uses them all it
# simply searches again. 2³⁰ steps is beyond any real training run.
_SEARCH_CAP = 1 << 30


class BudgetExhausted(RuntimeError):
    """One more step would take ε past the target; nothing was applied."""

    def __init__(self, spent: float, target: float, delta: float, step: str) -> None:
        self.spent, self.target, self.delta = spent, target, delta
        super().__init__(
            f"privacy budget exhausted: ε spent so far is {spent:.6g} at δ={delta:g}, and one "
            f"more step ({step}) would take it past the target ε={target:.6g}. Nothing was "
            "applied. To continue, lower the number of steps, raise the noise multiplier σ, or "
            "raise the budget (a larger target_epsilon, if your privacy plan allows it)."
        )


@dataclass
class _Entry:
    """A run of ``count`` identical consecutive records: a training step or a labelled event."""

    label: str
    event: DpEvent
    count: int
    step: StepRecord | None = None  # set for training steps (its batch_size is None)

    def same_kind(self, label: str, event: DpEvent, step: StepRecord | None) -> bool:
        """Whether a new record extends this run."""
        return self.label == label and self.step == step and self.event == event


@dataclass
class _Headroom:
    """Cached answer to "how many more steps like ``step`` fit the target from here".

    ``exact``: the room is the largest that fits (0 then means refuse); otherwise it is only
    known to fit (0 then means ask again).
    """

    step: StepRecord
    room: int
    exact: bool = True


class PrivacyLedger:
    """Accounts every step and release of a run under one accountant, δ and relation.

    ``accountant`` names a registered accountant ('pld' or 'rdp'); ``target_epsilon`` (optional)
    arms the budget guard: :meth:`check_step` refuses a step that would take the total ε — training
    plus every labelled event — past it at ``delta``.
    """

    def __init__(
        self,
        delta: float,
        *,
        accountant: str = "pld",
        target_epsilon: float | None = None,
        relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE,
    ) -> None:
        self.delta = check_delta(delta)
        self.relation = NeighbouringRelation.parse(relation)
        self.accountant = str(accountant).strip().lower()
        self._probe = _new_accountant(self.accountant, self.relation)  # validates the name
        self.target_epsilon = (
            None if target_epsilon is None else check_positive("target_epsilon", target_epsilon)
        )
        self._entries: list[_Entry] = []
        self._examples_seen = 0
        self._sized_steps = 0
        self._checked_events: set[DpEvent] = set()
        self._epsilon_cache: dict[tuple[str | None, bool, float], float] = {}
        self._headroom: _Headroom | None = None
        self._certificate: Certificate | None = None
        self._certificate_guess = FIRST_GUESS
        self._near_limit = False
        #: The accountant's running state, if it keeps one (additive accountants: RDP), built
        #: at the first guarded step and kept up to date by every record after it.
        self._running: Any = None
        self._warned_assumption = False
        #: The run this ledger accounts (set by make_private), so a checkpoint's ledger and
        #: sampler state can be checked to belong together.
        self.run_id: str | None = None

    # -- recording -----------------------------------------------------------------------------
    def record(
        self, step: StepRecord, *, relation: NeighbouringRelation | str | None = None
    ) -> None:
        """Append one step that happened, from the sampler's record and the σ used.

        Call :meth:`check_step` *before* applying the step: ``record`` accounts the truth even
        past the budget, because a step that was applied must be accounted.
        """
        event = self._validate_step(step, relation)
        plain = dataclasses.replace(step, batch_size=None)
        self._append(TRAINING, event, 1, plain)
        if step.batch_size is not None:
            self._examples_seen += step.batch_size
            self._sized_steps += 1
        if self._headroom is not None and self._headroom.step == plain:
            self._headroom.room -= 1  # exactly one of the counted steps is now spent
        elif not isinstance(event, NoOpEvent):  # a no-op adds nothing: the count stays exact
            self._headroom = None
        self._spend_certificate(event)
        if not step.sampling.assumption_met and not self._warned_assumption:
            self._warned_assumption = True
            warnings.warn(
                f"{step.sampling.description} The ledger and report will say so.",
                UserWarning,
                stacklevel=2,
            )

    def record_event(
        self,
        event: DpEvent,
        *,
        label: str = "tuning",
        count: int = 1,
        relation: NeighbouringRelation | str | None = None,
    ) -> None:
        """Append ``count`` runs of a release other than a training step, e.g. tuning runs.

        Events labelled ``"training"`` count towards the training ε; any other label is reported
        separately and all of them count towards the total (guide §5.4.2).
        """
        if not isinstance(label, str) or not label.strip() or label.strip() == TOTAL:
            raise ValueError(f"label must be a non-empty string other than 'total', got {label!r}")
        count = check_count("count", count, minimum=1)
        self._check_relation(relation)
        self._check_supported(event)
        self._append(label.strip(), event, count, None)
        self._headroom = None
        self._certificate = None

    def _append(self, label: str, event: DpEvent, count: int, step: StepRecord | None) -> None:
        """Extend the last run if identical, else start a new one; drop cached ε."""
        last = self._entries[-1] if self._entries else None
        if last is not None and last.same_kind(label, event, step):
            last.count += count
        else:
            self._entries.append(_Entry(label, event, count, step))
        self._epsilon_cache.clear()
        if self._running is not None:
            self._running.add(event, count)

    def _validate_step(
        self, step: StepRecord, relation: NeighbouringRelation | str | None
    ) -> DpEvent:
        """The step's event, once its type, relation and accountant support are confirmed."""
        if not isinstance(step, StepRecord):
            raise ValueError(f"expected a StepRecord, got {type(step).__name__}")
        self._check_relation(relation)
        unit = self._training_unit()
        if unit is not None and step.sampling.unit != unit:
            raise ValueError(
                f"unit of privacy mismatch: this ledger accounts {unit}-level steps but "
                f"the step sampled {step.sampling.unit}s; ε for different units of privacy "
                "cannot be composed (guide §2.1) — keep one unit for the run"
            )
        event = step.event
        self._check_supported(event)
        return event

    def _training_unit(self) -> str | None:
        """The unit of the first recorded step; every later step is checked against it."""
        return next((e.step.sampling.unit for e in self._entries if e.step is not None), None)

    def _check_relation(self, relation: NeighbouringRelation | str | None) -> None:
        """Refuse a record derived under another neighbouring relation."""
        if relation is None:
            return
        theirs = NeighbouringRelation.parse(relation)
        if theirs is not self.relation:
            raise ValueError(
                f"neighbouring relation mismatch: this ledger accounts under "
                f"'{self.relation.value}' but the record was derived under '{theirs.value}'; "
                "ε under different relations cannot be combined — use one relation for the run"
            )

    def _check_supported(self, event: DpEvent) -> None:
        """Refuse, at record time, an event the accountant could not bound later."""
        if not isinstance(event, DpEvent):
            raise ValueError(f"event must be a DpEvent, got {type(event).__name__}")
        if event in self._checked_events:
            return
        reason = self._probe.unsupported_reason(event)
        if reason is not None:
            raise UnsupportedEventError(reason)
        self._checked_events.add(event)

    # -- budget guard --------------------------------------------------------------------------
    def check_step(
        self, step: StepRecord, *, relation: NeighbouringRelation | str | None = None
    ) -> None:
        """Raise :class:`BudgetExhausted` if one more ``step`` would exceed the target.

        Call it before the step changes the model; it changes nothing. Cheap: the number of
        steps like ``step`` that still fit is searched once (see :meth:`remaining_steps`) and
        counted down by :meth:`record`; when steps differ from one to the next (σ or q
        schedules), a certificate covers a whole range of them (:mod:`dpfy.train.budget_guard`),
        and within a small margin of the target each step is checked with the accountant. An
        accountant whose events add exactly (RDP) keeps a running state instead, and each step is
        one conversion of it; only a tie within rounding of the target asks a fresh accountant.
        """
        event = self._validate_step(step, relation)
        if self.target_epsilon is None or isinstance(event, NoOpEvent):
            return  # a step that releases nothing cannot take ε past any target
        if self._running is None:
            self._running = self._probe.running()
            if self._running is not None:
                self._running.add_all(self._event_counts(None, poisson=False))
        if self._running is not None:  # ε with this step, from the running state: one conversion
            value = self._running.epsilon_with(event, 1, self.delta)
            tie = self.target_epsilon * self._running.tie  # rounding against a fresh accountant
            if value <= self.target_epsilon - tie:
                return
            if value > self.target_epsilon + tie:
                raise BudgetExhausted(
                    self.epsilon(), self.target_epsilon, self.delta, step.describe()
                )
        headroom = self._headroom
        if headroom is not None and headroom.step == step and (headroom.exact or headroom.room):
            if headroom.room >= 1:
                return
            raise BudgetExhausted(self.epsilon(), self.target_epsilon, self.delta, step.describe())
        certificate = self._certificate
        if certificate is not None and certificate.room >= 1 and certificate.covers(event):
            return
        last = self._last_step()
        if last is not None and last != step and sampled_gaussian(event) is not None:
            if self._fits_by_certificate(event) or self._fits_alone(step, event):
                return
            raise BudgetExhausted(self.epsilon(), self.target_epsilon, self.delta, step.describe())
        if self._room(step, event) < 1:
            raise BudgetExhausted(self.epsilon(), self.target_epsilon, self.delta, step.describe())

    def _last_step(self) -> StepRecord | None:
        """The most recent training step recorded, if any."""
        return next((e.step for e in reversed(self._entries) if e.step is not None), None)

    def _fits_by_certificate(self, event: DpEvent) -> bool:
        """Try to cover ``event`` with a new certificate (budget_guard); False near the limit.

        Invariant, why a certificate is safe: it was made when the ledger was L₀, and the bound
        variant of the accountant verified ε(L₀ + m × s*) ≤ target·(1 − MARGIN) for its ceiling
        s* and room m. Each :meth:`record` of a step it covers lowers m by one and anything else
        (another step, a labelled event, a load) drops it, so while it holds the ledger is L₀
        plus at most m steps each dominated by s*, whose ε is at most the verified one: domination
        survives composition, the bound variant is at least the accountant on every composition
        it dominates, and unvaried coordinates are pinned so the accountant's coarsening of many
        steps cannot change. Noise between such ε (discretisation) is far below the margin.
        """
        if self._near_limit:
            return False
        certificate = ceiling_for(event, (e.event for e in self._entries))
        if certificate is None:
            return False
        base = self._event_counts(None, poisson=False)
        ceiling, limit = certificate.ceiling, self.target_epsilon * (1 - MARGIN)

        def fits(m: int) -> bool:
            counts = dict(base)
            counts[ceiling] = counts.get(ceiling, 0) + m
            return self._compose(counts, bound=True).epsilon(self.delta) <= limit

        certificate.room = certified_room(fits, self._certificate_guess)
        if certificate.room < 1:
            self._near_limit = True  # ε only grows: from here on each step is checked alone
            return False
        self._certificate = certificate
        return True

    def _fits_alone(self, step: StepRecord, event: DpEvent) -> bool:
        """One accountant query: does the ledger plus this one step stay within the target?"""
        counts = self._event_counts(None, poisson=False)
        counts[event] = counts.get(event, 0) + 1
        if self._compose(counts).epsilon(self.delta) > self.target_epsilon:
            return False
        self._headroom = _Headroom(step, 1, exact=False)
        return True

    def _spend_certificate(self, event: DpEvent) -> None:
        """A recorded step spends one unit of the certificate covering it, or ends it."""
        certificate = self._certificate
        if certificate is None or isinstance(event, NoOpEvent):
            return
        if certificate.room >= 1 and certificate.covers(event):
            certificate.room -= 1
            certificate.used += 1
            if certificate.room == 0:  # used up: the next one may cover more of the run
                self._certificate_guess = max(FIRST_GUESS, 2 * certificate.used)
        else:  # the run left the ceiling's range: size the next one by what this one covered
            self._certificate_guess = max(FIRST_GUESS, 2 * certificate.used)
            self._certificate = None

    def remaining_steps(self, step: StepRecord) -> int:
        """How many more steps like ``step`` keep the total ε within the target (capped at 2³⁰).

        Cache logic: the answer m* = max{m : ε(ledger + m × step) ≤ target} is found by doubling
        then bisection (about 2·log₂ m* accountant queries) and cached with the step. Each
        :meth:`record` of that same step lowers the cached count by one, which keeps it exact:
        after k such records the ledger is "ledger + k × step" and m* − k more steps fit. Any
        other change — a different step, a labelled event, a load — drops the cache, except a step
        whose event is a no-op (it adds nothing to ε, so the count stays exact). Every m
        the search returns was itself checked with the accountant (the lower end of the
        bisection is always a verified fit), and ε never decreases as steps are added, so no
        cached count can admit an over-budget step.
        """
        if self.target_epsilon is None:
            raise ValueError("this ledger has no target_epsilon, so every step fits")
        return self._room(step, self._validate_step(step, None))

    def _room(self, step: StepRecord, event: DpEvent) -> int:
        """The cached headroom for ``step`` (its realised batch size takes no part in equality)."""
        cached = self._headroom
        if cached is None or cached.step != step or not cached.exact:
            self._headroom = _Headroom(step, self._search_room(event))
        return max(self._headroom.room, 0)

    def _search_room(self, event: DpEvent) -> int:
        """max{m ≤ cap : ε(ledger + m × event) ≤ target}; the accountant's fast variant guides
        the search and the full accountant decides every answer."""
        base = self._event_counts(None, poisson=False)

        def predicate(search: bool) -> Callable[[int], bool]:
            def fits(m: int) -> bool:
                counts = dict(base)
                counts[event] = counts.get(event, 0) + m
                return self._compose(counts, search=search).epsilon(self.delta) <= (
                    self.target_epsilon
                )

            return fits

        return largest_fitting_count(predicate(False), guide=predicate(True), cap=_SEARCH_CAP)

    # -- ε -------------------------------------------------------------------------------------
    def epsilon(self, delta: float | None = None) -> float:
        """Total ε spent so far — training and every labelled event — at ``delta`` (default δ)."""
        return self._epsilon(None, False, delta)

    def epsilon_by_label(self, delta: float | None = None) -> dict[str, float]:
        """ε of training, of each label (e.g. tuning) and of everything: ``{..., 'total': ε}``."""
        labels = [TRAINING, *sorted({e.label for e in self._entries} - {TRAINING})]
        result = {label: self._epsilon(label, False, delta) for label in labels}
        result[TOTAL] = self.epsilon(delta)
        return result

    def epsilon_under_poisson_assumption(self, delta: float | None = None) -> float:
        """Total ε if every step had been Poisson-sampled at its q (guide §4.3 comparison).

        Equal to :meth:`epsilon` for Poisson and shuffled runs (shuffling is already accounted
        under this assumption). A replace-one ledger (fixed-size sampling) has no such figure:
        Poisson sampling is accounted under add-or-remove, and ε under different relations is
        never compared, so it raises ValueError.
        """
        if self.relation is NeighbouringRelation.REPLACE_ONE:
            raise ValueError(
                "no ε under the Poisson assumption for a replace-one ledger: Poisson sampling is "
                "accounted under add-or-remove adjacency, and ε under different relations is not "
                "comparable"
            )
        return self._epsilon(None, True, delta)

    @property
    def assumptions_met(self) -> bool:
        """Whether every step's accounted event describes how its batch was really drawn."""
        return all(e.step.sampling.assumption_met for e in self._entries if e.step is not None)

    @property
    def steps(self) -> int:
        """Training steps recorded."""
        return sum(e.count for e in self._entries if e.step is not None)

    def events(self, label: str | None = None) -> ComposedEvent:
        """Everything recorded (or one label's part), in order, as one composed event."""
        return ComposedEvent(
            tuple(
                e.event if e.count == 1 else SelfComposedEvent(e.event, e.count)
                for e in self._entries
                if label is None or e.label == label
            )
        )

    def _epsilon(self, label: str | None, poisson: bool, delta: float | None) -> float:
        """Cached ε of a part of the ledger."""
        delta = self.delta if delta is None else check_delta(delta)
        key = (label, poisson, delta)
        if key not in self._epsilon_cache:
            counts = self._event_counts(label, poisson)
            self._epsilon_cache[key] = self._compose(counts).epsilon(delta)
        return self._epsilon_cache[key]

    def spent_beyond(self, earlier: PrivacyLedger) -> dict[tuple[str, DpEvent], int]:
        """The releases this ledger holds that ``earlier`` does not, by label and event.

        What a run loses from its ledger when it goes back to an earlier checkpoint: those steps
        were released (losses seen, models saved), so the rewound run must carry them.
        """
        counts: dict[tuple[str, DpEvent], int] = {}
        for entries, sign in ((self._entries, 1), (earlier._entries, -1)):
            for entry in entries:
                key = (entry.label, entry.event)
                counts[key] = counts.get(key, 0) + sign * entry.count
        return {key: n for key, n in counts.items() if n > 0}

    def _event_counts(self, label: str | None, poisson: bool) -> dict[DpEvent, int]:
        """How often each distinct event ran, for one label or all (None)."""
        counts: dict[DpEvent, int] = {}
        for entry in self._entries:
            if label is not None and entry.label != label:
                continue
            event = entry.event
            if poisson and entry.step is not None:
                event = entry.step.sampling.poisson_event(entry.step.noise_multiplier)
            counts[event] = counts.get(event, 0) + entry.count
        return counts

    def _compose(
        self, counts: dict[DpEvent, int], *, search: bool = False, bound: bool = False
    ) -> Accountant:
        """A fresh accountant holding ``counts`` (its fast search variant if ``search``, its
        bound variant — what the budget guard plans with — if ``bound``)."""
        accountant = _new_accountant(self.accountant, self.relation)
        if search:
            accountant = accountant.for_search()
        elif bound:
            accountant = accountant.for_bound()
        for event, count in counts.items():
            accountant.compose(event, count)
        return accountant

    # -- report --------------------------------------------------------------------------------
    def summary(self) -> LedgerSummary:
        """What the ledger recorded, typed, for the privacy report (guide §5.3.3)."""
        samplings: dict[SamplingRecord, int] = {}
        sigmas: set[float] = set()
        labels: dict[str, int] = {}
        for entry in self._entries:
            if entry.step is not None:
                samplings[entry.step.sampling] = samplings.get(entry.step.sampling, 0) + entry.count
                sigmas.add(entry.step.noise_multiplier)
            else:
                labels[entry.label] = labels.get(entry.label, 0) + entry.count
        met = self.assumptions_met
        return LedgerSummary(
            accountant=self.accountant,
            relation=self.relation.value,
            delta=self.delta,
            target_epsilon=self.target_epsilon,
            steps=self.steps,
            groups=len(self._entries),
            sampling=tuple(SampledSteps(record, n) for record, n in samplings.items()),
            noise_multipliers=tuple(sorted(sigmas)),
            assumptions_met=met,
            epsilon=self.epsilon_by_label(),
            labelled_events=labels,
            examples_seen=self._examples_seen if self._sized_steps else None,
            epsilon_under_poisson_assumption=None
            if met
            else self.epsilon_under_poisson_assumption(),
        )

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A versioned, plain-JSON dict of everything recorded, for checkpoints."""
        return {
            "format": LEDGER_FORMAT,
            "version": LEDGER_VERSION,
            "accountant": self.accountant,
            "relation": self.relation.value,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "entries": [encode_entry(e.label, e.count, e.step, e.event) for e in self._entries],
            "examples_seen": self._examples_seen,
            "sized_steps": self._sized_steps,
            "run_id": self.run_id,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PrivacyLedger:
        """A new ledger from :meth:`state_dict` output; any problem is a ValueError."""
        if not isinstance(state, dict):
            raise ValueError(f"ledger state must be a dict, got {type(state).__name__}")
        check_format(state)
        try:
            ledger = cls(
                state["delta"],
                accountant=state["accountant"],
                target_epsilon=state["target_epsilon"],
                relation=state["relation"],
            )
            for i, item in enumerate(entries_of(state)):
                ledger._load_entry(*decode_entry(i, item, TRAINING))
            ledger._examples_seen = check_count("examples_seen", state["examples_seen"])
            ledger._sized_steps = check_count("sized_steps", state["sized_steps"])
            run_id = state.get("run_id")
            if run_id is not None and not isinstance(run_id, str):
                raise ValueError("run_id must be a string")
            ledger.run_id = run_id
        except KeyError as missing:
            raise ValueError(f"corrupt ledger state: missing field {missing}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"corrupt ledger state: {err}") from None
        return ledger

    def _load_entry(
        self, label: str, count: int, step: StepRecord | None, event: DpEvent | None
    ) -> None:
        """Re-record one saved run, with the same checks as when it was first recorded."""
        if step is not None:
            self._append(TRAINING, self._validate_step(step, None), count, step)
            self._warned_assumption |= not step.sampling.assumption_met
        else:
            assert event is not None
            self.record_event(event, label=label, count=count)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpointed ledger; on any problem nothing changes.

        The state must match this ledger's accountant, δ and relation (ε under another δ or
        relation is a different claim). The target ε is this ledger's own, so a run may be
        resumed under a raised budget.
        """
        loaded = PrivacyLedger.from_state_dict(state)
        for name in ("accountant", "delta", "relation"):
            theirs, mine = getattr(loaded, name), getattr(self, name)
            if theirs != mine:
                shown = [getattr(v, "value", v) for v in (theirs, mine)]
                raise ValueError(
                    f"ledger state mismatch: the checkpoint was accounted with {name}="
                    f"{shown[0]!r} but this ledger uses {name}={shown[1]!r}; build the ledger "
                    "with the checkpoint's settings"
                )
        self._entries = loaded._entries
        self._examples_seen = loaded._examples_seen
        self._sized_steps = loaded._sized_steps
        self._checked_events = loaded._checked_events
        self._warned_assumption = loaded._warned_assumption
        self.run_id = loaded.run_id
        self._running = None
        self._epsilon_cache = {}
        self._headroom = None
        self._certificate = None
        self._certificate_guess = FIRST_GUESS
        self._near_limit = False

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(accountant={self.accountant!r}, delta={self.delta:g}, "
            f"relation={self.relation.value!r}, steps={self.steps}, groups={len(self._entries)})"
        )


def _new_accountant(name: str, relation: NeighbouringRelation) -> Accountant:
    """``make_accountant``, importing the built-in accountant modules on first use."""
    if name not in ACCOUNTANTS and name in ("pld", "rdp"):
        module = f"dpfy.plan.accounting.{name}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise  # a real missing dependency, not an accountant still to be written
            # otherwise make_accountant below lists what is available
    return make_accountant(name, relation)


__all__ = ["TOTAL", "TRAINING", "BudgetExhausted", "PrivacyLedger"]
