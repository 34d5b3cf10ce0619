"""The RDP accountant against dp_accounting (live oracle), quadrature and published numbers."""

from __future__ import annotations

import logging
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, special

from dpfy.plan.accounting import make_accountant
from dpfy.plan.accounting.accountant import UnsupportedEventError
from dpfy.plan.accounting.events import (
    ComposedEvent,
    FixedSizeSampledEvent,
    GaussianEvent,
    LaplaceEvent,
    NeighbouringRelation,
    NoOpEvent,
    PoissonSampledEvent,
    PureDpEvent,
    RepeatAndSelectEvent,
    SelfComposedEvent,
    dpsgd_event,
)
from dpfy.plan.accounting.rdp import GridEdgeWarning, RdpAccountant
from dpfy.plan.accounting.rdp_composition import DEFAULT_ORDERS, rdp_curve
from dpfy.plan.accounting.rdp_conversion import RdpEpsilon, delta_from_rdp, epsilon_from_rdp

dpa = pytest.importorskip("dp_accounting")
dpa_rdp = pytest.importorskip("dp_accounting.rdp")
from dp_accounting import dp_event as dpa_events  # noqa: E402

logging.getLogger("absl").setLevel(logging.ERROR)  # the oracle logs its own series' failures

ADD = NeighbouringRelation.ADD_OR_REMOVE
REPLACE = NeighbouringRelation.REPLACE_ONE
DPA_ORDERS = dpa_rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS


# -- helpers -------------------------------------------------------------------------------------
def ours(event, delta: float, relation=ADD, orders=None) -> float:
    """dpfy's RDP ε, with grid-edge warnings silenced (tested on their own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GridEdgeWarning)
        return RdpAccountant(relation, orders=orders).compose(event).epsilon(delta)


def oracle_accountant(event, relation=None, orders=None):
    """dp_accounting's RDP accountant with ``event`` composed."""
    relation = relation or dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    kwargs = {"neighboring_relation": relation}
    if orders is not None:
        kwargs["orders"] = orders
    accountant = dpa_rdp.RdpAccountant(**kwargs)
    accountant.compose(event)
    return accountant


def oracle_dpsgd(q: float, sigma: float, steps: int):
    """The same DP-SGD run as dp_accounting events."""
    sampled = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
    return dpa.SelfComposedDpEvent(sampled, steps)


def sampled_gaussian_by_quadrature(q: float, sigma: float, alpha: float) -> float:
    """ε(α) of the sampled Gaussian straight from its defining integral (MTZ 2019, §3)."""

    def integrand(z: float) -> float:
        ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * sigma**2))
        return math.exp(-(z**2) / (2 * sigma**2) + alpha * ratio) / (sigma * math.sqrt(2 * math.pi))

    peak = alpha + 1.0
    value, _ = integrate.quad(
        integrand, -40 * sigma, peak + 40 * sigma, points=[0.0, 0.5, peak], limit=500, epsabs=0
    )
    return math.log(value) / (alpha - 1)


# -- published sanity numbers, each beside the live oracle ---------------------------------------
def test_guide_appendix_c_one_epoch():
    event = dpsgd_event(5000 / 1e6, 1.0, 200)
    expected = oracle_accountant(oracle_dpsgd(5000 / 1e6, 1.0, 200)).get_epsilon(1e-6)
    assert ours(event, 1e-6) == pytest.approx(expected, rel=1e-3)
    assert ours(event, 1e-6) == pytest.approx(1.2173, rel=0.01)


def test_tf_privacy_statement_example():
    # N = 10 000, B = 64, 5 epochs: ceil(5·10000/64) = 782 steps at q = 0.0064. The published
    # ε ≈ 1.616 at δ = 1e-6 is the σ = 1.0 run; σ = 2 is checked against the oracle alone.
    steps = math.ceil(5 * 10_000 / 64)
    assert steps == 782
    for sigma in (1.0, 2.0):
        expected = oracle_accountant(oracle_dpsgd(64 / 10_000, sigma, steps)).get_epsilon(1e-6)
        assert ours(dpsgd_event(64 / 10_000, sigma, steps), 1e-6) == pytest.approx(
            expected, rel=1e-3
        )
    assert ours(dpsgd_event(64 / 10_000, 1.0, steps), 1e-6) == pytest.approx(1.616, rel=0.01)


