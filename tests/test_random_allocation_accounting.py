"""Balls-in-bins epochs accounted as random allocation (1 of t steps; Feldman & Shenfeld 2025):
exact at t = 1, never below an independent Monte Carlo estimate of the dominating pair, never
above the unamplified Gaussian, close to Poisson, charged once per epoch, saved and calibrated."""

from __future__ import annotations

import json

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.plan.accounting import (
    GaussianEvent,
    PldAccountant,
    PldPrecision,
    SelfComposedEvent,
    UnsupportedEventError,
    make_accountant,
)
from dpfy.plan.accounting.epoch_lower_bound import epoch_epsilon_lower_bound
from dpfy.plan.accounting.event_codec import decode_event, encode_event
from dpfy.plan.accounting.events import BallsInBinsEpochEvent, NoOpEvent
from dpfy.plan.accounting.pld_pairs import Direction
from dpfy.plan.accounting.random_allocation import DiscreteLossPair
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.plan.variants import PlanRequest, make_plan
from dpfy.train.ledger import PrivacyLedger


def _epsilon(event, delta: float) -> float:
    return make_accountant("pld").compose(event).epsilon(delta)


# ---------------------------------------------------------------------------------------------
# (a) one step per epoch is the Gaussian mechanism, exactly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sigma", "epochs"), [(0.8, 1), (1.5, 4)])
def test_one_step_per_epoch_is_the_gaussian_mechanism_by_dp_accounting(sigma, epochs):
    reference = dpa.pld.PLDAccountant()
    reference.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma), epochs))
    ours = _epsilon(SelfComposedEvent(BallsInBinsEpochEvent(sigma, 1), epochs), 1e-5)
    assert ours == pytest.approx(reference.get_epsilon(1e-5), rel=2e-3)


# ---------------------------------------------------------------------------------------------
# (b) never below an independent Monte Carlo estimate of the dominating pair, both directions
# ---------------------------------------------------------------------------------------------
def _monte_carlo_lower(sigma: float, t: int, epsilon: float, removal: bool) -> float:
    """A lower confidence bound (mean − 5 standard errors) on δ(ε) of P = (1/t)Σⱼ N(eⱼ, σ²I)
    against Q = N(0, σ²I): removal E_P[(1 − e^{ε−L})₊], addition E_Q[(1 − e^{ε+L})₊], with
    L = log(dP/dQ) = log((1/t) Σⱼ exp((2xⱼ − 1)/(2σ²)))."""
    rng = np.random.default_rng(20260 + t)
    n = 400_000
    x = rng.normal(0.0, sigma, size=(n, t))
    if removal:
        x[np.arange(n), rng.integers(0, t, size=n)] += 1.0
    log_ratio = np.logaddexp.reduce((2 * x - 1) / (2 * sigma**2), axis=1) - np.log(t)
    loss = log_ratio if removal else -log_ratio
    samples = np.clip(-np.expm1(epsilon - loss), 0.0, None)
    return float(samples.mean() - 5 * samples.std() / np.sqrt(n))


@pytest.mark.parametrize(
    ("t", "sigma"),
    [
        (2, 1.5),
        (4, 0.8),
        (8, 0.6),
        *(
            pytest.param(t, sigma, marks=pytest.mark.slow)  # the rest of the grid: slow suite
            for t, sigma in [(2, 0.6), (2, 0.8), (4, 0.6), (4, 1.5), (8, 0.8), (8, 1.5)]
        ),
    ],
)
def test_bound_is_never_below_a_monte_carlo_estimate_in_either_direction(t, sigma):
    accountant = PldAccountant().compose(BallsInBinsEpochEvent(sigma, t))
    removal, addition = accountant.composed()
    for epsilon in (0.25, 0.75):
        for pld, way in ((removal, True), (addition, False)):
            estimate = _monte_carlo_lower(sigma, t, epsilon, way)
            assert pld.delta(epsilon) >= estimate, (t, sigma, epsilon, way)
            # and tight: within a few percent of the estimate (where δ is resolved)
            if estimate > 1e-3:
                assert pld.delta(epsilon) <= 1.15 * estimate + 1e-3, (t, sigma, epsilon, way)


