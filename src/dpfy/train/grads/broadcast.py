"""Layers called on an input the whole batch shares (position ids of shape (1, T)).

BERT and GPT-2 look their position embeddings up with ``position_ids`` of shape (1, T) and add
the (1, T, d) result to the (B, T, d) token embeddings: the layer's input is shared by every
example, and example i's gradient of the layer reaches it through row i of the broadcast sum. The
engines can only see that gradient if the layer's output holds the batch, so while an engine is
attached such an output is expanded to (B, ...) (a view, no copy) and the call's inputs with it:
an ordinary batch-B call whose examples share one input.

That is exact only where the expanded output is used as a broadcast: combined elementwise with a
tensor that holds the batch in the same dim. Other uses (indexing its first dim, concatenating
it, reducing over it, adding it to a tensor with more dims) would see B copies where the model
sees one, and could silently mix the examples' rows (clipping would then bound nothing). So the
output is a :class:`BatchBroadcast` tensor. Elementwise arithmetic with a batch tensor gives an
ordinary tensor with exactly the shape and values the model computes without dpfy; casts, and
arithmetic with other shared tensors, keep the mark; any other use raises, naming the layer and
the fix (pass the input with its batch dim, e.g. ``position_ids.expand(B, -1)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["BatchBroadcast", "SharedInputs", "expand_output", "mark", "shares_batch", "tensors_in"]

_BINARY = (
    "add",
    "sub",
    "subtract",
    "mul",
    "multiply",
    "div",
    "divide",
    "true_divide",
    "rsub",
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
)
_INTO_OTHER = ("add_", "sub_", "mul_", "div_", "__iadd__", "__isub__", "__imul__", "__itruediv__")
_CASTS = ("to", "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone", "detach")
_READS = (
    "register_hook",
    "dim",
    "size",
    "numel",
    "is_floating_point",
    "is_complex",
    "element_size",
    "stride",
    "is_contiguous",
    "storage_offset",
    "data_ptr",
    "untyped_storage",
    "__repr__",
    "__format__",
)


def _functions(names: tuple[str, ...]) -> frozenset[Callable[..., Any]]:
    """The torch functions and Tensor methods of these names."""
    return frozenset(
        getattr(owner, name) for owner in (torch, Tensor) for name in names if hasattr(owner, name)
    )


_BINARY_FUNCS = _functions(_BINARY)
_INTO_OTHER_FUNCS = _functions(_INTO_OTHER)
_CAST_FUNCS = _functions(_CASTS)
_READ_FUNCS = _functions(_READS)


def tensors_in(value: Any) -> Iterator[Tensor]:
    """Every tensor in a call's arguments (nested tuples, lists and dicts included)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def _shape_without_dpfy(x: Tensor) -> tuple[int, ...]:
    """The shape ``x`` has in the model run without dpfy (a marked tensor's first dim is 1)."""
    return (1, *x.shape[1:]) if isinstance(x, BatchBroadcast) else tuple(x.shape)


class BatchBroadcast(Tensor):
    """An output expanded to the batch from a layer's shared input; only broadcast uses pass."""

    dpfy_layer: str = "?"

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Let reads, casts and broadcast arithmetic through; refuse every other use."""
        kwargs = kwargs or {}
        if func in _READ_FUNCS or getattr(func, "__name__", "") == "__get__":
            return super().__torch_function__(func, types, args, kwargs)
        tensors = list(tensors_in((args, kwargs)))
        marked = [t for t in tensors if isinstance(t, BatchBroadcast)]
        layer = marked[0].dpfy_layer if marked else "?"
        if func in _CAST_FUNCS:
            result = super().__torch_function__(func, types, args, kwargs)
            if isinstance(result, BatchBroadcast):
                result.dpfy_layer = layer
            return result
        into_other = func in _INTO_OTHER_FUNCS and not isinstance(args[0], BatchBroadcast)
        if func in _BINARY_FUNCS or into_other:
            ndim = max(t.dim() for t in tensors)
            if all(t.dim() == ndim for t in marked):
                expected = torch.broadcast_shapes(*(_shape_without_dpfy(t) for t in tensors))
                result = _plain(super().__torch_function__(func, types, args, kwargs))
                if into_other:
                    return args[0]
                return result if tuple(result.shape) == tuple(expected) else mark(result, layer)
        raise RuntimeError(
            f"the output of layer '{layer}' was computed from an input with batch size 1 that "
            "every example shares (like position ids of shape (1, T)); dpfy gives that output "
            "the batch dim so that each example's gradient can be clipped, which is exact only "
            "when the output is combined elementwise with a tensor holding the batch in the same "
            f"dim (as in x + position_embeddings), but it was used in {_name(func)}. Pass the "
            "layer's input with its batch dim instead (e.g. position_ids.expand(batch_size, -1))"
        )


def _plain(x: Any) -> Any:
    """A tensor as an ordinary ``Tensor`` (same data and autograd history)."""
    return x.as_subclass(Tensor) if isinstance(x, BatchBroadcast) else x


def _name(func: Callable[..., Any]) -> str:
    """A torch function's name for the message."""
    return getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))