# -- DP-SGD against dp_accounting ----------------------------------------------------------------
TYPICAL_SETTINGS = [
    # (q, σ, steps, δ): ε from about 0.03 to 30, optimal orders from 2 to 256
    (1e-4, 0.6, 10, 1e-7),
    (1e-4, 1.0, 1_000, 1e-6),
    (1e-4, 2.0, 100_000, 1e-5),
    (1e-4, 5.0, 10_000, 1e-6),
    (3e-4, 0.8, 50_000, 1e-5),
    (1e-3, 0.6, 1_000, 1e-6),
    (1e-3, 0.6, 100_000, 1e-5),
    (1e-3, 1.0, 10, 1e-7),
    (1e-3, 1.0, 100_000, 1e-5),
    (1e-3, 2.0, 1_000, 1e-6),
    (1e-3, 5.0, 100_000, 1e-5),
    (4e-3, 1.5, 20_000, 1e-6),
    (1e-2, 0.6, 10, 1e-7),
    (1e-2, 0.6, 1_000, 1e-6),
    (1e-2, 1.0, 1_000, 1e-6),
    (1e-2, 1.0, 100_000, 1e-5),
    (1e-2, 2.0, 10, 1e-7),
    (1e-2, 2.0, 100_000, 1e-5),
    (1e-2, 5.0, 100_000, 1e-5),
    (3e-2, 1.2, 5_000, 1e-6),
    (0.1, 0.6, 10, 1e-7),
    (0.1, 1.0, 1_000, 1e-6),
    (0.1, 2.0, 10, 1e-7),
    (0.1, 2.0, 1_000, 1e-6),
    (0.1, 5.0, 1_000, 1e-6),
    (0.1, 5.0, 5_000, 1e-5),
]


@pytest.mark.parametrize(("q", "sigma", "steps", "delta"), TYPICAL_SETTINGS)
def test_dpsgd_epsilon_within_one_percent_of_dp_accounting(q, sigma, steps, delta):
    expected = oracle_accountant(oracle_dpsgd(q, sigma, steps)).get_epsilon(delta)
    assert ours(dpsgd_event(q, sigma, steps), delta) == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize(("q", "sigma", "steps"), [(0.1, 1.0, 100_000), (0.1, 5.0, 20_000)])
def test_fractional_optimum_is_tighter_than_dp_accounting_and_matches_quadrature(q, sigma, steps):
    # When the best order is fractional and q is large, dp_accounting's fractional series
    # overestimates (by 1.5% at q = 0.1, σ = 5, α = 2.6); ours must never exceed it, and must
    # equal the defining integral at the orders involved.
    details = RdpAccountant().compose(dpsgd_event(q, sigma, steps)).epsilon_details(1e-5)
    assert details.epsilon <= oracle_accountant(oracle_dpsgd(q, sigma, steps)).get_epsilon(1e-5)
    for alpha in (details.order, 1.05, 1.3):
        curve = rdp_curve(PoissonSampledEvent(q, GaussianEvent(sigma)), ADD, [alpha])
        assert curve[0] == pytest.approx(sampled_gaussian_by_quadrature(q, sigma, alpha), rel=1e-9)


@pytest.mark.parametrize(("q", "sigma"), [(1e-3, 0.8), (0.01, 1.0), (0.05, 2.0), (0.1, 0.6)])
def test_sampled_gaussian_curve_matches_dp_accounting_at_shared_orders(q, sigma):
    orders = np.array([2.0, 3.0, 5.0, 7.7, 10.5, 16.0, 32.0, 63.0, 128.0, 1024.0])
    expected = oracle_accountant(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), orders=orders
    ).rdp
    got = rdp_curve(PoissonSampledEvent(q, GaussianEvent(sigma)), ADD, orders)
    integer = orders == np.round(orders)
    np.testing.assert_allclose(got[integer], expected[integer], rtol=1e-9)
    # At fractional orders the oracle's series is truncated a little high (see the quadrature
    # tests): ours may sit slightly below it, never above.
    np.testing.assert_allclose(got[~integer], expected[~integer], rtol=1e-4)
    assert np.all(got[~integer] <= expected[~integer] * (1 + 1e-12))


