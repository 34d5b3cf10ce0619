"""Exact, reversible substitution of layers the engines cannot watch or run as they are.

``nn.MultiheadAttention`` uses its ``out_proj`` and packed input projection through a functional
call, so hooks never see them. While an engine is attached it is replaced by
:class:`DPMultiheadAttention`, which computes the same function from a hookable input projection
(:class:`InProjection`, holding the *same* ``Parameter`` objects) and the original ``out_proj``
module. Parameter identity is kept, so optimizers built before or after stay valid; ``restore``
puts the original module back.

``nn.InstanceNorm1d/2d/3d`` raise on an empty batch (torch's ``instance_norm`` kernel), which
Poisson sampling draws now and then and DP-SGD must still step on (noise only). While attached,
such a layer's class is swapped in place for :class:`EmptyBatchInstanceNorm2d` (and 1d, 3d): a
subclass that also takes an empty batch and otherwise runs the very same forward. The object,
its parameters, buffers, hooks and state-dict keys stay as they are; ``restore`` swaps it back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "DPMultiheadAttention",
    "EmptyBatchInstanceNorm1d",
    "EmptyBatchInstanceNorm2d",
    "EmptyBatchInstanceNorm3d",
    "InProjection",
    "Substitution",
    "restore",
    "substitute",
    "substitution_blocker",
]


class InProjection(nn.Module):
    """The q/k/v input projection of attention, as a module hooks can watch.

    Holds either one packed ``in_proj_weight`` (3E × E) or ``q_proj_weight``, ``k_proj_weight``,
    ``v_proj_weight``, plus an optional packed ``in_proj_bias`` (3E): the very Parameter objects
    of the attention module it came from.
    """

    def __init__(self, attention: nn.MultiheadAttention) -> None:
        super().__init__()
        self.embed_dim = attention.embed_dim
        self.packed = attention._qkv_same_embed_dim
        if self.packed:
            self.in_proj_weight = attention.in_proj_weight
        else:
            self.q_proj_weight = attention.q_proj_weight
            self.k_proj_weight = attention.k_proj_weight
            self.v_proj_weight = attention.v_proj_weight
        self.in_proj_bias = attention.in_proj_bias

    def weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """The q, k and v projection matrices (views of the packed weight when packed)."""
        if self.packed:
            return tuple(self.in_proj_weight.chunk(3))  # type: ignore[return-value]
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def biases(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The q, k and v projection biases (None without bias)."""
        if self.in_proj_bias is None:
            return None, None, None
        return tuple(self.in_proj_bias.chunk(3))  # type: ignore[return-value]

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project query, key and value (one matrix product for self-attention)."""
        if self.packed and query is key and key is value:
            return tuple(F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, -1))
        (wq, wk, wv), (bq, bk, bv) = self.weights(), self.biases()
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)


class _TakesEmptyBatch(nn.Module):
    """InstanceNorm forward that also takes an empty batch (torch's kernel indexes example 0)."""

    def forward(self, input: Tensor) -> Tensor:
        """An empty batch: group norm with one channel per group (instance norm, no rows)."""
        if input.dim() == self._get_no_batch_dim() + 1 and input.shape[0] == 0:
            return F.group_norm(input, input.shape[1], self.weight, self.bias, self.eps)
        return super().forward(input)


class EmptyBatchInstanceNorm1d(_TakesEmptyBatch, nn.InstanceNorm1d):
    """``nn.InstanceNorm1d`` that takes an empty batch; swapped in while an engine is attached."""


class EmptyBatchInstanceNorm2d(_TakesEmptyBatch, nn.InstanceNorm2d):
    """``nn.InstanceNorm2d`` that takes an empty batch; swapped in while an engine is attached."""


class EmptyBatchInstanceNorm3d(_TakesEmptyBatch, nn.InstanceNorm3d):
    """``nn.InstanceNorm3d`` that takes an empty batch; swapped in while an engine is attached."""


#: Layer classes swapped in place for their empty-batch-safe subclass (exact types only: a user
#: subclass may override forward, and is left alone).
_EMPTY_BATCH_SAFE: dict[type[nn.Module], type[nn.Module]] = {
    nn.InstanceNorm1d: EmptyBatchInstanceNorm1d,
    nn.InstanceNorm2d: EmptyBatchInstanceNorm2d,
    nn.InstanceNorm3d: EmptyBatchInstanceNorm3d,
}


def _float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Boolean masks (True = not allowed) become additive -inf masks; float masks are kept."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf")
        )
    return mask.to(dtype)


