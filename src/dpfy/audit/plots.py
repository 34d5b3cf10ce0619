"""The audit's pictures: score distributions in and out, and the attack's ROC curve.

A number such as ε̂ hides how it arose; the histograms show how far apart the two score
distributions are and the ROC (log axes) shows the low-FPR region where an attack breaches
privacy. Drawn on matplotlib's Agg canvas directly — no global backend switch, no display.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dpfy.audit.membership import RocCurve, roc_curve
from dpfy.audit.result import AuditResult

_DPI = 120
#: The lowest FPR drawn on the log-scaled ROC (an attack's rates are at least 1/n anyway).
_FLOOR = 1e-4


def plot_score_histograms(
    scores_in: np.ndarray,
    scores_out: np.ndarray,
    path: str | os.PathLike[str],
    *,
    title: str = "Attack scores",
) -> Path:
    """Overlaid histograms (shared bins, densities) of the scores with and without the canary."""
    scores_in, scores_out = np.asarray(scores_in, float), np.asarray(scores_out, float)
    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    bins = np.histogram_bin_edges(np.concatenate([scores_in, scores_out]), bins=40)
    axes.hist(scores_out, bins=bins, density=True, alpha=0.55, label=f"out (n={scores_out.size})")
    axes.hist(scores_in, bins=bins, density=True, alpha=0.55, label=f"in (n={scores_in.size})")
    axes.set_xlabel("score (higher: more likely in)")
    axes.set_ylabel("density")
    axes.set_title(title)
    axes.legend()
    return _save(figure, path)


def plot_roc(curve: RocCurve, path: str | os.PathLike[str], *, title: str = "ROC") -> Path:
    """The ROC on log–log axes with the chance diagonal, AUC in the legend."""
    figure = Figure(figsize=(5, 5))
    axes = figure.subplots()
    fpr, tpr = np.maximum(curve.fpr, _FLOOR), np.maximum(curve.tpr, _FLOOR)
    axes.plot(fpr, tpr, label=f"attack (AUC {curve.auc:.3f})")
    axes.plot([_FLOOR, 1], [_FLOOR, 1], linestyle="--", color="grey", label="chance")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlim(_FLOOR, 1)
    axes.set_ylim(_FLOOR, 1)
    axes.set_xlabel("false-positive rate")
    axes.set_ylabel("true-positive rate")
    axes.set_title(title)
    axes.legend(loc="lower right")
    return _save(figure, path)


def audit_title(name: str, result: AuditResult | None = None) -> str:
    """A plot's title: the audit's name, and with its result ε̂ beside the claim it tested.

    The claim is the ε of what the audit itself ran (a step, an epoch, a re-run), not the run's
    whole ε, so the title says so; a picture read alone must not suggest another comparison.
    """
    if result is None:
        return name
    claim = (
        "claim unknown"
        if result.claimed_epsilon is None
        else f"claimed ε = {result.claimed_epsilon:.3g} (this audit's run)"
    )
    return (
        f"{name}\nε̂ = {result.epsilon_lower_bound:.3g} at {result.confidence:.0%} confidence "
        f"· {claim}"
    )


def write_audit_plots(
    scores_in: np.ndarray,
    scores_out: np.ndarray,
    run_dir: str | os.PathLike[str],
    name: str,
    *,
    roc: bool = True,
    result: AuditResult | None = None,
) -> dict[str, Path]:
    """The plots of one audit into ``run_dir`` as ``audit-NAME-scores.png`` / ``-roc.png``.

    ``roc=False`` leaves the ROC out, for an audit whose guesses are no threshold attack;
    ``result`` puts its ε̂ and the claim it tested into the titles.
    """
    directory = Path(run_dir)
    paths = {
        "scores": plot_score_histograms(
            scores_in,
            scores_out,
            directory / f"audit-{name}-scores.png",
            title=audit_title(f"{name} scores", result),
        )
    }
    if roc:
        paths["roc"] = plot_roc(
            roc_curve(scores_in, scores_out),
            directory / f"audit-{name}-roc.png",
            title=audit_title(name, result),
        )
    return paths


def _save(figure: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``figure`` as a PNG, creating the directory."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.savefig(target, format="png", dpi=_DPI)
    return target


__all__ = ["audit_title", "plot_roc", "plot_score_histograms", "write_audit_plots"]
