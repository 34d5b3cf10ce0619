"""ε̂ from one run with f-DP: the guesses tested against the claimed tradeoff curve, not (ε, δ).

Mahloujifar, Melis & Chaudhuri 2024 ("Auditing f-differential privacy in one run",
arXiv:2410.22235): the setting of :mod:`dpfy.audit.one_run` — m canaries, each in by a fair coin,
k guesses, c of them right — but the null hypothesis is "the run is f-DP" for a whole tradeoff
curve f rather than one (ε, δ) pair. Their bound on the chance of c or more right guesses is a
recursion over the guesses (their "audit with reconstruction-hardness and cap"): with τ = 1 −
confidence, start from r = τc/m and h = τ(k − c)/m and for i = c − 1, …, 0

    h' = max(h, B⁻¹(r)),   r ← min(r + i/(k − i)·(h' − h), 1),   h ← h',

where B⁻¹(r) = f(1 − r) inverts the blow-up B(x) = 1 − f(x) (the most an event of mass x
without a canary can weigh with it; f is symmetric); f is refuted at confidence 1 − τ when the
final r + h exceeds k/m. Because a curve uses every point of the tradeoff at once — not only the
two lines of one (ε, δ) — it rejects more than Steinke et al.'s bound from the same guesses.

**Families.** The audit reports the largest member of a family it refutes, the family chosen so
that its members are ordered (refuting one refutes every more private one):

- :class:`GaussianFamily`: μ-GDP, f = G_μ (Dong, Roth & Su 2022). It is the exact curve of
  every canary of DP-FTRL and of fixed-order BandMF/BLT (Gaussian noise, one sum over the
  canary's steps), and ε̂ = ε(μ̂, δ).
- :class:`EventFamily`: the claimed mechanism itself — the audit session's own ledger event —
  with every noise multiplier in it scaled by one factor (DP-SGD: T Poisson-subsampled Gaussian
  steps of rate q, σ free). Its curve is the envelope of the lines
  α + e^ε β ≥ 1 − δ(ε) over a grid of ε, δ(ε) from the plan's own accountant (both directions
  at once, so the envelope is symmetric; a grid gives a curve below the true one, which can only
  refute less). ε̂ = ε(σ̂, δ) of the same accountant.

Either way ε̂ > claimed ε exactly when the claimed member itself is refuted, so the verdict
"ε̂ above the claim" has the stated confidence whatever the mechanism.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import special

from dpfy._validate import check_range
from dpfy.audit.one_run import guess_counts, score_and_guess
from dpfy.audit.result import AuditResult
from dpfy.audit.tradeoff import epsilon_of_mu
from dpfy.plan.accounting.accountant import make_accountant
from dpfy.plan.accounting.events import DpEvent

#: Bisection on the family's parameter stops at this relative width (the rejected end kept).
RELATIVE_TOLERANCE = 1e-4
#: The ε grid whose (ε, δ(ε)) lines make an event's tradeoff curve.
EPSILON_GRID = tuple(float(e) for e in np.concatenate([np.linspace(0.0, 2.0, 41)[:-1],
                                                       np.geomspace(2.0, 60.0, 60)]))  # fmt: skip

#: The smallest noise multiplier an event family is searched down to.
SMALLEST_SIGMA = 0.3

BlowUpInverse = Callable[[float], float]


def refutes(blow_up_inverse: BlowUpInverse, canaries: int, guesses: int, correct: int,
            confidence: float) -> bool:  # fmt: skip
    """Whether c right guesses of k refute "f-DP" at ``confidence`` (the recursion above)."""
    if correct == 0:
        return False
    tau = 1.0 - confidence
    r = tau * correct / canaries
    h = tau * (guesses - correct) / canaries
    for i in range(correct - 1, -1, -1):
        h_new = max(h, blow_up_inverse(r))
        if h_new == h:
            break  # neither r nor h can change again
        r = min(r + i / (guesses - i) * (h_new - h), 1.0)
        h = h_new
    return r + h > guesses / canaries


class Family:
    """A family of tradeoff curves ordered by one parameter (larger: less private)."""

    label: str

    def blow_up_inverse(self, parameter: float) -> BlowUpInverse:
        """B⁻¹ of the member at ``parameter``."""
        raise NotImplementedError

    def epsilon(self, parameter: float) -> float:
        """ε at the audit's δ of the member at ``parameter``."""
        raise NotImplementedError

    def bracket(self) -> tuple[float, float]:
        """The parameters of the most and the least private members searched."""
        raise NotImplementedError


