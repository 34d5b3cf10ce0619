"""The black-box one-run audit: input-space canaries, one private run, the final model's losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpfy.audit.blackbox import MIN_CANARIES, insert_canaries, score_canaries
from dpfy.data.datasets import load_dataset
from dpfy.train.builder import make_private
from dpfy.train.models import build_model

DELTA = 1e-4


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _model(data) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model("mlp", data.input_shape, data.num_classes)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _private_audit(data, epsilon: float, canaries: int = 200, seed: int = 0):
    trainset, included, canary_set = insert_canaries(data.train, canaries, seed, coin_seed=seed)
    model, optimizer = _model(data)
    private = make_private(
        model, optimizer, trainset, batch_size=128, epochs=4, target_epsilon=epsilon,
        delta=DELTA, max_grad_norm=1.0, seed=seed,
    )  # fmt: skip
    criterion = nn.CrossEntropyLoss()
    for _ in range(private.loader.epochs):
        for x, y in private.loader:
            private.optimizer.zero_grad()
            criterion(private.model(x), y).backward()
            private.optimizer.step()
    claim = private.epsilon()
    return score_canaries(private.model, canary_set, included, delta=DELTA, claimed_epsilon=claim)


def test_canaries_are_public_mislabelled_records_each_kept_by_its_own_coin(digits):
    x, y = digits.train.tensors
    trainset, included, canaries = insert_canaries(digits.train, 100, seed=3, coin_seed=5)
    _, included_again, same = insert_canaries(digits.train, 100, seed=3, coin_seed=6)
    assert torch.equal(canaries.tensors[0], same.tensors[0])  # the public seed picks them
    assert not np.array_equal(included, included_again)  # the coins are the coin seed's
    assert len(trainset) == len(y) - 100 + int(included.sum())
    originals = [
        int(np.flatnonzero((x == row).flatten(1).all(1))[0]) for row in canaries.tensors[0]
    ]
    assert bool((canaries.tensors[1] != y[originals]).all())  # every label is wrong
    kept = trainset.tensors[0][len(y) - 100 :]
    assert torch.equal(kept, canaries.tensors[0][torch.as_tensor(included)])


@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_a_correct_private_run_stays_below_its_claim(digits, epsilon):
    result = _private_audit(digits, epsilon)
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.claimed_epsilon == pytest.approx(epsilon, rel=0.1)


def test_epsilon_hat_is_reported_with_its_canaries_confidence_and_threat_model(digits):
    result = _private_audit(digits, 8.0, canaries=100, seed=1)
    assert result.method == "one-run" and result.threat_model == "black-box"
    assert result.canaries == 100 and result.confidence == 0.95 and result.runs == 1
    assert 0 < result.guesses <= 100 and result.correct <= result.guesses


def test_a_non_private_run_shows_a_clearly_larger_epsilon_hat_than_a_private_one(digits):
    trainset, included, canaries = insert_canaries(digits.train, 100, seed=0, coin_seed=0)
    model, optimizer = _model(digits)
    criterion = nn.CrossEntropyLoss()
    shuffle = torch.Generator().manual_seed(0)
    for _ in range(30):  # no clipping, no noise: the canaries are memorised
        for x, y in DataLoader(trainset, batch_size=64, shuffle=True, generator=shuffle):
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    leaky = score_canaries(model, canaries, included, delta=DELTA)
    private = _private_audit(digits, 1.0, canaries=100)
    assert leaky.epsilon_lower_bound >= 1.0
    assert leaky.epsilon_lower_bound > private.epsilon_lower_bound + 1.0


def test_too_few_canaries_are_refused_in_one_line(digits):
    with pytest.raises(ValueError, match=f"at least {MIN_CANARIES} canaries, got 5") as err:
        insert_canaries(digits.train, 5)
    assert "\n" not in str(err.value)


def test_a_dataset_too_small_for_its_canaries_is_refused_naming_the_most_it_can_give():
    small = TensorDataset(torch.randn(60, 3), torch.arange(60) % 2)
    with pytest.raises(
        ValueError, match="more than half of the 60 training records; use at most 30"
    ):
        insert_canaries(small, 40)


def test_a_loss_that_averages_the_canaries_is_refused(digits):
    _, included, canaries = insert_canaries(digits.train, 40)
    model, _ = _model(digits)
    with pytest.raises(ValueError, match="reduction='none'"):
        score_canaries(model, canaries, included, delta=DELTA, loss_fn=nn.CrossEntropyLoss())
