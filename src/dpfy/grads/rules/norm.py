"""Rules for the per-example normalisation layers LayerNorm, GroupNorm and RMSNorm.

Their elementwise affine parameters have per-unit gradients Σ_positions g ⊙ x̂ (weight) and
Σ_positions g (bias), where x̂ is the normalised input. These are the size of one feature vector
per unit, so they are formed outright (recomputing x̂, which autograd does not expose).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from dpfy.grads.capture import Call
from dpfy.grads.registry import LayerRule, register_rule


def _per_unit(x: Tensor, group: int) -> Tensor:
    """(B, F) per-example gradients → (U, F) per-unit sums of ``group`` consecutive examples."""
    return x if group == 1 else x.reshape(-1, group, x.shape[1]).sum(1)


def _last_dims_grads(call: Call, x_hat: Tensor, size: int) -> dict[str, Tensor]:
    """Per-unit affine gradients when the parameters cover the last dims (size features)."""
    g = call.grads[0]
    batch = g.shape[0]
    out = {}
    if "weight" in call.trainable:
        out["weight"] = _per_unit((g * x_hat).reshape(batch, -1, size).sum(1), call.group)
    if "bias" in call.trainable:
        out["bias"] = _per_unit(g.reshape(batch, -1, size).sum(1), call.group)
    return out


class _AffineRule(LayerRule):
    """Shared shape of the normalisation rules: small per-unit gradients formed explicitly."""

    @staticmethod
    def unit_grads(layer: nn.Module, call: Call) -> dict[str, Tensor]:
        """Per-unit gradients (U, F) of the layer's trainable affine parameters, by name."""
        raise NotImplementedError

    @classmethod
    def sq_norms(cls, layer: nn.Module, call: Call) -> Tensor:  # type: ignore[override]
        """Sum of squares of the per-unit affine gradients."""
        grads = cls.unit_grads(layer, call)
        return sum(g.square().sum(1) for g in grads.values())

    @classmethod
    def clipped_sum(  # type: ignore[override]
        cls, layer: nn.Module, call: Call, weights: Tensor
    ) -> dict[str, Tensor]:
        """Weighted sum of the per-unit affine gradients."""
        grads = cls.unit_grads(layer, call)
        return {name: weights.to(g.dtype) @ g for name, g in grads.items()}


@register_rule(nn.LayerNorm)
class LayerNormRule(_AffineRule):
    """LayerNorm: x̂ = layer_norm(x) without affine; parameters span ``normalized_shape``."""

    @staticmethod
    def unit_grads(layer: nn.Module, call: Call) -> dict[str, Tensor]:
        """Per-unit Σ g ⊙ x̂ and Σ g over the leading (position) dims."""
        x_hat = F.layer_norm(call.inputs[0], layer.normalized_shape, eps=layer.eps)
        return _last_dims_grads(call, x_hat, layer.weight.numel())


@register_rule(nn.RMSNorm)
class RMSNormRule(_AffineRule):
    """RMSNorm: x̂ = x / rms(x) without weight; the weight spans ``normalized_shape``."""

    @staticmethod
    def unit_grads(layer: nn.Module, call: Call) -> dict[str, Tensor]:
        """Per-unit Σ g ⊙ x̂ over the leading (position) dims."""
        x_hat = F.rms_norm(call.inputs[0], layer.normalized_shape, eps=layer.eps)
        return _last_dims_grads(call, x_hat, layer.weight.numel())


@register_rule(nn.GroupNorm)
class GroupNormRule(_AffineRule):
    """GroupNorm: parameters are per channel (dim 1), summed over spatial positions."""

    channels_first = True

    @staticmethod
    def unit_grads(layer: nn.Module, call: Call) -> dict[str, Tensor]:
        """Per-unit Σ_spatial g ⊙ x̂ and Σ_spatial g per channel."""
        x, g = call.inputs[0], call.grads[0]
        batch, channels = x.shape[:2]
        x_hat = F.group_norm(x, layer.num_groups, eps=layer.eps)
        out = {}
        if "weight" in call.trainable:
            out["weight"] = _per_unit((g * x_hat).reshape(batch, channels, -1).sum(2), call.group)
        if "bias" in call.trainable:
            out["bias"] = _per_unit(g.reshape(batch, channels, -1).sum(2), call.group)
        return out
