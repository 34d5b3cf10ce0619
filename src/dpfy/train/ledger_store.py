"""The ledger's record store: what happened, run-length encoded, and the ε it composes to.

Apart from the budget guard so that ε has one source that decides nothing: the guard, the report
and checkpoints all read the same records. Each DP-SGD step is recorded from the sampler's
:class:`~dpfy.plan.sampling.SamplingRecord` and the σ actually used — never from the realised batch
size, which must not influence anything privacy-relevant; other releases (tuning runs) are
labelled events, reported beside the training ε (guide §5.4.2).

Consecutive identical records are one entry, so a run of 10⁶ steps at one σ and one q is one
entry. ε is computed by the chosen accountant from the composed events; composition is
commutative, so identical events anywhere in the run are composed together as one
``count``-fold self-composition.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dpfy._validate import check_count, check_delta
from dpfy.plan.accounting.accountant import (
    ACCOUNTANTS,
    Accountant,
    UnsupportedEventError,
    make_accountant,
)
from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    NeighbouringRelation,
    SelfComposedEvent,
)
from dpfy.plan.sampling import SamplingRecord
from dpfy.train.ledger_codec import encode_entry
from dpfy.train.ledger_summary import LedgerSummary, SampledSteps
from dpfy.train.step_record import StepRecord

__all__ = ["TOTAL", "TRAINING", "Entry", "LedgerStore"]

TRAINING = "training"
TOTAL = "total"


@dataclass
class Entry:
    """A run of ``count`` identical consecutive records: a training step or a labelled event."""

    label: str
    event: DpEvent
    count: int
    step: StepRecord | None = None  # set for training steps (its batch_size is None)

    def same_kind(self, label: str, event: DpEvent, step: StepRecord | None) -> bool:
        """Whether a new record extends this run."""
        return self.label == label and self.step == step and self.event == event


class LedgerStore:
    """Every step and release of a run under one accountant, δ and relation, and their ε.

    Each record is checked before it is kept (its relation, its unit of privacy, whether the
    accountant can bound it), so nothing is stored that could not be accounted later.
    """

    def __init__(self, delta: float, accountant: str, relation: NeighbouringRelation | str) -> None:
        self.delta = check_delta(delta)
        self.relation = NeighbouringRelation.parse(relation)
        self.accountant = str(accountant).strip().lower()
        #: An accountant kept only to ask which events it supports (built first: checks the name).
        self.probe = new_accountant(self.accountant, self.relation)
        self.entries: list[Entry] = []
        self.examples_seen = 0
        self.sized_steps = 0
        self.warned_assumption = False
        self._checked_events: set[DpEvent] = set()
        self._epsilon_cache: dict[tuple[str | None, bool, float], float] = {}

    # -- recording -----------------------------------------------------------------------------
    def add_step(
        self, step: StepRecord, relation: NeighbouringRelation | str | None, *, stacklevel: int
    ) -> tuple[StepRecord, DpEvent]:
        """Keep one step that happened; its record without the realised size, and its event.

        The first step whose sampling assumption does not hold is warned about once
        (``stacklevel`` points the warning at the caller's caller).
        """
        event = self.validate_step(step, relation)
        plain = dataclasses.replace(step, batch_size=None)
        self.append(TRAINING, event, 1, plain)
        if step.batch_size is not None:
            self.examples_seen += step.batch_size
            self.sized_steps += 1
        if not step.sampling.assumption_met and not self.warned_assumption:
            self.warned_assumption = True
            warnings.warn(
                f"{step.sampling.description} The ledger and report will say so.",
                UserWarning,
                stacklevel=stacklevel + 1,
            )
        return plain, event

    def add_event(
        self,
        event: DpEvent,
        label: str,
        count: int,
        relation: NeighbouringRelation | str | None,
    ) -> None:
        """Keep ``count`` runs of a labelled release, once label, count and event are checked."""
        if not isinstance(label, str) or not label.strip() or label.strip() == TOTAL:
            raise ValueError(f"label must be a non-empty string other than 'total', got {label!r}")
        count = check_count("count", count, minimum=1)
        self.check_relation(relation)
        self.check_supported(event)
        self.append(label.strip(), event, count, None)

    def load_entry(
        self, label: str, count: int, step: StepRecord | None, event: DpEvent | None
    ) -> None:
        """Re-record one saved run, with the same checks as when it was first recorded."""
        if step is not None:
            self.append(TRAINING, self.validate_step(step, None), count, step)
            self.warned_assumption |= not step.sampling.assumption_met
        else:
            assert event is not None
            self.add_event(event, label, count, None)

    def append(self, label: str, event: DpEvent, count: int, step: StepRecord | None) -> None:
        """Extend the last run if identical, else start a new one; drop cached ε."""
        last = self.entries[-1] if self.entries else None
        if last is not None and last.same_kind(label, event, step):
            last.count += count
        else:
            self.entries.append(Entry(label, event, count, step))
        self._epsilon_cache.clear()

    # -- checks --------------------------------------------------------------------------------
    def validate_step(
        self, step: StepRecord, relation: NeighbouringRelation | str | None
    ) -> DpEvent:
        """The step's event, once its type, relation and accountant support are confirmed."""
        if not isinstance(step, StepRecord):
            raise ValueError(f"expected a StepRecord, got {type(step).__name__}")
        self.check_relation(relation)
        unit = self._training_unit()
        if unit is not None and step.sampling.unit != unit:
            raise ValueError(
                f"unit of privacy mismatch: this ledger accounts {unit}-level steps but "
                f"the step sampled {step.sampling.unit}s; ε for different units of privacy "
                "cannot be composed (guide §2.1) — keep one unit for the run"
            )
        event = step.event
        self.check_supported(event)
        return event

    def _training_unit(self) -> str | None:
        """The unit of the first recorded step; every later step is checked against it."""
        return next((e.step.sampling.unit for e in self.entries if e.step is not None), None)

    def check_relation(self, relation: NeighbouringRelation | str | None) -> None:
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

    def check_supported(self, event: DpEvent) -> None:
        """Refuse, at record time, an event the accountant could not bound later."""
        if not isinstance(event, DpEvent):
            raise ValueError(f"event must be a DpEvent, got {type(event).__name__}")
        if event in self._checked_events:
            return
        reason = self.probe.unsupported_reason(event)
        if reason is not None:
            raise UnsupportedEventError(reason)
        self._checked_events.add(event)

    # -- what was recorded ---------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Training steps recorded."""
        return sum(e.count for e in self.entries if e.step is not None)

    @property
    def assumptions_met(self) -> bool:
        """Whether every step's accounted event describes how its batch was really drawn."""
        return all(e.step.sampling.assumption_met for e in self.entries if e.step is not None)

    def last_step(self) -> StepRecord | None:
        """The most recent training step recorded, if any."""
        return next((e.step for e in reversed(self.entries) if e.step is not None), None)

    def recorded_events(self) -> Iterator[DpEvent]:
        """Each entry's event, in order (one per run, whatever its count)."""
        return (e.event for e in self.entries)

    def events(self, label: str | None = None) -> ComposedEvent:
        """Everything recorded (or one label's part), in order, as one composed event."""
        return ComposedEvent(
            tuple(
                e.event if e.count == 1 else SelfComposedEvent(e.event, e.count)
                for e in self.entries
                if label is None or e.label == label
            )
        )

    def event_counts(self, label: str | None, poisson: bool) -> dict[DpEvent, int]:
        """How often each distinct event ran, for one label or all (None); with ``poisson``,
        each step as if Poisson-sampled at its q."""
        counts: dict[DpEvent, int] = {}
        for entry in self.entries:
            if label is not None and entry.label != label:
                continue
            event = entry.event
            if poisson and entry.step is not None:
                event = entry.step.sampling.poisson_event(entry.step.noise_multiplier)
            counts[event] = counts.get(event, 0) + entry.count
        return counts

    def spent_beyond(self, earlier: LedgerStore) -> dict[tuple[str, DpEvent], int]:
        """The releases this store holds that ``earlier`` does not, by label and event."""
        counts: dict[tuple[str, DpEvent], int] = {}
        for entries, sign in ((self.entries, 1), (earlier.entries, -1)):
            for entry in entries:
                key = (entry.label, entry.event)
                counts[key] = counts.get(key, 0) + sign * entry.count
        return {key: n for key, n in counts.items() if n > 0}

    # -- ε -------------------------------------------------------------------------------------
    def epsilon(self, label: str | None, poisson: bool, delta: float | None) -> float:
        """Cached ε of a part of the ledger (one label, or all with None) at ``delta``."""
        delta = self.delta if delta is None else check_delta(delta)
        key = (label, poisson, delta)
        if key not in self._epsilon_cache:
            counts = self.event_counts(label, poisson)
            self._epsilon_cache[key] = self.compose(counts).epsilon(delta)
        return self._epsilon_cache[key]

    def epsilon_by_label(self, delta: float | None) -> dict[str, float]:
        """ε of training, of each other label and of everything: ``{..., 'total': ε}``."""
        labels = [TRAINING, *sorted({e.label for e in self.entries} - {TRAINING})]
        result = {label: self.epsilon(label, False, delta) for label in labels}
        result[TOTAL] = self.epsilon(None, False, delta)
        return result

    def epsilon_under_poisson_assumption(self, delta: float | None) -> float:
        """Total ε if every step had been Poisson-sampled; none for replace-one (ValueError)."""
        if self.relation is NeighbouringRelation.REPLACE_ONE:
            raise ValueError(
                "no ε under the Poisson assumption for a replace-one ledger: Poisson sampling is "
                "accounted under add-or-remove adjacency, and ε under different relations is not "
                "comparable"
            )
        return self.epsilon(None, True, delta)

    def compose(
        self, counts: dict[DpEvent, int], *, search: bool = False, bound: bool = False
    ) -> Accountant:
        """A fresh accountant holding ``counts`` (its fast search variant if ``search``, its
        bound variant — what the budget guard plans with — if ``bound``)."""
        accountant = new_accountant(self.accountant, self.relation)
        if search:
            accountant = accountant.for_search()
        elif bound:
            accountant = accountant.for_bound()
        for event, count in counts.items():
            accountant.compose(event, count)
        return accountant

    # -- report and checkpoint -----------------------------------------------------------------
    def summary(self, target_epsilon: float | None) -> LedgerSummary:
        """What was recorded, typed, for the privacy report (guide §5.3.3)."""
        samplings: dict[SamplingRecord, int] = {}
        sigmas: set[float] = set()
        labels: dict[str, int] = {}
        for entry in self.entries:
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
            target_epsilon=target_epsilon,
            steps=self.steps,
            groups=len(self.entries),
            sampling=tuple(SampledSteps(record, n) for record, n in samplings.items()),
            noise_multipliers=tuple(sorted(sigmas)),
            assumptions_met=met,
            epsilon=self.epsilon_by_label(None),
            labelled_events=labels,
            examples_seen=self.examples_seen if self.sized_steps else None,
            epsilon_under_poisson_assumption=None
            if met
            else self.epsilon_under_poisson_assumption(None),
        )

    def encoded_entries(self) -> list[dict[str, Any]]:
        """The entries in the checkpoint format (:mod:`dpfy.train.ledger_codec`)."""
        return [encode_entry(e.label, e.count, e.step, e.event) for e in self.entries]


def new_accountant(name: str, relation: NeighbouringRelation) -> Accountant:
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
