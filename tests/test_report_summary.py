"""The typed ledger summary: built from the ledger, through facts.json and back, unchanged."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from dpfy.plan.accounting import dpsgd_event
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.report.accounting import summary_from_dict
from dpfy.report.facts import (
    FACTS_VERSION,
    DatasetFacts,
    LedgerSummary,
    ModelFacts,
    RunFacts,
    SampledSteps,
    TrainingFacts,
    accounting_facts,
)
from dpfy.report.json_codec import asdict, json_restore, json_safe
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.step_record import StepRecord

N, B, SIGMA, DELTA = 1_000, 50, 1.1, 1e-5


def shuffled_ledger(sigmas: tuple[float, ...] = (SIGMA, SIGMA, 2 * SIGMA)) -> PrivacyLedger:
    """Shuffled steps (one sampling record, however many σ) and a tuning event."""
    book = PrivacyLedger(DELTA, target_epsilon=50.0)
    record = SamplingRecord(SamplingKind.SHUFFLE, B / N, N, B)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shuffle sampler warns that it is not Poisson
        for sigma in sigmas:
            book.record(StepRecord(record, sigma, batch_size=B))
    book.record_event(dpsgd_event(B / N, SIGMA, 20), label="tuning", count=2)
    return book


def test_summary_holds_what_the_ledger_says():
    book = shuffled_ledger()
    summary = book.summary()
    assert (summary.accountant, summary.relation, summary.delta) == ("pld", "add-or-remove", DELTA)
    assert summary.target_epsilon == 50.0 and summary.steps == 3
    (group,) = summary.sampling  # one record, whatever σ its steps used
    assert group == SampledSteps(SamplingRecord(SamplingKind.SHUFFLE, B / N, N, B), 3)
    assert group.description == group.sampling.description and "NOT Poisson" in group.description
    assert summary.assumptions_met is False
    assert summary.epsilon == book.epsilon_by_label()
    assert summary.total_epsilon == book.epsilon()
    assert summary.labelled_events == {"tuning": 2}
    assert summary.noise_multipliers == (SIGMA, 2 * SIGMA) and summary.groups == 3
    assert summary.examples_seen == 3 * B
    assert summary.epsilon_under_poisson_assumption == book.epsilon_under_poisson_assumption()


def test_summary_round_trips_through_json():
    summary = shuffled_ledger().summary()
    text = json.dumps(json_safe(asdict(summary)), allow_nan=False)
    assert '"kind": "shuffle"' in text and "description" not in text  # prose is derived
    again = summary_from_dict(json_restore(json.loads(text)))
    assert again == summary
    assert isinstance(again.sampling[0].sampling, SamplingRecord)


def _facts(book: PrivacyLedger) -> RunFacts:
    """Facts of ``book``'s run, whose plan names one σ."""
    return RunFacts(
        dataset=DatasetFacts("d", N),
        model=ModelFacts("m", 10, 10, 0),
        privacy=PrivacyPlan(
            N, B, B / N, 3, SIGMA, 1.0, DELTA, 50.0, "pld", "shuffle", None, "mean"
        ),
        training=TrainingFacts("SGD", 0.1, 3, 3 * B / N),
        accounting=accounting_facts(book),
        software={},
    )


def test_summary_round_trips_through_saved_facts(tmp_path):
    facts = _facts(shuffled_ledger((SIGMA,) * 3))
    data = facts.to_dict()
    assert data["version"] == FACTS_VERSION == 2
    assert data["accounting"]["summary"]["sampling"][0]["steps"] == 3
    again = RunFacts.from_dict(json.loads(json.dumps(data, allow_nan=False)))
    assert again == facts and isinstance(again.accounting.summary, LedgerSummary)
    # load() recomputes the summary from the stored ledger state, and gets the same one
    loaded = RunFacts.load(facts.save(tmp_path / "facts.json"))
    assert loaded.accounting.summary == facts.accounting.summary


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda s: s.update(secret=1), "unknown LedgerSummary fields at accounting.summary"),
        (lambda s: s.pop("labelled_events"), "accounting.summary.labelled_events"),
        (lambda s: s.update(steps="3"), "accounting.summary.steps must be int"),
        (lambda s: s["sampling"][0].update(steps=2.5), "accounting.summary.sampling[0].steps"),
        (lambda s: s["sampling"][0]["sampling"].update(kind="lottery"), "sampling[0].sampling"),
        (lambda s: s.update(sampling={}), "accounting.summary.sampling must be a list"),
    ],
)
def test_a_malformed_summary_is_refused_naming_the_field(edit, named):
    data = _facts(shuffled_ledger((SIGMA,) * 3)).to_dict()
    edit(data["accounting"]["summary"])
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        RunFacts.from_dict(data)


def test_a_summary_that_disagrees_with_the_stored_ledger_is_refused(tmp_path):
    facts = _facts(shuffled_ledger((SIGMA,) * 3))
    record = dataclasses.replace(facts.accounting.summary.sampling[0].sampling, batch_size=B - 1)
    summary = dataclasses.replace(facts.accounting.summary, sampling=(SampledSteps(record, 3),))
    edited = dataclasses.replace(
        facts, accounting=dataclasses.replace(facts.accounting, summary=summary)
    )
    with pytest.raises(
        ValueError, match=r"accounting\.summary\.sampling\[0\]\.sampling\.batch_size"
    ):
        RunFacts.load(edited.save(tmp_path / "facts.json"))
