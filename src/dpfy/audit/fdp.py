"""The f-DP audit of one private step: 10⁶ Dirac-canary trials in seconds, ε̂ close to ε.

**Trials, vectorised** (Nasr et al. 2023, §4: Dirac gradient canaries on coordinates no other
record moves). One audit session is dpfy's private step, built by make_private with the run's
σ, C, clipping unit and Poisson rate q, on ``canaries`` records that are each a Dirac canary
(:class:`~dpfy.audit.canaries.IndexedCanaryModel`), with as many more coordinates that no record
moves: the coordinates of canaries that are *out* (removed). At every step each present
canary's coordinate, normalised by B/C, is one trial "in" — N(1, σ²) when its record was
sampled (probability q), N(0, σ²) otherwise — and each absent canary's coordinate is one trial
"out", N(0, σ²). The noise is independent across coordinates and steps, and Poisson sampling
draws each record independently, so a correct step makes every coordinate of every step an
independent trial of the one-step mechanism: K canaries and T steps give K·T trials a side, for
the cost of T small steps.

**The bound** is :mod:`dpfy.audit.tradeoff`'s: the threshold test on a coordinate, its rates'
Clopper–Pearson upper bounds, and the tradeoff curve of a q-subsampled Gaussian fitted to them
(μ̂, assumption-free: the step is not f_{q,μ}-DP for μ < μ̂), then ε̂ = ε(q, 1/μ̂, δ), a lower
bound on the step's ε when its noise is Gaussian of some σ, as the claim says. ε̂ and the claim
are both of one step; the claim is the session's ledger after its first step.

**Where it applies.** DP-SGD with Poisson sampling, per example or per user (one record per
user), under add-or-remove: there every step is a fresh trial and removal is the out side.
Other samplers tie the trials together, DP-FTRL's and BandMF's noise is correlated across
steps, and other relations change the out side; for those the classical and one-run audits
(:mod:`dpfy.audit.whitebox`) apply.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch

from dpfy.audit.canaries import IndexedCanaryModel
from dpfy.audit.observe import StepSettings, _private_session, watch_updates
from dpfy.audit.result import AuditResult
from dpfy.audit.tradeoff import (
    PILOT_SHARE,
    TIGHT_RATIO,
    TradeoffBound,
    tradeoff_bound,
    trials_needed,
)

#: Canaries in (and as many coordinates out) per step, and steps, when not given.
DEFAULT_CANARIES = 10_000
DEFAULT_STEPS = 100
#: Receives an audit's scores with the canaries in and out (higher means "in").
ScoresSink = Callable[[np.ndarray, np.ndarray], None]


class _Indices(torch.utils.data.Dataset):
    """``records`` records, record i being canary i: a batch is the tensor of its indices."""

    def __init__(self, records: int) -> None:
        self.records = records

    def __len__(self) -> int:
        return self.records

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        return torch.as_tensor(indices, dtype=torch.long).reshape(-1)


def check_fdp_applies(settings: StepSettings) -> None:
    """Refuse a step whose trials are not independent draws of one Poisson-sampled step."""
    problems = []
    if settings.algorithm != "dp-sgd":
        problems.append(f"its algorithm is {settings.algorithm} (noise correlated across steps)")
    if settings.sampler not in (None, "poisson"):
        problems.append(f"its batches are {settings.sampler} (not independent Poisson draws)")
    if settings.relation != "add-or-remove":
        problems.append(f"its relation is {settings.relation}")
    if problems:
        raise ValueError(
            "the f-DP audit re-runs one Poisson-sampled DP-SGD step under add-or-remove, but "
            + "; ".join(problems)
            + "; use the classical or one-run audit (dpfy audit --method classical / one-run)"
        )


def trial_settings(settings: StepSettings, canaries: int) -> StepSettings:
    """The run's step on ``canaries`` records at the run's rate q = B/N (B rounded)."""
    if canaries < 10:
        raise ValueError(f"the f-DP audit needs at least 10 canaries, got {canaries}")
    q = settings.batch_size / settings.records
    batch = max(1, round(q * canaries))
    return dataclasses.replace(settings, records=canaries, batch_size=batch)


def run_trials(
    settings: StepSettings,
    canaries: int,
    steps: int,
    seed: int | None,
    on_step: Callable[[], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """(in, out, claim): steps × canaries normalised updates of present and absent canaries,
    and the session's claimed ε of one step at the run's δ."""
    trial = trial_settings(settings, canaries)
    model = IndexedCanaryModel(2 * canaries, 10.0 * settings.max_grad_norm)
    private = _private_session(trial, model, _Indices(canaries), steps, seed)
    try:
        watched = watch_updates(private, model, trial, steps, on_step, mark=1)
    finally:
        private.engine.detach()
    updates = watched.updates * trial.batch_size / trial.max_grad_norm
    return updates[:, :canaries], updates[:, canaries:], watched.epsilon_at_mark


def seconds_per_step(settings: StepSettings, canaries: int) -> float:
    """One audited step's time, timed on a short session after one to warm up (the estimate
    ``dpfy audit`` states before it starts)."""
    run_trials(settings, canaries, 2, 0)
    start = time.perf_counter()
    run_trials(settings, canaries, 4, 0)
    return (time.perf_counter() - start) / 4


def fdp_audit(
    settings: StepSettings,
    canaries: int = DEFAULT_CANARIES,
    steps: int = DEFAULT_STEPS,
    confidence: float = 0.95,
    seed: int | None = None,
    on_step: Callable[[], None] | None = None,
    on_scores: ScoresSink | None = None,
) -> AuditResult:
    """ε̂ of one step of the run's plan from ``canaries`` × ``steps`` trials a side."""
    check_fdp_applies(settings)
    start = time.perf_counter()
    scores_in, scores_out, claimed = run_trials(settings, canaries, steps, seed, on_step)
    trial = trial_settings(settings, canaries)
    q = trial.batch_size / trial.records
    bound = tradeoff_bound(scores_in, scores_out, q, confidence)
    if on_scores is not None:
        on_scores(scores_in.ravel(), scores_out.ravel())
    return AuditResult(
        method="f-dp",
        epsilon_lower_bound=bound.epsilon(settings.delta, settings.accountant),
        confidence=confidence,
        delta=settings.delta,
        canaries=canaries,
        runs=1,
        guesses=bound.positives + bound.negatives,
        correct=bound.positives + bound.negatives - bound.false_positives - bound.false_negatives,
        seconds=time.perf_counter() - start,
        claimed_epsilon=claimed,
        threat_model="white-box",
        scope="private-step",
        notes=fdp_notes(bound, trial, claimed, confidence, steps),
    )