def mark(x: Tensor, layer: str) -> BatchBroadcast:
    """``x`` (an expanded output of layer ``layer``) as a :class:`BatchBroadcast`."""
    out = x.as_subclass(BatchBroadcast)
    out.dpfy_layer = layer
    return out


def shares_batch(x: Any, batch: int) -> Any:
    """``x`` expanded from batch size 1 to ``batch`` along dim 0 (a view), if it is a tensor so."""
    if isinstance(x, Tensor) and x.dim() >= 1 and x.shape[0] == 1:
        return x.expand(batch, *x.shape[1:])
    return x


def expand_output(x: Tensor, *, batch: int, layer: str) -> Tensor:
    """An output tensor of a shared-input call, expanded and marked (if it needs a gradient)."""
    return mark(shares_batch(x, batch), layer) if x.requires_grad else x


def _storage(x: Tensor) -> int:
    """Where a tensor's data lives (shared by its views and slices; 0 for no data)."""
    return x.untyped_storage().data_ptr()


class SharedInputs:
    """Tells, during one forward pass, which layer calls take an input the batch shares."""

    def __init__(self) -> None:
        self._batch: int | None = None  # batch size of this forward's calls (other than 1)
        self._root_batch: int | None = None  # batch size of the model's own first input
        self._root_data: frozenset[int] | None = None  # storages of its inputs holding the batch

    def reset(self) -> None:
        """Forget the last forward pass."""
        self._batch = self._root_batch = self._root_data = None

    def begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The model's forward begins: its first input tells the batch size."""
        self.reset()
        given = list(tensors_in((args, kwargs)))
        if given and given[0].dim() >= 1:
            self._root_batch = given[0].shape[0]
        batch = self._root_batch  # the inputs holding the batch (not shared ones, of size 1)
        held = [x for x in given if batch != 1 and x.dim() >= 1 and x.shape[0] == batch]
        self._root_data = frozenset(_storage(x) for x in held) - {0}

    def batch_for(self, layer: str, args: tuple[Any, ...], outputs: list[Tensor]) -> int | None:
        """The batch size to expand a call of batch size 1 to (None: it is no broadcast).

        A call whose first input has batch size 1 while this forward's other calls (or, before
        any, the model's first input) have B ≠ 1 shares that input across the batch, provided
        each of its outputs needing a gradient has batch size 1 too, and the model's forward
        was seen to begin. An input that is a slice of the model's own inputs (one example's
        data, reaching every example's loss) is refused: no clipping can bound that.
        """
        first = args[0] if args else None
        if not isinstance(first, Tensor) or first.dim() == 0:
            return None
        size = first.shape[0]
        if size != 1:
            if self._batch is None:
                self._batch = size
            return None
        batch = self._batch if self._batch is not None else self._root_batch
        if batch is None or batch == 1:  # an empty batch (0) expands too: it is still a step
            return None
        if self._root_data is None or any(out.dim() == 0 or out.shape[0] != 1 for out in outputs):
            return None
        if any(_storage(x) in self._root_data for x in args if isinstance(x, Tensor)):
            raise ValueError(
                f"layer '{layer}' was called on a batch-size-1 slice of the model's input while "
                f"the batch holds {batch} examples: one example's data then reaches every "
                "example's loss, which per-example clipping cannot bound. Give each example its "
                "own input (or pass an input that no example's data is part of)"
            )
        return batch
