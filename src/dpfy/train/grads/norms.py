"""Squared L2 norms over chosen dimensions, in one pass.

``x.square().sum(dims)`` materialises a squared copy of ``x`` before reducing it; for per-example
gradients of a convolution that copy is as large as all of them. ``torch.linalg.vector_norm``
reduces in one pass, about three times faster on CPU, with float32 rounding of the same order.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sq_norm(x: Tensor, dim: int | tuple[int, ...]) -> Tensor:
    """Σ x² over ``dim`` without a squared temporary of ``x``."""
    return torch.linalg.vector_norm(x, dim=dim).square()
