"""The ε plot of a private run as a PNG file, and the PNG writer every dpfy plot uses.

The ε curve is recomputed from the ledger's recorded training steps with both accountants (PLD
tight, RDP looser, guide §4.2.2), at about 30 step counts; the returned :class:`EpsilonCurve`
holds exactly the numbers drawn, so tests and reports can check the picture against the
accountant. Figures are drawn on matplotlib's Agg canvas directly — no global backend switch, no
display needed. The loss/accuracy plot is :mod:`dpfy.report.training_plot`.
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
    from dpfy.train.ledger_codec import decode_entry

    runs, met = [], True
    for index, entry in enumerate(state["entries"]):
        if "sampling" not in entry:
            continue
        _, count, step, _ = decode_entry(index, entry, entry["label"])
        assert step is not None  # an entry with a sampling record is a training step
        runs.append(_TrainingRun(step.event, count))  # the mechanism's event where it charged one
        met &= step.sampling.assumption_met
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
    save_png(epsilon_figure(curve), path)
    return curve


def epsilon_figure(curve: EpsilonCurve) -> Figure:
    """The ε plot of ``curve``: each final ε is stated in the legend, which sits below the axes.

    Inline annotations beside the final points collided with each other, the curves and the title
    whenever the two accountants' figures were close; a legend outside the axes cannot.
    """
    figure = Figure(figsize=(7, 5), layout="constrained")
    axes = figure.add_subplot()
    for name, values, style in (("PLD", curve.pld, "-"), ("RDP", curve.rdp, "--")):
        if values is None:
            continue
        label = f"{name} accountant: ε = {values[-1]:.3g} after {curve.steps[-1]} steps"
        (line,) = axes.plot(curve.steps, values, style, marker=".", label=label)
        axes.plot(curve.steps[-1], values[-1], "o", markersize=9, color=line.get_color())
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
    figure.legend(loc="outside lower center", ncols=1, fontsize=8)
    caveat = "" if curve.assumptions_met else "\nunder the Poisson assumption, which was NOT met"
    axes.set_title(f"Privacy spent by training ({curve.relation} adjacency){caveat}", fontsize=10)
    return figure


__all__ = ["CURVE_POINTS", "EpsilonCurve", "epsilon_curve", "epsilon_figure", "plot_epsilon_curve"]
