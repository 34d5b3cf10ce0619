"""What an audit exercised and what it did not, and the run's behaviour checks that cover the rest.

An ε̂ is evidence only about the code the audit ran. The white-box audits run the run's privacy
plan through dpfy's private step on a canary model, so a coupling between examples in the run's
own model, loss or data pipeline (a hand-written batch norm, a loss normalised over the batch)
never reaches them; an audit that stays below the claim says nothing about those. Every audit
therefore names its *scope* (:data:`SCOPES`), and beside it the run's *behaviour checks* from
training (collate, model and loss probed on examples alone, state unchanged
outside the private step), read from the run's ``facts.json`` as a plain dict. A check that did
not run, or that the run did not record, is a gap in what was verified and is named as one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpfy._validate import check_count


@dataclass(frozen=True)
class Scope:
    """What one kind of audit exercised (``audited``), what it did not (``not_audited``), and
    ``covers``: the short phrase a verdict puts beside "consistent with the claim"."""

    audited: str
    not_audited: str
    covers: str


#: Every audit's scope, by name (:attr:`~dpfy.audit.result.AuditResult.scope`).
SCOPES = {
    "private-step": Scope(
        "the run's privacy plan (sampler and q, σ, C, clipping unit, noise mechanism, relation) "
        "applied by dpfy's private step to a canary model",
        "the run's own model, loss and data pipeline — a coupling between examples in them "
        "(batch statistics, a loss normalised over the batch) is invisible to this audit",
        "the run's privacy plan applied by dpfy's private step to a canary model, not the "
        "run's own model, loss or data pipeline",
    ),
    "user-model": Scope(
        "your own model, loss and collate (a copy of the model), with the run's σ and C, in "
        "one full-batch step of dpfy's private step, with and without an input canary — so a "
        "coupling between examples in your code shows as ε̂ above the claim",
        "sampling and the steps of the run (the step is full-batch and repeated from the same "
        "model), and data beyond the records the audit used",
        "your own model, loss and collate in one full-batch private step",
    ),
    "re-trained-run": Scope(
        "a fresh re-run of the run's configuration (its dataset, model, mean cross-entropy "
        "loss, sampler, σ, C and steps) through dpfy's private training with input-space "
        "canaries; only that re-run's final model is attacked",
        "the run's own trained model and its random draws, and any code outside `dpfy train` "
        "(a model, loss or collate of your own); an attack on the final model is weak, so a "
        "coupling between examples can leak without raising ε̂",
        "a re-run of the run's configuration attacked through its final model, not the run's "
        "own trained model",
    ),
    "trained-model": Scope(
        "the model handed to the attack, as its own training produced it (model, loss, data "
        "pipeline and private step end to end), through its final state only",
        "anything the final model does not reveal to this attack; a weak attack finds little "
        "even against a broken run",
        "the attacked model through its final state only",
    ),
}

#: What each behaviour check of training verifies.
BEHAVIOUR_CHECKS = {
    "collate": "each example's collated row equals it collated alone",
    "model": "each example's output is unchanged when the rest of the batch is replaced",
    "loss": "each example's loss gradient equals its loss alone",
    "state": "no parameter or buffer changed outside the private step",
}
#: The statuses a check can record.
CHECK_STATUSES = ("passed", "refused", "not run")
#: Said when the run's facts hold no behaviour checks at all.
NOT_RECORDED = "not recorded (the run predates behaviour checks)"
#: Checks as facts.json holds them: name → {"status", "probes", "detail"}.
BehaviourChecks = dict[str, dict[str, Any]]


def scope_of(name: str) -> Scope:
    """The scope called ``name``; an unknown one is a ValueError naming the choices."""
    if name not in SCOPES:
        raise ValueError(f"scope must be one of {sorted(SCOPES)}, got {name!r}")
    return SCOPES[name]


def check_behaviour_checks(data: Any, where: str = "behaviour_checks") -> BehaviourChecks:
    """The checks as a plain dict, each with a known status, a count and a text; else ValueError.

    A check may carry more keys than these three (kept as they are), and a run may record more
    checks than :data:`BEHAVIOUR_CHECKS` names; a check it did not record stays absent (a gap).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a JSON object of checks, got {type(data).__name__}")
    checks: BehaviourChecks = {}
    for name, check in data.items():
        at = f"{where}.{name}"
        if not isinstance(check, Mapping):
            raise ValueError(
                f"{at} must be an object with status, probes and detail, got {check!r:.60}"
            )
        if check.get("status") not in CHECK_STATUSES:
            raise ValueError(
                f"{at}.status must be one of {', '.join(CHECK_STATUSES)}, got "
                f"{check.get('status')!r:.60}"
            )
        probes = check.get("probes", 0)
        if isinstance(probes, bool) or not isinstance(probes, int):
            raise ValueError(f"{at}.probes must be an integer, got {probes!r:.60}")
        check_count(f"{at}.probes", probes)
        if not isinstance(check.get("detail", ""), str):
            raise ValueError(f"{at}.detail must be text, got {check.get('detail')!r:.60}")
        checks[str(name)] = dict(check)
    return checks


def behaviour_gaps(checks: Mapping[str, Mapping[str, Any]] | None) -> list[tuple[str, str]]:
    """(check, why) for every check that did not pass: refused, not run or not recorded."""
    if checks is None:
        return [(name, "not recorded") for name in BEHAVIOUR_CHECKS]
    names = [*BEHAVIOUR_CHECKS, *(name for name in checks if name not in BEHAVIOUR_CHECKS)]
    gaps = []
    for name in names:
        status = checks[name].get("status") if name in checks else "not recorded"
        if status != "passed":
            gaps.append((name, str(status)))
    return gaps


def behaviour_lines(checks: Mapping[str, Mapping[str, Any]] | None) -> list[str]:
    """One line per check (what it verifies, and any gap), then the gaps together.

    None (facts without behaviour checks) is one line saying they were not recorded.
    """
    if checks is None:
        return [
            f"behaviour checks: {NOT_RECORDED}; the run's own collate, model, loss and state "
            "were not verified by behaviour"
        ]
    lines = []
    for name in [*BEHAVIOUR_CHECKS, *(n for n in checks if n not in BEHAVIOUR_CHECKS)]:
        what = BEHAVIOUR_CHECKS.get(name, "a check of the run's own code")
        check = checks.get(name)
        if check is None:
            lines.append(f"{name}: not recorded — a gap: not verified that {what}")
            continue
        status = check.get("status")
        head = f"{name}: {status} ({check.get('probes', 0)} probes)"
        detail = f" ({check['detail']})" if check.get("detail") else ""
        if status == "passed":
            lines.append(f"{head} — verified that {what}{detail}")
        elif status == "refused":
            lines.append(f"{head} — it found a coupling: not so that {what}{detail}")
        else:
            lines.append(f"{head} — a gap: not verified that {what}{detail}")
    gaps = behaviour_gaps(checks)
    if gaps:
        named = ", ".join(f"{name} ({why})" for name, why in gaps)
        lines.append(f"gaps in what was verified: {named}")
    return lines


def behaviour_statement(checks: Mapping[str, Mapping[str, Any]] | None) -> str:
    """The checks in one paragraph (audit.json's plain statement)."""
    return "; ".join(behaviour_lines(checks))


__all__ = [
    "BEHAVIOUR_CHECKS",
    "CHECK_STATUSES",
    "NOT_RECORDED",
    "SCOPES",
    "BehaviourChecks",
    "Scope",
    "behaviour_gaps",
    "behaviour_lines",
    "behaviour_statement",
    "check_behaviour_checks",
    "scope_of",
]
