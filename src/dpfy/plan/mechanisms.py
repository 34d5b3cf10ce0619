"""Classic DP mechanisms: Laplace, Gaussian (classical, analytic), exponential, randomised response.

Each mechanism returns a :class:`MechanismResult` holding the released output *and* the
:class:`~dpfy.plan.accounting.events.DpEvent` that describes what was spent, so the caller can
record it
in a ledger or hand it to an accountant (guide §2.2: privacy adds up only if every release is
counted). Sensitivities are those of the query under the neighbouring relation the caller
accounts under; replace-one adjacency typically doubles them (guide §2.1).

Randomness comes from an optional ``rng`` (a :class:`numpy.random.Generator`); when omitted, a
fresh generator seeded from the operating system is used. Pass a seeded generator only for tests:
a predictable seed makes the noise predictable and voids the guarantee.

Floating-point caveat (Mironov 2012, "On significance of the least significant bits for
differential privacy", CCS): the proofs of the Laplace and Gaussian mechanisms assume exact real
arithmetic. Textbook samplers in floating point (as used here, through numpy) produce outputs whose
low-order bits can reveal the unnoised value, so the released *bits* are not exactly ε-DP. The
snapping mechanism (same paper) or discrete/integer samplers fix this; they are not implemented
here. Treat these mechanisms as faithful to the mathematics but not hardened against an adversary
who inspects the exact binary representation of the output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
from scipy import optimize, special

from dpfy._validate import check_count, check_delta, check_positive
from dpfy.plan.accounting.events import DpEvent, GaussianEvent, LaplaceEvent, PureDpEvent

__all__ = [
    "GAUSSIAN_CALIBRATIONS",
    "MechanismResult",
    "analytic_gaussian_delta",
    "analytic_gaussian_sigma",
    "classical_gaussian_sigma",
    "exponential_mechanism",
    "gaussian_mechanism",
    "laplace_mechanism",
    "randomized_response",
    "randomized_response_keep_probability",
]

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class MechanismResult(Generic[T]):
    """A released value together with the privacy event it cost, so the cost is never lost."""

    output: T
    event: DpEvent


# -- shared helpers ----------------------------------------------------------------------------


def _generator(rng: np.random.Generator | None) -> np.random.Generator:
    """The caller's generator, or a fresh OS-seeded one (never a fixed seed by default)."""
    if rng is None:
        return np.random.default_rng()
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator or None, got {type(rng).__name__}")
    return rng


def _as_finite_array(name: str, value: Any) -> np.ndarray:
    """The query answer as a float array; NaN or ±inf cannot be privatised meaningfully."""
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number or an array of numbers, got {value!r}") from None
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must contain only finite numbers (no NaN or inf)")
    return array


def _like_input(value: Any, noisy: np.ndarray) -> float | np.ndarray:
    """Return a float for scalar input and an array of the same shape otherwise."""
    return float(noisy) if np.ndim(value) == 0 else noisy


# -- Laplace -----------------------------------------------------------------------------------


def laplace_mechanism(
    value: float | np.ndarray | Sequence[float],
    sensitivity: float,
    epsilon: float,
    rng: np.random.Generator | None = None,
) -> MechanismResult[float | np.ndarray]:
    """Release ``value`` with Laplace noise of scale Δ₁/ε: ε-DP (Dwork & Roth 2014, Thm 3.6).

    ``sensitivity`` is the ℓ₁ sensitivity Δ₁ of the whole (possibly vector-valued) query. The
    event is ``LaplaceEvent(noise_multiplier=1/ε)``: the scale divided by Δ₁.
    """
    array = _as_finite_array("value", value)
    sensitivity = check_positive("sensitivity", sensitivity)
    epsilon = check_positive("epsilon", epsilon)
    scale = sensitivity / epsilon
    noisy = array + _generator(rng).laplace(0.0, scale, size=array.shape)
    return MechanismResult(_like_input(value, noisy), LaplaceEvent(noise_multiplier=1.0 / epsilon))


# -- Gaussian calibration ----------------------------------------------------------------------


def classical_gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """σ = Δ₂·√(2 ln(1.25/δ))/ε, the textbook bound (Dwork & Roth 2014, Thm A.1; guide §2.4).

    The proof only holds for ε in (0, 1), so larger ε is refused rather than silently returning
    a σ with no guarantee behind it.
    """
    sensitivity = check_positive("sensitivity", sensitivity)
    epsilon = check_positive("epsilon", epsilon)
    delta = check_delta(delta)
    if epsilon >= 1.0:
        raise ValueError(
            "the classical Gaussian bound σ = Δ·√(2 ln(1.25/δ))/ε is valid only for epsilon in "
            f"(0, 1) (Dwork & Roth 2014, Thm A.1), got epsilon={epsilon!r}; use "
            "analytic_gaussian_sigma (Balle & Wang 2018), which is tight for any epsilon > 0"
        )
    return sensitivity * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


_SQRT_HALF = math.sqrt(0.5)
_SIGMA_SAFETY = 1e-9
"""Relative headroom added to the analytic σ: covers rounding in evaluating δ (≈1e-11 at worst)."""


