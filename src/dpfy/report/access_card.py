"""The privacy report of a label-only or input-level run: what is protected, ε, and the pitfalls.

These runs do not go through the DP-SGD ledger, so their card is shorter than the full-training
one (:mod:`dpfy.report.card`) but states the same items in the same order (guide §5.3.3): the
setting and its access model (§3.2), what is released, the unit and the neighbouring relation,
the accounting, the results, and the pitfalls found.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpfy.report.access_card_layout import findings_lines, render_card, write_card
from dpfy.report.access_facts import AccessFacts, access_statement
from dpfy.report.pitfalls import Finding

__all__ = ["AccessRun", "render_access_report", "write_access_report"]

_RELEASED = {
    "label": (
        "the randomised labels and every model trained on them with the public features. "
        "Training adds no noise: the model is post-processing of the randomised labels and the "
        "public features, so it carries the labels' guarantee (guide §2.2)"
    ),
    "input": (
        "the randomised records and every model trained on them. The records were randomised "
        "before training, so whoever holds them — the trainer included — sees only the "
        "randomised data (guide §2.2)"
    ),
}

_RELATION = {
    "label": (
        "neighbouring datasets differ in the label of one example, all features fixed "
        "(label-level replace-one; guide §2.1)"
    ),
    "input": (
        "local DP: any two values of one record give outputs whose odds differ by at most e^ε "
        "(replace-one on the record, each record randomised independently)"
    ),
}


@dataclass(frozen=True)
class AccessRun:
    """What a label-only or input-level run did, in plain data (its report and JSON)."""

    access: AccessFacts
    dataset: str
    dataset_source: str
    train_size: int
    model: str
    accuracy: float | None = None
    baseline_accuracy: float | None = None
    accounting: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON."""
        return dataclasses.asdict(self)


def _epsilon_line(run: AccessRun) -> str:
    """The ε and δ the run spends, per label or per record."""
    per = "label" if run.access.model == "label" else "record"
    delta = "pure DP, δ = 0" if run.access.delta == 0 else f"δ = {run.access.delta:g}"
    return f"ε = {run.access.epsilon:g} per {per} ({delta})."


def _accounting_lines(run: AccessRun) -> list[str]:
    """The composition the ε follows from."""
    if run.access.model == "label":
        times = run.accounting.get("max_times_randomised", 1)
        return [
            _epsilon_line(run),
            "",
            f"Each of the {run.accounting.get('labels_randomised', run.train_size)} labels was "
            f"randomised {'once' if times == 1 else f'up to {times} times'}: releases on "
            "disjoint labels (examples, stages) compose in parallel, and releases of the same "
            "label add up (sequential composition). ε is the largest per-label sum.",
        ]
    return [
        _epsilon_line(run),
        "",
        f"Feature randomiser: {run.access.mechanism}; public bounds: {run.access.bounds}. "
        "Each record is randomised once and independently, so the guarantee is per record and "
        "does not depend on the number of records.",
    ]


def render_access_report(run: AccessRun, findings: tuple[Finding, ...]) -> str:
    """The report card as Markdown."""
    results = [f"- test accuracy: {run.accuracy:.4f}" if run.accuracy is not None else "- none"]
    if run.baseline_accuracy is not None:
        baseline = run.baseline_accuracy
        results.append(f"- non-private baseline (same model, true data): {baseline:.4f}")
    unit = "example’s label" if run.access.model == "label" else "record"
    bodies = (
        [access_statement(run.access)],
        [f"Released: {_RELEASED[run.access.model]}."],
        [
            f"Unit: one {unit}; {_RELATION[run.access.model]}. ε under different relations is "
            "not comparable."
        ],
        _accounting_lines(run),
        [f"{run.dataset}: {run.train_size} training examples ({run.dataset_source})."],
        results,
        findings_lines(findings),
    )
    return render_card(f"{run.dataset}, {run.model}", bodies)


def write_access_report(run: AccessRun, findings: tuple[Finding, ...], run_dir: Path) -> Path:
    """Write ``report.md`` and ``report.json`` (the run and its findings) into ``run_dir``."""
    document = {**run.to_dict(), "pitfalls": [f.to_dict() for f in findings]}
    return write_card(run_dir, document, render_access_report(run, findings))
