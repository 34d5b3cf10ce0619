"""Plots of a private run as PNG files: ε against steps, and loss/accuracy against steps.

The ε curve is recomputed from the ledger's recorded training steps with both accountants (PLD
tight, RDP looser, guide §4.2.2), at about 30 step counts; the returned :class:`EpsilonCurve`
holds exactly the numbers drawn, so tests and reports can check the picture against the
accountant. Figures are drawn on matplotlib's Agg canvas directly — no global backend switch, no
display needed.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dpfy.plan.accounting import UnsupportedEventError, make_accountant
from dpfy.plan.accounting.events import DpEvent
from dpfy.report.facts import RunFacts

CURVE_POINTS = 30
_DPI = 120


@dataclass(frozen=True)
class EpsilonCurve:
    """ε of the first k training steps at δ, for each k in ``steps`` (None: no bound)."""

    steps: tuple[int, ...]
    pld: tuple[float, ...] | None
    rdp: tuple[float, ...] | None
    delta: float
    relation: str
    accountant: str  # the run's own accountant, whose figure the report states
    assumptions_met: bool
    total_epsilon: float | None  # training and every labelled event, by the run's accountant


@dataclass(frozen=True)
class _TrainingRun:
    """A run of ``count`` identical training steps, as one event."""

    event: DpEvent
    count: int


def _ledger_state(source: Any) -> dict[str, Any]:
    """The ledger state from run facts, a ledger, or a state dict."""
    if isinstance(source, RunFacts):
        return source.accounting.ledger_state
    if hasattr(source, "state_dict") and hasattr(source, "epsilon_by_label"):
        return source.state_dict()
    if isinstance(source, Mapping):
        return dict(source)
    raise ValueError(
        f"expected RunFacts, a PrivacyLedger or a ledger state dict, got {type(source).__name__}"
    )


def _training_runs(state: dict[str, Any]) -> tuple[list[_TrainingRun], bool]:
    """The recorded training steps in order, and whether every one met its assumption."""
    from dpfy.plan.sampling import SamplingRecord

    runs, met = [], True
    for entry in state["entries"]:
        if "sampling" not in entry:
            continue
        record = SamplingRecord.from_dict(entry["sampling"])
        runs.append(_TrainingRun(record.event(entry["noise_multiplier"]), int(entry["count"])))
        met &= record.assumption_met
    return runs, met


def _prefix_counts(runs: Sequence[_TrainingRun], steps: int) -> dict[DpEvent, int]:
    """How often each distinct event ran in the first ``steps`` training steps."""
    counts: dict[DpEvent, int] = {}
    left = steps
    for run in runs:
        take = min(left, run.count)
        counts[run.event] = counts.get(run.event, 0) + take
        left -= take
        if left == 0:
            break
    return counts


def _curve(
    runs: Sequence[_TrainingRun], grid: Sequence[int], accountant: str, relation: str, delta: float
) -> tuple[float, ...] | None:
    """ε at every grid point under one accountant, or None if it cannot bound these events."""
    values = []
    for k in grid:
        tracker = make_accountant(accountant, relation)
        try:
            for event, count in _prefix_counts(runs, k).items():
                tracker.compose(event, count)
        except UnsupportedEventError:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a grid-edge RDP bound is loose, not unsound
            values.append(tracker.epsilon(delta))
    return tuple(values)


def epsilon_curve(source: Any, *, points: int = CURVE_POINTS) -> EpsilonCurve:
    """ε against training steps at the run's δ under PLD and RDP, at about ``points`` steps."""
    state = _ledger_state(source)
    runs, met = _training_runs(state)
    total_steps = sum(r.count for r in runs)
    if total_steps == 0:
        raise ValueError("the ledger holds no training step, so there is no ε curve to draw")
    grid = tuple(int(k) for k in np.unique(np.linspace(1, total_steps, points).round()))
    delta, relation = float(state["delta"]), str(state["relation"])
    total = None
    if isinstance(source, RunFacts):
        total = float(source.accounting.summary.total_epsilon)
    elif hasattr(source, "epsilon"):
        total = float(source.epsilon())
    return EpsilonCurve(
        steps=grid,
        pld=_curve(runs, grid, "pld", relation, delta),
        rdp=_curve(runs, grid, "rdp", relation, delta),
        delta=delta,
        relation=relation,
        accountant=str(state["accountant"]),
        assumptions_met=met,
        total_epsilon=total,
    )