def test_two_steps_are_never_below_the_exact_curve_by_quadrature():
    """t = 2, σ = 0.6: δ(ε) of each direction is a double integral over two normals, computed
    here on a fine grid — an exact reference, also deep in removal's tail, where one large
    coordinate (above the threshold) makes the loss."""
    sigma, t = 0.6, 2
    mu = 1 / sigma
    removal, addition = PldAccountant().compose(BallsInBinsEpochEvent(sigma, t)).composed()
    z = np.linspace(-9.0, 12.0, 3001)
    weight = np.exp(-z * z / 2) / np.sqrt(2 * np.pi) * (z[1] - z[0])
    tilted, plain = np.exp(mu * z + mu * mu / 2), np.exp(mu * z - mu * mu / 2)
    both = weight[:, None] * weight[None, :]

    def exact(epsilon: float, removal_way: bool) -> float:
        if removal_way:  # E_P[(1 − e^ε·t/S)₊], S = W + Y
            s_sum = tilted[:, None] + plain[None, :]
            return float((both * np.clip(1 - np.exp(epsilon) * t / s_sum, 0, None)).sum())
        s_sum = plain[:, None] + plain[None, :]  # E_Q[(1 − e^ε·S/t)₊], S = Y₁ + Y₂
        return float((both * np.clip(1 - np.exp(epsilon) * s_sum / t, 0, None)).sum())

    for epsilon in (0.5, 3.0, 5.5, 7.0, 8.0, 9.0):
        reference = exact(epsilon, True)
        assert reference <= removal.delta(epsilon) <= 1.05 * reference, epsilon
    for epsilon in (0.5, 2.0, 3.5):
        reference = exact(epsilon, False)
        assert reference <= addition.delta(epsilon) <= 1.05 * reference + 1e-12, epsilon


def test_windowed_lattice_of_a_long_epoch_is_never_below_a_monte_carlo_estimate():
    """t = 256 at σ = 3: the sums of more than 144·e^{1/σ²} ≈ 161 coordinates are kept on a
    window that starts above 0 (mass below it rounded up in removal, to loss +∞ in addition).
    A coarser lattice (2^18 points) is still a valid bound: checked as such."""
    sigma, t, n = 3.0, 256, 40_000
    coarse = PldAccountant(precision=PldPrecision(max_points=2**18))
    removal, addition = coarse.compose(BallsInBinsEpochEvent(sigma, t)).composed()
    rng = np.random.default_rng(5)
    for pld, way in ((removal, True), (addition, False)):
        x = rng.normal(0.0, sigma, size=(n, t))
        if way:
            x[np.arange(n), rng.integers(0, t, size=n)] += 1.0
        ratio = np.logaddexp.reduce((2 * x - 1) / (2 * sigma**2), axis=1) - np.log(t)
        loss = ratio if way else -ratio
        for epsilon in (0.0, 0.005):
            samples = np.clip(-np.expm1(epsilon - loss), 0.0, None)
            estimate = samples.mean() - 5 * samples.std() / np.sqrt(n)
            assert estimate > 0.004  # resolved
            assert estimate <= pld.delta(epsilon) <= 1.2 * samples.mean(), (way, epsilon)


