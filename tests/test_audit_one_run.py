"""The one-run bound (Steinke, Nasr & Jagielski 2023) against a direct evaluation of the theorem."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dpfy.audit.one_run import (
    EPSILON_TOLERANCE,
    guess_counts,
    one_run_ceiling,
    one_run_epsilon_lower_bound,
    one_run_p_value,
    score_and_guess,
)


def theorem_by_hand(epsilon: float, delta: float, r: int, v: int, m: int) -> float:
    """The theorem's right side, binomial terms summed one by one in exact rationals."""
    q = Fraction(1) / (1 + Fraction(math.exp(-epsilon)))
    pmf = [math.comb(r, w) * q**w * (1 - q) ** (r - w) for w in range(r + 1)]
    tails = [Fraction(0)] * (r + 2)
    for w in range(r, -1, -1):
        tails[w] = tails[w + 1] + pmf[w]

    def f(u: int) -> Fraction:
        return tails[max(u, 0)] if u <= r else Fraction(0)

    gaps = [float(f(u) - f(v)) for u in range(v + 1)]  # f(v − i) − f(v), exact then rounded
    worst = max(gaps[max(v - i, 0)] / i for i in range(1, m + 1))
    return min(1.0, float(f(v)) + 2 * m * delta * worst)


@pytest.mark.parametrize(
    ("epsilon", "delta", "r", "v", "m"),
    [
        (1.0, 1e-5, 40, 30, 100),
        (2.0, 1e-3, 20, 19, 50),
        (0.5, 0.0, 30, 20, 30),
        (3.0, 1e-5, 8, 8, 8),
    ],
)
def test_p_value_equals_the_theorem_summed_by_hand(epsilon, delta, r, v, m):
    assert one_run_p_value(epsilon, delta, r, v, m) == pytest.approx(
        theorem_by_hand(epsilon, delta, r, v, m), rel=1e-9
    )


@pytest.mark.parametrize(("r", "v"), [(100, 80), (1000, 600), (50, 50)])
def test_pure_dp_bound_is_where_the_binomial_tail_meets_the_error(r, v):
    eps = one_run_epsilon_lower_bound(r, v, 0.0, 0.95, 2 * r)
    # Rejected at ε̂ and not rejected just above it: the largest rejected ε.
    assert stats.binom.sf(v - 1, r, 1 / (1 + math.exp(-eps))) <= 0.05
    above = eps + 2 * EPSILON_TOLERANCE
    assert stats.binom.sf(v - 1, r, 1 / (1 + math.exp(-above))) > 0.05
    # And in closed form: the tail's root is the beta quantile, ε the log-odds of it.
    q = stats.beta.ppf(0.05, v, r - v + 1)
    assert eps == pytest.approx(math.log(q / (1 - q)), abs=1e-5)


def test_approximate_dp_bound_is_the_largest_epsilon_the_theorem_rejects():
    r, v, m, delta = 200, 170, 1000, 1e-5
    eps = one_run_epsilon_lower_bound(r, v, delta, 0.95, m)
    assert theorem_by_hand(eps, delta, r, v, m) <= 0.05
    assert theorem_by_hand(eps + 1e-4, delta, r, v, m) > 0.05
    assert eps < one_run_epsilon_lower_bound(r, v, 0.0, 0.95, m)  # δ only weakens it


def test_bound_grows_with_correct_guesses():
    bounds = [one_run_epsilon_lower_bound(100, v, 1e-5, 0.95, 1000) for v in range(50, 101, 5)]
    assert all(a <= b for a, b in itertools.pairwise(bounds))
    assert bounds[-1] > bounds[0]


@pytest.mark.parametrize(("r", "v"), [(100, 50), (100, 30), (7, 3), (1, 0)])
def test_no_better_than_chance_gives_zero(r, v):
    assert one_run_epsilon_lower_bound(r, v, 1e-5, 0.95, 1000) == 0.0


def test_p_value_refuses_more_correct_guesses_than_guesses():
    with pytest.raises(ValueError, match="correct ≤ guesses ≤ canaries"):
        one_run_p_value(1.0, 1e-5, 10, 11, 100)
    with pytest.raises(ValueError, match="correct ≤ guesses ≤ canaries"):
        one_run_epsilon_lower_bound(200, 150, 1e-5, 0.95, 100)


def test_declared_guess_counts_depend_on_the_number_of_canaries_alone():
    assert guess_counts(1000) == (20, 100, 250, 500)
    assert guess_counts(3) == (1,)


def test_perfect_scores_give_the_best_guess_count_its_bound():
    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    scores = included + rng.normal(0, 0.01, 1000)  # a perfect separation
    result = score_and_guess(scores, included, 1e-5, 0.95)
    assert result.correct == result.guesses
    each = 1 - 0.05 / len(guess_counts(1000))
    assert result.epsilon_lower_bound == pytest.approx(
        one_run_epsilon_lower_bound(result.guesses, result.correct, 1e-5, each, 1000)
    )
    assert (result.method, result.canaries) == ("one-run", 1000)


def test_scores_unrelated_to_inclusion_rarely_give_a_positive_bound():
    rng = np.random.default_rng(2)
    hits = sum(
        score_and_guess(rng.normal(size=400), rng.random(400) < 0.5, 1e-5, 0.95)
        .epsilon_lower_bound > 0
        for _ in range(30)
    )  # fmt: skip
    assert hits <= 3


def test_score_and_guess_refuses_mismatched_flags_and_guess_counts():
    with pytest.raises(ValueError, match="boolean inclusion flag"):
        score_and_guess([0.1, 0.2], [1, 0], 1e-5, 0.95)
    with pytest.raises(ValueError, match="each k"):
        score_and_guess([0.1, 0.2, 0.3, 0.4], np.array([True] * 4), 1e-5, 0.95, ks=[3])


def test_an_exactly_epsilon_dp_guesser_is_rarely_bounded_above_its_epsilon():
    # Randomised response at ε = 1 is exactly 1-DP: each guess right w.p. e/(1 + e). A sound
    # bound at 95 % exceeds 1 in at most about 5 % of audits.
    rng = np.random.default_rng(5)
    right = rng.binomial(500, 1 / (1 + math.exp(-1.0)), size=200)
    above = sum(one_run_epsilon_lower_bound(500, int(v), 0.0, 0.95, 500) > 1.0 for v in right)
    assert above <= 0.05 * 200 + 3 * math.sqrt(0.05 * 0.95 * 200)


def test_one_run_ceiling_is_the_bound_of_guesses_all_right():
    # Pure DP, r guesses all right: q^r = α at the ceiling, so ε̂ = log-odds of α^(1/r).
    q = 0.05 ** (1 / 100)
    assert one_run_ceiling(1000, 0.0, 0.95, ks=[50]) == pytest.approx(
        math.log(q / (1 - q)), abs=1e-5
    )
    assert one_run_ceiling(1000, 1e-5, 0.95) >= one_run_ceiling(100, 1e-5, 0.95)
