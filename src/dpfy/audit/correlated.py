"""White-box audits of matrix-factorisation noise (BandMF, BLT, amplified BandMF): ε̂ of a run.

**The mechanism as claimed.** A BandMF or BLT run (:mod:`dpfy.plan.correlated`,
docs/correlated-noise.md) releases ``C x + σ z`` over its T steps (Denisov et al. 2022;
Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization"): step t adds
``σ·C·(C⁻¹ z)_t`` to its clipped gradient sum, C the plan's lower-triangular Toeplitz strategy
(c_0 = 1). The white-box auditor sees every intermediate model (Nasr et al. 2023). On the canary
model of :mod:`dpfy.audit.canaries`, normalised by B/C (:mod:`dpfy.audit.observe`), the released
stream of canary k's coordinate is

    y = x + σ C⁻¹ z,     z ~ N(0, I_T),

where x ∈ {0, 1}^T marks the steps at which canary k's clipped gradient entered the sum (its
*participations*); on the out side x = 0 (the record zeroed, or removed), or −x (replace-one: the
opposite Dirac). The noise has covariance σ² C⁻¹C⁻ᵀ across steps and is independent across
coordinates, so no other record and no other canary moves coordinate k.

**The statistic (the optimal linear test).** Decorrelating with C whitens the noise:
``C y = C x + σ z``. For a known pattern x the hypotheses are N(Cx, σ²I) ("in") and
N(ℓ·Cx, σ²I) ("out", ℓ = 0, or −1 for replace-one), and by Neyman–Pearson the most powerful
test thresholds their log-likelihood ratio

    Λ = [(1 − ℓ)·⟨Cx, Cy⟩ − (1 − ℓ²)·‖Cx‖²/2] / σ²,

which is linear in ⟨Cx, Cy⟩ = xᵀ CᵀC y = Σ_{t ∈ participations} (CᵀC y)_t: apply C to the
released stream, weight it by the strategy once more (Cᵀ), and sum over the canary's
participations. Standardised, u = ⟨Cx, Cy⟩/(σ‖Cx‖) is N(‖Cx‖/σ, 1) in and N(ℓ‖Cx‖/σ, 1) out:
the canary faces a Gaussian mechanism of μ = (1 − ℓ)‖Cx‖/σ, and ‖Cx‖ ≤ Δ, the sensitivity the
accounting charges (Δ maximises ‖Cx‖ over every pattern the participation schema allows, at
clip norm 1), so a correct run shows at most the claimed μ and its ε̂ stays below the claim.
A step that lets a canary add more than C, or adds less noise than σ·C·C⁻¹z, shifts u further.
With one band (C = I) Λ is DP-SGD's sum over the canary's steps.

**Which steps a canary takes part in** is what the participation schema allows, and the auditor
may know what the accounting does not keep secret:

- *Fixed order* (``fixed-order-epochs``, MinSeparation): one permutation drawn before training,
  independently of the data, and repeated every epoch; a record sits at one position and takes
  part once per epoch, s = N // B steps apart. The accounting (one Gaussian of σ/Δ, Denisov et
  al. 2022 and Choquette-Choo et al. 2022) holds for every such order, so the auditor reads each
  canary's steps from the batches the sampler fetched (a zeroed canary keeps its position).
- *Cyclic Poisson* (amplified BandMF, bands ≤ groups b): the records are split once,
  independently of the data, into b groups; round r of group g is step g + r·b, and each record
  of the group takes part with probability q, the coin the amplification theorem of
  Choquette-Choo et al. 2023 keeps secret. The auditor knows the split (the theorem holds for any
  fixed split), never the coins. A banded C with bands ≤ b has disjoint columns on one group's
  rounds, so the u_r = ⟨C e_{t_r}, Cy⟩/(σ‖C e_{t_r}‖) are independent, each N(s_r μ_r, 1) with
  s_r ~ Bernoulli(q) and μ_r = ‖C e_{t_r}‖/σ — exactly the Poisson-subsampled Gaussian each round
  is charged (with the largest column norm) — and the likelihood ratio is

      Λ = Σ_r [log(1 − q + q·e^{μ_r u_r − μ_r²/2}) − log(1 − q + q·e^{ℓ μ_r u_r − ℓ² μ_r²/2})],

  again a function of the terms (CᵀC y)_t at the canary's possible steps. Its out side zeroes
  the canary's row instead of removing it: in the fixed-split model of the theorem a zero
  gradient adds nothing to any sum and removing it moves no other record to another group, so
  both release the same distribution, and zeroing keeps the dataset size, hence the split the
  auditor conditions on, independent of which canaries are in.

**Trials and bounds.** A trial is one canary in one whole re-run of the plan (T steps: the noise
is correlated over the whole run, so nothing shorter is an independent trial), and ε̂ is compared
with the ledger's ε for the whole run. The canaries are Dirac gradients on distinct coordinates
(Nasr et al. 2023) and the noise is independent across coordinates, so given the order (or the
split) their statistics are independent; their shifts differ with their positions, and the
hypothesis-testing inequality (Kairouz et al. 2015), linear in the rates, bounds their average
rates as it bounds each. *Classical*: ``blocks`` re-runs with every canary in and ``blocks`` with
every canary out; the threshold on Λ is chosen on the first fifth of the trials and evaluated
with Clopper–Pearson bounds on the rest (:mod:`dpfy.audit.bounds`). *One run* (Steinke, Nasr &
Jagielski 2023): ``blocks`` re-runs, each canary of each in by a fair coin; each canary's
inclusion changes only its own run, so the output is (ε, δ)-DP in every canary with the one
run's ε, and Λ ranks the guesses (:func:`dpfy.audit.one_run.score_and_guess`).

**What it cannot see.** ε̂ bounds ε from below; it is not a test that the noise has the claimed
covariance. Noise that is not correlated as claimed but is at least as private — for instance
independent noise of the per-step std, σ·C per step or more, while the accounting charges the
factorisation: every column of C and every row of C⁻¹ has length ≥ 1 (c_0 = 1), so its
μ = √k/σ_step ≤ Δ/σ — is no privacy bug, and no sound audit reports one. Λ is most powerful
under the claim; a stream that leaks in other directions (noise replayed across steps) may
leak more than this statistic detects.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from scipy import signal

from dpfy.audit.bounds import bound_at_threshold, choose_threshold
from dpfy.audit.canaries import (
    OUT_SIDES,
    CanaryDesign,
    CanaryModel,
    canary_rows,
    coin_generator,
    out_mean,
)
from dpfy.audit.observe import StepSettings, _private_session, _Rows, watch_updates
from dpfy.audit.one_run_fdp import EventFamily, one_run_bound
from dpfy.audit.result import AuditResult
from dpfy.plan.accounting.events import DpEvent
from dpfy.plan.correlated_events import decode_strategy, describe_strategy

#: Share of each side's trials that chooses the classical threshold (the rest evaluate it).
PILOT_SHARE = 0.2
#: The sampler whose rounds are Poisson-sampled (amplified BandMF); the other is a fixed order.
CYCLIC = "cyclic-poisson"
#: Receives an audit's scores with the canaries in and out (higher means "in").
ScoresSink = Callable[[np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class FactorisedSession:
    """One whole re-run of a matrix-factorisation plan, as the white-box auditor sees it.

    ``updates``: the normalised update of every step on every coordinate (T rows; a clipped
    canary adds 1, the noise is σ·(C⁻¹z)). ``steps``: for each canary (columns), the steps it
    can take part in as the auditor may know them — where its record was fetched (fixed order),
    or its group's rounds (cyclic Poisson). ``sampling_rate``: q of each of those steps (cyclic
    Poisson), None when each is certain. ``coefficients``: C's first T Toeplitz coefficients.
    ``claimed_epsilon``: the ledger's ε after the run, at the run's δ.
    """

    updates: np.ndarray
    steps: np.ndarray
    coefficients: np.ndarray
    noise_multiplier: float
    sampling_rate: float | None
    claimed_epsilon: float
    strategy: str
    participation: str
    #: The re-run's ledger event and relation (the claim the f-DP one-run audit tests).
    claimed_event: DpEvent | None = None
    relation: str = "add-or-remove"


def out_side(settings: StepSettings) -> str:
    """The relation whose out side the canaries take: the run's, but zeroed for cyclic Poisson.

    Amplified BandMF is accounted under add-or-remove; its canaries are zeroed instead of
    removed (the same distribution in the fixed-split model; see the module docstring).
    """
    return "zero-out" if settings.sampler == CYCLIC else settings.relation


def factorised_design(settings: StepSettings, canaries: int, probes: int) -> CanaryDesign:
    """The audit's records: the run's N, ``canaries`` of them canaries (up to all N, since no
    canary is ever removed), each of norm 10·C."""
    if canaries < 1:
        raise ValueError(f"canaries must be at least 1, got {canaries}")
    if canaries > settings.records:
        raise ValueError(
            f"the run samples {settings.records} records; use at most that many canaries"
        )
    return CanaryDesign(canaries, probes, settings.records, 10.0 * settings.max_grad_norm)


class _WatchedRows(_Rows):
    """The audit rows, noting the indices of every batch fetched while ``watching``."""

    def __init__(self, canaries: torch.Tensor, blanks: int) -> None:
        super().__init__(canaries, blanks)
        self.watching = False
        self.fetched: list[np.ndarray] = []

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        if self.watching:
            self.fetched.append(np.asarray(indices, dtype=np.int64).reshape(-1))
        return super().__getitems__(indices)


def run_factorised_session(
    settings: StepSettings,
    design: CanaryDesign,
    included: torch.Tensor,
    seed: int | None,
    on_step: Callable[[], None] | None = None,
    *,
    limit: int | None = None,
) -> FactorisedSession:
    """Re-run the whole plan with the canaries in ``included`` (the others on their out side).

    The session is planned by make_private with the run's N, B, σ, C, steps and bands or
    buffers; a plan whose strategy differs from the run's is refused. ``limit`` stops after
    that many steps (to time a session; the result is then partial).
    """
    if settings.steps is None:
        raise ValueError("a matrix-factorisation audit needs the run's planned steps")
    side = out_side(settings)
    rows = _WatchedRows(canary_rows(design, included, side), design.blanks)
    model = CanaryModel(design.coordinates)
    private = _private_session(settings, model, rows, settings.steps, seed)
    try:
        plan = private.plan
        if settings.strategy is not None and (
            plan.mechanism != settings.mechanism or plan.strategy != settings.strategy
        ):
            raise ValueError(
                f"the audit planned another {plan.algorithm} strategy than the run's "
                f"({describe_strategy(plan.mechanism, plan.strategy)} against "
                f"{describe_strategy(settings.mechanism, settings.strategy)}): re-run the "
                "audit with the run's own dpfy version"
            )
        total = settings.steps if limit is None else min(limit, settings.steps)
        rows.watching = True
        watched = watch_updates(private, model, settings, total, on_step)
        step, claimed = watched.updates.shape[0], watched.epsilon
        rows.watching = False
        if len(rows.fetched) != step:
            raise RuntimeError(
                f"the audit saw {len(rows.fetched)} batches fetched for {step} steps; it cannot "
                "tell which steps each canary took part in"
            )
        coefficients = decode_strategy(plan.mechanism, plan.strategy).toeplitz(settings.steps)
        cyclic = plan.sampler == CYCLIC
        steps = (
            _group_rounds(private.loader.dp_sampler, design.canaries, step)
            if cyclic
            else _fetched_steps(rows.fetched, design.canaries, included, side)
        )
        return FactorisedSession(
            updates=watched.updates * settings.batch_size / settings.max_grad_norm,
            steps=steps,
            coefficients=coefficients,
            noise_multiplier=plan.noise_multiplier,
            sampling_rate=plan.sampling_rate if cyclic else None,
            claimed_epsilon=claimed,
            strategy=describe_strategy(plan.mechanism, plan.strategy),
            participation=_participation(plan, settings.steps),
            claimed_event=watched.event,
            relation=watched.relation,
        )
    finally:
        private.engine.detach()


def _fetched_steps(
    fetched: list[np.ndarray], canaries: int, included: torch.Tensor, side: str
) -> np.ndarray:
    """steps × canaries: where each canary's record was fetched (its fixed-order positions)."""
    flags = included.numpy().astype(bool)
    # A removed canary has no row: the dataset's rows are the present canaries, in order.
    owner = np.flatnonzero(flags) if OUT_SIDES[side] == "removed" else np.arange(canaries)
    steps = np.zeros((len(fetched), canaries), dtype=bool)
    for t, indices in enumerate(fetched):
        mine = indices[indices < owner.size]
        steps[t, owner[mine]] = True
    return steps


