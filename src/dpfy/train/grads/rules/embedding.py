"""Rule for ``nn.Embedding``: ghost norm on indices, clipped sum by ``index_add``.

A unit's weight gradient has row v equal to Σ_{t: idx_t = v} g_t, so its squared norm is
Σ_{t,t'} [idx_t = idx_t'] ⟨g_t, g_t'⟩ (the ghost-norm identity with one-hot inputs, Li et al.
2022) — no vocabulary-sized tensor per example. Positions holding ``padding_idx`` get no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from dpfy.train.grads.capture import Call
from dpfy.train.grads.layout import group_positions
from dpfy.train.grads.registry import LayerRule, register_rule


def _indices_and_grads(layer: nn.Embedding, call: Call) -> tuple[Tensor, Tensor]:
    """Indices (U, T) and output gradients (U, T, d), padding positions' gradients zeroed."""
    x = call.inputs[0]
    idx = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # explicit sizes: the batch may be empty
    g = call.grads[0].reshape(idx.shape[0], idx.shape[1], layer.embedding_dim)
    if layer.padding_idx is not None:
        g = g * (idx != layer.padding_idx).unsqueeze(-1).to(g.dtype)
    return group_positions(idx, call.group), group_positions(g, call.group)


@register_rule(nn.Embedding)
class EmbeddingRule(LayerRule):
    """Weight gradient rows Σ_{t: idx_t = v} g_t per unit."""

    factored = frozenset({"weight"})

    @staticmethod
    def factors(layer: nn.Module, call: Call, name: str) -> tuple[Tensor, Tensor]:
        """L = the one-hot row of each position's index (given as the index), R = g."""
        return _indices_and_grads(layer, call)

    @staticmethod
    def unsupported_reason(layer: nn.Module) -> str | None:
        """``scale_grad_by_freq`` scales by batch-wide counts, coupling the examples."""
        if layer.scale_grad_by_freq:
            return "scale_grad_by_freq couples the examples of a batch"
        return None

    @staticmethod
    def sq_norms(layer: nn.Module, call: Call) -> Tensor:
        """Σ_{t,t'} [idx_t = idx_t'] ⟨g_t, g_t'⟩ per unit."""
        idx, g = _indices_and_grads(layer, call)
        same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(g.dtype)
        return (same * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))

    @staticmethod
    def clipped_sum(layer: nn.Module, call: Call, weights: Tensor) -> dict[str, Tensor]:
        """Scatter-add the weighted output gradients into the rows of their indices."""
        return EmbeddingRule.add_clipped_sum(layer, call, weights, {})

    @staticmethod
    def add_clipped_sum(  # type: ignore[override]
        layer: nn.Module, call: Call, weights: Tensor, into: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Scatter-add straight into the running sum when there is one (no vocabulary temp)."""
        idx, g = _indices_and_grads(layer, call)
        rows = (g * weights.to(g.dtype)[:, None, None]).reshape(-1, g.shape[-1])
        slot = into.get("weight")
        if slot is not None and slot.dtype == rows.dtype:
            slot.index_add_(0, idx.reshape(-1), rows)
            return {}
        return {"weight": g.new_zeros(layer.weight.shape).index_add_(0, idx.reshape(-1), rows)}