@pytest.mark.parametrize(
    ("q", "sigma", "alpha"),
    [(0.01, 1.0, 1.1), (0.01, 1.0, 2.5), (0.1, 0.6, 1.05), (0.1, 0.6, 1.5), (0.3, 2.0, 4.4),
     (0.49, 1.0, 1.05), (0.5, 1.0, 2.5), (0.9, 2.0, 1.1), (1e-3, 5.0, 7.3), (0.1, 5.0, 2.6)],
)  # fmt: skip
def test_fractional_orders_match_the_defining_integral(q, sigma, alpha):
    # Tight enough to notice a series cut after a few hundred terms (slow tails near q = 1/2).
    got = rdp_curve(PoissonSampledEvent(q, GaussianEvent(sigma)), ADD, [alpha])[0]
    assert got == pytest.approx(sampled_gaussian_by_quadrature(q, sigma, alpha), rel=1e-10)


def test_fractional_orders_never_above_dp_accounting():
    # dp_accounting's own fractional values are upper bounds; ours are the exact integral.
    orders = np.array([1.1, 1.5, 2.5, 3.3, 6.6, 10.9])
    for q, sigma in [(0.01, 1.0), (0.1, 0.6), (0.9, 2.0)]:
        expected = oracle_accountant(
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), orders=orders
        ).rdp
        got = rdp_curve(PoissonSampledEvent(q, GaussianEvent(sigma)), ADD, orders)
        finite = np.isfinite(expected)
        assert np.all(got[finite] <= expected[finite] * (1 + 1e-9))


@pytest.mark.parametrize(("q", "sigma"), [(1e-6, 50.0), (1e-8, 50.0), (1e-4, 1000.0)])
def test_tiny_q_large_sigma_is_accurate_at_every_order(q, sigma):
    # For z₀ ≫ α the exact A_α − 1 is Σ_{k≥2} C(α,k)(1−q)^{α−k}q^k·expm1((k²−k)/2σ²), whose
    # first terms suffice at tiny q. A_α is within 1e-16 of 1 here, so a series that sums A_α
    # itself rather than A_α − 1 loses most digits at q = 1e-8.
    orders = np.array(DEFAULT_ORDERS)
    k = np.arange(2, 8, dtype=float)[None, :]
    alpha = orders[:, None]
    binom = special.binom(alpha, k)
    terms = binom * (1 - q) ** (alpha - k) * q**k * np.expm1((k * k - k) / (2 * sigma**2))
    expected = np.log1p(terms.sum(axis=1)) / (orders - 1)
    curve = rdp_curve(PoissonSampledEvent(q, GaussianEvent(sigma)), ADD, orders)
    np.testing.assert_allclose(curve, expected, rtol=1e-6)


@pytest.mark.parametrize(("q", "sigma"), [(1e-4, 0.6), (0.02, 1.0), (0.3, 0.7), (0.7, 3.0)])
def test_sampled_gaussian_curve_is_nondecreasing_in_the_order(q, sigma):
    curve = rdp_curve(PoissonSampledEvent(q, GaussianEvent(sigma)), ADD)
    assert np.all(np.isfinite(curve)) and np.all(curve >= 0)
    assert np.all(np.diff(curve) >= -1e-12 * curve[1:])


def test_q_one_is_the_plain_gaussian():
    orders = np.array(DEFAULT_ORDERS)
    np.testing.assert_allclose(
        rdp_curve(PoissonSampledEvent(1.0, GaussianEvent(1.5)), ADD, orders),
        rdp_curve(GaussianEvent(1.5), ADD, orders),
    )


# -- relations -----------------------------------------------------------------------------------
def test_replace_one_gaussian_equals_add_or_remove_at_half_sigma():
    np.testing.assert_allclose(
        rdp_curve(GaussianEvent(3.0), REPLACE), rdp_curve(GaussianEvent(1.5), ADD)
    )
    assert ours(GaussianEvent(3.0), 1e-6, REPLACE) == pytest.approx(ours(GaussianEvent(1.5), 1e-6))


def test_zero_out_accounts_poisson_sampling_like_add_or_remove():
    event = dpsgd_event(0.01, 1.0, 500)
    assert ours(event, 1e-6, NeighbouringRelation.ZERO_OUT) == ours(event, 1e-6)