def _group_rounds(sampler, canaries: int, total: int) -> np.ndarray:  # CyclicPoissonSampler
    """steps × canaries: the rounds of each canary's group (never which of them sampled it)."""
    group = np.full(canaries, -1)
    for g in range(sampler.groups):
        members = sampler.group(g).numpy()
        members = members[members < canaries]
        group[members] = g
    steps = np.arange(total)[:, None] % sampler.groups == group[None, :]
    return steps & (group[None, :] >= 0)


def _participation(plan, steps: int) -> str:  # PrivacyPlan
    """The participation schema in words: what the auditor knows of each canary's steps."""
    if plan.sampler == CYCLIC:
        groups = round(plan.sampling_rate * plan.dataset_size / plan.expected_batch_size)
        return (
            f"cyclic Poisson: {groups} groups fixed once, each step samples one group at "
            f"q = {plan.sampling_rate:.4g}; a canary's possible steps are its group's "
            f"⌈T/b⌉ = {-(-steps // groups)} rounds (its group known, its coins not)"
        )
    per_epoch = plan.dataset_size // plan.expected_batch_size
    return (
        f"fixed order: each record at one position every epoch, s = {per_epoch} steps apart, "
        f"k = {-(-steps // per_epoch)} steps in the run (its positions known)"
    )


