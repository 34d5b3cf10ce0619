"""Rényi-DP accounting: the RDP curve ε(α) of every event, and its conversion to (ε, δ).

An RDP curve is a vector of upper bounds on the Rényi divergence of order α between the outputs
on neighbouring datasets, one entry per order of a fixed grid (Mironov 2017, Def. 4). Curves of
sequential runs add (Mironov 2017, Prop. 1), so composing events is summing vectors; the (ε, δ)
guarantee is the best conversion over the grid. Each event type has one small rule (its curve and
why it might be refused), registered in a dict keyed by the event class.

Where each part lives: the walker and the orders grid in rdp_composition; the rules in
rdp_mechanisms, rdp_subsampling and rdp_repeat_and_select (importing them here registers
them); the conversion in rdp_conversion; this module holds the accountant.

Heterogeneous runs (σ or q changing every step) are many distinct Poisson-sampled Gaussians:
the accountant computes all of their curves in one batch (rdp_sampled_gaussian) and, for ε or
δ, only at the orders that can be the best (rdp_order_search); :attr:`RdpAccountant.rdp`
still gives the whole curve.

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
from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    GaussianEvent,
    NeighbouringRelation,
    NoOpEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
)
from dpfy.plan.accounting.rdp_composition import _curve, check_orders, rdp_unsupported_reason
from dpfy.plan.accounting.rdp_conversion import (
    RdpEpsilon,
    _epsilon_per_order,
    _log_delta_per_order,
    _on_edge,
)
from dpfy.plan.accounting.rdp_order_search import best_order
from dpfy.plan.accounting.rdp_running import RunningRdp
from dpfy.plan.accounting.rdp_sampled_gaussian import sampled_gaussian_curves

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


class _Split:
    """The composed events as distinct sampled Gaussians (rows, with counts) plus the rest.

    The rows' curve is computed lazily, order by order, and kept: an ε query needs only a few
    orders, the whole curve needs them all.
    """

    def __init__(
        self,
        composed: list[tuple[DpEvent, int]],
        relation: NeighbouringRelation,
        orders: np.ndarray,
    ) -> None:
        rows: dict[tuple[float, float], int] = {}
        self.other = np.zeros_like(orders)
        stack = [(event, count) for event, count in reversed(composed)]
        while stack:
            event, count = stack.pop()
            if isinstance(event, ComposedEvent):
                stack.extend((member, count) for member in reversed(event.events))
            elif isinstance(event, SelfComposedEvent):
                if event.count:
                    stack.append((event.event, count * event.count))
            elif isinstance(event, PoissonSampledEvent) and isinstance(event.event, GaussianEvent):
                key = (float(event.sampling_rate), float(event.event.noise_multiplier))
                rows[key] = rows.get(key, 0) + count
            elif not isinstance(event, NoOpEvent):
                self.other = self.other + count * _curve(event, relation, orders)
        self.orders = orders
        self.q = np.array([key[0] for key in rows], dtype=float)
        self.sigma = np.array([key[1] for key in rows], dtype=float)
        self.counts = np.array(list(rows.values()), dtype=float)
        self.rows = np.full(orders.shape, np.nan)

    def exact(self, indices: np.ndarray) -> np.ndarray:
        """Σ count·ε_row(α) at ``orders[indices]`` (computed once per order)."""
        todo = indices[np.isnan(self.rows[indices])]
        if todo.size:
            if self.q.size:
                curves = sampled_gaussian_curves(
                    self.q, self.sigma, self.orders[todo], top_order=float(self.orders.max())
                )
                with np.errstate(invalid="ignore"):  # 0·∞ cannot occur: counts are ≥ 1
                    self.rows[todo] = np.einsum("r,ro->o", self.counts, curves)
            else:
                self.rows[todo] = 0.0
        return self.rows[indices]

    def curve(self) -> np.ndarray:
        """The whole RDP curve."""
        return self.exact(np.arange(self.orders.size)) + self.other

    def best(self, score) -> tuple[int, float]:
        """The order index minimising ``score(indices, curve values)``, and that minimum."""
        index, _ = best_order(self.orders, self.exact, self.other, score)
        value = float(
            score(np.array([index]), self.exact(np.array([index])) + self.other[[index]])[0]
        )
        return index, value

    @property
    def nothing(self) -> bool:
        """Whether nothing private was composed (the curve is zero everywhere)."""
        return self.q.size == 0 and not np.any(self.other > 0)


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
        self._split: _Split | None = None

    @property
    def orders(self) -> np.ndarray:
        """The grid of orders (a copy)."""
        return self._orders.copy()

    @property
    def rdp(self) -> np.ndarray:
        """The RDP of everything composed so far, one entry per order (a copy)."""
        return self._parts().curve().copy()

    def _parts(self) -> _Split:
        """The composed events split into batched sampled Gaussians and the rest (cached)."""
        if self._split is None:
            self._split = _Split(self._composed, self.relation, self._orders)
        return self._split

    def unsupported_reason(self, event: DpEvent) -> str | None:
        """Why this accountant cannot bound ``event`` under its relation, or None if it can."""
        return rdp_unsupported_reason(event, self.relation)

    def running(self) -> RunningRdp:
        """A running curve on this accountant's grid (rdp_running): curves add exactly."""
        return RunningRdp(self.relation, self._orders, self._batched_curve)

    def _batched_curve(self, counts: dict[DpEvent, int]) -> np.ndarray:
        """The curve of ``counts`` composed in one batch on this grid."""
        return _Split(list(counts.items()), self.relation, self._orders).curve()

    def _invalidate(self) -> None:
        """A new event changes the curve; recompute it on the next query."""
        self._split = None

    def epsilon_details(self, delta: float) -> RdpEpsilon:
        """ε at ``delta`` with the certifying order; warns when that order is on the grid edge."""
        delta = check_delta(delta)
        details = self._epsilon_search(delta)
        self._warn_on_edge(details)
        return details

    def delta_details(self, epsilon: float) -> RdpEpsilon:
        """δ at ``epsilon`` with the certifying order; warns when that order is on the grid edge."""
        epsilon = check_range("epsilon", epsilon, 0.0, math.inf, low_open=False)
        details = self._delta_search(epsilon)
        self._warn_on_edge(details)
        return details

    def _epsilon_search(self, delta: float) -> RdpEpsilon:
        """What ``epsilon_from_rdp`` gives on the whole curve, computing only needed orders."""
        parts, orders = self._parts(), self._orders
        if parts.nothing:
            return RdpEpsilon(0.0, delta, math.inf, False)
        index, value = parts.best(lambda idx, curve: _epsilon_per_order(curve, orders[idx], delta))
        if not math.isfinite(value):  # no order bounds anything: ε is infinite
            return RdpEpsilon(math.inf, delta, math.inf, False)
        return RdpEpsilon(max(0.0, value), delta, float(orders[index]), _on_edge(index, orders))

    def _delta_search(self, epsilon: float) -> RdpEpsilon:
        """What ``delta_from_rdp`` gives on the whole curve, computing only needed orders."""
        parts, orders = self._parts(), self._orders
        if parts.nothing:
            return RdpEpsilon(epsilon, 0.0, math.inf, False)
        index, value = parts.best(
            lambda idx, curve: _log_delta_per_order(curve, orders[idx], epsilon)[0]
        )
        delta = math.exp(min(0.0, value))
        return RdpEpsilon(epsilon, delta, float(orders[index]), _on_edge(index, orders))

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
