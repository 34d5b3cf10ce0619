"""Truncated Poisson sampling: what capping a Poisson batch at M records costs, charged in δ.

A truncated Poisson step draws a Poisson sample at rate q and, if it holds more than M records,
keeps M of them. Run on the same dataset, it releases exactly what the untruncated step releases
except when the sample is cut, so the two output distributions are within total variation
``p = P[|S| > M]`` of each other on any dataset, and within ``Σ_t p_t`` over a run (a coupling
that draws the same samples). For neighbours D, D' and any set O of outcomes:

    P[T(D) ∈ O] ≤ P[M(D) ∈ O] + s ≤ e^ε P[M(D') ∈ O] + δ_M(ε) + s
                ≤ e^ε P[T(D') ∈ O] + δ_M(ε) + (1 + e^ε)·s

so a run of truncated steps is (ε, δ_M(ε) + (1 + e^ε)·s)-DP, where δ_M is the untruncated
run's curve and s = Σ_t P[Binomial(N + 1, q_t) > M_t]: N + 1 because a neighbour under
add-or-remove may hold one record more than the N the run was planned for (the larger dataset is
cut more often). This is the coupling bound; JAX Privacy and dp_accounting's
``TruncatedSubsampledGaussianDpEvent`` charge the truncation inside ε instead (a mixture privacy
loss distribution, arXiv 2508.15089), which is tighter but never smaller than the untruncated ε.
With M chosen so that the cut is rare (``max_batch_size_for``), s is negligible and the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from scipy.stats import binom

from dpfy._validate import check_count, check_sampling_rate
from dpfy.plan.accounting.events import (
    ComposedEvent,
    DpEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
    TruncatedPoissonSampledEvent,
)

__all__ = [
    "max_batch_size_for",
    "split_truncation",
    "truncated_delta",
    "truncated_epsilon",
    "truncation_probability",
]


def truncation_probability(dataset_size: int, sampling_rate: float, max_batch_size: int) -> float:
    """P[Binomial(N + 1, q) > M]: the chance one step's sample is cut, on the larger neighbour."""
    n = check_count("dataset_size", dataset_size, minimum=1)
    q = check_sampling_rate(sampling_rate)
    m = check_count("max_batch_size", max_batch_size, minimum=1)
    return float(binom.sf(m, n + 1, q))


def max_batch_size_for(
    dataset_size: int, sampling_rate: float, steps: int, budget: float = 1e-10
) -> int:
    """The smallest M whose truncation over ``steps`` steps costs at most ``budget`` in δ/(1+e^ε).

    A starting point for ``max_batch_size``: B plus a few standard deviations of the batch size.
    """
    n, q = check_count("dataset_size", dataset_size, minimum=1), check_sampling_rate(sampling_rate)
    steps = check_count("steps", steps, minimum=1)
    per_step = budget / steps
    m = int(binom.isf(per_step, n + 1, q))
    while m < n + 1 and truncation_probability(n, q, max(m, 1)) > per_step:
        m += 1
    return max(m, 1)


def split_truncation(event: DpEvent) -> tuple[DpEvent, float]:
    """(``event`` with each truncated sample replaced by its untruncated Poisson step, the total
    truncation probability s it ran with) — what an accountant composes, and what it adds to δ."""
    if isinstance(event, TruncatedPoissonSampledEvent):
        p = truncation_probability(event.dataset_size, event.sampling_rate, event.max_batch_size)
        return PoissonSampledEvent(event.sampling_rate, event.event), p
    if isinstance(event, SelfComposedEvent):
        inner, slack = split_truncation(event.event)
        if inner is event.event:
            return event, 0.0
        return SelfComposedEvent(inner, event.count), slack * event.count
    if isinstance(event, ComposedEvent):
        parts = [split_truncation(e) for e in event.events]
        if all(inner is e for (inner, _), e in zip(parts, event.events, strict=True)):
            return event, 0.0
        return ComposedEvent(tuple(p for p, _ in parts)), math.fsum(s for _, s in parts)
    return event, 0.0


def truncated_delta(delta_at: Callable[[float], float], epsilon: float, slack: float) -> float:
    """δ(ε) of a run whose untruncated curve is ``delta_at``: δ_M(ε) + (1 + e^ε)·s, at most 1."""
    if slack <= 0.0:
        return delta_at(epsilon)
    extra = math.inf if epsilon > 700 else (1.0 + math.exp(epsilon)) * slack
    return min(1.0, delta_at(epsilon) + extra)


def truncated_epsilon(
    epsilon_at: Callable[[float], float], delta: float, slack: float, rounds: int = 200
) -> float:
    """The smallest ε with δ_M(ε) + (1 + e^ε)·s ≤ δ, from the untruncated ε(δ) ``epsilon_at``.

    ε ↦ ε_M(δ − (1 + e^ε)·s) is increasing; any guess g with f = ε_M(δ − (1 + e^g)·s) ≤ g
    certifies f (δ_M(f) ≤ δ − (1 + e^g)·s ≤ δ − (1 + e^f)·s), so the answer returned is always
    one such f. ∞ when the truncation alone spends δ.
    """
    if slack <= 0.0:
        return epsilon_at(delta)

    def step(guess: float) -> float:
        room = delta - (1.0 + math.exp(min(guess, 700.0))) * slack
        return math.inf if room <= 0.0 else epsilon_at(room)

    guess = step(0.0)
    for _ in range(rounds):
        if not math.isfinite(guess):
            return math.inf
        padded = guess * (1.0 + 1e-9) + 1e-12
        found = step(padded)
        if found <= padded:
            return found
        guess = found
    return math.inf
