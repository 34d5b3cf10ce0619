"""White-box audits of the private step: ε̂ from gradient canaries, classical and one-run.

Python API for any run: ``audit_private_step(StepSettings.from_plan(private.plan))`` re-runs the
run's plan through dpfy's private step (:mod:`dpfy.audit.observe`) with Dirac canaries
(:mod:`dpfy.audit.canaries`) and returns an :class:`~dpfy.audit.result.AuditResult`.

**Classical** (Nasr et al. 2023): one session with every canary in and one with every canary
out (removed, zeroed or negated, by the run's relation). A trial is one canary coordinate in one
block — one step of DP-SGD (independent noise; the canary's gradient does not depend on the
model, so every step is a fresh run of the one-step mechanism), one epoch of DP-FTRL (its noise
is correlated within a tree, so single steps are not independent trials). Two statistics, each
at confidence 1 − (1 − c)/2 so that their maximum holds at c: the canary coordinate's update
(higher means "in"), and the noise scale the probes show (a correct step's is fixed; one that
divides by the realised batch size shrinks it when the canary's record makes the batch larger).
The threshold is chosen on the first fifth of each session's blocks and evaluated on the rest
(:func:`dpfy.audit.bounds.classical_epsilon_lower_bound`). ε̂ bounds the ε of one block, and is
compared with the ledger's ε for one block.

How many trials tightness needs: with n trials a side, a test that never errs one way has a
Clopper–Pearson rate bound of about 3.7/n at 97.5 %, so ε̂ ≤ log(n/3.7) however good the attack.
At ε = 8 for one step (σ ≈ 0.55 at q = ½, δ = 10⁻⁵) the best threshold's expected ε̂ is ≈ 3.9
with 3·10⁴ trials a side, ≈ 4.4 with 10⁵, ≈ 4.9 with 3·10⁵: reaching ε̂ ≥ ε/2 = 4 takes ≈ 10⁵
trials a side after the threshold split, e.g. 500 canaries × 250 steps.

**f-DP** (:mod:`dpfy.audit.fdp`; Nasr et al. 2023, §5): the tight audit of one DP-SGD step.
Every coordinate of every step is a trial (10⁴ canaries in and 10⁴ out per step), and the bound
fits the claimed Gaussian tradeoff curve to the test's rates instead of the (ε, δ) polygon, so
10⁶ trials a side (seconds) give ε̂ within a few per cent of ε at ε = 1 … 8.

**One-run** (Steinke, Nasr & Jagielski 2023): one session whose canaries are each in with
probability ½ (a coin flip the auditor scores, never uses); each canary's score is the
log-likelihood ratio of its coordinate's updates over all steps under the claimed mechanism,
and :func:`dpfy.audit.one_run.score_and_guess` turns the guesses into ε̂ for the whole run.

**What it audits.** The run's privacy plan applied by dpfy's own private step to a canary model
(``scope="private-step"``); never the run's model, loss or data pipeline, so a coupling between
examples there (batch statistics, a loss normalised over the batch) is invisible to it — the
run's behaviour checks from training cover those (:mod:`dpfy.audit.scope`), and
:func:`dpfy.audit.user_model.audit_user_model` runs the user's own model and loss through the
private step with an input canary, so a coupling there shows as ε̂ above the claim.

**Matrix-factorisation noise** (BandMF, BLT, amplified BandMF) is correlated over the whole
run, so one trial is one canary in one whole re-run, scored by the optimal test under the
claimed covariance σ²C⁻¹C⁻ᵀ: the released stream decorrelated with C and summed over the
canary's participations (:mod:`dpfy.audit.correlated`, where it is derived).

**Where the white-box audit is sound.** DP-SGD and user-level DP-SGD: yes, per step with
Poisson sampling (the canary user holds one record); shuffled or fixed-size batches tie the
canaries' inclusions together, so there only the one-run audit applies. DP-FTRL: only per
epoch — an epoch's trees are restarted, so epochs are independent, while steps inside a tree
share noise — and only under its zero-out relation: removing a record would shift every later
record into another batch, a pair of datasets the tree accounting does not call neighbours, so
an audit comparing them could report ε̂ above a correct claim. The one-run audit of DP-FTRL
needs the canaries in fixed positions of the stream, which its zero-out canaries keep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch
from scipy import special

from dpfy.audit.bounds import bound_at_threshold, choose_threshold
from dpfy.audit.canaries import CanaryDesign, coin_generator, out_mean
from dpfy.audit.correlated import factorised_audit
from dpfy.audit.fdp import check_fdp_applies, fdp_audit
from dpfy.audit.observe import Session, StepSettings, run_session
from dpfy.audit.one_run_fdp import EventFamily, one_run_bound
from dpfy.audit.result import AuditResult

#: Share of each session's blocks that chooses the threshold (the rest evaluate it).
PILOT_SHARE = 0.2
#: The classical audit's statistics (higher means "the canaries were in").
STATISTICS = ("canary update", "noise scale")
#: Receives an audit's scores with the canaries in and out (higher means "in").
ScoresSink = Callable[[np.ndarray, np.ndarray], None]


def audit_private_step(
    settings: StepSettings,
    *,
    method: str = "classical",
    canaries: int = 100,
    blocks: int = 100,
    probes: int = 64,
    confidence: float = 0.95,
    seed: int | None = None,
    statistics: tuple[str, ...] = STATISTICS,
    on_step: Callable[[], None] | None = None,
    on_scores: ScoresSink | None = None,
) -> AuditResult:
    """ε̂ of the run's private step (classical: of one block; one-run: of ``blocks`` blocks).

    A BandMF or BLT run (``settings.factorised``) is audited whole by
    :mod:`dpfy.audit.correlated`: each block is one re-run of all its T steps, and ε̂ (both
    methods) is of one run, beside the run's claimed ε.

    ``seed`` makes the audit reproducible (leave it None to draw from the OS); ``statistics``
    are the classical audit's (each costs a share of the confidence); ``on_step`` is called
    after every audited step (:func:`audit_steps` of them: a progress bar); ``on_scores``
    receives the scores in and out that ε̂ came from (for the plots).

    ``method="auto"`` is "f-dp" where it applies, else "classical". ``method="f-dp"``
    (:mod:`dpfy.audit.fdp`) audits one Poisson-sampled DP-SGD step with
    ``canaries`` canaries in and as many out in each of ``blocks`` steps, every coordinate of
    every step a trial, and fits the claimed Gaussian tradeoff curve: ε̂ of one step, near the
    claim for a correct step (use 10⁴ canaries and 100 steps).
    """
    method = chosen_method(settings, method)
    if method == "f-dp":
        return fdp_audit(settings, canaries, blocks, confidence, seed, on_step, on_scores)
    if settings.factorised:
        if "canary update" not in statistics:
            raise ValueError(
                f"a {settings.algorithm} audit has one statistic, the canary update (its "
                "log-likelihood ratio); pass statistics=('canary update',)"
            )
        return factorised_audit(
            settings, method, canaries, blocks, probes, confidence, seed, on_step, on_scores
        )
    if method == "classical":
        return classical_audit(
            settings, canaries, blocks, probes, confidence, seed, statistics, on_step, on_scores
        )
    if method in ("one-run", "one-run-f-dp"):
        bound = "f-dp" if method == "one-run-f-dp" else "steinke"
        return one_run_audit(
            settings, canaries, blocks, probes, confidence, seed, on_step, on_scores, bound
        )
    raise ValueError(
        f"method must be 'f-dp', 'classical', 'one-run' or 'one-run-f-dp', got {method!r}"
    )


def chosen_method(settings: StepSettings, method: str) -> str:
    """``method``, with "auto" chosen: the f-DP step audit where it applies, else classical."""
    if method != "auto":
        return method
    try:
        check_fdp_applies(settings)
    except ValueError:
        return "classical"
    return "f-dp"


def audit_steps(settings: StepSettings, method: str, blocks: int) -> int:
    """How many private steps an audit takes: two sessions (classical) or one (one-run, f-DP:
    there ``blocks`` counts steps)."""
    if chosen_method(settings, method) == "f-dp":
        return blocks
    return (2 if method == "classical" else 1) * blocks * settings.steps_per_block


def design_for(settings: StepSettings, canaries: int, probes: int) -> CanaryDesign:
    """The audit's records: the run's N, ``canaries`` of them canaries, each of norm 10·C.

    Removing every canary must leave at least B records (a batch of B stays possible).
    """
    if settings.relation == "add-or-remove" and settings.records - canaries < settings.batch_size:
        raise ValueError(
            f"{canaries} canaries removed from {settings.records} records leave fewer than the "
            f"batch size {settings.batch_size}; use at most "
            f"{settings.records - settings.batch_size} canaries"
        )
    return CanaryDesign(canaries, probes, settings.records, 10.0 * settings.max_grad_norm)


def classical_audit(
    settings: StepSettings,
    canaries: int,
    blocks: int,
    probes: int,
    confidence: float,
    seed: int | None,
    statistics: tuple[str, ...] = STATISTICS,
    on_step: Callable[[], None] | None = None,
    on_scores: ScoresSink | None = None,
) -> AuditResult:
    """Sessions with all canaries in and all out; ε̂ of one block (see the module docstring)."""
    unknown = sorted(set(statistics) - set(STATISTICS)) or ([] if statistics else ["(none)"])
    if unknown:
        raise ValueError(f"statistics must be among {list(STATISTICS)}, got {unknown}")
    check_independent_trials(settings)
    start = time.perf_counter()
    design = design_for(settings, canaries, probes)
    seeds = (None, None) if seed is None else (2 * seed, 2 * seed + 1)
    every = torch.ones(canaries, dtype=torch.bool)
    inside = run_session(settings, design, every, blocks, seeds[0], on_step)
    outside = run_session(settings, design, ~every, blocks, seeds[1], on_step)
    each = 1.0 - (1.0 - confidence) / len(statistics)
    observed = {
        "canary update": (_canary_scores(inside, settings, canaries),
                          _canary_scores(outside, settings, canaries)),
        "noise scale": (_scale_scores(inside, settings, canaries),
                        _scale_scores(outside, settings, canaries)),
    }  # fmt: skip
    bounds = {
        name: _split_bound(scores_in, scores_out, settings.delta, each)
        for name, (scores_in, scores_out) in observed.items()
        if name in statistics and scores_in.shape[1] > 0
    }
    if not bounds:
        raise ValueError("the noise-scale statistic needs at least 2 probes; pass probes=64")
    name, best = max(bounds.items(), key=lambda item: item[1].epsilon_lower_bound)
    if on_scores is not None:
        on_scores(observed[name][0].ravel(), observed[name][1].ravel())
    notes = tuple(
        f"{n}: ε̂ {b.epsilon_lower_bound:.3g}; {'; '.join(b.notes)}" for n, b in bounds.items()
    )
    return best.with_context(
        confidence=confidence,
        canaries=canaries,
        runs=2,
        seconds=time.perf_counter() - start,
        claimed_epsilon=inside.claimed_block_epsilon,
        threat_model="white-box",
        scope="private-step",
        notes=(
            f"best statistic: {name}; each at confidence {each:.4g} (union bound)",
            f"one trial = {settings.steps_per_block} step(s); ε̂ and the claim are for one trial",
            *notes,
        ),
    )


def check_independent_trials(settings: StepSettings) -> None:
    """Refuse samplers whose trials are not independent, which Clopper–Pearson assumes.

    Shuffled batches put each record in exactly one step of an epoch, and fixed-size batches
    make the canaries of a step compete for B places; the one-run audit needs neither.
    """
    if settings.algorithm != "dp-ftrl" and settings.sampler in ("shuffle", "fixed-size"):
        raise ValueError(
            f"the classical audit needs independent trials, but {settings.sampler} batches tie "
            "the canaries' inclusions together (within a step or an epoch); use the one-run "
            "audit (method='one-run', dpfy audit --method one-run), which needs no such "
            "independence"
        )


def one_run_audit(
    settings: StepSettings,
    canaries: int,
    blocks: int,
    probes: int,
    confidence: float,
    seed: int | None,
    on_step: Callable[[], None] | None = None,
    on_scores: ScoresSink | None = None,
    bound: str = "steinke",
) -> AuditResult:
    """One session, each canary in with probability ½; ε̂ of the whole session.

    ``bound`` "steinke" tests (ε, δ) (Steinke et al. 2023); "f-dp" tests the session's own
    ledger event with its noise scaled (Mahloujifar et al. 2024), Steinke's figure in its notes.
    """
    start = time.perf_counter()
    design = design_for(settings, canaries, probes)
    flips = coin_generator(seed)
    included = torch.rand(canaries, generator=flips) < 0.5
    session = run_session(
        settings, design, included, blocks, None if seed is None else seed + 1, on_step
    )
    scores = _log_likelihood_ratios(session, settings, canaries)
    if on_scores is not None:
        on_scores(scores[included.numpy()], scores[~included.numpy()])
    flags = included.numpy()
    family = EventFamily.of(session.claimed_event, settings, session.relation)
    result = one_run_bound(scores, flags, settings.delta, confidence, bound, family)
    return result.with_context(
        runs=1,
        seconds=time.perf_counter() - start,
        claimed_epsilon=session.claimed_epsilon,
        scope="private-step",
        notes=(*result.notes, f"{blocks * settings.steps_per_block} steps, white-box updates"),
    )


def _canary_scores(session: Session, settings: StepSettings, canaries: int) -> np.ndarray:
    """Each block's update on each canary coordinate: rows are blocks, columns canaries."""
    return session.blocks(settings.steps_per_block)[:, :canaries]


