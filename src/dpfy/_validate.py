"""Input checks that turn bad parameters into one clear ValueError naming the fix."""

from __future__ import annotations

import math


def check_finite(name: str, value: float) -> float:
    """Reject NaN and ±inf early, so no accountant ever reasons about them."""
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
    """Require a whole count such as a number of steps (bools and fractional floats refused)."""
    if isinstance(value, bool) or not float(value).is_integer():
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