@pytest.mark.parametrize("removal", [True, False])
def test_composed_epochs_are_never_below_a_monte_carlo_estimate(removal):
    """Three epochs of t = 4 at σ = 1: the composed δ(ε) against the loss of three independent
    epochs summed (Monte Carlo, lower confidence bound)."""
    sigma, t, epochs, n = 1.0, 4, 3, 300_000
    rng = np.random.default_rng(11)
    loss = np.zeros(n)
    for _ in range(epochs):
        x = rng.normal(0.0, sigma, size=(n, t))
        if removal:
            x[np.arange(n), rng.integers(0, t, size=n)] += 1.0
        ratio = np.logaddexp.reduce((2 * x - 1) / (2 * sigma**2), axis=1) - np.log(t)
        loss += ratio if removal else -ratio
    pld = PldAccountant().compose(BallsInBinsEpochEvent(sigma, t), epochs).composed()
    for epsilon in (0.5, 1.5):
        samples = np.clip(-np.expm1(epsilon - loss), 0.0, None)
        estimate = samples.mean() - 5 * samples.std() / np.sqrt(n)
        assert pld[0 if removal else 1].delta(epsilon) >= estimate
        assert pld[0 if removal else 1].delta(epsilon) <= 1.15 * estimate + 1e-3


def test_discrete_pair_curves_are_the_hockey_stick_divergences_of_its_atoms():
    """Each direction's curve of a small pair equals Σ(p − e^ε p')₊ plus its infinite atom."""
    rng = np.random.default_rng(7)
    values = np.sort(rng.normal(0.0, 1.0, 12))
    p0 = rng.dirichlet(np.ones(12)) * 0.9  # 0.1 of P₀ at −∞
    p1 = p0 * np.exp(values)
    p1 *= 0.95 / p1.sum()  # 0.05 of P₁ at +∞ ...
    p0 = p1 * np.exp(-values)  # ... and P₀ consistent with it (the rest at −∞)
    pair = DiscreteLossPair(values, p1, p0, removal=True)
    for epsilon in (0.0, 0.3, 1.1):
        removal = Direction(pair, 1.0, True).hockey_stick(np.array([epsilon]))[0]
        expected = 0.05 + np.clip(p1 - np.exp(epsilon) * p0, 0, None).sum()
        assert removal == pytest.approx(expected, rel=1e-12, abs=1e-15)
        addition = Direction(pair, 1.0, False).hockey_stick(np.array([epsilon]))[0]
        rest = 1.0 - p0.sum()
        expected = rest + np.clip(p0 - np.exp(epsilon) * p1, 0, None).sum()
        assert addition == pytest.approx(expected, rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------------------------------------
# (c) between Poisson and no amplification
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sigma", "t", "epochs"), [(1.0, 50, 5), (1.5, 20, 3)])
def test_bound_is_below_the_gaussian_and_close_to_poisson(sigma, t, epochs):
    ours = _epsilon(SelfComposedEvent(BallsInBinsEpochEvent(sigma, t), epochs), 1e-5)
    gaussian = _epsilon(SelfComposedEvent(GaussianEvent(sigma), epochs), 1e-5)
    poisson = dpa.pld.PLDAccountant()
    poisson.compose(
        dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(1 / t, dpa.GaussianDpEvent(sigma)), t * epochs
        )
    )
    reference = poisson.get_epsilon(1e-5)
    assert ours < gaussian / 2
    assert 0.7 * reference < ours < 1.25 * reference


@pytest.mark.parametrize(
    ("sigma", "k", "epochs"),
    [(0.3, 3, 1), pytest.param(0.3, 3, 2, marks=pytest.mark.slow), (0.4, 100, 2)],
)
def test_small_sigma_is_never_charged_more_than_a_gaussian_per_epoch(sigma, k, epochs):
    """At small σ each coordinate's heavy tail makes the lattice coarse: the epoch's curve is
    then capped by the Gaussian's (which also dominates it), so the bound never exceeds the
    unamplified charge (dp_accounting: epochs × Gaussian of σ)."""
    ours = _epsilon(SelfComposedEvent(BallsInBinsEpochEvent(sigma, k), epochs), 1e-5)
    reference = dpa.pld.PLDAccountant()
    reference.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma), epochs))
    assert ours <= reference.get_epsilon(1e-5) * (1 + 1e-3)


