"""Input checks that turn bad parameters into one clear ValueError naming the fix."""

from __future__ import annotations

import math
import operator


def _not_a_number(name: str, value: object) -> None:
    """Strings and bools are refused where a number is meant: ``"3"`` or ``True`` is a caller's
    mistake (a value read from text, a flag passed in the wrong place), never coerced."""
    if isinstance(value, (str, bytes, bool)):
        raise ValueError(
            f"{name} must be a number, got {value!r} ({type(value).__name__}); pass a number"
        )


def check_finite(name: str, value: float) -> float:
    """Reject NaN and ±inf early, so no accountant ever reasons about them."""
    _not_a_number(name, value)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def check_range(
    name: str,
    value: float,
    low: float,
    high: float,
    *,
    low_open: bool = True,
    high_open: bool = True,
) -> float:
    """Require `value` in the interval from `low` to `high` with the stated open/closed ends."""
    value = check_finite(name, value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        interval = ("(" if low_open else "[") + f"{low:g}, {high:g}" + (")" if high_open else "]")
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return value


def check_positive(name: str, value: float) -> float:
    """Require a finite, strictly positive number (noise scales, privacy parameters)."""
    return check_range(name, value, 0.0, math.inf, low_open=True, high_open=True)


def check_count(name: str, value: int, *, minimum: int = 0) -> int:
    """Require a whole count such as a number of steps (bools, strings and fractional floats
    refused)."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r} (a string)")
    try:
        whole = not isinstance(value, bool) and float(value).is_integer()
    except OverflowError:  # an int too large for a float is still whole
        whole = isinstance(value, int)
    except (TypeError, ValueError):
        whole = False
    if not whole:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return value


def check_delta(value: float, name: str = "delta") -> float:
    """δ must lie strictly inside (0, 1); a δ of 1 or more promises nothing."""
    return check_range(name, value, 0.0, 1.0)


def check_sampling_rate(value: float, name: str = "sampling_rate") -> float:
    """A Poisson sampling rate q lies in (0, 1]."""
    return check_range(name, value, 0.0, 1.0, high_open=False)


#: Largest accepted seed: derived streams (seed + 1, seed + 2, one per tuning trial …) must still
#: fit the 64-bit seeds torch and numpy take, so half that range is left as headroom.
MAX_SEED = 2**63 - 1

#: Largest accepted learning rate: far above any step size that trains (float32 weights overflow
#: long before), and it keeps ``lr`` representable where torch converts it to float32.
MAX_LEARNING_RATE = 1e6


def check_seed(value: int | None, name: str = "seed") -> int | None:
    """A seed must be a whole number in [0, MAX_SEED] (None: draw from OS entropy)."""
    if value is None:
        return None
    try:
        seed = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        seed = None
    if seed is None or not 0 <= seed <= MAX_SEED:
        raise ValueError(
            f"{name} must be a whole number from 0 to 2**63 - 1 = {MAX_SEED}, got {value!r}; "
            "pass a seed in that range, or none for OS entropy"
        )
    return seed


def check_positive_at_most(name: str, value: float, limit: float, why: str) -> float:
    """A positive number no larger than ``limit``; ``why`` says what a larger one would do."""
    value = check_positive(name, value)
    if value > limit:
        raise ValueError(f"{name} must be at most {limit:g}, got {value:g}: {why}; lower it")
    return value


def check_learning_rate(name: str, value: float) -> float:
    """A learning rate lies in (0, MAX_LEARNING_RATE]; larger ones only overflow the weights."""
    return check_positive_at_most(
        name, value, MAX_LEARNING_RATE, "a step that large overflows the weights"
    )
