"""One tuning trial: a short DP-SGD run of one configuration, scored on a validation split.

A trial reuses the library's training path — :func:`dpfy.train.builder.make_private`, the trainer's
optimizers and accuracy — and returns its score, the number of correct validation predictions,
the unclipped per-example gradient norms it saw (``DPOptimizer.clip_observers``) and the privacy
event of what it actually did, read from its own ledger.

A zero-noise trial (σ = 0, the guide's ClipSearch, §5.4.1 step 2) clips but adds no noise. It has
no finite ε, so its event is ``None``: such a trial may only run on data declared public.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

from dpfy._validate import check_count, check_positive, check_range
from dpfy.data.loader import rest_of_run
from dpfy.jobs.train import OPTIMIZERS, accuracy, fresh_model
from dpfy.plan.accounting.events import DpEvent
from dpfy.report.facts import record_clip_norms
from dpfy.train.builder import make_private

#: σ a zero-noise trial's throwaway session is built with; its noise source is then replaced by
#: zeros and its ledger discarded (never reported).
_PLACEHOLDER_SIGMA = 1.0


@dataclass(frozen=True)
class TrialConfig:
    """The hyperparameters of one trial; ``noise_multiplier = 0`` means clip without noise."""

    max_grad_norm: float
    lr: float
    noise_multiplier: float
    epochs: float = 2.0
    batch_size: int = 128
    model: str = "mlp"
    optimizer: str = "adam"
    #: Seeds the trial's sampling and noise, for experiments only: anyone who knows the seed can
    #: replay the noise. None (the default) draws both from OS entropy, as everywhere in dpfy; the
    #: model's initialisation is public and fixed by ``run_config.public_seed`` either way.
    seed: int | None = None

    def __post_init__(self) -> None:
        check_positive("max_grad_norm", self.max_grad_norm)
        check_positive("lr", self.lr)
        check_range("noise_multiplier", self.noise_multiplier, 0.0, math.inf, low_open=False)
        check_positive("epochs", self.epochs)
        check_count("batch_size", self.batch_size, minimum=1)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}"
            )

    def with_(self, **changes: float | int | str) -> TrialConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass
class TrialResult:
    """What one trial produced: its score, its privacy event and the gradient norms it saw."""

    config: TrialConfig
    correct: int
    evaluated: int
    event: DpEvent | None
    norms: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))

    @property
    def accuracy(self) -> float:
        """Validation accuracy: correct / evaluated."""
        return self.correct / self.evaluated


@dataclass(frozen=True)
class TuningData:
    """What a tuning run needs: data the trials train on, and the split they are scored on."""

    train: TensorDataset | Subset
    validation: TensorDataset | Subset
    input_shape: tuple[int, ...]
    num_classes: int


class _ZeroNoise:
    """A noise source that adds nothing: for zero-noise (public-data) trials only."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        """Zeros shaped like ``like``."""
        return torch.zeros_like(like)

    def fill_(self, out: torch.Tensor, std: float) -> torch.Tensor:
        """Zero ``out`` in place (the engine may draw noise straight into its sums)."""
        return out.zero_()


def split_indices(size: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded random split of ``range(size)`` into (the ``fraction`` part, the rest)."""
    check_range("fraction", fraction, 0.0, 1.0)
    order = np.random.default_rng(seed).permutation(size)
    cut = round(fraction * size)
    if cut < 1 or cut >= size:
        raise ValueError(
            f"a {fraction:g} split of {size} examples leaves one side empty; choose a fraction "
            "that keeps at least one example on each side"
        )
    return np.sort(order[:cut]), np.sort(order[cut:])


def _sampling_event(private: object) -> DpEvent:
    """The trial's training events as its ledger recorded them."""
    return private.ledger.events("training")  # type: ignore[attr-defined]


def run_trial(config: TrialConfig, data: TuningData, delta: float) -> TrialResult:
    """Train ``config`` privately on ``data.train`` and count correct validation predictions.

    Sampling and noise come from OS entropy unless ``config.seed`` is set (an experiment), so two
    default trials on the same data are two independent private runs.
    """
    model, optimizer = fresh_model(config, data)
    zero_noise = config.noise_multiplier == 0.0
    private = make_private(
        model,
        optimizer,
        data.train,
        batch_size=min(config.batch_size, len(data.train)),
        epochs=config.epochs,
        noise_multiplier=_PLACEHOLDER_SIGMA if zero_noise else config.noise_multiplier,
        delta=delta,
        max_grad_norm=config.max_grad_norm,
        seed=config.seed,
        criterion=nn.CrossEntropyLoss(),
    )
    if zero_noise:
        private.optimizer.noise = _ZeroNoise()
    criterion = private.criterion  # probed for coupled examples like every private loop
    with record_clip_norms(private) as norms:
        for x, y in rest_of_run(private.loader):
            private.optimizer.zero_grad()
            criterion(private.model(x), y).backward()
            private.optimizer.step()
    private.detach()
    validation = data.validation
    correct = round(accuracy(private.model, validation) * len(validation))  # type: ignore[arg-type]
    event = None if zero_noise else _sampling_event(private)
    return TrialResult(config, int(correct), len(validation), event, norms.norms)  # type: ignore[arg-type]


__all__ = ["TrialConfig", "TrialResult", "TuningData", "run_trial", "split_indices"]
