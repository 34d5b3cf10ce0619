"""Balls-in-bins sampling (Chua et al. 2025): assignment statistics, its per-epoch accounting
against dp_accounting, and the lower bound the card states for once-per-epoch batches."""

from __future__ import annotations

import dp_accounting as dpa
import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.sampling import BallsInBinsSampler, make_sampler
from dpfy.plan.accounting import make_accountant
from dpfy.plan.accounting.epoch_lower_bound import epoch_epsilon_lower_bound
from dpfy.plan.accounting.events import (
    BallsInBinsEpochEvent,
    GaussianEvent,
    NoOpEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
)
from dpfy.plan.sampling import SamplingKind, SamplingRecord


def _epochs(sampler: BallsInBinsSampler, epochs: int) -> list[list[list[int]]]:
    """The batches of ``epochs`` whole epochs, epoch by epoch."""
    k, out, current = sampler.batches_per_epoch, [], []
    while len(out) < epochs:
        for batch in sampler:
            current.append(batch)
            if len(current) == k:
                out.append(current)
                current = []
    return out


def test_each_example_is_in_exactly_one_batch_per_epoch():
    sampler = BallsInBinsSampler(103, 10, generator=torch.Generator().manual_seed(0))
    assert sampler.batches_per_epoch == 10
    for epoch in _epochs(sampler, 20):
        assert sorted(i for batch in epoch for i in batch) == list(range(103))


def test_each_example_picks_its_batch_uniformly_and_independently():
    n, b, epochs = 60, 10, 3000
    sampler = BallsInBinsSampler(n, b, generator=torch.Generator().manual_seed(1))
    k = sampler.batches_per_epoch
    where = torch.zeros(epochs, n, dtype=torch.long)
    sizes = []
    for e, epoch in enumerate(_epochs(sampler, epochs)):
        for j, batch in enumerate(epoch):
            where[e, batch] = j
            sizes.append(len(batch))
    # one example's batch is uniform on the k batches
    counts = torch.bincount(where[:, 7], minlength=k).double()
    assert stats.chisquare(counts.numpy()).pvalue > 1e-4
    # two examples share a batch with probability 1/k (independent assignments)
    shared = float((where[:, 3] == where[:, 4]).double().mean())
    assert abs(shared - 1 / k) < 4 * (1 / k * (1 - 1 / k) / epochs) ** 0.5
    # batch sizes are Binomial(N, 1/k)
    sizes_t = torch.tensor(sizes, dtype=torch.double)
    mean, var = n / k, n * (1 / k) * (1 - 1 / k)
    assert abs(float(sizes_t.mean()) - mean) < 4 * (var / len(sizes)) ** 0.5
    assert float(sizes_t.var()) == pytest.approx(var, rel=0.1)
    assert 0 in sizes or min(sizes) >= 0  # empty batches are yielded, never skipped


def test_resumed_sampler_continues_the_same_assignment():
    first = BallsInBinsSampler(50, 7, 10, torch.Generator().manual_seed(2), total=30)
    drawn = [b for _ in range(3) for b in first]
    again = BallsInBinsSampler(50, 7, 10, torch.Generator().manual_seed(9), total=30)
    again.load_state_dict(first.state_dict(position=12))
    assert [b for _ in range(2) for b in again] == drawn[12:]
    assert again.epoch_position(13) == first.epoch_position(13)


def test_an_epoch_is_charged_one_gaussian_at_its_first_step():
    record = SamplingRecord(SamplingKind.BALLS_IN_BINS, 10 / 100, 100, 10)
    assert record.at_epoch_position(0).event(1.3) == BallsInBinsEpochEvent(1.3, 10)
    assert record.at_epoch_position(4).event(1.3) == NoOpEvent()
    with pytest.raises(ValueError, match="place in the epoch"):
        record.event(1.3)
    with pytest.raises(ValueError, match="place in the epoch"):
        record.at_epoch_position(None)
    assert SamplingRecord.from_dict(record.at_epoch_position(0).to_dict()).epoch_start is True


def _train(sampler: str, steps: int, sigma: float = 1.0, seed: int = 3):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(120, 4), torch.randint(0, 3, (120,)))
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=20, delta=1e-5,
        max_grad_norm=1.0, steps=steps, noise_multiplier=sigma, sampler=sampler, seed=seed,
    )  # fmt: skip
    for _ in range(private.loader.epochs):
        for x, y in private.loader:
            nn.functional.cross_entropy(private.model(x), y).backward()
            private.optimizer.step()
            private.optimizer.zero_grad()
    return private


