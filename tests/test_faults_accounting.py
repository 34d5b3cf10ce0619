"""Issue 35, items 7 and 8: a tiny σ (a δ near 1 calibrates one) keeps the PLD accountant's grid
bounded without ever under-reporting ε; a target ε beyond what the accountant resolves is one
clear refusal, not "σ … got nan"."""

from __future__ import annotations

import math

import pytest

from dpfy.plan.accounting import dpsgd_event, make_accountant, pld_compose
from dpfy.plan.accounting.calibrate import CalibrationError, calibrate_noise_multiplier

dp_accounting = pytest.importorskip("dp_accounting")


@pytest.fixture
def leaf_sizes(monkeypatch):
    """The number of grid points each leaf is discretised on."""
    sizes: list[int] = []
    real = pld_compose.discretize

    def spy(direction, spacing, bounds):
        pld = real(direction, spacing, bounds)
        sizes.append(pld.pmf.size)
        return pld

    monkeypatch.setattr(pld_compose, "discretize", spy)
    return sizes


@pytest.mark.parametrize("sigma", [0.008, 0.02])
def test_a_tiny_sigma_keeps_every_leaf_grid_bounded(leaf_sizes, sigma):
    # dpfy train --delta 0.5 --epochs 0.2 on digits: q = 128/1437, 3 steps, σ ≈ 0.008; the leaf
    # grid held 10⁸ points (4.7 GB) before the bound.
    make_accountant("pld").compose(dpsgd_event(128 / 1437, sigma, 3)).epsilon(0.5)
    assert leaf_sizes and max(leaf_sizes) <= pld_compose.MAX_LEAF_POINTS + 2


def _reference(q: float, sigma: float, steps: int, delta: float, interval: float = 1e-2) -> float:
    from dp_accounting import dp_event, pld

    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps
    )
    accountant = pld.PLDAccountant(value_discretization_interval=interval)
    return accountant.compose(event).get_epsilon(delta)


@pytest.mark.parametrize(
    ("q", "sigma", "steps", "delta"),
    [
        (0.089, 0.03, 3, 0.2435),  # the bound coarsens the removal leaf; ε finite but huge
        (0.089, 0.03, 3, 0.244),  # past the mass at +∞: ε = 0
        (0.02, 0.03, 1, 0.0199),
        (0.3, 0.04, 2, 0.5),
    ],
)
def test_a_bounded_grid_never_reports_less_than_dp_accounting(q, sigma, steps, delta):
    ours = make_accountant("pld").compose(dpsgd_event(q, sigma, steps)).epsilon(delta)
    reference = _reference(q, sigma, steps, delta)
    assert ours >= reference * (1 - 1e-3) - 1e-9


def test_the_bound_changes_nothing_at_ordinary_sigma(leaf_sizes):
    ours = make_accountant("pld").compose(dpsgd_event(0.01, 1.0, 1000)).epsilon(1e-5)
    assert max(leaf_sizes) < pld_compose.MAX_LEAF_POINTS
    assert ours == pytest.approx(_reference(0.01, 1.0, 1000, 1e-5, 1e-4), rel=0.01)


def test_a_target_epsilon_beyond_any_guarantee_is_refused_by_name():
    with pytest.raises(CalibrationError, match="target_epsilon 1e\\+308 is beyond"):
        calibrate_noise_multiplier(1e308, 1e-5, 0.01, 100)


def test_a_huge_but_resolvable_target_calibrates_to_a_finite_sigma():
    sigma = calibrate_noise_multiplier(5000.0, 1e-5, 0.01, 100)
    epsilon = make_accountant("pld").compose(dpsgd_event(0.01, sigma, 100)).epsilon(1e-5)
    assert math.isfinite(sigma) and epsilon <= 5000.0
