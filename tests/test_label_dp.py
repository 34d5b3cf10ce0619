"""Label-only DP: the RR channel, RRWithPrior against Ghazi et al.'s formula, and the ledger's ε."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from dpfy.access.label_dp import forward_corrected_loss, stage_partition, train_label_private
from dpfy.access.label_ledger import LabelBudgetExhausted, LabelLedger
from dpfy.access.rr_prior import (
    randomized_response_with_prior,
    rr_channel,
    rr_prior_channels,
    rr_prior_output_distribution,
    top_k_choice,
)
from dpfy.plan.accounting.events import ComposedEvent, PureDpEvent
from dpfy.plan.mechanisms import randomized_response

K = 5
DRAWS = 40_000


def _theoretical_confusion(num_classes: int, epsilon: float) -> np.ndarray:
    """P[out = j | in = i]: e^ε/(e^ε+k−1) on the diagonal, 1/(e^ε+k−1) elsewhere."""
    off = 1.0 / (math.exp(epsilon) + num_classes - 1)
    matrix = np.full((num_classes, num_classes), off)
    np.fill_diagonal(matrix, math.exp(epsilon) * off)
    return matrix


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_rr_empirical_confusion_matches_the_theoretical_channel(epsilon: float) -> None:
    rng = np.random.default_rng(1)
    theory = _theoretical_confusion(K, epsilon)
    for true in range(K):
        out = randomized_response(np.full(DRAWS, true), K, epsilon, rng=rng).output
        observed = np.bincount(out, minlength=K)
        _, p_value = stats.chisquare(observed, DRAWS * theory[true])
        assert p_value > 1e-4, (true, observed)


def test_a_wrong_channel_is_rejected_by_the_same_chi_square() -> None:
    rng = np.random.default_rng(2)
    out = randomized_response(np.zeros(DRAWS, dtype=int), K, 1.0, rng=rng).output
    wrong = _theoretical_confusion(K, 1.2)[0]  # the test can fail: a nearby ε is rejected
    _, p_value = stats.chisquare(np.bincount(out, minlength=K), DRAWS * wrong)
    assert p_value < 1e-6


def _paper_k_star(prior: np.ndarray, epsilon: float) -> int:
    """Ghazi et al. Alg. 2, written out: argmax over k of e^ε/(e^ε+k−1) · (top-k prior mass)."""
    ranked = sorted(prior, reverse=True)
    scores = [
        math.exp(epsilon) / (math.exp(epsilon) + k - 1) * sum(ranked[:k])
        for k in range(1, len(prior) + 1)
    ]
    return int(np.argmax(scores)) + 1


@pytest.mark.parametrize("epsilon", [0.3, 1.0, 3.0])
def test_rr_prior_picks_the_top_k_that_maximises_the_keep_probability(epsilon: float) -> None:
    rng = np.random.default_rng(3)
    priors = rng.dirichlet(np.full(K, 0.4), size=200)
    order, k_star = top_k_choice(priors, epsilon)
    assert list(k_star) == [_paper_k_star(p, epsilon) for p in priors]
    for row, ranks in zip(priors, order, strict=True):
        assert np.all(np.diff(row[ranks]) <= 0)  # classes by decreasing prior


def test_a_uniform_prior_is_plain_randomised_response() -> None:
    distribution = rr_prior_output_distribution(np.full(K, 1.0 / K), 2, 1.0)
    np.testing.assert_allclose(distribution, _theoretical_confusion(K, 1.0)[2])


@pytest.mark.parametrize("label", [0, 1, 3])
def test_rr_prior_output_distribution_matches_the_paper_and_sampling(label: int) -> None:
    epsilon, prior = 1.0, np.array([0.45, 0.35, 0.1, 0.06, 0.04])
    size = _paper_k_star(prior, epsilon)
    assert size == 2
    expected = np.zeros(K)
    if label < size:  # inside the top set: kept w.p. e^ε/(e^ε+k*−1), else another member
        keep = math.exp(epsilon) / (math.exp(epsilon) + size - 1)
        expected[:size] = (1 - keep) / (size - 1)
        expected[label] = keep
    else:  # outside: a uniform member of the top set
        expected[:size] = 1.0 / size
    np.testing.assert_allclose(rr_prior_output_distribution(prior, label, epsilon), expected)
    rng = np.random.default_rng(4)
    out = randomized_response_with_prior(
        np.full(DRAWS, label), np.tile(prior, (DRAWS, 1)), epsilon, rng=rng
    )
    observed = np.bincount(out, minlength=K)
    support = expected > 0
    assert observed[~support].sum() == 0
    _, p_value = stats.chisquare(observed[support], DRAWS * expected[support])
    assert p_value > 1e-4


@pytest.mark.parametrize("epsilon", [0.2, 1.0, 4.0])
def test_rr_prior_is_epsilon_dp_for_every_pair_of_labels(epsilon: float) -> None:
    rng = np.random.default_rng(5)
    for prior in rng.dirichlet(np.full(K, 0.3), size=50):
        table = np.array([rr_prior_output_distribution(prior, y, epsilon) for y in range(K)])
        for output in np.flatnonzero(table[0] > 0):
            ratio = table[:, output].max() / table[:, output].min()
            assert ratio <= math.exp(epsilon) * (1 + 1e-12)


def test_the_ledger_epsilon_of_disjoint_stages_is_epsilon_once() -> None:
    ledger = LabelLedger(1000, target_epsilon=2.0)
    for stage, part in enumerate(stage_partition(1000, 4, seed=0)):
        ledger.record(part, 2.0, mechanism="rr" if stage == 0 else "rr-prior", stage=stage)
    assert ledger.epsilon == 2.0  # parallel composition: closed form max over examples = ε
    assert ledger.max_times_randomised == 1 and ledger.labels_randomised == 1000
    assert ledger.events() == ComposedEvent((PureDpEvent(2.0),))


def test_the_ledger_composes_a_label_randomised_twice_sequentially() -> None:
    ledger = LabelLedger(10)
    ledger.record(np.arange(6), 0.5, mechanism="rr")
    ledger.record(np.arange(4, 10), 1.25, mechanism="rr")
    assert ledger.epsilon == pytest.approx(1.75)  # examples 4, 5: 0.5 + 1.25
    assert ledger.events() == ComposedEvent((PureDpEvent(0.5), PureDpEvent(1.25)))


def test_the_ledger_refuses_a_release_past_the_target_before_it_happens() -> None:
    ledger = LabelLedger(10, target_epsilon=1.0)
    ledger.record(np.arange(5), 1.0, mechanism="rr")
    with pytest.raises(LabelBudgetExhausted, match="Nothing was released"):
        ledger.record(np.array([4, 7]), 0.1, mechanism="rr")
    ledger.record(np.arange(5, 10), 1.0, mechanism="rr")  # disjoint: fits
    assert ledger.epsilon == 1.0


def test_the_ledger_refuses_repeated_indices_and_other_mechanisms() -> None:
    ledger = LabelLedger(10)
    with pytest.raises(ValueError, match="two releases"):
        ledger.record(np.array([1, 1]), 1.0, mechanism="rr")
    with pytest.raises(ValueError, match="pure ε-label-DP"):
        ledger.record(np.array([1]), 1.0, mechanism="gaussian")


def test_stages_partition_every_example_once() -> None:
    parts = stage_partition(103, 3, seed=7)
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))


def _factory() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _separable(n: int = 600) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (n,), generator=generator)
    features = torch.randn(n, 4, generator=generator) * 0.3
    features[torch.arange(n), labels] += 2.0
    return features, labels


@pytest.mark.parametrize(("mechanism", "stages"), [("rr", 1), ("rr-prior", 2)])
def test_label_private_training_randomises_each_label_once_and_learns(
    mechanism: str, stages: int
) -> None:
    features, labels = _separable()
    result = train_label_private(
        _factory, features, labels, 3, 2.0, mechanism=mechanism, stages=stages, epochs=5, seed=0
    )
    assert result.ledger.epsilon == 2.0 and result.ledger.max_times_randomised == 1
    assert [r.mechanism for r in result.ledger.releases] == ["rr", "rr-prior"][:stages]
    assert sum(result.stage_sizes) == len(labels)
    predictions = result.model(features).argmax(1)
    assert (predictions == labels).float().mean() > 0.9


def test_stages_with_plain_rr_are_refused() -> None:
    features, labels = _separable(30)
    with pytest.raises(ValueError, match="rr-prior only"):
        train_label_private(_factory, features, labels, 3, 1.0, mechanism="rr", stages=2)


@pytest.mark.parametrize("epsilon", [0.3, 1.0, 3.0])
def test_rr_prior_channels_hold_each_examples_output_distribution(epsilon: float) -> None:
    priors = np.random.default_rng(6).dirichlet(np.full(K, 0.3), size=60)
    channels = rr_prior_channels(priors, epsilon)
    for prior, channel in zip(priors, channels, strict=True):
        for y in range(K):
            np.testing.assert_allclose(channel[y], rr_prior_output_distribution(prior, y, epsilon))
    np.testing.assert_allclose(rr_channel(K, epsilon), _theoretical_confusion(K, epsilon))


def test_the_forward_corrected_loss_is_the_noisy_labels_likelihood() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.5, 0.0]])
    channel = torch.from_numpy(rr_channel(3, 1.0)).float()
    labels = torch.tensor([1, 2])
    p = torch.softmax(logits, dim=1)
    expected = -torch.log((p @ channel)[torch.arange(2), labels]).mean()
    loss = forward_corrected_loss(logits, labels, channel.expand(2, 3, 3))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
