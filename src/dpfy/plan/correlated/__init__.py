"""Correlated noise for private training: matrix-factorisation mechanisms (no torch).

DP-SGD adds independent noise each step. A matrix-factorisation mechanism writes the prefix sums
A = B C and adds σ · (C⁻¹ z)_t at step t, noise correlated so that it cancels in the running sum
(Choquette-Choo et al. 2022, 2023; McKenna 2024; Dvijotham, McMahan et al. 2024). Here: the
Toeplitz algebra, BandMF and BLT strategies with their optimisers and reference noise streams,
participation schemas, sensitivity, error, and the privacy event a run produces. See
docs/correlated-noise.md. Names load on first use (PEP 562).
"""

from __future__ import annotations

from dpfy._lazy import lazy_exports

_EXPORTS = {
    "BandedNoise": "dpfy.plan.correlated.banded",
    "BandedStrategy": "dpfy.plan.correlated.banded",
    "optimise_banded": "dpfy.plan.correlated.banded",
    "square_root_coefficients": "dpfy.plan.correlated.banded",
    "Blt": "dpfy.plan.correlated.blt",
    "BltNoise": "dpfy.plan.correlated.blt",
    "optimise_blt": "dpfy.plan.correlated.blt",
    "CyclicPoisson": "dpfy.plan.correlated.participation",
    "MinSeparation": "dpfy.plan.correlated.participation",
    "Sensitivity": "dpfy.plan.correlated.sensitivity",
    "brute_force_sensitivity_squared": "dpfy.plan.correlated.sensitivity",
    "matrix_sensitivity_squared": "dpfy.plan.correlated.sensitivity",
    "toeplitz_sensitivity_squared": "dpfy.plan.correlated.sensitivity",
    "inverse_coefficients": "dpfy.plan.correlated.toeplitz",
    "prefix_sum_error": "dpfy.plan.correlated.toeplitz",
    "toeplitz_matrix": "dpfy.plan.correlated.toeplitz",
    "rmse": "dpfy.plan.correlated.error",
    "rmse_ratio": "dpfy.plan.correlated.error",
    "total_squared_error": "dpfy.plan.correlated.error",
    "CorrelatedAccounting": "dpfy.plan.correlated.accounting",
    "calibrate_correlated_noise": "dpfy.plan.correlated.accounting",
    "correlated_accounting": "dpfy.plan.correlated.accounting",
    "correlated_event": "dpfy.plan.correlated.accounting",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
