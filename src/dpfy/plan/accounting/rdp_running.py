"""A running RDP curve: the sum of every recorded event's curve, kept up to date one event at a
time, so "ε if one more step were added" costs one conversion rather than a new composition.

RDP curves of sequential runs add (Mironov 2017, Prop. 1), so the running sum is the curve of
everything recorded, exactly as an accountant would compose it; it differs from a fresh
accountant's curve only by floating-point rounding in the order of the additions (relative
1e-13 or so). The budget guard uses it to decide far from the target and asks a fresh
accountant within a relative ``TIE`` of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from dpfy.plan.accounting.events import DpEvent, NeighbouringRelation
from dpfy.plan.accounting.rdp_composition import rdp_curve
from dpfy.plan.accounting.rdp_conversion import epsilon_from_rdp

__all__ = ["TIE", "RunningRdp"]

#: Within this relative distance of the target, the running value does not decide.
TIE = 1e-9


class RunningRdp:
    """The running curve of one ledger's events under one relation and grid of orders."""

    #: Relative distance from a target within which :meth:`epsilon_with` does not decide.
    tie = TIE

    def __init__(
        self,
        relation: NeighbouringRelation,
        orders: np.ndarray,
        batch: Callable[[dict[DpEvent, int]], np.ndarray],
    ) -> None:
        """``batch`` composes many events into one curve (the accountant's batched path)."""
        self.relation = relation
        self.orders = np.asarray(orders, dtype=float)
        self._batch = batch
        self.total = np.zeros_like(self.orders)
        self._curve = functools.lru_cache(maxsize=4096)(self._fresh_curve)

    def _fresh_curve(self, event: DpEvent) -> np.ndarray:
        """One event's curve on the grid (cached: a run repeats its steps)."""
        curve = rdp_curve(event, self.relation, self.orders)
        curve.flags.writeable = False
        return curve

    def add(self, event: DpEvent, count: int) -> None:
        """Record ``count`` more runs of ``event``."""
        self.total = self.total + count * self._curve(event)

    def add_all(self, counts: dict[DpEvent, int]) -> None:
        """Record many events at once: one batched curve (a resumed run's whole ledger)."""
        self.total = self.total + self._batch(counts)

    def epsilon_with(self, event: DpEvent, count: int, delta: float) -> float:
        """ε at ``delta`` of everything recorded plus ``count`` runs of ``event``."""
        curve = self.total + count * self._curve(event)
        with np.errstate(invalid="ignore"):
            return epsilon_from_rdp(curve, self.orders, delta).epsilon
