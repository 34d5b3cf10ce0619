"""Bring captured calls into the layout rules expect: batch first, whole microbatches, no Nones."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import Tensor

from dpfy.train.grads.capture import Call
from dpfy.train.grads.precision import compute_dtype

__all__ = [
    "BATCH_SLICES",
    "Units",
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


@dataclasses.dataclass(frozen=True)
class Units:
    """How the n examples of a batch form clipping units: examples, microbatches or users.

    ``index[i]`` is the unit (0..U-1) of example i and ``sizes[u]`` the number of examples in
    unit u. Rules read a *padded, unit-major* layout of ``U · width`` rows, in which unit u owns
    rows ``u·width … u·width + width - 1`` and unused rows are zero examples (which contribute
    nothing to any gradient): ``slots[i]`` is example i's row there, or None when the examples
    already lie in that order and only the tail needs padding (per-example and microbatch units).

    Consecutive units (:meth:`consecutive`) hold only ``examples`` and ``width``; their ``index``
    and ``sizes`` tensors are formed when first read (the fast engine's per-example step reads
    neither, and each is a tensor allocation per step). They are a function of those two frozen
    fields alone, so once formed they cannot go stale.
    """

    examples: int
    width: int
    slots: Tensor | None = None
    ids: Tensor | None = dataclasses.field(default=None, repr=False)  # ``index`` of from_ids
    counts: Tensor | None = dataclasses.field(default=None, repr=False)  # ``sizes`` of from_ids

    @classmethod
    def consecutive(cls, n: int, group: int) -> Units:
        """Groups of ``group`` consecutive examples; a last, smaller group keeps its own size."""
        return cls(n, group)

    @classmethod
    def from_ids(cls, ids: Tensor) -> Units:
        """One unit per distinct id (any order, any sizes); units are numbered by sorted id."""
        ids = ids.detach().to("cpu", torch.int64)
        distinct, index = torch.unique(ids, return_inverse=True)
        sizes = torch.bincount(index, minlength=distinct.numel())
        width = int(sizes.max())
        order = torch.argsort(index, stable=True)
        starts = torch.cumsum(sizes, 0) - sizes
        rank = torch.empty_like(index)
        rank[order] = torch.arange(ids.numel()) - starts[index[order]]
        slots = index * width + rank
        in_place = bool(torch.equal(slots, torch.arange(ids.numel())))
        return cls(ids.numel(), width, None if in_place else slots, index, sizes)

    @functools.cached_property
    def index(self) -> Tensor:
        """(n,) the unit of each example."""
        if self.ids is not None:
            return self.ids
        if self.width == 1:
            return torch.arange(self.examples)
        return torch.arange(self.examples) // self.width

    @functools.cached_property
    def sizes(self) -> Tensor:
        """(U,) the number of examples in each unit."""
        if self.counts is not None:
            return self.counts
        if self.width == 1:
            return torch.ones(self.examples, dtype=torch.int64)
        count = self.count
        sizes = torch.full((count,), self.width, dtype=torch.int64)
        sizes[-1] = self.examples - (count - 1) * self.width
        return sizes

    @property
    def count(self) -> int:
        """U, the number of clipping units."""
        if self.counts is not None:
            return int(self.counts.numel())
        return -(-self.examples // self.width)

    @property
    def rows(self) -> int:
        """Rows of the padded layout, ``U · width``."""
        return self.count * self.width

    def place(self, x: Tensor) -> Tensor:
        """(n, ...) batch-first rows → (U·width, ...) padded unit-major rows."""
        if self.slots is None:
            return pad_batch(x, self.rows)
        out = x.new_zeros((self.rows, *x.shape[1:]))
        out[self.slots.to(x.device)] = x
        return out

    def sum_rows(self, x: Tensor) -> Tensor:
        """(n, ...) per-example rows → (U, ...) per-unit sums."""
        if self.width == 1 and self.slots is None:
            return x
        return self.place(x).reshape(self.count, self.width, *x.shape[1:]).sum(1)

    def expand(self, weights: Tensor) -> Tensor:
        """(U,) per-unit weights → (n,) the weight of each example's unit."""
        return weights[self.index.to(weights.device)]


def prepare_call(call: Call, batch_dim: int, units: Units | None = None) -> Call:
    """Move the batch dim first, zero-fill unused outputs, lay examples out by unit (padded).

    Floating tensors are brought to one dtype of at least float32 (under autocast an input
    may be float32 and its output gradient bf16; see :mod:`dpfy.train.grads.precision`). A new
    call, or ``call`` itself when it is in that layout already.
    """
    group = 1 if units is None else units.width
    per_example = units is None or (group == 1 and units.slots is None)
    cast = _cast_to(call)
    if not batch_dim and per_example and call.group == 1 and cast is None and _all_set(call.grads):
        return call  # already in the layout (batch first, one example per unit): the common case
    n = call.inputs[0].shape[batch_dim] if isinstance(call.inputs[0], Tensor) else None
    moved: dict[int, tuple[Tensor, Tensor]] = {}  # id → (tensor, moved): identical stay identical
    spread = n is not None and not per_example

    def move(x: Tensor) -> Tensor:
        if id(x) not in moved:  # the entry keeps x alive, so its id cannot be reused meanwhile
            y = x.movedim(batch_dim, 0) if batch_dim else x
            if cast is not None and y.is_floating_point():
                y = y.to(cast)
            if spread:
                y = units.place(y)
            moved[id(x)] = (x, y)
        return moved[id(x)][1]

    inputs = tuple(move(x) if isinstance(x, Tensor) else x for x in call.inputs)
    grads = [
        move(g if g is not None else torch.zeros(shape, dtype=dtype, device=device))
        for g, (shape, dtype, device) in zip(call.grads, call.out_meta, strict=True)
    ]
    return dataclasses.replace(call, inputs=inputs, grads=grads, group=group)


def _cast_to(call: Call) -> torch.dtype | None:
    """The dtype the call's floating tensors must be cast to (None: they are all in it)."""
    dtypes = [x.dtype for x in call.inputs if isinstance(x, Tensor) and x.is_floating_point()]
    dtypes += [meta[1] for meta in call.out_meta]
    target = compute_dtype(*dtypes)
    return None if all(dtype == target for dtype in dtypes) else target


def _all_set(grads: list[Tensor | None]) -> bool:
    """Whether every output gradient arrived (none is None)."""
    return all(grad is not None for grad in grads)


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
    """(B, *, d) → (B, T, d): every middle dim is a position (a 2-D input gets T = 1).

    T comes from the shape, not ``-1``: with B = 0 a reshape could not infer it.
    """
    return x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])


#: Large per-example reductions run over this many slices of the batch, so that their
#: temporaries stay a fraction of the activations they read (peak memory).
BATCH_SLICES = 4

#: Below this many bytes read, one slice: the temporaries are small anyway, and each slice costs
#: kernel launches (what a small model's step on a fast GPU is made of).
SLICE_ABOVE_BYTES = 1 << 20


def batch_slices(x: Tensor) -> list[slice]:
    """Up to ``BATCH_SLICES`` consecutive slices of ``x``'s batch (dim 0); one if ``x`` is small."""
    batch = x.shape[0]
    if x.numel() * x.element_size() <= SLICE_ABOVE_BYTES:
        return [slice(0, batch)]
    step = max(1, -(-batch // BATCH_SLICES))
    return [slice(start, start + step) for start in range(0, batch, step)]
