"""Per-unit norms and weighted sums of gradients of the form ``Σ_t g_t a_tᵀ`` (Linear, Conv, ...).

For a layer ``y_t = W a_t + b`` applied at positions t of one unit, the unit's weight gradient is
``G = Σ_t g_t a_tᵀ`` with ``g_t = ∂L/∂y_t``. Its squared Frobenius norm is computed either
*directly* (form G, p·d numbers per unit) or by the *ghost norm* identity
``‖G‖²_F = ⟨A Aᵀ, Γ Γᵀ⟩`` (Li et al. 2022, "Large language models can be strong differentially
private learners"), which only forms T×T Gram matrices. The clipped sum over units is one matrix
product ``Aᵀ diag(c) Γ`` ("book-keeping", Bu et al. 2023, "Differentially Private Optimization on
Large Model at Small Cost"), so per-unit gradients are never kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpfy.train.grads.norms import sq_norm
from dpfy.train.grads.rows import weighted_rows

__all__ = [
    "as_dtype",
    "bias_sq_norms",
    "direct_sq_norms",
    "ghost_sq_norms",
    "gram",
    "position_sum",
    "product_into",
    "use_ghost",
    "weight_sq_norms",
    "weighted_bias_sum",
    "weighted_rows",
    "weighted_weight_sum",
]


def use_ghost(positions: int, d_in: int, d_out: int) -> bool:
    """Ghost norm is cheaper when two T×T Grams are smaller than one p×d gradient per unit."""
    return 2 * positions * positions < d_in * d_out


def gram(x: Tensor) -> Tensor:
    """Per-unit Gram matrix over positions: (U, T, d) → (U, T, T)."""
    return torch.bmm(x, x.transpose(1, 2))


def ghost_sq_norms(a: Tensor, g: Tensor, a_gram: Tensor | None = None) -> Tensor:
    """‖Σ_t g_t a_tᵀ‖² per unit via Gram matrices: a (U, T, d), g (U, T, p) → (U,).

    ``a_gram`` may carry ``gram(a)`` when several maps share the input (attention's q, k, v).
    """
    return ((gram(a) if a_gram is None else a_gram) * gram(g)).sum((1, 2))


def direct_sq_norms(a: Tensor, g: Tensor) -> Tensor:
    """‖Σ_t g_t a_tᵀ‖² per unit by forming each unit's p×d gradient: (U, T, d), (U, T, p) → (U,)."""
    return sq_norm(torch.bmm(g.transpose(1, 2), a), (1, 2))


def weight_sq_norms(
    a: Tensor, g: Tensor, a_gram: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Per-unit squared weight-gradient norms by the cheapest exact route for these shapes.

    Returns the norms and, when the direct route formed them anyway, the per-unit gradients
    (U, p, d) so that the clipped sum can reuse them instead of a second matrix product.
    """
    positions = a.shape[1]
    if positions == 1:  # rank one: ‖g aᵀ‖ = ‖g‖·‖a‖
        return sq_norm(a[:, 0], 1) * sq_norm(g[:, 0], 1), None
    if use_ghost(positions, a.shape[2], g.shape[2]):
        return ghost_sq_norms(a, g, a_gram), None
    grads = torch.bmm(g.transpose(1, 2), a)
    return sq_norm(grads, (1, 2)), grads


def position_sum(g: Tensor) -> Tensor:
    """Σ_t g_t, each unit's bias gradient: (U, T, p) → (U, p), no reduction kernel when T = 1."""
    return g[:, 0] if g.shape[1] == 1 else g.sum(1)


def bias_sq_norms(g: Tensor, cache: dict[str, Tensor] | None = None, key: str = "bias") -> Tensor:
    """Per-unit squared norm of the bias gradient Σ_t g_t: (U, T, p) → (U,).

    With ``cache``, the per-unit bias gradients are kept there under ``key`` for
    :func:`weighted_bias_sum` (the position sum reads the whole output gradient once, not twice).
    """
    unit_grads = position_sum(g)
    if cache is not None and g.shape[1] > 1:
        cache[key] = unit_grads
    return sq_norm(unit_grads, 1)


def weighted_weight_sum(
    a: Tensor,
    g: Tensor,
    weights: Tensor,
    unit_grads: Tensor | None = None,
    into: Tensor | None = None,
) -> Tensor:
    """Σ_u w_u Σ_t g_ut a_utᵀ as one matrix product: (U, T, d), (U, T, p), (U,) → (p, d).

    With ``unit_grads`` (U, p, d) from :func:`weight_sq_norms`, a weighted sum of those instead.
    With ``into`` ((p, d) running sum) the sum is added into it in place (no (p, d) temporary)
    and returned.
    """
    if unit_grads is not None:
        total = torch.tensordot(weights.to(unit_grads.dtype), unit_grads, dims=1)
        return total if into is None else into.add_(total)
    w = weights.to(a.dtype)[:, None, None]
    if a.shape[2] <= g.shape[2]:
        a = a * w
    else:
        g = g * w
    return product_into(g.reshape(-1, g.shape[2]).t(), a.reshape(-1, a.shape[2]), into)


def product_into(left: Tensor, right: Tensor, into: Tensor | None) -> Tensor:
    """``left @ right``, or added into ``into`` in place (one product, no temporary)."""
    if into is None:
        return left @ right
    if into.dtype != left.dtype:
        return into.add_(left @ right)
    return into.addmm_(left, right)


def weighted_bias_sum(
    g: Tensor,
    weights: Tensor,
    cache: dict[str, Tensor] | None = None,
    key: str = "bias",
    into: Tensor | None = None,
) -> Tensor:
    """Σ_u w_u Σ_t g_ut: (U, T, p), (U,) → (p,) (from ``cache[key]`` if bias_sq_norms left it).

    With ``into`` ((p,) running sum) the sum is added into it in place (one matrix-vector
    product, no (p,) temporary) and returned.
    """
    unit_grads = cache[key] if cache is not None and key in cache else position_sum(g)
    return weighted_rows(unit_grads, weights, into)


def as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype`` (itself when it is in it already: no call into torch)."""
    return x if x.dtype == dtype else x.to(dtype)
