"""Rule for Hugging Face's ``Conv1D`` (GPT-2's projections): a Linear layer stored transposed.

``transformers.pytorch_utils.Conv1D`` computes ``y = x W + b`` with ``W`` of shape (in, out), so a
unit's weight gradient is ``Σ_t a_t g_tᵀ``, the transpose of ``nn.Linear``'s ``Σ_t g_t a_tᵀ``:
the same norms (direct or ghost, whichever is cheaper) and the same book-keeping product with the
two sides swapped. Registered by qualified name, so importing dpfy never imports transformers.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from dpfy.train.grads.capture import Call
from dpfy.train.grads.layout import flatten_positions, group_positions
from dpfy.train.grads.registry import LayerRule, register_rule
from dpfy.train.grads.rules._bilinear import (
    bias_sq_norms,
    weight_sq_norms,
    weighted_bias_sum,
    weighted_weight_sum,
)

CONV1D = "transformers.pytorch_utils.Conv1D"


def _units(x: Tensor, group: int) -> Tensor:
    """(B, *, d) → (U, T, d): positions flattened, microbatches merged into one unit."""
    return group_positions(flatten_positions(x), group)


@register_rule(CONV1D)
class Conv1DRule(LayerRule):
    """Weight gradient Σ_t a_t g_tᵀ (in × out), bias gradient Σ_t g_t, per unit."""

    factored = frozenset({"weight", "bias"})

    @staticmethod
    def unsupported_reason(layer: nn.Module) -> str | None:
        """The rule reads the weight as one (in, out) matrix."""
        if layer.weight.dim() != 2:
            return "its weight is not one (in, out) matrix"
        return None

    @staticmethod
    def sq_norms(layer: nn.Module, call: Call) -> Tensor:
        """Linear's norms with input and output gradient swapped (the gradient is transposed)."""
        a, g = _units(call.inputs[0], call.group), _units(call.grads[0], call.group)
        total = a.new_zeros(a.shape[0])
        if "weight" in call.trainable:
            sq, unit_grads = weight_sq_norms(g, a)  # direct route: (U, in, out) gradients
            total = total + sq
            if unit_grads is not None:
                call.cache["weight"] = unit_grads
        if "bias" in call.trainable:
            total = total + bias_sq_norms(g, call.cache)
        return total

    @staticmethod
    def clipped_sum(layer: nn.Module, call: Call, weights: Tensor) -> dict[str, Tensor]:
        """Book-keeping: Σ_u w_u Σ_t a_ut g_utᵀ for the weight, wᵀ Σ_t Γ for the bias."""
        return Conv1DRule.add_clipped_sum(layer, call, weights, {})

    @staticmethod
    def add_clipped_sum(  # type: ignore[override]
        layer: nn.Module, call: Call, weights: Tensor, into: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """The weight's product is added straight into the running sum when there is one."""
        a, g = _units(call.inputs[0], call.group), _units(call.grads[0], call.group)
        out = {}
        if "weight" in call.trainable:
            slot = into.get("weight")
            total = weighted_weight_sum(g, a, weights, call.cache.get("weight"), slot)
            if slot is None:
                out["weight"] = total
        if "bias" in call.trainable:
            bias = weighted_bias_sum(g, weights, call.cache, into=into.get("bias"))
            if "bias" not in into:
                out["bias"] = bias
        return out

    @staticmethod
    def factors(layer: nn.Module, call: Call, name: str) -> tuple[Tensor, Tensor]:
        """Weight: L = a, R = g; bias: L = g, R = 1."""
        g = _units(call.grads[0], call.group)
        if name == "bias":
            return g, g.new_ones(*g.shape[:2], 1)
        return _units(call.inputs[0], call.group), g
