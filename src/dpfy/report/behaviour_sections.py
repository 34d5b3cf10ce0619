"""The card's section on the run's own code: was each example's contribution its own?

A DP claim rests on clipping bounding one example's influence, which holds only if the user's
collate_fn, model and loss treat examples independently and nothing writes into the model
outside the private step. dpfy probes that by behaviour during training
(:mod:`dpfy.train.behaviour`); the card states which checks ran, how often, and what was not
verified — names of code and reasons only, never values of the private data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpfy.audit.scope import BEHAVIOUR_CHECKS, behaviour_gaps, behaviour_lines
from dpfy.report.sections import section

if TYPE_CHECKING:
    from dpfy.report.facts import RunFacts
    from dpfy.report.pitfalls import Finding
    from dpfy.report.wording import Wording


def _render(data: dict[str, Any]) -> list[str]:
    """One bullet per check, then the statement."""
    return [*(f"- {line}" for line in data["lines"]), "", data["statement"]]


@section("behaviour_checks", "Behaviour checks of the run's own code", _render)
def behaviour_checks(
    facts: RunFacts, findings: tuple[Finding, ...], words: Wording
) -> dict[str, Any]:
    """Each check's status, probe count and schedule; the gaps named."""
    checks = facts.behaviour_checks
    gaps = behaviour_gaps(checks)
    if checks is None:
        statement = (
            "The run recorded no behaviour checks, so its collate path, model, loss and state "
            "were not verified to treat examples independently."
        )
    elif not gaps:
        schedule = checks.get("model", {}).get("schedule", "a schedule")
        statement = (
            "Every check passed: on the probed batches each example's contribution depended on "
            "that example alone, and nothing changed the model outside the private step (checked "
            f"every step). The probes sample the run ({schedule}); they are evidence, not proof."
        )
    else:
        statement = (
            "Not everything was verified: "
            + ", ".join(f"{name} ({why})" for name, why in gaps)
            + ". The claim assumes those parts treat examples independently."
        )
    return {
        "checks": checks,
        "verifies": dict(BEHAVIOUR_CHECKS),
        "gaps": [name for name, _ in gaps],
        "lines": behaviour_lines(checks)[: len(BEHAVIOUR_CHECKS) if checks else 1],
        "statement": statement,
    }


SECTIONS = (behaviour_checks,)

__all__ = ["SECTIONS"]
