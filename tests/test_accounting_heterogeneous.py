"""Heterogeneous runs (σ or q changing every step): both accountants against dp_accounting, the
shortcuts that make them fast against the slow exact answer, and the budget guard's boundary."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from scipy import integrate

from dpfy.plan.accounting import (
    GaussianEvent,
    LaplaceEvent,
    PldAccountant,
    PldPrecision,
    PoissonSampledEvent,
    PureDpEvent,
    RdpAccountant,
    SelfComposedEvent,
    make_accountant,
)
from dpfy.plan.accounting.accountant import ACCOUNTANTS, Accountant
from dpfy.plan.accounting.pld_rounding import MANY_LEAVES, dominating_gaussians, round_up
from dpfy.plan.accounting.rdp_conversion import delta_from_rdp, epsilon_from_rdp
from dpfy.plan.accounting.rdp_sampled_gaussian import sampled_gaussian_curves
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.train.ledger import BudgetExhausted, PrivacyLedger
from dpfy.train.step_record import StepRecord

dpa = pytest.importorskip("dp_accounting")
dpa_rdp = pytest.importorskip("dp_accounting.rdp")
dpa_pld = pytest.importorskip("dp_accounting.pld")
logging.getLogger("absl").setLevel(logging.ERROR)

DPA_ORDERS = np.array(dpa_rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=float)


def schedule(n: int, sigmas=(1.5, 0.7), rates=(1e-3, 0.02)) -> list[tuple[float, float]]:
    """(q, σ) of n steps: σ falls linearly while q grows geometrically, all distinct."""
    return list(
        zip(np.geomspace(*rates, n).tolist(), np.linspace(*sigmas, n).tolist(), strict=True)
    )


def ours(accountant, steps):
    for q, sigma in steps:
        accountant.compose(PoissonSampledEvent(q, GaussianEvent(sigma)))
    return accountant


def theirs(accountant, steps):
    for q, sigma in steps:
        accountant.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)))
    return accountant


def by_quadrature(q: float, sigma: float, alpha: float) -> float:
    """ε(α) of the sampled Gaussian straight from its defining integral (MTZ 2019, §3), with
    A_α − 1 = E[(1 + u)^α − 1 − αu], u = q·(e^{(2z−1)/(2σ²)} − 1), integrated directly so that
    values of A_α within 1e-9 of 1 keep their digits."""

    def integrand(z: float) -> float:
        u = q * math.expm1((2 * z - 1) / (2 * sigma**2))
        power, scale = alpha * math.log1p(u), -(z**2) / (2 * sigma**2) - math.log(sigma)
        if power > 50:  # the subtracted 1 + αu are below e^{-40} of (1 + u)^α here
            return math.exp(power + scale) / math.sqrt(2 * math.pi)
        return math.exp(scale) * (math.expm1(power) - alpha * u) / math.sqrt(2 * math.pi)

    peak = max(alpha, 2.0) + 1.0
    value, _ = integrate.quad(
        integrand,
        -40 * sigma,
        peak + 40 * sigma,
        points=[0.0, 0.5, peak],
        limit=500,
        epsabs=0,
        epsrel=1e-13,
    )
    return math.log1p(value) / (alpha - 1)


# -- RDP -----------------------------------------------------------------------------------------
def test_rdp_of_a_schedule_equals_dp_accounting_on_integer_orders():
    steps = schedule(40)
    integer = DPA_ORDERS[np.round(DPA_ORDERS) == DPA_ORDERS]
    got = ours(RdpAccountant(orders=integer), steps)
    expected = theirs(dpa_rdp.RdpAccountant(orders=list(integer)), steps)
    np.testing.assert_allclose(got.rdp, expected.rdp, rtol=1e-9)
    for delta in (1e-5, 1e-8):
        assert got.epsilon(delta) == pytest.approx(expected.get_epsilon(delta), rel=1e-9)


def test_rdp_of_a_schedule_is_never_above_dp_accounting_at_fractional_orders():
    # dp_accounting's fractional series stops a little high near α = 1 (by 5% at α = 1.1
    # here); ours is the defining integral (checked below), so it may only be lower.
    steps = schedule(40)
    got = ours(RdpAccountant(orders=DPA_ORDERS), steps)
    expected = theirs(dpa_rdp.RdpAccountant(orders=list(DPA_ORDERS)), steps)
    assert np.all(got.rdp <= expected.rdp * (1 + 1e-9))
    for delta in (1e-5, 1e-8):
        assert got.epsilon(delta) <= expected.get_epsilon(delta) * (1 + 1e-12)
        assert got.epsilon(delta) == pytest.approx(expected.get_epsilon(delta), rel=1e-4)


@pytest.mark.parametrize("alpha", [1.05, 1.5, 2.5, 4.4, 7.3, 10.9])
def test_batched_fractional_orders_match_the_defining_integral(alpha):
    steps = schedule(5, sigmas=(2.0, 0.6), rates=(1e-3, 0.3))
    q, sigma = (np.array(v) for v in zip(*steps, strict=True))
    curves = sampled_gaussian_curves(q, sigma, np.array([alpha]))[:, 0]
    expected = [by_quadrature(a, b, alpha) for a, b in steps]
    np.testing.assert_allclose(curves, expected, rtol=1e-9)


def test_a_batch_of_curves_equals_the_curves_one_at_a_time():
    steps = schedule(30, sigmas=(3.0, 0.5), rates=(1e-5, 0.5))
    q, sigma = (np.array(v) for v in zip(*steps, strict=True))
    orders = np.concatenate([DPA_ORDERS, [1.01, 20.5, 100.5]])
    batch = sampled_gaussian_curves(q, sigma, orders)
    for row, (a, b) in enumerate(steps):
        single = sampled_gaussian_curves(np.array([a]), np.array([b]), orders)[0]
        np.testing.assert_allclose(batch[row], single, rtol=1e-12)


def test_rdp_epsilon_from_a_few_orders_equals_the_whole_curve():
    accountant = ours(RdpAccountant(), schedule(200, sigmas=(4.0, 0.6)))
    accountant.compose(LaplaceEvent(30.0), 3).compose(PureDpEvent(0.05), 2)
    accountant.compose(SelfComposedEvent(GaussianEvent(40.0), 7))
    curve, orders = accountant.rdp, accountant.orders
    for delta in (1e-3, 1e-6, 1e-12, 1e-30):
        assert accountant.epsilon_details(delta) == epsilon_from_rdp(curve, orders, delta)
    for epsilon in (0.5, 2.0, 8.0, 40.0):
        assert accountant.delta_details(epsilon) == delta_from_rdp(curve, orders, epsilon)


def test_rdp_of_ten_thousand_distinct_steps_is_one_batch_not_ten_thousand_series():
    accountant = ours(RdpAccountant(), schedule(10_000))
    assert accountant.epsilon(1e-5) == pytest.approx(
        epsilon_from_rdp(accountant.rdp, accountant.orders, 1e-5).epsilon, rel=1e-12
    )


# -- PLD -----------------------------------------------------------------------------------------
@pytest.fixture
def few_leaves(monkeypatch):
    """Round up beyond 16 distinct leaves instead of MANY_LEAVES, so tests stay quick."""
    monkeypatch.setattr("dpfy.plan.accounting.pld.MANY_LEAVES", 16)
    monkeypatch.setattr("dpfy.plan.accounting.pld_compose.MANY_LEAVES", 16)


@pytest.mark.parametrize(
    ("rounded", "rel"), [(False, 0.01), (True, 0.015)]
)  # composed exactly; rounded up (each step then alone in its grid cell: the worst case)
def test_pld_of_a_schedule_agrees_with_dp_accounting(rounded, rel, request):
    if rounded:
        request.getfixturevalue("few_leaves")
    steps = schedule(40, sigmas=(1.2, 0.8), rates=(2e-3, 0.01))
    got = ours(PldAccountant(), steps)
    expected = theirs(dpa_pld.PLDAccountant(value_discretization_interval=1e-3), steps)
    for delta in (1e-5, 1e-7):
        assert got.epsilon(delta) == pytest.approx(expected.get_epsilon(delta), rel=rel)
        assert got.epsilon(delta) >= 0.99 * expected.get_epsilon(delta)


def test_rounding_many_distinct_steps_never_lowers_epsilon_and_costs_little(few_leaves):
    steps = schedule(60, sigmas=(1.2, 0.8), rates=(2e-3, 0.01))
    rounded = ours(PldAccountant(), steps)
    # A resolution of 1e-12 rounds nothing away: the slow, exact composition of every step.
    exact = ours(PldAccountant(precision=PldPrecision(rounding_resolution=1e-12)), steps)
    for delta in (1e-5, 1e-9):
        e_rounded, e_exact = rounded.epsilon(delta), exact.epsilon(delta)
        assert e_exact <= e_rounded <= e_exact * 1.015


def test_rounding_dominates_each_step_and_keeps_a_fixed_coordinate_exact():
    resolution = 2**-8
    leaves = {(1 / sigma, 0.004): 1 for _, sigma in schedule(3 * MANY_LEAVES)}
    rounded = dominating_gaussians(leaves, resolution)
    assert {q for _, q in rounded} == {0.004}  # the rate never varied: left exact
    assert sum(rounded.values()) == len(leaves) and len(rounded) < len(leaves)
    for mu, _ in leaves:
        up = round_up(mu, resolution)
        assert mu <= up <= mu * (1 + resolution) * (1 + 1e-12)
        assert (up, 0.004) in rounded


def test_unsampled_gaussians_merge_exactly_into_one():
    sigmas = np.linspace(5.0, 9.0, 2 * MANY_LEAVES)
    merged = dominating_gaussians({(1 / s, 1.0): 2 for s in sigmas}, 2**-8)
    assert list(merged.values()) == [1]
    ((mu, q),) = merged
    assert q == 1.0 and mu == pytest.approx(math.sqrt(np.sum(2 / sigmas**2)), rel=1e-12)


# -- the budget guard ----------------------------------------------------------------------------
def step_records(n: int, sigmas=(1.6, 0.8), q=0.01) -> list[StepRecord]:
    return [
        StepRecord(SamplingRecord(SamplingKind.POISSON, q, 10_000), float(sigma))
        for sigma in np.linspace(*sigmas, n)
    ]


def walk(ledger: PrivacyLedger, steps: list[StepRecord]) -> int | None:
    """Check and record each step; the index of the first refused one, if any."""
    for i, step in enumerate(steps):
        try:
            ledger.check_step(step)
        except BudgetExhausted:
            return i
        ledger.record(step)
    return None


@pytest.mark.parametrize(("name", "rounded"), [("rdp", False), ("pld", False), ("pld", True)])
def test_guard_refuses_exactly_the_step_that_crosses_a_target_on_a_schedule(name, rounded, request):
    if rounded:
        request.getfixturevalue("few_leaves")
    n = 300 if name == "rdp" else 60
    steps = step_records(n)
    stop = n - 7
    reference = PrivacyLedger(1e-5, accountant=name)
    for step in steps[:stop]:
        reference.record(step)
    target = reference.epsilon()  # reachable exactly: the guard must allow it, no further
    ledger = PrivacyLedger(1e-5, accountant=name, target_epsilon=target)
    assert walk(ledger, steps) == stop
    assert ledger.epsilon() == target


class CountingRdp(RdpAccountant):
    """The RDP accountant, counting the ε queries made of fresh instances."""

    name = "counting-rdp"
    queries = 0

    def _epsilon(self, delta: float) -> float:
        type(self).queries += 1
        return super()._epsilon(delta)


def test_rdp_guard_answers_from_its_running_curve():
    ACCOUNTANTS[CountingRdp.name] = CountingRdp
    try:
        steps = step_records(2000)
        ledger = PrivacyLedger(1e-5, accountant=CountingRdp.name, target_epsilon=1.0)
        CountingRdp.queries = 0
        refused = walk(ledger, steps)
        assert refused is not None and 100 < refused < 2000
        assert CountingRdp.queries <= 2  # the refusal's message, and a tie at most
    finally:
        del ACCOUNTANTS[CountingRdp.name]


class Linear(Accountant):
    """Test-only basic composition: a sampled Gaussian step costs q/σ, a pure-DP release its ε;
    counts its queries."""

    name = "linear"
    queries = 0

    def unsupported_reason(self, event):
        return None

    def _cost(self, event) -> float:
        if isinstance(event, PoissonSampledEvent):
            return event.sampling_rate / event.event.noise_multiplier
        return event.epsilon if isinstance(event, PureDpEvent) else 0.0

    def _epsilon(self, delta: float) -> float:
        type(self).queries += 1
        return sum(count * self._cost(event) for event, count in self._composed)

    def _delta(self, epsilon: float) -> float:
        return 0.0


def test_certificates_cover_a_schedule_with_few_queries():
    ACCOUNTANTS[Linear.name] = Linear
    try:
        steps = step_records(5000, sigmas=(1.6, 0.8), q=0.01)
        target = 0.99 * sum(s.sampling.sampling_rate / s.noise_multiplier for s in steps)
        ledger = PrivacyLedger(1e-5, accountant=Linear.name, target_epsilon=target)
        Linear.queries = 0
        refused = walk(ledger, steps)
        assert refused is not None and ledger.epsilon() <= target
        assert Linear.queries < 5000 / 20  # one query per 20 steps at most, over the whole run
    finally:
        del ACCOUNTANTS[Linear.name]


def test_a_labelled_release_ends_the_certificate():
    ACCOUNTANTS[Linear.name] = Linear
    try:
        steps = step_records(200, q=0.01)
        ledger = PrivacyLedger(1e-5, accountant=Linear.name, target_epsilon=10.0)
        walk(ledger, steps[:50])
        assert ledger._certificate is not None
        ledger.record_event(PureDpEvent(9.0), label="tuning")
        assert ledger._certificate is None
        assert walk(ledger, steps[50:]) is not None  # the release leaves room for few steps
        assert ledger.epsilon() <= 10.0
    finally:
        del ACCOUNTANTS[Linear.name]


def test_make_accountant_still_builds_the_real_ones():
    assert isinstance(make_accountant("pld"), PldAccountant)
    assert isinstance(make_accountant("rdp").for_bound(), RdpAccountant)
    assert make_accountant("pld").for_bound().precision.round_always