@pytest.mark.parametrize(("sigma", "k", "epochs"), [(1.0, 2000, 2), (2.0, 1000, 4)])
def test_long_epochs_stay_close_to_poisson(sigma, k, epochs):
    """Thousands of steps per epoch (windowed lattice, 2^18 points): within 10 % of Poisson
    sampling at q = 1/k (dp_accounting) and above the card's lower bound."""
    coarse = PldAccountant(precision=PldPrecision(max_points=2**18))
    ours = coarse.compose(BallsInBinsEpochEvent(sigma, k), epochs).epsilon(1e-5)
    poisson = dpa.pld.PLDAccountant()
    poisson.compose(
        dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(1 / k, dpa.GaussianDpEvent(sigma)), k * epochs
        )
    )
    assert 0.9 < ours / poisson.get_epsilon(1e-5) < 1.1
    assert ours >= epoch_epsilon_lower_bound(sigma, k, epochs, 1e-5)


@pytest.mark.parametrize(("sigma", "k", "epochs"), [(1.0, 50, 3), (0.8, 120, 2)])
def test_bound_is_never_below_the_proven_lower_bound_of_once_per_epoch_batches(sigma, k, epochs):
    """An independent computation (the card's lower bound: the largest noisy sum of each epoch)
    that no valid ε can go below, at sizes a Monte Carlo check cannot reach."""
    ours = _epsilon(SelfComposedEvent(BallsInBinsEpochEvent(sigma, k), epochs), 1e-5)
    lower = epoch_epsilon_lower_bound(sigma, k, epochs, 1e-5)
    assert lower <= ours < 1.5 * lower


# ---------------------------------------------------------------------------------------------
# (d) the ledger charges one epoch event per epoch, and it survives save and load
# ---------------------------------------------------------------------------------------------
def test_a_step_charges_the_epoch_at_its_first_step_only():
    record = SamplingRecord(SamplingKind.BALLS_IN_BINS, 10 / 100, 100, 10)
    assert record.at_epoch_position(0).event(1.3) == BallsInBinsEpochEvent(1.3, 10)
    assert record.at_epoch_position(9).event(1.3) == NoOpEvent()
    # a run of 25 steps begins 3 epochs: each charged in full, the partial one too
    assert record.run_event(1.3, 25) == SelfComposedEvent(BallsInBinsEpochEvent(1.3, 10), 3)


def test_epoch_event_round_trips_through_the_codec_and_refuses_bad_fields():
    event = SelfComposedEvent(BallsInBinsEpochEvent(0.9, 234), 7)
    assert decode_event(json.loads(json.dumps(encode_event(event)))) == event
    with pytest.raises(ValueError, match="steps_per_epoch"):
        decode_event({"type": "BallsInBinsEpochEvent", "noise_multiplier": 1.0,
                      "steps_per_epoch": 0})  # fmt: skip
    with pytest.raises(ValueError, match="noise_multiplier"):
        BallsInBinsEpochEvent(-1.0, 4)


def test_trained_ledger_charges_each_begun_epoch_once_and_reloads_the_same_epsilon():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(120, 4), torch.randint(0, 3, (120,)))
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=20, delta=1e-5,
        max_grad_norm=1.0, steps=14, noise_multiplier=1.2, sampler="balls-in-bins", seed=3,
    )  # fmt: skip
    for _ in range(private.loader.epochs):
        for x, y in private.loader:
            nn.functional.cross_entropy(private.model(x), y).backward()
            private.optimizer.step()
            private.optimizer.zero_grad()
    ledger = private.ledger
    pairs = [
        (e.event, e.count) if isinstance(e, SelfComposedEvent) else (e, 1)
        for e in ledger.events().events
    ]
    assert all(isinstance(e, (NoOpEvent, BallsInBinsEpochEvent)) for e, _ in pairs)
    epochs = sum(n for e, n in pairs if isinstance(e, BallsInBinsEpochEvent))
    assert epochs == 3  # k = 6 steps per epoch: 14 steps begin 3 epochs
    expected = _epsilon(SelfComposedEvent(BallsInBinsEpochEvent(1.2, 6), 3), 1e-5)
    assert ledger.epsilon() == pytest.approx(expected, rel=1e-6)
    gaussian = _epsilon(SelfComposedEvent(GaussianEvent(1.2), 3), 1e-5)
    assert ledger.epsilon() < gaussian
    restored = PrivacyLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.epsilon() == pytest.approx(ledger.epsilon(), rel=1e-9)


