"""Input-level DP: each record's noise is calibrated to the public bounds' sensitivity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpfy.access.input_dp import FeatureBounds, InputRandomiser
from dpfy.plan.mechanisms import analytic_gaussian_sigma

D, N = 8, 20_000


def _bounds() -> FeatureBounds:
    return FeatureBounds(np.zeros(D), np.linspace(1.0, 2.0, D), source="test")


def test_laplace_scale_is_the_l1_width_over_the_feature_epsilon() -> None:
    randomiser = InputRandomiser(_bounds(), epsilon=4.0, label_share=0.25)
    width = float(np.sum(np.linspace(1.0, 2.0, D)))
    assert randomiser.sensitivity == pytest.approx(width)
    assert randomiser.noise_scale == pytest.approx(width / 3.0)  # ε_x = 4 · 0.75
    x = np.full((N, D), 0.5)
    noise = randomiser(x, rng=np.random.default_rng(0)).features - x
    _, p_value = stats.kstest(noise.ravel()[:N], stats.laplace(scale=width / 3.0).cdf)
    assert p_value > 1e-4


def test_gaussian_sigma_is_calibrated_to_the_l2_width() -> None:
    randomiser = InputRandomiser(_bounds(), epsilon=2.0, mechanism="gaussian", delta=1e-5)
    width = float(np.linalg.norm(np.linspace(1.0, 2.0, D)))
    sigma = analytic_gaussian_sigma(width, 1.0, 1e-5)  # ε_x = 2 · (1 − 0.5)
    assert randomiser.noise_scale == pytest.approx(sigma)
    x = np.zeros((N, D))
    noise = randomiser(x, rng=np.random.default_rng(1)).features
    assert np.std(noise) == pytest.approx(sigma, rel=0.02)


def test_records_are_clipped_into_the_bounds_before_the_noise() -> None:
    randomiser = InputRandomiser(_bounds(), epsilon=1e6, label_share=0.0)  # almost no noise
    far = np.full((3, D), 100.0)
    released = randomiser(far, rng=np.random.default_rng(2)).features
    np.testing.assert_allclose(released, np.tile(np.linspace(1.0, 2.0, D), (3, 1)), atol=1e-3)


def test_labels_go_through_randomised_response_at_their_share() -> None:
    randomiser = InputRandomiser(_bounds(), epsilon=2.0, label_share=0.5)
    out = randomiser(np.zeros((N, D)), np.zeros(N, dtype=int), 4, np.random.default_rng(3))
    keep = math.exp(1.0) / (math.exp(1.0) + 3)
    assert np.mean(out.labels == 0) == pytest.approx(keep, abs=0.01)


def test_unbounded_features_are_refused() -> None:
    with pytest.raises(ValueError, match="finite public bound on every feature"):
        FeatureBounds(np.zeros(2), np.array([1.0, np.inf]), source="test")


def test_the_gaussian_randomiser_needs_delta() -> None:
    with pytest.raises(ValueError, match="needs delta"):
        InputRandomiser(_bounds(), epsilon=1.0, mechanism="gaussian")
