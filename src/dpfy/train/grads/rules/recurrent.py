"""Rule for ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``: per-example gradients by one unrolled replay.

The fused kernels keep their gates to themselves, so the rule recomputes the layer step by step
in plain tensor operations, once for the whole batch, from the captured input and initial state,
with a zero "probe" added to each pre-activation: ``x_t W_ihᵀ + b_ih`` (all steps at once) and
``h_{t-1} W_hhᵀ + b_hh`` (step by step). One backward pass of that replay, fed the output
gradients captured from the real backward pass, gives each probe's gradient γ_t; an example's
weight gradients are then ``Σ_t γ_t a_tᵀ`` over its own steps (``a_t`` = the step's input, or the
previous hidden state) and its bias gradients ``Σ_t γ_t``, as for a linear layer on a sequence
(the cell equations are torch's, documented on ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``).

Not covered (the engine replays such calls as the vmap engine does): packed batches. Refused
(``unsupported_reason``, so ``auto`` picks vmap): ``proj_size`` (LSTM projections).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from dpfy.train.grads.capture import Call
from dpfy.train.grads.precision import compute_dtype
from dpfy.train.grads.registry import LayerRule, register_rule

__all__ = ["RecurrentRule"]

_State = tuple[Tensor, Tensor | None]  # h, and c for an LSTM
_Cell = Callable[[Tensor, Tensor, Tensor, Tensor | None], _State]


def _tanh_cell(xp: Tensor, hp: Tensor, h: Tensor, c: Tensor | None) -> _State:
    return torch.tanh(xp + hp), None


def _relu_cell(xp: Tensor, hp: Tensor, h: Tensor, c: Tensor | None) -> _State:
    return torch.relu(xp + hp), None


def _lstm_cell(xp: Tensor, hp: Tensor, h: Tensor, c: Tensor | None) -> _State:
    i, f, g, o = (xp + hp).chunk(4, -1)
    assert c is not None
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _gru_cell(xp: Tensor, hp: Tensor, h: Tensor, c: Tensor | None) -> _State:
    xr, xz, xn = xp.chunk(3, -1)
    hr, hz, hn = hp.chunk(3, -1)
    r = torch.sigmoid(xr + hr)
    z = torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    return (1 - z) * n + z * h, None


#: ``nn.RNNBase.mode`` → one step of the cell, from the two pre-activations.
CELLS: dict[str, _Cell] = {
    "RNN_TANH": _tanh_cell,
    "RNN_RELU": _relu_cell,
    "LSTM": _lstm_cell,
    "GRU": _gru_cell,
}


@register_rule(nn.RNN, nn.GRU, nn.LSTM)
class RecurrentRule(LayerRule):
    """Weights ``Σ_t γ_t a_tᵀ``, biases ``Σ_t γ_t`` per example, γ from an unrolled replay."""

    from_rows = True

    @staticmethod
    def unsupported_reason(layer: nn.Module) -> str | None:
        """LSTM projections are left to the vmap engine."""
        if getattr(layer, "proj_size", 0) > 0:
            return "proj_size > 0 is not covered by the fast rule"
        return None

    @staticmethod
    def example_rows(layer: nn.Module, call: Call) -> dict[str, Tensor] | None:
        """Each example's gradient of every trainable weight and bias, (B, *shape)."""
        assert isinstance(layer, nn.RNNBase)
        x = call.inputs[0] if call.inputs else call.kwargs["input"]
        if isinstance(x, PackedSequence) or x.dim() != 3:
            return None  # replayed by the engine (packed), or refused there (unbatched)
        if layer.training and layer.dropout > 0 and layer.num_layers > 1:
            raise ValueError(
                f"{type(layer).__name__}(dropout={layer.dropout}) draws its dropout between "
                "stacked layers inside one fused kernel, which cannot be replayed per example; "
                "use dropout=0, or single-layer RNNs with nn.Dropout between them"
            )
        hx = call.inputs[1] if len(call.inputs) > 1 else call.kwargs.get("hx")
        return _rows(layer, call, x, hx)


