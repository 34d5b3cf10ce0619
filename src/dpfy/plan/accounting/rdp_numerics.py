"""Log-space numerics the RDP bounds share, so tiny and huge moments neither cancel nor overflow."""

from __future__ import annotations

import numpy as np
from scipy import special


# -- numerics shared by several rules ------------------------------------------------------------
def _log_expm1(x: np.ndarray | float) -> np.ndarray:
    """log(eˣ − 1) for x ≥ 0 without overflow for large x or cancellation for small x."""
    x = np.asarray(x, dtype=float)
    with np.errstate(divide="ignore"):
        return x + np.log(-np.expm1(-x))


def _log_abs_binom(alpha: float, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log|C(α, k)| and its sign for real α > 0 and whole k ≥ 0 (the generalised binomial)."""
    log_abs = special.gammaln(alpha + 1) - special.gammaln(k + 1) - special.gammaln(alpha - k + 1)
    return log_abs, special.gammasgn(alpha - k + 1)


def _half_square(scale: float) -> float:
    """scale²/2, or +∞ where that overflows a float: noise so small gives no finite guarantee."""
    with np.errstate(over="ignore"):
        return float(np.float64(scale) ** 2 / 2.0)
