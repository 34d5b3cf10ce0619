"""The ledger's side of a run's facts: its state, a typed summary, and every ε the report prints.

Every figure is computed here, once, while the ledger is at hand: ε per label, ε under the
Poisson assumption, and ε at a few standard δ under both the PLD and the RDP accountant. A saved
report recomputes all of it from the stored ledger state (:mod:`dpfy.report.recompute`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpfy._validate import check_delta
from dpfy.plan.accounting.events import NeighbouringRelation
from dpfy.plan.sampling import POISSON_KINDS, SamplingKind, SamplingRecord
from dpfy.report.json_codec import build, list_as_tuple, tuple_of
from dpfy.train.ledger_summary import LedgerSummary, SampledSteps

if TYPE_CHECKING:
    from dpfy.plan.privacy_plan import PrivacyPlan
    from dpfy.train.ledger import PrivacyLedger

# δ values at which the report also states ε, beside the run's own δ (guide §5.3.3 asks for the
# full (ε, δ); several δ let readers compare with other work).
STANDARD_DELTAS = (1e-5, 1e-6, 1e-8)


def _sampled_steps_from_dict(data: Any, where: str) -> SampledSteps:
    """Inverse of ``dataclasses.asdict`` for one sampling record's steps; errors name where."""

    def record(value: Any) -> SamplingRecord:
        try:
            return SamplingRecord.from_dict(value)
        except ValueError as err:
            raise ValueError(f"{where}.sampling: {err}") from None

    return build(SampledSteps, data, {"sampling": record}, where)


def summary_from_dict(data: Any, where: str = "accounting.summary") -> LedgerSummary:
    """Inverse of ``dataclasses.asdict`` for a ledger summary; every problem names the field."""
    converters = {
        "sampling": tuple_of(SampledSteps, f"{where}.sampling", _sampled_steps_from_dict),
        "noise_multipliers": list_as_tuple,
    }
    return build(LedgerSummary, data, converters, where)


@dataclass(frozen=True)
class EpsilonAtDelta:
    """Total ε at one δ under each accountant (None where it has no bound for these events)."""

    delta: float
    pld: float | None
    rdp: float | None


@dataclass(frozen=True)
class AccountingFacts:
    """The ledger's state and every ε the report prints, computed when the facts were collected."""

    ledger_state: dict[str, Any]
    summary: LedgerSummary
    epsilon_under_poisson_assumption: float | None
    epsilon_table: tuple[EpsilonAtDelta, ...]
    notes: tuple[str, ...] = ()
    #: A proven lower bound on the training ε at the run's δ for batches that hold each example
    #: once per epoch (shuffled, balls-in-bins): no accountant can certify less for them
    #: (:mod:`dpfy.plan.accounting.epoch_lower_bound`). None for the other samplers.
    epsilon_lower_bound: float | None = None

    @classmethod
    def from_dict(cls, data: Any, where: str = "accounting") -> AccountingFacts:
        """Inverse of ``dataclasses.asdict``."""
        converters = {
            "summary": lambda d: summary_from_dict(d, f"{where}.summary"),
            "epsilon_table": tuple_of(EpsilonAtDelta, f"{where}.epsilon_table"),
            "notes": list_as_tuple,
        }
        return build(cls, data, converters, where)


def planned_sampling(plan: PrivacyPlan) -> SamplingRecord:
    """The record the plan's sampler reports each step: whether its assumption holds, and why."""
    kind = SamplingKind.parse(plan.sampler)
    batch = None if kind in POISSON_KINDS else plan.max_batch_size or plan.expected_batch_size
    return SamplingRecord(kind, plan.sampling_rate, plan.dataset_size, batch, unit=plan.unit)


def _event_counts(ledger: PrivacyLedger) -> list[tuple[Any, int]]:
    """The ledger's composed events as (event, count) pairs, in order."""
    from dpfy.plan.accounting.events import SelfComposedEvent

    pairs = []
    for event in ledger.events().events:
        if isinstance(event, SelfComposedEvent):
            pairs.append((event.event, event.count))
        else:
            pairs.append((event, 1))
    return pairs


