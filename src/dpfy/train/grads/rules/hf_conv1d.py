"""Rule for Hugging Face's ``Conv1D`` (GPT-2's projections): a Linear layer stored transposed.

``transformers.pytorch_utils.Conv1D`` computes ``y = x W + b`` with ``W`` of shape (in, out), so a
unit's weight gradient is ``Σ_t a_t g_tᵀ``, the transpose of ``nn.Linear``'s: Linear's rule with
the two sides swapped. Registered by qualified name, so importing dpfy never imports transformers.
"""

from __future__ import annotations

from torch import nn

from dpfy.train.grads.registry import register_rule
from dpfy.train.grads.rules.linear import LinearRule

CONV1D = "transformers.pytorch_utils.Conv1D"


@register_rule(CONV1D)
class Conv1DRule(LinearRule):
    """Weight gradient Σ_t a_t g_tᵀ (in × out), bias gradient Σ_t g_t, per unit."""

    transposed = True

    @staticmethod
    def unsupported_reason(layer: nn.Module) -> str | None:
        """The rule reads the weight as one (in, out) matrix."""
        if layer.weight.dim() != 2:
            return "its weight is not one (in, out) matrix"
        return None
