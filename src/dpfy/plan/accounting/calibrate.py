"""Calibration: the σ, the number of steps, or the (B, σ) pairs that meet a target (ε, δ).

Every function here returns a setting whose *accounted* ε is at most the target: root finding
works on a smooth surrogate (log ε against log σ or log steps) and the answer is then checked
with the accountant itself and moved to the safe side if needed. The guide's order of choices
(§5.4.1): fix batch size and epochs first, then pick σ for the target ε.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from scipy.optimize import brentq

from dpfy._validate import check_count, check_delta, check_positive, check_sampling_rate
from dpfy.plan.accounting.accountant import make_accountant
from dpfy.plan.accounting.events import DpEvent, NeighbouringRelation, dpsgd_event

#: Noise multipliers above this are treated as "cannot be reached" (the model would learn nothing).
MAX_NOISE_MULTIPLIER = 1e4
MIN_NOISE_MULTIPLIER = 1e-3
#: Largest target ε calibrated: far above any meaningful guarantee, and below where e^ε and the
#: accountants' loss grids overflow (a target of 1e308 used to end in "σ … got nan").
MAX_TARGET_EPSILON = 1e4


class CalibrationError(ValueError):
    """The target cannot be met with the given settings (the message says what to change)."""


def _epsilon_function(
    accountant: str, delta: float, relation: NeighbouringRelation | str, *, search: bool = False
) -> Callable[[DpEvent], float]:
    """ε(δ) of an event under a fresh accountant of the given kind (its fast variant if search)."""
    prototype = make_accountant(accountant, relation)

    def epsilon(event: DpEvent) -> float:
        fresh = prototype.for_search() if search else make_accountant(accountant, relation)
        return fresh.compose(event).epsilon(delta)

    return epsilon


def _log_gap(
    epsilon: Callable[[DpEvent], float], event_for: Callable[[float], DpEvent], target: float
) -> Callable[[float], float]:
    """log ε(σ) − log target as a function of log σ: smooth, nearly linear, and memoised."""

    @functools.cache
    def gap(log_sigma: float) -> float:
        value = epsilon(event_for(math.exp(log_sigma)))
        # An unbounded ε (losses beyond what e^ε can hold) is "far above": finite, so the root
        # search brackets the jump to it instead of returning NaN.
        return math.log(min(max(value, 1e-300), 1e300)) - math.log(target)

    return gap


def _bracket(gap: Callable[[float], float], lo: float, hi: float) -> tuple[float, float]:
    """Widen [lo, hi] (in log σ) until gap(lo) > 0 ≥ gap(hi), i.e. the root lies inside."""
    step = hi - lo
    while gap(hi) > 0:
        lo, hi, step = hi, hi + step, step * 2
        if hi > math.log(MAX_NOISE_MULTIPLIER):
            raise CalibrationError(f"no noise multiplier up to {MAX_NOISE_MULTIPLIER:g} suffices")
    while gap(lo) <= 0:
        hi, lo, step = lo, lo - step, step * 2
        if lo < math.log(MIN_NOISE_MULTIPLIER):
            break
    return lo, hi


def smallest_noise_multiplier(
    event_for: Callable[[float], DpEvent],
    target_epsilon: float,
    delta: float,
    *,
    accountant: str = "pld",
    relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE,
    rtol: float = 1e-3,
) -> float:
    """The smallest σ (within ``rtol``) such that ``event_for(σ)`` meets (ε, δ); never above it.

    ``event_for`` maps a noise multiplier to the whole run's event, so heterogeneous runs
    (several phases, tuning trials) are calibrated the same way as plain DP-SGD. The root is
    found with the accountant's fast variant, then one Newton step with the full accountant
    predicts it, and a bracket of width ``rtol`` around the prediction confirms it.
    """
    target_epsilon = check_positive("target_epsilon", target_epsilon)
    if target_epsilon > MAX_TARGET_EPSILON:
        raise CalibrationError(
            f"target_epsilon {target_epsilon:g} is beyond any guarantee the accountant resolves "
            f"(a privacy loss of e^{target_epsilon:g}); pass a target of at most "
            f"{MAX_TARGET_EPSILON:g} (an ε above 10 already promises little)"
        )
    delta = check_delta(delta)
    coarse = _log_gap(
        _epsilon_function(accountant, delta, relation, search=True), event_for, target_epsilon
    )
    fine = _log_gap(_epsilon_function(accountant, delta, relation), event_for, target_epsilon)
    width = math.log1p(rtol)
    try:
        lo, hi = _bracket(coarse, math.log(0.5), math.log(2.0))
        if lo < math.log(MIN_NOISE_MULTIPLIER):
            return _confirm(fine, hi, width)
        guess = brentq(coarse, lo, hi, xtol=width / 4)
        slope = (coarse(hi) - coarse(lo)) / (hi - lo)
        predicted = guess - fine(guess) / slope
        lo, hi = _bracket(fine, predicted - width / 2, predicted + width / 2)
    except CalibrationError:
        raise CalibrationError(
            f"no noise multiplier up to {MAX_NOISE_MULTIPLIER:g} reaches ε = {target_epsilon:g} "
            f"at δ = {delta:g}; raise the target ε or δ, or use fewer steps / a smaller batch"
        ) from None
    if hi - lo > 1.01 * width and lo >= math.log(MIN_NOISE_MULTIPLIER):  # prediction was off
        hi = brentq(fine, lo, hi, xtol=width / 4) + width / 4
    return _confirm(fine, hi, width)


def _confirm(gap: Callable[[float], float], log_sigma: float, width: float) -> float:
    """Return exp(log_sigma), stepping up until the full accountant confirms ε ≤ target."""
    while gap(log_sigma) > 0:
        log_sigma += width / 4
    return math.exp(log_sigma)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    *,
    accountant: str = "pld",
    relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE,
    rtol: float = 1e-3,
) -> float:
    """The smallest σ for ``steps`` Poisson-sampled DP-SGD steps at rate q to meet (ε, δ)."""
    sampling_rate = check_sampling_rate(sampling_rate)
    steps = check_count("steps", steps, minimum=1)
    return smallest_noise_multiplier(
        lambda sigma: dpsgd_event(sampling_rate, sigma, steps),
        target_epsilon,
        delta,
        accountant=accountant,
        relation=relation,
        rtol=rtol,
    )


def largest_fitting_count(
    fits: Callable[[int], bool],
    *,
    guide: Callable[[int], bool] | None = None,
    cap: int = 1 << 30,
) -> int:
    """max{m ≤ cap : fits(m)} for a predicate that stays true below any m where it holds; 0 if none.

    ``guide`` is a cheaper approximation of ``fits`` (the accountant's search variant): it finds
    the neighbourhood by doubling and bisection, then ``fits`` alone decides the answer with a
    few calls around it. Only ``fits`` is trusted, so the result is exact for ``fits``.
    """
    if guide is None:
        return _doubling_search(fits, 0, cap)
    guess = _doubling_search(guide, 0, cap)
    step = max(1, guess // 256)
    if guess >= 1 and fits(guess):
        low, high = guess, guess + step
        while high <= cap and fits(high):
            low, high, step = high, high + 2 * step, 2 * step
        if high > cap:
            return low if low == cap or not fits(cap) else cap
    else:
        high, low = max(guess, 1), max(guess, 1) - step
        while low >= 1 and not fits(low):
            high, low, step = low, low - 2 * step, 2 * step
        low = max(low, 0)
    return _bisect_counts(fits, low, high)


def _doubling_search(fits: Callable[[int], bool], low: int, cap: int) -> int:
    """Largest m ≤ cap with fits(m), knowing fits(low) (m = 0 always "fits")."""
    if not fits(max(low, 1)):
        return low
    low, high = max(low, 1), max(2 * low, 2)
    while high <= cap and fits(high):
        low, high = high, high * 2
    if high > cap:
        return cap if fits(cap) else _bisect_counts(fits, low, cap)
    return _bisect_counts(fits, low, high)


def _bisect_counts(fits: Callable[[int], bool], low: int, high: int) -> int:
    """Largest m in [low, high) with fits(m), given fits(low) (or low = 0) and not fits(high)."""
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def max_steps(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    noise_multiplier: float,
    *,
    accountant: str = "pld",
    relation: NeighbouringRelation | str = NeighbouringRelation.ADD_OR_REMOVE,
    limit: int = 10**9,
) -> int:
    """The largest number of DP-SGD steps whose ε stays at or below the target (0 if none)."""
    target_epsilon = check_positive("target_epsilon", target_epsilon)
    delta = check_delta(delta)
    sampling_rate = check_sampling_rate(sampling_rate)
    noise_multiplier = check_positive("noise_multiplier", noise_multiplier)

    def predicate(search: bool) -> Callable[[int], bool]:
        epsilon = _epsilon_function(accountant, delta, relation, search=search)
        return lambda steps: (
            epsilon(dpsgd_event(sampling_rate, noise_multiplier, steps)) <= target_epsilon
        )

    return largest_fitting_count(predicate(False), guide=predicate(True), cap=limit)


@dataclass(frozen=True)
class FixedRatioSetting:
    """One (B, σ) choice at a fixed σ·C/B, with its accounted ε (guide §5.4.1 step 4)."""

    batch_size: int
    noise_multiplier: float
    sampling_rate: float
    steps: int
    epsilon: float
    meets_target: bool
    examples_processed: int

    def as_dict(self) -> dict[str, float | int | bool]:
        """A plain dict for JSON output."""
        return asdict(self)


def settings_at_fixed_ratio(
    noise_to_batch_ratio: float,
    clip_norm: float,
    dataset_size: int,
    epochs: float,
    target_epsilon: float,
    delta: float,
    batch_sizes: Sequence[int] | None = None,
    *,
    accountant: str = "pld",
) -> list[FixedRatioSetting]:
    """For each batch size B, the σ that keeps σ·C/B at the given ratio, and whether ε is met.

    The guide's step 4 (§5.4.1): accuracy depends mainly on σ·C/B for large B — an assumption it
    attributes to earlier work and asks users to check — so larger batches buy privacy with
    compute: σ grows linearly with B while ε falls.
    """
    noise_to_batch_ratio = check_positive("noise_to_batch_ratio", noise_to_batch_ratio)
    clip_norm = check_positive("clip_norm", clip_norm)
    dataset_size = check_count("dataset_size", dataset_size, minimum=1)
    epochs = check_positive("epochs", epochs)
    target_epsilon = check_positive("target_epsilon", target_epsilon)
    delta = check_delta(delta)
    if batch_sizes is None:
        batch_sizes = [2**k for k in range(4, 30) if 2**k <= dataset_size]
    epsilon = _epsilon_function(accountant, delta, NeighbouringRelation.ADD_OR_REMOVE)
    settings = []
    for batch_size in batch_sizes:
        batch_size = check_count("batch_size", batch_size, minimum=1)
        if batch_size > dataset_size:
            raise ValueError(
                f"batch_size must be at most dataset_size ({dataset_size}), got {batch_size}"
            )
        sigma = noise_to_batch_ratio * batch_size / clip_norm
        rate = batch_size / dataset_size
        steps = max(1, math.ceil(epochs * dataset_size / batch_size))
        value = epsilon(dpsgd_event(rate, sigma, steps))
        settings.append(
            FixedRatioSetting(
                batch_size=batch_size,
                noise_multiplier=sigma,
                sampling_rate=rate,
                steps=steps,
                epsilon=value,
                meets_target=value <= target_epsilon,
                examples_processed=steps * batch_size,
            )
        )
    return settings
