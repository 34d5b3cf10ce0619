"""Every long step shows how far it is and an estimate of the time left; the non-private
baseline's bar never shows an ε (it has none)."""

from __future__ import annotations

import io
import math

from rich.console import Console

from dpfy.jobs.progress_bars import baseline_progress, step_progress, work_progress


def rendered(make, **fields) -> str:
    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    with make(console) as progress:
        task = progress.add_task("work", total=10, **fields)
        progress.update(task, advance=4)
    return console.file.getvalue()


def test_the_private_bar_shows_its_fields_and_an_estimate():
    text = rendered(lambda c: step_progress(c, "ε {task.fields[eps]:.3f}"), eps=1.5)
    assert "4/10" in text and "ε 1.500" in text and "eta" in text


def test_the_baseline_bar_says_not_private_and_shows_no_epsilon():
    text = rendered(baseline_progress, loss=math.nan)
    assert "not private" in text and "ε" not in text and "eta" in text


def test_preparation_work_shows_an_estimate():
    assert "eta" in rendered(work_progress)
