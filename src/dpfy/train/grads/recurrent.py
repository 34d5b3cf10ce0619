"""Recurrent layers (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``) replayed per example by the vmap engine.

Their input holds the batch in dim 0 or 1 by the layer's own ``batch_first``, and their hidden
states (layers·directions, B, H) in dim 1 always. A missing initial state is passed as the zeros
the layer would have made (a state made inside the replay would not be batched). A packed batch
(``PackedSequence``) is replayed as padded tensors, one piece per sequence length: a recurrent
layer runs each packed sequence alone for exactly its own length (both directions), which is what
a plain batch of sequences that all have that length computes, so each example's gradient is
exact. The layer's dropout between stacked layers draws inside the fused kernel, where no replay
can reach it: in training mode it is refused (put ``nn.Dropout`` between single-layer RNNs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from dpfy.train.grads.capture import Call
from dpfy.train.grads.replay import Piece, ReplayPlan, filled_grads, picker, register_planner

__all__ = ["recurrent_plan"]


@register_planner(nn.RNNBase)
def recurrent_plan(layer: nn.Module, call: Call, batch_dim: int) -> ReplayPlan:
    """Pieces of one call of a recurrent layer: the whole batch, or one per packed length."""
    assert isinstance(layer, nn.RNNBase)
    if layer.training and layer.dropout > 0 and layer.num_layers > 1:
        raise ValueError(
            f"{type(layer).__name__}(dropout={layer.dropout}) draws its dropout between stacked "
            "layers inside one fused kernel, which cannot be replayed per example; use "
            "dropout=0, or single-layer RNNs with nn.Dropout between them"
        )
    x, hx = _split_inputs(layer, call)
    if isinstance(x, PackedSequence):
        return _packed_plan(layer, call, x, hx)
    if x.dim() != 3:
        raise ValueError(
            f"{type(layer).__name__} got an unbatched input of shape {tuple(x.shape)}; pass a "
            "batch (3-D input) so that each example's gradient can be formed"
        )
    time_dim = 1 if layer.batch_first else 0
    bdim = 1 - time_dim
    n = x.shape[bdim]
    hx = _initial_state(layer, hx, n, x)
    grads = filled_grads(call)
    grad_dims = tuple(bdim if j == 0 else 1 for j in call.out_index)
    piece = Piece(
        rows=None,
        args=(x, hx),
        kwargs={},
        arg_dims=(bdim, _state_dims(hx)),
        kwarg_dims={},
        grads=grads,
        grad_dims=grad_dims,
        pick=picker(call.out_index),
    )
    return ReplayPlan(n, [piece])


def _split_inputs(layer: nn.RNNBase, call: Call) -> tuple[Any, Any]:
    """The input and the initial state (None: zeros) of a call, positional or keyword."""
    args, kwargs = call.inputs, call.kwargs
    x = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    return x, hx


def _state_dims(hx: Any) -> Any:
    """Batch dims of an initial state: dim 1 of h (and of c, for an LSTM)."""
    return (1, 1) if isinstance(hx, tuple) else 1


def _initial_state(layer: nn.RNNBase, hx: Any, n: int, like: Tensor) -> Any:
    """The initial state the layer would use: the one given, or zeros of batch ``n``."""
    if hx is not None:
        return tuple(hx) if isinstance(hx, (tuple, list)) else hx
    directions = 2 if layer.bidirectional else 1
    out = layer.proj_size if layer.proj_size > 0 else layer.hidden_size
    h = torch.zeros(layer.num_layers * directions, n, out, dtype=like.dtype, device=like.device)
    if isinstance(layer, nn.LSTM):
        c = torch.zeros(
            layer.num_layers * directions,
            n,
            layer.hidden_size,
            dtype=like.dtype,
            device=like.device,
        )
        return (h, c)
    return h


def _packed_plan(layer: nn.RNNBase, call: Call, x: PackedSequence, hx: Any) -> ReplayPlan:
    """One piece per sequence length: padded inputs cut to that length, states by example."""
    padded, lengths = pad_packed_sequence(x, batch_first=True)  # examples in their given order
    n = padded.shape[0]
    hx = _initial_state(layer, hx, n, padded)
    grads = filled_grads(call)
    # The packed output flattens to its data, batch sizes and (unless sorted) two index tensors.
    fields = (x.data, x.batch_sizes, x.sorted_indices, x.unsorted_indices)
    packed_tensors = sum(isinstance(t, Tensor) for t in fields)
    plain_index: list[int] = []
    out_grads: list[Tensor] = []
    for j, grad in zip(call.out_index, grads, strict=True):
        if j == 0:  # the packed output's data: unpack it like the input
            packed_grad = PackedSequence(grad, x.batch_sizes, x.sorted_indices, x.unsorted_indices)
            out_grads.append(pad_packed_sequence(packed_grad, batch_first=True)[0])
            plain_index.append(0)
        elif j >= packed_tensors:  # h_n (and c_n): plain tensors after the packed output
            out_grads.append(grad)
            plain_index.append(j - packed_tensors + 1)
    pieces = []
    for length in sorted({int(v) for v in lengths}):
        rows = torch.nonzero(lengths == length).flatten()
        index = rows.to(padded.device)
        seq = padded[index, :length]
        piece_grads = tuple(
            (g[index, :length] if j == 0 else g[:, index])
            for j, g in zip(plain_index, out_grads, strict=True)
        )
        if not layer.batch_first:
            seq = seq.transpose(0, 1)
            piece_grads = tuple(
                g.transpose(0, 1) if j == 0 else g
                for j, g in zip(plain_index, piece_grads, strict=True)
            )
        bdim = 0 if layer.batch_first else 1
        state = tuple(s[:, index] for s in hx) if isinstance(hx, tuple) else hx[:, index]
        pieces.append(
            Piece(
                rows=rows,
                args=(seq, state),
                kwargs={},
                arg_dims=(bdim, _state_dims(state)),
                kwarg_dims={},
                grads=piece_grads,
                grad_dims=tuple(bdim if j == 0 else 1 for j in plain_index),
                pick=picker(plain_index),
            )
        )
    return ReplayPlan(n, pieces)
