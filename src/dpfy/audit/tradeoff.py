"""f-DP audits: ε̂ from the tradeoff curve a step claims, tight for Gaussian noise. No torch.

**Tradeoff curves** (Dong, Roth & Su 2022, "Gaussian differential privacy", §2). A mechanism is
f-DP when every test of "out" against "in" with false-positive rate α has false-negative rate at
least f(α). The Gaussian mechanism of sensitivity 1 and noise σ has f = G_μ, μ = 1/σ,

    G_μ(α) = Φ(Φ⁻¹(1 − α) − μ),

and one step of it on a Poisson sample of rate q, tested as an auditor tests a canary (its
coordinate N(0, σ²) when the canary is out; N(1, σ²) with probability q and N(0, σ²) otherwise
when it is in; the likelihood ratio rises with the coordinate, so thresholds are optimal) has

    f_{q,μ}(α) = (1 − q)(1 − α) + q · G_μ(α)      (Dong et al., §4.1; q = 1 gives G_μ).

**The bound** (Nasr et al. 2023, "Tight auditing of differentially private machine learning",
§5: fit the Gaussian tradeoff rather than the (ε, δ) polygon). A threshold test's rates are
replaced by their Clopper–Pearson upper bounds α⁺, β⁺ (each at 1 − (1 − c)/2, so both hold at
c). f_{q,μ} rises as μ falls, so the claim "f_{q,μ}-DP" is refuted exactly when f_{q,μ}(α⁺) > β⁺,
i.e. for every μ below

    μ̂ = Φ⁻¹(1 − α⁺) − Φ⁻¹((β⁺ − (1 − q)(1 − α⁺)) / q).

*Assumption-free:* with probability ≥ c the step is not f_{q,μ}-DP for any μ < μ̂; a step that
claims μ = 1/σ and shows μ̂ > 1/σ breaks its claimed tradeoff, whatever its noise is. *Under the
claim's family* (the step is a q-subsampled Gaussian, of some σ): σ ≤ 1/μ̂, so its ε at δ is at
least ε̂ = ε(q, σ̂ = 1/μ̂, δ), computed by the plan's own accountant. ε̂ rises with μ̂ and equals the
claimed ε exactly when μ̂ = 1/σ, so "ε̂ > ε" and "μ̂ > μ" are the same verdict.

Why this is tight where the (ε, δ) bound is not: the (ε, δ) bound needs α of order e^{−ε}, far
in the tail, where n trials estimate it to within ≈ 3.7/n; the tradeoff curve is pinned in its
middle (α ≈ 0.1), where n = 10⁶ trials estimate the rates to ±0.1 %, and the Gaussian shape
carries the bound into the tail.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from dpfy._validate import check_count, check_range
from dpfy.plan.accounting.accountant import compute_epsilon
from dpfy.plan.accounting.events import DpEvent, GaussianEvent, PoissonSampledEvent

#: Share of the trials that choose the threshold (the rest evaluate it).
PILOT_SHARE = 0.2
#: The largest μ̂ reported (σ̂ = 0.05): beyond it every claim in the family is refuted anyway.
MAX_MU = 20.0
#: Errors of each kind the pilot must see at a threshold before it may be chosen.
MIN_ERRORS = 20
#: The one-sided tail at which the pilot bounds its rates while choosing the threshold.
PILOT_TAIL = 1e-4
#: ε̂ below this ratio of the claim is what the trial count is sized against.
TIGHT_RATIO = 0.8


def gaussian_tradeoff(alpha: np.ndarray | float, mu: float) -> np.ndarray:
    """G_μ(α) = Φ(Φ⁻¹(1 − α) − μ): the least FNR at FPR α against N(0,1) vs N(μ,1)."""
    return stats.norm.cdf(stats.norm.isf(np.asarray(alpha, dtype=float)) - mu)


def subsampled_tradeoff(alpha: np.ndarray | float, mu: float, q: float) -> np.ndarray:
    """f_{q,μ}(α) = (1 − q)(1 − α) + q·G_μ(α): one Poisson-subsampled Gaussian step, out vs in."""
    alpha = np.asarray(alpha, dtype=float)
    return (1.0 - q) * (1.0 - alpha) + q * gaussian_tradeoff(alpha, mu)


def refuted_mu(fpr_upper: np.ndarray, fnr_upper: np.ndarray, q: float) -> np.ndarray:
    """μ̂: every f_{q,μ} with μ < μ̂ lies above the point (α⁺, β⁺); 0 where none does.

    Vectorised over candidate thresholds. A point below even f_{q,∞} (β⁺ ≤ (1 − q)(1 − α⁺):
    the step is no q-subsampled Gaussian of any σ) refutes every μ, shown as :data:`MAX_MU`.
    """
    alpha = np.asarray(fpr_upper, dtype=float)
    beta = np.asarray(fnr_upper, dtype=float)
    shifted = (beta - (1.0 - q) * (1.0 - alpha)) / q
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = stats.norm.isf(alpha) - stats.norm.ppf(np.clip(shifted, 0.0, 1.0))
    mu = np.where(shifted <= 0.0, MAX_MU, np.minimum(mu, MAX_MU))
    return np.where(alpha >= 1.0, 0.0, np.nan_to_num(np.maximum(mu, 0.0), nan=0.0))


def step_event(q: float, sigma: float) -> DpEvent:
    """The claim's family: one Gaussian step of σ, on a Poisson sample of rate q (q = 1: none)."""
    if q >= 1.0:
        return GaussianEvent(sigma)
    return PoissonSampledEvent(q, GaussianEvent(sigma))