def save_png(figure: Figure, path: str | os.PathLike[str]) -> Path:
    """Render a figure to PNG on the Agg canvas (every dpfy plot is written this way)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    figure.savefig(target, format="png", dpi=_DPI)
    return target


def plot_epsilon_curve(
    source: Any, path: str | os.PathLike[str], *, points: int = CURVE_POINTS
) -> EpsilonCurve:
    """Draw ε against steps (PLD and RDP, final point marked) to ``path``; return the curve."""
    curve = epsilon_curve(source, points=points)
    figure = Figure(figsize=(7, 4.5))
    axes = figure.add_subplot()
    for name, values, style in (("PLD", curve.pld, "-"), ("RDP", curve.rdp, "--")):
        if values is None:
            continue
        axes.plot(curve.steps, values, style, marker=".", label=f"{name} accountant")
        axes.plot(curve.steps[-1], values[-1], "o", markersize=9, color="black")
        axes.annotate(
            f"{name}: ε = {values[-1]:.3g} after {curve.steps[-1]} steps",
            (curve.steps[-1], values[-1]),
            textcoords="offset points",
            xytext=(-12, -14 if name == "PLD" else 6),
            ha="right",
            fontsize=8,
        )
    own = curve.pld if curve.accountant == "pld" else curve.rdp
    trained = own[-1] if own else math.inf
    if curve.total_epsilon is not None and curve.total_epsilon > trained * (1 + 1e-9):
        axes.axhline(
            curve.total_epsilon,
            color="grey",
            linestyle=":",
            label=f"total incl. tuning: ε = {curve.total_epsilon:.3g} ({curve.accountant.upper()})",
        )
    axes.set_xlabel("training steps")
    axes.set_ylabel(f"ε (at δ = {curve.delta:g})")
    axes.set_xlim(left=0)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    caveat = "" if curve.assumptions_met else "\nunder the Poisson assumption, which was NOT met"
    axes.set_title(f"Privacy spent by training ({curve.relation} adjacency){caveat}", fontsize=10)
    figure.tight_layout()
    save_png(figure, path)
    return curve


@dataclass(frozen=True)
class TrainingCurves:
    """The series :func:`plot_training_curves` drew, keyed by history field."""

    steps: tuple[int, ...]
    series: dict[str, tuple[tuple[int, float], ...]]


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[tuple[int, float], ...]:
    """(step, value) for every history row that has a finite ``key``."""
    points = []
    for row in history:
        value = row.get(key)
        if value is not None and math.isfinite(float(value)):
            points.append((int(row["step"]), float(value)))
    return tuple(points)


def plot_training_curves(
    history: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]
) -> TrainingCurves:
    """Draw loss and accuracy (and ε on a secondary axis) against steps to ``path``.

    ``history`` is the trainer's list of dicts, each with ``step`` and any of ``loss``, keys
    containing ``accuracy`` (e.g. ``train_accuracy``, ``test_accuracy``), ``epsilon`` and
    ``epoch``; rows may carry only some of them.
    """
    if not history or any("step" not in row for row in history):
        raise ValueError("history must be a non-empty list of dicts, each with a 'step'")
    keys = sorted({k for row in history for k in row if k == "loss" or "accuracy" in k})
    series = {k: _series(history, k) for k in [*keys, "epsilon"]}
    figure = Figure(figsize=(7, 6))
    loss_axes, acc_axes = figure.subplots(2, 1, sharex=True)
    _draw(loss_axes, series, [k for k in keys if k == "loss"], "loss")
    _draw(acc_axes, series, [k for k in keys if "accuracy" in k], "accuracy")
    if series["epsilon"]:
        eps_axes = acc_axes.twinx()
        steps, values = zip(*series["epsilon"], strict=True)
        eps_axes.plot(steps, values, color="tab:red", linestyle=":", label="ε spent")
        eps_axes.set_ylabel("ε spent", color="tab:red")
        eps_axes.set_ylim(bottom=0)
        eps_axes.legend(loc="center right")
    _epoch_axis(loss_axes, history)
    acc_axes.set_xlabel("training steps")
    figure.suptitle("Private training: loss and accuracy against steps", fontsize=10)
    figure.tight_layout()
    save_png(figure, path)
    return TrainingCurves(tuple(int(row["step"]) for row in history), series)


def _draw(axes: Any, series: dict[str, Any], keys: Sequence[str], ylabel: str) -> None:
    """Plot some series on one axes, or say there is nothing."""
    for key in keys:
        if series[key]:
            steps, values = zip(*series[key], strict=True)
            axes.plot(steps, values, marker=".", label=key.replace("_", " "))
    if any(series[k] for k in keys):
        axes.legend(loc="best")
    else:
        axes.text(0.5, 0.5, f"no {ylabel} recorded", ha="center", transform=axes.transAxes)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)


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


__all__ = [
    "CURVE_POINTS",
    "EpsilonCurve",
    "TrainingCurves",
    "epsilon_curve",
    "plot_epsilon_curve",
    "plot_training_curves",
]