def test_poisson_sampling_refused_under_replace_one():
    accountant = RdpAccountant(REPLACE)
    with pytest.raises(UnsupportedEventError, match="add-or-remove") as error:
        accountant.compose(dpsgd_event(0.01, 1.0, 10))
    assert "FixedSizeSampledEvent" in str(error.value)
    assert not accountant.supports(PoissonSampledEvent(0.01, GaussianEvent(1.0)))


def test_mixing_relations_refused():
    accountant = RdpAccountant(ADD)
    with pytest.raises(ValueError, match="relation mismatch"):
        accountant.compose(GaussianEvent(1.0), relation=REPLACE)
    accountant.compose(GaussianEvent(1.0), relation="add-or-remove")  # same relation is fine


def test_poisson_sampling_of_non_gaussian_refused_with_reason():
    with pytest.raises(UnsupportedEventError, match="LaplaceEvent"):
        RdpAccountant().compose(PoissonSampledEvent(0.1, LaplaceEvent(1.0)))


def test_fixed_size_sampling_refused_outside_replace_one():
    event = FixedSizeSampledEvent(1000, 10, GaussianEvent(1.0))
    for relation in (ADD, NeighbouringRelation.ZERO_OUT):
        with pytest.raises(UnsupportedEventError, match="replace-one"):
            RdpAccountant(relation).compose(event)


# -- sampling without replacement ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "m", "sigma", "steps"),
    [(1000, 10, 2.0, 100), (60_000, 256, 1.1, 2000), (10**6, 5000, 1.0, 200), (100, 50, 1.0, 10),
     (10_000, 100, 4.0, 1000)],
)  # fmt: skip
def test_fixed_size_sampling_against_dp_accounting(n, m, sigma, steps):
    # dp_accounting's σ is relative to the replace-one sensitivity; dpfy's to Δ (rule 5), and
    # replace-one doubles it: dpfy σ ↔ dp_accounting σ/2. dp_accounting adds a Gaussian-specific
    # refinement (WBK 2019, Thm. 27) to Thm. 9, so ours is never tighter and stays close.
    event = SelfComposedEvent(FixedSizeSampledEvent(n, m, GaussianEvent(sigma)), steps)
    inner = dpa.SampledWithoutReplacementDpEvent(n, m, dpa.GaussianDpEvent(sigma / 2))
    expected = oracle_accountant(
        dpa.SelfComposedDpEvent(inner, steps), dpa.NeighboringRelation.REPLACE_ONE
    ).get_epsilon(1e-5)
    got = ours(event, 1e-5, REPLACE)
    assert expected * (1 - 1e-9) <= got <= expected * 1.05


def test_fixed_size_curve_equals_theorem_9_where_it_binds():
    # Large orders (and order 2) use Theorem 9 in both libraries: the curves agree there.
    orders = np.array([2.0, 2.5, 128.0, 256.0, 512.0, 1024.0])
    inner = dpa.SampledWithoutReplacementDpEvent(10_000, 100, dpa.GaussianDpEvent(2.0))
    expected = oracle_accountant(inner, dpa.NeighboringRelation.REPLACE_ONE, orders).rdp
    got = rdp_curve(FixedSizeSampledEvent(10_000, 100, GaussianEvent(4.0)), REPLACE, orders)
    np.testing.assert_allclose(got[[0, 2, 3, 4, 5]], expected[[0, 2, 3, 4, 5]], rtol=1e-9)
    # Order 2.5 interpolates orders 2 and 3, where the oracle's Thm. 27 is a little tighter.
    assert expected[1] * (1 - 1e-9) <= got[1] <= expected[1] * 1.01


def test_fixed_size_fractional_orders_lie_on_the_convex_chord():
    event = FixedSizeSampledEvent(5000, 50, GaussianEvent(1.0))
    low, mid, high = rdp_curve(event, REPLACE, [3.0, 3.4, 4.0])
    assert 2.4 * mid == pytest.approx(0.6 * 2 * low + 0.4 * 3 * high)


def test_full_batch_without_replacement_is_the_inner_mechanism():
    np.testing.assert_allclose(
        rdp_curve(FixedSizeSampledEvent(100, 100, GaussianEvent(2.0)), REPLACE),
        rdp_curve(GaussianEvent(2.0), REPLACE),
    )


