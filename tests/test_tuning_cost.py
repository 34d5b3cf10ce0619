"""Tuning cost (guide §5.4.2, app. C): each method's event, checked against dp_accounting."""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
from dp_accounting import dp_event as dpa_events
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpfy.plan.accounting import (
    ComposedEvent,
    NoOpEvent,
    PureDpEvent,
    RepeatAndSelectEvent,
    compute_epsilon,
    dpsgd_event,
)
from dpfy.tune.cost import (
    TUNING_METHODS,
    TuningSpec,
    draw_trial_count,
    get_method,
    single_trial_event,
)

# The guide's app. C scenario: N = 10⁶, B = 5000, σ = 1, one epoch per trial, δ = 10⁻⁶.
N, B, SIGMA, DELTA = 1_000_000, 5000, 1.0, 1e-6
STEPS = N // B
EPOCH = dpsgd_event(B / N, SIGMA, STEPS)
EPOCH_ORACLE = dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(SIGMA)), STEPS
)


def _oracle(event: dp_accounting.DpEvent, kind: str) -> float:
    """ε(δ) from dp_accounting's own accountant."""
    accountant = (
        rdp_privacy_accountant.RdpAccountant()
        if kind == "rdp"
        else pld_privacy_accountant.PLDAccountant()
    )
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize(("kind", "guide", "rtol"), [("rdp", 1.2, 1e-6), ("pld", 0.59, 1e-3)])
def test_app_c_per_epoch_cost(kind: str, guide: float, rtol: float) -> None:
    ours = compute_epsilon(EPOCH, DELTA, kind)
    assert ours == pytest.approx(_oracle(EPOCH_ORACLE, kind), rel=rtol)
    assert round(ours, 2 if kind == "pld" else 1) == guide


@pytest.mark.parametrize(("kind", "guide"), [("rdp", 4.95), ("pld", 4.61)])
def test_app_c_compose_100_runs(kind: str, guide: float) -> None:
    event = get_method("compose").event([EPOCH] * 100, TuningSpec())
    ours = compute_epsilon(event, DELTA, kind)
    oracle = _oracle(dp_accounting.SelfComposedDpEvent(EPOCH_ORACLE, 100), kind)
    assert ours == pytest.approx(oracle, rel=1e-3)
    assert round(ours, 2) == guide


@pytest.mark.parametrize(
    ("distribution", "oracle_shape", "mean", "guide"),
    [
        ("poisson", float("inf"), 10, 1.72),
        ("poisson", float("inf"), 100, 4.18),
        ("geometric", 1.0, 10, 2.03),
        ("geometric", 1.0, 100, 2.74),
    ],
)
def test_app_c_random_trials(
    distribution: str, oracle_shape: float, mean: float, guide: float
) -> None:
    spec = TuningSpec(distribution=distribution, mean_trials=mean)
    event = get_method("random-trials").event([EPOCH], spec)
    assert isinstance(event, RepeatAndSelectEvent)
    ours = compute_epsilon(event, DELTA, "rdp")
    oracle = _oracle(dpa_events.RepeatAndSelectDpEvent(EPOCH_ORACLE, mean, oracle_shape), "rdp")
    assert ours == pytest.approx(oracle, rel=1e-4)
    assert round(ours, 2) == guide


def test_random_trials_cheaper_than_composing_the_expected_number_of_runs() -> None:
    spec = TuningSpec(distribution="geometric", mean_trials=100)
    random_trials = compute_epsilon(get_method("random-trials").event([EPOCH], spec), DELTA, "rdp")
    composed = compute_epsilon(get_method("compose").event([EPOCH] * 100, spec), DELTA, "rdp")
    assert random_trials < composed


def test_exponential_pays_the_runs_and_the_selection() -> None:
    spec = TuningSpec(selection_epsilon=0.5)
    event = get_method("exponential").event([EPOCH] * 10, spec)
    assert isinstance(event, ComposedEvent) and PureDpEvent(0.5) in event.events
    composed = compute_epsilon(get_method("compose").event([EPOCH] * 10, spec), DELTA, "pld")
    exponential = compute_epsilon(event, DELTA, "pld")
    assert composed < exponential <= composed + 0.5 + 1e-6


def test_public_costs_nothing_and_distinct_trials_compose() -> None:
    assert get_method("public").event([EPOCH], TuningSpec()) == NoOpEvent()
    other = dpsgd_event(B / N, 2.0, STEPS)
    event = get_method("compose").event([EPOCH, other, EPOCH], TuningSpec())
    expected = compute_epsilon(ComposedEvent((EPOCH, EPOCH, other)), DELTA, "pld")
    assert compute_epsilon(event, DELTA, "pld") == pytest.approx(expected, rel=1e-9)


def test_no_method_is_refused_with_the_choices_listed() -> None:
    for missing in (None, "", "  "):
        with pytest.raises(ValueError, match="needs an accounting method") as info:
            get_method(missing)
        for name in ("compose", "exponential", "random-trials", "public"):
            assert name in str(info.value)
    with pytest.raises(ValueError, match="unknown tuning accounting method 'bogus'"):
        get_method("bogus")
    assert set(TUNING_METHODS) == {"compose", "exponential", "random-trials", "public"}


def test_random_trials_needs_one_mechanism_and_a_mean() -> None:
    with pytest.raises(ValueError, match="same mechanism"):
        single_trial_event([EPOCH, dpsgd_event(B / N, 2.0, STEPS)])
    with pytest.raises(ValueError, match="mean number of trials"):
        get_method("random-trials").event([EPOCH], TuningSpec())
    with pytest.raises(ValueError, match="no tuning trial ran"):
        get_method("compose").event([], TuningSpec())


@pytest.mark.parametrize(
    ("distribution", "shape", "mean"),
    [
        ("poisson", None, 4.0),
        ("geometric", None, 4.0),
        ("logarithmic", None, 4.0),
        ("truncated-negative-binomial", 0.5, 4.0),
        ("truncated-negative-binomial", -0.5, 3.0),
    ],
)
def test_drawn_number_of_runs_has_the_stated_mean(
    distribution: str, shape: float | None, mean: float
) -> None:
    spec = TuningSpec(distribution=distribution, shape=shape, mean_trials=mean)
    rng = np.random.default_rng(1)
    draws = np.array([draw_trial_count(spec, rng) for _ in range(6000)])
    assert draws.mean() == pytest.approx(mean, rel=0.06)
    if distribution != "poisson":
        assert draws.min() >= 1  # truncated: K = 0 is impossible
    again = np.random.default_rng(1)
    assert [draw_trial_count(spec, again) for _ in range(20)] == draws[:20].tolist()


def test_geometric_draw_matches_its_probability_of_one_run() -> None:
    # Geometric with mean 10: P(K = 1) = γ = 1/10 (Papernot & Steinke 2022, §2).
    spec = TuningSpec(distribution="geometric", mean_trials=10)
    rng = np.random.default_rng(7)
    draws = np.array([draw_trial_count(spec, rng) for _ in range(8000)])
    assert np.mean(draws == 1) == pytest.approx(0.1, abs=0.012)


def test_draw_needs_a_numpy_generator() -> None:
    with pytest.raises(ValueError, match=r"numpy\.random\.Generator"):
        draw_trial_count(TuningSpec(mean_trials=3), 3)
