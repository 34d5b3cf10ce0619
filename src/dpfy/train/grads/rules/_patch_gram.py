"""The Gram matrix of a convolution's input patches, formed without unfolding the patches.

The ghost norm of a convolution (Li et al. 2022; Bu et al. 2023) needs, per example and group,
``A Aᵀ[t, s] = ⟨a_t, a_s⟩`` over output positions t, s, where the patch a_t holds every input
channel under the kernel at t. Unfolding copies each input value once per kernel offset, in one
pass that torch runs on a single thread. The same Gram is a sum over kernel offsets k of
``⟨x_{t+k}, x_{s+k}⟩``: with the Gram of the padded input's positions, ``P[u, v] = ⟨x_u, x_v⟩``
(one batched product over channels), A Aᵀ is the sum over kernel offsets of strided blocks of P.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["patch_gram", "use_position_gram"]


def use_position_gram(padded: Sequence[int], out: Sequence[int], patch: int) -> bool:
    """Whether P, (H_p·W_p)² numbers per unit, holds at most twice the unfold route's numbers.

    Unfolding holds T·d patch values and the T² Gram per unit (d = ``patch``, the values under
    the kernel). Twice that admits the padding and the strided layers of small inputs, where
    P is also faster than unfolding (docs/performance.md); it refuses a strided layer on a large
    input, whose P would hold ≈ 16 T² numbers per unit.
    """
    positions, padded_positions = math.prod(out), math.prod(padded)
    return padded_positions * padded_positions <= 2 * positions * (patch + positions)


def patch_gram(
    x: Tensor,
    groups: int,
    out: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
) -> Tensor:
    """(B·G, T, T): the Gram of each example's and group's patches of a padded 2-D input.

    ``x`` is (B, C, H_p, W_p), padded as the convolution reads it; ``out`` is the output's
    (H, W). Position (i, j) of the output reads input position (i·s + k·d) along each axis.
    """
    batch, channels, height, width = x.shape
    units = batch * groups
    flat = x.reshape(units, channels // groups, height * width)
    positions = torch.bmm(flat.transpose(1, 2), flat).view(units, height, width, height, width)
    gram = x.new_zeros((units, out[0], out[1], out[0], out[1]))
    for i in range(kernel[0]):
        rows = slice(i * dilation[0], i * dilation[0] + stride[0] * (out[0] - 1) + 1, stride[0])
        for j in range(kernel[1]):
            cols = slice(j * dilation[1], j * dilation[1] + stride[1] * (out[1] - 1) + 1, stride[1])
            gram.add_(positions[:, rows, cols, rows, cols])
    return gram.view(units, out[0] * out[1], out[0] * out[1])
