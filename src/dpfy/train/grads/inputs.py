"""Where the batch sits in a layer call's inputs, whatever container holds them.

A layer may take a dict or a list of tensors, keyword arguments, or a packed batch of sequences
(``PackedSequence``: each example's rows interleaved, the batch size in ``batch_sizes[0]``), and a
recurrent layer holds its batch in dim 0 or 1 by its own ``batch_first``, whatever the model's.
The engines count the examples of a step from every watched call, so a call whose first input is
not a plain tensor must still tell its batch size (else it would silently count none).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils import _pytree as pytree

__all__ = ["call_size", "input_batch_dim", "packed_inputs", "tensor_leaves"]


def tensor_leaves(value: Any) -> Iterator[Tensor]:
    """The tensors inside ``value`` (tuples, lists, dicts, packed sequences), in order."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, Tensor):
            yield leaf


def packed_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> PackedSequence | None:
    """The first ``PackedSequence`` among a call's inputs (None: there is none)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, PackedSequence):
            return value
        if isinstance(value, (tuple, list)):
            found = packed_inputs(tuple(value), {})
            if found is not None:
                return found
        if isinstance(value, dict):
            found = packed_inputs((), value)
            if found is not None:
                return found
    return None


def input_batch_dim(module: nn.Module) -> int | None:
    """The batch dim of a layer's main input when the layer itself fixes it (None: the model's)."""
    if isinstance(module, nn.RNNBase):
        return 0 if module.batch_first else 1
    return None


def call_size(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, batch_first: bool
) -> int | None:
    """The batch size of a call whose first input is not a plain batch tensor (None: it is).

    A packed batch holds ``batch_sizes[0]`` sequences; a recurrent layer's input holds the batch
    in the dim its ``batch_first`` says; otherwise the first tensor found (in a dict, a list, the
    keyword arguments) holds it in dim 0, or in dim 1 for sequence-first models' sequences.
    """
    packed = packed_inputs(args, kwargs)
    if packed is not None:
        return int(packed.batch_sizes[0]) if packed.batch_sizes.numel() else 0
    own = input_batch_dim(module)
    first = next(tensor_leaves((args, kwargs)), None)
    if first is None:
        return None
    if own is not None and first.dim() == 3:
        return first.shape[own]
    if args and isinstance(args[0], Tensor):
        return None  # the engine reads it (its batch_first rule)
    dim = 0
    if not batch_first:
        sequence_ndim = 3 if first.is_floating_point() or first.is_complex() else 2
        dim = 1 if first.dim() >= sequence_ndim else 0
    return first.shape[dim] if first.dim() > dim else None
