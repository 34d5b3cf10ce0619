"""ε̂ from one training run: canaries in or out by coin flip, the auditor's guesses scored.

Steinke, Nasr & Jagielski 2023 ("Privacy auditing with one (1) training run", arXiv:2305.08846,
§3): m canaries are each included independently with probability ½; from the run's output the
auditor guesses "in" or "out" for r of them (abstaining on the rest) and v guesses are right.
If the run is (ε, δ)-DP, their main theorem for approximate DP bounds the chance of that many
right guesses:

    P[W ≥ v] ≤ f(v) + 2mδ · max_{1 ≤ i ≤ v} (f(v − i) − f(v)) / i,
    f(u) = P[Binomial(r, e^ε / (1 + e^ε)) ≥ u],

(for δ = 0, f alone: every guess is at best as good as randomised response). ε is rejected at
``confidence`` when the right side is at most 1 − confidence, and ε̂ is a rejected ε found by
bisection. Reporting any rejected ε is sound: a run that is (ε*, δ)-DP is (ε, δ)-DP for every
ε ≥ ε*, so a reported ε̂ above ε* means the theorem's bound at some ε ≥ ε* was exceeded, which
happens with probability at most 1 − confidence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import special, stats

from dpfy._validate import check_count, check_range
from dpfy.audit.result import AuditResult

#: Bisection stops when the bracket is this narrow (ε̂ is the lower, rejected, end).
EPSILON_TOLERANCE = 1e-6
#: No audit reports more than this; beyond it the binomial tails underflow.
MAX_EPSILON = 60.0


def one_run_p_value(
    epsilon: float, delta: float, guesses: int, correct: int, canaries: int
) -> float:
    """The theorem's bound on P[≥ ``correct`` right guesses] if the run were (ε, δ)-DP.

    Kept separate from the bisection so tests and users can evaluate the theorem at any ε.
    """
    _check_audit(guesses, correct, canaries, delta)
    if correct == 0:
        return 1.0
    accuracy = float(special.expit(epsilon))
    tail = float(stats.binom.sf(correct - 1, guesses, accuracy))
    if delta == 0.0:
        return tail
    shortfall = np.arange(1, correct + 1)
    # f(v − i) − f(v) = P[v − i ≤ W ≤ v − 1], accumulated from W = v − 1 downwards.
    between = np.cumsum(stats.binom.pmf(correct - shortfall, guesses, accuracy))
    extra = 2.0 * canaries * delta * float(np.max(between / shortfall))
    return min(1.0, tail + extra)


def one_run_epsilon_lower_bound(
    guesses: int, correct: int, delta: float, confidence: float, canaries: int
) -> float:
    """The largest ε (to 1e-6) the one-run theorem rejects at ``confidence``; 0 if none.

    Bisection keeps its lower end rejected, so the value returned is itself rejected and never
    rounds the bound up.
    """
    _check_audit(guesses, correct, canaries, delta)
    confidence = check_range("confidence", confidence, 0.0, 1.0)
    alpha = 1.0 - confidence

    def rejected(epsilon: float) -> bool:
        return one_run_p_value(epsilon, delta, guesses, correct, canaries) <= alpha

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):
        if high >= MAX_EPSILON:
            return MAX_EPSILON
        low, high = high, min(2.0 * high, MAX_EPSILON)
    while high - low > EPSILON_TOLERANCE:
        middle = 0.5 * (low + high)
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low


def guess_counts(canaries: int) -> tuple[int, ...]:
    """The declared numbers k of "in" (and of "out") guesses tried: fixed by m alone.

    Fixed before any score is seen, so the best of them needs only a Bonferroni split of the
    confidence and not a correction for a data-chosen k.
    """
    half = canaries // 2
    return tuple(sorted({k for k in (half, half // 2, canaries // 10, canaries // 50) if k >= 1}))


def one_run_ceiling(
    canaries: int, delta: float, confidence: float, ks: Sequence[int] | None = None
) -> float:
    """The largest ε̂ a one-run audit with this many canaries can show: every guess right.

    :func:`score_and_guess` can never report more, so this says up front whether an audit is
    large enough to test a claimed ε at all.
    """
    tried = tuple(guess_counts(canaries) if ks is None else ks)
    each = 1.0 - (1.0 - check_range("confidence", confidence, 0.0, 1.0)) / len(tried)
    return max(one_run_epsilon_lower_bound(2 * k, 2 * k, delta, each, canaries) for k in tried)


def score_and_guess(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    delta: float,
    confidence: float,
    *,
    ks: Sequence[int] | None = None,
    threat_model: str = "black-box",
    seed: int = 0,
) -> AuditResult:
    """ε̂ of a one-run audit: guess the top k scores "in" and the bottom k "out", best k.

    Higher scores must mean "more likely included". Each k in ``ks`` (default
    :func:`guess_counts`) is evaluated at confidence 1 − (1 − confidence)/len(ks), so the best
    of them holds at ``confidence`` (union bound). ``included`` is the coin flip of each canary,
    used only to score the guesses — never to make them: tied scores are ordered by a random
    permutation drawn from ``seed``, not by position, since a caller's order (members first)
    may itself reveal who is in.
    """
    scores = np.asarray(scores, dtype=float)
    mask = np.asarray(included)
    if scores.ndim != 1 or mask.shape != scores.shape or mask.dtype != bool:
        raise ValueError(
            "score_and_guess needs one finite score and one boolean inclusion flag per canary, "
            f"got scores of shape {scores.shape} and flags of shape {mask.shape} ({mask.dtype})"
        )
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores hold NaN or ∞; score every canary with a finite number")
    confidence = check_range("confidence", confidence, 0.0, 1.0)
    m = scores.size
    tried = tuple(guess_counts(m) if ks is None else ks)
    if not tried or any(not 1 <= check_count("k", k) <= m // 2 for k in tried):
        raise ValueError(f"each k must lie in [1, {m // 2}] (2k guesses of {m} canaries)")
    each = 1.0 - (1.0 - confidence) / len(tried)
    tie_break = np.random.default_rng(seed).permutation(m)
    order = np.lexsort((tie_break, -scores))
    best: tuple[float, int, int] = (-1.0, 0, 0)
    for k in tried:
        correct = int(mask[order[:k]].sum() + (~mask[order[m - k :]]).sum())
        epsilon = one_run_epsilon_lower_bound(2 * k, correct, delta, each, m)
        if epsilon > best[0]:
            best = (epsilon, 2 * k, correct)
    epsilon, guesses, correct = best
    return AuditResult(
        method="one-run",
        epsilon_lower_bound=epsilon,
        confidence=confidence,
        delta=delta,
        canaries=m,
        guesses=guesses,
        correct=correct,
        threat_model=threat_model,
        notes=(
            f"best of k ∈ {list(tried)} guesses each way, each at confidence {each:.4g} "
            "(union bound)",
        ),
    )


def _check_audit(guesses: int, correct: int, canaries: int, delta: float) -> None:
    """0 ≤ correct ≤ guesses ≤ canaries and δ in [0, 1): the theorem's setting."""
    check_count("guesses", guesses)
    check_count("correct", correct)
    check_count("canaries", canaries)
    if not correct <= guesses <= canaries:
        raise ValueError(
            f"need correct ≤ guesses ≤ canaries, got correct={correct}, guesses={guesses}, "
            f"canaries={canaries}; the auditor guesses at most once per canary"
        )
    check_range("delta", delta, 0.0, 1.0, low_open=False)


__all__ = [
    "EPSILON_TOLERANCE",
    "MAX_EPSILON",
    "guess_counts",
    "one_run_ceiling",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
    "score_and_guess",
]
