"""White-box audits of matrix-factorisation noise (BandMF, BLT, amplified BandMF).

ε̂ ≤ ε on the library's own mechanisms, ε̂ > ε when the sensitivity is under-stated. The statistic
(:mod:`dpfy.audit.correlated`) is checked against the dense algebra and its distribution under
the claimed covariance, and the library's released noise is checked to have that covariance.
The broken steps are built here, by patching the library for the length of one test.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch

from dpfy.audit.correlated import (
    FactorisedSession,
    decorrelated,
    factorised_design,
    log_likelihood_ratios,
    run_factorised_session,
    transposed,
)
from dpfy.audit.observe import StepSettings, run_session
from dpfy.audit.whitebox import audit_private_step, audit_steps
from dpfy.plan.accounting import make_accountant
from dpfy.plan.correlated import BandedStrategy, Blt, MinSeparation, toeplitz_sensitivity_squared
from dpfy.plan.correlated.toeplitz import toeplitz_matrix
from dpfy.plan.correlated_events import decode_strategy, run_charges
from dpfy.train.grads.engine import GradEngine
from dpfy.train.noise.banded import BandedMechanism
from dpfy.train.noise.blt import BltMechanism

#: The audited runs: N = 1000, B = 250 (s = 4) over 2 epochs in a fixed order; amplified BandMF
#: samples 2 groups (bands) of 500 at q = 0.1 for 20 steps.
MECHANISMS = {
    "bandmf": {"algorithm": "bandmf"},
    "blt": {"algorithm": "blt"},
    "amplified bandmf": {"algorithm": "bandmf", "sampler": "cyclic-poisson", "batch_size": 50,
                         "steps": 20},
}  # fmt: skip
#: Many canaries (one coordinate each, cheap) and a few whole re-runs: 4000 trials a side.
CANARIES, BLOCKS = 1000, 5


@functools.cache
def settings(mechanism: str, epsilon: float, noise_multiplier: float = 1.0) -> StepSettings:
    base = StepSettings(records=1000, batch_size=250, noise_multiplier=noise_multiplier,
                        max_grad_norm=1.0, delta=1e-5, steps=8)  # fmt: skip
    step = dataclasses.replace(base, **MECHANISMS[mechanism])
    if not epsilon:  # a given σ, possibly tiny: RDP states its huge ε cheaply
        return dataclasses.replace(step, accountant="rdp")
    return step.calibrated(epsilon)


def stream(strategy, steps: int, x: np.ndarray, sigma: float, rng) -> np.ndarray:
    """y = x + σ C⁻¹ z on as many coordinates as x has columns (the claimed mechanism)."""
    inverse = np.linalg.inv(toeplitz_matrix(strategy.toeplitz(steps), steps))
    return x + sigma * inverse @ rng.standard_normal(x.shape)


STRATEGIES = {
    "bandmf": BandedStrategy((1.0, 0.5, 0.375, 0.3)),
    "blt": Blt((0.9, 0.5), (0.3, 0.2)),
}


# -- the statistic ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_decorrelated_and_transposed_apply_C_and_its_transpose(name):
    c = STRATEGIES[name].toeplitz(12)
    dense = toeplitz_matrix(c, 12)
    y = np.random.default_rng(0).standard_normal((12, 5))
    np.testing.assert_allclose(decorrelated(y, c), dense @ y, atol=1e-12)
    np.testing.assert_allclose(transposed(y, c), dense.T @ y, atol=1e-12)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_statistic_is_a_gaussian_shift_of_norm_Cx_over_sigma_under_the_claim(name):
    # Λ = (⟨Cx, Cy⟩ − ‖Cx‖²/2)/σ² is N(m²/2, m²) in and N(−m²/2, m²) out, m = ‖Cx‖/σ: the
    # Gaussian mechanism of μ = m that the accounting bounds by Δ/σ.
    strategy, steps, sigma, n = STRATEGIES[name], 12, 1.7, 40_000
    pattern = np.zeros(steps)
    pattern[[1, 5, 9]] = 1.0  # three epochs of s = 4, the canary at position 1
    x = np.repeat(pattern[:, None], n, axis=1)
    rng = np.random.default_rng(1)
    c = strategy.toeplitz(steps)
    m = np.linalg.norm(toeplitz_matrix(c, steps) @ pattern) / sigma

    def scores(shift):
        session = FactorisedSession(stream(strategy, steps, shift, sigma, rng), x.astype(bool),
                                    c, sigma, None, 1.0, name, "fixed order")  # fmt: skip
        return log_likelihood_ratios(session, n, 0.0)

    inside, outside = scores(x), scores(0 * x)
    assert inside.mean() == pytest.approx(m**2 / 2, abs=4 * m / math.sqrt(n))
    assert outside.mean() == pytest.approx(-(m**2) / 2, abs=4 * m / math.sqrt(n))
    assert inside.std() == pytest.approx(m, rel=0.02)
    assert outside.std() == pytest.approx(m, rel=0.02)
    delta = math.sqrt(toeplitz_sensitivity_squared(c, steps, MinSeparation(3, 4)).squared)
    assert m <= delta / sigma + 1e-12  # the canary's μ never exceeds what is charged


def test_with_one_band_the_statistic_is_the_sum_over_the_canarys_steps():
    rng = np.random.default_rng(2)
    y, steps = rng.standard_normal((6, 3)), np.zeros((6, 3), dtype=bool)
    steps[[0, 3], 0] = steps[[2, 5], 1] = steps[[1], 2] = True
    session = FactorisedSession(y, steps, np.eye(6)[0], 2.0, None, 1.0, "DP-SGD", "")
    expected = ((y * steps).sum(axis=0) - steps.sum(axis=0) / 2) / 4.0
    np.testing.assert_allclose(log_likelihood_ratios(session, 3, 0.0), expected)


def test_cyclic_statistic_is_the_mixture_likelihood_ratio_of_each_round():
    # bands ≤ groups: a group's rounds touch disjoint rows of C, so each is one subsampled
    # Gaussian; Λ is the sum of their log-likelihood ratios, computed here by brute force.
    strategy, steps, sigma, q = BandedStrategy((1.0, 0.6)), 6, 1.3, 0.3
    c = strategy.toeplitz(steps)
    dense = toeplitz_matrix(c, steps)
    y = np.random.default_rng(3).standard_normal((steps, 1))
    rounds = np.zeros((steps, 1), dtype=bool)
    rounds[[1, 3, 5], 0] = True  # group 1 of 2
    session = FactorisedSession(y, rounds, c, sigma, q, 1.0, "BandMF", "cyclic")
    white = dense @ y[:, 0]
    expected = 0.0
    for t in (1, 3, 5):
        column = dense[:, t]
        shift = (column @ white - column @ column / 2) / sigma**2
        expected += math.log(1 - q + q * math.exp(shift))
    assert log_likelihood_ratios(session, 1, 0.0)[0] == pytest.approx(expected, rel=1e-10)


# -- the session: what the auditor sees of the library's own mechanism ----------------------------
@pytest.mark.parametrize("mechanism", ["bandmf", "blt"])
def test_a_canary_adds_exactly_one_at_its_fixed_position_every_epoch(mechanism):
    step = settings(mechanism, 0.0, noise_multiplier=1e-3)
    design = factorised_design(step, 1000, 2)
    session = run_factorised_session(step, design, torch.ones(1000, dtype=torch.bool), seed=0)
    canaries = session.updates[:, :1000]
    np.testing.assert_allclose(canaries, session.steps, atol=0.02)  # 1 where fetched, else 0
    first = session.steps.argmax(axis=0)
    assert (session.steps.sum(axis=0) == 2).all()  # two epochs: once each
    assert session.steps[first + 4, np.arange(1000)].all()  # s = N // B = 4 steps apart
    assert np.bincount(first, minlength=4).tolist() == [250] * 4  # one batch per position


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_the_released_noise_is_white_once_C_is_applied(mechanism):
    # The statistic's premise, on the library's own stream: y = σ C⁻¹ z, so C y / σ ~ N(0, I).
    step = settings(mechanism, 0.0, noise_multiplier=2.0)
    design = factorised_design(step, 1, 3000)
    session = run_factorised_session(step, design, torch.zeros(1, dtype=torch.bool), seed=1)
    white = decorrelated(session.updates[:, 1:], session.coefficients) / 2.0
    covariance = white @ white.T / white.shape[1]
    np.testing.assert_allclose(covariance, np.eye(covariance.shape[0]), atol=0.08)
    raw = session.updates[:, 1:] @ session.updates[:, 1:].T / white.shape[1] / 4.0
    assert np.abs(raw - np.eye(raw.shape[0])).max() > 0.15  # and correlated before


def test_cyclic_canaries_are_scored_on_their_groups_rounds_never_on_their_coins():
    step = settings("amplified bandmf", 0.0, noise_multiplier=0.02)
    design = factorised_design(step, 1000, 2)
    session = run_factorised_session(step, design, torch.ones(1000, dtype=torch.bool), seed=2)
    assert session.sampling_rate == pytest.approx(0.1)
    groups = session.steps.argmax(axis=0)
    assert np.bincount(groups).tolist() == [500, 500]  # 2 groups split once
    for t in range(20):
        assert (session.steps[t] == (groups == t % 2)).all()  # every round of the group
    sampled = session.updates[:, :1000] > 0.5
    assert not (sampled & ~session.steps).any()  # taken only at its group's rounds
    assert 0.05 < sampled[session.steps].mean() < 0.15  # …and at q there, unknown to the score


# -- correct mechanisms: ε̂ ≤ ε -------------------------------------------------------------------
@pytest.mark.parametrize("epsilon", [1.0, 4.0, 8.0])
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_classical_audit_of_the_whole_run_stays_below_the_claim(mechanism, epsilon):
    step = settings(mechanism, epsilon)
    result = audit_private_step(step, canaries=CANARIES, blocks=BLOCKS, seed=int(epsilon))
    assert result.claimed_epsilon == pytest.approx(epsilon, rel=1e-2)
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.epsilon_lower_bound > 0.0  # it does find the canaries
    assert (result.runs, result.scope, result.threat_model) == (10, "private-step", "white-box")
    assert any("whole run of T = " in note for note in result.notes)


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_one_run_audit_stays_below_the_claim(mechanism):
    step = settings(mechanism, 8.0)
    result = audit_private_step(step, method="one-run", canaries=CANARIES, blocks=2, seed=3)
    assert result.method == "one-run" and result.canaries == 2 * CANARIES and result.runs == 2
    assert 0.0 < result.epsilon_lower_bound <= result.claimed_epsilon


def test_the_audit_costs_whole_runs_and_says_what_it_audited():
    step = settings("bandmf", 2.0)
    assert step.steps_per_block == 8 and audit_steps(step, "classical", 5) == 80
    assert (step.mechanism, step.relation, step.sampler) == ("banded-mf", "zero-out",
                                                            "fixed-order-epochs")  # fmt: skip
    result = audit_private_step(step, canaries=100, blocks=2, seed=0)
    mechanism, trial, statistic = result.notes[:3]
    assert "BandMF, 4 bands" in mechanism and "s = 4 steps apart" in mechanism
    assert "one whole run of T = 8 steps" in trial and "(CᵀC y)_t" in statistic


# -- broken mechanisms: ε̂ > ε ---------------------------------------------------------------------
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_a_sensitivity_under_stated_four_times_is_caught(mechanism, monkeypatch):
    # Each canary's gradient is clipped to 4C while the noise and the accounting assume C.
    step = settings(mechanism, 2.0)
    original = GradEngine.clip_and_accumulate

    def four_times(self, clip, *args, **kwargs):
        return original(self, 4.0 * clip, *args, **kwargs)

    monkeypatch.setattr(GradEngine, "clip_and_accumulate", four_times)
    result = audit_private_step(step, canaries=CANARIES, blocks=BLOCKS, seed=11)
    assert result.exceeds_claim, result.notes
    assert result.epsilon_lower_bound > 1.25 * result.claimed_epsilon


@pytest.mark.parametrize("mechanism", ["bandmf", "blt"])
def test_independent_noise_accounted_as_the_factorisation_is_not_a_leak(mechanism, monkeypatch):
    # Noise not correlated as claimed — fresh N(0, (σC/B)²) each step, the factorisation's
    # accounting unchanged — is no privacy bug: with c_0 = 1 every column of C has length ≥ 1,
    # so Δ² ≥ k and the independent noise's μ = √k/σ is at most the Δ/σ charged. A sound audit
    # must not flag it (it is a lower bound on ε, not a test of the covariance).
    step = settings(mechanism, 2.0)
    for cls in (BandedMechanism, BltMechanism):
        monkeypatch.setattr(cls, "_correlate", lambda self, name, fresh: fresh)
    result = audit_private_step(step, canaries=CANARIES, blocks=BLOCKS, seed=12)
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    c = decode_strategy(step.mechanism, step.strategy).toeplitz(8)
    assert toeplitz_sensitivity_squared(c, 8, MinSeparation(2, 4)).squared >= 2.0  # Δ² ≥ k = 2


# -- settings from a run, and refusals ----------------------------------------------------------
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_a_runs_plan_gives_the_whole_run_the_audit_re_runs(mechanism):
    from torch import nn
    from torch.utils.data import TensorDataset

    import dpfy

    options = dict(MECHANISMS[mechanism])
    steps = options.pop("steps", 8)
    batch = options.pop("batch_size", 250)
    model = nn.Linear(3, 1)
    private = dpfy.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                TensorDataset(torch.zeros(1000, 3), torch.zeros(1000)),
                                batch_size=batch, delta=1e-5, max_grad_norm=0.7, steps=steps,
                                noise_multiplier=1.3, **options)  # fmt: skip
    private.engine.detach()
    step = StepSettings.from_plan(private.plan)
    assert (step.steps, step.strategy, step.mechanism) == (
        steps,
        private.plan.strategy,
        private.plan.mechanism,
    )
    assert (step.relation, step.noise_multiplier) == (private.plan.relation, 1.3)
    result = audit_private_step(step, canaries=50, blocks=1, seed=0)
    plan = private.plan
    charges = run_charges(plan.mechanism, plan.strategy, plan.sampler, plan.steps,
                          plan.dataset_size, plan.expected_batch_size)  # fmt: skip
    whole = make_accountant(plan.accountant, plan.relation).compose(charges.run_events(1.3))
    assert result.claimed_epsilon == pytest.approx(whole.epsilon(1e-5), rel=1e-6)


def test_a_session_that_plans_another_strategy_is_refused():
    step = settings("bandmf", 2.0)
    other = dataclasses.replace(step, strategy=(1.0, 0.1, 0.1, 0.1))
    with pytest.raises(ValueError, match="another bandmf strategy than the run's"):
        audit_private_step(other, canaries=10, blocks=1, seed=0)


def test_a_factorised_audit_needs_the_runs_steps_and_its_one_statistic():
    bare = StepSettings(records=100, batch_size=10, noise_multiplier=1.0, max_grad_norm=1.0,
                        delta=1e-5, algorithm="blt")  # fmt: skip
    with pytest.raises(ValueError, match="planned steps"):
        bare.steps_per_block  # noqa: B018
    step = settings("blt", 2.0)
    with pytest.raises(ValueError, match="one statistic"):
        audit_private_step(step, statistics=("noise scale",))
    with pytest.raises(ValueError, match="whole run"):
        run_session(step, factorised_design(step, 2, 2), torch.ones(2, dtype=torch.bool), 1, 0)
    with pytest.raises(ValueError, match="at most that many canaries"):
        factorised_design(step, 1001, 2)