# -- randomised number of tuning trials ----------------------------------------------------------
APP_C_EPOCH = dpsgd_event(0.005, 1.0, 200)
APP_C_EPOCH_ORACLE = oracle_dpsgd(0.005, 1.0, 200)


@pytest.mark.parametrize(
    ("distribution", "shape", "oracle_shape", "published"),
    [
        ("poisson", None, math.inf, 1.721),
        ("geometric", None, 1.0, 2.030),
        ("truncated-negative-binomial", 0.5, 0.5, None),
        ("logarithmic", None, 0.0, None),
        ("truncated-negative-binomial", 3.0, 3.0, None),
    ],
)
def test_repeat_and_select_against_dp_accounting(distribution, shape, oracle_shape, published):
    event = RepeatAndSelectEvent(APP_C_EPOCH, 10, distribution, shape)
    oracle_event = dpa_events.RepeatAndSelectDpEvent(APP_C_EPOCH_ORACLE, 10, oracle_shape)
    expected = oracle_accountant(oracle_event).get_epsilon(1e-6)
    got = ours(event, 1e-6)
    assert got == pytest.approx(expected, rel=1e-3)
    if published is not None:
        assert got == pytest.approx(published, rel=0.01)


def test_truncated_negative_binomial_is_continuous_at_shape_zero():
    near_zero = ours(
        RepeatAndSelectEvent(APP_C_EPOCH, 10, "truncated-negative-binomial", 1e-9), 1e-6
    )
    logarithmic = ours(RepeatAndSelectEvent(APP_C_EPOCH, 10, "logarithmic"), 1e-6)
    negative = ours(
        RepeatAndSelectEvent(APP_C_EPOCH, 10, "truncated-negative-binomial", -0.5), 1e-6
    )
    assert near_zero == pytest.approx(logarithmic, rel=1e-6)
    assert ours(APP_C_EPOCH, 1e-6) < negative < logarithmic


def test_more_trials_cost_more():
    costs = [
        ours(RepeatAndSelectEvent(APP_C_EPOCH, mean, "geometric"), 1e-6) for mean in (2, 10, 100)
    ]
    assert costs == sorted(costs) and costs[0] > ours(APP_C_EPOCH, 1e-6)


# -- leaf mechanisms -----------------------------------------------------------------------------
def test_laplace_against_dp_accounting():
    orders = np.array([1.5, 2.0, 4.5, 32.0, 1024.0])
    expected = oracle_accountant(dpa.LaplaceDpEvent(2.0), orders=orders).rdp
    np.testing.assert_allclose(rdp_curve(LaplaceEvent(2.0), ADD, orders), expected, rtol=1e-9)
    np.testing.assert_allclose(
        rdp_curve(LaplaceEvent(4.0), REPLACE, orders), expected, rtol=1e-9
    )  # replace-one doubles the ℓ₁ sensitivity


@pytest.mark.parametrize("eps", [0.01, 0.5, 1.0, 3.0, 10.0])
def test_pure_dp_bound_is_sound_and_tight(eps):
    orders = np.array(DEFAULT_ORDERS)
    pure = rdp_curve(PureDpEvent(eps), ADD, orders)
    assert np.all(pure <= np.minimum(eps, orders * eps**2 / 2) * (1 + 1e-12))
    # Laplace of scale 1/ε is ε-DP, so its RDP can never exceed the worst case over ε-DP pairs.
    assert np.all(rdp_curve(LaplaceEvent(1 / eps), ADD, orders) <= pure * (1 + 1e-9) + 1e-15)
    # ... and randomised response with odds e^ε attains it, so it cannot be lowered.
    p, log_p, log_1mp = special.expit(eps), -np.logaddexp(0, -eps), -np.logaddexp(0, eps)
    assert 0 < p < 1
    rr = np.logaddexp(
        orders * log_p + (1 - orders) * log_1mp, orders * log_1mp + (1 - orders) * log_p
    ) / (orders - 1)
    np.testing.assert_allclose(pure, rr, rtol=1e-9, atol=1e-15)


