"""The f-DP audit of one step: the tradeoff maths against closed forms and an independent
accountant, its confidence on simulated trials, ε̂ ≤ ε on correct steps and ε̂ > ε on an
under-noised one, and how close it comes."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy import optimize, stats

from dpfy.audit.fdp import check_fdp_applies, fdp_audit
from dpfy.audit.observe import StepSettings
from dpfy.audit.tradeoff import (
    MAX_MU,
    epsilon_of_mu,
    expected_epsilon,
    refuted_mu,
    subsampled_tradeoff,
    tradeoff_bound,
    trials_needed,
)
from dpfy.audit.whitebox import audit_private_step
from dpfy.train.noise import mechanisms

EPSILONS = (1.0, 2.0, 4.0, 8.0)


def step(epsilon: float, q: float) -> StepSettings:
    base = StepSettings(
        records=1000, batch_size=round(1000 * q), noise_multiplier=1.0, max_grad_norm=1.0,
        delta=1e-5,
    )  # fmt: skip
    return base.calibrated(epsilon)


# -- the tradeoff maths ---------------------------------------------------------------------------
@pytest.mark.parametrize(("mu", "q"), [(0.3, 1.0), (1.7, 1.0), (2.0, 0.1), (0.8, 0.01)])
def test_a_point_on_the_claimed_curve_refutes_exactly_the_smaller_mus(mu, q):
    alpha = np.array([0.01, 0.2, 0.5])
    beta = subsampled_tradeoff(alpha, mu, q)
    assert refuted_mu(alpha, beta, q) == pytest.approx(mu, rel=1e-9)
    # a point just above the curve refutes less, one just below refutes more
    assert np.all(refuted_mu(alpha, beta + 1e-6, q) < mu)
    assert np.all(refuted_mu(alpha, beta - 1e-6, q) > mu)


def test_a_point_no_subsampled_gaussian_allows_refutes_every_mu_and_a_blind_one_none():
    # below (1 − q)(1 − α): more certain than a step that skips the record 1 − q of the time
    assert refuted_mu(0.1, 0.4, 0.5) == MAX_MU  # (1 − q)(1 − α) = 0.45
    assert refuted_mu(1.0, 0.0, 1.0) == 0.0  # α⁺ = 1 says nothing
    assert refuted_mu(0.5, 0.6, 1.0) == 0.0  # above the diagonal: no μ > 0 refuted


@pytest.mark.parametrize("mu", [0.25, 1.0, 2.5])
def test_gaussian_epsilon_matches_the_gdp_closed_form(mu):
    # Dong, Roth & Su 2022, Corollary 2.13: δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)
    def delta(eps: float) -> float:
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2
        )

    want = optimize.brentq(lambda e: delta(e) - 1e-5, 1e-9, 100.0)
    assert epsilon_of_mu(mu, 1.0, 1e-5) == pytest.approx(want, rel=2e-3)


@pytest.mark.parametrize(("sigma", "q"), [(0.9, 0.1), (0.6, 0.01)])
def test_subsampled_epsilon_matches_dp_accounting(sigma, q):
    dp_accounting = pytest.importorskip("dp_accounting")
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)))
    assert epsilon_of_mu(1 / sigma, q, 1e-5) == pytest.approx(
        accountant.get_epsilon(1e-5), rel=2e-2
    )


@pytest.mark.parametrize(("sigma", "q"), [(1.0, 1.0), (0.7, 0.1)])
def test_mu_hat_exceeds_the_truth_no_more_often_than_the_confidence_allows(sigma, q):
    # 120 audits of simulated correct trials (2000 a side): μ̂ > 1/σ at most 5 % of the time
    rng = np.random.default_rng(33)
    over = 0
    for _ in range(120):
        scores_out = rng.normal(0.0, sigma, 2000)
        scores_in = rng.normal(0.0, sigma, 2000) + (rng.random(2000) < q)
        over += tradeoff_bound(scores_in, scores_out, q, 0.95).mu > 1.0 / sigma
    assert over <= 0.05 * 120


def test_the_assumption_free_bound_needs_far_more_trials_than_the_fitted_one():
    sigma = 0.6
    fitted = trials_needed(1.0, sigma, 1e-5, 0.95, 8.0)
    classical = trials_needed(1.0, sigma, 1e-5, 0.95, 8.0, fitted=False)
    assert fitted is not None and classical is not None and classical > 100 * fitted
    assert expected_epsilon(fitted, 1.0, sigma, 1e-5, 0.95) >= 0.8 * 8.0 * 0.99


# -- correct steps: ε̂ ≤ ε; an under-noised step: ε̂ > ε ---------------------------------------------
@pytest.mark.parametrize("q", [1.0, 0.1])
@pytest.mark.parametrize("epsilon", EPSILONS)
def test_a_correct_step_stays_below_its_claim(epsilon, q):
    result = fdp_audit(step(epsilon, q), canaries=2000, steps=30, seed=int(10 * epsilon + q))
    assert result.claimed_epsilon == pytest.approx(epsilon, rel=1e-2)
    assert 0.0 < result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.method == "f-dp" and result.threat_model == "white-box"
    assert result.guesses == 2 * round(0.8 * 2000 * 30)  # the held-out trials of both sides


@pytest.mark.parametrize("q", [1.0, 0.1])
def test_an_under_noised_step_is_caught(monkeypatch, q):
    original = mechanisms.fill_with_noise
    monkeypatch.setattr(
        mechanisms, "fill_with_noise", lambda s, out, std: original(s, out, 0.7 * std)
    )
    result = fdp_audit(step(2.0, q), canaries=2000, steps=30, seed=3)
    assert result.exceeds_claim, result.notes


def test_the_audit_through_audit_private_step_reports_what_a_claim_needs():
    result = audit_private_step(step(4.0, 1.0), method="f-dp", canaries=500, blocks=20, seed=1)
    assert result.method == "f-dp"
    assert any("trials a side for an expected ε̂" in note for note in result.notes)
    assert any("μ̂ =" in note for note in result.notes)


@pytest.mark.slow
@pytest.mark.parametrize("q", [1.0, 0.1])
@pytest.mark.parametrize("epsilon", EPSILONS)
def test_ten_to_the_six_trials_come_within_eighty_percent_of_the_claim(epsilon, q):
    result = fdp_audit(step(epsilon, q), seed=int(epsilon))  # 10⁴ canaries × 100 steps
    assert 0.8 * result.claimed_epsilon <= result.epsilon_lower_bound <= result.claimed_epsilon


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"algorithm": "dp-ftrl", "relation": "zero-out", "sampler": "fixed-order"}, "dp-ftrl"),
        ({"sampler": "shuffle"}, "shuffle"),
    ],
)
def test_steps_whose_trials_are_not_independent_are_refused_naming_the_alternative(changes, named):
    settings = dataclasses.replace(
        StepSettings(records=100, batch_size=10, noise_multiplier=1.0, max_grad_norm=1.0,
                     delta=1e-5), **changes)  # fmt: skip
    with pytest.raises(ValueError, match=rf"{named}.*classical or one-run"):
        check_fdp_applies(settings)
