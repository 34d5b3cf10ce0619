"""What an example-level guarantee says about a person who contributes many examples.

When one person contributes many examples, example-level ε understates their exposure (guide
§2.1, §4.4); group privacy bounds it, loosely — which is why user-level runs
(``make_private(..., user_ids=...)``) account users directly.
"""

from __future__ import annotations

import math

from dpfy._validate import check_count, check_delta, check_positive

__all__ = ["group_privacy"]


def group_privacy(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """What an example-level (ε, δ) guarantee says about a user holding ``group_size`` examples.

    Group privacy (Dwork & Roth 2014, "The algorithmic foundations of DP", thm. 2.2; guide §2.1):
    chaining the guarantee through the k datasets between "with" and "without" the user's k
    examples gives (kε, δ·Σ_{i<k} e^{iε}). The δ term grows like e^{(k-1)ε}, so for all but the
    smallest groups the example-level guarantee says nothing useful about a user — which is why
    a user-level run accounts users directly. A returned δ of 1.0 means no guarantee at all.
    """
    epsilon = check_positive("epsilon", epsilon)
    delta = check_delta(delta)
    k = check_count("group_size", group_size, minimum=1)
    # Σ_{i<k} e^{iε} = (e^{kε} - 1) / (e^ε - 1), computed without overflow for large kε
    log_sum = k * epsilon + math.log(-math.expm1(-k * epsilon)) - math.log(math.expm1(epsilon))
    return k * epsilon, min(1.0, math.exp(min(log_sum + math.log(delta), 0.0)))
