"""The fast engine: one forward, one backward, per-layer rules, no per-example gradients.

Hooks keep each watched layer's inputs and output gradients. Each layer's rule (see
:mod:`dpfy.grads.registry`) gives the per-unit squared norms of its own parameters' gradients;
their sum over layers gives each unit's total norm and clip factor, and the same rules then form
the clipped sum directly ("book-keeping", Bu et al. 2023). While a watched layer runs forward,
its parameters' ``requires_grad`` is switched off so autograd does not compute the ordinary
(unclipped) parameter gradient that would be thrown away; the graph to the layer's input is kept.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dpfy.grads.capture import Call, Tap
from dpfy.grads.engine import GradEngine
from dpfy.grads.layout import prepare_call
from dpfy.grads.registry import LayerRule, find_rule

__all__ = ["FastEngine"]


class FastEngine(GradEngine):
    """Per-example clipping from per-layer norm rules and book-keeping sums."""

    kind = "fast"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Same arguments as :class:`GradEngine`; every tap must have a rule."""
        super().__init__(*args, **kwargs)
        self._pending: list[tuple[Tap, type[LayerRule], Call]] = []

    def _check_calls(self, tap: Tap, calls: list[Call]) -> None:
        """Refuse a layer used more than once in one forward pass (its norms would couple)."""
        if len(calls) > 1:
            raise ValueError(
                f"layer '{tap.name}' was called {len(calls)} times in one forward pass; the "
                "fast engine does not support repeated use. Use make_engine(..., engine='vmap')"
            )

    def _unit_sq_norms(self, calls: list[tuple[Tap, Call]], n: int, group: int) -> Tensor:
        """Sum each layer rule's per-unit squared norms."""
        self._pending = []
        total: Tensor | None = None
        for tap, call in calls:
            rule = find_rule(tap.module)
            assert rule is not None, f"no rule for {tap.name}"  # checked by make_engine
            prepared = prepare_call(call, self.batch_dim(tap, call), group)
            self._pending.append((tap, rule, prepared))
            sq = rule.sq_norms(tap.module, prepared)
            total = sq if total is None else total + sq
        assert total is not None
        return total

    def _unit_weighted_sums(self, weights: Tensor) -> dict[str, Tensor]:
        """Each layer rule's book-keeping sum, keyed by the parameter's name in the model."""
        out: dict[str, Tensor] = {}
        try:
            for tap, rule, call in self._pending:
                for local, value in rule.clipped_sum(tap.module, call, weights).items():
                    out[self._names[id(getattr(tap.module, local))]] = value
        finally:
            self._pending = []
        return out