@dataclass(frozen=True)
class GaussianFamily(Family):
    """μ-GDP curves G_μ; ε(μ, δ) at ``delta``."""

    delta: float
    label: str = "μ-GDP (Gaussian tradeoff)"

    def blow_up_inverse(self, parameter: float) -> BlowUpInverse:
        return lambda r: float(special.ndtr(special.ndtri(r) - parameter))

    def epsilon(self, parameter: float) -> float:
        return epsilon_of_mu(parameter, 1.0, self.delta)

    def bracket(self) -> tuple[float, float]:
        return 1e-3, 60.0


@dataclass(frozen=True)
class EventFamily(Family):
    """The claimed mechanism's curve with its noise scaled: every noise multiplier of the
    ``claimed`` event divided by the parameter (1: the claim itself), accounted as the run is."""

    claimed: DpEvent
    delta: float
    accountant: str = "pld"
    relation: str = "add-or-remove"
    label: str = "the claimed mechanism's tradeoff, its noise scaled"

    @classmethod
    def of(cls, claimed: DpEvent | None, settings: Any, relation: str) -> EventFamily | None:
        """The family of an audit session's ledger event (None: no event recorded), at the
        audited run's δ and accountant (``settings``: a StepSettings)."""
        if claimed is None:
            return None
        return cls(claimed, settings.delta, settings.accountant, relation)

    def blow_up_inverse(self, parameter: float) -> BlowUpInverse:
        grid, deltas = np.asarray(EPSILON_GRID), self._deltas(parameter)

        def inverse(r: float) -> float:
            alpha = 1.0 - r  # f(1 − r): the envelope of the (ε, δ(ε)) lines at α
            lines = np.maximum(1.0 - deltas - np.exp(grid) * alpha,
                               np.exp(-grid) * (1.0 - deltas - alpha))  # fmt: skip
            return float(np.clip(lines.max(), 0.0, 1.0))

        return inverse

    def epsilon(self, parameter: float) -> float:
        return self._accountant(parameter).epsilon(self.delta)

    def bracket(self) -> tuple[float, float]:
        """Down to a twentieth of the claimed noise; up to where the smallest σ is
        :data:`SMALLEST_SIGMA` (a finer σ makes the accountant's grid huge)."""
        smallest = min(noise_multipliers(self.claimed), default=1.0)
        return 0.05, max(1.0, smallest / SMALLEST_SIGMA)

    def _deltas(self, parameter: float) -> np.ndarray:
        accountant = self._accountant(parameter)
        return np.array([accountant.delta(e) for e in EPSILON_GRID])

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a few members per audit, frozen self
    def _accountant(self, parameter: float):  # -> Accountant
        event = scaled_event(self.claimed, 1.0 / parameter)
        return make_accountant(self.accountant, self.relation).compose(event)


def scaled_event(event: DpEvent, factor: float) -> DpEvent:
    """``event`` with every noise multiplier in it multiplied by ``factor``."""
    if not dataclasses.is_dataclass(event):
        return event
    changes = {}
    for field in dataclasses.fields(event):
        value = getattr(event, field.name)
        if field.name == "noise_multiplier":
            changes[field.name] = value * factor
        elif isinstance(value, DpEvent):
            changes[field.name] = scaled_event(value, factor)
        elif isinstance(value, tuple) and value and all(isinstance(v, DpEvent) for v in value):
            changes[field.name] = tuple(scaled_event(v, factor) for v in value)
    return dataclasses.replace(event, **changes)


def noise_multipliers(event: DpEvent) -> list[float]:
    """Every noise multiplier inside ``event``."""
    if not dataclasses.is_dataclass(event):
        return []
    found = []
    for field in dataclasses.fields(event):
        value = getattr(event, field.name)
        if field.name == "noise_multiplier":
            found.append(float(value))
        elif isinstance(value, DpEvent):
            found += noise_multipliers(value)
        elif isinstance(value, tuple):
            for v in value:
                if isinstance(v, DpEvent):
                    found += noise_multipliers(v)
    return found