def test_trained_epsilon_is_one_gaussian_per_begun_epoch_by_dp_accounting():
    """k = 6 steps per epoch: 14 steps begin 3 epochs, each charged as random allocation (1 of
    6), below 3 Gaussians of σ (dp_accounting)."""
    private = _train("balls-in-bins", 14, sigma=1.2)
    reference = dpa.pld.PLDAccountant()
    reference.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.2), 3))
    charged = make_accountant("pld").compose(BallsInBinsEpochEvent(1.2, 6), 3).epsilon(1e-5)
    assert private.ledger.epsilon() == pytest.approx(charged, rel=1e-6)
    assert private.ledger.epsilon() < reference.get_epsilon(1e-5)
    assert private.ledger.steps == 14


def test_make_sampler_builds_balls_in_bins():
    sampler = make_sampler("balls-in-bins", 100, 10, 10, torch.Generator().manual_seed(0))
    assert isinstance(sampler, BallsInBinsSampler)
    assert sampler.record.kind is SamplingKind.BALLS_IN_BINS


# ---------------------------------------------------------------------------------------------
# The lower bound for once-per-epoch batches
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sigma", "epochs"), [(1.0, 1), (2.0, 5), (0.7, 3)])
def test_lower_bound_of_one_batch_per_epoch_is_the_gaussian_epsilon(sigma, epochs):
    """k = 1: the example is in the epoch's only batch; the bound is E Gaussians' ε, from
    below (dp_accounting, independently)."""
    reference = dpa.pld.PLDAccountant()
    reference.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma), epochs))
    exact = reference.get_epsilon(1e-5)
    bound = epoch_epsilon_lower_bound(sigma, 1, epochs, 1e-5)
    assert exact * 0.995 <= bound <= exact * (1 + 1e-6)


@pytest.mark.parametrize(("n", "b", "sigma", "epochs"), [(6000, 60, 0.8, 3), (20000, 400, 1.0, 5)])
def test_lower_bound_lies_below_every_upper_bound(n, b, sigma, epochs):
    """Below the no-amplification ε (proven upper bound) and, here, the Poisson figure."""
    k = n // b
    bound = epoch_epsilon_lower_bound(sigma, k, epochs, 1e-6, in_epoch=k * b / n)
    gaussians = make_accountant("pld").compose(SelfComposedEvent(GaussianEvent(sigma), epochs))
    poisson = make_accountant("pld").compose(
        SelfComposedEvent(PoissonSampledEvent(b / n, GaussianEvent(sigma)), epochs * k)
    )
    assert 0 < bound < gaussians.epsilon(1e-6)
    assert bound < poisson.epsilon(1e-6) * 1.5
    more = epoch_epsilon_lower_bound(sigma, k, epochs + 2, 1e-6, in_epoch=k * b / n)
    assert more > bound


# ---------------------------------------------------------------------------------------------
# The card
# ---------------------------------------------------------------------------------------------
def _card(private, tmp_path) -> str:
    return private.report(tmp_path / "card")["markdown"].read_text()


def test_card_for_shuffled_batches_never_gives_the_poisson_figure_alone(tmp_path):
    with pytest.warns(UserWarning, match="NOT Poisson"):
        private = _train("shuffle", 12)
    card = _card(private, tmp_path)
    assert "NOT met" in card
    assert "ε under the Poisson-sampling assumption" in card
    assert "proven to be at least" in card  # the lower bound beside the Poisson figure
    assert "To shuffle or not to shuffle" in card


def test_card_for_balls_in_bins_states_the_proven_bound_and_claims_no_amplification(tmp_path):
    private = _train("balls-in-bins", 12)
    card = _card(private, tmp_path)
    assert "random-allocation bound" in card and "Feldman & Shenfeld" in card
    assert "Monte Carlo" in card  # says there is none: "no Monte Carlo"
    assert "proven to be at least" in card
    assert "ε under the Poisson assumption" in card  # the comparison figure is kept
    gaussians = make_accountant("pld").compose(GaussianEvent(1.0), 2).epsilon(1e-5)
    assert private.ledger.summary().total_epsilon < gaussians
