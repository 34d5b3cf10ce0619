"""The mathematics of correlated noise (dpfy.plan.correlated), each checked an independent way.

Toeplitz algebra against dense linear algebra; analytic gradients against finite differences;
optimised strategies against DP-SGD, each other and tree aggregation (whose error is computed
here from its definition, dense); streams against C⁻¹z solved densely and against their
covariance; sensitivities against brute force over every participation pattern; events against
dp_accounting.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dpfy.plan.accounting import NeighbouringRelation, compute_epsilon
from dpfy.plan.correlated.accounting import (
    calibrate_correlated_noise,
    correlated_accounting,
    correlated_event,
)
from dpfy.plan.correlated.banded import (
    BandedNoise,
    BandedStrategy,
    banded_loss,
    optimise_banded,
    square_root_coefficients,
)
from dpfy.plan.correlated.blt import Blt, BltNoise, blt_loss, optimise_blt
from dpfy.plan.correlated.error import rmse_ratio, total_squared_error
from dpfy.plan.correlated.participation import CyclicPoisson, MinSeparation
from dpfy.plan.correlated.sensitivity import (
    brute_force_sensitivity_squared,
    matrix_sensitivity_squared,
    max_separated_sum,
    toeplitz_sensitivity_and_gradient,
    toeplitz_sensitivity_squared,
)
from dpfy.plan.correlated.toeplitz import (
    inverse_coefficients,
    multiply,
    prefix_sum_error,
    prefix_sum_error_gradient,
    toeplitz_matrix,
)

try:  # a test-only dependency: only the accounting cross-checks need it
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant as dpa_pld
except ImportError:  # pragma: no cover
    dpa = dpa_pld = None

needs_dp_accounting = pytest.mark.skipif(dpa is None, reason="dp_accounting is not installed")


def workload(n: int) -> np.ndarray:
    """A: the n×n lower-triangular matrix of ones (prefix sums)."""
    return np.tril(np.ones((n, n)))


def dense_error(c_matrix: np.ndarray) -> float:
    """‖A C⁻¹‖_F², densely."""
    n = c_matrix.shape[1]
    return float(np.linalg.norm(workload(n) @ np.linalg.inv(c_matrix)) ** 2)


def finite_difference(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central differences of a scalar function."""
    out = np.zeros_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = h
        out[i] = (f(x + e) - f(x - e)) / (2 * h)
    return out


# -- Toeplitz algebra -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 30])
@pytest.mark.parametrize("length", [1, 3, 12])
def test_series_inverse_is_the_inverse_matrix(n, length):
    rng = np.random.default_rng(n * 100 + length)
    c = np.concatenate(([1.0], 0.4 * rng.standard_normal(length - 1)))
    dense = np.linalg.inv(toeplitz_matrix(c, n))
    assert np.allclose(toeplitz_matrix(inverse_coefficients(c, n), n), dense, atol=1e-10)


def test_toeplitz_product_is_the_matrix_product():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(5), rng.standard_normal(9)
    n = 11
    product = toeplitz_matrix(a, n) @ toeplitz_matrix(b, n)
    assert np.allclose(toeplitz_matrix(multiply(a, b, n), n), product)


@pytest.mark.parametrize("n", [1, 5, 40])
def test_prefix_sum_error_matches_the_dense_frobenius_norm(n):
    rng = np.random.default_rng(n)
    c = np.concatenate(([1.0], 0.3 * rng.standard_normal(6)))
    expected = dense_error(toeplitz_matrix(c, n))
    assert prefix_sum_error(inverse_coefficients(c, n), n) == pytest.approx(expected, rel=1e-10)
    assert prefix_sum_error_gradient(c, n)[0] == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("n", [3, 25, 300])
def test_error_gradient_matches_finite_differences(n):
    rng = np.random.default_rng(n)
    c = np.concatenate(([1.0], 0.3 * rng.random(5)))
    _, grad = prefix_sum_error_gradient(c, n)
    numeric = finite_difference(lambda x: prefix_sum_error(inverse_coefficients(x, n), n), c)
    assert np.allclose(grad[: min(n, c.size)], numeric[: min(n, c.size)], rtol=1e-5)