def test_composition_sums_and_multiplies_curves():
    a, b = dpsgd_event(0.01, 1.0, 3), LaplaceEvent(5.0)
    orders = np.array(DEFAULT_ORDERS)
    np.testing.assert_allclose(
        rdp_curve(ComposedEvent((a, b, NoOpEvent())), ADD, orders),
        rdp_curve(a, ADD, orders) + rdp_curve(b, ADD, orders),
    )
    np.testing.assert_allclose(
        rdp_curve(a, ADD, orders), 3 * rdp_curve(a.event, ADD, orders), rtol=1e-12
    )
    accountant = RdpAccountant().compose(a.event, 2).compose(b).compose(a.event)
    np.testing.assert_allclose(accountant.rdp, rdp_curve(ComposedEvent((a, b)), ADD, orders))


def test_nothing_private_costs_nothing():
    accountant = RdpAccountant()
    assert accountant.epsilon(1e-6) == 0.0
    accountant.compose(NoOpEvent(), 5).compose(SelfComposedEvent(GaussianEvent(1.0), 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GridEdgeWarning)
        assert accountant.epsilon(1e-6) == 0.0
        assert accountant.delta(0.5) == 0.0


# -- conversion ----------------------------------------------------------------------------------
def test_conversion_beats_the_classic_bound_and_matches_dp_accounting():
    orders = np.array(DPA_ORDERS, dtype=float)
    curve = rdp_curve(dpsgd_event(0.02, 1.1, 3000), ADD, orders)
    classic = np.min(curve + math.log(1e6) / (orders - 1))
    details = epsilon_from_rdp(curve, orders, 1e-6)
    assert details.epsilon < classic
    expected_eps, expected_order = dpa_rdp.rdp_privacy_accountant.compute_epsilon(
        orders, curve, 1e-6
    )
    assert details.epsilon == pytest.approx(expected_eps, rel=1e-9)
    assert details.order == expected_order
    expected_delta, _ = dpa_rdp.rdp_privacy_accountant.compute_delta(orders, curve, 2.0)
    assert delta_from_rdp(curve, orders, 2.0).delta == pytest.approx(expected_delta, rel=1e-6)


def test_epsilon_details_reports_the_order():
    accountant = RdpAccountant().compose(APP_C_EPOCH)
    details = accountant.epsilon_details(1e-6)
    assert isinstance(details, RdpEpsilon)
    assert details.delta == 1e-6 and not details.on_grid_edge
    assert details.order in accountant.orders
    assert details.epsilon == accountant.epsilon(1e-6)


def test_grid_edge_warning_names_the_order():
    accountant = RdpAccountant().compose(dpsgd_event(1e-5, 20.0, 10))
    with pytest.warns(GridEdgeWarning, match="1024") as record:
        details = accountant.epsilon_details(1e-5)
    assert details.on_grid_edge and details.order == 1024
    assert "wider grid" in str(record[0].message)
    wide = RdpAccountant(orders=[*DEFAULT_ORDERS, 4096, 16384, 65536]).compose(
        dpsgd_event(1e-5, 20.0, 10)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GridEdgeWarning)
        assert wide.epsilon(1e-5) < details.epsilon


def test_no_warning_in_the_typical_regime():
    with warnings.catch_warnings():
        warnings.simplefilter("error", GridEdgeWarning)
        RdpAccountant().compose(APP_C_EPOCH).epsilon(1e-6)


def test_default_grid_is_a_superset_of_dp_accounting():
    assert np.all(np.isin(np.array(DPA_ORDERS, dtype=float), np.array(DEFAULT_ORDERS)))


def test_registered_under_its_name():
    accountant = make_accountant("rdp", "replace-one")
    assert isinstance(accountant, RdpAccountant) and accountant.relation is REPLACE


# -- properties ----------------------------------------------------------------------------------
q_values = st.sampled_from([1e-4, 5e-4, 1e-3, 4e-3, 0.01, 0.03, 0.1])
sigma_values = st.sampled_from([0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0])
step_values = st.integers(min_value=1, max_value=100_000)
delta_values = st.sampled_from([1e-7, 1e-6, 1e-5])


@settings(max_examples=30, deadline=None)
@given(
    q=q_values, sigma=sigma_values, steps=step_values, extra=st.integers(1, 1000), d=delta_values
)
def test_epsilon_grows_with_steps(q, sigma, steps, extra, d):
    assert ours(dpsgd_event(q, sigma, steps), d) <= ours(dpsgd_event(q, sigma, steps + extra), d)


@settings(max_examples=30, deadline=None)
@given(q1=q_values, q2=q_values, sigma=sigma_values, steps=step_values, d=delta_values)
def test_epsilon_grows_with_sampling_rate(q1, q2, sigma, steps, d):
    low, high = sorted((q1, q2))
    assert ours(dpsgd_event(low, sigma, steps), d) <= ours(dpsgd_event(high, sigma, steps), d) * (
        1 + 1e-12
    )


@settings(max_examples=30, deadline=None)
@given(q=q_values, s1=sigma_values, s2=sigma_values, steps=step_values, d=delta_values)
def test_epsilon_shrinks_with_noise(q, s1, s2, steps, d):
    low, high = sorted((s1, s2))
    assert ours(dpsgd_event(q, high, steps), d) <= ours(dpsgd_event(q, low, steps), d) * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(q=q_values, sigma=sigma_values, steps=step_values, d=st.floats(1e-12, 0.5))
def test_delta_of_epsilon_round_trips(q, sigma, steps, d):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GridEdgeWarning)
        accountant = RdpAccountant().compose(dpsgd_event(q, sigma, steps))
        assert accountant.delta(accountant.epsilon(d)) <= d * (1 + 1e-9)