# -- the statistic -------------------------------------------------------------------------------
def decorrelated(stream: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """C y for each column of ``stream`` (steps × coordinates): Σ_{j ≤ t} c_j y_{t−j}."""
    c = np.asarray(coefficients, dtype=np.float64)[: stream.shape[0]]
    return signal.convolve(stream, c[:, None])[: stream.shape[0]]


def transposed(stream: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """Cᵀ w for each column: Σ_j c_j w_{t+j} (C applied to the time-reversed stream)."""
    return decorrelated(stream[::-1], coefficients)[::-1]


def log_likelihood_ratios(session: FactorisedSession, canaries: int, low: float) -> np.ndarray:
    """Λ of every canary under the claimed mechanism (the module docstring): higher is "in".

    ``low`` is the out side's mean (0 zeroed or removed, −1 negated). A canary that never could
    take part (a fixed order's N mod B records) scores 0 on both sides.
    """
    c = session.coefficients
    sigma2 = session.noise_multiplier**2
    # (CᵀC y)_t for every step and canary: the terms every statistic is made of.
    weighted = transposed(decorrelated(session.updates[:, :canaries], c), c)
    steps = session.steps[: weighted.shape[0]].astype(np.float64)
    if session.sampling_rate is None:
        inner = (steps * weighted).sum(axis=0)  # ⟨Cx, Cy⟩
        norm2 = (decorrelated(steps, c) ** 2).sum(axis=0)  # ‖Cx‖²
        return ((1.0 - low) * inner - (1.0 - low**2) * norm2 / 2.0) / sigma2
    # Cyclic Poisson: every possible round an independent subsampled Gaussian.
    column2 = np.cumsum(c**2)[::-1][: weighted.shape[0]]  # ‖C e_t‖² = Σ_{j < T−t} c_j²
    q = session.sampling_rate
    shift_in = (weighted - column2[:, None] / 2.0) / sigma2
    shift_out = (low * weighted - low**2 * column2[:, None] / 2.0) / sigma2
    per_round = _log_mixture(shift_in, q) - _log_mixture(shift_out, q)
    return (per_round * steps).sum(axis=0)


def _log_mixture(shift: np.ndarray, q: float) -> np.ndarray:
    """log(1 − q + q·e^shift), stably."""
    if q >= 1.0:
        return shift
    return np.logaddexp(math.log1p(-q), math.log(q) + shift)


# -- the audits ----------------------------------------------------------------------------------
def factorised_audit(
    settings: StepSettings,
    method: str,
    canaries: int,
    blocks: int,
    probes: int,
    confidence: float,
    seed: int | None,
    on_step: Callable[[], None] | None = None,
    on_scores: ScoresSink | None = None,
) -> AuditResult:
    """ε̂ of one whole run of a BandMF or BLT plan: ``method`` "classical", "one-run" or
    "one-run-f-dp"."""
    if method == "classical":
        return factorised_classical_audit(
            settings, canaries, blocks, probes, confidence, seed, on_step, on_scores
        )
    if method in ("one-run", "one-run-f-dp"):
        bound = "f-dp" if method == "one-run-f-dp" else "steinke"
        return factorised_one_run_audit(
            settings, canaries, blocks, probes, confidence, seed, on_step, on_scores, bound
        )
    raise ValueError(f"method must be 'classical', 'one-run' or 'one-run-f-dp', got {method!r}")


def factorised_classical_audit(
    settings: StepSettings,
    canaries: int,
    blocks: int,
    probes: int,
    confidence: float,
    seed: int | None,
    on_step: Callable[[], None] | None = None,
    on_scores: ScoresSink | None = None,
) -> AuditResult:
    """``blocks`` whole runs with every canary in and ``blocks`` with every canary out."""
    start = time.perf_counter()
    design = factorised_design(settings, canaries, probes)
    seeds = _seeds(seed, 2 * blocks)
    every = torch.ones(canaries, dtype=torch.bool)
    low = out_mean(out_side(settings))
    scores_in, scores_out, sessions = [], [], []
    for block in range(blocks):
        inside = run_factorised_session(settings, design, every, seeds[2 * block], on_step)
        outside = run_factorised_session(settings, design, ~every, seeds[2 * block + 1], on_step)
        scores_in.append(log_likelihood_ratios(inside, canaries, low))
        scores_out.append(log_likelihood_ratios(outside, canaries, low))
        sessions.append(inside)
    held_in, pilot_in = _split(np.concatenate(scores_in))
    held_out, pilot_out = _split(np.concatenate(scores_out))
    threshold = choose_threshold(pilot_in, pilot_out, settings.delta, confidence)
    bound = bound_at_threshold(threshold, held_in, held_out, settings.delta, confidence)
    if on_scores is not None:
        on_scores(np.concatenate(scores_in), np.concatenate(scores_out))
    first = sessions[0]
    return bound.with_context(
        confidence=confidence,
        canaries=canaries,
        runs=2 * blocks,
        seconds=time.perf_counter() - start,
        claimed_epsilon=first.claimed_epsilon,
        threat_model="white-box",
        scope="private-step",
        notes=(
            *_notes(first, settings),
            f"{blocks} whole runs with every canary in, {blocks} with every canary "
            f"{OUT_SIDES[out_side(settings)]}; threshold {threshold:.4g} on Λ chosen on the "
            f"first {PILOT_SHARE:.0%} of each side's trials",
            *bound.notes,
        ),
    )


def factorised_one_run_audit(
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
    """``blocks`` whole runs, each with its own canaries in by a fair coin; ε̂ of one run.

    ``bound``: "steinke" (ε, δ), or "f-dp" against the re-run's ledger event with its noise
    scaled (:mod:`dpfy.audit.one_run_fdp`).
    """
    start = time.perf_counter()
    design = factorised_design(settings, canaries, probes)
    flips = coin_generator(seed)
    included = torch.rand(blocks, canaries, generator=flips) < 0.5
    seeds = _seeds(None if seed is None else seed + 1, blocks)
    low = out_mean(out_side(settings))
    scores, sessions = [], []
    for block in range(blocks):
        session = run_factorised_session(settings, design, included[block], seeds[block], on_step)
        scores.append(log_likelihood_ratios(session, canaries, low))
        sessions.append(session)
    flat, flags = np.concatenate(scores), included.numpy().ravel()
    if on_scores is not None:
        on_scores(flat[flags], flat[~flags])
    family = EventFamily.of(sessions[0].claimed_event, settings, sessions[0].relation)
    result = one_run_bound(flat, flags, settings.delta, confidence, bound, family)
    return result.with_context(
        runs=blocks,
        seconds=time.perf_counter() - start,
        claimed_epsilon=sessions[0].claimed_epsilon,
        scope="private-step",
        notes=(
            *_notes(sessions[0], settings),
            f"{blocks} whole runs of {canaries} canaries each, every canary in by a fair coin "
            "and only in its own run",
            *result.notes,
        ),
    )


def seconds_per_step(settings: StepSettings, canaries: int, probes: int = 2) -> float:
    """A whole session's time (planning included) per step, timed on its first few steps."""
    design = factorised_design(settings, canaries, probes)
    every = torch.ones(canaries, dtype=torch.bool)
    run_factorised_session(settings, design, every, 0, limit=1)  # warm up
    marks: list[float] = []
    start = time.perf_counter()
    run_factorised_session(
        settings, design, every, 0, lambda: marks.append(time.perf_counter()), limit=5
    )
    per_step = (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else marks[0] - start
    planning = max(0.0, marks[0] - start - per_step)
    steps = settings.steps_per_block
    return (planning + steps * per_step) / steps


def _notes(session: FactorisedSession, settings: StepSettings) -> tuple[str, ...]:
    """What was audited: the mechanism, the schema, the trial, and the statistic."""
    return (
        f"mechanism: {session.strategy}; {session.participation}",
        f"one trial = one canary in one whole run of T = {settings.steps_per_block} steps; ε̂ "
        "and the claim are for the whole run",
        "statistic: Λ, the canary's log-likelihood ratio under the claimed mechanism from "
        "(CᵀC y)_t at its steps (C applied to the released stream, then the strategy's "
        "weights, summed over its participations)",
    )


def _split(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(held-out, pilot): the first PILOT_SHARE of the trials choose the threshold."""
    cut = max(1, min(scores.size - 1, round(PILOT_SHARE * scores.size)))
    return scores[cut:], scores[:cut]


def _seeds(seed: int | None, count: int) -> list[int | None]:
    """``count`` distinct session seeds derived from ``seed`` (None: each from the OS)."""
    if seed is None:
        return [None] * count
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(count, dtype=np.uint32)]


__all__ = [
    "CYCLIC",
    "FactorisedSession",
    "decorrelated",
    "factorised_audit",
    "factorised_classical_audit",
    "factorised_design",
    "factorised_one_run_audit",
    "log_likelihood_ratios",
    "out_side",
    "run_factorised_session",
    "seconds_per_step",
    "transposed",
]
