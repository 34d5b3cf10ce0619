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
from dpfy.report.diagnostics import write_baseline_diagnostics
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
    """The report card as Markdown: released and public facts only (released facts only).

    The test accuracy of the released model is stated; a non-private baseline, trained without
    noise on the true private data, is not released by the mechanism and is kept in
    ``diagnostics.md`` (:func:`write_access_report`), which the card names without its value.
    """
    results = [f"- test accuracy: {run.accuracy:.4f}" if run.accuracy is not None else "- none"]
    results += ["", f"*{_DIAGNOSTICS}*"]
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


_DIAGNOSTICS = (
    "Un-noised diagnostics of the private data (any non-private baseline) are kept in "
    "diagnostics.md beside this card; they are outside the DP guarantee and not part of it."
)


def write_access_report(run: AccessRun, findings: tuple[Finding, ...], run_dir: Path) -> Path:
    """Write ``report.md`` and ``report.json`` (the run and its findings) into ``run_dir``.

    The non-private baseline's accuracy goes to ``diagnostics.md`` / ``diagnostics.json``
    instead, marked not for publication.
    """
    published = {k: v for k, v in run.to_dict().items() if k != "baseline_accuracy"}
    document = {**published, "pitfalls": [f.to_dict() for f in findings]}
    write_baseline_diagnostics(
        run_dir, f"{run.dataset}, {run.model}", run.baseline_accuracy, "the test split"
    )
    return write_card(run_dir, document, render_access_report(run, findings))
