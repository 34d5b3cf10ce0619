"""The report card's empirical-audit section, and audits saved in the run facts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dpfy.audit.result import AuditResult
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.report.audit_sections import EVIDENCE_NOT_PROOF, NONE_RECORDED
from dpfy.report.facts import (
    DatasetFacts,
    ModelFacts,
    RunFacts,
    TrainingFacts,
    accounting_facts,
)
from dpfy.report.render import build_report
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.step_record import StepRecord

N, B, DELTA, SIGMA = 1_000, 50, 1e-5, 1.0


def run_facts(*audits: AuditResult) -> RunFacts:
    """Facts of a four-step Poisson DP-SGD run carrying ``audits``."""
    privacy = PrivacyPlan(N, B, B / N, 4, SIGMA, 1.0, DELTA, None, "pld", "poisson", None, "mean")
    book = PrivacyLedger(DELTA, accountant="pld")
    for _ in range(4):
        book.record(StepRecord(SamplingRecord(SamplingKind.POISSON, B / N, N, None), SIGMA))
    return RunFacts(
        dataset=DatasetFacts("d", N),
        model=ModelFacts("m", 10, 10, 0),
        privacy=privacy,
        training=TrainingFacts("SGD", 0.1, 4, 4 * B / N),
        accounting=accounting_facts(book),
        software={},
        audits=audits,
    )


def audit(**changes) -> AuditResult:
    base = AuditResult(
        method="one-run",
        epsilon_lower_bound=0.4,
        confidence=0.95,
        delta=DELTA,
        canaries=1000,
        guesses=200,
        correct=130,
        seconds=3.5,
        threat_model="white-box",
        notes=("best of k ∈ [20, 100]",),
    )
    return dataclasses.replace(base, **changes)


def test_section_shows_the_bound_beside_the_runs_own_epsilon():
    facts = run_facts(audit())
    section = build_report(facts).to_json()["empirical_audit"]
    row = section["audits"][0]
    assert row["claimed_epsilon"] == pytest.approx(facts.accounting.summary.total_epsilon)
    assert row["exceeds_claim"] is False and section["any_exceeds_claim"] is False
    assert "consistent with the claim" in row["statement"]
    md = build_report(facts).to_markdown()
    assert "## Empirical audit" in md and "| one-run | white-box | 0.4 |" in md
    assert EVIDENCE_NOT_PROOF in md and "best of k" in md


def test_bound_above_the_claim_is_called_a_bug():
    facts = run_facts(audit(epsilon_lower_bound=6.0, claimed_epsilon=2.0))
    section = build_report(facts).to_json()["empirical_audit"]
    assert section["any_exceeds_claim"] is True
    assert "EXCEEDS the claimed ε = 2" in section["audits"][0]["statement"]
    assert "bug" in section["audits"][0]["statement"]
    assert "not supported by the code that ran" in section["statement"]


def test_bound_above_the_claim_is_an_error_the_headline_counts():
    card = build_report(run_facts(audit(epsilon_lower_bound=6.0, claimed_epsilon=2.0)))
    codes = [(f.code, f.severity.value) for f in card.findings]
    assert ("audit-exceeds-claim", "error") in codes
    assert "1 error-level pitfall(s)" in card.headline
    assert not any(
        f.code == "audit-exceeds-claim" for f in build_report(run_facts(audit())).findings
    )


def test_audit_at_another_delta_without_its_own_claim_is_not_compared():
    section = build_report(run_facts(audit(delta=1e-3))).to_json()["empirical_audit"]
    assert section["audits"][0]["claimed_epsilon"] is None
    assert "states no ε at this δ" in section["audits"][0]["statement"]


def test_run_without_audits_says_none_is_recorded():
    card = build_report(run_facts())
    assert card.to_json()["empirical_audit"]["audits"] == []
    assert NONE_RECORDED in card.to_markdown()


def test_audits_round_trip_through_json(tmp_path):
    facts = run_facts(audit(), audit(method="classical", runs=2, claimed_epsilon=0.9))
    path = facts.save(tmp_path / "facts.json")
    loaded = RunFacts.load(path)
    assert loaded.audits == facts.audits
    assert build_report(loaded).to_markdown() == build_report(facts).to_markdown()


def test_facts_written_before_audits_existed_still_load():
    data = run_facts().to_dict()
    del data["audits"]
    assert RunFacts.from_dict(data).audits == ()


@pytest.mark.parametrize(
    ("field", "value", "refusal"),
    [
        ("correct", 201, "cannot exceed guesses"),
        ("confidence", 1.0, "confidence must lie in"),
        ("epsilon_lower_bound", -0.1, "must be ≥ 0"),
        ("epsilon_lower_bound", "inf", "finite"),
        ("method", "vibes", "method must be one of"),
        ("runs", 0, "runs must be a whole number >= 1"),
        ("canaries", 2.5, "canaries must be an integer"),
        ("delta", 1.5, "delta must lie in"),
    ],
)
def test_saved_facts_with_an_impossible_audit_are_refused(field, value, refusal):
    data = json.loads(json.dumps(run_facts(audit()).to_dict()))
    data["audits"][0][field] = value
    with pytest.raises(ValueError, match=refusal) as caught:
        RunFacts.from_dict(data)
    assert "audits[0]" in str(caught.value)


def test_an_impossible_audit_cannot_be_constructed():
    with pytest.raises(ValueError, match="threat_model must be one of"):
        audit(threat_model="grey-box")
    with pytest.raises(ValueError, match="claimed_epsilon must be > 0"):
        audit(claimed_epsilon=0.0)


def test_exceeds_claim_compares_with_the_audits_own_claim():
    assert audit(epsilon_lower_bound=1.0, claimed_epsilon=0.5).exceeds_claim
    assert not audit(epsilon_lower_bound=1.0).exceeds_claim  # nothing to compare with


def test_a_membership_bound_above_the_claim_does_not_claim_a_false_alarm_rate():
    # one model's examples are not independent trials: no theorem bounds how often a correct
    # run's membership ε̂ exceeds its ε, so the card must not state a probability for it
    facts = run_facts(
        audit(method="membership-inference", epsilon_lower_bound=6.0, claimed_epsilon=2.0)
    )
    card = build_report(facts)
    statement = card.to_json()["empirical_audit"]["audits"][0]["statement"]
    evidence = next(f.evidence for f in card.findings if f.code == "audit-exceeds-claim")
    for text in (statement, evidence):
        assert "probability at most" not in text and "is not bounded" in text
    one_run = build_report(run_facts(audit(epsilon_lower_bound=6.0, claimed_epsilon=2.0)))
    row = one_run.to_json()["empirical_audit"]["audits"][0]
    assert "probability at most 0.05" in row["statement"]


# --- what each audit exercised, and the run's behaviour checks (issue 29, item 5) ------------

CHECKS = {
    "collate": {"status": "passed", "probes": 4, "detail": "rows equal alone"},
    "model": {"status": "refused", "probes": 4, "detail": "BatchNorm-like coupling in layer 2"},
    "loss": {"status": "passed", "probes": 4, "detail": ""},
    "state": {"status": "not run", "probes": 0, "detail": "no steps"},
}


def test_a_private_step_audit_says_it_ran_the_plan_on_a_canary_model_not_the_runs_model():
    section = build_report(run_facts(audit())).to_json()["empirical_audit"]
    row = section["audits"][0]
    assert row["scope"] == "private-step"
    assert "applied by dpfy's private step to a canary model" in row["audited"]
    assert "the run's own model, loss and data pipeline" in row["not_audited"]
    assert "invisible to this audit" in row["not_audited"]
    assert "consistent with the claim for the run's privacy plan" in row["statement"]
    assert "not the run's own model, loss or data pipeline" in row["statement"]
    md = build_report(run_facts(audit())).to_markdown()
    assert "  - audited: the run's privacy plan" in md
    assert "  - not audited: the run's own model" in md


@pytest.mark.parametrize(
    ("changes", "scope", "words"),
    [
        ({"threat_model": "black-box"}, "trained-model", "the model handed to the attack"),
        ({"threat_model": "black-box", "scope": "re-trained-run"}, "re-trained-run", "re-run"),
        ({"method": "membership-inference", "threat_model": "black-box"}, "trained-model", ""),
    ],
)
def test_every_scope_is_worded_and_a_bound_without_one_takes_its_threat_models(
    changes, scope, words
):
    row = build_report(run_facts(audit(**changes))).to_json()["empirical_audit"]["audits"][0]
    assert row["scope"] == scope and words in row["audited"] and row["not_audited"]
    assert "consistent with the claim for " in row["statement"]


def test_the_behaviour_checks_an_audit_read_are_shown_with_every_gap():
    section = build_report(run_facts(audit(behaviour_checks=CHECKS))).to_json()
    data = section["empirical_audit"]
    assert data["behaviour_checks"] == CHECKS
    assert data["behaviour_check_gaps"] == ["model", "state"]
    md = build_report(run_facts(audit(behaviour_checks=CHECKS))).to_markdown()
    assert "collate: passed (4 probes)" in md
    assert "model: refused (4 probes)" in md and "BatchNorm-like coupling" in md
    assert "state: not run" in md
    assert "gaps in what was verified: model (refused), state (not run)" in md


def test_an_audit_of_a_run_without_behaviour_checks_says_not_recorded():
    data = build_report(run_facts(audit())).to_json()["empirical_audit"]
    assert data["behaviour_checks"] is None
    assert "not recorded (the run predates behaviour checks)" in data["behaviour_statement"]
    assert "not recorded (the run predates behaviour checks)" in (
        build_report(run_facts(audit())).to_markdown()
    )


def test_an_audit_saved_before_scopes_existed_still_loads_and_is_worded():
    data = json.loads(json.dumps(run_facts(audit()).to_dict()))
    del data["audits"][0]["scope"], data["audits"][0]["behaviour_checks"]
    loaded = RunFacts.from_dict(data)
    assert loaded.audits[0].scope is None and loaded.audits[0].audited_scope == "private-step"


@pytest.mark.parametrize(
    ("checks", "refusal"),
    [
        ({"loss": {"status": "fine", "probes": 1, "detail": ""}}, "behaviour_checks.loss.status"),
        ({"loss": {"status": "passed", "probes": -1, "detail": ""}}, r"checks\.loss\.probes"),
        ({"loss": {"status": "passed", "probes": 1, "detail": 3}}, "behaviour_checks.loss.detail"),
        ({"loss": "passed"}, "behaviour_checks.loss must be"),
    ],
)
def test_saved_behaviour_checks_that_cannot_have_happened_are_refused(checks, refusal):
    data = json.loads(json.dumps(run_facts(audit()).to_dict()))
    data["audits"][0]["behaviour_checks"] = checks
    with pytest.raises(ValueError, match=refusal):
        RunFacts.from_dict(data)


def test_an_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="scope must be one of"):
        audit(scope="everything")
