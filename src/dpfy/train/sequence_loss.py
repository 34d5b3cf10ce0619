"""Sequence losses that are a mean of per-example losses, each averaged over its own tokens.

DP-SGD clips each example's gradient, so an example's loss may depend on that example alone. The
usual token-level loss — cross-entropy averaged over every target token of the *batch*
(``F.cross_entropy(logits.view(-1, V), labels.view(-1))``, and Hugging Face's built-in LM losses)
— divides by the batch's token count: with padding or varied lengths, each example's gradient is
scaled by the other examples' lengths, and adding or removing one example changes every other
example's contribution, so the sum's sensitivity is no longer C. :func:`per_example_token_mean`
averages each sequence's loss over its own target tokens, then over the batch's examples (guide
§5.4.1: normalise per example, so gradient norms do not grow with length either).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["IGNORE_INDEX", "per_example_token_losses", "per_example_token_mean"]

#: The label that marks a position with no target (padding, prompt tokens), as in torch and HF.
IGNORE_INDEX = -100


def per_example_token_losses(
    logits: Tensor, labels: Tensor, *, shift: bool = False, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Each example's cross-entropy averaged over its own target tokens, shape ``(B,)``.

    ``logits`` is ``(B, T, V)`` and ``labels`` ``(B, T)``. ``shift=True`` is causal language
    modelling: position t predicts the label at t + 1. An example with no target token has
    loss 0 (its gradient is zero; it still counts as one example). Computed in float32 at least,
    so a bf16/fp16 model's per-example losses are not rounded before they are averaged.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be (batch, tokens, classes) and labels (batch, tokens); got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    labels = labels.to(logits.device)
    tokens = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
    ).view(labels.shape)
    counted = (labels != ignore_index).sum(dim=1)
    return tokens.sum(dim=1) / counted.clamp(min=1).to(tokens.dtype)


def per_example_token_mean(
    logits: Tensor, labels: Tensor, *, shift: bool = False, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """The batch mean of :func:`per_example_token_losses`: the loss to call ``backward`` on.

    A mean over the batch's examples (``loss_reduction="mean"``, dpfy's default), so each
    example's gradient is its own token-averaged gradient, whatever the other examples hold.
    """
    losses = per_example_token_losses(logits, labels, shift=shift, ignore_index=ignore_index)
    return losses.mean() if losses.numel() else losses.sum()
