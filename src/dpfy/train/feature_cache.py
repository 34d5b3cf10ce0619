"""A public feature cache: the frozen lower layers run once, only the trainable top trains.

When a fine-tuning run trains the top N layers and the head (or the head alone), the layers below
are frozen at their public pretrained values and, in eval mode, deterministic: every epoch would
recompute the same outputs. :func:`cache_features` computes them once per example and
:class:`CachedTop` trains the rest on them, with exactly the classifier's own layers (the same
Parameter objects, so training it trains the classifier).

Privacy: each cached row is a fixed public function (the pretrained lower layers) of one
example's private text. DP-SGD on the cached rows is DP-SGD on the examples — adding or removing
an example adds or removes its row — so the guarantee covers the cached features; nothing is
released from the cache itself, and it lives in memory only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpfy.train.finetune_modes import encoder_layers
from dpfy.train.pretrained import SequenceClassifier, mean_pool

__all__ = ["CachedTop", "cache_features"]


def _bottom(model: SequenceClassifier, frozen: int, ids: torch.Tensor, mask: torch.Tensor) -> Any:
    """The embeddings and the first ``frozen`` layers' output (pooled when every layer is)."""
    from transformers.masking_utils import create_bidirectional_mask

    encoder = model.encoder
    hidden = encoder.embeddings(input_ids=ids)
    layers = encoder_layers(model)
    if frozen:
        attention = create_bidirectional_mask(
            config=encoder.config, inputs_embeds=hidden, attention_mask=mask
        )
        for layer in layers[:frozen]:
            hidden = layer(hidden, attention)
    return mean_pool(hidden, mask) if frozen == len(layers) else hidden


@torch.no_grad()
def cache_features(
    model: SequenceClassifier,
    frozen: int,
    data: TensorDataset,
    batch_size: int = 256,
    on_batch: Callable[[int], None] | None = None,
) -> TensorDataset:
    """(input ids, mask, label) rows → (features, mask, label), through the frozen bottom.

    ``frozen`` is the number of bottom layers cached; when it is all of them the features are
    the pooled vectors (N, d) and the rows are (features, label). Runs in eval mode (no dropout:
    the frozen part is a fixed function). ``on_batch(n)`` reports progress.
    """
    was_training = model.training
    model.eval()
    parts: list[list[torch.Tensor]] = [[], [], []]
    try:
        for ids, mask, labels in DataLoader(data, batch_size=batch_size):
            parts[0].append(_bottom(model, frozen, ids, mask).float())
            parts[1].append(mask)
            parts[2].append(labels)
            if on_batch is not None:
                on_batch(len(labels))
    finally:
        model.train(was_training)
    features, masks, labels = (torch.cat(p) for p in parts)
    if frozen == len(encoder_layers(model)):
        return TensorDataset(features, labels)
    return TensorDataset(features, masks, labels)


class CachedTop(nn.Module):
    """The classifier's top ``len(layers) - frozen`` layers and head, fed with cached features."""

    def __init__(self, model: SequenceClassifier, frozen: int) -> None:
        super().__init__()
        layers = encoder_layers(model)
        self.config = model.encoder.config
        self.layers = nn.ModuleList(layers[frozen:])  # the classifier's own modules, not copies
        self.dropout = model.dropout
        self.head = model.head

    @property
    def pooled(self) -> bool:
        """True when every encoder layer is cached: the input is pooled features (N, d)."""
        return len(self.layers) == 0

    def forward(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.pooled:
            return self.head(self.dropout(features))
        from transformers.masking_utils import create_bidirectional_mask

        attention = create_bidirectional_mask(
            config=self.config, inputs_embeds=features, attention_mask=mask
        )
        hidden = features
        for layer in self.layers:
            hidden = layer(hidden, attention)
        return self.head(self.dropout(mean_pool(hidden, mask)))
