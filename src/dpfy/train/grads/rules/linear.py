"""Rule for ``nn.Linear`` on inputs (B, d) or sequences (B, *, d), and for weights stored (in, out).

A unit's weight gradient is Σ_t g_t a_tᵀ; a layer that stores its weight transposed (Hugging
Face's ``Conv1D``, :mod:`.hf_conv1d`) has the transpose, Σ_t a_t g_tᵀ: the same norms and the
same book-keeping products with the two sides swapped (``transposed``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from dpfy.train.grads.capture import Call
from dpfy.train.grads.layout import flatten_positions, group_positions
from dpfy.train.grads.norms import sq_norm
from dpfy.train.grads.registry import LayerRule, register_rule
from dpfy.train.grads.rules._bilinear import (
    as_dtype,
    bias_sq_norms,
    product_into,
    weight_sq_norms,
    weighted_bias_sum,
    weighted_weight_sum,
)


def _units(x: Tensor, group: int) -> Tensor:
    """(B, *, d) → (U, T, d): positions flattened, microbatches merged into one unit."""
    return group_positions(flatten_positions(x), group)


@register_rule(nn.Linear)
class LinearRule(LayerRule):
    """Weight gradient Σ_t g_t a_tᵀ (Σ_t a_t g_tᵀ when ``transposed``), bias Σ_t g_t, per unit."""

    factored = frozenset({"weight", "bias"})
    #: Whether the weight is stored (in, out), so that its gradient is Σ_t a_t g_tᵀ.
    transposed: ClassVar[bool] = False

    @classmethod
    def sides(cls, call: Call) -> tuple[Tensor, Tensor]:
        """(R, L) as (U, T, ·), the weight gradient being Σ_t L_t R_tᵀ: (a, g), or (g, a)."""
        a, g = _units(call.inputs[0], call.group), _units(call.grads[0], call.group)
        return (g, a) if cls.transposed else (a, g)

    @classmethod
    def factors(cls, layer: nn.Module, call: Call, name: str) -> tuple[Tensor, Tensor]:
        """Weight: (L, R) of :meth:`sides`; bias: L = g, R = 1 (Σ_t L_t R_tᵀ is the gradient)."""
        if name == "bias":
            g = _units(call.grads[0], call.group)
            return g, g.new_ones(*g.shape[:2], 1)
        right, left = cls.sides(call)
        return left, right

    @classmethod
    def sq_norms(cls, layer: nn.Module, call: Call) -> Tensor:
        """Direct, rank-one or ghost norm of the weight gradient plus the bias norm."""
        single = _one_position(call)
        if single is not None:
            # One position: ‖g aᵀ‖² + ‖g‖² = (‖a‖² + 1)·‖g‖², one norm of g for both.
            g_sq = sq_norm(single[1], 1)
            return torch.addcmul(g_sq, sq_norm(single[0], 1), g_sq)
        g = _units(call.grads[0], call.group)
        total = g.new_zeros(g.shape[0])
        if "weight" in call.trainable:
            sq, unit_grads = weight_sq_norms(*cls.sides(call))  # direct: (U, L's, R's width)
            total = total + sq
            if unit_grads is not None:
                call.cache["weight"] = unit_grads
        if "bias" in call.trainable:
            total = total + bias_sq_norms(g, call.cache)
        return total

    @classmethod
    def clipped_sum(cls, layer: nn.Module, call: Call, weights: Tensor) -> dict[str, Tensor]:
        """Book-keeping: Aᵀ diag(w) Γ for the weight, wᵀ Σ_t Γ for the bias."""
        return cls.add_clipped_sum(layer, call, weights, {})

    @classmethod
    def add_clipped_sum(
        cls, layer: nn.Module, call: Call, weights: Tensor, into: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """The weight's product is added straight into the running sum when there is one."""
        single = _one_position(call)
        if single is not None:
            return _rank_one_sums(*single, weights, into, cls.transposed)
        g = _units(call.grads[0], call.group)
        out = {}
        if "weight" in call.trainable:
            slot = into.get("weight")
            right, left = cls.sides(call)
            total = weighted_weight_sum(right, left, weights, call.cache.get("weight"), slot)
            if slot is None:
                out["weight"] = total
        if "bias" in call.trainable:
            bias = weighted_bias_sum(g, weights, call.cache, into=into.get("bias"))
            if "bias" not in into:
                out["bias"] = bias
        return out


_WEIGHT_AND_BIAS = frozenset({"weight", "bias"})


def _one_position(call: Call) -> tuple[Tensor, Tensor] | None:
    """(a, g) as (U, d) and (U, p) when each unit has one position and both parameters train.

    The MLP case (2-D inputs, one example per unit), which takes the rank-one route.
    """
    if call.trainable != _WEIGHT_AND_BIAS:
        return None
    x, g = call.inputs[0], call.grads[0]
    if x.dim() == 2 and call.group == 1:
        return x, g  # already (U, d), (U, p): no reshapes
    a, g = _units(x, call.group), _units(g, call.group)
    return (a.select(1, 0), g.select(1, 0)) if a.shape[1] == 1 else None


def _rank_one_sums(
    a: Tensor, g: Tensor, weights: Tensor, into: Mapping[str, Tensor], transposed: bool
) -> dict[str, Tensor]:
    """One position, weight and bias: Σ_u w_u g_u a_uᵀ (or its transpose) and Σ_u w_u g_u.

    The weight's sum is one product with the narrower side scaled by w (gᵀ's columns when it
    is not wider than a); the bias's is one matrix-vector product gᵀw from the same gᵀ. Each
    goes straight into its running sum where ``into`` has one.
    """
    w = as_dtype(weights, g.dtype)
    gt = g.t()
    if a.shape[1] < g.shape[1]:
        left, right = gt, a * w[:, None]
    else:
        left, right = gt * w, a
    if transposed:  # Σ_u w_u a_u g_uᵀ = (right)ᵀ (left)ᵀ
        left, right = right.t(), left.t()
    slot = into.get("weight")
    total = product_into(left, right, slot)
    out = {} if slot is not None else {"weight": total}
    bias = into.get("bias")
    if bias is None:
        out["bias"] = gt @ w
    elif bias.dtype != g.dtype:
        bias.add_(gt @ w)
    else:
        bias.addmv_(gt, w)
    return out
