"""The report card's "Empirical audit" section: each ε̂ beside the ε the run claims.

An ε is a proof about the mechanism as written; an audit is evidence about the code that ran.
The section states each audit's lower bound ε̂, its confidence, method and cost beside the
claimed ε, and says what the comparison means: ε̂ ≤ ε is consistent with the claim but proves
nothing (a weak attack finds little even against a broken run), while ε̂ > ε at confidence c
happens to a correct run with probability at most 1 − c — it means a bug. Each audit says what
it exercised and what it did not (:data:`dpfy.audit.scope.SCOPES`), and "consistent with the
claim" is never said without that scope; beside them stand the run's behaviour checks from
training, every check that did not pass named as a gap in what was verified.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dpfy.audit.result import METHODS, THREAT_MODELS, AuditResult
from dpfy.audit.scope import (
    BehaviourChecks,
    behaviour_gaps,
    behaviour_lines,
    behaviour_statement,
    scope_of,
)
from dpfy.report.pitfalls import Finding, Severity, detector
from dpfy.report.sections import section, show_epsilon, show_value

if TYPE_CHECKING:
    from dpfy.report.facts import RunFacts
    from dpfy.report.wording import Wording

NONE_RECORDED = (
    "No empirical audit is recorded for this run. An audit (dpfy.audit) attacks the run with "
    "canaries or membership inference and states a lower bound ε̂ on the ε the code really has."
)
WHAT_EPSILON_HAT_MEANS = (
    "What ε̂ means: a lower bound, at the stated confidence, on the ε of the part of training "
    "the audit ran (one step, one DP-FTRL epoch, one whole re-run, or one step of your own "
    "model — each audit says which), found by attacking it with canaries: no smaller ε is "
    "consistent with what the attack saw. It is compared with the ε the accounting claims for "
    "that same part, not with the whole run's ε. ε̂ close to the claim says the claim is tight "
    "and the code clips and adds noise as accounted; ε̂ above the claim says the code leaks "
    "more than its accounting (a bug, or chance at most 1 − confidence of the time). What it "
    "does not mean: ε̂ is not the run's privacy — the claimed ε is, and an audit can only show "
    "it is too small; a small ε̂ does not prove the claim (a weak attack finds little); and an "
    "audit says nothing about code it did not run. An f-DP audit's ε̂ assumes the audited "
    "step's noise is Gaussian, as its claim says; its comparison of μ̂ with the claimed μ needs "
    "no such assumption."
)
EVIDENCE_NOT_PROOF = (
    "ε̂ ≤ ε is evidence that the run is correct, not proof: an audit bounds ε from below, and an "
    "attack that finds little says nothing about attacks it did not try."
)


def claimed_epsilon(audit: AuditResult, facts: RunFacts) -> float | None:
    """The ε the audit is compared with: its own claim, else the run's total ε at the same δ.

    An audit of one step or block states that part's claimed ε itself; without one, only the
    run's ε at exactly the audit's δ is comparable.
    """
    if audit.claimed_epsilon is not None:
        return audit.claimed_epsilon
    summary = facts.accounting.summary
    return summary.total_epsilon if audit.delta == summary.delta else None


def verdict(audit: AuditResult, claim: float | None) -> str:
    """One sentence: what this ε̂ says about this claim."""
    eps_hat, conf = show_epsilon(audit.epsilon_lower_bound), f"{audit.confidence:.4g}"
    if claim is None:
        return (
            f"ε̂ = {eps_hat} at δ = {audit.delta:g} ({conf} confidence); the run states no ε at "
            "this δ to compare it with."
        )
    if audit.epsilon_lower_bound > claim:
        return (
            f"ε̂ = {eps_hat} EXCEEDS the claimed ε = {show_epsilon(claim)}: the code leaks more "
            f"than its accounting says. {false_alarm_rate(audit)} Treat it as a bug in the "
            "private step, the sampler or the accounting, and do not publish the claim until it "
            "is found."
        )
    return (
        f"ε̂ = {eps_hat} ≤ claimed ε = {show_epsilon(claim)} at {conf} confidence: consistent "
        f"with the claim for {scope_of(audit.audited_scope).covers}."
    )


def false_alarm_rate(audit: AuditResult) -> str:
    """How often a correct run would show this ε̂: bounded by the theorem, except for one model's
    membership inference, whose examples are not independent trials (its own notes say so)."""
    if audit.method == "membership-inference":
        return (
            "This bound treats every example of one model as an independent trial, which no "
            "theorem justifies, so how often a correct run shows it is not bounded; confirm it "
            "with a one-run audit (members drawn by coin flip) or `dpfy audit RUN_DIR`."
        )
    return f"A correct run shows this with probability at most {1 - audit.confidence:.2g}."


def _audit_row(audit: AuditResult, facts: RunFacts) -> dict[str, Any]:
    """One audit as JSON: its figures, its claim and the sentence comparing them."""
    claim = claimed_epsilon(audit, facts)
    scope = scope_of(audit.audited_scope)
    return {
        **audit.to_dict(),
        "scope": audit.audited_scope,
        "audited": scope.audited,
        "not_audited": scope.not_audited,
        "claimed_epsilon": claim,
        "method_description": METHODS[audit.method],
        "threat_model_description": THREAT_MODELS[audit.threat_model],
        "exceeds_claim": claim is not None and audit.epsilon_lower_bound > claim,
        "statement": verdict(audit, claim),
    }


def _render_audits(data: dict[str, Any]) -> list[str]:
    """A table of ε̂ beside claimed ε, each audit's verdict, scope and notes, the run's behaviour
    checks, then the caveat."""
    checks = [
        "**The run's behaviour checks from training** (its own collate, model, loss and state):",
        "",
        *(f"- {line}" for line in data.get("behaviour_check_lines", ())),
    ]
    if not data["audits"]:
        return [data["statement"], *(["", *checks] if "behaviour_checks" in data else [])]
    lines = [
        "| method | access | ε̂ (lower bound) | claimed ε | δ | confidence | canaries | runs "
        "| seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["audits"]:
        eps_hat, claim = (
            show_epsilon(row["epsilon_lower_bound"]),
            show_epsilon(row["claimed_epsilon"]),
        )
        lines.append(
            f"| {row['method']} | {row['threat_model']} | {eps_hat} | {claim} | {row['delta']:g} "
            f"| {row['confidence']:.4g} | {row['canaries']} | {row['runs']} "
            f"| {show_value(float(row['seconds']))} |"
        )
    lines.append("")
    for row in data["audits"]:
        lines.append(f"- **{row['method']}** ({row['method_description']}): {row['statement']}")
        lines += [f"  - audited: {row['audited']}", f"  - not audited: {row['not_audited']}"]
        lines += [f"  - {note}" for note in row["notes"]]
    return [*lines, "", data.get("meaning", WHAT_EPSILON_HAT_MEANS), "", *checks, "",
            data["statement"]]  # fmt: skip


@section("empirical_audit", "Empirical audit", _render_audits)
def empirical_audit(
    facts: RunFacts, findings: tuple[Finding, ...], words: Wording
) -> dict[str, Any]:
    """Every recorded audit's ε̂ beside the claimed ε, and what the comparison means."""
    rows = [_audit_row(audit, facts) for audit in facts.audits]
    checks = run_behaviour_checks(facts)
    behaviour = {
        "behaviour_checks": checks,
        "behaviour_check_gaps": [name for name, _ in behaviour_gaps(checks)],
        "behaviour_check_lines": behaviour_lines(checks),
        "behaviour_statement": behaviour_statement(checks),
    }
    if not rows:  # the checks stand in their own section (behaviour_sections) until an audit
        return {"audits": [], "any_exceeds_claim": False, "statement": NONE_RECORDED}
    exceeded = any(row["exceeds_claim"] for row in rows)
    statement = EVIDENCE_NOT_PROOF
    if exceeded:
        statement = (
            "At least one audit found more leakage than the run claims: the claimed ε is not "
            "supported by the code that ran. " + EVIDENCE_NOT_PROOF
        )
    return {
        "audits": rows,
        "any_exceeds_claim": exceeded,
        "statement": statement,
        "meaning": WHAT_EPSILON_HAT_MEANS,
        **behaviour,
    }


