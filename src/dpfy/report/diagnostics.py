"""A run's un-noised diagnostics of its private data: ``diagnostics.md`` / ``diagnostics.json``.

The card (:mod:`dpfy.report.card`) is what a user publishes, so it holds only what the
mechanism released and public facts (released facts only). Everything else a run measured goes here,
in a file whose first line says it must not be published. How each figure a run records is
classified:

- **Released or public — on the card.** The model (post-processing of the DP outputs); (ε, δ)
  from the ledger and the ε curve (``epsilon.png``); the plan (N, q, B, σ, C, δ, steps, sampler)
  and the other hyperparameters; tuning's trials run, method, accounted ε, chosen values and grid
  edges (the choice is the tuning mechanism's output); declared facts (dataset name, size,
  source, preprocessing, what is released, the unit, public inputs); the model's parameter counts
  and frozen or unnoised parts; software versions; the released model's held-out test accuracy
  (``training.png`` draws it with ε spent); ``dpfy audit``'s ε̂; the pitfalls found from these.
- **Un-noised diagnostics of the private data — here.** Per-example gradient norms before
  clipping (count, quantiles, mean, maximum, fraction clipped: one record moves the maximum);
  the clip-norm check that reads them (its finding is itself such a statistic); the non-private
  baseline's accuracy (a model trained without noise on the private data); loss and accuracy on
  private training batches (``history.json``'s ``loss`` and ``train_accuracy``, drawn in
  ``diagnostics.png``).

The held-out test accuracy is published by custom: the model is released, and the test split is
not the training data the guarantee protects (nor does the guarantee cover it: a test split that
is itself private needs its own accounting). ``facts.json`` is the run's own record, holding both
kinds, and is not published either; the card and this file are both rendered from it, so ``dpfy
report RUN_DIR`` (and ``--diagnostics``) re-renders each alone.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dpfy._safe_io import atomic_write_text
from dpfy.report.facts import RunFacts
from dpfy.report.json_codec import json_safe
from dpfy.report.pitfalls import diagnostic_pitfalls
from dpfy.report.sections import show_value
from dpfy.report.wording import wording_for

DIAGNOSTICS_FORMAT = "dpfy.diagnostics"
DIAGNOSTICS_VERSION = 1
DIAGNOSTICS_MARKDOWN = "diagnostics.md"
DIAGNOSTICS_JSON = "diagnostics.json"
DIAGNOSTICS_PLOT = "diagnostics.png"

#: The first line of the diagnostics file: that it must not be published, what it holds and why.
NOT_FOR_PUBLICATION = (
    "NOT FOR PUBLICATION: un-noised statistics of the private training data (gradient norms, a "
    "non-private baseline, measurements on private batches), computed without noise and outside "
    "the DP guarantee; keep this file with the private data. The card to publish is report.md."
)

_HISTORY = (
    "history.json's `loss` and `train_accuracy` fields are measured on private training batches "
    "without noise, and diagnostics.png draws them (with any non-private baseline): both belong "
    "with this file, not with the card; training.png draws only the released test accuracy and ε."
)


def diagnostics_document(facts: RunFacts) -> dict[str, Any]:
    """The JSON object ``diagnostics.json`` holds; its first key is the not-for-publication line.

    ``accuracy`` is the released model's (the card's own figure), repeated here beside the
    baseline for comparison; everything else is an un-noised statistic of the private data.
    """
    r, g = facts.results, facts.grad_norms
    words = wording_for(facts.privacy)
    return json_safe(
        {
            "not_for_publication": NOT_FOR_PUBLICATION,
            "format": DIAGNOSTICS_FORMAT,
            "version": DIAGNOSTICS_VERSION,
            "title": f"Diagnostics (not for publication): {facts.model.name} on "
            f"{facts.dataset.name}",
            "accuracy": r.accuracy,
            "baseline_accuracy": r.baseline_accuracy,
            "evaluated_on": r.evaluated_on,
            "clipped": f"per-{facts.privacy.clipping_unit} {words.algorithm.clipped}",
            "grad_norms": None if g is None else asdict(g),
            "pitfalls": [f.to_dict() for f in diagnostic_pitfalls(facts)],
            "history": _HISTORY,
        }
    )


def _norm_lines(data: dict[str, Any]) -> list[str]:
    """The gradient-norm statistics in one bullet."""
    norms, clipped = data["grad_norms"], data["clipped"]
    if norms is None:
        return [f"- {clipped} norms: not collected"]
    return [
        f"- {clipped} norms before clipping ({norms['count']} values): median "
        f"{norms['median']:.4g}, 10–90% [{norms['p10']:.4g}, {norms['p90']:.4g}], mean "
        f"{norms['mean']:.4g}, max {norms['maximum']:.4g}; {norms['fraction_clipped']:.1%} "
        f"clipped at C = {norms['max_grad_norm']:g}"
    ]


def diagnostics_markdown(data: dict[str, Any]) -> str:
    """``diagnostics.md`` from :func:`diagnostics_document`'s object: the warning comes first."""
    on = f" on {data['evaluated_on']}" if data["evaluated_on"] else ""
    lines = [
        f"**{data['not_for_publication']}**",
        "",
        f"# {data['title']}",
        "",
        f"- accuracy of the released private model{on}: {show_value(data['accuracy'])} (the "
        "card's figure, repeated for comparison)",
        f"- accuracy of the non-private baseline{on}: {show_value(data['baseline_accuracy'])} "
        "(a model trained without noise on the private data)",
        *_norm_lines(data),
        "",
        "## Checks that read these figures",
        "",
    ]
    findings = data["pitfalls"]
    if not findings:
        lines.append("None found.")
    for f in findings:
        lines += [
            f"- **[{f['severity'].upper()}] {f['title']}** (`{f['code']}`, guide "
            f"{f['guide_section']})",
            f"  - Evidence: {f['evidence']}",
            f"  - Fix: {f['fix']}",
        ]
    lines += ["", "## Training history", "", data["history"]]
    return "\n".join(lines) + "\n"