# ---------------------------------------------------------------------------------------------
# (e) calibration, and what each accountant says
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow  # ~12 s: each full-precision look builds a new epoch's lattice (2^20 points)
def test_plan_calibrates_sigma_on_the_random_allocation_bound():
    plan = make_plan(
        PlanRequest(
            records=2_000,
            batch_size=100,
            delta=1e-5,
            max_grad_norm=1.0,
            epochs=3,
            target_epsilon=2.0,
            sampler="balls-in-bins",
        )
    )
    event = SelfComposedEvent(BallsInBinsEpochEvent(plan.noise_multiplier, 20), 3)
    eps = _epsilon(event, 1e-5)
    assert eps <= 2.0 and eps == pytest.approx(2.0, rel=1e-2)
    unamplified = _epsilon(SelfComposedEvent(GaussianEvent(plan.noise_multiplier), 3), 1e-5)
    assert unamplified > 2 * eps  # the amplification was used to lower σ


def test_rdp_and_replace_one_refuse_with_the_fix():
    with pytest.raises(UnsupportedEventError, match="accountant='pld'"):
        make_accountant("rdp").compose(BallsInBinsEpochEvent(1.0, 8))
    with pytest.raises(UnsupportedEventError, match="add-or-remove"):
        make_accountant("pld", "replace-one").compose(BallsInBinsEpochEvent(1.0, 8))


def test_a_balls_in_bins_plan_under_rdp_is_refused_before_training():
    request = PlanRequest(
        records=2_000,
        batch_size=100,
        delta=1e-5,
        max_grad_norm=1.0,
        epochs=3,
        noise_multiplier=1.0,
        sampler="balls-in-bins",
        accountant="rdp",
    )
    with pytest.raises(ValueError, match=r"balls-in-bins.*accountant='pld'"):
        make_plan(request)


# ---------------------------------------------------------------------------------------------
# A rewound run reuses an epoch's assignment: charged as Gaussians (train/session.py)
# ---------------------------------------------------------------------------------------------
def test_rewinding_charges_a_reused_assignment_as_gaussians(tmp_path):
    """k = 6: save at the boundary after epoch 1, train 2 steps into epoch 2, go back and train
    them again. Epoch 2's assignment is released twice: for each fixed assignment that is two
    Gaussians of σ, so the ledger must charge at least epoch 1's bound plus two Gaussians."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(120, 4), torch.randint(0, 3, (120,)))
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=20, delta=1e-5,
        max_grad_norm=1.0, steps=18, noise_multiplier=1.2, sampler="balls-in-bins", seed=3,
    )  # fmt: skip

    def train(steps: int) -> None:
        batches = iter(private.loader)
        for _ in range(steps):
            x, y = next(batches)
            nn.functional.cross_entropy(private.model(x), y).backward()
            private.optimizer.step()
            private.optimizer.zero_grad()

    train(6)
    path = private.save(tmp_path / "boundary.pt")
    train(2)
    private.load(path)
    train(2)
    floor = (
        make_accountant("pld")
        .compose(BallsInBinsEpochEvent(1.2, 6))
        .compose(GaussianEvent(1.2), 2)
        .epsilon(1e-5)
    )
    assert private.ledger.epsilon() >= floor
