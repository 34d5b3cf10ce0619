"""The report card as text and files: Markdown or JSON, and a run directory that renders again.

:func:`write_report` writes ``facts.json`` (the run's own record) beside the card meant for
publication (``report.md``, ``report.json``, ``epsilon.png``, ``training.png``) and the run's
un-noised diagnostics of the private data, marked not for publication (``diagnostics.md``,
``diagnostics.json``, ``diagnostics.png``; released facts only). :func:`render_run` (what ``dpfy
report RUN_DIR`` prints) re-renders either from the facts file alone. A re-rendered report
recomputes ε from the stored events and never trusts a stored number, so an edited file is
refused, not printed. The card itself is :mod:`dpfy.report.card`; the diagnostics
:mod:`dpfy.report.diagnostics`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpfy._safe_io import atomic_write_text
from dpfy.report.card import REPORT_FORMAT, REPORT_VERSION, SECTIONS, ReportCard, build_report
from dpfy.report.diagnostics import (
    DIAGNOSTICS_JSON,
    DIAGNOSTICS_MARKDOWN,
    DIAGNOSTICS_PLOT,
    render_diagnostics,
)
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


def step_axis(facts: RunFacts) -> str | None:
    """What one step of the run is called on a plot's axis when it is not a gradient step: the
    variant's own word ("rounds" for DP-FedAvg), so a federated plot does not count rounds as
    steps; None for gradient steps (the plots' default axis)."""
    from dpfy.plan.variants import variant_for

    try:
        steps = variant_for(facts.privacy.algorithm, facts.privacy.unit).text.steps
    except ValueError:
        return None
    word = steps.removeprefix("noised ")
    return None if word.endswith("gradient steps") else word


def render(facts: RunFacts, fmt: str = "md") -> str:
    """The report of ``facts`` as Markdown ('md') or indented JSON ('json') text."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    return FORMATS[fmt](build_report(facts))


def render_run(
    run_dir: str | os.PathLike[str], fmt: str = "md", *, diagnostics: bool = False
) -> str:
    """Re-render the report of a saved run from its facts file (what ``dpfy report`` prints).

    ``diagnostics=True`` renders the run's diagnostics file instead of its card: un-noised
    statistics of the private data, not for publication. A re-rendered report recomputes ε from
    the stored events and never trusts a stored number: :meth:`RunFacts.load` rebuilds the ledger
    and refuses, with one ValueError naming the file, the field and the fix, any file whose
    figures the recomputation does not bear out.
    """
    facts = RunFacts.load(Path(run_dir) / FACTS_FILE)
    if diagnostics:
        return render_diagnostics(facts, fmt)
    return render(facts, fmt)


def write_report(
    facts: RunFacts,
    run_dir: str | os.PathLike[str],
    *,
    history: Sequence[Mapping[str, Any]] | None = None,
    plots: bool = True,
) -> dict[str, Path]:
    """Write the facts, the card and its plots, and the diagnostics into ``run_dir``.

    The card meant for publication is ``report.md``, ``report.json``, ``epsilon.png`` and, with
    the trainer's ``history``, ``training.png`` (released test metrics and ε only). The
    diagnostics, not for publication, are ``diagnostics.md``, ``diagnostics.json`` and, with a
    history, ``diagnostics.png`` (the curves on the private training data, and the facts'
    non-private baseline accuracy when the trainer ran one). Returns the written paths by name.
    """
    target = Path(run_dir)
    target.mkdir(parents=True, exist_ok=True)
    written = {"facts": facts.save(target / FACTS_FILE)}
    for name, filename, text in (
        ("markdown", REPORT_MARKDOWN, render(facts, "md")),
        ("json", REPORT_JSON, render(facts, "json")),
        ("diagnostics_markdown", DIAGNOSTICS_MARKDOWN, render_diagnostics(facts, "md")),
        ("diagnostics_json", DIAGNOSTICS_JSON, render_diagnostics(facts, "json")),
    ):
        written[name] = target / filename
        atomic_write_text(written[name], text)
    if plots:
        from dpfy.report.plots import plot_epsilon_curve
        from dpfy.report.training_plot import plot_training_curves

        if facts.accounting.summary.steps:
            written["epsilon_plot"] = target / EPSILON_PLOT
            plot_epsilon_curve(facts, written["epsilon_plot"])
        if history:
            axis = step_axis(facts)
            named = {} if axis is None else {"step_name": axis}
            written["training_plot"] = target / TRAINING_PLOT
            plot_training_curves(history, written["training_plot"], private_curves=False, **named)
            written["diagnostics_plot"] = target / DIAGNOSTICS_PLOT
            baseline = facts.results.baseline_accuracy
            plot_training_curves(
                history, written["diagnostics_plot"], baseline_accuracy=baseline, **named
            )
    return written


__all__ = [
    "DIAGNOSTICS_JSON",
    "DIAGNOSTICS_MARKDOWN",
    "DIAGNOSTICS_PLOT",
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