class DPMultiheadAttention(nn.Module):
    """Drop-in equivalent of ``nn.MultiheadAttention`` built from hookable projections.

    Same forward signature and results (``key_padding_mask``, ``attn_mask`` 2-D or 3-D, bool or
    float, ``need_weights``, ``average_attn_weights``, ``is_causal``, ``batch_first``, dropout,
    ``add_zero_attn``, unbatched inputs). Not covered: ``add_bias_kv`` (see
    :func:`substitution_blocker`).
    """

    def __init__(self, attention: nn.MultiheadAttention) -> None:
        super().__init__()
        self.embed_dim = attention.embed_dim
        self.kdim = attention.kdim
        self.vdim = attention.vdim
        self.num_heads = attention.num_heads
        self.head_dim = attention.head_dim
        self.dropout = attention.dropout
        self.batch_first = attention.batch_first
        self.add_zero_attn = attention.add_zero_attn
        self._qkv_same_embed_dim = attention._qkv_same_embed_dim
        self.bias_k = None
        self.bias_v = None
        self.in_proj = InProjection(attention)
        self.out_proj = attention.out_proj
        self.training = attention.training
        # Checkpoints taken while an engine is attached keep nn.MultiheadAttention's keys.
        self._register_state_dict_hook(_flatten_in_proj_keys)
        self._register_load_state_dict_pre_hook(_nest_in_proj_keys)

    @property
    def in_proj_weight(self) -> Tensor | None:
        """Packed input projection weight, as ``nn.MultiheadAttention`` exposes it."""
        return self.in_proj.in_proj_weight if self.in_proj.packed else None

    @property
    def in_proj_bias(self) -> Tensor | None:
        """Packed input projection bias, as ``nn.MultiheadAttention`` exposes it."""
        return self.in_proj.in_proj_bias

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention exactly as ``nn.MultiheadAttention.forward`` computes it."""
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                "module method `generate_square_subsequent_mask` to create this mask."
            )
        # As torch does: the causal hint replaces the mask when no weights or padding mask are
        # needed (scaled_dot_product_attention then applies its own causal mask).
        causal = is_causal and key_padding_mask is None and not need_weights
        if causal:
            attn_mask = None
        unbatched = query.dim() == 2
        if unbatched:
            batch_dim = 0 if self.batch_first else 1
            query, key, value = (t.unsqueeze(batch_dim) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        q, k, v = self.in_proj(query, key, value)
        if not self.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        batch, tgt_len, src_len = q.shape[0], q.shape[1], k.shape[1]
        heads, head_dim = self.num_heads, self.head_dim

        def split(t: Tensor) -> Tensor:
            return t.reshape(batch, t.shape[1], heads, head_dim).transpose(1, 2)

        q, k, v = split(q), split(k), split(v)
        mask = _float_mask(attn_mask, q.dtype)
        pad = _float_mask(key_padding_mask, q.dtype)
        if self.add_zero_attn:
            zeros = q.new_zeros(batch, heads, 1, head_dim)
            k, v = torch.cat([k, zeros], 2), torch.cat([v, zeros], 2)
            mask = F.pad(mask, (0, 1)) if mask is not None else None
            pad = F.pad(pad, (0, 1)) if pad is not None else None
            src_len += 1
        if mask is not None and mask.dim() == 3:
            mask = mask.reshape(batch, heads, tgt_len, src_len)
        elif mask is not None:
            mask = mask[None, None]
        if pad is not None:
            pad = pad.reshape(batch, 1, 1, src_len)
            mask = pad if mask is None else mask + pad
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * math.sqrt(1.0 / head_dim)) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            weights = scores.softmax(-1)
            if dropout > 0.0:
                weights = F.dropout(weights, p=dropout)
            out = weights @ v
            if average_attn_weights:
                weights = weights.mean(1)
            if unbatched:
                weights = weights.squeeze(0)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal
            )
        out = out.transpose(1, 2).reshape(batch, tgt_len, self.embed_dim)
        if not self.batch_first:
            out = out.transpose(0, 1)
        out = self.out_proj(out)
        if unbatched:
            out = out.squeeze(0 if self.batch_first else 1)
        return out, weights


_IN_PROJ_NAMES = (
    "in_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "in_proj_bias",
)


def _flatten_in_proj_keys(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict
) -> None:
    """state_dict hook: ``<prefix>in_proj.<name>`` → ``<prefix><name>``, as torch names them."""
    renamed = {f"{prefix}in_proj.{name}": prefix + name for name in _IN_PROJ_NAMES}
    if not any(key in state_dict for key in renamed):
        return
    items = list(state_dict.items())  # rebuilt, so that the keys keep their order
    state_dict.clear()
    for key, value in items:
        state_dict[renamed.get(key, key)] = value


def _nest_in_proj_keys(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: accept nn.MultiheadAttention's keys for the substitute."""
    for name in _IN_PROJ_NAMES:
        if prefix + name in state_dict:
            state_dict[f"{prefix}in_proj.{name}"] = state_dict.pop(prefix + name)


