"""Rule for ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``: per-example gradients from one replay.

The fused kernels keep their gates to themselves, so the rule runs the layer again on the whole
batch, from the captured input and initial state, one layer and direction at a time: the input
projection ``xp_t = x_t W_ihᵀ + b_ih`` as one product over all steps, then torch's own fused
recurrence on ``xp`` (a one-layer RNN of the same kind whose input weight is the identity). One
backward pass of that replay, fed the output gradients captured from the real backward pass,
gives γ_t = ∂L/∂xp_t at every step; an example's weight gradients are then ``Σ_t γ_t a_tᵀ`` over
its own steps, as for a linear layer on a sequence (``a_t`` = the step's input for ``W_ih``, the
previous hidden state for ``W_hh``), and its bias gradients ``Σ_t γ_t``. The hidden
pre-activation ``h_{t-1} W_hhᵀ + b_hh`` has the same γ, except a GRU's n-part, which reaches the
loss through the reset gate: γ_n · r_t (the cell equations are torch's, documented on ``nn.RNN``,
``nn.GRU`` and ``nn.LSTM``).

Not covered (the engine replays such calls as the vmap engine does): packed batches. Refused
(``unsupported_reason``, so ``auto`` picks vmap): ``proj_size`` (LSTM projections). A stacked
layer's own dropout, in training mode, is refused at the step (no replay can redraw it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils.rnn import PackedSequence

from dpfy.train.grads.capture import Call
from dpfy.train.grads.precision import compute_dtype
from dpfy.train.grads.registry import LayerRule, register_rule

__all__ = ["RecurrentRule"]


@register_rule(nn.RNN, nn.GRU, nn.LSTM)
class RecurrentRule(LayerRule):
    """Weights ``Σ_t γ_t a_tᵀ``, biases ``Σ_t γ_t`` per example, γ from a replay of the batch."""

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
    """The replay, its backward from the captured gradients, and the per-example products."""
    dtype = compute_dtype(x.dtype, *(meta[1] for meta in call.out_meta))
    seq = (x if layer.batch_first else x.transpose(0, 1)).detach().to(dtype)  # (B, T, d)
    directions = 2 if layer.bidirectional else 1
    h0, c0 = _initial(layer, hx, seq.shape[0], seq)
    found: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # suffix → xp, a, h_prev, r
    finals_h: list[Tensor] = []
    finals_c: list[Tensor] = []
    with torch.enable_grad():
        layer_input = seq
        for k in range(layer.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = f"_l{k}" + ("_reverse" if direction else "")
                state = k * directions + direction
                inputs = layer_input.flip(1) if direction else layer_input
                xp, out, h_n, c_n = _one_direction(
                    layer, suffix, inputs, h0[state], None if c0 is None else c0[state], dtype
                )
                outputs.append(out.flip(1) if direction else out)
                finals_h.append(h_n)
                if c_n is not None:
                    finals_c.append(c_n)
                previous = torch.cat([h0[state][:, None], out[:, :-1]], 1).detach()
                found[suffix] = (
                    xp,
                    inputs.detach(),
                    previous,
                    _reset_gate(layer, suffix, xp, previous, dtype),
                )
            layer_input = torch.cat(outputs, -1) if directions > 1 else outputs[0]
        produced = [layer_input, torch.stack(finals_h)]
        if finals_c:
            produced.append(torch.stack(finals_c))
        given = _output_grads(layer, call, produced, dtype)
        gammas = torch.autograd.grad(
            produced, [entry[0] for entry in found.values()], given, allow_unused=True
        )
    rows: dict[str, Tensor] = {}
    for gamma, (suffix, (xp, a_ih, a_hh, r)) in zip(gammas, found.items(), strict=True):
        g_ih = torch.zeros_like(xp) if gamma is None else gamma
        g_hh = g_ih if r is None else _gru_hidden_gamma(g_ih, r)
        for part, g, a in (("ih", g_ih, a_ih), ("hh", g_hh, a_hh)):
            if f"weight_{part}{suffix}" in call.trainable:
                rows[f"weight_{part}{suffix}"] = torch.einsum("btg,btd->bgd", g, a)
            if f"bias_{part}{suffix}" in call.trainable:
                rows[f"bias_{part}{suffix}"] = g.sum(1)
    return rows


def _one_direction(
    layer: nn.RNNBase,
    suffix: str,
    inputs: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One layer in one direction: ``xp = x W_ihᵀ + b_ih``, then the fused recurrence on ``xp``.

    The recurrence runs as a one-layer RNN of the same kind whose input weight is the identity
    (its input is already projected), so the gradient reaching ``xp`` is the pre-activation
    gradient γ_t of every step, from torch's own fused backward. Returns xp, the hidden states
    (B, T, H), and the final h (and c).
    """
    w_ih, b_ih, w_hh, b_hh = (
        _weight(layer, f"{part}{suffix}", dtype)
        for part in ("weight_ih", "bias_ih", "weight_hh", "bias_hh")
    )
    assert w_ih is not None and w_hh is not None
    xp = inputs @ w_ih.T
    if b_ih is not None:
        xp = xp + b_ih
    xp = xp.detach().requires_grad_(True) if not xp.requires_grad else xp
    gates = w_ih.shape[0]
    weights = {
        "weight_ih_l0": torch.eye(gates, dtype=dtype, device=xp.device),
        "weight_hh_l0": w_hh,
    }
    if b_hh is not None:
        weights["bias_ih_l0"] = xp.new_zeros(gates)
        weights["bias_hh_l0"] = b_hh
    cell = _cell(layer, gates, b_hh is not None)
    state: Any = (h0[None], c0[None]) if c0 is not None else h0[None]
    out, final = functional_call(cell, weights, (xp, state))
    if isinstance(final, tuple):
        return xp, out, final[0][0], final[1][0]
    return xp, out, final[0], None


