"""The privacy report of a prediction-level run: only the answers are protected (guide §3.2).

A served ensemble releases answers, never a model, so its card says what is released and what is
not, and accounts the answers: ε after the queries asked, the budget, and how many more fit.
The items follow the other cards' order (guide §5.3.3): setting, release, unit and relation,
accounting, data, results, pitfalls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpfy.report.access_card_layout import findings_lines, render_card, write_card
from dpfy.report.access_facts import AccessFacts, access_statement
from dpfy.report.pitfalls import Finding

__all__ = ["PredictionRun", "render_prediction_report", "write_prediction_report"]


@dataclass(frozen=True)
class PredictionRun:
    """What a prediction-level run did, in plain data (its report and JSON)."""

    access: AccessFacts
    dataset: str
    dataset_source: str
    train_size: int
    model: str
    teachers: int
    aggregator: dict[str, Any]
    accountant: str
    budget_epsilon: float
    queries_offered: int
    queries_asked: int
    queries_answered: int
    capacity: int
    answered_accuracy: float | None
    refused: str | None = None
    relation: str = "add-or-remove"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON."""
        return dataclasses.asdict(self)


def _mechanism_line(aggregator: dict[str, Any]) -> str:
    """The aggregator and its per-query event, in words."""
    sigma = aggregator["noise_multiplier"]
    if aggregator["kind"] == "gnmax":
        return (
            f"GNMax: Gaussian noise of std σ = {sigma:g} on each class's vote count, then the "
            f"argmax; one record changes one teacher's vote, an L2 change of √2, so each answer "
            f"is a Gaussian mechanism of noise multiplier σ/√2 = {sigma / 2**0.5:.4g}."
        )
    return (
        f"Confident-GNMax: a query is answered only when its top vote count plus N(0, σ₁²), "
        f"σ₁ = {aggregator['threshold_noise']:g}, reaches {aggregator['threshold']:g} (a Gaussian "
        f"on a count of sensitivity 1); answers use GNMax with σ₂ = {sigma:g}. Every query is "
        "charged both, answered or not."
    )


def _accounting_lines(run: PredictionRun) -> list[str]:
    """The composition the ε follows from, the budget and what is left of it."""
    lines = [
        f"ε = {run.access.epsilon:.4g} at δ = {run.access.delta:g} after {run.queries_asked} "
        f"queries (budget ε = {run.budget_epsilon:g}; {run.capacity} queries fit in it, "
        f"{run.capacity - run.queries_asked} are left).",
        "",
        _mechanism_line(run.aggregator),
        f"The queries compose sequentially ({run.accountant.upper()} accountant). Each query was "
        "accounted before it was answered, and a request past the budget is refused whole.",
        "",
        "The ε is data-independent: it depends on σ and the number of queries only, never on "
        "the votes. The data-dependent analysis of Papernot et al. (2018) is not used: its ε "
        "is itself a function of the private votes, and releasing it soundly needs a further "
        "private (smooth-sensitivity) step.",
    ]
    if run.refused:
        lines += ["", f"Refused: {run.refused}"]
    return lines


def render_prediction_report(run: PredictionRun, findings: tuple[Finding, ...]) -> str:
    """The report card as Markdown."""
    accuracy = (
        f"- accuracy of the answered queries: {run.answered_accuracy:.4f}"
        if run.answered_accuracy is not None
        else "- no query was answered"
    )
    bodies = (
        [access_statement(run.access)],
        [
            "Released: only the answers to the queries (one noisy-argmax label per query). The "
            "teachers are trained without noise and are not private: they are never released. "
            "`ensemble.pt` holds them for the server alone — keep it with the private data and "
            "never publish it."
        ],
        [
            f"Unit: one training record; relation {run.relation} (guide §2.1). Each record "
            "belongs to one teacher, by a hash of the record alone, so one record moves one "
            "teacher's vote (two under replace-one). The number of teachers and σ are set "
            "before training from the dataset size N alone, which is treated as public (as "
            "DP-SGD's sampling rate B/N is): a neighbouring dataset is served by the same number "
            "of teachers. If N itself is secret, fix the number of teachers in advance rather "
            "than deriving it. ε under different relations is not comparable."
        ],
        _accounting_lines(run),
        [
            f"{run.dataset}: {run.train_size} training examples ({run.dataset_source}), split "
            f"into {run.teachers} disjoint partitions, one per teacher."
        ],
        [
            f"- queries offered (the test split): {run.queries_offered}; answered: "
            f"{run.queries_answered} of {run.queries_asked} accounted",
            accuracy,
        ],
        findings_lines(findings),
    )
    return render_card(f"{run.dataset}, {run.teachers} × {run.model} teachers", bodies)


def write_prediction_report(
    run: PredictionRun, findings: tuple[Finding, ...], run_dir: Path
) -> Path:
    """Write ``report.md`` and ``report.json`` (the run and its findings) into ``run_dir``."""
    document = {**run.to_dict(), "pitfalls": [f.to_dict() for f in findings]}
    return write_card(run_dir, document, render_prediction_report(run, findings))