def epsilon_of_mu(mu: float, q: float, delta: float, accountant: str = "pld") -> float:
    """ε at δ of one q-subsampled Gaussian step of σ = 1/μ (0 when μ = 0)."""
    if mu <= 0.0:
        return 0.0
    return float(compute_epsilon(step_event(q, 1.0 / mu), delta, accountant))


@dataclass(frozen=True)
class TradeoffBound:
    """What one f-DP audit found: μ̂ (assumption-free) and the counts behind it: the held-out
    trials of each side and the test's errors on them; :meth:`epsilon` is ε̂ (within the claim's
    family)."""

    mu: float
    threshold: float
    false_positives: int
    negatives: int
    false_negatives: int
    positives: int
    fpr_upper: float
    fnr_upper: float
    q: float

    def epsilon(self, delta: float, accountant: str = "pld") -> float:
        """ε̂: the ε at δ of one q-subsampled Gaussian step of σ̂ = 1/μ̂."""
        return epsilon_of_mu(self.mu, self.q, delta, accountant)


def tradeoff_bound(
    scores_in: np.ndarray, scores_out: np.ndarray, q: float, confidence: float
) -> TradeoffBound:
    """μ̂ and ε̂ of the test "score ≥ t means in", t chosen on the first trials of each side.

    Trials are rows of ``scores_in`` / ``scores_out`` (independent draws; flattened in order):
    the first :data:`PILOT_SHARE` choose the threshold maximising μ̂, the rest evaluate it.
    """
    confidence = check_range("confidence", confidence, 0.0, 1.0)
    q = check_range("q", q, 0.0, 1.0, high_open=False)
    pilot_in, held_in = _split(np.asarray(scores_in, dtype=float).ravel())
    pilot_out, held_out = _split(np.asarray(scores_out, dtype=float).ravel())
    if held_in.size < 1 or held_out.size < 1:
        raise ValueError("an f-DP audit needs at least 2 trials of each side; run more steps")
    threshold = _best_threshold(pilot_in, pilot_out, q, confidence)
    fp = int(np.sum(held_out >= threshold))
    fn = int(np.sum(held_in < threshold))
    tail = (1.0 - confidence) / 2.0
    fpr = float(_upper(np.array([fp]), held_out.size, tail)[0])
    fnr = float(_upper(np.array([fn]), held_in.size, tail)[0])
    mu = float(refuted_mu(fpr, fnr, q))
    return TradeoffBound(
        mu=mu,
        threshold=threshold,
        false_positives=fp,
        negatives=held_out.size,
        false_negatives=fn,
        positives=held_in.size,
        fpr_upper=fpr,
        fnr_upper=fnr,
        q=q,
    )


def _best_threshold(scores_in: np.ndarray, scores_out: np.ndarray, q: float, c: float) -> float:
    """Among the pilot's scores (at most 4096 quantiles), the threshold with the largest μ̂.

    The pilot's rates are bounded at the stricter tail :data:`PILOT_TAIL` (and thresholds with
    fewer than :data:`MIN_ERRORS` errors of either kind skipped): the curve is flat near its
    best point, and a threshold in a thin tail would win on the pilot's luck alone and lose it on
    the held-out trials. The choice only costs tightness, never soundness.
    """
    pooled = np.concatenate([scores_in, scores_out])
    candidates = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, 4097)))
    sorted_in, sorted_out = np.sort(scores_in), np.sort(scores_out)
    fn = np.searchsorted(sorted_in, candidates, side="left")
    fp = scores_out.size - np.searchsorted(sorted_out, candidates, side="left")
    tail = min(PILOT_TAIL, (1.0 - c) / 2.0)
    mu = refuted_mu(_upper(fp, scores_out.size, tail), _upper(fn, scores_in.size, tail), q)
    least = min(MIN_ERRORS, math.ceil(0.05 * min(scores_in.size, scores_out.size)))
    enough = (fp >= least) & (fn >= least)
    if enough.any():
        mu = np.where(enough, mu, -1.0)
    if mu.max() <= 0.0:  # the pilot refutes nothing: the midpoint, best for a Gaussian shift
        return float((np.median(scores_in) + np.median(scores_out)) / 2.0)
    return float(candidates[int(np.argmax(mu))])


