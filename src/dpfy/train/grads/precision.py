"""The engines' arithmetic precision: float32 at least, whatever precision the model runs in.

Under ``torch.autocast`` (bf16/fp16) a layer's captured input may be float32 while its output
gradient is bf16, and with bf16 weights everything is bf16. The engines compute per-unit norms
and clipped sums in :func:`compute_dtype` (float32; float64 for a float64 model) with autocast
switched off, and keep each running sum in it, so that a clip factor is not rounded to 8 bits
of mantissa before it scales a gradient (which could lift a clipped norm above C) and the sum
over a batch does not lose the small terms. Only the finished (noised) sum is cast to the
parameter's dtype: post-processing of what was released.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "LOW_PRECISION",
    "autocast_as",
    "autocast_dtype",
    "autocast_off",
    "compute_dtype",
    "is_low",
]

#: Floating dtypes whose rounding (unit roundoff 2⁻⁸ for bf16, 2⁻¹¹ for fp16) the engines never
#: compute norms or sums in.
LOW_PRECISION = (torch.bfloat16, torch.float16)

#: Device types whose autocast state the engines read and switch off.
_DEVICE_TYPES = ("cpu", "cuda")


def is_low(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a half-precision float (bf16 or fp16)."""
    return dtype in LOW_PRECISION


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype the engines compute in for tensors of ``dtypes``: float32 or wider."""
    out = torch.float32
    for dtype in dtypes:
        if dtype.is_floating_point or dtype.is_complex:
            out = torch.promote_types(out, dtype)
    return out


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type`` now (None: autocast is off there)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


@contextlib.contextmanager
def autocast_off(*device_types: str) -> Iterator[None]:
    """Autocast switched off wherever it is on (CPU, CUDA and ``device_types``)."""
    with contextlib.ExitStack() as stack:
        for device_type in dict.fromkeys((*_DEVICE_TYPES, *device_types)):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


@contextlib.contextmanager
def autocast_as(device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    """Autocast on ``device_type`` to ``dtype`` (None: nothing), to replay a layer's forward."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type, dtype=dtype):
        yield
