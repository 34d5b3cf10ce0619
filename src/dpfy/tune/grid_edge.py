"""A choice at the edge of its grid: the best value may lie beyond it, so say so (guide §5.4.1).

A grid search returns only values it tried. When the chosen learning rate or clip norm is the
smallest or the largest of its grid, a better one may lie outside, and the choice says as much
about the grid as about the data. One warning per parameter names the value and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from dpfy.tune.clip_search import ClipChoice, ClipSearch
from dpfy.tune.search import Search
from dpfy.tune.sweep import LrClipSweep
from dpfy.tune.trial import TrialConfig


class TuningGridEdgeWarning(UserWarning):
    """The chosen value of a tuned parameter is the smallest or largest of its grid."""


@dataclass(frozen=True)
class GridEdge:
    """A chosen value at one end of its (sorted, multi-valued) grid."""

    parameter: str  # e.g. "learning rate"
    option: str  # the dpfy tune option that sets the grid
    value: float
    grid: tuple[float, ...]

    @property
    def smallest(self) -> bool:
        """Whether the value is the grid's low end (else its high end)."""
        return self.value == min(self.grid)

    def message(self) -> str:
        """One line: the parameter, its value, which edge, and how to extend the grid."""
        side, way = ("smallest", "below") if self.smallest else ("largest", "above")
        values = ", ".join(f"{v:g}" for v in self.grid)
        return (
            f"the tuning chose {self.parameter} = {self.value:g}, the {side} value of its grid "
            f"({values}): the best may lie {way} it; extend {self.option} {way} {self.value:g} "
            "and tune again (a new tuning run spends privacy budget too)"
        )


def grid_edges(axes: Sequence[tuple[str, str, Sequence[float], float]]) -> list[GridEdge]:
    """The edges hit among (parameter, option, grid, chosen value); one-value grids never are."""
    edges = []
    for parameter, option, grid, value in axes:
        values = tuple(sorted(float(v) for v in grid))
        if len(values) > 1 and value in (values[0], values[-1]):
            edges.append(GridEdge(parameter, option, float(value), values))
    return edges


def search_edges(search: Search, chosen: TrialConfig, clip: ClipChoice | None) -> list[GridEdge]:
    """The grid edges of a chosen configuration, for the searches that have grids.

    ClipSearch is skipped when its trials did not tell the clip norms apart (``clip.indistinct``):
    its rule then takes the smallest C by design, and a note already says to lengthen the trials.
    """
    if isinstance(search, LrClipSweep):
        return grid_edges(
            [
                ("learning rate", "--lr-grid", search.lrs, chosen.lr),
                ("clip norm C", "--clip-grid", search.clips, chosen.max_grad_norm),
            ]
        )
    if isinstance(search, ClipSearch) and not (clip is not None and clip.indistinct):
        return grid_edges([("clip norm C", "--clip-grid", search.grid, chosen.max_grad_norm)])
    return []


def warn_grid_edges(edges: Sequence[GridEdge]) -> None:
    """One warning per edge (the CLI prints each as ``warning: …``)."""
    for edge in edges:
        warnings.warn(edge.message(), TuningGridEdgeWarning, stacklevel=2)


__all__ = ["GridEdge", "TuningGridEdgeWarning", "grid_edges", "search_edges", "warn_grid_edges"]
