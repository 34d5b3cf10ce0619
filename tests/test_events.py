"""The event algebra: validation with clear messages, immutability, relations, registry."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from dpfy.plan.accounting import (
    ComposedEvent,
    FixedSizeSampledEvent,
    GaussianEvent,
    LaplaceEvent,
    NeighbouringRelation,
    PoissonSampledEvent,
    PureDpEvent,
    RepeatAndSelectEvent,
    SelfComposedEvent,
    TrialDistribution,
    dpsgd_event,
    make_accountant,
)


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: GaussianEvent(0.0), "noise_multiplier"),
        (lambda: GaussianEvent(-1.0), "noise_multiplier"),
        (lambda: GaussianEvent(float("nan")), "noise_multiplier"),
        (lambda: LaplaceEvent(float("inf")), "noise_multiplier"),
        (lambda: PureDpEvent(0.0), "epsilon"),
        (lambda: PoissonSampledEvent(0.0, GaussianEvent(1.0)), "sampling_rate"),
        (lambda: PoissonSampledEvent(1.01, GaussianEvent(1.0)), "sampling_rate"),
        (lambda: SelfComposedEvent(GaussianEvent(1.0), -1), "count"),
        (lambda: SelfComposedEvent(GaussianEvent(1.0), 2.5), "count"),
        (lambda: dpsgd_event(0.1, 1.0, -10), "steps"),
        (lambda: FixedSizeSampledEvent(10, 20, GaussianEvent(1.0)), "batch_size"),
        (lambda: RepeatAndSelectEvent(GaussianEvent(1.0), 0.0), "mean"),
        (
            lambda: RepeatAndSelectEvent(GaussianEvent(1.0), 10.0, "truncated-negative-binomial"),
            "shape",
        ),
        (lambda: PoissonSampledEvent(0.1, "gaussian"), "DpEvent"),
    ],
)
def test_bad_parameters_raise_value_error_naming_them(build, name):
    with pytest.raises(ValueError, match=name):
        build()


def test_poisson_sampling_rate_one_is_allowed():
    assert PoissonSampledEvent(1.0, GaussianEvent(1.0)).sampling_rate == 1.0


def test_events_are_immutable_and_compare_by_value():
    event = dpsgd_event(0.01, 1.0, 100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.count = 5  # type: ignore[misc]
    assert event == dpsgd_event(0.01, 1.0, 100)
    assert hash(event) == hash(dpsgd_event(0.01, 1.0, 100))
    assert ComposedEvent([event]).events == (event,)


def test_trial_distributions_fix_their_shapes():
    assert RepeatAndSelectEvent(GaussianEvent(1.0), 10.0, "geometric").shape == 1.0
    assert RepeatAndSelectEvent(GaussianEvent(1.0), 10.0, "logarithmic").shape == 0.0
    poisson = RepeatAndSelectEvent(GaussianEvent(1.0), 10.0)
    assert poisson.distribution is TrialDistribution.POISSON and poisson.shape is None
    with pytest.raises(ValueError, match="poisson, truncated-negative-binomial"):
        RepeatAndSelectEvent(GaussianEvent(1.0), 10.0, "uniform")


def test_relations_parse_and_double_sensitivity_only_for_replace_one():
    assert NeighbouringRelation.parse("replace_one") is NeighbouringRelation.REPLACE_ONE
    assert NeighbouringRelation.REPLACE_ONE.sensitivity_factor == 2.0
    assert NeighbouringRelation.ADD_OR_REMOVE.sensitivity_factor == 1.0
    assert NeighbouringRelation.ZERO_OUT.sensitivity_factor == 1.0
    with pytest.raises(ValueError, match="add-or-remove, zero-out, replace-one"):
        NeighbouringRelation.parse("swap")


@pytest.mark.parametrize("name", ["pld", "rdp"])
def test_every_accountant_refuses_mixed_relations(name):
    accountant = make_accountant(name, "add-or-remove")
    accountant.compose(GaussianEvent(1.0), relation="add-or-remove")
    with pytest.raises(ValueError, match="never mix"):
        accountant.compose(GaussianEvent(1.0), relation=NeighbouringRelation.REPLACE_ONE)


def test_unknown_accountant_lists_the_choices():
    with pytest.raises(ValueError, match="pld, rdp"):
        make_accountant("moments")


def test_accounting_imports_without_torch():
    code = (
        "import sys, dpfy.plan.accounting, dpfy.plan.accounting.calibrate; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