def _log_gaussian_delta(ratio: float, epsilon: float) -> float:
    """log δ(ε) of the Gaussian mechanism with σ/Δ = ``ratio`` (Balle & Wang 2018, Thm 8).

    δ = Φ(a) − e^ε Φ(b) with a = 1/(2r) − εr, b = −1/(2r) − εr. For a < 0 both terms are tiny;
    since b² − a² = 2ε, writing Φ(−x) = ½·e^(−x²/2)·erfcx(x/√2) factors out the common e^(−a²/2)
    and leaves a difference of two O(1) numbers, so log δ stays accurate far below 1e-300.
    """
    a = 0.5 / ratio - epsilon * ratio
    b = -0.5 / ratio - epsilon * ratio
    if a >= 0.0:
        delta = special.ndtr(a) - math.exp(epsilon + special.log_ndtr(b))
        return math.log(delta) if delta > 0.0 else -math.inf
    gap = special.erfcx(-a * _SQRT_HALF) - special.erfcx(-b * _SQRT_HALF)
    if gap <= 0.0:
        return -math.inf
    return -0.5 * a * a + math.log(0.5 * gap)


def analytic_gaussian_delta(sigma: float, sensitivity: float, epsilon: float) -> float:
    """The exact δ at which N(0, σ²) noise on a Δ₂-sensitive query is (ε, δ)-DP (B&W Thm 8)."""
    sigma = check_positive("sigma", sigma)
    sensitivity = check_positive("sensitivity", sensitivity)
    epsilon = check_positive("epsilon", epsilon)
    return math.exp(_log_gaussian_delta(sigma / sensitivity, epsilon))


def _bracket_ratio(epsilon: float, log_delta: float) -> tuple[float, float]:
    """Two values of σ/Δ with δ above and below the target (δ decreases as σ grows)."""
    start = math.sqrt(2.0 * max(-log_delta, 1.0)) / epsilon
    low, high = start, start
    for _ in range(2100):
        if _log_gaussian_delta(low, epsilon) > log_delta:
            break
        low /= 2.0
    for _ in range(2100):
        if _log_gaussian_delta(high, epsilon) <= log_delta:
            break
        high *= 2.0
    if not _log_gaussian_delta(low, epsilon) > log_delta >= _log_gaussian_delta(high, epsilon):
        raise ValueError(f"cannot calibrate the Gaussian mechanism for epsilon={epsilon!r}")
    return low, high


def analytic_gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """The smallest σ for which the Gaussian mechanism is (ε, δ)-DP, for any ε > 0.

    Balle & Wang 2018 ("Improving the Gaussian mechanism for differential privacy", ICML, Thm 8):
    the mechanism is (ε, δ)-DP iff Φ(Δ/(2σ) − εσ/Δ) − e^ε·Φ(−Δ/(2σ) − εσ/Δ) ≤ δ. The left side
    decreases in σ, so the boundary is found by root finding on log σ; the result gets a 1e-9
    relative headroom and is then checked and nudged upwards until the inequality holds, so it
    never undershoots.
    """
    sensitivity = check_positive("sensitivity", sensitivity)
    epsilon = check_positive("epsilon", epsilon)
    delta = check_delta(delta)
    log_delta = math.log(delta)
    low, high = _bracket_ratio(epsilon, log_delta)
    log_ratio = optimize.brentq(
        lambda log_r: _log_gaussian_delta(math.exp(log_r), epsilon) - log_delta,
        math.log(low),
        math.log(high),
        xtol=1e-15,
        rtol=4 * np.finfo(float).eps,
    )
    ratio = math.exp(log_ratio)
    sigma = ratio * sensitivity * (1.0 + _SIGMA_SAFETY)
    while math.exp(_log_gaussian_delta(sigma / sensitivity, epsilon)) > delta:
        sigma = math.nextafter(sigma, math.inf) * (1.0 + 1e-13)
    return sigma


GAUSSIAN_CALIBRATIONS: dict[str, Callable[[float, float, float], float]] = {
    "analytic": analytic_gaussian_sigma,
    "classical": classical_gaussian_sigma,
}
"""How ``gaussian_mechanism`` turns (Δ₂, ε, δ) into σ, by name; add entries to extend."""


def _gaussian_calibration(name: str) -> Callable[[float, float, float], float]:
    """Look up a calibration by name, with an error that lists the choices."""
    key = str(name).strip().lower()
    if key not in GAUSSIAN_CALIBRATIONS:
        choices = ", ".join(sorted(GAUSSIAN_CALIBRATIONS))
        raise ValueError(f"calibration must be one of {choices}; got {name!r}")
    return GAUSSIAN_CALIBRATIONS[key]