def _cell(layer: nn.RNNBase, gates: int, bias: bool) -> nn.RNNBase:
    """A one-layer, one-direction, batch-first RNN of ``layer``'s kind with input size ``gates``.

    Made on the meta device (its own weights are never used: ``functional_call`` passes them),
    afresh for each call, so that no module is shared between steps or threads.
    """
    options: dict[str, Any] = {"batch_first": True, "bias": bias}
    if isinstance(layer, nn.RNN):
        options["nonlinearity"] = layer.nonlinearity
    with torch.device("meta"):
        return type(layer)(gates, layer.hidden_size, **options)


def _reset_gate(
    layer: nn.RNNBase, suffix: str, xp: Tensor, previous: Tensor, dtype: torch.dtype
) -> Tensor | None:
    """A GRU's reset gate r_t per step (None for other kinds): it scales the hidden n-part."""
    if not isinstance(layer, nn.GRU):
        return None
    w_hh = _weight(layer, f"weight_hh{suffix}", dtype)
    b_hh = _weight(layer, f"bias_hh{suffix}", dtype)
    assert w_hh is not None
    hidden = layer.hidden_size
    hr = previous @ w_hh[:hidden].T
    if b_hh is not None:
        hr = hr + b_hh[:hidden]
    return torch.sigmoid(xp.detach()[..., :hidden] + hr)


def _gru_hidden_gamma(g_ih: Tensor, r: Tensor) -> Tensor:
    """γ of a GRU's hidden pre-activation: the input one for r and z, times r_t for n.

    ``n = tanh(x_n + r ⊙ (h W_hnᵀ + b_hn))``: the n-part of ``h W_hhᵀ + b_hh`` reaches the loss
    through ``r ⊙ ·``, the r and z parts exactly as the input pre-activation does.
    """
    hidden = r.shape[-1]
    return torch.cat([g_ih[..., : 2 * hidden], g_ih[..., 2 * hidden :] * r], -1)


def _weight(layer: nn.RNNBase, name: str, dtype: torch.dtype) -> Tensor | None:
    """A weight or bias of the layer, detached, in the dtype of the replay (None: no bias)."""
    value = getattr(layer, name, None)
    return None if value is None else value.detach().to(dtype)


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