def _epsilons(
    pairs: Sequence[tuple[Any, int]], accountant: str, relation: Any, deltas: Sequence[float]
) -> tuple[list[float | None], str | None]:
    """ε at each δ under one accountant, or Nones and the reason it has no bound."""
    from dpfy.plan.accounting import UnsupportedEventError, make_accountant

    tracker = make_accountant(accountant, relation)
    try:
        for event, count in pairs:
            tracker.compose(event, count)
    except UnsupportedEventError as err:
        return [None] * len(deltas), f"{accountant.upper()}: {err}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a grid-edge RDP bound is loose, never unsound
        return [tracker.epsilon(d) for d in deltas], None


def _poisson_epsilon(ledger: PrivacyLedger) -> float | str:
    """The ledger's ε as if every step were Poisson-sampled, or the reason it has none."""
    try:
        return ledger.epsilon_under_poisson_assumption()
    except ValueError as err:  # a replace-one ledger, or steps their mechanism accounts
        if ledger.relation is NeighbouringRelation.REPLACE_ONE:
            return f"Poisson sampling has no bound under {ledger.relation.value} adjacency"
        return str(err)


def epoch_lower_bound(ledger: PrivacyLedger) -> float | None:
    """ε at the ledger's δ below which no accountant can go for its once-per-epoch batches.

    Shuffled batches hold the example with chance kB/N per epoch (the last N mod B sit out);
    balls-in-bins with chance 1. Several σ: the largest, which only lowers the bound.
    """
    from dpfy.plan.accounting.epoch_lower_bound import epoch_epsilon_lower_bound

    summary = ledger.summary()
    kinds = {s.sampling.kind for s in summary.sampling}
    if not summary.sampling or not kinds <= _ONCE_PER_EPOCH or len(kinds) > 1:
        return None
    record = summary.sampling[0].sampling
    steps = sum(s.steps for s in summary.sampling)
    k = record.batches_per_epoch
    share = k * record.batch_size / record.dataset_size  # P[the example is in an epoch]
    if record.kind is SamplingKind.BALLS_IN_BINS:
        share = 1.0
    partial = steps % k
    return epoch_epsilon_lower_bound(
        max(summary.noise_multipliers),
        k,
        steps // k,
        ledger.delta,
        in_epoch=share,
        partial_batches=partial,
        partial_in_epoch=share * partial / k,
    )


#: Samplers whose batches hold each example at most once per epoch, in one of k batches.
_ONCE_PER_EPOCH = frozenset({SamplingKind.SHUFFLE, SamplingKind.BALLS_IN_BINS})


def accounting_facts(
    ledger: PrivacyLedger, deltas: Sequence[float] = STANDARD_DELTAS
) -> AccountingFacts:
    """The ledger's state and summary plus ε at several δ under PLD and RDP (guide §5.3.3)."""
    every = sorted({ledger.delta, *(check_delta(d) for d in deltas)}, reverse=True)
    pairs = _event_counts(ledger)
    columns, notes = {}, []
    for name in ("pld", "rdp"):
        columns[name], note = _epsilons(pairs, name, ledger.relation, every)
        if note is not None:
            notes.append(note)
    table = tuple(
        EpsilonAtDelta(d, columns["pld"][i], columns["rdp"][i]) for i, d in enumerate(every)
    )
    poisson: float | str | None = _poisson_epsilon(ledger)
    if isinstance(poisson, str):
        notes.append(f"No ε under the Poisson assumption: {poisson}.")
        poisson = None
    return AccountingFacts(
        ledger_state=ledger.state_dict(),
        summary=ledger.summary(),
        epsilon_under_poisson_assumption=poisson,
        epsilon_table=table,
        notes=tuple(notes),
        epsilon_lower_bound=epoch_lower_bound(ledger),
    )


__all__ = [
    "STANDARD_DELTAS",
    "AccountingFacts",
    "EpsilonAtDelta",
    "LedgerSummary",
    "SampledSteps",
    "accounting_facts",
    "epoch_lower_bound",
    "planned_sampling",
    "summary_from_dict",
]
