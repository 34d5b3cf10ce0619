"""Rule for ``nn.Conv1d`` and ``nn.Conv2d``: a convolution is a Linear map on unfolded patches.

Unfolding the (padded) input into patches turns each output position into one position of a
Linear layer per group, so the ``_bilinear`` norms (direct or ghost) and book-keeping sums apply
with T = number of output positions, d = in_channels/groups · kernel size, p = out_channels/groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpfy.grads.capture import Call
from dpfy.grads.layout import group_positions
from dpfy.grads.registry import LayerRule, register_rule
from dpfy.grads.rules._bilinear import (
    bias_sq_norms,
    weight_sq_norms,
    weighted_bias_sum,
    weighted_weight_sum,
)


def _as_2d(layer: nn.Module, x: Tensor) -> tuple[Tensor, tuple[tuple[int, int], ...]]:
    """The input padded as the layer pads it, viewed as 2-D, with kernel/dilation/stride pairs."""
    pad = layer._reversed_padding_repeated_twice
    if any(pad):
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        x = F.pad(x, pad, mode=mode)
    if isinstance(layer, nn.Conv1d):
        x = x.unsqueeze(2)
        geometry = ((1, *layer.kernel_size), (1, *layer.dilation), (1, *layer.stride))
    else:
        geometry = (layer.kernel_size, layer.dilation, layer.stride)
    return x, geometry  # type: ignore[return-value]


def _patches_and_grads(layer: nn.Module, call: Call) -> tuple[Tensor, Tensor]:
    """Unit-major linear form: patches (U·G, T, d_g) and output gradients (U·G, T, p_g)."""
    x, (kernel, dilation, stride) = _as_2d(layer, call.inputs[0])
    groups = layer.groups
    batch = x.shape[0]
    cols = F.unfold(x, kernel, dilation=dilation, stride=stride)  # (B, C·k, T)
    positions = cols.shape[-1]
    a = cols.reshape(batch, groups, -1, positions).transpose(2, 3)  # (B, G, T, d_g)
    g = call.grads[0].reshape(batch, groups, -1, positions).transpose(2, 3)  # (B, G, T, p_g)
    k = call.group
    if k > 1:  # merge each microbatch's positions: (B, G, T, ·) → (U, G, k·T, ·)
        a = group_positions(a.transpose(1, 2), k).transpose(1, 2)
        g = group_positions(g.transpose(1, 2), k).transpose(1, 2)
    return a.reshape(-1, a.shape[2], a.shape[3]), g.reshape(-1, g.shape[2], g.shape[3])


@register_rule(nn.Conv1d, nn.Conv2d)
class ConvRule(LayerRule):
    """Per group: weight gradient Σ_t g_t a_tᵀ over output positions; bias Σ_t g_t."""

    channels_first = True

    @staticmethod
    def sq_norms(layer: nn.Module, call: Call) -> Tensor:
        """Weight norms summed over groups, plus bias norms over all output channels."""
        a, g = _patches_and_grads(layer, call)
        groups = layer.groups
        total = a.new_zeros(a.shape[0] // groups)
        if "weight" in call.trainable:
            total = total + weight_sq_norms(a, g).reshape(-1, groups).sum(1)
        if "bias" in call.trainable:
            total = total + bias_sq_norms(g).reshape(-1, groups).sum(1)
        return total

    @staticmethod
    def clipped_sum(layer: nn.Module, call: Call, weights: Tensor) -> dict[str, Tensor]:
        """Book-keeping per group, reassembled into the weight's (C_out, C_in/G, *k) shape."""
        a, g = _patches_and_grads(layer, call)
        groups = layer.groups
        units = a.shape[0] // groups
        a = a.reshape(units, groups, *a.shape[1:])
        g = g.reshape(units, groups, *g.shape[1:])
        out = {}
        if "weight" in call.trainable:
            parts = [weighted_weight_sum(a[:, j], g[:, j], weights) for j in range(groups)]
            out["weight"] = torch.cat(parts).reshape(layer.weight.shape)
        if "bias" in call.trainable:
            out["bias"] = weighted_bias_sum(g.transpose(1, 2).flatten(2), weights)
        return out
