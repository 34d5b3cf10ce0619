"""The fast engine: one forward, one backward, per-layer rules, no per-example gradients.

Hooks keep each watched layer's inputs and output gradients. Each layer's rule (see
:mod:`dpfy.train.grads.registry`) gives the per-unit squared norms of its own parameters' gradients;
their sum over layers gives each unit's total norm and clip factor, and the same rules then form
the clipped sum directly ("book-keeping", Bu et al. 2023). While a watched layer runs forward,
its parameters' ``requires_grad`` is switched off so autograd does not compute the ordinary
(unclipped) parameter gradient that would be thrown away; the graph to the layer's input is kept.
Layers whose per-example gradients are small (convolutions on the direct route, normalisation
layers) are reduced to them during backward, so their activations and output gradients are
released early. A parameter shared by several layers (tied embeddings) gets the norm of its
summed gradient: the layers' own norms plus twice the inner products of their gradients
(:mod:`dpfy.train.grads.shared`); each layer then adds its part of the clipped sum into the same
running sum.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dpfy.train.grads.capture import Call, Tap, release
from dpfy.train.grads.engine import GradEngine, NoiseStart
from dpfy.train.grads.hooks import refuse_gradient_hooks
from dpfy.train.grads.layout import Units, prepare_call
from dpfy.train.grads.precision import autocast_off, compute_dtype
from dpfy.train.grads.registry import LayerRule, find_rule
from dpfy.train.grads.rows import Rows
from dpfy.train.grads.shared import cross_inner_products
from dpfy.train.grads.vmap import per_example_grads

__all__ = ["FastEngine"]

_Pending = tuple[Tap, type[LayerRule], Call, dict[str, Rows] | None]


class FastEngine(GradEngine):
    """Per-example clipping from per-layer norm rules and book-keeping sums."""

    kind = "fast"

    def __init__(self, *args: Any, replay_repeated: bool = False, **kwargs: Any) -> None:
        """Same arguments as :class:`GradEngine`; every tap must have a rule.

        ``replay_repeated`` (``engine="auto"``): a layer called more than once in a forward pass
        gets its per-example gradients from the vmap engine's replay of each call (summed over
        the calls) instead of being refused; the other layers keep their rules.
        """
        super().__init__(*args, **kwargs)
        self._replay_repeated = replay_repeated
        #: The layers whose per-example gradients the last step formed by replay (called twice).
        self.replayed_layers: set[str] = set()
        self._pending: list[_Pending] = []
        self._layer_names = {tap.name: self._names_of(tap) for tap in self._taps.taps}
        self._shared = self._shared_uses()
        self._sharing = {tap_name for uses in self._shared.values() for tap_name, _ in uses}

    def _shared_uses(self) -> dict[str, list[tuple[str, str]]]:
        """Parameters watched in more than one layer: name → [(layer name, local name)]."""
        uses: dict[str, list[tuple[str, str]]] = {}
        for tap_name, names in self._layer_names.items():
            for local, name in names.items():
                uses.setdefault(name, []).append((tap_name, local))
        return {name: found for name, found in uses.items() if len(found) > 1}

    def _rule(self, tap: Tap) -> type[LayerRule]:
        """The tap's rule (``make_engine`` checked that there is one)."""
        rule = find_rule(tap.module)
        assert rule is not None, f"no rule for {tap.name}"
        return rule

    def _check_calls(self, tap: Tap, calls: list[Call]) -> None:
        """Refuse a layer used more than once in one forward pass (its norms would couple)."""
        if len(calls) > 1 and not (self._replay_repeated and tap.name not in self._sharing):
            raise ValueError(
                f"layer '{tap.name}' was called {len(calls)} times in one forward pass; the "
                "fast engine does not support repeated use. Use make_engine(..., engine='vmap')"
            )

    def _on_ready(self, tap: Tap, call: Call) -> None:
        """During backward: reduce the call to per-example gradients where its rule says so."""
        rule = self._rule(tap)
        if rule.per_example_grads is LayerRule.per_example_grads:
            return  # the rule keeps the captures (no reduction to prepare the call for)
        if call.stale_input() or len(tap.calls) > 1:
            return  # clip_and_accumulate reports these
        if tap.name in self._sharing:
            return  # a shared parameter's inner products read the captures
        with autocast_off(*self._devices):  # backward may run inside the caller's autocast
            prepared = prepare_call(call, self.batch_dim(tap, call))
            if prepared.batch_size == 0:
                return  # an empty batch: nothing to reduce, and the step adds nothing but noise
            grads = rule.per_example_grads(tap.module, prepared)
        if grads is None:
            return
        size = prepared.batch_size
        call.release()
        call.compact, call.size = {name: Rows.of(rows) for name, rows in grads.items()}, size

    def _unit_sq_norms(self, calls: list[tuple[Tap, Call]], units: Units) -> Tensor:
        """Sum each layer's per-unit squared norms (from its rule, or its compact gradients)."""
        refuse_gradient_hooks(self.params)  # one added since make_engine: refused before summing
        self._pending = []
        total: Tensor | None = None
        counts: dict[str, int] = {}
        for tap, _ in calls:
            counts[tap.name] = counts.get(tap.name, 0) + 1
        repeated: dict[str, tuple[Tap, list[Call]]] = {}
        self.replayed_layers = set()
        for tap, call in calls:
            rule = self._rule(tap)
            if counts[tap.name] > 1 or rule.from_rows:  # repeated: only under replay_repeated
                repeated.setdefault(tap.name, (tap, []))[1].append(call)
                continue
            if call.compact is not None:
                grouped = {name: rows.per_unit(units) for name, rows in call.compact.items()}
                self._pending.append((tap, rule, call, grouped))
                for rows in grouped.values():
                    sq = rows.sq_norms()
                    total = sq if total is None else total + sq
            else:
                prepared = prepare_call(call, self.batch_dim(tap, call), units)
                self._pending.append((tap, rule, prepared, None))
                sq = rule.sq_norms(tap.module, prepared)
                total = sq if total is None else total + sq
        for tap, tap_calls in repeated.values():
            grouped = self._example_rows(tap, tap_calls, units)
            self._pending.append((tap, self._rule(tap), tap_calls[0], grouped))
            for rows in grouped.values():
                sq = rows.sq_norms()
                total = sq if total is None else total + sq
        assert total is not None
        if self._shared:
            total = total + self._cross_terms()
        return total

    def _example_rows(self, tap: Tap, calls: list[Call], units: Units) -> dict[str, Rows]:
        """Per-unit gradients from whole per-example gradients, summed over the layer's calls.

        Each call's come from its rule (``example_rows``) or, where the rule has none for it (a
        layer called twice, a packed batch), from replaying the call as the vmap engine does.
        """
        rule = self._rule(tap)
        summed: dict[str, Tensor] = {}
        with autocast_off(*self._devices):
            for call in calls:
                grads = rule.example_rows(tap.module, call) if rule.from_rows else None
                if grads is None:
                    grads = per_example_grads(tap, call, self.batch_dim(tap, call))
                    self.replayed_layers.add(tap.name)
                for local, grad in grads.items():
                    rows = grad.to(compute_dtype(grad.dtype)).reshape(grad.shape[0], -1)
                    summed[local] = summed[local] + rows if local in summed else rows
        return {local: Rows.of(rows).per_unit(units) for local, rows in summed.items()}

    def _cross_terms(self) -> Tensor | float:
        """Σ over shared parameters of 2⟨G_k, G_l⟩ for every pair of layers k < l using it.

        With each layer's own squared norms this makes ‖Σ_k G_k‖², the norm of the parameter's
        per-unit gradient summed over the layers that share it.
        """
        calls = {
            tap.name: (tap, rule, call) for tap, rule, call, rows in self._pending if rows is None
        }
        total: Tensor | float = 0.0
        for uses in self._shared.values():
            factors = [
                calls[tap_name][1].factors(calls[tap_name][0].module, calls[tap_name][2], local)
                for tap_name, local in uses
                if tap_name in calls
            ]
            for k, first in enumerate(factors):
                for second in factors[k + 1 :]:
                    total = total + 2 * cross_inner_products(first, second)
        return total

    def _accumulate(self, weights: Tensor, noise: NoiseStart | None) -> None:
        """Add each layer's clipped sum into the running sums (in place where its rule can).

        With ``noise``, a named parameter's sum is opened from its noise just before its layer
        is summed, so the product adds into it and no second parameter-sized tensor is held.
        """
        try:
            while self._pending:  # release each layer's captures as soon as it is summed
                tap, rule, call, grouped = self._pending.pop()
                names = self._layer_names[tap.name]
                into = {}
                for local, name in names.items():
                    slot = self._slot(name, noise)
                    if slot is not None:
                        into[local] = slot
                if grouped is not None:  # per-example rows: added in place where a sum is open
                    sums = {}
                    for local, rows in grouped.items():
                        slot = into.get(local)
                        if slot is not None and slot.is_contiguous():
                            rows.weighted_sum(weights, slot)
                        else:
                            sums[local] = rows.weighted_sum(weights)
                else:
                    sums = rule.add_clipped_sum(tap.module, call, weights, into)
                call.release()
                release(tap)
                del call, grouped
                for local, value in sums.items():
                    self._add_into(names[local], into.get(local), value)
        finally:
            self._pending = []

    def _model_names(self, tap: Tap) -> dict[str, str]:
        """The layer's trainable parameters, largest first: local name → name in the model."""
        return self._layer_names[tap.name]

    def _names_of(self, tap: Tap) -> dict[str, str]:
        """:meth:`_model_names` of one layer, worked out once when the engine is made."""
        local = {self._names[id(getattr(tap.module, n))]: n for n in tap.trainable}
        return {local[name]: name for name in self._largest_first(local)}
