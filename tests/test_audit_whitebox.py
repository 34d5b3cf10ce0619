"""White-box audits of the private step: ε̂ ≤ ε on correct steps, ε̂ > ε on broken ones.

The broken steps are built here, by patching the noise, the clipping or the divisor of the
library's own step for the length of one test; the library has no switch that breaks it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dpfy.audit.canaries import CanaryDesign, audit_rows
from dpfy.audit.observe import StepSettings, run_session
from dpfy.audit.whitebox import audit_private_step
from dpfy.train.grads.engine import GradEngine
from dpfy.train.noise import mechanisms
from dpfy.train.optim import DPOptimizer

EPSILONS = (1.0, 2.0, 4.0, 8.0)


def settings(epsilon: float, **changes) -> StepSettings:
    base = StepSettings(
        records=400, batch_size=200, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5
    )
    return dataclasses.replace(base, **changes).calibrated(epsilon)


def canary_update_only(step: StepSettings, **options):
    return audit_private_step(step, statistics=("canary update",), **options)


# -- the canaries ---------------------------------------------------------------------------------
def test_a_canary_moves_only_its_own_coordinate_by_exactly_the_clip_norm():
    step = StepSettings(records=4, batch_size=3, noise_multiplier=1e-6, max_grad_norm=0.5,
                        delta=1e-5, sampler="shuffle", accountant="rdp")  # fmt: skip
    design = CanaryDesign(canaries=2, probes=3, records=4, scale=7.0)
    session = run_session(step, design, torch.tensor([True, False]), 3, seed=0)
    # canary 1 removed, 3 records in every shuffled batch of 3; normalised by B/C the present
    # canary adds 1 per step, and nothing else moves
    expected = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]).expand(3, 5).numpy()
    assert session.updates == pytest.approx(expected, abs=1e-4)


def test_the_out_side_of_a_canary_follows_the_relation():
    design = CanaryDesign(canaries=2, probes=1, records=3, scale=2.0)
    flags = torch.tensor([True, False])
    assert audit_rows(design, flags, "add-or-remove").shape == (2, 3)  # removed
    assert audit_rows(design, flags, "zero-out")[1].abs().sum() == 0  # zeroed
    assert audit_rows(design, flags, "replace-one")[1, 1] == -2.0  # the opposite Dirac


def test_too_many_removed_canaries_for_the_batch_size_are_refused_naming_the_limit():
    step = StepSettings(records=10, batch_size=8, noise_multiplier=1.0, max_grad_norm=1.0,
                        delta=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="at most 2 canaries"):
        audit_private_step(step, canaries=3, blocks=2)


# -- correct steps: ε̂ ≤ ε -------------------------------------------------------------------------
@pytest.mark.parametrize("epsilon", EPSILONS)
def test_dp_sgd_classical_audit_stays_below_the_claim(epsilon):
    step = settings(epsilon)
    result = audit_private_step(step, canaries=100, blocks=40, seed=int(epsilon))
    assert result.claimed_epsilon == pytest.approx(epsilon, rel=1e-2)
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.threat_model == "white-box" and result.canaries == 100


@pytest.mark.parametrize("epsilon", EPSILONS)
def test_user_level_dp_sgd_classical_audit_stays_below_the_claim(epsilon):
    step = settings(epsilon, unit="user")
    result = audit_private_step(step, canaries=100, blocks=40, seed=10 + int(epsilon))
    assert result.epsilon_lower_bound <= result.claimed_epsilon


@pytest.mark.parametrize("epsilon", EPSILONS)
def test_dp_ftrl_audit_per_epoch_stays_below_the_claim(epsilon):
    step = settings(epsilon, algorithm="dp-ftrl", relation="zero-out", sampler="fixed-order",
                    records=400, batch_size=100)  # fmt: skip
    assert step.steps_per_block == 4  # an epoch of trees is one trial, not a step
    result = audit_private_step(step, canaries=100, blocks=20, seed=20 + int(epsilon))
    assert result.claimed_epsilon == pytest.approx(epsilon, rel=1e-2)
    assert result.epsilon_lower_bound <= result.claimed_epsilon


@pytest.mark.parametrize("epsilon", (2.0, 8.0))
def test_one_run_audit_stays_below_the_whole_runs_claim(epsilon):
    step = settings(epsilon)
    result = audit_private_step(step, method="one-run", canaries=200, blocks=10, seed=3)
    assert result.method == "one-run" and result.runs == 1
    assert result.epsilon_lower_bound <= result.claimed_epsilon


def test_one_run_audit_finds_the_canaries_of_a_weakly_private_run():
    # 10 steps of ε = 8 each: the guesses are near perfect, so ε̂ is far from 0
    result = audit_private_step(settings(8.0), method="one-run", canaries=200, blocks=10, seed=4)
    assert result.correct >= 0.95 * result.guesses and result.epsilon_lower_bound > 2.0


# -- broken steps: ε̂ > ε -------------------------------------------------------------------------
def test_halved_noise_is_caught(monkeypatch):
    step = settings(2.0)
    original = mechanisms.fill_with_noise
    monkeypatch.setattr(
        mechanisms, "fill_with_noise", lambda s, out, std: original(s, out, std / 2)
    )
    result = canary_update_only(step, canaries=200, blocks=125, seed=5)
    assert result.exceeds_claim, result.notes


def test_clipping_switched_off_is_caught(monkeypatch):
    step = settings(2.0)
    original = GradEngine.clip_and_accumulate

    def unclipped(self, clip, *args, **kwargs):
        return original(self, 1e12, *args, **kwargs)  # no unit is ever scaled down

    monkeypatch.setattr(GradEngine, "clip_and_accumulate", unclipped)
    result = canary_update_only(step, canaries=100, blocks=40, seed=6)
    assert result.exceeds_claim and result.epsilon_lower_bound > 2 * result.claimed_epsilon


def test_dividing_by_the_realised_batch_size_is_caught(monkeypatch):
    # one blank and one canary, B = 1: the canary's record makes a batch of two a quarter of the
    # time, and then a realised divisor halves the noise every probe shows
    step = settings(1.0, records=2, batch_size=1)
    take, clip = DPOptimizer._take_batch, DPOptimizer._clip

    def realised_take(self, *args, **kwargs):
        batch = take(self, *args, **kwargs)
        self.mechanism.std = self.plan.noise_std / max(batch.size, 1)
        return batch

    def realised_clip(self, batch, noise=None, scale=1.0):
        return clip(self, batch, noise, scale=1.0 / max(batch.size, 1))

    monkeypatch.setattr(DPOptimizer, "_take_batch", realised_take)
    monkeypatch.setattr(DPOptimizer, "_clip", realised_clip)
    result = audit_private_step(step, canaries=1, blocks=300, probes=256, seed=7)
    assert result.exceeds_claim, result.notes
    assert "noise scale" in result.notes[0]


def test_the_correct_step_passes_the_realised_divisor_check():
    step = settings(1.0, records=2, batch_size=1)
    result = audit_private_step(step, canaries=1, blocks=300, probes=256, seed=7)
    assert not result.exceeds_claim


# -- tightness ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_white_box_audit_at_epsilon_8_is_at_least_half_tight():
    # 500 canaries × 200 held-out steps = 10⁵ trials a side (the module docstring's count)
    step = settings(8.0, records=1000, batch_size=500)
    result = canary_update_only(step, canaries=500, blocks=250, seed=8)
    assert result.epsilon_lower_bound >= 0.5 * result.claimed_epsilon
    assert result.epsilon_lower_bound <= result.claimed_epsilon


@pytest.mark.parametrize("sampler", ["shuffle", "fixed-size"])
def test_classical_audit_refuses_samplers_whose_trials_are_not_independent(sampler):
    step = StepSettings(records=40, batch_size=20, noise_multiplier=1.0, max_grad_norm=1.0,
                        delta=1e-5, sampler=sampler, accountant="rdp")  # fmt: skip
    with pytest.raises(ValueError, match=r"needs independent trials.*one-run"):
        audit_private_step(step, canaries=10, blocks=5)
    assert audit_private_step(step, method="one-run", canaries=10, blocks=5, seed=0).runs == 1


def test_a_runs_plan_gives_the_step_the_audit_re_runs():
    from torch import nn
    from torch.utils.data import TensorDataset

    import dpfy

    model = nn.Linear(3, 1)
    data = TensorDataset(torch.zeros(64, 3), torch.zeros(64))
    private = dpfy.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                                batch_size=16, delta=1e-5, max_grad_norm=0.7, epochs=1,
                                noise_multiplier=1.3, algorithm="dp-ftrl",
                                sampler="fixed-order")  # fmt: skip
    step = StepSettings.from_plan(private.plan)
    assert (step.records, step.batch_size, step.noise_multiplier, step.max_grad_norm) == (
        64,
        16,
        1.3,
        0.7,
    )
    assert (step.algorithm, step.sampler, step.relation) == ("dp-ftrl", "fixed-order", "zero-out")
    assert step.steps_per_block == 4  # one epoch of 64 / 16 batches
    microbatched = dataclasses.replace(private.plan, microbatch_size=4)
    with pytest.raises(ValueError, match="microbatch"):
        StepSettings.from_plan(microbatched)