def _upper(successes: np.ndarray, trials: int, tail: float) -> np.ndarray:
    """One-sided Clopper–Pearson upper bounds, failing w.p. ≤ ``tail`` each (1 when all)."""
    successes = np.asarray(successes)
    safe = np.minimum(successes, trials - 1)
    upper = special.betaincinv(safe + 1, trials - safe, 1.0 - tail)
    return np.where(successes >= trials, 1.0, upper)


def _split(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pilot, held-out): the first PILOT_SHARE of the trials, then the rest."""
    cut = max(1, min(scores.size - 1, round(PILOT_SHARE * scores.size)))
    return scores[:cut], scores[cut:]


# -- what a claim needs ---------------------------------------------------------------------------
def expected_epsilon(
    trials: int,
    q: float,
    sigma: float,
    delta: float,
    confidence: float,
    *,
    fitted: bool = True,
    accountant: str = "pld",
) -> float:
    """ε̂ an audit of ``trials`` a side is expected to show on a correct step of (q, σ).

    The rates at each threshold are the claimed mechanism's, their counts rounded, the
    threshold the best one; ``fitted`` is this module's bound, else the (ε, δ) bound of the
    classical audit (Kairouz et al. 2015), which needs far more trials.
    """
    trials = check_count("trials", trials, minimum=2)
    held = trials - max(1, round(PILOT_SHARE * trials))
    t = np.linspace(-4.0 * sigma, 1.0 + 8.0 * sigma, 2001)
    alpha = stats.norm.sf(t / sigma)
    beta = (1.0 - q) * stats.norm.cdf(t / sigma) + q * stats.norm.cdf((t - 1.0) / sigma)
    tail = (1.0 - confidence) / 2.0
    fpr = _upper(np.round(alpha * held), held, tail)
    fnr = _upper(np.round(beta * held), held, tail)
    if fitted:
        return epsilon_of_mu(float(refuted_mu(fpr, fnr, q).max()), q, delta, accountant)
    with np.errstate(divide="ignore", invalid="ignore"):
        one = np.log(np.clip(1.0 - delta - fnr, 0.0, None) / fpr)
        other = np.log(np.clip(1.0 - delta - fpr, 0.0, None) / fnr)
    return float(np.nan_to_num(np.maximum(one, other), nan=0.0, neginf=0.0).clip(0.0).max())


def trials_needed(
    q: float,
    sigma: float,
    delta: float,
    confidence: float,
    claimed: float,
    *,
    ratio: float = TIGHT_RATIO,
    fitted: bool = True,
    limit: int = 10**12,
) -> int | None:
    """The fewest trials a side (to 2 significant digits) whose expected ε̂ reaches
    ``ratio``·``claimed``; None beyond ``limit`` (the bound cannot get there in practice)."""
    goal = ratio * claimed

    def reaches(n: int) -> bool:
        return expected_epsilon(n, q, sigma, delta, confidence, fitted=fitted) >= goal

    return _smallest(reaches, limit)


def _smallest(reaches: Callable[[int], bool], limit: int) -> int | None:
    """The smallest n (to ~2 digits) with ``reaches(n)``, by doubling then bisection on log n."""
    low, high = 10, 100
    while not reaches(high):
        if high >= limit:
            return None
        low, high = high, min(10 * high, limit)
    while high / low > 1.05:
        middle = int(math.sqrt(low * high))
        low, high = (low, middle) if reaches(middle) else (middle, high)
    return int(float(f"{high:.2g}"))


__all__ = [
    "MAX_MU",
    "MIN_ERRORS",
    "PILOT_SHARE",
    "TIGHT_RATIO",
    "TradeoffBound",
    "epsilon_of_mu",
    "expected_epsilon",
    "gaussian_tradeoff",
    "refuted_mu",
    "step_event",
    "subsampled_tradeoff",
    "tradeoff_bound",
    "trials_needed",
]
