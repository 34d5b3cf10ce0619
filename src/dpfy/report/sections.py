"""What a report-card section is, and how its figures are written for people.

A section is a JSON key, a Markdown heading, a builder (facts, pitfall findings and the run's
wording → JSON-ready data) and a renderer (that data → Markdown lines), so the Markdown is
rendered from the same JSON the card exports and the two never disagree. Every section states
only what the mechanism released and public facts; the un-noised diagnostics of the private
data are :mod:`~dpfy.report.diagnostics`'s. The sections of the §5.3.3 list live in
:mod:`~dpfy.report.setting_sections`, :mod:`~dpfy.report.accounting_sections` and
:mod:`~dpfy.report.run_sections`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dpfy.report.facts import RunFacts
    from dpfy.report.pitfalls import Finding
    from dpfy.report.wording import Wording

SectionBuilder = Callable[["RunFacts", "tuple[Finding, ...]", "Wording"], Any]
SectionRenderer = Callable[[Any], list[str]]


@dataclass(frozen=True)
class Section:
    """One report section: its JSON key, its Markdown heading, and how to build and render it."""

    key: str
    title: str
    build: SectionBuilder
    render: SectionRenderer


def section(key: str, title: str, render: SectionRenderer) -> Callable[[SectionBuilder], Section]:
    """Declare a section by its builder; the decorated name becomes the :class:`Section`."""

    def declare(build: SectionBuilder) -> Section:
        return Section(key, title, build, render)

    return declare


def show_epsilon(value: Any) -> str:
    """An ε for people: 4 significant digits, ∞ when unbounded, — when absent."""
    if value is None:
        return "—"
    value = float(value)
    if math.isinf(value):
        return "∞"
    return f"{value:.4g}"


def show_value(value: Any) -> str:
    """A number or fact for a table cell."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def paragraph(data: dict[str, Any]) -> list[str]:
    """Render a section that is one statement."""
    return [data["statement"]]


__all__ = [
    "Section",
    "SectionBuilder",
    "SectionRenderer",
    "paragraph",
    "section",
    "show_epsilon",
    "show_value",
]
