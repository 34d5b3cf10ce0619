"""Rule for ``nn.Conv1d`` and ``nn.Conv2d``.

A convolution is a Linear map applied to input patches: with T output positions, patches of
d = in_channels/groups · kernel size and p = out_channels/groups outputs per group, a unit's weight
gradient is Σ_t g_t a_tᵀ per group. Two exact routes, chosen by the ``_bilinear`` cost formula:

* direct (p·d ≤ 2T², the usual case): every example's weight gradient is the weight gradient of
  one convolution whose groups are the examples ("batch as groups", Rochette et al. 2019,
  "Efficient per-example gradient computations in convolutional neural networks"), one
  ``convolution_backward`` call, or for small inputs one batched product of unfolded patches
  and output gradients; the per-unit gradients are kept for the clipped sum;
* ghost (large kernels, few positions): Gram matrices of patches and output gradients (the
  patches' Gram summed from the Gram of the input's positions, :mod:`._patch_gram`, unless
  that would take more memory than unfolding the patches);
  the clipped sum is then the weight gradient of the convolution for output gradients scaled
  by the clip weights (book-keeping, Bu et al. 2023).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpfy.train.grads.capture import Call
from dpfy.train.grads.layout import SLICE_ABOVE_BYTES, batch_slices, group_positions
from dpfy.train.grads.norms import sq_norm
from dpfy.train.grads.registry import LayerRule, register_rule
from dpfy.train.grads.rows import Rows
from dpfy.train.grads.rules._bilinear import ghost_sq_norms, gram, use_ghost
from dpfy.train.grads.rules._patch_gram import patch_gram, use_position_gram


def _padded(layer: nn.Module, x: Tensor) -> tuple[Tensor, list[int]]:
    """The input padded as the layer's forward pads it, and the padding left for the conv op."""
    if layer.padding_mode != "zeros" or isinstance(layer.padding, str):
        pad = layer._reversed_padding_repeated_twice
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        return (F.pad(x, pad, mode=mode) if any(pad) else x), [0] * (x.dim() - 2)
    return x, list(layer.padding)


def _weight_grad(
    layer: nn.Module, x: Tensor, g: Tensor, groups: int, weight_shape: tuple[int, ...]
) -> Tensor:
    """The convolution's weight gradient for input x and output gradient g (one kernel call)."""
    x, padding = _padded(layer, x)
    # Only the weight's shape matters for its gradient: a zero-stride view allocates nothing.
    dummy = x.new_empty((1,) * len(weight_shape)).expand(weight_shape)
    return torch.ops.aten.convolution_backward(
        g,
        x,
        dummy,
        None,
        list(layer.stride),
        padding,
        list(layer.dilation),
        False,
        [0] * (x.dim() - 2),
        groups,
        [False, True, False],
    )[1]


def _per_example_weight_grads(layer: nn.Module, call: Call) -> Rows:
    """(B, C_out·C_in/G·k) per-example weight gradients.

    Inputs whose patches take more than ``SLICE_ABOVE_BYTES``: examples become convolution
    groups, in slices of the batch (the convolution kernel's working buffers scale with the
    slice, which keeps this step below the peak memory of the backward pass itself); the slices
    are returned as they are (:class:`Rows`), not joined. Smaller inputs: one batched product
    of the unfolded patches and the output gradients, the same gradients in a few kernels (a
    convolution of B·G groups costs several times that at these sizes on a CPU).
    """
    x, g = call.inputs[0], call.grads[0]
    if x.shape[0] == 0:  # no examples: no rows (a convolution of zero groups is refused)
        return Rows((x.new_zeros((0, layer.weight.numel())),))
    if _patch_bytes(layer, x, g) <= SLICE_ABOVE_BYTES:
        if layer.groups == 1:  # (B, C_out, T) @ (B, T, C_in·k): no per-group views
            cols = _unfold(layer, x)
            grads = torch.bmm(g.reshape(g.shape[0], g.shape[1], -1), cols.transpose(1, 2))
        else:
            a, gg = _patches(layer, x, g)  # (B·G, T, d_g), (B·G, T, p_g)
            grads = torch.bmm(gg.transpose(1, 2), a)
        return Rows((grads.reshape(x.shape[0], -1),))
    parts = []
    for part in batch_slices(x):
        xs, gs = x[part], g[part]
        size = xs.shape[0]
        grads = _weight_grad(
            layer,
            xs.reshape(1, -1, *xs.shape[2:]),
            gs.reshape(1, -1, *gs.shape[2:]),
            size * layer.groups,
            (size * layer.weight.shape[0], *layer.weight.shape[1:]),
        )
        parts.append(grads.reshape(size, -1))
    return Rows(tuple(parts))


