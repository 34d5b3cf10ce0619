"""The privacy plan: made by one resolver per (algorithm, unit), read by the one private step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.loader import rest_of_run
from dpfy.data.provenance import Provenance
from dpfy.plan.accounting import make_accountant
from dpfy.plan.accounting.events import SelfComposedEvent
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.plan.variants import PlanRequest, make_plan, variant_keys
from dpfy.train.grads import make_engine
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.noise.mechanisms import MECHANISMS
from dpfy.train.optim import DPOptimizer
from dpfy.train.variants import variant_for


def request(**overrides) -> PlanRequest:
    values = dict(records=1000, batch_size=50, delta=1e-5, max_grad_norm=1.0, steps=40,
                  noise_multiplier=1.1)  # fmt: skip
    values.update(overrides)
    return PlanRequest(**values)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def data(n: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=generator), torch.arange(n) % 3)


#: Plans dpfy.federated trains (its rounds clip each user's model change), not make_private.
FEDERATED = {"dp-fedavg", "dp-fedsgd"}


def test_every_resolver_has_a_training_variant_and_a_mechanism():
    for algorithm, unit in variant_keys():
        if algorithm not in FEDERATED:
            assert variant_for(algorithm, unit).unit == unit
        plan = make_plan(request(), algorithm, unit)
        assert plan.algorithm == algorithm
        assert plan.mechanism in MECHANISMS
        assert plan.clipping_unit in ("example", "microbatch", "user")


@pytest.mark.parametrize(
    ("algorithm", "unit", "message"),
    [("dp-foo", "example", "algorithm must be one of"), ("dp-ftrl", "user", "drop user_ids")],
)
def test_an_unknown_variant_is_refused_with_the_choices(algorithm, unit, message):
    with pytest.raises(ValueError, match=message):
        make_plan(request(), algorithm, unit)


def test_calibrated_sigma_meets_the_target_on_the_events_the_ledger_will_record():
    plan = make_plan(request(noise_multiplier=None, target_epsilon=2.0, epochs=3, steps=None))
    assert plan.steps == 60  # ⌈3 · 1000 / 50⌉
    event = SelfComposedEvent(plan.sampling_record().event(plan.noise_multiplier), plan.steps)
    epsilon = make_accountant("pld").compose(event).epsilon(plan.delta)
    assert 2.0 * 0.99 < epsilon <= 2.0


def test_each_variant_fixes_its_relation_and_sampling():
    fixed = make_plan(request(sampler="fixed-size"))
    assert (fixed.relation, fixed.accountant) == ("replace-one", "rdp")
    assert fixed.sampling_record().batch_size == 50
    tree = make_plan(request(restart_every=5), "dp-ftrl")
    assert (tree.relation, tree.mechanism, tree.restart_every, tree.tree) == (
        "zero-out", "tree-aggregation", 5, "efficient",
    )  # fmt: skip
    users = make_plan(request(examples=4000), "dp-sgd", "user")
    assert users.clipping_unit == "user" and users.sampling_record().unit == "user"
    micro = make_plan(request(microbatch_size=5))
    assert micro.clipping_unit == "microbatch" and micro.divisor == 10 and micro.sensitivity == 2


@pytest.mark.parametrize(
    ("algorithm", "unit", "option", "message"),
    [
        ("dp-sgd", "example", {"tree": "plain"}, "tree not supported with DP-SGD"),
        ("dp-sgd", "user", {"microbatch_size": 2}, "microbatch_size not supported with user_ids"),
        ("dp-sgd", "user", {"sampler": "shuffle"}, "sampler not supported with user_ids"),
        ("dp-ftrl", "example", {"sampler": "poisson"}, "no meaning for it"),
    ],
)
def test_an_option_a_variant_cannot_honour_is_refused(algorithm, unit, option, message):
    with pytest.raises(ValueError, match=message):
        make_plan(request(**option), algorithm, unit)


def test_the_step_refuses_a_sampler_that_is_not_the_plans():
    # The ledger records what the sampler reports: a record the plan was not made for (another
    # q, another kind) would be accounted as something else, so it is refused up front.
    plan = make_plan(request())
    net = model()
    engine = make_engine(net)
    other = SamplingRecord(SamplingKind.POISSON, 0.1, 1000)  # the plan has q = 0.05
    with pytest.raises(ValueError, match="sampler reports"):
        DPOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), engine, PrivacyLedger(1e-5), other, plan,
            provenance=Provenance(),
        )  # fmt: skip
    engine.detach()


def test_the_step_refuses_a_ledger_under_another_relation():
    plan = make_plan(request(sampler="fixed-size"))  # replace-one
    net = model()
    engine = make_engine(net)
    with pytest.raises(ValueError, match="replace-one"):
        DPOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), engine, PrivacyLedger(1e-5),
            plan.sampling_record(), plan, provenance=Provenance(),
        )  # fmt: skip
    engine.detach()


@pytest.mark.parametrize(
    "options",
    [{}, {"microbatch_size": 2}, {"user_ids": torch.arange(96) % 24}, {"algorithm": "dp-ftrl"}],
    ids=["example", "microbatch", "user", "dp-ftrl"],
)
def test_every_variant_takes_the_same_private_step(options):
    net = model()
    private = dpfy.make_private(
        net, torch.optim.SGD(net.parameters(), lr=0.1), data(), batch_size=8, delta=1e-5,
        max_grad_norm=1.0, noise_multiplier=1.0, steps=3, seed=0, **options,
    )  # fmt: skip
    assert type(private.optimizer) is DPOptimizer
    assert private.optimizer.plan is private.plan
    for x, y in rest_of_run(private.loader):
        private.optimizer.zero_grad()
        nn.functional.cross_entropy(private.model(x), y).backward()
        private.optimizer.step()
    assert private.ledger.steps == 3


def test_a_checkpoint_with_another_mechanisms_state_is_refused(tmp_path):
    def run(**options):
        net = model()
        return dpfy.make_private(
            net, torch.optim.SGD(net.parameters(), lr=0.1), data(), batch_size=8, delta=1e-5,
            max_grad_norm=1.0, noise_multiplier=1.0, steps=3, seed=0, **options,
        )  # fmt: skip

    private = run()
    with pytest.raises(ValueError, match="tree-aggregation"):
        private.optimizer.mechanism.load_state_dict(
            run(algorithm="dp-ftrl").optimizer.mechanism.state_dict()
        )


def test_replacing_the_noise_source_keeps_the_mechanism():
    net = model()
    private = dpfy.make_private(
        net, torch.optim.SGD(net.parameters(), lr=0.1), data(), batch_size=8, delta=1e-5,
        max_grad_norm=1.0, noise_multiplier=1.0, steps=3, algorithm="dp-ftrl",
    )  # fmt: skip
    mechanism = private.optimizer.mechanism

    class Zero:
        def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
            return torch.zeros_like(like)

    private.optimizer.noise = Zero()
    assert private.optimizer.mechanism is mechanism and isinstance(mechanism.source, Zero)


def test_the_plan_round_trips_as_a_plain_dict():
    plan = make_plan(request(restart_every=5), "dp-ftrl")
    assert type(plan)(**dataclasses.asdict(plan)) == plan


def test_a_federated_plan_is_not_trained_by_make_private():
    net = model()
    with pytest.raises(ValueError, match=r"dpfy\.federated"):
        dpfy.make_private(
            net, torch.optim.SGD(net.parameters(), lr=0.1), data(), batch_size=8, delta=1e-5,
            max_grad_norm=1.0, noise_multiplier=1.0, steps=3, algorithm="dp-fedavg",
            user_ids=torch.arange(96) % 24,
        )  # fmt: skip
