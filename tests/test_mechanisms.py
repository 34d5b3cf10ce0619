"""Classic mechanisms: calibration formulas, noise distributions measured statistically, events."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpfy.plan.accounting.events import GaussianEvent, LaplaceEvent, PureDpEvent
from dpfy.plan.mechanisms import (
    GAUSSIAN_CALIBRATIONS,
    MechanismResult,
    analytic_gaussian_delta,
    analytic_gaussian_sigma,
    classical_gaussian_sigma,
    exponential_mechanism,
    gaussian_mechanism,
    laplace_mechanism,
    randomized_response,
    randomized_response_keep_probability,
)

P_MIN = 1e-4  # seeded draws: a p-value below this means the distribution is wrong
DRAWS = 200_000


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _exact_delta(sigma: float, sensitivity: float, epsilon: float) -> float:
    """Balle & Wang Thm 8 evaluated in 60-digit arithmetic: an oracle independent of the code."""
    mp = pytest.importorskip("mpmath")
    with mp.workdps(60):
        s, e, d = mp.mpf(sigma), mp.mpf(epsilon), mp.mpf(sensitivity)
        value = mp.ncdf(d / (2 * s) - e * s / d) - mp.e**e * mp.ncdf(-d / (2 * s) - e * s / d)
        return float(value)


def _variance_p_value(sample: np.ndarray, sigma: float) -> float:
    """Two-sided chi-square test of Var = σ² for a zero-mean normal sample."""
    n = sample.size
    statistic = np.sum(sample**2) / sigma**2
    cdf = stats.chi2.cdf(statistic, n)
    return 2 * min(cdf, 1 - cdf)


# -- Laplace -----------------------------------------------------------------------------------


def test_laplace_noise_has_scale_sensitivity_over_epsilon():
    sensitivity, epsilon = 2.0, 0.5
    value = np.full(DRAWS, 3.0)
    result = laplace_mechanism(value, sensitivity, epsilon, rng=_rng(1))
    noise = result.output - value
    scale = sensitivity / epsilon
    assert stats.kstest(noise, stats.laplace(scale=scale).cdf).pvalue > P_MIN
    # |Laplace(b)| is Exponential(b): its mean b has standard error b/√n.
    assert abs(np.mean(np.abs(noise)) - scale) < 5 * scale / math.sqrt(DRAWS)


def test_laplace_wrong_scale_is_detected_by_the_same_check():
    noise = laplace_mechanism(np.zeros(DRAWS), 1.0, 1.0, rng=_rng(2)).output
    assert stats.kstest(noise, stats.laplace(scale=1.1).cdf).pvalue < P_MIN


def test_laplace_event_and_output_types():
    scalar = laplace_mechanism(1.5, 1.0, 0.25, rng=_rng(3))
    assert isinstance(scalar, MechanismResult)
    assert isinstance(scalar.output, float)
    assert scalar.event == LaplaceEvent(noise_multiplier=4.0)
    vector = laplace_mechanism([1.0, 2.0, 3.0], 1.0, 2.0, rng=_rng(3))
    assert vector.output.shape == (3,)
    assert vector.event == LaplaceEvent(noise_multiplier=0.5)


def test_result_is_frozen():
    result = laplace_mechanism(0.0, 1.0, 1.0, rng=_rng(4))
    with pytest.raises(AttributeError):
        result.output = 0.0  # type: ignore[misc]


def test_default_rng_is_freshly_seeded():
    first = laplace_mechanism(np.zeros(8), 1.0, 1.0).output
    second = laplace_mechanism(np.zeros(8), 1.0, 1.0).output
    assert not np.array_equal(first, second)


def test_rng_must_be_a_generator():
    with pytest.raises(TypeError, match=r"numpy\.random\.Generator"):
        laplace_mechanism(0.0, 1.0, 1.0, rng=42)  # type: ignore[arg-type]


# -- Gaussian calibration ----------------------------------------------------------------------


def test_classical_sigma_formula():
    sigma = classical_gaussian_sigma(2.0, 0.5, 1e-5)
    assert sigma == pytest.approx(2.0 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 0.5, rel=1e-12)


@pytest.mark.parametrize("epsilon", [1.0, 1.5, 8.0])
def test_classical_sigma_refuses_epsilon_of_one_or_more(epsilon):
    with pytest.raises(ValueError, match=r"valid only for epsilon in \(0, 1\)") as info:
        classical_gaussian_sigma(1.0, epsilon, 1e-5)
    assert "analytic_gaussian_sigma" in str(info.value)


EPSILONS = [1e-3, 0.1, 0.5, 0.99, 1.0, 2.0, 5.0, 20.0]
DELTAS = [0.1, 1e-5, 1e-9, 1e-15]


@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("delta", DELTAS)
def test_analytic_sigma_satisfies_and_is_tight(epsilon, delta):
    sigma = analytic_gaussian_sigma(1.0, epsilon, delta)
    achieved = _exact_delta(sigma, 1.0, epsilon)
    assert achieved <= delta  # never undershoots σ
    assert achieved >= delta * (1 - 1e-3)  # and is the smallest such σ to 1e-3 in δ
    assert analytic_gaussian_delta(sigma, 1.0, epsilon) <= delta


@pytest.mark.parametrize("epsilon", [0.01, 0.3, 0.9])
@pytest.mark.parametrize("delta", [1e-3, 1e-6, 1e-10])
def test_analytic_sigma_beats_classical_below_one(epsilon, delta):
    assert analytic_gaussian_sigma(1.0, epsilon, delta) < classical_gaussian_sigma(
        1.0, epsilon, delta
    )


def test_analytic_sigma_scales_with_sensitivity():
    base = analytic_gaussian_sigma(1.0, 0.7, 1e-6)
    assert analytic_gaussian_sigma(3.5, 0.7, 1e-6) == pytest.approx(3.5 * base, rel=1e-9)


def test_analytic_sigma_decreases_with_epsilon_and_delta():
    sigmas = [analytic_gaussian_sigma(1.0, e, 1e-6) for e in (0.1, 0.5, 1.0, 4.0)]
    assert sigmas == sorted(sigmas, reverse=True)
    sigmas = [analytic_gaussian_sigma(1.0, 1.0, d) for d in (1e-12, 1e-8, 1e-4)]
    assert sigmas == sorted(sigmas, reverse=True)


def test_analytic_delta_matches_high_precision_oracle():
    for sigma in (0.3, 1.0, 4.0, 20.0):
        ours = analytic_gaussian_delta(sigma, 1.0, 1.0)
        assert ours == pytest.approx(_exact_delta(sigma, 1.0, 1.0), rel=1e-9)


def test_gaussian_noise_has_calibrated_std():
    sensitivity, epsilon, delta = 1.5, 0.8, 1e-5
    sigma = analytic_gaussian_sigma(sensitivity, epsilon, delta)
    value = np.full(DRAWS, -2.0)
    result = gaussian_mechanism(value, sensitivity, epsilon, delta, rng=_rng(5))
    noise = result.output - value
    assert stats.kstest(noise, stats.norm(scale=sigma).cdf).pvalue > P_MIN
    assert _variance_p_value(noise, sigma) > P_MIN
    assert result.event == GaussianEvent(noise_multiplier=sigma / sensitivity)


def test_gaussian_variance_check_detects_a_five_percent_error():
    noise = gaussian_mechanism(np.zeros(DRAWS), 1.0, 0.5, 1e-5, rng=_rng(6)).output
    sigma = analytic_gaussian_sigma(1.0, 0.5, 1e-5)
    assert _variance_p_value(noise, 1.05 * sigma) < P_MIN


def test_gaussian_classical_calibration_uses_classical_sigma():
    result = gaussian_mechanism(0.0, 2.0, 0.5, 1e-6, rng=_rng(7), calibration="classical")
    expected = classical_gaussian_sigma(2.0, 0.5, 1e-6) / 2.0
    assert isinstance(result.output, float)
    assert result.event == GaussianEvent(noise_multiplier=expected)
    with pytest.raises(ValueError, match="analytic_gaussian_sigma"):
        gaussian_mechanism(0.0, 1.0, 2.0, 1e-6, calibration="classical")


def test_gaussian_calibrations_are_a_registry():
    assert set(GAUSSIAN_CALIBRATIONS) == {"analytic", "classical"}
    with pytest.raises(ValueError, match="analytic, classical"):
        gaussian_mechanism(0.0, 1.0, 0.5, 1e-6, calibration="moments")


# -- exponential mechanism ---------------------------------------------------------------------


def _selection_frequencies(scores, epsilon, sensitivity, monotonic, draws=10_000, seed=8):
    rng = _rng(seed)
    names = [f"c{i}" for i in range(len(scores))]
    counts = dict.fromkeys(names, 0)
    for _ in range(draws):
        pick = exponential_mechanism(names, scores, epsilon, sensitivity, rng, monotonic).output
        counts[pick] += 1
    return np.array([counts[n] for n in names])


@pytest.mark.parametrize("monotonic", [False, True])
def test_exponential_mechanism_frequencies_match_theory(monotonic):
    scores = np.array([0.0, 1.0, 2.0, 3.5])
    epsilon, sensitivity = 1.2, 1.5
    factor = 1.0 if monotonic else 0.5
    weights = np.exp(factor * epsilon * scores / sensitivity)
    expected = weights / weights.sum()
    counts = _selection_frequencies(scores, epsilon, sensitivity, monotonic)
    assert stats.chisquare(counts, expected * counts.sum()).pvalue > P_MIN


def test_exponential_mechanism_frequency_check_detects_wrong_factor():
    scores = np.array([0.0, 1.0, 2.0, 3.5])
    counts = _selection_frequencies(scores, 1.2, 1.5, monotonic=True)
    weights = np.exp(0.5 * 1.2 * scores / 1.5)  # the non-monotone law: must be rejected
    assert stats.chisquare(counts, weights / weights.sum() * counts.sum()).pvalue < P_MIN


def test_exponential_mechanism_is_stable_for_huge_scores():
    result = exponential_mechanism(["low", "high"], [1e6, 1e6 + 500.0], 1.0, 1.0, rng=_rng(9))
    assert result.output == "high"
    assert result.event == PureDpEvent(1.0)


def test_exponential_mechanism_returns_candidate_objects():
    candidates = [(0.1, 64), (0.01, 256)]
    result = exponential_mechanism(candidates, [0.0, 0.0], 0.5, 1.0, rng=_rng(10))
    assert result.output in candidates
    assert result.event == PureDpEvent(0.5)


@pytest.mark.parametrize(
    ("candidates", "scores", "match"),
    [
        ([], [], "candidates must not be empty"),
        (["a", "b"], [1.0], "one score per candidate"),
        (["a", "b"], [[1.0, 2.0]], "one score per candidate"),
        (["a", "b"], [1.0, math.nan], "finite"),
        (["a", "b"], [1.0, math.inf], "finite"),
    ],
)
def test_exponential_mechanism_refuses_bad_input(candidates, scores, match):
    with pytest.raises(ValueError, match=match):
        exponential_mechanism(candidates, scores, 1.0, 1.0)


# -- randomised response -----------------------------------------------------------------------


def test_randomized_response_keep_rate_and_uniform_flips():
    k, epsilon, n = 5, 1.0, DRAWS
    rng = _rng(11)
    true = rng.integers(0, k, n)
    result = randomized_response(true, k, epsilon, rng=rng)
    reported = result.output
    keep = randomized_response_keep_probability(k, epsilon)
    assert keep == pytest.approx(math.e / (math.e + k - 1), rel=1e-12)
    kept = int(np.sum(reported == true))
    assert stats.binomtest(kept, n, keep).pvalue > P_MIN
    shifts = (reported - true)[reported != true] % k
    assert set(np.unique(shifts)) <= set(range(1, k))
    counts = np.bincount(shifts, minlength=k)[1:]
    assert stats.chisquare(counts).pvalue > P_MIN
    for label in range(k):  # per true label, the others are equally likely
        flipped = reported[(true == label) & (reported != true)]
        others = np.bincount(flipped, minlength=k)[[c for c in range(k) if c != label]]
        assert stats.chisquare(others).pvalue > P_MIN
    assert result.event == PureDpEvent(epsilon)


def test_randomized_response_keep_rate_check_has_power():
    k, n = 4, DRAWS
    rng = _rng(12)
    true = rng.integers(0, k, n)
    reported = randomized_response(true, k, 0.5, rng=rng).output
    kept = int(np.sum(reported == true))
    wrong = 1.0 / (1.0 + k * math.exp(-0.5))  # a plausible off-by-one in the denominator
    assert stats.binomtest(kept, n, wrong).pvalue < P_MIN


def test_randomized_response_scalar_and_shape():
    single = randomized_response(2, 3, 50.0, rng=_rng(13))
    assert single.output == 2 and isinstance(single.output, int)
    grid = randomized_response(np.zeros((3, 4), dtype=int), 2, 1.0, rng=_rng(13))
    assert grid.output.shape == (3, 4)


@pytest.mark.parametrize(
    ("labels", "num_classes", "match"),
    [
        ([0, 3], 3, r"labels must lie in \[0, 3\)"),
        ([-1, 0], 3, r"labels must lie in \[0, 3\)"),
        ([0.5, 1.0], 3, "whole numbers"),
        ([0, 1], 1, "num_classes must be a whole number >= 2"),
        ([0, math.nan], 3, "finite"),
    ],
)
def test_randomized_response_refuses_bad_labels(labels, num_classes, match):
    with pytest.raises(ValueError, match=match):
        randomized_response(labels, num_classes, 1.0)


# -- bad privacy parameters, shared across mechanisms ------------------------------------------

BAD_POSITIVE = [0.0, -1.0, math.nan, math.inf]
# _validate names the interval for out-of-range numbers and says "finite" for NaN/inf.


@pytest.mark.parametrize("bad", BAD_POSITIVE)
@pytest.mark.parametrize(
    "call",
    [
        lambda e: laplace_mechanism(0.0, 1.0, e),
        lambda e: gaussian_mechanism(0.0, 1.0, e, 1e-5),
        lambda e: analytic_gaussian_sigma(1.0, e, 1e-5),
        lambda e: classical_gaussian_sigma(1.0, e, 1e-5),
        lambda e: exponential_mechanism(["a"], [0.0], e, 1.0),
        lambda e: randomized_response([0], 2, e),
    ],
)
def test_bad_epsilon_is_refused_with_its_range(call, bad):
    with pytest.raises(ValueError, match=r"epsilon must (lie in \(0, inf\)|be a finite number)"):
        call(bad)


@pytest.mark.parametrize("bad", BAD_POSITIVE)
@pytest.mark.parametrize(
    "call",
    [
        lambda s: laplace_mechanism(0.0, s, 1.0),
        lambda s: gaussian_mechanism(0.0, s, 1.0, 1e-5),
        lambda s: analytic_gaussian_sigma(s, 1.0, 1e-5),
        lambda s: classical_gaussian_sigma(s, 0.5, 1e-5),
        lambda s: exponential_mechanism(["a"], [0.0], 1.0, s),
    ],
)
def test_bad_sensitivity_is_refused_with_its_range(call, bad):
    with pytest.raises(
        ValueError, match=r"sensitivity must (lie in \(0, inf\)|be a finite number)"
    ):
        call(bad)


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, -1e-5, math.nan])
@pytest.mark.parametrize(
    "call",
    [
        lambda d: gaussian_mechanism(0.0, 1.0, 1.0, d),
        lambda d: analytic_gaussian_sigma(1.0, 1.0, d),
        lambda d: classical_gaussian_sigma(1.0, 0.5, d),
    ],
)
def test_bad_delta_is_refused_with_its_range(call, bad):
    with pytest.raises(ValueError, match=r"delta must (lie in \(0, 1\)|be a finite number)"):
        call(bad)


@pytest.mark.parametrize("bad", [math.nan, [1.0, math.inf], "abc"])
def test_non_finite_values_are_refused(bad):
    with pytest.raises(ValueError, match="value must"):
        laplace_mechanism(bad, 1.0, 1.0)
    with pytest.raises(ValueError, match="value must"):
        gaussian_mechanism(bad, 1.0, 1.0, 1e-5)