def _patch_bytes(layer: nn.Module, x: Tensor, g: Tensor) -> int:
    """Bytes of the unfolded patches of ``x``: B · C_in·k · T (T read from the output grad)."""
    patch = math.prod(layer.weight.shape[1:]) * layer.groups  # C_in · kernel size
    return x.shape[0] * patch * math.prod(g.shape[2:]) * x.element_size()


def _unfold(layer: nn.Module, x: Tensor) -> Tensor:
    """The input's patches as the layer's forward reads them: (B, C_in·k, T)."""
    x, _ = _padded(layer, x)
    kernel, dilation, stride = layer.kernel_size, layer.dilation, layer.stride
    padding = layer.padding if not isinstance(layer.padding, str) else (0,) * len(kernel)
    if layer.padding_mode != "zeros" or isinstance(layer.padding, str):
        padding = (0,) * len(kernel)
    if isinstance(layer, nn.Conv1d):  # view as 2-D with a height of one
        x = x.unsqueeze(2)
        kernel, dilation, stride = (1, *kernel), (1, *dilation), (1, *stride)
        padding = (0, *padding)
    return F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)


def _patches(layer: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Per example and group: patches (B·G, T, d_g) and output gradients (B·G, T, p_g).

    Both are transposed views of channel-major tensors (the unfolded input, the output
    gradient), not copies: Gram matrices and products read them as they lie.
    """
    cols = _unfold(layer, x)  # (B, C·k, T), each group's channels contiguous
    units = x.shape[0] * layer.groups  # explicit: B may be 0
    positions = cols.shape[-1]
    d_g, p_g = cols.shape[1] // layer.groups, layer.out_channels // layer.groups
    a = cols.reshape(units, d_g, positions).transpose(1, 2)
    g = g.reshape(units, p_g, positions).transpose(1, 2)
    return a, g


def _patches_and_grads(layer: nn.Module, call: Call) -> tuple[Tensor, Tensor]:
    """Per unit and group: patches (U·G, T, d_g) and output gradients (U·G, T, p_g)."""
    a, g = _patches(layer, call.inputs[0], call.grads[0])
    if call.group == 1:
        return a, g
    # Merge each microbatch's positions: (B, G, T, ·) → (U, G, k·T, ·).
    batch, groups = call.inputs[0].shape[0], layer.groups
    a, g = (t.reshape(batch, groups, *t.shape[1:]).transpose(1, 2) for t in (a, g))
    a = group_positions(a, call.group).transpose(1, 2)
    g = group_positions(g, call.group).transpose(1, 2)
    return a.reshape(-1, *a.shape[2:]), g.reshape(-1, *g.shape[2:])


def _ghost_sq_norms(layer: nn.Module, call: Call) -> Tensor:
    """Per unit ‖Σ_t g_t a_tᵀ‖² = ⟨A Aᵀ, Γ Γᵀ⟩, summed over groups: (U,)."""
    patches_gram = _position_gram(layer, call)
    if patches_gram is None:
        norms = ghost_sq_norms(*_patches_and_grads(layer, call))
    else:
        g = call.grads[0]
        units, positions = g.shape[0] * layer.groups, math.prod(g.shape[2:])
        grads = g.reshape(units, layer.out_channels // layer.groups, positions).transpose(1, 2)
        norms = (patches_gram * gram(grads)).sum((1, 2))
    return norms.reshape(-1, layer.groups).sum(1)


def _position_gram(layer: nn.Module, call: Call) -> Tensor | None:
    """Each example's patches' Gram (B·G, T, T) from the input positions' Gram, or None.

    None for microbatches (a unit's positions span several examples' inputs) and where P
    would hold much more than the unfolded patches (strided layers on large inputs).
    """
    x, out = call.inputs[0], tuple(call.grads[0].shape[2:])
    if call.group > 1 or not use_position_gram(
        _padded_size(layer, x), out, math.prod(layer.weight.shape[1:])
    ):
        return None
    x = _fully_padded(layer, x)
    kernel, stride, dilation = layer.kernel_size, layer.stride, layer.dilation
    if isinstance(layer, nn.Conv1d):  # as 2-D with a height of one
        x = x.unsqueeze(2)
        kernel, stride, dilation, out = (1, *kernel), (1, *stride), (1, *dilation), (1, *out)
    return patch_gram(x, layer.groups, out, kernel, stride, dilation)


def _padded_size(layer: nn.Module, x: Tensor) -> tuple[int, ...]:
    """The input's spatial size once padded as the forward pads it, without padding it."""
    pad = layer._reversed_padding_repeated_twice  # (before, after) per dim, last dim first
    dims = x.shape[2:]
    return tuple(
        size + pad[2 * (len(dims) - 1 - i)] + pad[2 * (len(dims) - 1 - i) + 1]
        for i, size in enumerate(dims)
    )


def _fully_padded(layer: nn.Module, x: Tensor) -> Tensor:
    """The input with all the padding the forward applies, zeros included."""
    x, padding = _padded(layer, x)
    if any(padding):
        x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])
    return x