# -- input validation ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: GaussianEvent(0.0), "noise_multiplier"),
        (lambda: GaussianEvent(-1.0), "noise_multiplier"),
        (lambda: dpsgd_event(0.0, 1.0, 10), "sampling_rate"),
        (lambda: dpsgd_event(1.5, 1.0, 10), "sampling_rate"),
        (lambda: dpsgd_event(float("nan"), 1.0, 10), "sampling_rate"),
        (lambda: dpsgd_event(0.01, float("nan"), 10), "noise_multiplier"),
        (lambda: dpsgd_event(0.01, 1.0, -3), "steps"),
        (lambda: RdpAccountant().compose(GaussianEvent(1.0), -1), "count"),
        (lambda: RdpAccountant().compose(GaussianEvent(1.0)).epsilon(0.0), "delta"),
        (lambda: RdpAccountant().compose(GaussianEvent(1.0)).epsilon(1.0), "delta"),
        (lambda: RdpAccountant().compose(GaussianEvent(1.0)).epsilon(float("nan")), "delta"),
        (lambda: RdpAccountant().compose(GaussianEvent(1.0)).epsilon_details(2.0), "delta"),
        (lambda: RdpAccountant().compose(GaussianEvent(1.0)).delta(-1.0), "epsilon"),
        (lambda: RdpAccountant().compose(GaussianEvent(1.0)).delta_details(math.inf), "epsilon"),
        (lambda: RdpAccountant(orders=[0.5, 2.0]), "orders"),
        (lambda: RdpAccountant(orders=[1.0]), "orders"),
        (lambda: RdpAccountant(orders=[2.0, float("nan")]), "orders"),
        (lambda: RdpAccountant(orders=[]), "orders"),
        (lambda: rdp_curve(GaussianEvent(1.0), "sideways"), "relation"),
        (lambda: epsilon_from_rdp([1.0, -1.0], [2.0, 3.0], 1e-5), "rdp"),
        (lambda: epsilon_from_rdp([1.0], [2.0, 3.0], 1e-5), "rdp"),
    ],
)
def test_bad_input_names_the_parameter(build, name):
    with pytest.raises(ValueError, match=name):
        build()


def test_sampled_gaussian_helper_uses_log_space_for_huge_orders():
    # Order 1024 with small σ: terms like e^{k²/2σ²} overflow doubles unless kept in logs.
    curve = rdp_curve(PoissonSampledEvent(0.1, GaussianEvent(0.6)), ADD, [1024.0])
    assert np.isfinite(curve[0]) and curve[0] > 0
    log_sum = special.logsumexp(
        [math.log(special.comb(1024, 1024, exact=False)) + 1024 * math.log(0.1)
         + (1024**2 - 1024) / (2 * 0.36)]
    )  # fmt: skip
    assert curve[0] >= log_sum / 1023  # at least the k = α term of the expansion
