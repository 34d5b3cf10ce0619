"""Label-only DP training (guide §3.2): randomise each label once, then train on the noisy labels.

Only the labels are private: the features are public (the adversary may know every one of them),
so a model trained without further noise on the public features and the randomised labels is
post-processing of the randomised labels and is ε-label-DP (guide §2.2). Two randomisers:

- ``"rr"``: k-ary randomised response on every label (Warner 1965), one stage;
- ``"rr-prior"``: RRWithPrior in ``stages`` disjoint stages (Ghazi et al. 2021, "Deep learning with
  label differential privacy", Alg. 3). Stage 1 is plain randomised response (a uniform prior);
  the prior of each later stage's examples is the softmax of a model trained on the noisy labels
  of the stages before it, so the randomisation concentrates on the labels the public features
  make likely. The stages partition the examples by a public random permutation, independent of
  the labels.

Each label is randomised exactly once, so by parallel composition over examples and stages the
whole run is ε-label-DP (:class:`~dpfy.access.label_ledger.LabelLedger` accounts it).

Training on the noisy labels uses, by default, the *forward-corrected* loss (Patrini et al. 2017,
"Making deep neural networks robust to label noise: a loss correction approach", §3.1): the
model's class probabilities p(y|x) are pushed through the randomiser's known channel M[y, ŷ]
and the loss is −log Σ_y p(y|x)·M[y, ŷ] of the released label ŷ, so the model estimates the
clean label rather than fitting the noise. M depends only on ε and the public prior, so the
correction is post-processing and costs no privacy; ``correction="none"`` trains on ŷ directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dpfy._validate import check_count, check_positive
from dpfy.access.label_ledger import LABEL_MECHANISMS, LabelLedger
from dpfy.access.rr_prior import randomized_response_with_prior, rr_channel, rr_prior_channels
from dpfy.plan.mechanisms import randomized_response

__all__ = [
    "CORRECTIONS",
    "LabelPrivateResult",
    "ModelFactory",
    "stage_partition",
    "train_label_private",
]

#: How training treats the released labels: the forward-corrected loss, or none.
CORRECTIONS = ("forward", "none")

#: Builds a fresh model and its optimizer (each stage trains from the same public initialisation).
ModelFactory = Callable[[], tuple[nn.Module, torch.optim.Optimizer]]


@dataclass
class LabelPrivateResult:
    """The trained model, the ledger of the label randomisation, and the released labels."""

    model: nn.Module
    ledger: LabelLedger
    noisy_labels: np.ndarray
    stage_sizes: tuple[int, ...]


def stage_partition(size: int, stages: int, seed: int) -> list[np.ndarray]:
    """Disjoint, near-equal stages from a public permutation: independent of every label."""
    size = check_count("size", size, minimum=1)
    stages = check_count("stages", stages, minimum=1)
    if stages > size:
        raise ValueError(f"stages ({stages}) exceeds the {size} examples; use fewer stages")
    order = np.random.default_rng(seed).permutation(size)
    return [part.astype(np.int64) for part in np.array_split(order, stages)]


def forward_corrected_loss(
    logits: torch.Tensor, labels: torch.Tensor, channels: torch.Tensor
) -> torch.Tensor:
    """−log P[ŷ | x] = −log Σ_y softmax(logits)_y · M[y, ŷ], per example M (b, k, k)."""
    probabilities = torch.softmax(logits, dim=1)
    noisy = torch.einsum("bk,bkj->bj", probabilities, channels)
    picked = noisy.gather(1, labels[:, None])[:, 0]
    return -torch.log(picked.clamp_min(1e-12)).mean()


def fit_on_labels(
    factory: ModelFactory,
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    channels: torch.Tensor | None = None,
) -> nn.Module:
    """Ordinary training on public features and released labels: post-processing, no noise.

    ``channels`` (n, k, k): each example's randomiser channel, for the forward-corrected loss;
    None trains with plain cross-entropy on the released labels.
    """
    model, optimizer = factory()
    generator = torch.Generator().manual_seed(seed)
    criterion = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(labels), generator=generator).split(batch_size):
            optimizer.zero_grad()
            logits = model(features[batch])
            if channels is None:
                loss = criterion(logits, labels[batch])
            else:
                loss = forward_corrected_loss(logits, labels[batch], channels[batch])
            loss.backward()
            optimizer.step()
    model.eval()
    return model


@torch.no_grad()
def class_priors(model: nn.Module, features: torch.Tensor, batch_size: int = 4096) -> np.ndarray:
    """The model's softmax on public features: the next stage's prior (post-processing)."""
    model.eval()
    parts = [torch.softmax(model(x), dim=1) for x in features.split(batch_size)]
    return torch.cat(parts).double().numpy()


def _check_choice(mechanism: str, stages: int, correction: str) -> None:
    """One clear error for an unknown randomiser or correction, or stages without rr-prior."""
    if correction not in CORRECTIONS:
        raise ValueError(f"correction must be one of {', '.join(CORRECTIONS)}; got {correction!r}")
    if mechanism not in LABEL_MECHANISMS:
        raise ValueError(
            f"label mechanism must be one of {', '.join(LABEL_MECHANISMS)}; got {mechanism!r}"
        )
    check_count("stages", stages, minimum=1)
    if mechanism == "rr" and stages != 1:
        raise ValueError(
            "stages apply to rr-prior only (plain randomised response has no prior to learn): "
            "pass stages=1, or mechanism='rr-prior'"
        )


def train_label_private(
    factory: ModelFactory,
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    epsilon: float,
    *,
    mechanism: str = "rr",
    stages: int = 1,
    epochs: int = 20,
    batch_size: int = 128,
    seed: int | None = None,
    correction: str = "forward",
) -> LabelPrivateResult:
    """Randomise every label once (ε-label-DP) and train ``factory``'s model on the result.

    ``seed`` fixes the label randomisation too (experiments only: whoever knows the seed can undo
    it); None draws it from OS entropy. The stage partition, the initialisation and the
    batch order use the public seed (``seed`` or 0).
    """
    _check_choice(mechanism, stages, correction)
    epsilon = check_positive("epsilon", epsilon)
    num_classes = check_count("num_classes", num_classes, minimum=2)
    epochs = check_count("epochs", math.ceil(epochs), minimum=1)
    public = 0 if seed is None else seed
    rng = np.random.default_rng(seed)  # None: OS entropy
    true = labels.numpy()
    ledger = LabelLedger(len(true), target_epsilon=epsilon)
    noisy = np.full(len(true), -1, dtype=np.int64)
    channels = np.zeros((len(true), num_classes, num_classes), dtype=np.float32)
    parts = stage_partition(len(true), stages, public)
    model: nn.Module | None = None
    for stage, part in enumerate(parts):
        ledger.check_release(part, epsilon)
        if model is None:
            noisy[part] = randomized_response(true[part], num_classes, epsilon, rng=rng).output
            channels[part] = rr_channel(num_classes, epsilon)
            used = "rr"
        else:
            priors = class_priors(model, features[part])
            noisy[part] = randomized_response_with_prior(true[part], priors, epsilon, rng=rng)
            channels[part] = rr_prior_channels(priors, epsilon)
            used = "rr-prior"
        ledger.record(part, epsilon, mechanism=used, stage=stage)
        seen = np.concatenate(parts[: stage + 1])
        corrected = torch.from_numpy(channels[seen]) if correction == "forward" else None
        model = fit_on_labels(
            factory, features[seen], torch.from_numpy(noisy[seen]),
            epochs=epochs, batch_size=batch_size, seed=public, channels=corrected,
        )  # fmt: skip
    assert model is not None  # at least one stage ran
    return LabelPrivateResult(model, ledger, noisy, tuple(len(p) for p in parts))
