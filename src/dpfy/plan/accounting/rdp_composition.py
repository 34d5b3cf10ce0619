"""The RDP curve of an event on a grid of orders: curves of sequential runs add (Mironov 2017,
Prop. 1), so the walker sums the rule registered (``@_rule``) for each event type.

The rule modules (rdp_mechanisms, rdp_subsampling, rdp_repeat_and_select) register on import;
:mod:`dpfy.plan.accounting.rdp`, imported by the package, imports them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfy._validate import check_range
from dpfy.plan.accounting.accountant import UnsupportedEventError
from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    NeighbouringRelation,
    SelfComposedEvent,
)

__all__ = ["DEFAULT_ORDERS", "check_orders", "rdp_curve", "rdp_unsupported_reason"]

DEFAULT_ORDERS: tuple[float, ...] = (
    *(round(1 + i / 100, 2) for i in range(1, 10)),
    *(round(1 + i / 10, 1) for i in range(1, 100)),
    *(float(i) for i in range(11, 64)),
    128.0,
    256.0,
    512.0,
    1024.0,
)
"""Orders 1.01–1.09 (step 0.01), 1.1–10.9 (step 0.1), 11–63, 128, 256, 512, 1024.

A superset of the grid most RDP tools use, with extra orders near 1 for very large budgets.
"""


# -- validation ----------------------------------------------------------------------------------
def check_orders(orders: Sequence[float] | np.ndarray | None) -> np.ndarray:
    """A sorted, duplicate-free grid of finite orders above 1 (None gives ``DEFAULT_ORDERS``)."""
    if orders is None:
        return np.array(DEFAULT_ORDERS, dtype=float)
    values = [check_range("orders", o, 1.0, math.inf) for o in np.atleast_1d(np.asarray(orders))]
    if not values:
        raise ValueError("orders must hold at least one order in (1, inf), got an empty grid")
    return np.unique(np.array(values, dtype=float))


# -- the rule registry ---------------------------------------------------------------------------
CurveRule = Callable[[Any, NeighbouringRelation, np.ndarray], np.ndarray]
ReasonRule = Callable[[Any, NeighbouringRelation], "str | None"]


def _always_supported(event: DpEvent, relation: NeighbouringRelation) -> str | None:
    """Leaf events with a closed-form curve are accepted under every relation."""
    return None


@dataclass(frozen=True)
class _Rule:
    """How one event type is accounted: its RDP curve, and why it could be refused."""

    curve: CurveRule
    reason: ReasonRule


_RULES: dict[type[DpEvent], _Rule] = {}


def _rule(
    event_type: type[DpEvent], reason: ReasonRule = _always_supported
) -> Callable[[CurveRule], CurveRule]:
    """Decorator: register ``curve`` (and its refusal reason) as the RDP rule of ``event_type``."""

    def register(curve: CurveRule) -> CurveRule:
        _RULES[event_type] = _Rule(curve, reason)
        return curve

    return register


def rdp_unsupported_reason(event: DpEvent, relation: NeighbouringRelation | str) -> str | None:
    """Why no sound RDP bound is implemented for ``event`` under ``relation``, or None."""
    relation = NeighbouringRelation.parse(relation)
    rule = _RULES.get(type(event))
    if rule is None:
        return f"the RDP accountant has no bound for {type(event).__name__}"
    return rule.reason(event, relation)


def rdp_curve(
    event: DpEvent,
    relation: NeighbouringRelation | str,
    orders: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """Upper bounds on the RDP ε(α) of ``event`` at each order; refuses unsupported events."""
    relation = NeighbouringRelation.parse(relation)
    orders = check_orders(orders)
    if not isinstance(event, DpEvent):
        raise ValueError(f"event must be a DpEvent, got {type(event).__name__}")
    reason = rdp_unsupported_reason(event, relation)
    if reason is not None:
        raise UnsupportedEventError(reason)
    return _curve(event, relation, orders)


def _curve(event: DpEvent, relation: NeighbouringRelation, orders: np.ndarray) -> np.ndarray:
    """Dispatch to the registered rule; callers have already checked support."""
    return _RULES[type(event)].curve(event, relation, orders)


# -- composition ---------------------------------------------------------------------------------
def _self_composed_reason(event: SelfComposedEvent, relation: NeighbouringRelation) -> str | None:
    """A repeated event is supported exactly when the event is."""
    return rdp_unsupported_reason(event.event, relation)


@_rule(SelfComposedEvent, _self_composed_reason)
def _self_composed_curve(
    event: SelfComposedEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """RDP adds under adaptive composition (Mironov 2017, Prop. 1): count × the curve."""
    if event.count == 0:
        return np.zeros_like(orders)
    return event.count * _curve(event.event, relation, orders)


def _composed_reason(event: ComposedEvent, relation: NeighbouringRelation) -> str | None:
    """A sequence is supported when every member is; the first refusal explains why."""
    for member in event.events:
        reason = rdp_unsupported_reason(member, relation)
        if reason is not None:
            return reason
    return None


@_rule(ComposedEvent, _composed_reason)
def _composed_curve(
    event: ComposedEvent, relation: NeighbouringRelation, orders: np.ndarray
) -> np.ndarray:
    """Heterogeneous runs compose by summing their curves (Mironov 2017, Prop. 1)."""
    total = np.zeros_like(orders)
    for member in event.events:
        total = total + _curve(member, relation, orders)
    return total