def _ghost(layer: nn.Module, call: Call) -> bool:
    """Whether the ghost route is cheaper for this layer's shapes."""
    positions = math.prod(call.grads[0].shape[2:])  # from the shape: the batch may be empty
    d_in = math.prod(layer.weight.shape[1:])  # from the shape: no indexing call into torch
    return use_ghost(positions * call.group, d_in, layer.weight.shape[0] // layer.groups)


def _position_sums(g: Tensor) -> Tensor:
    """(B, C, *positions) → (B, C): each example's bias gradient, in one reduction."""
    return g.sum(tuple(range(2, g.dim())))


def _per_unit(x: Tensor, group: int) -> Tensor:
    """(B, F) per-example rows → (U, F) sums of ``group`` consecutive rows."""
    return x if group == 1 else x.reshape(x.shape[0] // group, group, x.shape[1]).sum(1)


@register_rule(nn.Conv1d, nn.Conv2d)
class ConvRule(LayerRule):
    """Per group: weight gradient Σ_t g_t a_tᵀ over output positions; bias Σ_t g_t."""

    channels_first = True

    @staticmethod
    def per_example_grads(layer: nn.Module, call: Call) -> dict[str, Tensor | Rows] | None:
        """On the direct route, per-example gradients are smaller than the activations."""
        if "weight" in call.trainable and _ghost(layer, call):
            return None
        out: dict[str, Tensor | Rows] = {}
        if "weight" in call.trainable:
            out["weight"] = _per_example_weight_grads(layer, call)
        if "bias" in call.trainable:
            out["bias"] = _position_sums(call.grads[0])
        return out

    @staticmethod
    def sq_norms(layer: nn.Module, call: Call) -> Tensor:
        """Weight norms (direct or ghost) plus bias norms, per unit."""
        g = call.grads[0]
        total = g.new_zeros(call.num_units)
        if "weight" in call.trainable:
            if _ghost(layer, call):
                total = total + _ghost_sq_norms(layer, call)
            else:
                unit_grads = _per_unit(_per_example_weight_grads(layer, call).joined(), call.group)
                call.cache["weight"] = unit_grads
                total = total + sq_norm(unit_grads, 1)
        if "bias" in call.trainable:
            bias = _per_unit(_position_sums(g), call.group)
            call.cache["bias"] = bias
            total = total + sq_norm(bias, 1)
        return total

    @staticmethod
    def clipped_sum(layer: nn.Module, call: Call, weights: Tensor) -> dict[str, Tensor]:
        """Weighted sums of kept per-unit gradients, or the weight gradient of scaled g."""
        out = {}
        if "weight" in call.trainable:
            if "weight" in call.cache:
                summed = weights.to(call.cache["weight"].dtype) @ call.cache["weight"]
            else:
                per_example = weights.repeat_interleave(call.group).to(call.grads[0].dtype)
                g = call.grads[0] * per_example.view(-1, *[1] * (call.grads[0].dim() - 1))
                summed = _weight_grad(layer, call.inputs[0], g, layer.groups, layer.weight.shape)
            out["weight"] = summed.reshape(layer.weight.shape)
        if "bias" in call.trainable:
            out["bias"] = weights.to(call.cache["bias"].dtype) @ call.cache["bias"]
        return out
