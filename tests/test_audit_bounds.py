"""The classical audit's statistics: Clopper–Pearson intervals and the hypothesis-testing bound."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from dpfy.audit.bounds import (
    best_threshold_bound,
    classical_ceiling,
    classical_epsilon_lower_bound,
    clopper_pearson,
    clopper_pearson_lower,
    clopper_pearson_upper,
    epsilon_from_rates,
)
from dpfy.audit.result import AuditResult


@pytest.mark.parametrize(
    ("k", "n", "confidence"),
    [(0, 10, 0.95), (3, 10, 0.95), (10, 10, 0.9), (1, 1000, 0.99), (517, 1000, 0.95)],
)
def test_clopper_pearson_equals_the_beta_quantiles(k, n, confidence):
    tail = (1 - confidence) / 2
    low, high = clopper_pearson(k, n, confidence)
    want_low = 0.0 if k == 0 else stats.beta.ppf(tail, k, n - k + 1)
    want_high = 1.0 if k == n else stats.beta.ppf(1 - tail, k + 1, n - k)
    assert low == pytest.approx(want_low, rel=1e-10, abs=1e-15)
    assert high == pytest.approx(want_high, rel=1e-10)


@pytest.mark.parametrize(("k", "n"), [(2, 20), (50, 400), (7, 7000)])
def test_clopper_pearson_ends_are_where_the_binomial_tails_equal_the_error(k, n):
    low, high = clopper_pearson(k, n, 0.9)
    assert stats.binom.cdf(k, n, high) == pytest.approx(0.05, rel=1e-8)
    assert stats.binom.sf(k - 1, n, low) == pytest.approx(0.05, rel=1e-8)


def test_clopper_pearson_of_no_successes_has_the_closed_form_upper_end():
    # P[Bin(10, p) = 0] = (1 − p)^10 = 0.025  ⇒  p = 1 − 0.025^(1/10).
    assert clopper_pearson(0, 10, 0.95) == pytest.approx((0.0, 1 - 0.025 ** (1 / 10)))


def test_one_sided_bounds_spend_the_whole_error_on_one_side():
    assert clopper_pearson_upper(3, 50, 0.95) == pytest.approx(stats.beta.ppf(0.95, 4, 47))
    assert clopper_pearson_lower(3, 50, 0.95) == pytest.approx(stats.beta.ppf(0.05, 3, 48))
    assert clopper_pearson_upper(3, 50, 0.95) < clopper_pearson(3, 50, 0.95)[1]


@pytest.mark.parametrize(
    ("args", "match"),
    [((5, 4, 0.95), "cannot exceed"), ((1, 4, 1.0), "confidence"), ((-1, 4, 0.9), "whole")],
)
def test_clopper_pearson_refuses_impossible_counts_and_confidences(args, match):
    with pytest.raises(ValueError, match=match):
        clopper_pearson(*args)


def test_epsilon_from_rates_inverts_the_hypothesis_testing_region():
    fpr, fnr, delta = 0.01, 0.3, 1e-5
    eps = epsilon_from_rates(fpr, fnr, delta)
    assert eps == pytest.approx(math.log((1 - delta - fnr) / fpr))
    # The (ε, δ) region's boundary: α + e^ε β ≥ 1 − δ is tight on the larger side.
    assert fpr * math.exp(eps) + fnr == pytest.approx(1 - delta)


def test_epsilon_from_rates_is_zero_for_a_test_no_better_than_chance():
    assert epsilon_from_rates(0.5, 0.5, 0.0) == 0.0
    assert epsilon_from_rates(0.7, 0.6, 1e-5) == 0.0


def test_epsilon_from_rates_is_unbounded_for_a_test_never_wrong_one_way():
    assert epsilon_from_rates(0.0, 0.2, 1e-5) == math.inf
    assert epsilon_from_rates(0.0, 1.0, 0.0) == 0.0  # never says "in": no evidence


def test_classical_bound_uses_the_union_bound_on_both_rates():
    bound = classical_epsilon_lower_bound(2, 500, 40, 500, 1e-5, 0.95)
    fpr = stats.beta.ppf(0.975, 3, 498)
    fnr = stats.beta.ppf(0.975, 41, 460)
    assert isinstance(bound, AuditResult)
    assert bound.epsilon_lower_bound == pytest.approx(math.log((1 - 1e-5 - fnr) / fpr))
    assert (bound.guesses, bound.correct, bound.method) == (1000, 958, "classical")


def test_classical_bound_is_below_the_point_estimate_and_grows_with_trials():
    point = epsilon_from_rates(0.01, 0.1, 1e-5)
    small = classical_epsilon_lower_bound(1, 100, 10, 100, 1e-5, 0.95).epsilon_lower_bound
    large = classical_epsilon_lower_bound(100, 10_000, 1000, 10_000, 1e-5, 0.95)
    assert small < large.epsilon_lower_bound < point


def test_classical_bound_needs_trials_of_both_kinds():
    with pytest.raises(ValueError, match="both"):
        classical_epsilon_lower_bound(0, 0, 1, 10, 1e-5, 0.95)


def test_a_chosen_threshold_is_evaluated_on_scores_it_never_saw():
    rng = np.random.default_rng(0)
    scores_in, scores_out = rng.normal(2.0, 1.0, 2000), rng.normal(0.0, 1.0, 2000)
    bound = best_threshold_bound(scores_in, scores_out, 1e-5, 0.95)
    assert bound.guesses == 2000  # only the held-out halves are counted
    assert 0.5 < bound.epsilon_lower_bound < 4.0
    assert "other half" in bound.notes[-1]


def test_threshold_bound_of_indistinguishable_scores_stays_near_zero():
    # Same distribution in and out: a sound bound exceeds 0 only by chance (≤ 5 % of seeds).
    rng = np.random.default_rng(1)
    hits = sum(
        best_threshold_bound(rng.normal(size=200), rng.normal(size=200), 1e-5, 0.95)
        .epsilon_lower_bound > 0
        for _ in range(40)
    )  # fmt: skip
    assert hits <= 4


def test_threshold_bound_refuses_too_few_or_non_finite_scores():
    with pytest.raises(ValueError, match="at least 2"):
        best_threshold_bound([1.0], [0.0, 1.0], 1e-5, 0.95)
    with pytest.raises(ValueError, match="NaN"):
        best_threshold_bound([1.0, math.nan], [0.0, 1.0], 1e-5, 0.95)


def test_an_exactly_epsilon_dp_test_is_rarely_bounded_above_its_epsilon():
    # Randomised response at ε = 1 errs each way w.p. 1/(1 + e), on the (1, 0) boundary.
    rng = np.random.default_rng(6)
    error = 1 / (1 + math.e)
    fp, fn = rng.binomial(300, error, size=300), rng.binomial(300, error, size=300)
    above = sum(
        classical_epsilon_lower_bound(int(a), 300, int(b), 300, 0.0, 0.95).epsilon_lower_bound > 1
        for a, b in zip(fp, fn, strict=True)
    )
    assert above <= 0.05 * 300 + 3 * math.sqrt(0.05 * 0.95 * 300)


def test_classical_ceiling_is_the_bound_of_an_attack_never_wrong():
    # No errors in n trials: each rate ≤ 1 − (α/2)^(1/n), so ε̂ = log((1 − δ − u)/u).
    n, delta = 10_000, 1e-5
    u = 1 - 0.025 ** (1 / n)
    assert classical_ceiling(n, n, delta, 0.95) == pytest.approx(math.log((1 - delta - u) / u))
    assert classical_ceiling(n, n, delta, 0.95) == pytest.approx(math.log(n / 3.689), abs=0.01)


def test_audit_statistics_import_no_torch_at_module_level():
    # A saved run's audit is re-checked and re-rendered without torch (its report needs none).
    import dpfy.audit.bounds as bounds_module
    import dpfy.audit.membership as membership_module
    import dpfy.audit.one_run as one_run_module
    import dpfy.audit.result as result_module

    for module in (bounds_module, one_run_module, result_module, membership_module):
        tree = ast.parse(Path(module.__file__).read_text())
        for node in tree.body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "torch" for n in names), module.__name__
