"""Per-unit norms of a parameter shared by several layers: the norm of the summed gradient.

A parameter used by two layers (tied input and output embeddings) has per-unit gradient
``G = G₁ + G₂``, and DP-SGD clips ``‖G‖``, not ``‖G₁‖ + ‖G₂‖``:
``‖G‖² = ‖G₁‖² + ‖G₂‖² + 2⟨G₁, G₂⟩``. The layers' own rules give the first two terms; this module
gives the cross term without forming either gradient. Each rule writes its unit gradient as
``G = Σ_t L_t R_tᵀ`` (:meth:`dpfy.train.grads.registry.LayerRule.factors`), so

    ⟨Σ_t L_t R_tᵀ, Σ_s L'_s R'_sᵀ⟩ = Σ_{t,s} ⟨L_t, L'_s⟩ · ⟨R_t, R'_s⟩,

a sum over T×T' products (the ghost-norm identity of Li et al. 2022 applied to two layers). An
embedding's ``L_t`` is the one-hot row of its index, so ``⟨L_t, L'_s⟩`` is ``L'_s`` read at that
index (or, against another embedding, whether the two indices are equal).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cross_inner_products"]


def _is_index(x: Tensor) -> bool:
    """Whether a left factor holds row indices (one-hot rows) rather than dense rows."""
    return not (x.is_floating_point() or x.is_complex())


def _left_products(left: Tensor, other: Tensor) -> Tensor:
    """⟨L_t, L'_s⟩ for every pair of positions: (U, T, ·), (U, T', ·) → (U, T, T')."""
    if _is_index(left) and _is_index(other):
        return left.unsqueeze(2) == other.unsqueeze(1)  # the caller casts it
    if _is_index(left):  # ⟨onehot(i_t), L'_s⟩ = L'_s[i_t]
        index = left.unsqueeze(1).expand(-1, other.shape[1], -1)  # (U, T', T)
        return torch.gather(other, 2, index).transpose(1, 2)
    if _is_index(other):
        return _left_products(other, left).transpose(1, 2)
    return torch.bmm(left, other.transpose(1, 2))


def cross_inner_products(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> Tensor:
    """⟨G_u, G'_u⟩ per unit for two factored unit gradients of one parameter, (U,).

    ``first`` and ``second`` are ``(L, R)`` pairs as :meth:`LayerRule.factors` returns them,
    laid out over the same units.
    """
    (left, right), (left2, right2) = first, second
    rights = torch.bmm(right, right2.transpose(1, 2))
    lefts = _left_products(left, left2)
    return (lefts.to(rights.dtype) * rights).sum((1, 2))
