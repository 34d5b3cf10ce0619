"""Membership inference on a final model: could an attacker tell training examples apart?

The attack scores each candidate example — its loss under the model (Yeom et al. 2018), or, with
reference models trained without it, how far its loss falls below theirs (the offline
likelihood-ratio test of Carlini et al. 2022, "Membership inference attacks from first
principles", §4) — and a threshold on the score says "member". What is reported is the
attack's ROC curve, its AUC and its TPR at low FPR (the figure Carlini et al. argue matters: an
attack that is confident on a few examples breaches their privacy even at AUC near ½), and an
ε̂ by the classical route.

That ε̂ treats each example as an independent trial, which no theorem justifies for examples of
one model; when the members were drawn by coin flip, :func:`membership_inference` also returns
the one-run bound (Steinke, Nasr & Jagielski 2023), which is sound in exactly that setting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpfy.audit.bounds import best_threshold_bound
from dpfy.audit.one_run import score_and_guess
from dpfy.audit.result import AuditResult

#: The false-positive rates at which the attack's true-positive rate is reported.
LOW_FPRS = (1e-3, 1e-2, 1e-1)


@dataclass(frozen=True)
class RocCurve:
    """An attack's ROC: at ``thresholds[i]`` it flags ``tpr[i]`` of members, ``fpr[i]`` of others.

    Kept as arrays so the report, the plot and the tests read the same points.
    """

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray

    @property
    def auc(self) -> float:
        """Area under the curve (trapezoids; ½ for a coin flip, 1 for a perfect attack)."""
        return float(np.sum(np.diff(self.fpr) * (self.tpr[1:] + self.tpr[:-1])) / 2.0)

    def tpr_at(self, fpr: float) -> float:
        """The best TPR among thresholds whose FPR is at most ``fpr`` (0 if none)."""
        allowed = self.fpr <= fpr
        return float(self.tpr[allowed].max()) if allowed.any() else 0.0


def roc_curve(member_scores: np.ndarray, non_member_scores: np.ndarray) -> RocCurve:
    """ROC of the test "score ≥ t means member" over every distinct score, from (0, 0) to (1, 1).

    numpy only (no scikit-learn at run time); ties move both rates at once, as they must.
    """
    members = _scores(member_scores, "member_scores")
    others = _scores(non_member_scores, "non_member_scores")
    thresholds = np.unique(np.concatenate([members, others]))[::-1]
    flagged_members = members.size - np.searchsorted(np.sort(members), thresholds, side="left")
    flagged_others = others.size - np.searchsorted(np.sort(others), thresholds, side="left")
    return RocCurve(
        fpr=np.concatenate([[0.0], flagged_others / others.size]),
        tpr=np.concatenate([[0.0], flagged_members / members.size]),
        thresholds=np.concatenate([[np.inf], thresholds]),
    )


@dataclass(frozen=True)
class MembershipReport:
    """What the attack achieved, and the ε̂ it supports (``one_run`` only for coin-flip members)."""

    auc: float
    tpr_at_fpr: tuple[tuple[float, float], ...]
    members: int
    non_members: int
    bound: AuditResult
    one_run: AuditResult | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON for ``report.json`` and the benchmark table."""
        return {
            "auc": self.auc,
            "tpr_at_fpr": [{"fpr": f, "tpr": t} for f, t in self.tpr_at_fpr],
            "members": self.members,
            "non_members": self.non_members,
            "bound": self.bound.to_dict(),
            "one_run": None if self.one_run is None else self.one_run.to_dict(),
        }


