"""Calibration never overshoots the target ε and is tight; max steps is exact."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfy.plan.accounting import (
    CalibrationError,
    PldAccountant,
    RdpAccountant,
    calibrate_noise_multiplier,
    dpsgd_event,
    max_steps,
    settings_at_fixed_ratio,
    smallest_noise_multiplier,
)
from dpfy.plan.accounting.events import ComposedEvent, GaussianEvent, SelfComposedEvent

ACCOUNTANTS = {"pld": PldAccountant, "rdp": RdpAccountant}


def epsilon_of(name: str, q: float, sigma: float, steps: int, delta: float) -> float:
    return ACCOUNTANTS[name]().compose(dpsgd_event(q, sigma, steps)).epsilon(delta)


@settings(max_examples=12, deadline=None)
@given(
    q=st.floats(1e-3, 0.05),
    steps=st.integers(10, 20_000),
    target=st.floats(0.3, 10.0),
    delta=st.sampled_from([1e-7, 1e-6, 1e-5]),
    name=st.sampled_from(["pld", "rdp"]),
)
def test_calibrated_sigma_meets_the_target_and_is_tight(q, steps, target, delta, name):
    sigma = calibrate_noise_multiplier(target, delta, q, steps, accountant=name, rtol=1e-3)
    assert epsilon_of(name, q, sigma, steps, delta) <= target
    # Within the tolerance of the smallest σ: a slightly smaller σ misses the target.
    assert epsilon_of(name, q, sigma * (1 - 2e-3), steps, delta) > target


def test_guide_example_calibrates_back_to_sigma_one():
    """App. C: σ = 1 gives ε ≈ 0.5868, so calibrating to that ε recovers σ ≈ 1."""
    sigma = calibrate_noise_multiplier(0.5868, 1e-6, 0.005, 200)
    assert sigma == pytest.approx(1.0, rel=5e-3)


def test_heterogeneous_runs_calibrate_through_the_event_factory():
    def run(sigma: float) -> ComposedEvent:
        return ComposedEvent(
            (dpsgd_event(0.01, sigma, 1000), SelfComposedEvent(GaussianEvent(10 * sigma), 5))
        )

    sigma = smallest_noise_multiplier(run, 2.0, 1e-5)
    assert PldAccountant().compose(run(sigma)).epsilon(1e-5) <= 2.0
    assert PldAccountant().compose(run(sigma * 0.995)).epsilon(1e-5) > 2.0


@settings(max_examples=8, deadline=None)
@given(
    q=st.floats(1e-3, 0.05),
    sigma=st.floats(0.6, 3.0),
    target=st.floats(0.5, 8.0),
)
def test_max_steps_is_the_last_step_that_fits(q, sigma, target):
    limit = 10**7
    steps = max_steps(target, 1e-5, q, sigma, limit=limit)
    if steps:
        assert epsilon_of("pld", q, sigma, steps, 1e-5) <= target
    if steps < limit:  # at the limit the search stops there: more steps may still fit
        assert epsilon_of("pld", q, sigma, steps + 1, 1e-5) > target


def test_max_steps_is_zero_when_even_one_step_is_too_many():
    assert max_steps(0.01, 1e-5, 0.5, 0.5) == 0


def test_fixed_ratio_settings_follow_the_guide_step_4():
    ratio, clip, n, epochs = 0.01, 1.0, 60_000, 10
    found = settings_at_fixed_ratio(ratio, clip, n, epochs, 3.0, 1e-5, [256, 1024, 4096])
    for setting in found:
        assert setting.noise_multiplier * clip / setting.batch_size == pytest.approx(ratio)
        assert setting.steps == math.ceil(epochs * n / setting.batch_size)
        accounted = epsilon_of(
            "pld", setting.sampling_rate, setting.noise_multiplier, setting.steps, 1e-5
        )
        assert setting.epsilon == pytest.approx(accounted)
        assert setting.meets_target == (accounted <= 3.0)
    # Larger batches at a fixed σC/B buy privacy: ε falls as B grows.
    assert found[0].epsilon > found[1].epsilon > found[2].epsilon


def test_unreachable_target_says_what_to_change():
    with pytest.raises(CalibrationError, match="raise the target"):
        calibrate_noise_multiplier(1e-6, 1e-9, 1.0, 10**6)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"sampling_rate": 0.0}, "sampling_rate"),
        ({"steps": -5}, "steps"),
        ({"target_epsilon": float("nan")}, "target_epsilon"),
    ],
)
def test_bad_input_names_the_parameter(kwargs, name):
    arguments = {"target_epsilon": 1.0, "delta": 1e-5, "sampling_rate": 0.01, "steps": 100}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=name):
        calibrate_noise_multiplier(**arguments)
