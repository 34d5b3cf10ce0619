"""Low-rank adapters (LoRA, Hu et al. 2021) on a frozen pretrained model, through ``peft``.

A chosen linear layer W becomes ``W x + (α/r) · B A x`` with W frozen (public pretrained values)
and only the rank-r factors A and B trained; B starts at zero, so the adapted model starts exactly
at the pretrained one. Few trainable values mean little noise to add, which is why DP fine-tuning
favours adapters (Yu et al. 2022). peft's A and B are plain ``nn.Linear`` layers, so the fast
clipping engine computes their per-example norms like any other linear layer.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["DEFAULT_TARGETS", "add_lora", "is_adapter"]

#: BERT-style attention projections adapted by default (Hu et al. 2021 adapt the query and value).
DEFAULT_TARGETS = ("query", "value")


def add_lora(
    model: nn.Module,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = DEFAULT_TARGETS,
) -> list[str]:
    """Adapt every linear layer whose attribute name is in ``targets``; returns their paths.

    Everything else in ``model`` is frozen. The adapters are created from the current torch seed
    (a public seed: they hold no data); no dropout, so a step's gradient is a function of its batch.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a whole number >= 1, got {rank!r}")
    present = [
        path
        for path, module in model.named_modules()
        if path.rpartition(".")[2] in targets and isinstance(module, nn.Linear)
    ]
    if not present:
        raise ValueError(
            f"no nn.Linear layer named {', '.join(targets)} found for LoRA; this model's "
            "attention projections have other names: choose another mode (last-N, full, head)"
        )
    widths = {
        path: min(module.in_features, module.out_features)
        for path, module in model.named_modules()
        if path in present and isinstance(module, nn.Linear)
    }
    narrowest = min(widths.values())
    if rank > narrowest:
        path = min(widths, key=widths.__getitem__)
        raise ValueError(
            f"LoRA rank {rank} exceeds the width of the layers it adapts ({path} is "
            f"{narrowest} wide): a rank above min(in, out) adds parameters (and noise) without "
            f"adding capacity; pass a rank of at most {narrowest}"
        )
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets))
    inject_adapter_in_model(config, model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name)
    return present


def is_adapter(module: nn.Module) -> bool:
    """Whether ``module`` is a layer peft adapted (it holds LoRA factors)."""
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")
