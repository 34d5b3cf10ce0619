"""Rule for :class:`~dpfy.train.grads.substitutions.InProjection`, attention's q/k/v projection.

The packed weight's rows split into the q, k and v projections, whose gradients occupy disjoint
blocks, so squared norms add over the three Linear maps. For self-attention the three maps share
one input, whose Gram matrix (ghost norm) is then formed once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from dpfy.train.grads.capture import Call
from dpfy.train.grads.layout import flatten_positions, group_positions
from dpfy.train.grads.registry import LayerRule, register_rule
from dpfy.train.grads.rules._bilinear import (
    bias_sq_norms,
    gram,
    use_ghost,
    weight_sq_norms,
    weighted_bias_sum,
    weighted_weight_sum,
)
from dpfy.train.grads.substitutions import InProjection

_WEIGHTS = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def _units(x: Tensor, group: int) -> Tensor:
    """(B, *, d) → (U, T, d)."""
    return group_positions(flatten_positions(x), group)


def _pairs(layer: InProjection, call: Call) -> list[tuple[str, Tensor, Tensor]]:
    """(weight name, input, output gradient) for the q, k and v projections, in that order."""
    xs = [_units(x, call.group) for x in call.inputs]
    if call.inputs[0] is call.inputs[1] is call.inputs[2]:
        xs = [xs[0]] * 3  # self-attention: one input tensor shared by the three maps
    gs = [_units(g, call.group) for g in call.grads]
    names = ("in_proj_weight",) * 3 if layer.packed else _WEIGHTS
    return list(zip(names, xs, gs, strict=True))


@register_rule(InProjection)
class InProjectionRule(LayerRule):
    """Three Linear maps (q, k, v) whose weights and biases are blocks of packed parameters."""

    @staticmethod
    def sq_norms(layer: nn.Module, call: Call) -> Tensor:
        """Sum over q, k, v of weight and bias norms (blocks are disjoint, so norms add)."""
        pairs = _pairs(layer, call)
        total = pairs[0][1].new_zeros(call.num_units)
        grams: dict[int, Tensor] = {}  # one Gram matrix per distinct input (self-attention)
        for j, (name, a, g) in enumerate(pairs):
            if name in call.trainable:
                ghost = a.shape[1] > 1 and use_ghost(a.shape[1], a.shape[2], g.shape[2])
                if ghost and id(a) not in grams:
                    grams[id(a)] = gram(a)
                sq, unit_grads = weight_sq_norms(a, g, grams.get(id(a)))
                total = total + sq
                if unit_grads is not None:
                    call.cache[str(j)] = unit_grads
            if "in_proj_bias" in call.trainable:
                total = total + bias_sq_norms(g, call.cache, f"bias{j}")
        return total

    @staticmethod
    def clipped_sum(layer: nn.Module, call: Call, weights: Tensor) -> dict[str, Tensor]:
        """Book-keeping sums per projection, re-packed into the module's parameters."""
        return InProjectionRule.add_clipped_sum(layer, call, weights, {})

    @staticmethod
    def add_clipped_sum(  # type: ignore[override]
        layer: nn.Module, call: Call, weights: Tensor, into: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Each projection's product goes straight into its rows of the running sum if any."""
        pairs = _pairs(layer, call)
        blocks: dict[str, list[Tensor]] = {}
        rows: dict[str, int] = {}  # next free row of each packed weight's running sum
        for j, (name, a, g) in enumerate(pairs):
            if name not in call.trainable:
                continue
            start, size = rows.get(name, 0), g.shape[2]
            rows[name] = start + size
            slot = into.get(name)
            if slot is not None:
                slot = slot[start : start + size]
            block = weighted_weight_sum(a, g, weights, call.cache.get(str(j)), slot)
            if slot is None:
                blocks.setdefault(name, []).append(block)
        out = {name: torch.cat(parts) for name, parts in blocks.items()}
        if "in_proj_bias" in call.trainable:
            out["in_proj_bias"] = torch.cat(
                [
                    weighted_bias_sum(g, weights, call.cache, f"bias{j}")
                    for j, (_, _, g) in enumerate(pairs)
                ]
            )
        return out