def _scale_scores(session: Session, settings: StepSettings, canaries: int) -> np.ndarray:
    """−log of the probes' spread in each block (larger when the noise shrinks): one column."""
    probes = session.blocks(settings.steps_per_block)[:, canaries:]
    if probes.shape[1] < 2:
        return np.empty((probes.shape[0], 0))
    return -np.log(probes.std(axis=1, ddof=1) + 1e-300)[:, None]


def _split_bound(
    scores_in: np.ndarray, scores_out: np.ndarray, delta: float, confidence: float
) -> AuditResult:
    """Threshold chosen on the first blocks, bound evaluated on the rest ("≥ t" means in)."""
    pilot_in, held_in = _split(scores_in)
    pilot_out, held_out = _split(scores_out)
    threshold = choose_threshold(pilot_in, pilot_out, delta, confidence)
    bound = bound_at_threshold(threshold, held_in, held_out, delta, confidence)
    return bound.with_context(notes=(*bound.notes, f"threshold {threshold:.4g}"))


def _split(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first PILOT_SHARE of the blocks (flattened), and the rest."""
    cut = max(1, min(scores.shape[0] - 1, round(PILOT_SHARE * scores.shape[0])))
    return scores[:cut].ravel(), scores[cut:].ravel()


def _log_likelihood_ratios(session: Session, settings: StepSettings, canaries: int) -> np.ndarray:
    """Σ over blocks of log p_in(x)/p_out(x) under the claimed mechanism, per canary.

    A DP-SGD step's canary coordinate is N(0, σ²) unsampled and N(μ, σ²) sampled (q = B/N; μ = 1
    in, the relation's out mean out); a DP-FTRL epoch's is N(μ, v σ²) (always in it; v the tree's
    prefix variance) and its ratio is linear in x.
    """
    x = _canary_scores(session, settings, canaries)
    sigma2 = settings.noise_multiplier**2
    low = out_mean(settings.relation)
    if settings.algorithm == "dp-ftrl":
        return ((1.0 - low) * x.sum(axis=0)) / sigma2
    q = settings.batch_size / settings.records
    return (_log_mixture(x, 1.0, q, sigma2) - _log_mixture(x, low, q, sigma2)).sum(axis=0)


def _log_mixture(x: np.ndarray, mean: float, q: float, sigma2: float) -> np.ndarray:
    """log[(1 − q) + q · N(x; mean, σ²)/N(x; 0, σ²)], stably."""
    if q >= 1.0:
        return (2.0 * mean * x - mean**2) / (2.0 * sigma2)
    log_ratio = (2.0 * mean * x - mean**2) / (2.0 * sigma2)
    return special.logsumexp(
        np.stack([np.full_like(x, math.log1p(-q)), math.log(q) + log_ratio]), axis=0
    )


__all__ = [
    "STATISTICS",
    "ScoresSink",
    "audit_private_step",
    "audit_steps",
    "check_independent_trials",
    "chosen_method",
    "classical_audit",
    "design_for",
    "one_run_audit",
]
