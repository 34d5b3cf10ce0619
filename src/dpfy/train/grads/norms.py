"""Squared L2 norms over chosen dimensions, in one pass.

``x.square().sum(dims)`` materialises a squared copy of ``x`` before reducing it; for per-example
gradients of a convolution that copy is as large as all of them. ``torch.linalg.vector_norm``
reduces in one pass, about three times faster on CPU, with float32 rounding of the same order.
Small tensors (a small model's per-example rows) are reduced by ``torch.linalg.vecdot`` instead:
one call into torch rather than two (the norm, then its square), and the squared copy it forms
is small. A half-precision tensor is reduced in float32 (``vector_norm``'s ``dtype``), never in
its own 8 or 11 bits of mantissa.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpfy.train.grads.precision import LOW_PRECISION

#: Up to this many elements (float32/float64, one reduced dim), ``vecdot`` reduces the tensor.
SMALL_NUMEL = 1 << 15

_VECDOT_DTYPES = (torch.float32, torch.float64)


def sq_norm(x: Tensor, dim: int | tuple[int, ...]) -> Tensor:
    """Σ x² over ``dim`` without a squared temporary of ``x`` (a small one for small ``x``)."""
    if type(dim) is int and x.dtype in _VECDOT_DTYPES and x.numel() <= SMALL_NUMEL:
        return torch.linalg.vecdot(x, x, dim=dim)
    if x.dtype in LOW_PRECISION:
        return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float32).square()
    return torch.linalg.vector_norm(x, dim=dim).square()
