"""The one private aggregation (clip → sum ÷ expected units → noise) that DP-SGD's step,
DP-FedAvg and the Flower strategy release through."""

from __future__ import annotations

import math

import pytest
import torch

from dpfy.federated.aggregate import ClippedSum
from dpfy.plan.variants import PlanRequest, make_plan
from dpfy.train.noise.source import TorchNoise
from dpfy.train.private_aggregation import PrivateAggregation


class ZeroNoise:
    """A source that draws zeros: what is left is the clipped sum alone."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)


def test_a_long_unit_is_clipped_to_c_and_divided_by_the_expected_units():
    aggregation = PrivateAggregation.gaussian(frozenset("ab"), ZeroNoise(), 1.0, 2.0, 4)
    sums = aggregation.open_sums({"a": torch.zeros(3), "b": torch.zeros(1)})
    norm = aggregation.add_clipped(
        sums, {"a": torch.tensor([30.0, 0, 40]), "b": torch.zeros(1)}, 2.0
    )
    released = aggregation.release(sums)
    assert norm == pytest.approx(50.0)
    # C/B = 2/4 along the unit's direction, whatever the realised number of units (one here).
    assert torch.allclose(released["a"], torch.tensor([0.3, 0.0, 0.4]))


def test_the_noise_on_the_average_has_std_sigma_c_over_expected_units():
    sigma, clip, divisor = 1.5, 2.0, 8
    aggregation = PrivateAggregation.gaussian(frozenset("w"), TorchNoise(3), sigma, clip, divisor)
    noise = aggregation.release(aggregation.open_sums({"w": torch.zeros(200_000)}))["w"]
    expected = sigma * clip / divisor
    # the sample std of 2e5 normals is within 1 % of the truth with overwhelming probability
    assert noise.std().item() == pytest.approx(expected, rel=0.01)
    assert noise.mean().abs().item() < 5 * expected / math.sqrt(200_000)


@pytest.mark.parametrize("algorithm", ["dp-sgd", "dp-ftrl", "blt"])
def test_every_mechanism_noises_each_parameter_once_on_sums_formed_outside_the_engine(algorithm):
    request = PlanRequest(
        records=100, batch_size=10, delta=1e-5, max_grad_norm=1.0, steps=20, noise_multiplier=1.0
    )
    plan = make_plan(request, algorithm, "example")
    params = {"w": torch.zeros(50_000)}
    aggregation = PrivateAggregation.from_plan(plan, params, TorchNoise(0))
    released = aggregation.release(aggregation.open_sums(params))["w"]
    # first step of every mechanism: the noise on step one is σC/B per coordinate (the tree's
    # first leaf, BLT's and BandMF's first row of C⁻¹ are each 1), neither zero nor doubled
    assert released.std().item() == pytest.approx(plan.noise_std / plan.divisor, rel=0.03)


def test_a_federated_round_and_a_hand_built_aggregation_release_the_same_average():
    like = {"w": torch.zeros(4)}
    units = [{"w": torch.tensor([3.0, 4.0, 0.0, 0.0])}, {"w": torch.tensor([0.1, 0.0, 0.0, 0.2])}]
    rounds = []
    for _ in range(2):
        aggregation = PrivateAggregation.gaussian(frozenset(like), TorchNoise(7), 1.0, 1.0, 5)
        rounds.append(aggregation)
    total = ClippedSum(like, 1.0, rounds[0])
    for unit in units:
        total.add(unit)
    by_hand = rounds[1].open_sums(like)
    for unit in units:
        rounds[1].add_clipped(by_hand, unit, 1.0)
    assert torch.equal(total.noisy_mean()["w"], rounds[1].release(by_hand)["w"])
