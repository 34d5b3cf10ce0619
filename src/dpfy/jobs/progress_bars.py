"""The jobs' progress bars: every step that can take more than a few seconds shows how far it
is and an estimate of the time left (a newcomer should never stare at a silent terminal)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["baseline_progress", "step_progress", "work_progress"]


def _bar(console: Console, *middle: ProgressColumn) -> Progress:
    """Description, bar, done/total, ``middle``, elapsed time and the estimate of what is left."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        *middle,
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def step_progress(console: Console, fields: str) -> Progress:
    """A private run's bar; ``fields`` formats the task's fields (loss, accuracy, ε so far)."""
    return _bar(console, TextColumn(fields))


def baseline_progress(console: Console) -> Progress:
    """The non-private baseline's bar: its loss only (no ε: it is not private)."""
    return _bar(console, TextColumn("loss {task.fields[loss]:.3f}  (not private)"))


def work_progress(console: Console) -> Progress:
    """A bar for preparation work counted in items (e.g. examples through a frozen encoder)."""
    return _bar(console)