def substitution_blocker(module: nn.Module) -> str | None:
    """Why ``module`` (an ``nn.MultiheadAttention``) cannot be substituted (None: it can)."""
    if module.bias_k is not None or module.bias_v is not None:
        return "nn.MultiheadAttention with add_bias_kv=True is not supported"
    return None


def is_substitutable(module: nn.Module) -> bool:
    """True for an exact ``nn.MultiheadAttention`` that :class:`DPMultiheadAttention` covers."""
    return type(module) is nn.MultiheadAttention and substitution_blocker(module) is None


@dataclasses.dataclass
class Substitution:
    """One change to undo, so that detaching leaves the user's model exactly as it was.

    A replaced child: where it sat and the original module to put back. With
    ``original_class``: ``original`` had its class swapped in place (``parent`` is None).
    """

    parent: nn.Module | None
    name: str
    original: nn.Module
    original_class: type[nn.Module] | None = None


def substitute(model: nn.Module) -> list[Substitution]:
    """Make ``model`` watchable and runnable on any batch, in place (see ``restore``).

    Replaces every substitutable attention module, and swaps the class of every layer that
    cannot take an empty batch for its subclass that can.
    """
    replaced: dict[int, nn.Module] = {}
    done: list[Substitution] = []
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is None or not is_substitutable(child):
                continue
            if id(child) not in replaced:
                replaced[id(child)] = DPMultiheadAttention(child)
            parent._modules[name] = replaced[id(child)]
            done.append(Substitution(parent, name, child))
    for module in model.modules():  # each module once, the model itself included
        safe = _EMPTY_BATCH_SAFE.get(type(module))
        if safe is not None:
            done.append(Substitution(None, "", module, type(module)))
            module.__class__ = safe
    return done


def restore(substitutions: list[Substitution]) -> None:
    """Put every original module back where ``substitute`` took it from."""
    for sub in reversed(substitutions):
        if sub.original_class is not None:
            sub.original.__class__ = sub.original_class
            continue
        assert sub.parent is not None
        current = sub.parent._modules[sub.name]
        sub.original.train(current.training)
        sub.parent._modules[sub.name] = sub.original