def run_behaviour_checks(facts: RunFacts) -> BehaviourChecks | None:
    """The run's behaviour checks from training: the facts' own record where they carry one,
    else what the latest audit read from ``facts.json``; None when neither holds any."""
    recorded = getattr(facts, "behaviour_checks", None)  # a facts field, once the run has one
    if isinstance(recorded, Mapping):
        return dict(recorded)
    return facts.audits[-1].behaviour_checks if facts.audits else None


@detector("audit-exceeds-claim")
def audit_exceeds_claim(facts: RunFacts) -> Iterator[Finding]:
    """An audit's ε̂ above the claimed ε is an error: the headline must not state the claim bare.

    Registered here, beside the section that words the same comparison, so the report card
    (which imports this module) counts it among the errors that weaken the claim.
    """
    for i, audit in enumerate(facts.audits):
        claim = claimed_epsilon(audit, facts)
        if claim is not None and audit.epsilon_lower_bound > claim:
            yield Finding(
                "audit-exceeds-claim",
                Severity.ERROR,
                f"Empirical audit {i + 1} ({audit.method}) found more leakage than claimed",
                f"ε̂ = {show_epsilon(audit.epsilon_lower_bound)} > claimed ε = "
                f"{show_epsilon(claim)} at {audit.confidence:.4g} confidence (δ = "
                f"{audit.delta:g}). {false_alarm_rate(audit)}",
                "find the bug in the private step, the sampler or the accounting (noise scale, "
                "clipping, the batch-size divisor), then train and audit again.",
                "§5.3.3",
            )


SECTIONS = (empirical_audit,)

__all__ = [
    "EVIDENCE_NOT_PROOF",
    "NONE_RECORDED",
    "SECTIONS",
    "WHAT_EPSILON_HAT_MEANS",
    "audit_exceeds_claim",
    "claimed_epsilon",
    "run_behaviour_checks",
    "verdict",
]
