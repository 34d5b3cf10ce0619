"""Which part of a pretrained classifier a DP fine-tuning run trains: lora, last-N, full or head.

The fewer values a run trains, the less noise it adds (noise goes on every trainable coordinate
each step), which is why the efficient DP recipes train adapters or the top layers only (Li et
al. 2022; Yu et al. 2022). Everything not trained keeps its public pretrained value.

==========  ==================================================================================
``lora``    rank-r adapters on every attention query and value projection, plus the head; the
            encoder's own weights stay frozen. Trains through the whole model every step.
``last-N``  the top N encoder layers and the head (``last-2``: two layers).
``head``    the linear head on the pooled features only.
``full``    every parameter, embeddings included.
==========  ==================================================================================

``last-N`` and ``head`` leave the lower layers frozen, so a trainer may compute their output once
(:mod:`dpfy.train.feature_cache`): :attr:`TrainableMode.cached_layers` says how many layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from dpfy.train.lora import add_lora
from dpfy.train.pretrained import SequenceClassifier

__all__ = ["MODE_NAMES", "TrainableMode", "apply_mode", "encoder_layers", "parse_mode"]

#: The modes a user may name (``last-N`` with N a whole number of layers).
MODE_NAMES = ("lora", "last-N", "head", "full")

_LAST = re.compile(r"last-(\d+)")


@dataclass(frozen=True)
class TrainableMode:
    """A parsed mode: its kind, the top layers it trains (last-N) and the LoRA rank."""

    kind: str
    layers: int = 0
    rank: int = 8

    @property
    def label(self) -> str:
        """The mode as the user writes it (``last-2``)."""
        return f"last-{self.layers}" if self.kind == "last" else self.kind

    def cached_layers(self, depth: int) -> int | None:
        """Frozen bottom layers whose output a trainer can cache (None: train through them all)."""
        if self.kind == "head":
            return depth
        if self.kind == "last":
            return depth - self.layers
        return None


def parse_mode(text: str, rank: int = 8) -> TrainableMode:
    """``lora``, ``last-N``, ``head`` or ``full`` → a :class:`TrainableMode`, or one clear error."""
    text = str(text).strip().lower()
    match = _LAST.fullmatch(text)
    if match:
        layers = int(match.group(1))
        if layers < 1:
            raise ValueError("last-N needs N >= 1 layers; use 'head' to train the head alone")
        return TrainableMode("last", layers=layers, rank=rank)
    if text in ("lora", "head", "full"):
        return TrainableMode(text, rank=rank)
    raise ValueError(
        f"unknown fine-tuning mode {text!r}; choose one of lora, last-N (e.g. last-2), head, full"
    )


def encoder_layers(model: SequenceClassifier) -> nn.ModuleList:
    """The encoder's stack of transformer layers (BERT-style ``encoder.layer``)."""
    layers = getattr(getattr(model.encoder, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model.encoder).__name__} has no BERT-style encoder.layer stack; last-N and "
            "head modes need one (lora and full train any encoder)"
        )
    return layers


def apply_mode(model: SequenceClassifier, mode: TrainableMode) -> None:
    """Freeze what ``mode`` does not train (and add the LoRA adapters), in place.

    Call it before building the optimizer and ``make_private``: a parameter that becomes
    trainable afterwards is refused by the private optimizer.
    """
    if mode.kind == "full":
        model.requires_grad_(True)
        return
    model.requires_grad_(False)
    if mode.kind == "lora":
        add_lora(model.encoder, rank=mode.rank)  # new adapters are trainable, the rest frozen
    elif mode.kind == "last":
        layers = encoder_layers(model)
        if mode.layers > len(layers):
            raise ValueError(
                f"last-{mode.layers} asks for more layers than the encoder has ({len(layers)}); "
                f"choose last-1 … last-{len(layers)} or full"
            )
        for layer in layers[len(layers) - mode.layers :]:
            layer.requires_grad_(True)
    model.head.requires_grad_(True)
