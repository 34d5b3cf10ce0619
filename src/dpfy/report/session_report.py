"""The report card of a user's own training loop: ``private.report(out_dir)``.

It is the report ``dpfy train`` writes (guide §5.3.3), collected from the live session: the
ledger, the plan and the model say what happened; the caller adds what only the caller knows
(the dataset's name and source, its preprocessing, the accuracy it measured, its history).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dpfy.report.facts import ResultFacts, collect_facts
from dpfy.report.render import write_report
from dpfy.train.session import PrivateTraining

#: Files whose presence means ``out_dir`` already holds a report: never overwritten silently.
_REPORT_FILES = ("facts.json", "report.md", "report.json", "diagnostics.md", "diagnostics.json")


def write_session_report(
    training: PrivateTraining,
    out_dir: str | os.PathLike[str],
    *,
    dataset: str | None = None,
    dataset_source: str = "",
    model: str | None = None,
    preprocessing: Any = (),
    accuracy: float | None = None,
    baseline_accuracy: float | None = None,
    history: Sequence[Mapping[str, Any]] | None = None,
    sequence_task: bool | None = None,
    loss_normalisation: str | None = None,
    overwrite: bool = False,
    plots: bool = True,
) -> dict[str, Path]:
    """Write report.md, report.json, facts.json, the diagnostics and the plots into ``out_dir``.

    ``report.md`` / ``report.json`` are the card to publish; ``baseline_accuracy`` (a model
    trained without noise on the private data) goes to ``diagnostics.md`` / ``diagnostics.json``
    with the other un-noised statistics of the private data, which are not for publication.

    Names default to the dataset's and model's classes. ``sequence_task`` and
    ``loss_normalisation`` (how each example's loss combines its tokens, e.g. 'per-token-mean')
    default to what the engine saw: a Hugging Face token-level head makes a sequence task, and
    its loss is 'per-token-mean' when every forward computed it from labels (dpfy made it so).
    A directory that already holds a
    report is refused unless ``overwrite=True``, so no earlier run's report is lost.
    """
    target = Path(out_dir)
    existing = [name for name in _REPORT_FILES if (target / name).exists()]
    if existing and not overwrite:
        raise ValueError(
            f"{target} already holds a report ({', '.join(existing)}); pass another directory, "
            "or overwrite=True to replace it"
        )
    guard = training.engine.loss_guard
    facts = collect_facts(
        training,
        dataset_name=dataset or type(training.loader.dataset).__name__,
        model_name=model or type(training.model).__name__,
        dataset_source=dataset_source,
        preprocessing=preprocessing,
        results=ResultFacts(accuracy=accuracy, baseline_accuracy=baseline_accuracy),
        sequence_task=guard.token_heads if sequence_task is None else sequence_task,
        loss_normalisation=loss_normalisation or guard.loss_normalisation,
    )
    return write_report(facts, target, history=history, plots=plots)


__all__ = ["write_session_report"]
