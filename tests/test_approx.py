"""Approximations: classical composition bounds and the fitted scaling law, against live oracles."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest

from dpfy.plan.accounting import approx
from dpfy.plan.accounting.approx import (
    SCALING_LAW_FITS,
    CompositionApproximation,
    ScalingLawEstimate,
    advanced_composition,
    basic_composition,
    scaling_law_epsilon,
    scaling_law_noise_multiplier,
)

dp_accounting = pytest.importorskip("dp_accounting")


def _event(q: float, sigma: float, steps: int):
    step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    return dp_accounting.SelfComposedDpEvent(step, int(steps))


def _rdp_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    accountant = dp_accounting.rdp.RdpAccountant()
    return accountant.compose(_event(q, sigma, steps)).get_epsilon(delta)


def _pld_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """PLD ε with the discretisation refined until it moves < 0.2% (as the fitting script does)."""
    previous, interval = None, 1e-4
    while True:
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
        epsilon = accountant.compose(_event(q, sigma, steps)).get_epsilon(delta)
        if previous is not None and abs(previous - epsilon) < 2e-3 * epsilon:
            return epsilon
        previous, interval = epsilon, interval / 3


ORACLES = {"pld": _pld_epsilon, "rdp": _rdp_epsilon}


def _random_points(fit, seed: int, count: int, max_steps: int | None = None):
    """Log-uniform points of the fitted region and δ range whose exact ε is in the fitted range."""
    rng = np.random.default_rng(seed)
    oracle = ORACLES[fit.accountant]
    k_lo, k_hi = fit.steps_range
    ranges = (
        fit.sampling_rate_range,
        fit.noise_multiplier_range,
        (k_lo, min(k_hi, max_steps or k_hi)),
        (min(fit.deltas), max(fit.deltas)),
    )
    found = []
    for _ in range(400):
        q, sigma, steps, delta = (
            math.exp(rng.uniform(math.log(lo), math.log(hi))) for lo, hi in ranges
        )
        steps = round(steps)
        if q * steps < fit.min_epochs:
            continue
        upper = _rdp_epsilon(q, sigma, steps, delta)  # cheap screen: RDP bounds PLD from above
        if upper < fit.epsilon_range[0] or upper > 5 * fit.epsilon_range[1]:
            continue
        exact = oracle(q, sigma, steps, delta)
        if fit.epsilon_range[0] <= exact <= fit.epsilon_range[1]:
            found.append((q, sigma, steps, delta, exact))
            if len(found) == count:
                return found
    raise AssertionError("could not draw enough in-range points")


def _check_points(accountant: str, points) -> None:
    for q, sigma, steps, delta, exact in points:
        estimate = scaling_law_epsilon(q, steps, sigma, delta, accountant=accountant)
        error = abs(estimate.epsilon - exact) / exact
        assert error <= estimate.max_relative_error, (q, sigma, steps, delta, exact, estimate)
        assert estimate.in_fit_range, estimate.notes
        low, high = estimate.bracket()
        assert low <= exact <= high


def test_scaling_law_within_stated_error_of_live_rdp():
    fit = SCALING_LAW_FITS["rdp"]
    _check_points("rdp", _random_points(fit, seed=1, count=12))


def test_scaling_law_within_stated_error_of_live_pld():
    fit = SCALING_LAW_FITS["pld"]  # up to 10⁴ steps here: long PLD compositions take seconds
    _check_points("pld", _random_points(fit, seed=2, count=4, max_steps=10_000))


@pytest.mark.slow
def test_scaling_law_within_stated_error_of_live_pld_full_range():
    fit = SCALING_LAW_FITS["pld"]
    _check_points("pld", _random_points(fit, seed=3, count=20))


def test_guide_worked_example_is_flagged_outside_the_fit():
    # Guide App. C: N = 10⁶, B = 5000, σ = 1, one epoch, δ = 10⁻⁶ gives ε ≈ 0.59 (PLD). σ = 1 is
    # below the fitted region, where the law is known to be poor: the estimate must say so.
    estimate = scaling_law_epsilon(5000 / 1e6, 200, 1.0, 1e-6)
    assert not estimate.in_fit_range
    assert any(note.startswith("noise_multiplier=1 outside") for note in estimate.notes)
    assert "Outside the fit" in str(estimate)


def test_stated_error_is_not_vacuous():
    for fit in SCALING_LAW_FITS.values():
        assert 0 < fit.median_relative_error < fit.max_relative_error < 0.5


@pytest.mark.parametrize("accountant", sorted(SCALING_LAW_FITS))
def test_inverse_is_consistent_with_forward(accountant):
    rng = np.random.default_rng(4)
    for _ in range(50):
        q = math.exp(rng.uniform(math.log(1e-4), math.log(0.05)))
        steps = int(math.exp(rng.uniform(math.log(100), math.log(1e5))))
        delta = math.exp(rng.uniform(math.log(1e-7), math.log(1e-5)))
        target = math.exp(rng.uniform(math.log(0.1), math.log(20)))
        inverse = scaling_law_noise_multiplier(q, steps, target, delta, accountant=accountant)
        forward = scaling_law_epsilon(q, steps, inverse.noise_multiplier, delta, accountant)
        assert forward.epsilon == pytest.approx(target, rel=1e-10)
        assert inverse.solved_for == "noise_multiplier" and forward.solved_for == "epsilon"


def test_noise_bracket_straddles_the_exact_rdp_noise():
    q, steps, target, delta = 0.02, 5000, 4.0, 1e-6
    estimate = scaling_law_noise_multiplier(q, steps, target, delta, accountant="rdp")
    assert estimate.in_fit_range, estimate.notes
    low, high = estimate.bracket()
    assert low < estimate.noise_multiplier < high
    assert _rdp_epsilon(q, low, steps, delta) >= target >= _rdp_epsilon(q, high, steps, delta)


def test_more_noise_less_epsilon_and_smaller_delta_more_epsilon():
    eps = [scaling_law_epsilon(0.01, 1000, s, 1e-6).epsilon for s in (0.6, 1.0, 2.0, 4.0)]
    assert eps == sorted(eps, reverse=True)
    eps = [scaling_law_epsilon(0.01, 1000, 1.0, d).epsilon for d in (1e-5, 1e-6, 1e-7, 1e-8)]
    assert eps == sorted(eps)


def test_estimates_say_they_are_approximations():
    estimate = scaling_law_epsilon(0.01, 1000, 1.0, 1e-6)
    assert isinstance(estimate, ScalingLawEstimate)
    assert estimate.is_approximation
    assert str(estimate).startswith("approximation")
    assert "approximation" in estimate.label and "PLD" in estimate.label
    inverse = scaling_law_noise_multiplier(0.01, 1000, 2.0, 1e-6, accountant="rdp")
    assert str(inverse).startswith("approximation") and "RDP" in str(inverse)


def test_outside_the_fit_is_noted():
    inside = scaling_law_epsilon(0.01, 3000, 2.0, 1e-6)
    assert inside.in_fit_range and "Outside" not in str(inside), inside.notes
    outside = scaling_law_epsilon(0.2, 1000, 2.0, 1e-9)
    assert not outside.in_fit_range
    text = str(outside)
    assert "sampling_rate=0.2 outside" in text
    assert "extrapolated linearly in log δ" in text
    few_epochs = scaling_law_epsilon(1e-3, 500, 2.0, 1e-6)
    assert any("expected epochs" in note for note in few_epochs.notes)


def test_extrapolated_coefficients_are_clipped_at_zero():
    fit = SCALING_LAW_FITS["rdp"]  # B falls to 0 at δ = 1e-7 and would turn negative below
    a, b = fit.coefficients(1e-10)
    assert a > max(fit.a) and b == 0.0
    estimate = scaling_law_epsilon(0.01, 3000, 2.0, 1e-10, accountant="rdp")
    assert estimate.b == 0.0 and estimate.epsilon > 0
    synthetic = dataclasses.replace(fit, a=(0.1, 0.5, 1.0), b=(0.1, 0.2, 0.3))
    assert synthetic.coefficients(1e-3) == (pytest.approx(0.0), pytest.approx(0.0))


def test_constants_that_vanish_are_refused():
    fit = dataclasses.replace(SCALING_LAW_FITS["pld"], a=(0.1, 0.5, 1.0))
    with pytest.raises(ValueError, match="too far outside"):
        approx._coefficients(fit, 1e-3)


def test_coefficients_interpolate_between_fitted_deltas():
    fit = SCALING_LAW_FITS["pld"]
    for delta, a, b in zip(fit.deltas, fit.a, fit.b, strict=True):
        assert fit.coefficients(delta) == pytest.approx((a, b), rel=1e-12)
    mid = math.sqrt(fit.deltas[0] * fit.deltas[1])
    a_mid, b_mid = fit.coefficients(mid)
    assert a_mid == pytest.approx((fit.a[0] + fit.a[1]) / 2, rel=1e-12)
    assert b_mid == pytest.approx((fit.b[0] + fit.b[1]) / 2, rel=1e-12)


def test_library_does_not_import_dp_accounting():
    code = "import sys, dpfy.plan.accounting.approx; sys.exit('dp_accounting' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- classical composition ---------------------------------------------------------------------


def test_basic_composition_adds_up():
    result = basic_composition(0.3, 1e-7, 10)
    assert isinstance(result, CompositionApproximation)
    epsilon, delta = result
    assert epsilon == pytest.approx(3.0) and delta == pytest.approx(1e-6)
    assert basic_composition(0.1, 0.2, 10).delta == 1.0


def test_advanced_composition_formula():
    epsilon, delta, k, delta_prime = 0.1, 1e-8, 400, 1e-6
    result = advanced_composition(epsilon, delta, k, delta_prime)
    expected = math.sqrt(2 * k * math.log(1 / delta_prime)) * epsilon
    expected += k * epsilon * (math.exp(epsilon) - 1)
    assert result.epsilon == pytest.approx(expected, rel=1e-12)
    assert result.delta == pytest.approx(k * delta + delta_prime, rel=1e-12)


@pytest.mark.parametrize(("epsilon", "k"), [(0.01, 10_000), (0.05, 1_000), (0.1, 5_000)])
def test_advanced_beats_basic_for_many_small_steps(epsilon, k):
    assert (
        advanced_composition(epsilon, 0.0, k, 1e-6).epsilon
        < basic_composition(epsilon, 0.0, k).epsilon
    )


def test_basic_beats_advanced_for_few_large_steps():
    assert basic_composition(1.0, 0.0, 3).epsilon < advanced_composition(1.0, 0.0, 3, 1e-6).epsilon


def test_composition_results_are_labelled():
    for result in (basic_composition(0.5, 1e-6, 4), advanced_composition(0.5, 1e-6, 4, 1e-5)):
        assert result.is_approximation
        assert str(result).startswith("approximation")
        assert "Thm 3." in result.label


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: basic_composition(0.0, 1e-6, 3), r"epsilon must lie in \(0, inf\)"),
        (lambda: basic_composition(1.0, 1.0, 3), r"delta must lie in \[0, 1\)"),
        (lambda: basic_composition(1.0, -0.1, 3), r"delta must lie in \[0, 1\)"),
        (lambda: basic_composition(1.0, 1e-6, 0), r"k must be a whole number >= 1"),
        (lambda: basic_composition(1.0, 1e-6, 2.5), r"k must be a whole number >= 1"),
        (lambda: advanced_composition(1.0, 1e-6, 3, 0.0), r"delta_prime must lie in \(0, 1\)"),
        (lambda: advanced_composition(math.nan, 1e-6, 3, 1e-6), "epsilon must be a finite"),
        (lambda: scaling_law_epsilon(0.0, 10, 1.0, 1e-6), r"sampling_rate must lie in \(0, 1\]"),
        (lambda: scaling_law_epsilon(1.5, 10, 1.0, 1e-6), r"sampling_rate must lie in \(0, 1\]"),
        (lambda: scaling_law_epsilon(0.1, 0, 1.0, 1e-6), r"steps must be a whole number >= 1"),
        (lambda: scaling_law_epsilon(0.1, 10, -1.0, 1e-6), r"noise_multiplier must lie in"),
        (lambda: scaling_law_epsilon(0.1, 10, 1.0, 0.0), r"delta must lie in \(0, 1\)"),
        (lambda: scaling_law_epsilon(0.1, 10, 1.0, 1e-6, "moments"), "must be one of pld, rdp"),
        (
            lambda: scaling_law_noise_multiplier(0.1, 10, 0.0, 1e-6),
            r"target_epsilon must lie in \(0, inf\)",
        ),
        (lambda: scaling_law_noise_multiplier(0.1, 10, math.nan, 1e-6), "target_epsilon"),
    ],
)
def test_bad_input_is_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