def largest_refuted(family: Family, canaries: int, guesses: int, correct: int,
                    confidence: float) -> float:  # fmt: skip
    """The least private member refuted (its parameter), to :data:`RELATIVE_TOLERANCE`; 0 if
    none. Bisection on log(parameter) keeps its lower end refuted."""
    low, high = family.bracket()

    def refuted(parameter: float) -> bool:
        inverse = family.blow_up_inverse(parameter)
        return refutes(inverse, canaries, guesses, correct, confidence)

    if not refuted(low):
        return 0.0
    if refuted(high):
        return high
    while high / low > 1.0 + RELATIVE_TOLERANCE:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if refuted(middle) else (low, middle)
    return low


def score_and_guess_fdp(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    family: Family,
    confidence: float,
    *,
    threat_model: str = "white-box",
    seed: int = 0,
) -> AuditResult:
    """ε̂ of a one-run audit under ``family``: top k guessed in, bottom k out, best k.

    The guesses are made as :func:`dpfy.audit.one_run.score_and_guess` makes them (the same k
    fixed by m, ties broken by a random permutation), each k at confidence 1 − (1 − c)/len(ks).
    """
    scores = np.asarray(scores, dtype=float)
    mask = np.asarray(included, dtype=bool)
    if scores.ndim != 1 or mask.shape != scores.shape or not np.all(np.isfinite(scores)):
        raise ValueError("one finite score and one inclusion flag per canary are needed")
    confidence = check_range("confidence", confidence, 0.0, 1.0)
    m = scores.size
    tried = guess_counts(m)
    each = 1.0 - (1.0 - confidence) / len(tried)
    order = np.lexsort((np.random.default_rng(seed).permutation(m), -scores))
    best = (0.0, 0.0, 0, 0)
    for k in tried:
        correct = int(mask[order[:k]].sum() + (~mask[order[m - k :]]).sum())
        parameter = largest_refuted(family, m, 2 * k, correct, each)
        epsilon = family.epsilon(parameter) if parameter > 0 else 0.0
        if epsilon > best[0]:
            best = (epsilon, parameter, 2 * k, correct)
    epsilon, parameter, guesses, correct = best
    return AuditResult(
        method="one-run-f-dp",
        epsilon_lower_bound=epsilon,
        confidence=confidence,
        delta=family.delta,  # type: ignore[attr-defined]
        canaries=m,
        guesses=guesses,
        correct=correct,
        threat_model=threat_model,
        notes=(
            f"f-DP one-run bound (Mahloujifar et al. 2024) over {family.label}: the least "
            f"private member refuted has parameter {parameter:.4g}; best of k ∈ {list(tried)} "
            f"guesses each way, each at confidence {each:.4g} (union bound)",
        ),
    )


def one_run_bound(
    scores: np.ndarray,
    included: np.ndarray,
    delta: float,
    confidence: float,
    bound: str,
    family: Family | None,
) -> AuditResult:
    """Steinke et al.'s (ε, δ) bound (``bound="steinke"``), or the f-DP bound against
    ``family`` with Steinke's ε̂ from the same guesses in its notes (``bound="f-dp"``)."""
    steinke = score_and_guess(scores, included, delta, confidence, threat_model="white-box")
    if bound == "steinke":
        return steinke
    if bound != "f-dp" or family is None:
        raise ValueError(
            f"bound must be 'steinke' or 'f-dp' (with the claim's family), got {bound!r}"
        )
    result = score_and_guess_fdp(scores, included, family, confidence)
    return result.with_context(
        notes=(
            *result.notes,
            "beside it, Steinke et al.'s (ε, δ) bound from the same scores: ε̂ = "
            f"{steinke.epsilon_lower_bound:.4g} ({steinke.correct} of {steinke.guesses} right)",
        )
    )


__all__ = [
    "EPSILON_GRID",
    "EventFamily",
    "Family",
    "GaussianFamily",
    "largest_refuted",
    "noise_multipliers",
    "one_run_bound",
    "refutes",
    "scaled_event",
    "score_and_guess_fdp",
]