def write_baseline_diagnostics(
    run_dir: Path, title: str, baseline_accuracy: float | None, evaluated_on: str
) -> Path:
    """``diagnostics.md`` / ``.json`` of a run whose only un-noised diagnostic is a baseline.

    The access-model runs (label-only, input-level) have no gradient norms; their non-private
    baseline, trained on the true private data, goes here rather than on their card.
    """
    data = {
        "not_for_publication": NOT_FOR_PUBLICATION,
        "format": DIAGNOSTICS_FORMAT,
        "version": DIAGNOSTICS_VERSION,
        "title": f"Diagnostics (not for publication): {title}",
        "baseline_accuracy": baseline_accuracy,
        "evaluated_on": evaluated_on,
    }
    atomic_write_text(run_dir / DIAGNOSTICS_JSON, json.dumps(data, indent=2) + "\n")
    lines = [
        f"**{NOT_FOR_PUBLICATION}**",
        "",
        f"# {data['title']}",
        "",
        f"- accuracy of the non-private baseline on {evaluated_on}: "
        f"{show_value(baseline_accuracy)} (the same model trained on the true private data)",
    ]
    target = run_dir / DIAGNOSTICS_MARKDOWN
    atomic_write_text(target, "\n".join(lines) + "\n")
    return target


def render_diagnostics(facts: RunFacts, fmt: str = "md") -> str:
    """The diagnostics of ``facts`` as Markdown ('md') or indented JSON ('json') text."""
    data = diagnostics_document(facts)
    if fmt == "md":
        return diagnostics_markdown(data)
    if fmt == "json":
        return json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    raise ValueError(f"format must be one of md, json; got {fmt!r}")


__all__ = [
    "DIAGNOSTICS_FORMAT",
    "DIAGNOSTICS_JSON",
    "DIAGNOSTICS_MARKDOWN",
    "DIAGNOSTICS_PLOT",
    "DIAGNOSTICS_VERSION",
    "NOT_FOR_PUBLICATION",
    "diagnostics_document",
    "diagnostics_markdown",
    "render_diagnostics",
    "write_baseline_diagnostics",
]
