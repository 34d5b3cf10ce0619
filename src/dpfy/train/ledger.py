"""The privacy ledger: one event per step from what actually happened, and a budget guard.

The ledger accounts every step, empty ones included, from what the sampler reports; it guards
the budget, travels in checkpoints and counts tuning runs. Each DP-SGD step is recorded from the
sampler's :class:`~dpfy.plan.sampling.SamplingRecord` and the noise multiplier σ actually used —
never from the realised batch size, which must not influence anything privacy-relevant.
Tuning runs and other releases are recorded as labelled events and reported beside the training ε
(guide §5.4.2). The budget guard refuses a step *before* it is applied, and the whole
ledger travels in checkpoints as plain JSON.

This module is the facade callers and checkpoints know; it joins two parts, each with one job:
the record store (:mod:`dpfy.train.ledger_store`: run-length-encoded entries and the ε they
compose to) and the budget guard (:mod:`dpfy.train.budget_guard`: whether one more step fits,
with its caches), which reads the store and hears of every record.
"""

from __future__ import annotations

from typing import Any

from dpfy._validate import check_count
from dpfy.plan.accounting.accountant import Accountant
from dpfy.plan.accounting.events import ComposedEvent, DpEvent, NeighbouringRelation
from dpfy.train.budget_certificate import Certificate
from dpfy.train.budget_exhausted import BudgetExhausted
from dpfy.train.budget_guard import BudgetGuard
from dpfy.train.ledger_codec import (
    LEDGER_FORMAT,
    LEDGER_VERSION,
    check_format,
    decode_entry,
    entries_of,
)
from dpfy.train.ledger_store import TOTAL, TRAINING, LedgerStore
from dpfy.train.ledger_summary import LedgerSummary
from dpfy.train.step_record import StepRecord


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
        self._store = LedgerStore(delta, accountant, relation)
        self._guard = BudgetGuard(self._store, target_epsilon)
        #: The run this ledger accounts (set by make_private), so a checkpoint's ledger and
        #: sampler state can be checked to belong together.
        self.run_id: str | None = None

    @property
    def delta(self) -> float:
        """The δ every ε of this ledger is stated at."""
        return self._store.delta

    @property
    def relation(self) -> NeighbouringRelation:
        """The neighbouring relation every record was derived under."""
        return self._store.relation

    @property
    def accountant(self) -> str:
        """The name of the accountant that computes ε."""
        return self._store.accountant

    @property
    def target_epsilon(self) -> float | None:
        """The budget the guard holds the total ε to (None: no guard); setting it re-arms the
        guard from scratch."""
        return self._guard.target_epsilon

    @target_epsilon.setter
    def target_epsilon(self, value: float | None) -> None:
        self._guard.target_epsilon = value

    @property
    def _probe(self) -> Accountant:
        """The accountant asked which events it supports."""
        return self._store.probe

    @property
    def _certificate(self) -> Certificate | None:
        """The guard's current certificate, if any (:mod:`dpfy.train.budget_certificate`)."""
        return self._guard.certificate

    # -- recording -----------------------------------------------------------------------------
    def record(
        self, step: StepRecord, *, relation: NeighbouringRelation | str | None = None
    ) -> None:
        """Append one step that happened, from the sampler's record and the σ used.

        Call :meth:`check_step` *before* applying the step: ``record`` accounts the truth even
        past the budget, because a step that was applied must be accounted.
        """
        plain, event = self._store.add_step(step, relation, stacklevel=2)
        self._guard.recorded_step(plain, event)

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
        self._store.add_event(event, label, count, relation)
        self._guard.recorded_event(event, count)

    # -- budget guard --------------------------------------------------------------------------
    def check_step(
        self, step: StepRecord, *, relation: NeighbouringRelation | str | None = None
    ) -> None:
        """Raise :class:`BudgetExhausted` if one more ``step`` would exceed the target.

        Call it before the step changes the model; it changes nothing. Cheap: the number of
        steps like ``step`` that still fit is searched once (see :meth:`remaining_steps`) and
        counted down by :meth:`record`; when steps differ from one to the next (σ or q
        schedules), a certificate covers a whole range of them
        (:mod:`dpfy.train.budget_certificate`), and within a small margin of the target each step
        is checked with the accountant. An accountant whose events add exactly (RDP) keeps a
        running state instead, and each step is one conversion of it; only a tie within rounding
        of the target asks a fresh accountant. The guard itself is :mod:`dpfy.train.budget_guard`.
        """
        self._guard.check(step, relation)

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
        return self._guard.remaining(step)

    # -- ε -------------------------------------------------------------------------------------
    def epsilon(self, delta: float | None = None) -> float:
        """Total ε spent so far — training and every labelled event — at ``delta`` (default δ)."""
        return self._store.epsilon(None, False, delta)

    def epsilon_by_label(self, delta: float | None = None) -> dict[str, float]:
        """ε of training, of each label (e.g. tuning) and of everything: ``{..., 'total': ε}``."""
        return self._store.epsilon_by_label(delta)

    def epsilon_under_poisson_assumption(self, delta: float | None = None) -> float:
        """Total ε if every step had been Poisson-sampled at its q (guide §4.3 comparison).

        Equal to :meth:`epsilon` for Poisson and shuffled runs (shuffling is already accounted
        under this assumption). A replace-one ledger (fixed-size sampling) has no such figure:
        Poisson sampling is accounted under add-or-remove, and ε under different relations is
        never compared, so it raises ValueError.
        """
        return self._store.epsilon_under_poisson_assumption(delta)

    @property
    def assumptions_met(self) -> bool:
        """Whether every step's accounted event describes how its batch was really drawn."""
        return self._store.assumptions_met

    @property
    def steps(self) -> int:
        """Training steps recorded."""
        return self._store.steps

    def events(self, label: str | None = None) -> ComposedEvent:
        """Everything recorded (or one label's part), in order, as one composed event."""
        return self._store.events(label)

    def spent_beyond(self, earlier: PrivacyLedger) -> dict[tuple[str, DpEvent], int]:
        """The releases this ledger holds that ``earlier`` does not, by label and event.

        What a run loses from its ledger when it goes back to an earlier checkpoint: those steps
        were released (losses seen, models saved), so the rewound run must carry them.
        """
        return self._store.spent_beyond(earlier._store)

    # -- report --------------------------------------------------------------------------------
    def summary(self) -> LedgerSummary:
        """What the ledger recorded, typed, for the privacy report (guide §5.3.3)."""
        return self._store.summary(self.target_epsilon)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A versioned, plain-JSON dict of everything recorded, for checkpoints."""
        store = self._store
        return {
            "format": LEDGER_FORMAT,
            "version": LEDGER_VERSION,
            "accountant": store.accountant,
            "relation": store.relation.value,
            "delta": store.delta,
            "target_epsilon": self.target_epsilon,
            "entries": store.encoded_entries(),
            "examples_seen": store.examples_seen,
            "sized_steps": store.sized_steps,
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
            store = ledger._store
            for i, item in enumerate(entries_of(state)):
                store.load_entry(*decode_entry(i, item, TRAINING))
            store.examples_seen = check_count("examples_seen", state["examples_seen"])
            store.sized_steps = check_count("sized_steps", state["sized_steps"])
            run_id = state.get("run_id")
            if run_id is not None and not isinstance(run_id, str):
                raise ValueError("run_id must be a string")
            ledger.run_id = run_id
        except KeyError as missing:
            raise ValueError(f"corrupt ledger state: missing field {missing}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"corrupt ledger state: {err}") from None
        return ledger

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
        self._store = loaded._store
        self._guard = BudgetGuard(self._store, self.target_epsilon)
        self.run_id = loaded.run_id

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(accountant={self.accountant!r}, delta={self.delta:g}, "
            f"relation={self.relation.value!r}, steps={self.steps}, "
            f"groups={len(self._store.entries)})"
        )


__all__ = ["TOTAL", "TRAINING", "BudgetExhausted", "PrivacyLedger"]
