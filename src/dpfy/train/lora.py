"""Low-rank adapters (LoRA, Hu et al. 2021) on a frozen pretrained model's linear layers.

A chosen ``nn.Linear`` W becomes ``W x + (α/r) · B A x`` with W frozen (public pretrained values)
and only the rank-r factors A (r × in) and B (out × r) trained; B starts at zero, so the adapted
model starts exactly at the pretrained one. Few trainable values mean little noise to add, which
is why DP fine-tuning favours adapters (Yu et al. 2022). A and B are plain ``nn.Linear`` layers,
so the fast clipping engine computes their per-example norms like any other linear layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["DEFAULT_TARGETS", "LoRALinear", "add_lora"]

#: BERT-style attention projections adapted by default (Hu et al. 2021 adapt the query and value).
DEFAULT_TARGETS = ("query", "value")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``(α/r) · B A``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        for parameter in base.parameters():
            parameter.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale


def add_lora(
    model: nn.Module,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = DEFAULT_TARGETS,
) -> list[str]:
    """Wrap every ``nn.Linear`` whose attribute name is in ``targets``; returns their paths.

    The adapters are created from the current torch seed (a public seed: they hold no data).
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be a whole number >= 1, got {rank!r}")
    wrapped = []
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
                wrapped.append(f"{path}.{name}" if path else name)
    if not wrapped:
        raise ValueError(
            f"no nn.Linear layer named {', '.join(targets)} found for LoRA; this model's "
            "attention projections have other names: choose another mode (last-N, full, head)"
        )
    return wrapped