def _rows(layer: nn.RNNBase, call: Call, x: Tensor, hx: Any) -> dict[str, Tensor]:
    """The unrolled replay, its backward from the captured gradients, and the products."""
    dtype = compute_dtype(x.dtype, *(meta[1] for meta in call.out_meta))
    seq = (x if layer.batch_first else x.transpose(0, 1)).detach().to(dtype)  # (B, T, d)
    n, steps = seq.shape[:2]
    directions = 2 if layer.bidirectional else 1
    h0, c0 = _initial(layer, hx, n, seq)
    cell = CELLS[layer.mode]
    probes: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # suffix → probes, inputs
    finals_h: list[Tensor] = []
    finals_c: list[Tensor] = []
    with torch.enable_grad():
        layer_input = seq
        for k in range(layer.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = f"_l{k}" + ("_reverse" if direction else "")
                w_ih, b_ih, w_hh, b_hh = (
                    _weight(layer, f"{part}{suffix}", dtype)
                    for part in ("weight_ih", "bias_ih", "weight_hh", "bias_hh")
                )
                inputs = layer_input.flip(1) if direction else layer_input
                xp = inputs @ w_ih.T
                if b_ih is not None:
                    xp = xp + b_ih
                probe_ih = torch.zeros_like(xp, requires_grad=True)
                probe_hh = torch.zeros_like(xp, requires_grad=True)
                xp = xp + probe_ih
                state = k * directions + direction
                h, c = h0[state], None if c0 is None else c0[state]
                previous, hidden = [], []
                for t in range(steps):
                    previous.append(h)
                    hp = h @ w_hh.T
                    if b_hh is not None:
                        hp = hp + b_hh
                    h, c = cell(xp[:, t], hp + probe_hh[:, t], h, c)
                    hidden.append(h)
                out = torch.stack(hidden, 1)
                outputs.append(out.flip(1) if direction else out)
                finals_h.append(h)
                if c is not None:
                    finals_c.append(c)
                probes[suffix] = (probe_ih, probe_hh, inputs.detach(), torch.stack(previous, 1))
            layer_input = torch.cat(outputs, -1) if directions > 1 else outputs[0]
        produced = [layer_input, torch.stack(finals_h)]
        if finals_c:
            produced.append(torch.stack(finals_c))
        given = _output_grads(layer, call, produced, dtype)
        flat = [p for entry in probes.values() for p in entry[:2]]
        gammas = torch.autograd.grad(produced, flat, given, allow_unused=True)
    rows: dict[str, Tensor] = {}
    for index, (suffix, (probe_ih, probe_hh, a_ih, a_hh)) in enumerate(probes.items()):
        g_ih = _or_zeros(gammas[2 * index], probe_ih)
        g_hh = _or_zeros(gammas[2 * index + 1], probe_hh)
        for part, gamma, a in (("ih", g_ih, a_ih), ("hh", g_hh, a_hh.detach())):
            if f"weight_{part}{suffix}" in call.trainable:
                rows[f"weight_{part}{suffix}"] = torch.einsum("btg,btd->bgd", gamma, a)
            if f"bias_{part}{suffix}" in call.trainable:
                rows[f"bias_{part}{suffix}"] = gamma.sum(1)
    return rows


def _weight(layer: nn.RNNBase, name: str, dtype: torch.dtype) -> Tensor | None:
    """A weight or bias of the layer, detached, in the dtype of the replay (None: no bias)."""
    value = getattr(layer, name, None)
    return None if value is None else value.detach().to(dtype)


def _or_zeros(gamma: Tensor | None, like: Tensor) -> Tensor:
    """A probe's gradient (zeros when nothing downstream used it)."""
    return torch.zeros_like(like) if gamma is None else gamma


def _initial(layer: nn.RNNBase, hx: Any, n: int, seq: Tensor) -> tuple[Tensor, Tensor | None]:
    """h0 (and c0) as (layers·directions, B, H): the caller's, or the zeros the layer uses."""
    directions = 2 if layer.bidirectional else 1
    shape = (layer.num_layers * directions, n, layer.hidden_size)
    if hx is None:
        zeros = seq.new_zeros(shape)
        return zeros, (zeros if isinstance(layer, nn.LSTM) else None)
    if isinstance(hx, (tuple, list)):
        return hx[0].detach().to(seq.dtype), hx[1].detach().to(seq.dtype)
    return hx.detach().to(seq.dtype), None


def _output_grads(
    layer: nn.RNNBase, call: Call, produced: list[Tensor], dtype: torch.dtype
) -> list[Tensor]:
    """The captured gradients of output, h_n (and c_n), in the replay's layout and dtype."""
    given = [torch.zeros_like(t) for t in produced]
    for j, grad in zip(call.out_index, call.grads, strict=True):
        if grad is None or j >= len(given):
            continue
        if j == 0 and not layer.batch_first:
            grad = grad.transpose(0, 1)
        given[j] = grad.to(dtype)
    return given