@pytest.mark.parametrize(
    ("participation", "c"),
    [
        (MinSeparation(1, 1), [1.0, 0.5, 0.3]),
        (MinSeparation(3, 2), [1.0, 0.6]),  # disjoint columns
        (MinSeparation(3, 2), [1.0, 0.6, 0.5, 0.2]),  # non-increasing: packed is exact
        (MinSeparation(4, 3), [1.0, 1.3, 0.5, -0.4, 0.2]),  # majorant bound
    ],
)
def test_sensitivity_gradient_matches_finite_differences(participation, c):
    c = np.asarray(c)
    n = 20
    _, grad = toeplitz_sensitivity_and_gradient(c, n, participation)
    numeric = finite_difference(
        lambda x: toeplitz_sensitivity_squared(x, n, participation).squared, c, h=1e-7
    )
    assert np.allclose(grad, numeric, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "participation", [MinSeparation(1, 40), MinSeparation(4, 10), CyclicPoisson(5)]
)
def test_banded_loss_gradient_matches_finite_differences(participation):
    free = np.array([0.45, 0.3, 0.2, 0.1])
    value, grad = banded_loss(free, 40, participation, 5)
    assert math.isfinite(value)
    numeric = finite_difference(lambda x: banded_loss(x, 40, participation, 5)[0], free)
    assert np.allclose(grad, numeric, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("participation", [MinSeparation(1, 60), MinSeparation(3, 20)])
def test_blt_loss_gradient_matches_finite_differences(participation):
    params = np.array([0.7, 2.5, 0.25, 0.2])  # log time scales, weights
    value, grad = blt_loss(params, 60, participation)
    assert math.isfinite(value)
    numeric = finite_difference(lambda x: blt_loss(x, 60, participation)[0], params)
    assert np.allclose(grad, numeric, rtol=1e-5, atol=1e-8)


# -- BLT algebra ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("decays", "weights"),
    [((0.5,), (0.3,)), ((0.2, 0.9), (0.3, 0.15)), ((0.1, 0.6, 0.97), (0.2, 0.2, 0.05))],
)
def test_blt_coefficients_inverse_and_its_parameters_agree_with_dense_algebra(decays, weights):
    n = 15
    blt = Blt(decays, weights)
    dense = np.zeros((n, n))  # built from the definition c_0 = 1, c_m = Σ ω θ^{m−1}
    for i in range(n):
        for j in range(i + 1):
            m = i - j
            dense[i, j] = (
                1.0
                if m == 0
                else sum(w * t ** (m - 1) for t, w in zip(decays, weights, strict=True))
            )
    assert np.allclose(blt.matrix(n), dense)
    inverse = np.linalg.inv(dense)
    assert np.allclose(toeplitz_matrix(blt.inverse_toeplitz(n), n), inverse, atol=1e-12)
    params = blt.inverse()
    assert np.allclose(params.matrix(n), inverse, atol=1e-10)
    # The papers' shape: real decays below 1, negative weights for C⁻¹.
    assert all(abs(t) < 1 for t in params.decays) and all(w < 0 for w in params.weights)


# -- optimisation -----------------------------------------------------------------------------


def dense_loss(strategy, n: int, participation) -> float:
    """‖A C⁻¹‖² · Δ² with a dense inverse and the dense sensitivity routine."""
    c = strategy.matrix(n)
    return dense_error(c) * matrix_sensitivity_squared(c, participation).squared


