"""How good a strategy is: the prefix-sum error at a fixed privacy level, and its RMSE ratio.

The mechanism x ↦ C x + σ z, decoded as A C⁻¹ (C x + σ z) = A x + σ A C⁻¹ z, costs privacy
through σ/Δ(C) only, so at equal privacy its total squared error on all n prefix sums is
‖A C⁻¹‖_F² · Δ(C)² per unit σ² (Choquette-Choo et al. 2022, 2023; Denisov et al. 2022). DP-SGD
is C = I: n(n+1)/2 · Δ(I)².
"""

from __future__ import annotations

import math

from dpfy._validate import check_count
from dpfy.plan.correlated.banded import BandedStrategy
from dpfy.plan.correlated.participation import Participation
from dpfy.plan.correlated.sensitivity import accounted_sensitivity_and_gradient
from dpfy.plan.correlated.toeplitz import ToeplitzStrategy, prefix_sum_error


def total_squared_error(strategy: ToeplitzStrategy, n: int, participation: Participation) -> float:
    """‖A C⁻¹‖_F² · Δ(C)²: the summed prefix-sum variance over n steps at noise multiplier 1.

    Δ is the sensitivity the accounting charges (largest column norm where the cyclic-Poisson
    amplification theorem applies, else the min-separation sensitivity — an upper bound where not
    exact, so this error is never flattered).
    """
    n = check_count("n", n, minimum=1)
    sensitivity, _ = accounted_sensitivity_and_gradient(
        strategy.toeplitz(n), n, participation, strategy.bands
    )
    return prefix_sum_error(strategy.inverse_toeplitz(n), n) * sensitivity.squared


def rmse(strategy: ToeplitzStrategy, n: int, participation: Participation) -> float:
    """Root mean squared error per prefix sum: √(total squared error / n)."""
    return math.sqrt(total_squared_error(strategy, n, participation) / n)


def rmse_ratio(strategy: ToeplitzStrategy, n: int, participation: Participation) -> float:
    """RMSE relative to DP-SGD (C = I) under the same schema, at the same σ/Δ: below 1 is better.

    Equal σ/Δ is equal privacy when both are accounted alike: always under ``MinSeparation``;
    under ``CyclicPoisson`` only if both are amplified (bands ≤ groups) — an unbanded strategy
    (BLT) is charged without amplification there, and then the ratio flatters it.
    """
    baseline = total_squared_error(BandedStrategy.identity(), n, participation)
    return math.sqrt(total_squared_error(strategy, n, participation) / baseline)