def fdp_notes(
    bound: TradeoffBound, trial: StepSettings, claimed: float, confidence: float, steps: int
) -> tuple[str, ...]:
    """What was measured, the assumption ε̂ rests on, and the trials a claim needs."""
    sigma = trial.noise_multiplier
    need_fit = trials_needed(bound.q, sigma, trial.delta, confidence, claimed)
    need_classical = trials_needed(bound.q, sigma, trial.delta, confidence, claimed, fitted=False)
    total = bound.positives + round(bound.positives * PILOT_SHARE / (1 - PILOT_SHARE))
    return (
        f"one trial = one canary coordinate in one step; {trial.records} canaries in and "
        f"{trial.records} out per step, {steps} steps: {total} trials a side, the first "
        f"{PILOT_SHARE:.0%} choosing the threshold {bound.threshold:.4g}",
        f"FPR ≤ {bound.fpr_upper:.4g} ({bound.false_positives}/{bound.negatives}), FNR ≤ "
        f"{bound.fnr_upper:.4g} ({bound.false_negatives}/{bound.positives}), each at "
        f"{1 - (1 - confidence) / 2:.4g} (union bound)",
        f"μ̂ = {bound.mu:.4g} against the claimed μ = 1/σ = {1 / sigma:.4g}: without any "
        f"assumption, the step is not f-DP with the tradeoff of a q = {bound.q:.4g} subsampled "
        f"Gaussian of μ < μ̂ (at {confidence:g} confidence)",
        "ε̂ = ε(q, σ̂ = 1/μ̂, δ) assumes the step's noise is Gaussian, of whatever σ (the "
        "claim's family): it bounds the ε of such a step, and exceeds the claim exactly when "
        "μ̂ > 1/σ",
        "trials a side for an expected ε̂ ≥ "
        f"{TIGHT_RATIO:g}·ε: {_count(need_fit)} with this bound, {_count(need_classical)} with "
        f"the assumption-free (ε, δ) bound; this audit had {total}",
    )


def _count(trials: int | None) -> str:
    """A trial count in words (None: beyond any practical audit)."""
    return "more than 10¹²" if trials is None else f"≈ {trials:.2g}"


__all__ = [
    "DEFAULT_CANARIES",
    "DEFAULT_STEPS",
    "check_fdp_applies",
    "fdp_audit",
    "fdp_notes",
    "run_trials",
    "seconds_per_step",
    "trial_settings",
]
