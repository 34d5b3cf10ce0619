"""The settings of ``dpfy finetune``, torch-free so the CLI can show their defaults cheaply.

The defaults are the recipe measured in docs/finetuning.md, the cheapest that meets issue 18's
accuracy target on a CPU: a linear head on MiniLM's pooled features (computed once from the
frozen public encoder), large batches, many epochs and AdamW (Li et al. 2022; Yu et al. 2022).
They were fixed before the accuracy runs, not tuned on the data.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from dpfy._validate import check_count, check_learning_rate, check_positive, check_seed
from dpfy.jobs.config import check_epochs

__all__ = ["FINETUNE_OPTIMIZERS", "FinetuneConfig", "check_finetune_config"]

#: Optimizers the fine-tuning job offers (each post-processes the private gradient).
FINETUNE_OPTIMIZERS = ("adamw", "adam", "sgd")

_MODE = re.compile(r"lora|head|full|last-[1-9]\d*")


@dataclass(frozen=True)
class FinetuneConfig:
    """Everything ``dpfy finetune`` needs (ε None: a non-private run, for comparison only)."""

    model: str = "minilm"
    model_dir: Path | None = None
    mode: str = "head"
    target_epsilon: float | None = 8.0
    delta: float | None = None
    epochs: float = 20
    batch_size: int = 1024
    max_grad_norm: float = 1.0
    lr: float = 1e-3
    optimizer: str = "adamw"
    lora_rank: int = 8
    max_length: int = 64
    out: Path | None = None
    #: Seeds sampling and noise (experiments only: the report flags a seeded run). None: OS
    #: entropy; the public randomness (head initialisation) then uses seed 0.
    seed: int | None = None
    baseline: bool = False
    data_dir: Path | None = None
    engine: str = "auto"
    limit: int | None = None  # first examples of each split only (quick checks)

    def resolved_delta(self, dataset_size: int) -> float:
        """δ as given, or a power of ten at least 10× below 1/N (guide §2.1: δ ≪ 1/N)."""
        if self.delta is not None:
            return self.delta
        return 10.0 ** -(math.ceil(math.log10(dataset_size)) + 1)


def check_finetune_config(config: FinetuneConfig) -> None:
    """Refuse bad settings before any weights or data are loaded."""
    if config.target_epsilon is not None:
        check_positive("target_epsilon", config.target_epsilon)
    check_epochs("epochs", config.epochs)
    check_count("batch_size", config.batch_size, minimum=1)
    check_positive("max_grad_norm", config.max_grad_norm)
    check_learning_rate("lr", config.lr)
    check_count("lora_rank", config.lora_rank, minimum=1)
    check_count("max_length", config.max_length, minimum=2)
    check_seed(config.seed)
    if config.limit is not None:
        check_count("limit", config.limit, minimum=1)
    if config.optimizer not in FINETUNE_OPTIMIZERS:
        raise ValueError(
            f"optimizer must be one of {', '.join(FINETUNE_OPTIMIZERS)}; got {config.optimizer!r}"
        )
    if not _MODE.fullmatch(str(config.mode)):
        raise ValueError(
            f"unknown fine-tuning mode {config.mode!r}; choose one of lora, last-N (e.g. "
            "last-2), head, full"
        )
    if config.engine not in ("auto", "fast", "vmap"):
        raise ValueError(f"engine must be one of auto, fast, vmap; got {config.engine!r}")
