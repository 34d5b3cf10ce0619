"""Rules for the per-example normalisation layers LayerNorm, GroupNorm, RMSNorm, InstanceNorm.

Their elementwise affine parameters have per-unit gradients Σ_positions g ⊙ x̂ (weight) and
Σ_positions g (bias), where x̂ is the normalised input. These are the size of one feature vector
per unit, so they are formed outright (recomputing x̂, which autograd does not expose).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpfy.train.grads.capture import Call
from dpfy.train.grads.layout import batch_slices
from dpfy.train.grads.norms import sq_norm
from dpfy.train.grads.registry import LayerRule, register_rule
from dpfy.train.grads.substitutions import (
    EmptyBatchInstanceNorm1d,
    EmptyBatchInstanceNorm2d,
    EmptyBatchInstanceNorm3d,
)


def _per_unit(x: Tensor, group: int) -> Tensor:
    """(B, F) per-example gradients → (U, F) per-unit sums of ``group`` consecutive examples."""
    return x if group == 1 else x.reshape(x.shape[0] // group, group, x.shape[1]).sum(1)


def _sum_positions(t: Tensor, size: int) -> Tensor:
    """(b, *, *normalized_shape) → (b, size): the sum over positions; b = 0 works too."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]) // size, size).sum(1)


def _sum_spatial(t: Tensor, channels: int) -> Tensor:
    """(b, C, *spatial) → (b, C): the sum over spatial positions; b = 0 works too."""
    return t.reshape(t.shape[0], channels, math.prod(t.shape[2:])).sum(2)


def _affine_grads(
    call: Call,
    normalise: Callable[[Tensor], Tensor],
    position_sums: Callable[[Tensor], Tensor],
) -> dict[str, Tensor]:
    """Per-unit Σ_positions g ⊙ x̂ (weight) and Σ_positions g (bias), as (U, F) rows.

    ``position_sums`` sums a batch slice over its positions, (b, ...) → (b, features). x̂ and
    g ⊙ x̂ are formed one batch slice at a time, so their temporaries stay small (a batch small
    enough for one slice is read whole: no slicing, no join).
    """
    x, g = call.inputs[0], call.grads[0]
    out = {}
    if "weight" in call.trainable:
        slices = batch_slices(x)
        if len(slices) == 1:
            rows = position_sums(g * normalise(x))
        else:
            rows = torch.cat([position_sums(g[s] * normalise(x[s])) for s in slices])
        out["weight"] = _per_unit(rows, call.group)
    if "bias" in call.trainable:
        out["bias"] = _per_unit(position_sums(g), call.group)
    return out


class _AffineRule(LayerRule):
    """Shared shape of the normalisation rules: small per-unit gradients formed explicitly."""

    @staticmethod
    def unit_grads(layer: nn.Module, call: Call) -> dict[str, Tensor]:
        """Per-unit gradients (U, F) of the layer's trainable affine parameters, by name."""
        raise NotImplementedError

    @classmethod
    def per_example_grads(  # type: ignore[override]
        cls, layer: nn.Module, call: Call
    ) -> dict[str, Tensor] | None:
        """Always: one feature vector per example, smaller than the activations."""
        return cls.unit_grads(layer, call)

    @classmethod
    def sq_norms(cls, layer: nn.Module, call: Call) -> Tensor:  # type: ignore[override]
        """Sum of squares of the per-unit affine gradients."""
        total: Tensor | None = None
        for g in cls.unit_grads(layer, call).values():  # not sum(): that would add 0 + the first
            sq = sq_norm(g, 1)
            total = sq if total is None else total + sq
        assert total is not None, "a normalisation layer with no trainable parameter"
        return total

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
        size = math.prod(layer.normalized_shape)
        return _affine_grads(
            call,
            lambda x: F.layer_norm(x, layer.normalized_shape, eps=layer.eps),
            lambda t: _sum_positions(t, size),
        )


@register_rule(nn.RMSNorm)
class RMSNormRule(_AffineRule):
    """RMSNorm: x̂ = x / rms(x) without weight; the weight spans ``normalized_shape``."""

    @staticmethod
    def unit_grads(layer: nn.Module, call: Call) -> dict[str, Tensor]:
        """Per-unit Σ g ⊙ x̂ over the leading (position) dims."""
        size = math.prod(layer.normalized_shape)
        return _affine_grads(
            call,
            lambda x: F.rms_norm(x, layer.normalized_shape, eps=layer.eps),
            lambda t: _sum_positions(t, size),
        )


@register_rule(nn.GroupNorm)
class GroupNormRule(_AffineRule):
    """GroupNorm: parameters are per channel (dim 1), summed over spatial positions."""

    channels_first = True

    @staticmethod
    def unit_grads(layer: nn.Module, call: Call) -> dict[str, Tensor]:
        """Per-unit Σ_spatial g ⊙ x̂ and Σ_spatial g per channel."""
        channels = call.inputs[0].shape[1]
        return _affine_grads(
            call,
            lambda x: F.group_norm(x, layer.num_groups, eps=layer.eps),
            lambda t: _sum_spatial(t, channels),
        )


@register_rule(
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    # the classes they are swapped for while attached (see dpfy.train.grads.substitutions)
    EmptyBatchInstanceNorm1d,
    EmptyBatchInstanceNorm2d,
    EmptyBatchInstanceNorm3d,
)
class InstanceNormRule(_AffineRule):
    """InstanceNorm (affine, no running statistics): GroupNorm with one channel per group."""

    channels_first = True

    @staticmethod
    def unsupported_reason(layer: nn.Module) -> str | None:
        """Running statistics are averages over private batches, outside clipping and noise."""
        if layer.track_running_stats:
            return "track_running_stats=True averages private batches (dpfy.fix drops it)"
        return None

    @staticmethod
    def unit_grads(layer: nn.Module, call: Call) -> dict[str, Tensor]:
        """Per-unit Σ_spatial g ⊙ x̂ and Σ_spatial g per channel.

        x̂ comes from ``group_norm`` with C groups, the same statistics (per example and
        channel, biased variance): torch's ``instance_norm`` raises on an empty batch.
        """
        channels = call.inputs[0].shape[1]
        return _affine_grads(
            call,
            lambda x: F.group_norm(x, channels, eps=layer.eps),
            lambda t: _sum_spatial(t, channels),
        )
