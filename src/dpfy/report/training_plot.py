"""The training plots: accuracy and ε against steps, and the diagnostics beside them.

A run directory holds two. ``training.png``, beside the card, draws only released figures (the
held-out test metrics and ε spent, as :mod:`dpfy.report.history` classifies them:
``private_curves=False``). ``diagnostics.png``, beside the diagnostics file, draws everything:
the curves computed on the private training data (the running train loss and accuracy, labelled
as not private in the legend and the title) and the non-private baseline's test accuracy, when
the trainer ran one, as a horizontal reference line. Legends sit outside the axes, below the
plots, so no label ever covers a curve.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure

from dpfy.report.history import NOT_PRIVATE_TAG, is_released, series_label
from dpfy.report.plots import save_png

BASELINE_LABEL = "non-private baseline"
#: The x axis of a run whose steps are gradient steps; a federated run's are "rounds".
STEPS = "training steps"


@dataclass(frozen=True)
class TrainingCurves:
    """The series :func:`plot_training_curves` drew, keyed by history field, and the baseline."""

    steps: tuple[int, ...]
    series: dict[str, tuple[tuple[int, float], ...]]
    labels: dict[str, str]
    baseline_accuracy: float | None = None


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[tuple[int, float], ...]:
    """(step, value) for every history row that has a finite ``key``."""
    points = []
    for row in history:
        value = row.get(key)
        if value is not None and math.isfinite(float(value)):
            points.append((int(row["step"]), float(value)))
    return tuple(points)


def _check(history: Sequence[Mapping[str, Any]], baseline_accuracy: float | None) -> None:
    """Refuse a history without steps, or a baseline accuracy outside [0, 1]."""
    if not history or any("step" not in row for row in history):
        raise ValueError("history must be a non-empty list of dicts, each with a 'step'")
    if baseline_accuracy is not None and not 0.0 <= baseline_accuracy <= 1.0:
        raise ValueError(
            f"baseline_accuracy must be an accuracy in [0, 1], got {baseline_accuracy!r}"
        )


def training_figure(
    history: Sequence[Mapping[str, Any]],
    *,
    baseline_accuracy: float | None = None,
    private_curves: bool = True,
    step_name: str = STEPS,
) -> tuple[Figure, TrainingCurves]:
    """Loss and accuracy (ε on a secondary axis, the baseline as a line) against steps.

    ``history`` is the trainer's list of dicts, each with ``step`` and any of ``loss``, keys
    containing ``accuracy`` (e.g. ``train_accuracy``, ``test_accuracy``), ``epsilon`` and
    ``epoch``; rows may carry only some of them. ``private_curves=False`` draws only released
    fields (the plot beside the card): no curve measured on the private data and no baseline,
    and the loss panel only if a released loss (e.g. ``test_loss``) was recorded. A history
    without any loss (a federated run records none) gets no loss panel: never an empty half.
    ``step_name`` labels the x axis (e.g. "rounds").
    """
    _check(history, baseline_accuracy)
    if not private_curves and baseline_accuracy is not None:
        raise ValueError(
            "a non-private baseline is an un-noised diagnostic of the private data: draw it "
            "with private_curves=True (diagnostics.png), never on the published plot"
        )
    keys = sorted({k for row in history for k in row if "loss" in k or "accuracy" in k})
    if not private_curves:
        keys = [k for k in keys if is_released(k)]
    series = {k: _series(history, k) for k in [*keys, "epsilon"]}
    labels = {k: series_label(k) for k in keys}
    losses = [k for k in keys if "loss" in k and series[k]]
    colours = _colours(keys)
    figure = Figure(figsize=(7, 6.8 if losses else 4.6), layout="constrained")
    if losses:
        loss_axes, acc_axes = figure.subplots(2, 1, sharex=True)
        _draw(
            loss_axes, series, labels, losses, "train loss" if private_curves else "loss", colours
        )
    else:
        loss_axes = acc_axes = figure.subplots(1, 1)
    _draw(acc_axes, series, labels, [k for k in keys if "accuracy" in k], "accuracy", colours)
    if baseline_accuracy is not None:
        labels["baseline"] = f"{BASELINE_LABEL}: test accuracy {baseline_accuracy:.3g} (not DP)"
        acc_axes.axhline(baseline_accuracy, color="black", linestyle="--", label=labels["baseline"])
    if series["epsilon"]:
        eps_axes = acc_axes.twinx()
        steps, values = zip(*series["epsilon"], strict=True)
        eps_axes.plot(steps, values, color="tab:red", linestyle=":", label="ε spent")
        eps_axes.set_ylabel("ε spent", color="tab:red")
        eps_axes.set_ylim(bottom=0)
    _epoch_axis(loss_axes, history)
    acc_axes.set_xlabel(step_name)
    _legend(figure)
    title = _title(private_curves, keys, series, baseline_accuracy, step_name)
    figure.suptitle(title, fontsize=10)
    steps_drawn = tuple(int(row["step"]) for row in history)
    return figure, TrainingCurves(steps_drawn, series, labels, baseline_accuracy)


def _title(
    private_curves: bool,
    keys: Sequence[str],
    series: dict[str, Any],
    baseline: float | None,
    step_name: str = STEPS,
) -> str:
    """What the figure shows; a diagnostics figure with private curves says not to publish it."""
    against = f"against {step_name.removeprefix('training ')}"
    if not private_curves:
        return f"Private training: released test metrics and ε {against}"
    drawn = [k for k in keys if series[k]]
    shown = (
        " and ".join(name for name in ("loss", "accuracy") if any(name in k for k in drawn)) or "ε"
    )
    private = any(not is_released(k) for k in drawn) or baseline is not None
    if not private:
        return f"Private training: {shown} {against}"
    return (
        f"Diagnostics, NOT FOR PUBLICATION: {shown} {against}\n"
        f"curves marked ({NOT_PRIVATE_TAG}) and any baseline are outside the DP guarantee"
    )


def plot_training_curves(
    history: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    baseline_accuracy: float | None = None,
    private_curves: bool = True,
    step_name: str = STEPS,
) -> TrainingCurves:
    """Write :func:`training_figure` as a PNG to ``path``; return what was drawn."""
    figure, curves = training_figure(
        history,
        baseline_accuracy=baseline_accuracy,
        private_curves=private_curves,
        step_name=step_name,
    )
    save_png(figure, path)
    return curves


def _draw(
    axes: Any,
    series: dict[str, Any],
    labels: dict[str, str],
    keys: Sequence[str],
    ylabel: str,
    colours: dict[str, str],
) -> None:
    """Plot some series on one axes, or say there is nothing."""
    for key in keys:
        if series[key]:
            steps, values = zip(*series[key], strict=True)
            axes.plot(
                steps, values, marker=".", label=labels[key], color=colours[key],
                linestyle="-" if is_released(key) else "--",
            )  # fmt: skip
    if not any(series[k] for k in keys):
        axes.text(0.5, 0.5, f"no {ylabel} recorded", ha="center", transform=axes.transAxes)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)


#: One colour per curve, so that the shared legend tells every curve apart; red (ε) and black
#: (the baseline) are kept for those two. Released curves are solid, private ones dashed.
_COLOURS = {
    "test_accuracy": "tab:blue",
    "test_loss": "tab:purple",
    "train_accuracy": "tab:green",
    "loss": "tab:orange",
    "train_loss": "tab:orange",
}
_OTHER_COLOURS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def _colours(keys: Sequence[str]) -> dict[str, str]:
    """Each curve's own colour: the known fields theirs, the others the next unused one."""
    spare = iter(_OTHER_COLOURS * (1 + len(keys) // len(_OTHER_COLOURS)))
    return {key: _COLOURS.get(key) or next(spare) for key in keys}


def _legend(figure: Figure) -> None:
    """One legend for every labelled curve, outside the axes, below the plots."""
    handles, names = [], []
    for axes in figure.axes:
        for handle, name in zip(*axes.get_legend_handles_labels(), strict=True):
            handles.append(handle)
            names.append(name)
    if handles:
        figure.legend(handles, names, loc="outside lower center", ncols=2, fontsize=8)


def _epoch_axis(axes: Any, history: Sequence[Mapping[str, Any]]) -> None:
    """An epochs scale on top, when the history records epochs (epoch ∝ step)."""
    pairs = [(r["step"], r["epoch"]) for r in history if r.get("epoch") is not None and r["step"]]
    if not pairs:
        return
    step, epoch = pairs[-1]
    ratio = float(epoch) / float(step)
    if ratio <= 0:
        return
    top = axes.secondary_xaxis("top", functions=(lambda s: s * ratio, lambda e: e / ratio))
    top.set_xlabel("epochs")


__all__ = ["BASELINE_LABEL", "STEPS", "TrainingCurves", "plot_training_curves", "training_figure"]
