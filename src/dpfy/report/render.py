"""The report card as text and files: Markdown or JSON, and a run directory that renders again.

:func:`write_report` writes ``facts.json`` beside ``report.md``, ``report.json`` and the PNG
plots; :func:`render_run` (what ``dpfy report RUN_DIR`` prints) re-renders from the facts file
alone. A re-rendered report recomputes ε from the stored events and never trusts a stored
number, so an edited file is refused, not printed. The card itself is :mod:`dpfy.report.card`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpfy.report.card import REPORT_FORMAT, REPORT_VERSION, SECTIONS, ReportCard, build_report
from dpfy.report.facts import RunFacts
from dpfy.report.sections import Section

FACTS_FILE = "facts.json"
REPORT_MARKDOWN = "report.md"
REPORT_JSON = "report.json"
EPSILON_PLOT = "epsilon.png"
TRAINING_PLOT = "training.png"

FORMATS: dict[str, Callable[[ReportCard], str]] = {
    "md": lambda card: card.to_markdown(),
    "json": lambda card: (
        json.dumps(card.to_json(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    ),
}


def render(facts: RunFacts, fmt: str = "md") -> str:
    """The report of ``facts`` as Markdown ('md') or indented JSON ('json') text."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    return FORMATS[fmt](build_report(facts))


def render_run(run_dir: str | os.PathLike[str], fmt: str = "md") -> str:
    """Re-render the report of a saved run from its facts file (what ``dpfy report`` prints).

    A re-rendered report recomputes ε from the stored events and never trusts a stored number:
    :meth:`RunFacts.load` rebuilds the ledger and refuses, with one ValueError naming the file,
    the field and the fix, any file whose figures the recomputation does not bear out.
    """
    return render(RunFacts.load(Path(run_dir) / FACTS_FILE), fmt)


def write_report(
    facts: RunFacts,
    run_dir: str | os.PathLike[str],
    *,
    history: Sequence[Mapping[str, Any]] | None = None,
    plots: bool = True,
) -> dict[str, Path]:
    """Write the facts, report.md, report.json and the PNG plots into ``run_dir``.

    Returns the written paths by name. The training plot needs the trainer's ``history``; it
    draws the facts' non-private baseline accuracy, when the trainer ran one, as a reference.
    """
    target = Path(run_dir)
    target.mkdir(parents=True, exist_ok=True)
    written = {"facts": facts.save(target / FACTS_FILE)}
    for name, (fmt, filename) in {
        "markdown": ("md", REPORT_MARKDOWN),
        "json": ("json", REPORT_JSON),
    }.items():
        written[name] = target / filename
        written[name].write_text(render(facts, fmt), encoding="utf-8")
    if plots:
        from dpfy.report.plots import plot_epsilon_curve
        from dpfy.report.training_plot import plot_training_curves

        if facts.accounting.summary.steps:
            written["epsilon_plot"] = target / EPSILON_PLOT
            plot_epsilon_curve(facts, written["epsilon_plot"])
        if history:
            written["training_plot"] = target / TRAINING_PLOT
            baseline = facts.results.baseline_accuracy
            plot_training_curves(history, written["training_plot"], baseline_accuracy=baseline)
    return written


__all__ = [
    "EPSILON_PLOT",
    "FACTS_FILE",
    "FORMATS",
    "REPORT_FORMAT",
    "REPORT_JSON",
    "REPORT_MARKDOWN",
    "REPORT_VERSION",
    "SECTIONS",
    "TRAINING_PLOT",
    "ReportCard",
    "Section",
    "build_report",
    "render",
    "render_run",
    "write_report",
]