def gaussian_mechanism(
    value: float | np.ndarray | Sequence[float],
    sensitivity: float,
    epsilon: float,
    delta: float,
    rng: np.random.Generator | None = None,
    calibration: str = "analytic",
) -> MechanismResult[float | np.ndarray]:
    """Release ``value`` with N(0, σ²) noise per coordinate, σ calibrated to (ε, δ) for Δ₂.

    ``calibration`` is "analytic" (tight, any ε; default) or "classical" (ε < 1 only). The event
    is ``GaussianEvent(noise_multiplier=σ/Δ₂)``, which an accountant can compose far more tightly
    than by adding the (ε, δ) of each release.
    """
    array = _as_finite_array("value", value)
    sensitivity = check_positive("sensitivity", sensitivity)
    sigma = _gaussian_calibration(calibration)(sensitivity, epsilon, delta)
    noisy = array + _generator(rng).normal(0.0, sigma, size=array.shape)
    return MechanismResult(
        _like_input(value, noisy), GaussianEvent(noise_multiplier=sigma / sensitivity)
    )


# -- exponential mechanism ---------------------------------------------------------------------


def _selection_probabilities(
    scores: np.ndarray, epsilon: float, sensitivity: float, monotonic: bool
) -> np.ndarray:
    """P(i) ∝ exp(c·ε·uᵢ/Δu) with c = ½ (or 1 if monotone), normalised by log-sum-exp."""
    factor = 1.0 if monotonic else 0.5
    logits = factor * epsilon * scores / sensitivity
    weights = np.exp(logits - logits.max())  # log-sum-exp shift: the largest weight is 1
    return weights / weights.sum()


def exponential_mechanism(
    candidates: Sequence[T],
    scores: Sequence[float] | np.ndarray,
    epsilon: float,
    sensitivity: float,
    rng: np.random.Generator | None = None,
    monotonic: bool = False,
) -> MechanismResult[T]:
    """Pick one public candidate, favouring high scores: ε-DP (McSherry & Talwar 2007).

    P(candidate i) ∝ exp(ε·uᵢ/(2Δu)) where Δu bounds how much one record can change any score
    (Dwork & Roth 2014, Thm 3.10). If adding a record can only move all scores in the same
    direction (``monotonic=True``), exp(ε·uᵢ/Δu) is also ε-DP (Dwork & Roth §3.4). The candidate
    set must not depend on the private data; the scores may.
    """
    pool = list(candidates)
    if not pool:
        raise ValueError("candidates must not be empty: the mechanism has nothing to select")
    utility = _as_finite_array("scores", scores)
    if utility.ndim != 1 or utility.size != len(pool):
        raise ValueError(
            f"scores must be a flat sequence with one score per candidate ({len(pool)}), "
            f"got shape {utility.shape}"
        )
    epsilon = check_positive("epsilon", epsilon)
    sensitivity = check_positive("sensitivity", sensitivity)
    probabilities = _selection_probabilities(utility, epsilon, sensitivity, bool(monotonic))
    index = int(_generator(rng).choice(len(pool), p=probabilities))
    return MechanismResult(pool[index], PureDpEvent(epsilon))


# -- randomised response -----------------------------------------------------------------------


def randomized_response_keep_probability(num_classes: int, epsilon: float) -> float:
    """e^ε/(e^ε + k − 1): the chance k-ary randomised response reports the true label."""
    num_classes = check_count("num_classes", num_classes, minimum=2)
    epsilon = check_positive("epsilon", epsilon)
    return 1.0 / (1.0 + (num_classes - 1) * math.exp(-epsilon))


def _as_labels(labels: Any, num_classes: int) -> np.ndarray:
    """Labels as an integer array, each checked to lie in [0, num_classes)."""
    array = np.asarray(labels)
    if array.dtype.kind not in "iu":
        numeric = _as_finite_array("labels", array)
        if not np.all(numeric == np.round(numeric)):
            raise ValueError("labels must be whole numbers (class indices)")
        array = numeric.astype(np.int64)
    if array.size and (array.min() < 0 or array.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, {num_classes}) for num_classes={num_classes}, "
            f"got values from {array.min()} to {array.max()}"
        )
    return array.astype(np.int64, copy=False)


def randomized_response(
    labels: int | Sequence[int] | np.ndarray,
    num_classes: int,
    epsilon: float,
    rng: np.random.Generator | None = None,
) -> MechanismResult[int | np.ndarray]:
    """k-ary randomised response on labels: each label is ε-label-DP (Warner 1965).

    Each label is kept with probability e^ε/(e^ε + k − 1) and otherwise replaced by one of the
    k − 1 *other* labels uniformly at random, so any two inputs produce any output with odds at
    most e^ε (Ghazi et al. 2021, "Deep learning with label differential privacy", RR). Protects
    labels only (guide §3.2, label-only DP), under replacing one record's label.
    """
    num_classes = check_count("num_classes", num_classes, minimum=2)
    epsilon = check_positive("epsilon", epsilon)
    true = _as_labels(labels, num_classes)
    keep_probability = randomized_response_keep_probability(num_classes, epsilon)
    generator = _generator(rng)
    keep = generator.random(true.shape) < keep_probability
    shift = generator.integers(1, num_classes, size=true.shape)
    reported = np.where(keep, true, (true + shift) % num_classes)
    output: int | np.ndarray = int(reported) if np.ndim(labels) == 0 else reported
    return MechanismResult(output, PureDpEvent(epsilon))
