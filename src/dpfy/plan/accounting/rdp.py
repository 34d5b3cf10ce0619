"""Rényi-DP accounting: the RDP curve ε(α) of every event, and its conversion to (ε, δ).

An RDP curve is a vector of upper bounds on the Rényi divergence of order α between the outputs
on neighbouring datasets, one entry per order of a fixed grid (Mironov 2017, Def. 4). Curves of
sequential runs add (Mironov 2017, Prop. 1), so composing events is summing vectors; the (ε, δ)
guarantee is the best conversion over the grid. Each event type has one small rule (its curve and
why it might be refused), registered in a dict keyed by the event class.

Where each part lives: the walker and the orders grid in rdp_composition; the rules in
rdp_mechanisms, rdp_subsampling and rdp_repeat_and_select (importing them here registers
them); the conversion in rdp_conversion; this module holds the accountant.

Pure numpy/scipy: this module never imports torch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from dpfy._validate import check_delta, check_range

# The rule modules register their curves with the walker of rdp_composition when imported.
from dpfy.plan.accounting import (
    rdp_mechanisms,  # noqa: F401
    rdp_repeat_and_select,  # noqa: F401
    rdp_subsampling,  # noqa: F401
)
from dpfy.plan.accounting.accountant import Accountant, register_accountant
from dpfy.plan.accounting.events import DpEvent, NeighbouringRelation
from dpfy.plan.accounting.rdp_composition import _curve, check_orders, rdp_unsupported_reason
from dpfy.plan.accounting.rdp_conversion import RdpEpsilon, delta_from_rdp, epsilon_from_rdp

__all__ = ["GridEdgeWarning", "RdpAccountant"]


class GridEdgeWarning(UserWarning):
    """The best order was the smallest or largest of the grid: a wider grid may give a smaller ε."""


# -- the accountant ------------------------------------------------------------------------------
def _edge_message(details: RdpEpsilon, orders: np.ndarray) -> str:
    """Name the edge order and the direction in which to widen the grid."""
    smallest = details.order == orders[0]
    side, hint = (
        ("smallest", f"orders between 1 and {orders[0]:g}")
        if smallest
        else ("largest", f"orders above {orders[-1]:g}")
    )
    return (
        f"the best RDP order ({details.order:g}) is the {side} of the grid; the bound may be "
        f"loose — pass a wider grid to RdpAccountant(orders=...) that adds {hint}"
    )


@register_accountant
class RdpAccountant(Accountant):
    """Rényi-DP accountant: sums RDP curves over a grid of orders, converts to (ε, δ).

    Looser than PLD accounting for DP-SGD, but it alone covers sampling without replacement
    (replace-one) and randomised numbers of tuning trials.
    """

    name = "rdp"

    def __init__(
        self,
        relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE,
        orders: Sequence[float] | np.ndarray | None = None,
    ) -> None:
        super().__init__(relation)
        self._orders = check_orders(orders)
        self._rdp: np.ndarray | None = None

    @property
    def orders(self) -> np.ndarray:
        """The grid of orders (a copy)."""
        return self._orders.copy()

    @property
    def rdp(self) -> np.ndarray:
        """The RDP of everything composed so far, one entry per order (a copy)."""
        if self._rdp is None:
            total = np.zeros_like(self._orders)
            for event, count in self._composed:
                total = total + count * _curve(event, self.relation, self._orders)
            self._rdp = total
        return self._rdp.copy()

    def unsupported_reason(self, event: DpEvent) -> str | None:
        """Why this accountant cannot bound ``event`` under its relation, or None if it can."""
        return rdp_unsupported_reason(event, self.relation)

    def _invalidate(self) -> None:
        """A new event changes the curve; recompute it on the next query."""
        self._rdp = None

    def epsilon_details(self, delta: float) -> RdpEpsilon:
        """ε at ``delta`` with the certifying order; warns when that order is on the grid edge."""
        delta = check_delta(delta)
        details = epsilon_from_rdp(self.rdp, self._orders, delta)
        self._warn_on_edge(details)
        return details

    def delta_details(self, epsilon: float) -> RdpEpsilon:
        """δ at ``epsilon`` with the certifying order; warns when that order is on the grid edge."""
        epsilon = check_range("epsilon", epsilon, 0.0, math.inf, low_open=False)
        details = delta_from_rdp(self.rdp, self._orders, epsilon)
        self._warn_on_edge(details)
        return details

    def _warn_on_edge(self, details: RdpEpsilon) -> None:
        """A grid-edge optimum means ε could shrink with more orders: say so, never silently."""
        if details.on_grid_edge:
            warnings.warn(GridEdgeWarning(_edge_message(details, self._orders)), stacklevel=3)

    def _epsilon(self, delta: float) -> float:
        """The base-class hook: ε of the best order (warning on a grid-edge optimum)."""
        return self.epsilon_details(delta).epsilon

    def _delta(self, epsilon: float) -> float:
        """The base-class hook: δ of the best order (warning on a grid-edge optimum)."""
        return self.delta_details(epsilon).delta