def membership_inference(
    member_scores: Sequence[float] | np.ndarray,
    non_member_scores: Sequence[float] | np.ndarray,
    delta: float,
    confidence: float = 0.95,
    *,
    randomised: bool = False,
) -> MembershipReport:
    """ROC, AUC, TPR at :data:`LOW_FPRS` and ε̂ of an attack's scores (higher means member).

    ``randomised=True`` says each candidate was put in the training set by an independent fair
    coin; only then is the one-run bound computed, from the same scores.
    """
    members = _scores(member_scores, "member_scores")
    others = _scores(non_member_scores, "non_member_scores")
    curve = roc_curve(members, others)
    bound = best_threshold_bound(members, others, delta, confidence, method="membership-inference")
    note = "each example treated as an independent trial: an estimate for one model, not a proof"
    one_run = None
    if randomised:
        scores = np.concatenate([members, others])
        included = np.concatenate([np.ones(members.size, bool), np.zeros(others.size, bool)])
        one_run = score_and_guess(scores, included, delta, confidence)
    return MembershipReport(
        auc=curve.auc,
        tpr_at_fpr=tuple((level, curve.tpr_at(level)) for level in LOW_FPRS),
        members=members.size,
        non_members=others.size,
        bound=bound.with_context(canaries=members.size + others.size, notes=(*bound.notes, note)),
        one_run=one_run,
    )


def loss_scores(
    model: Any,
    inputs: Any,
    targets: Any,
    *,
    loss: Callable[[Any, Any], Any] | None = None,
    batch_size: int = 512,
) -> np.ndarray:
    """Per-example losses of ``model`` (eval mode, no gradients); negate them to score members.

    ``loss(outputs, targets)`` must return one loss per example (default: cross-entropy with
    ``reduction="none"``). The model's training mode is restored afterwards.
    """
    import torch

    criterion = loss or torch.nn.CrossEntropyLoss(reduction="none")
    was_training = model.training
    model.eval()
    parts = []
    try:
        with torch.no_grad():
            for start in range(0, len(inputs), batch_size):
                stop = start + batch_size
                values = criterion(model(inputs[start:stop]), targets[start:stop])
                if values.ndim != 1 or values.shape[0] != len(inputs[start:stop]):
                    raise ValueError(
                        "loss must return one value per example (e.g. reduction='none'), got "
                        f"shape {tuple(values.shape)}"
                    )
                parts.append(values.detach().double().cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(parts) if parts else np.zeros(0)


def likelihood_ratio_scores(
    target_losses: Sequence[float] | np.ndarray, reference_losses: Sequence[Any] | np.ndarray
) -> np.ndarray:
    """Offline likelihood-ratio scores: how far each example's loss falls below its references.

    ``reference_losses[j, i]`` is example i's loss under reference model j, trained without it.
    Losses become logit-scaled confidences φ = log(p / (1 − p)) with p = e^(−loss), which are
    close to Gaussian across models (Carlini et al. 2022, §4.2); the score is φ's z-score against
    the references, so each example is judged against its own difficulty.
    """
    target = _scores(target_losses, "target_losses")
    reference = np.asarray(reference_losses, dtype=float)
    if reference.ndim != 2 or reference.shape[1] != target.size or reference.shape[0] < 2:
        raise ValueError(
            "reference_losses must be (reference models ≥ 2) × (examples) with one column per "
            f"target loss, got shape {reference.shape} for {target.size} targets"
        )
    if not np.all(np.isfinite(reference)) or np.any(reference < 0) or np.any(target < 0):
        raise ValueError("losses must be finite and non-negative (a per-example loss)")
    phi, phi_ref = _logit_confidence(target), _logit_confidence(reference)
    spread = np.maximum(phi_ref.std(axis=0, ddof=1), 1e-6)
    return (phi - phi_ref.mean(axis=0)) / spread


def _logit_confidence(losses: np.ndarray) -> np.ndarray:
    """log(p / (1 − p)) for p = e^(−loss), computed stably near loss 0 and for large losses."""
    safe = np.maximum(losses, 1e-12)
    return -safe - np.log(-np.expm1(-safe))


def _scores(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    """A non-empty 1-D array of finite scores, or a ValueError naming the problem."""
    array = np.asarray(values, dtype=float)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} holds NaN or ∞; score every example with a finite number")
    return array


__all__ = [
    "LOW_FPRS",
    "MembershipReport",
    "RocCurve",
    "likelihood_ratio_scores",
    "loss_scores",
    "membership_inference",
    "roc_curve",
]
