"""Black-box one-run audit: input-space canaries, one ordinary private run, the final model only.

Steinke, Nasr & Jagielski 2023 ("Privacy auditing with one (1) training run", arXiv:2305.08846,
§3 and their black-box experiments): m canary records are each put into the training set by an
independent fair coin, the model is trained once by the ordinary private training, and only the
final model is attacked: each canary's loss is its score (a lower loss means "more likely
trained on"), the auditor guesses "in" for the lowest losses and "out" for the highest, and
:func:`dpfy.audit.one_run.score_and_guess` turns the right guesses into ε̂ for the whole run.

The canaries are records of the dataset itself, chosen by a public seed, taken out of it and
given a random wrong label, so that a model that memorises them is told apart from one that
only generalises. The canaries' coin flips are never used to guess, only to score the guesses.

Use it with any loop::

    trainset, included, canaries = insert_canaries(train, 200, seed=0)
    ...  # train privately on trainset (make_private), as usual
    result = score_canaries(model, canaries, included, delta=plan.delta)

The bound holds at the stated confidence whatever the model; it is loose (an attacker that sees
only the final model learns far less than one that sees every step), so ε̂ well below the claim
is expected of a correct run and says nothing about tightness.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from dpfy.audit.one_run import score_and_guess
from dpfy.audit.result import AuditResult

#: Fewer canaries than this cannot show any ε̂ worth reporting (the one-run ceiling is tiny).
MIN_CANARIES = 20
#: At most this share of the dataset becomes canaries, so the run still learns its task.
MAX_CANARY_SHARE = 0.5

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def insert_canaries(
    dataset: TensorDataset, canaries: int, seed: int = 0, *, coin_seed: int | None = None
) -> tuple[TensorDataset, np.ndarray, TensorDataset]:
    """The dataset with ``canaries`` mislabelled records each kept by a coin flip.

    Returns the training set (the non-canary records, then the included canaries), the coin
    flips (True: included) and every canary record. ``seed`` (public) picks the canaries and
    their labels; ``coin_seed`` draws the flips (None: from the OS, so nobody can know them).
    """
    features, labels = _tensors(dataset)
    n = len(labels)
    _check_sizes(canaries, n)
    public = np.random.default_rng(seed)
    chosen = public.choice(n, size=canaries, replace=False)
    classes = int(labels.max()) + 1
    if classes < 2:
        raise ValueError("canaries get a wrong label, which needs at least 2 classes")
    shift = torch.as_tensor(public.integers(1, classes, size=canaries), dtype=labels.dtype)
    canary_set = TensorDataset(features[chosen], (labels[chosen] + shift) % classes)
    included = np.random.default_rng(coin_seed).random(canaries) < 0.5
    rest = torch.as_tensor(np.setdiff1d(np.arange(n), chosen))
    kept = torch.as_tensor(np.flatnonzero(included))
    trainset = TensorDataset(
        torch.cat([features[rest], canary_set.tensors[0][kept]]),
        torch.cat([labels[rest], canary_set.tensors[1][kept]]),
    )
    return trainset, included, canary_set


def canary_losses(
    model: nn.Module, canaries: TensorDataset, loss_fn: LossFn | None = None
) -> np.ndarray:
    """Each canary's loss under ``model`` (per example: ``loss_fn`` must not reduce)."""
    loss_fn = loss_fn or nn.CrossEntropyLoss(reduction="none")
    features, labels = canaries.tensors
    was_training = model.training
    model.eval()
    with torch.no_grad():
        losses = loss_fn(model(features), labels).detach().cpu().numpy().astype(float)
    model.train(was_training)
    if losses.shape != (len(labels),):
        raise ValueError(
            f"loss_fn returned shape {losses.shape} for {len(labels)} canaries; give it "
            "reduction='none' so each canary gets its own loss"
        )
    return losses


def score_canaries(
    model: nn.Module,
    canaries: TensorDataset,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    loss_fn: LossFn | None = None,
    claimed_epsilon: float | None = None,
    seed: int = 0,
) -> AuditResult:
    """ε̂ of the run that trained ``model``: the lowest losses guessed "in", the highest "out"."""
    losses = canary_losses(model, canaries, loss_fn)
    return audit_from_losses(losses, included, delta, confidence, claimed_epsilon, seed)


def audit_from_losses(
    losses: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float,
    claimed_epsilon: float | None = None,
    seed: int = 0,
) -> AuditResult:
    """The one-run bound on the canaries' negated losses (higher score: more likely in)."""
    _check_sizes(len(losses), None)
    result = score_and_guess(-np.asarray(losses, float), included, delta, confidence, seed=seed)
    return result.with_context(
        claimed_epsilon=claimed_epsilon,
        threat_model="black-box",
        notes=(*result.notes, "input-space canaries (random wrong labels), final model's loss"),
    )


def _check_sizes(canaries: int, records: int | None) -> None:
    """Enough canaries to bound anything, and a dataset large enough to give them up."""
    if canaries < MIN_CANARIES:
        raise ValueError(
            f"a black-box audit needs at least {MIN_CANARIES} canaries, got {canaries}; pass "
            "more (a few hundred show a useful ε̂)"
        )
    if records is not None and canaries > MAX_CANARY_SHARE * records:
        raise ValueError(
            f"{canaries} canaries are more than half of the {records} training records; use at "
            f"most {int(MAX_CANARY_SHARE * records)} or a larger dataset"
        )


def _tensors(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The (features, labels) of a TensorDataset of two tensors; anything else is refused."""
    if not isinstance(dataset, TensorDataset) or len(dataset.tensors) != 2:
        raise ValueError(
            "insert_canaries needs a TensorDataset of (features, labels); build one with "
            "torch.utils.data.TensorDataset(x, y)"
        )
    return dataset.tensors[0], dataset.tensors[1]


__all__ = [
    "MAX_CANARY_SHARE",
    "MIN_CANARIES",
    "audit_from_losses",
    "canary_losses",
    "insert_canaries",
    "score_canaries",
]
