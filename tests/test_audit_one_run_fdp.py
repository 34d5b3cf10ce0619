"""f-DP one-run audits (Mahloujifar et al. 2024): the bound against Steinke et al.'s from the
same guesses, its confidence on simulated runs, the claimed event's family, and the audits of
DP-SGD, user level, DP-FTRL and matrix-factorisation noise."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dpfy.audit.observe import StepSettings
from dpfy.audit.one_run import score_and_guess
from dpfy.audit.one_run_fdp import (
    EventFamily,
    GaussianFamily,
    noise_multipliers,
    refutes,
    scaled_event,
    score_and_guess_fdp,
)
from dpfy.audit.whitebox import audit_private_step
from dpfy.plan.accounting.accountant import compute_epsilon
from dpfy.plan.accounting.events import (
    ComposedEvent,
    GaussianEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
)
from dpfy.train.grads.engine import GradEngine


def one_run(mu: float, m: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """A simulated run of a μ-GDP mechanism: each canary in by a coin, its score N(μ·in, 1)."""
    included = rng.random(m) < 0.5
    return rng.normal(0.0, 1.0, m) + mu * included, included


# -- the bound ------------------------------------------------------------------------------------
def test_more_right_guesses_refute_more_and_no_guesses_refute_nothing():
    inverse = GaussianFamily(1e-5).blow_up_inverse(1.0)
    assert not refutes(inverse, 1000, 100, 0, 0.95)
    assert not refutes(inverse, 1000, 100, 60, 0.95)  # barely better than a coin
    assert refutes(inverse, 1000, 100, 100, 0.95)  # every guess right: 1-GDP cannot do that


@pytest.mark.parametrize("mu", [1.0, 2.0, 4.0])
def test_the_f_dp_bound_is_at_least_steinkes_from_the_same_guesses(mu):
    scores, included = one_run(mu, 1000, np.random.default_rng(int(mu)))
    steinke = score_and_guess(scores, included, 1e-5, 0.95)
    fdp = score_and_guess_fdp(scores, included, GaussianFamily(1e-5), 0.95)
    assert fdp.epsilon_lower_bound >= steinke.epsilon_lower_bound > 0
    assert fdp.method == "one-run-f-dp" and fdp.guesses > 0


def test_a_simulated_gaussian_run_is_refuted_no_more_often_than_the_confidence_allows():
    # 20 runs of a 2-GDP mechanism: ε̂ above its ε at most 5 % of the time (here: at most 1)
    rng = np.random.default_rng(7)
    family = GaussianFamily(1e-5)
    truth = family.epsilon(2.0)
    over = 0
    for _ in range(20):
        scores, included = one_run(2.0, 1000, rng)
        over += score_and_guess_fdp(scores, included, family, 0.95).epsilon_lower_bound > truth
    assert over <= 1


# -- the claimed event's family -------------------------------------------------------------------
def test_scaling_an_event_scales_every_noise_multiplier_and_nothing_else():
    step = PoissonSampledEvent(0.1, GaussianEvent(2.0))
    event = ComposedEvent((SelfComposedEvent(step, 10), GaussianEvent(4.0)))
    scaled = scaled_event(event, 0.5)
    assert sorted(noise_multipliers(scaled)) == [1.0, 2.0]
    assert scaled.events[0].count == 10 and scaled.events[0].event.sampling_rate == 0.1


def test_the_family_member_at_one_is_the_claim():
    claimed = SelfComposedEvent(PoissonSampledEvent(0.5, GaussianEvent(1.5)), 5)
    family = EventFamily(claimed, 1e-5)
    assert family.epsilon(1.0) == pytest.approx(compute_epsilon(claimed, 1e-5))
    assert family.epsilon(2.0) > family.epsilon(1.0)  # half the noise: less private


# -- the audits of the training variants ----------------------------------------------------------
VARIANTS = {
    "dp-sgd": {},
    "user level": {"unit": "user"},
    "dp-ftrl": {"algorithm": "dp-ftrl", "relation": "zero-out", "sampler": "fixed-order",
                "records": 1000, "batch_size": 250},
    "bandmf": {"algorithm": "bandmf", "records": 1000, "batch_size": 250, "steps": 8},
}  # fmt: skip


def variant(name: str, epsilon: float, blocks: int) -> StepSettings:
    base = StepSettings(records=2000, batch_size=1500, noise_multiplier=1.0, max_grad_norm=1.0,
                        delta=1e-5)  # fmt: skip
    step = dataclasses.replace(base, **VARIANTS[name])
    return step.calibrated(epsilon, 1 if step.factorised else blocks)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_correct_run_stays_below_its_claim_with_steinkes_figure_beside_it(name):
    step = variant(name, 4.0, 4)
    result = audit_private_step(step, method="one-run-f-dp", canaries=300, blocks=2 if
                                step.factorised else 4, seed=5)  # fmt: skip
    assert result.method == "one-run-f-dp"
    assert 0.0 <= result.epsilon_lower_bound <= result.claimed_epsilon
    assert any("Steinke et al.'s (ε, δ) bound from the same scores" in n for n in result.notes)


def test_a_run_whose_clipping_lets_each_canary_add_four_times_c_is_caught(monkeypatch):
    step = variant("dp-sgd", 2.0, 4)
    original = GradEngine.clip_and_accumulate

    def four_times(self, clip, *args, **kwargs):
        return original(self, 4.0 * clip, *args, **kwargs)

    monkeypatch.setattr(GradEngine, "clip_and_accumulate", four_times)
    result = audit_private_step(step, method="one-run-f-dp", canaries=300, blocks=4, seed=6)
    assert result.exceeds_claim, result.notes
