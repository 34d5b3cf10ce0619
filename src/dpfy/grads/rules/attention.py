"""Rule for :class:`~dpfy.grads.substitutions.InProjection`, attention's q/k/v projection.

The packed weight's rows split into the q, k and v projections, whose gradients occupy disjoint
blocks, so squared norms add over the three Linear maps. For self-attention (one input) the three
are one Linear map with concatenated output gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dpfy.grads.capture import Call
from dpfy.grads.layout import flatten_positions, group_positions
from dpfy.grads.registry import LayerRule, register_rule
from dpfy.grads.rules._bilinear import (
    bias_sq_norms,
    weight_sq_norms,
    weighted_bias_sum,
    weighted_weight_sum,
)
from dpfy.grads.substitutions import InProjection

_WEIGHTS = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def _units(x: Tensor, group: int) -> Tensor:
    """(B, *, d) → (U, T, d)."""
    return group_positions(flatten_positions(x), group)


def _pairs(layer: InProjection, call: Call) -> list[tuple[str, Tensor, Tensor]]:
    """(weight name, input, output gradient) per projection; one for packed self-attention."""
    xs = [_units(x, call.group) for x in call.inputs]
    gs = [_units(g, call.group) for g in call.grads]
    if layer.packed and call.inputs[0] is call.inputs[1] is call.inputs[2]:
        return [("in_proj_weight", xs[0], torch.cat(gs, -1))]
    names = ("in_proj_weight",) * 3 if layer.packed else _WEIGHTS
    return list(zip(names, xs, gs, strict=True))


@register_rule(InProjection)
class InProjectionRule(LayerRule):
    """Three Linear maps (q, k, v) sharing one packed weight and bias."""

    @staticmethod
    def sq_norms(layer: nn.Module, call: Call) -> Tensor:
        """Sum over q, k, v of weight and bias norms."""
        total = call.inputs[0].new_zeros(call.num_units)
        for j, (name, a, g) in enumerate(_pairs(layer, call)):
            if name in call.trainable:
                sq, unit_grads = weight_sq_norms(a, g)
                total = total + sq
                if unit_grads is not None:
                    call.cache[str(j)] = unit_grads
            if "in_proj_bias" in call.trainable:
                total = total + bias_sq_norms(g)
        return total

    @staticmethod
    def clipped_sum(layer: nn.Module, call: Call, weights: Tensor) -> dict[str, Tensor]:
        """Book-keeping sums per projection, re-packed into the module's parameters."""
        pairs = _pairs(layer, call)
        blocks: dict[str, list[Tensor]] = {}
        for j, (name, a, g) in enumerate(pairs):
            if name in call.trainable:
                block = weighted_weight_sum(a, g, weights, call.cache.get(str(j)))
                blocks.setdefault(name, []).append(block)
        out = {name: torch.cat(parts) for name, parts in blocks.items()}
        if "in_proj_bias" in call.trainable:
            out["in_proj_bias"] = torch.cat([weighted_bias_sum(g, weights) for _, _, g in pairs])
        return out
