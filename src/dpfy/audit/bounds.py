"""ε lower bounds from an attack's error rates: exact binomial intervals, no torch.

An (ε, δ)-DP mechanism limits every test that tells a neighbouring pair apart: its
false-positive rate α and false-negative rate β satisfy α + e^ε β ≥ 1 − δ and e^ε α + β ≥ 1 − δ
(Kairouz, Oh & Viswanath 2015, Theorem 2.1). An attack's observed rates therefore bound ε from
below — but only the rates themselves, not their estimates, so each rate is replaced by its
Clopper–Pearson upper bound (Clopper & Pearson 1934) before the inequality is inverted. Both
rates are bounded at once by a union bound: each one-sided interval fails with probability at
most (1 − confidence)/2.

A threshold chosen on the same scores it is evaluated on overfits them and the bound is no
longer valid; :func:`best_threshold_bound` chooses it on one half of the scores and evaluates
it on the other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import special

from dpfy._validate import check_count, check_range
from dpfy.audit.result import AuditBound, AuditResult


def clopper_pearson(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """Two-sided exact interval for a binomial rate: each side fails w.p. ≤ (1 − confidence)/2.

    Exact (never narrower than the truth, unlike the normal approximation), so an ε bound built
    on it keeps its stated confidence even for the handful of trials an audit can afford.
    """
    successes, trials = _check_counts(successes, trials)
    tail = (1.0 - _check_confidence(confidence)) / 2.0
    return (
        _lower(successes, trials, tail),
        _upper(successes, trials, tail),
    )


def clopper_pearson_upper(successes: int, trials: int, confidence: float) -> float:
    """One-sided exact upper bound on a binomial rate, failing w.p. ≤ 1 − confidence."""
    successes, trials = _check_counts(successes, trials)
    return _upper(successes, trials, 1.0 - _check_confidence(confidence))


def clopper_pearson_lower(successes: int, trials: int, confidence: float) -> float:
    """One-sided exact lower bound on a binomial rate, failing w.p. ≤ 1 − confidence."""
    successes, trials = _check_counts(successes, trials)
    return _lower(successes, trials, 1.0 - _check_confidence(confidence))


def _upper(successes: int, trials: int, tail: float) -> float:
    """The rate p with P[Bin(trials, p) ≤ successes] = tail (1 when every trial succeeded)."""
    if successes >= trials:
        return 1.0
    return float(special.betaincinv(successes + 1, trials - successes, 1.0 - tail))


def _lower(successes: int, trials: int, tail: float) -> float:
    """The rate p with P[Bin(trials, p) ≥ successes] = tail (0 when none succeeded)."""
    if successes <= 0:
        return 0.0
    return float(special.betaincinv(successes, trials - successes + 1, tail))


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """The smallest ε an (ε, δ)-DP mechanism needs for a test with these error rates.

    max(log((1 − δ − fnr)/fpr), log((1 − δ − fpr)/fnr), 0) (Kairouz et al. 2015); ∞ when a rate
    is 0 and the other leaves room, since no finite ε allows a test that is never wrong one way.
    """
    fpr = check_range("fpr", fpr, 0.0, 1.0, low_open=False, high_open=False)
    fnr = check_range("fnr", fnr, 0.0, 1.0, low_open=False, high_open=False)
    delta = check_range("delta", delta, 0.0, 1.0, low_open=False)
    return max(_log_ratio(1.0 - delta - fnr, fpr), _log_ratio(1.0 - delta - fpr, fnr), 0.0)


def _log_ratio(numerator: float, denominator: float) -> float:
    """log(numerator/denominator), or no constraint (0) when the numerator is not positive."""
    if numerator <= 0.0:
        return 0.0
    if denominator <= 0.0:
        return math.inf
    return math.log(numerator / denominator)


def classical_epsilon_lower_bound(
    false_positives: int,
    negatives: int,
    false_negatives: int,
    positives: int,
    delta: float,
    confidence: float,
    *,
    method: str = "classical",
) -> AuditBound:
    """ε̂ from an attack's errors over independent trials (repeated runs, or a held-out split).

    Each rate is replaced by its one-sided Clopper–Pearson upper bound at confidence
    1 − (1 − confidence)/2, so both hold together with probability ≥ ``confidence`` (union
    bound), and ε̂ is :func:`epsilon_from_rates` of those bounds; ε̂ falls as either rate rises,
    so it is a lower bound whenever the two intervals hold. The trials must be independent and
    the attack (its threshold) fixed before they were seen.
    """
    false_positives, negatives = _check_counts(
        false_positives, negatives, "false_positives", "negatives"
    )
    false_negatives, positives = _check_counts(
        false_negatives, positives, "false_negatives", "positives"
    )
    if negatives == 0 or positives == 0:
        raise ValueError(
            f"a classical audit needs trials of both kinds, got {positives} with the canary and "
            f"{negatives} without; run the attack on both"
        )
    confidence = _check_confidence(confidence)
    tail = (1.0 - confidence) / 2.0
    fpr = _upper(false_positives, negatives, tail)
    fnr = _upper(false_negatives, positives, tail)
    epsilon = epsilon_from_rates(fpr, fnr, delta)
    trials = negatives + positives
    return AuditResult(
        method=method,
        epsilon_lower_bound=epsilon,
        confidence=confidence,
        delta=delta,
        guesses=trials,
        correct=trials - false_positives - false_negatives,
        notes=(
            f"FPR ≤ {fpr:.4g} ({false_positives}/{negatives}), FNR ≤ {fnr:.4g} "
            f"({false_negatives}/{positives}), each at {1 - tail:.4g} (union bound)",
        ),
    )


def classical_ceiling(negatives: int, positives: int, delta: float, confidence: float) -> float:
    """The largest ε̂ a classical audit of this size can show: that of an attack never wrong.

    Stated before an audit is run, so its cost is known: with n trials a side ε̂ is at most about
    log(n / log(2 / (1 − confidence))), however strong the attack (the rates' upper bounds
    never reach 0).
    """
    return classical_epsilon_lower_bound(
        0, negatives, 0, positives, delta, confidence
    ).epsilon_lower_bound


def best_threshold_bound(
    scores_in: Sequence[float] | np.ndarray,
    scores_out: Sequence[float] | np.ndarray,
    delta: float,
    confidence: float,
    *,
    method: str = "classical",
) -> AuditBound:
    """ε̂ of the best threshold test "score ≥ t means the canary was in", soundly chosen.

    Choosing t on the same scores it is then evaluated on overfits them and voids the bound, so
    t is chosen on the even-indexed half of each sample (the one maximising the classical bound
    there) and the bound is computed on the odd-indexed half alone. The scores of each kind must
    be independent and identically distributed (one per run, or per randomly drawn example), in
    any order that does not depend on their values. Higher scores must mean "in"; pass the
    negated loss for a loss.
    """
    scores_in, scores_out = _as_scores(scores_in, "scores_in"), _as_scores(scores_out, "scores_out")
    if scores_in.size < 2 or scores_out.size < 2:
        raise ValueError(
            "best_threshold_bound needs at least 2 scores of each kind (one half chooses the "
            f"threshold, the other evaluates it), got {scores_in.size} in and "
            f"{scores_out.size} out"
        )
    confidence = _check_confidence(confidence)
    threshold = choose_threshold(scores_in[0::2], scores_out[0::2], delta, confidence)
    bound = bound_at_threshold(
        threshold, scores_in[1::2], scores_out[1::2], delta, confidence, method=method
    )
    note = f"threshold {threshold:.6g} chosen on half the scores, evaluated on the other half"
    return bound.with_context(notes=(*bound.notes, note))


def bound_at_threshold(
    threshold: float,
    held_in: np.ndarray,
    held_out: np.ndarray,
    delta: float,
    confidence: float,
    **details: Any,
) -> AuditResult:
    """The classical bound of the attack "score ≥ threshold means in", on scores it never saw."""
    return classical_epsilon_lower_bound(
        int(np.sum(held_out >= threshold)),
        held_out.size,
        int(np.sum(held_in < threshold)),
        held_in.size,
        delta,
        confidence,
        **details,
    )


def choose_threshold(
    scores_in: np.ndarray, scores_out: np.ndarray, delta: float, confidence: float
) -> float:
    """The threshold (among the observed scores) with the largest classical ε̂ on these scores.

    Ranked by the bound itself rather than accuracy, so thresholds resting on a few errors in a
    small tail — where the ε̂ is largest — win only when there are enough trials behind them.
    """
    candidates = np.unique(np.concatenate([scores_in, scores_out]))
    sorted_in, sorted_out = np.sort(scores_in), np.sort(scores_out)
    false_neg = np.searchsorted(sorted_in, candidates, side="left")
    false_pos = scores_out.size - np.searchsorted(sorted_out, candidates, side="left")
    tail = (1.0 - confidence) / 2.0
    fpr = _upper_many(false_pos, scores_out.size, tail)
    fnr = _upper_many(false_neg, scores_in.size, tail)
    with np.errstate(divide="ignore", invalid="ignore"):
        one = np.log(np.clip(1.0 - delta - fnr, 0.0, None) / fpr)
        other = np.log(np.clip(1.0 - delta - fpr, 0.0, None) / fnr)
    epsilon = np.nan_to_num(np.maximum(one, other), nan=0.0, neginf=0.0)
    return float(candidates[int(np.argmax(epsilon))])


def _upper_many(successes: np.ndarray, trials: int, tail: float) -> np.ndarray:
    """:func:`_upper` for an array of success counts out of the same number of trials."""
    safe = np.minimum(successes, trials - 1)
    upper = special.betaincinv(safe + 1, trials - safe, 1.0 - tail)
    return np.where(successes >= trials, 1.0, upper)


def _as_scores(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    """A 1-D float array of finite scores, or a ValueError naming the problem."""
    array = np.asarray(values, dtype=float)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one score per trial (1-D), got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} holds NaN or ∞; score every trial with a finite number")
    return array


def _check_counts(
    successes: int, trials: int, name: str = "successes", trials_name: str = "trials"
) -> tuple[int, int]:
    """Whole counts with 0 ≤ successes ≤ trials."""
    successes = check_count(name, successes)
    trials = check_count(trials_name, trials)
    if successes > trials:
        raise ValueError(f"{name} ({successes}) cannot exceed {trials_name} ({trials})")
    return successes, trials


def _check_confidence(confidence: float) -> float:
    """A confidence strictly inside (0, 1): 1 would need infinitely many trials."""
    return check_range("confidence", confidence, 0.0, 1.0)


__all__ = [
    "best_threshold_bound",
    "bound_at_threshold",
    "choose_threshold",
    "classical_ceiling",
    "classical_epsilon_lower_bound",
    "clopper_pearson",
    "clopper_pearson_lower",
    "clopper_pearson_upper",
    "epsilon_from_rates",
]
