"""The layout the access-model report cards share: seven numbered sections and report.json.

Label-, input- and prediction-level runs each state different facts, but in the same order as
the guide's report card (§5.3.3), so a reader finds the DP setting, what was released, the unit
and relation, the accounting, the data, the results and the pitfalls in the same place.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpfy._safe_io import atomic_write_text
from dpfy.report.pitfalls import Finding

__all__ = ["SECTIONS", "findings_lines", "render_card", "write_card"]

SECTIONS = (
    "DP setting",
    "What is released",
    "Unit of privacy and neighbouring relation",
    "Accounting",
    "Data",
    "Results",
    "Pitfalls",
)


def findings_lines(findings: tuple[Finding, ...]) -> list[str]:
    """The pitfalls, or a line saying none were found."""
    if not findings:
        return ["No pitfalls found."]
    return [
        f"- **{f.severity.value.upper()}** {f.code}: {f.title} — {f.evidence} Fix: {f.fix}"
        for f in findings
    ]


def render_card(title: str, bodies: Sequence[Sequence[str]]) -> str:
    """``# Privacy report: title`` and one numbered section per body, in :data:`SECTIONS` order."""
    if len(bodies) != len(SECTIONS):
        raise ValueError(f"a card has {len(SECTIONS)} sections, got {len(bodies)}")
    lines = [f"# Privacy report: {title}"]
    for number, (heading, body) in enumerate(zip(SECTIONS, bodies, strict=True), start=1):
        lines += ["", f"## {number}. {heading}", "", *body]
    return "\n".join(lines) + "\n"


def write_card(run_dir: Path, document: dict[str, Any], markdown: str) -> Path:
    """Write ``report.json`` (``document``) and ``report.md`` into ``run_dir``; the card's path."""
    atomic_write_text(run_dir / "report.json", json.dumps(document, indent=2) + "\n")
    target = run_dir / "report.md"
    atomic_write_text(target, markdown)
    return target
