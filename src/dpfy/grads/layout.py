"""Bring captured calls into the layout rules expect: batch first, whole microbatches, no Nones."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from dpfy.grads.capture import Call

__all__ = [
    "BATCH_SLICES",
    "batch_slices",
    "flatten_positions",
    "group_positions",
    "pad_batch",
    "prepare_call",
]


def pad_batch(x: Tensor, size: int) -> Tensor:
    """Append zero examples along dim 0 up to ``size`` (zero examples contribute nothing)."""
    missing = size - x.shape[0]
    if missing == 0:
        return x
    return torch.cat([x, x.new_zeros((missing, *x.shape[1:]))])


def prepare_call(call: Call, batch_dim: int, group: int) -> Call:
    """Move the batch dim first, zero-fill unused outputs, pad to whole microbatches."""
    n = call.inputs[0].shape[batch_dim] if isinstance(call.inputs[0], Tensor) else None
    moved: dict[int, tuple[Tensor, Tensor]] = {}  # id → (tensor, moved): identical stay identical

    def move(x: Tensor) -> Tensor:
        if id(x) not in moved:  # the entry keeps x alive, so its id cannot be reused meanwhile
            y = x.movedim(batch_dim, 0) if batch_dim else x
            if n is not None and group > 1:
                y = pad_batch(y, -(-n // group) * group)
            moved[id(x)] = (x, y)
        return moved[id(x)][1]

    inputs = tuple(move(x) if isinstance(x, Tensor) else x for x in call.inputs)
    grads = [
        move(g if g is not None else torch.zeros(shape, dtype=dtype, device=device))
        for g, (shape, dtype, device) in zip(call.grads, call.out_meta, strict=True)
    ]
    return dataclasses.replace(call, inputs=inputs, grads=grads, group=group)


def group_positions(x: Tensor, group: int) -> Tensor:
    """(B, T, ...) → (B/group, group·T, ...): a microbatch is one unit with all its positions.

    Every rule sums a parameter's gradient over positions, so the summed gradient of ``group``
    consecutive examples is the gradient of one "example" holding all their positions.
    """
    if group == 1:
        return x
    b, t = x.shape[:2]
    return x.reshape(b // group, group * t, *x.shape[2:])


def flatten_positions(x: Tensor) -> Tensor:
    """(B, *, d) → (B, T, d): every middle dim is a position (a 2-D input gets T = 1)."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


#: Large per-example reductions run over this many slices of the batch, so that their
#: temporaries stay a fraction of the activations they read (peak memory).
BATCH_SLICES = 4


def batch_slices(batch: int) -> list[slice]:
    """Up to ``BATCH_SLICES`` consecutive slices covering ``range(batch)``."""
    step = max(1, -(-batch // BATCH_SLICES))
    return [slice(start, start + step) for start in range(0, batch, step)]
