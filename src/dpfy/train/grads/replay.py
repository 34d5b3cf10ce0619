"""How the vmap engine runs a captured layer call again, on each example alone.

A layer's tensors need not hold the batch in one dim: a recurrent layer's hidden states
(layers·directions, B, H) are sequence-first whatever its ``batch_first``; inputs may come in a
dict, a list or as keyword arguments; an input every example shares has no batch dim at all; a
packed batch of sequences interleaves the examples' rows. :func:`replay_plan` says, for one call,
which dim of each input, output gradient and recorded dropout mask is the batch (None: shared),
and splits the batch into :class:`Piece` s that can each be replayed by one ``vmap`` (a packed
batch: its examples grouped by length). Layer types with their own layout register a planner with
:func:`register_planner`; the others get the model's (``batch_dim``).

The replay calls the layer's ``forward`` itself, not the module: the layer's own forward hooks ran
after the engine captured the layer's output, and its pre-hooks before the captured inputs, so
applying them again would apply a user's hook twice, or to the wrong tensor (pre-hooks are still
called, for what they set on the layer, and their results ignored).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils import _pytree as pytree

from dpfy.train.grads.capture import Call, Tap, output_tensors
from dpfy.train.grads.inputs import packed_inputs

__all__ = ["Piece", "Planner", "ReplayPlan", "bare_call", "register_planner", "replay_plan"]


@dataclasses.dataclass
class Piece:
    """Examples ``rows`` of a call (None: all, in order), as one batched call of the layer.

    ``arg_dims`` / ``kwarg_dims`` mirror ``args`` / ``kwargs`` with each tensor's batch dim (None:
    shared by every example); ``grads[j]`` is the gradient of ``pick(output)[j]``, batch in
    ``grad_dims[j]``; ``masks`` are the dropout masks drawn inside the layer, batch in
    ``mask_dims``.
    """

    rows: Tensor | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    arg_dims: Any
    kwarg_dims: Any
    grads: tuple[Tensor, ...]
    grad_dims: tuple[int, ...]
    pick: Callable[[Any], tuple[Tensor, ...]]
    masks: tuple[Tensor, ...] = ()
    mask_dims: tuple[int, ...] = ()


@dataclasses.dataclass
class ReplayPlan:
    """All pieces of one call, and its batch size."""

    size: int
    pieces: list[Piece]


Planner = Callable[[nn.Module, Call, int], ReplayPlan]
_PLANNERS: dict[type[nn.Module], Planner] = {}


def register_planner(*layer_types: type[nn.Module]) -> Callable[[Planner], Planner]:
    """Decorator: ``planner(layer, call, batch_dim)`` lays out calls of these layer types."""

    def deco(planner: Planner) -> Planner:
        for layer_type in layer_types:
            _PLANNERS[layer_type] = planner
        return planner

    return deco


def replay_plan(tap: Tap, call: Call, batch_dim: int) -> ReplayPlan:
    """How to replay ``call`` per example (``batch_dim``: the model's batch dim for this call)."""
    for cls in type(tap.module).__mro__:
        planner = _PLANNERS.get(cls)
        if planner is not None:
            return planner(tap.module, call, batch_dim)
    packed = packed_inputs(call.inputs, call.kwargs)
    if packed is not None:
        raise ValueError(
            f"layer '{tap.name}' ({type(tap.module).__name__}) takes a PackedSequence, whose "
            "examples' rows are interleaved: the engine cannot tell which rows are whose for "
            "this layer type (nn.RNN, nn.GRU and nn.LSTM are handled). Unpack it before the "
            "layer (torch.nn.utils.rnn.pad_packed_sequence) or pass padded tensors"
        )
    return ReplayPlan(*default_piece(call, batch_dim))


def default_piece(call: Call, batch_dim: int) -> tuple[int, list[Piece]]:
    """The whole call as one piece: every tensor of the batch size holds it in ``batch_dim``."""
    n = call.size
    if n is None:
        first = next(x for x in pytree.tree_leaves(call.inputs) if isinstance(x, Tensor))
        n = first.shape[batch_dim]

    def dim_of(x: Any) -> int | None:
        if isinstance(x, Tensor) and x.dim() > batch_dim and x.shape[batch_dim] == n:
            return batch_dim
        return None

    piece = Piece(
        rows=None,
        args=call.inputs,
        kwargs=call.kwargs,
        arg_dims=pytree.tree_map(dim_of, call.inputs),
        kwarg_dims=pytree.tree_map(dim_of, call.kwargs),
        grads=filled_grads(call),
        grad_dims=(batch_dim,) * len(call.grads),
        pick=picker(call.out_index),
        masks=call.masks,
        mask_dims=mask_dims(call.masks, n, batch_dim),
    )
    return n, [piece]


def mask_dims(masks: tuple[Tensor, ...], n: int, batch_dim: int) -> tuple[int, ...]:
    """The batch dim of each recorded dropout mask: the model's, else the first of size n."""
    dims = []
    for mask in masks:
        if mask.dim() > batch_dim and mask.shape[batch_dim] == n:
            dims.append(batch_dim)
        elif mask.dim() and mask.shape[0] == n:
            dims.append(0)
        else:
            raise ValueError(
                f"a dropout inside a watched layer drew a mask of shape {tuple(mask.shape)}, "
                f"which holds no batch of {n} examples: its per-example gradients cannot be formed"
            )
    return tuple(dims)


def filled_grads(call: Call) -> tuple[Tensor, ...]:
    """The call's output gradients, zeros for outputs backward never reached."""
    return tuple(
        g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
        for g, (shape, dtype, device) in zip(call.grads, call.out_meta, strict=True)
    )


def picker(index: list[int]) -> Callable[[Any], tuple[Tensor, ...]]:
    """Select the outputs at ``index`` among a layer output's tensors."""

    def pick(output: Any) -> tuple[Tensor, ...]:
        every = list(output_tensors(output))
        return tuple(every[j] for j in index)

    return pick


class _Bare(nn.Module):
    """Runs the wrapped layer's ``forward`` without applying the layer's own hooks again.

    Its pre-hooks are called (a pre-hook may set what ``forward`` reads, as
    ``torch.nn.utils.spectral_norm`` computes ``weight`` from ``weight_orig``) but what they
    return is ignored: the captured inputs already are what they made. Its forward hooks are not
    called: the captured output gradient is that of ``forward``'s own output.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The inner layer's forward (its children are called as usual, hooks included)."""
        inner = self.inner
        with_kwargs = inner._forward_pre_hooks_with_kwargs
        for key, hook in list(inner._forward_pre_hooks.items()):
            if key in with_kwargs:
                hook(inner, args, kwargs)
            else:
                hook(inner, args)
        return inner.forward(*args, **kwargs)


def bare_call(
    module: nn.Module, params: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``module.forward(*args, **kwargs)`` with ``params`` in place of its own parameters."""
    named = {f"inner.{name}": value for name, value in params.items()}
    return functional_call(_Bare(module), named, args, kwargs)