@pytest.mark.parametrize("n", [2, 3, 10, 64, 257])
def test_optimised_banded_beats_dpsgd_and_improves_with_bands(n):
    participation = MinSeparation(1, n)
    losses = []
    for bands in [b for b in (1, 2, 4, 8, 16) if b <= n]:
        strategy = optimise_banded(n, bands, participation)
        assert strategy.bands == bands
        losses.append(dense_loss(strategy, n, participation))
    assert losses[0] == pytest.approx(n * (n + 1) / 2)  # b = 1 is DP-SGD
    assert losses[1] < losses[0]  # strictly better than DP-SGD for n ≥ 2
    assert all(b <= a * (1 + 1e-9) for a, b in itertools.pairwise(losses))
    if n >= 64:
        assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(("n", "epochs"), [(64, 4), (120, 6)])
def test_multi_epoch_banded_improves_with_bands_up_to_and_past_the_separation(n, epochs):
    participation = MinSeparation.epochs(epochs, n // epochs)
    losses = [
        dense_loss(optimise_banded(n, b, participation), n, participation)
        for b in (1, 2, 4, 8, 16, 24)
    ]
    assert losses[0] == pytest.approx(epochs * n * (n + 1) / 2)
    assert all(b <= a * (1 + 1e-9) for a, b in itertools.pairwise(losses))
    assert losses[-1] < 0.7 * losses[0]


def test_amplified_banded_refuses_more_bands_than_groups():
    with pytest.raises(ValueError, match="groups"):
        optimise_banded(20, 5, CyclicPoisson(4))


def tree_matrix(m: int) -> np.ndarray:
    """The online binary tree over m steps: one row per completed dyadic node [k2^l, (k+1)2^l)."""
    rows = []
    level = 1
    while level <= m:
        for start in range(0, m - level + 1, level):
            row = np.zeros(m)
            row[start : start + level] = 1.0
            rows.append(row)
        level *= 2
    return np.array(rows)


def tree_errors(n: int, epochs: int) -> dict[str, float]:
    """Tree aggregation restarted every epoch, as dpfy runs it: ‖B‖_F² Δ² for three decoders.

    Δ² = epochs · depth (one leaf per epoch, each in ``depth`` nodes of its own tree). "plain":
    each prefix read off the nodes of its binary decomposition (variance popcount); "honaker":
    dpfy.train.noise.tree's "efficient" variance 2^l/(2^{l+1}−1) per node; "optimal": the least-
    squares decoder B = A C⁺, the best any linear read-out of the tree's nodes can do.
    """
    m = n // epochs
    depth = m.bit_length()
    sensitivity = epochs * depth
    tree = tree_matrix(m)
    per_epoch = np.kron(np.eye(epochs), tree)
    optimal = float(np.linalg.norm(workload(n) @ np.linalg.pinv(per_epoch)) ** 2)

    def prefix(t: int, weight) -> float:
        return sum(weight(level) for level in range(t.bit_length()) if t >> level & 1)

    out = {"optimal": optimal * sensitivity}
    for name, weight in (
        ("plain", lambda level: 1.0),
        ("honaker", lambda lv: 2**lv / (2 ** (lv + 1) - 1)),
    ):
        total = 0.0
        for step in range(1, n + 1):
            finished, position = divmod(step - 1, m)
            total += finished * prefix(m, weight) + prefix(position + 1, weight)
        out[name] = total * sensitivity
    return out


@pytest.mark.parametrize(("n", "epochs"), [(100, 1), (256, 1), (256, 4)])
def test_optimised_blt_beats_tree_aggregation(n, epochs):
    participation = MinSeparation.epochs(epochs, n // epochs)
    tree = tree_errors(n, epochs)
    assert tree["optimal"] <= tree["honaker"] <= tree["plain"]
    for buffers in (2, 3, 4):
        blt = optimise_blt(n, buffers, participation)
        loss = dense_loss(blt, n, participation)
        assert loss == pytest.approx(total_squared_error(blt, n, participation), rel=1e-8)
        assert loss < tree["optimal"]
        if epochs > 1:  # the multi-epoch sensitivity must have been exact, not a bound
            assert toeplitz_sensitivity_squared(blt.toeplitz(n), n, participation).exact


def test_blt_improves_on_one_buffer_and_nearly_reaches_the_square_root():
    n = 500
    participation = MinSeparation(1, n)
    one, three = (rmse_ratio(optimise_blt(n, d, participation), n, participation) for d in (1, 3))
    root = BandedStrategy(tuple(square_root_coefficients(n)))
    assert three < one
    assert three <= rmse_ratio(root, n, participation) * 1.001


def test_optimisers_are_deterministic():
    participation = MinSeparation(3, 20)
    assert optimise_blt(60, 2, participation) == optimise_blt(60, 2, participation)
    assert optimise_banded(60, 4, participation) == optimise_banded(60, 4, participation)


# -- streaming ---------------------------------------------------------------------------------


def stream(noise, z: np.ndarray) -> np.ndarray:
    """Feed z_0, z_1, … (first axis = steps) through a generator."""
    return np.stack([noise.step(row) for row in z])


@pytest.mark.parametrize(
    "strategy",
    [
        BandedStrategy.identity(),
        BandedStrategy((1.0, 0.5, 0.375, 0.3125)),
        BandedStrategy((1.0, -0.7, 0.2)),
        Blt((0.3, 0.95), (0.3, 0.1)),
        Blt((0.5, 0.8, 0.99), (0.1, 0.2, 0.05)),
    ],
)
def test_streamed_noise_is_c_inverse_z(strategy):
    n = 40
    z = np.random.default_rng(0).standard_normal((n, 3, 2))
    generator = (
        BandedNoise(strategy) if isinstance(strategy, BandedStrategy) else BltNoise(strategy)
    )
    expected = np.linalg.solve(strategy.matrix(n), z.reshape(n, -1)).reshape(z.shape)
    assert np.max(np.abs(stream(generator, z) - expected)) < 1e-10
    generator.reset()
    assert np.max(np.abs(stream(generator, z) - expected)) < 1e-10


def covariance_within(samples: np.ndarray, covariance: np.ndarray, sigmas: float) -> bool:
    """Every entry of the empirical covariance within ``sigmas`` standard errors of the truth.

    For Gaussian data the standard error of the (i, j) entry is √((Σ_ii Σ_jj + Σ_ij²)/N).
    """
    count = samples.shape[0]
    empirical = samples.T @ samples / count
    diagonal = np.diag(covariance)
    error = np.sqrt((np.outer(diagonal, diagonal) + covariance**2) / count)
    return bool(np.all(np.abs(empirical - covariance) <= sigmas * error))


@pytest.mark.parametrize("strategy", [BandedStrategy((1.0, 0.6, 0.3)), Blt((0.4, 0.9), (0.3, 0.2))])
def test_streamed_noise_has_covariance_c_inverse_c_inverse_transposed(strategy):
    n, draws = 6, 40_000
    rng = np.random.default_rng(7)
    generator = (
        BandedNoise(strategy) if isinstance(strategy, BandedStrategy) else BltNoise(strategy)
    )
    samples = np.stack([generator.step(rng.standard_normal(draws)) for _ in range(n)], axis=1)
    inverse = np.linalg.inv(strategy.matrix(n))
    # 5 standard errors per entry (21 entries): a false alarm has probability below 1e-4.
    assert covariance_within(samples, inverse @ inverse.T, sigmas=5.0)
    # …and the check has teeth: independent noise's covariance (the identity) is rejected.
    assert not covariance_within(samples, np.eye(n), sigmas=5.0)


# -- sensitivity --------------------------------------------------------------------------------


def schemas(n: int):
    for separation in (1, 2, 3, 5):
        for k in (1, 2, 3, n):
            yield MinSeparation(k, separation)
    for groups in (1, 2, 3, 4):
        yield CyclicPoisson(groups)


def toeplitz_cases():
    rng = np.random.default_rng(3)
    yield "sqrt", square_root_coefficients(12)
    yield "band2", np.array([1.0, 0.7])
    yield "band3", np.array([1.0, 0.4, 0.35])
    yield "band4-mixed", np.array([1.0, -0.5, 0.3, 0.1])
    yield "band3-rising", np.array([1.0, 1.4, 0.5])
    yield "band4-gapped", np.array([1.0, 0.0, 0.0, 0.9])  # packing to the left is not the worst
    yield "blt", Blt((0.3, 0.85), (0.3, 0.2)).toeplitz(12)
    yield "random", np.concatenate(([1.0], rng.standard_normal(5)))


@pytest.mark.parametrize(("name", "c"), list(toeplitz_cases()))
@pytest.mark.parametrize("n", [6, 11])
def test_toeplitz_sensitivity_equals_brute_force_or_bounds_it(name, c, n):
    exact_seen = 0
    for participation in schemas(n):
        mixed = np.any(np.asarray(c)[:n] < 0)
        if mixed and participation.participations(n) > 4:
            continue  # the signed brute force is exponential in the pattern size
        matrix = toeplitz_matrix(c, n)
        truth = brute_force_sensitivity_squared(matrix, participation)
        computed = toeplitz_sensitivity_squared(c, n, participation)
        dense = matrix_sensitivity_squared(matrix, participation)
        for result in (computed, dense):
            if result.exact:
                assert result.squared == pytest.approx(truth, rel=1e-10), (participation, result)
            else:
                assert result.squared >= truth * (1 - 1e-12), (participation, result)
        exact_seen += computed.exact
    assert exact_seen > 0


def test_the_exact_rules_fire_where_the_papers_say():
    n = 12
    band = np.array([1.0, -0.5, 0.3])  # 3 bands, mixed signs
    assert toeplitz_sensitivity_squared(band, n, MinSeparation(4, 3)).exact
    assert not toeplitz_sensitivity_squared(band, n, MinSeparation(4, 2)).exact
    blt = Blt((0.3, 0.85), (0.3, 0.2)).toeplitz(n)  # non-negative, non-increasing
    assert toeplitz_sensitivity_squared(blt, n, MinSeparation(3, 2)).exact
    packed = toeplitz_matrix(blt, n)[:, [0, 2, 4]].sum(axis=1)
    assert toeplitz_sensitivity_squared(blt, n, MinSeparation(3, 2)).squared == pytest.approx(
        packed @ packed
    )


@pytest.mark.parametrize("seed", range(6))
def test_dense_sensitivity_of_any_matrix_is_exact_or_an_upper_bound(seed):
    rng = np.random.default_rng(seed)
    n = 9
    matrix = rng.standard_normal((n + 3, n)) * (rng.random((n + 3, n)) < 0.5)
    if seed % 2:
        matrix = np.abs(matrix)
    for participation in (MinSeparation(2, 2), MinSeparation(3, 3), CyclicPoisson(3)):
        truth = brute_force_sensitivity_squared(matrix, participation)
        result = matrix_sensitivity_squared(matrix, participation)
        if result.exact:
            assert result.squared == pytest.approx(truth, rel=1e-10)
        else:
            assert result.squared >= truth * (1 - 1e-12)


def test_max_separated_sum_is_the_best_allowed_pattern():
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.random(10)
        for k, sep in ((1, 1), (2, 3), (3, 2), (10, 1)):
            best = max(sum(w[list(p)]) for p in MinSeparation(k, sep).patterns(10))
            assert max_separated_sum(w, k, sep) == pytest.approx(best)


def test_participation_patterns_are_the_allowed_ones():
    n = 8
    for schema in (MinSeparation(2, 3), MinSeparation(8, 1), CyclicPoisson(3)):
        everything = {p for size in range(1, n + 1) for p in itertools.combinations(range(n), size)}
        allowed = {p for p in everything if schema.allows(p)}
        assert set(schema.patterns(n)) == allowed


# -- accounting --------------------------------------------------------------------------------


def dp_accounting_epsilon(event, delta: float) -> float:
    accountant = dpa_pld.PLDAccountant(
        neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=1e-4,
    )
    return accountant.compose(event).get_epsilon(delta)


@needs_dp_accounting
@pytest.mark.parametrize(
    ("strategy", "participation"),
    [
        (BandedStrategy((1.0, 0.6, 0.4)), MinSeparation(3, 4)),
        (Blt((0.4, 0.9), (0.3, 0.2)), MinSeparation(2, 5)),
        (Blt((0.4, 0.9), (0.3, 0.2)), CyclicPoisson(4, sampling_rate=0.1)),  # no amplification
        (BandedStrategy((1.0, 0.6, 0.4, 0.2, 0.1)), CyclicPoisson(4, 0.1)),  # bands > groups
    ],
)
def test_min_separation_event_is_the_gaussian_mechanism_at_sigma_over_delta(
    strategy, participation
):
    n, sigma, delta = 12, 3.0, 1e-6
    truth = brute_force_sensitivity_squared(strategy.matrix(n), participation)
    accounting = correlated_accounting(strategy, participation, n, sigma)
    assert not accounting.amplified
    assert accounting.sensitivity.squared >= truth * (1 - 1e-12)
    ours = compute_epsilon(accounting.event, delta, relation=NeighbouringRelation.ZERO_OUT)
    theirs = dp_accounting_epsilon(dpa.GaussianDpEvent(sigma / math.sqrt(truth)), delta)
    if accounting.sensitivity.exact:
        assert ours == pytest.approx(theirs, rel=2e-3)
    else:
        assert ours >= theirs * (1 - 2e-3)


@needs_dp_accounting
@pytest.mark.parametrize(("n", "groups", "rate"), [(40, 4, 0.1), (37, 5, 0.02)])
def test_amplified_banded_event_is_the_poisson_composition(n, groups, rate):
    strategy = optimise_banded(n, groups, CyclicPoisson(groups))
    participation = CyclicPoisson(groups, sampling_rate=rate)
    sigma, delta = 1.2, 1e-6
    accounting = correlated_accounting(strategy, participation, n, sigma)
    assert accounting.amplified
    column = float(np.max(np.linalg.norm(strategy.matrix(n), axis=0)))
    rounds = -(-n // groups)
    expected = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(sigma / column)), rounds
    )
    ours = compute_epsilon(accounting.event, delta)
    assert ours == pytest.approx(dp_accounting_epsilon(expected, delta), rel=2e-3)
    # Amplification is worth having: the same run charged without it costs more.
    unamplified = correlated_event(strategy, CyclicPoisson(groups), n, sigma)
    assert compute_epsilon(unamplified, delta) > 2 * ours


@needs_dp_accounting
@pytest.mark.parametrize(
    ("strategy", "participation", "steps"),
    [
        (Blt((0.5, 0.95), (0.3, 0.15)), MinSeparation.epochs(3, 50), 150),
        (BandedStrategy((1.0, 0.5, 0.3)), CyclicPoisson(3, sampling_rate=0.05), 300),
    ],
)
def test_calibrated_sigma_meets_the_target_and_no_more(strategy, participation, steps):
    target, delta = 2.0, 1e-6
    sigma = calibrate_correlated_noise(strategy, participation, steps, target, delta, rtol=1e-3)
    relation = correlated_accounting(strategy, participation, steps, sigma).relation

    def epsilon(s: float) -> float:
        event = correlated_event(strategy, participation, steps, s)
        return compute_epsilon(event, delta, relation=relation)

    assert epsilon(sigma) <= target
    assert epsilon(sigma * (1 - 3e-3)) > target  # tight: a visibly smaller σ misses
    # Independently: dp_accounting's ε at the same σ also meets the target (up to its grid).
    accounting = correlated_accounting(strategy, participation, steps, sigma)
    if accounting.amplified:
        theirs_event = dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(
                participation.sampling_rate,
                dpa.GaussianDpEvent(sigma / accounting.sensitivity.norm),
            ),
            participation.rounds(steps),
        )
    else:
        theirs_event = dpa.GaussianDpEvent(sigma / accounting.sensitivity.norm)
    assert dp_accounting_epsilon(theirs_event, delta) <= target * (1 + 2e-3)
