"""Paths into the one private step that a hand-built plan, a failing optimizer or a rewind open.

Each rule: the step is exact, or refused before anything changed with one message.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.provenance import Provenance
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.plan.tree_events import ftrl_step_events
from dpfy.plan.variants import PlanRequest, make_plan
from dpfy.train.checkpoints import seal, unseal
from dpfy.train.grads import make_engine
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.optim import DPOptimizer
from dpfy.train.step_record import StepRecord


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def data(n: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=generator), torch.arange(n) % 3)


def run(net: nn.Module | None = None, optimizer=None, **options) -> dpfy.PrivateTraining:
    net = model() if net is None else net
    optimizer = optimizer or torch.optim.SGD(net.parameters(), lr=0.5)
    settings = dict(batch_size=8, delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0, steps=12)
    settings.update(options)
    return dpfy.make_private(net, optimizer, data(), **settings)


def step(private: dpfy.PrivateTraining, batch) -> None:
    x, y = batch
    private.optimizer.zero_grad()
    nn.functional.cross_entropy(private.model(x), y).backward()
    private.optimizer.step()


def flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in net.parameters()])


FTRL = make_plan(
    PlanRequest(records=96, batch_size=8, delta=1e-5, max_grad_norm=1.0, steps=12,
                noise_multiplier=1.0),
    "dp-ftrl",
)  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mechanism": "gaussian", "restart_every": None, "tree": None}, "does not fit sampler"),
        ({"relation": "add-or-remove"}, "not add-or-remove"),
        ({"tree": "fancy"}, "tree must be one of"),
        ({"restart_every": 5}, "does not divide"),
        ({"mechanism": "laplace"}, "mechanism must be one of"),
    ],
)
def test_a_plan_whose_mechanism_sampling_and_relation_do_not_fit_is_refused(change, message):
    # Independent noise on batches in tree order would be charged nothing per step, and tree
    # aggregation has no bound under add-or-remove: a hand-built plan meets the resolver's rules.
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(FTRL, **change)


def test_gaussian_noise_cannot_take_tree_settings():
    plain = make_plan(PlanRequest(records=96, batch_size=8, delta=1e-5, max_grad_norm=1.0,
                                  steps=3, noise_multiplier=1.0))  # fmt: skip
    with pytest.raises(ValueError, match="belong to tree aggregation"):
        dataclasses.replace(plain, restart_every=4)


@pytest.mark.parametrize(
    "ledger",
    [
        PrivacyLedger(1e-6, relation="zero-out"),
        PrivacyLedger(1e-5, accountant="rdp", relation="zero-out"),
        PrivacyLedger(1e-5, relation="zero-out", target_epsilon=100.0),
    ],
    ids=["delta", "accountant", "target"],
)
def test_a_ledger_that_does_not_account_the_plans_claim_is_refused(ledger):
    net = model()
    engine = make_engine(net)
    record = SamplingRecord(SamplingKind.TREE_SHUFFLE, 8 / 96, 96, 8)
    with pytest.raises(ValueError, match="the plan was made for"):
        DPOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), engine, ledger, record, FTRL,
                    provenance=Provenance())  # fmt: skip
    engine.detach()


class Failing(torch.optim.SGD):
    """An update that raises after the private gradient was written (a closure-only optimizer)."""

    def step(self, closure=None):
        raise RuntimeError("this optimizer needs a closure")


@pytest.mark.parametrize("algorithm", ["dp-sgd", "dp-ftrl"])
def test_a_released_gradient_is_accounted_even_if_the_update_raises(algorithm):
    net = model()
    private = run(net, Failing(net.parameters(), lr=0.1), algorithm=algorithm)
    batch = next(iter(private.loader))
    with pytest.raises(RuntimeError, match="closure"):
        step(private, batch)
    assert private.ledger.steps == 1  # p.grad held the noisy gradient: it was released
    assert private.loader.provenance.state_dict()["stepped"] == 1


def test_going_back_to_a_checkpoint_never_replays_its_noise(tmp_path):
    # Replaying the same noise on a gradient that changed (dropout, another lr) would reveal the
    # difference of the two releases exactly; the rewound run draws fresh noise.
    private = run(seed=5)
    batches = iter(private.loader)
    step(private, next(batches))
    private.save(tmp_path / "ckpt.pt")
    before = flat(private.model)
    step(private, next(batches))
    first = flat(private.model) - before
    private.load(tmp_path / "ckpt.pt")
    step(private, next(iter(private.loader)))  # the same batch, from the same parameters
    again = flat(private.model) - before
    assert not torch.allclose(first, again)
    assert private.ledger.steps == 2 and private.epsilon() > run(seed=5).epsilon()


def test_a_dp_ftrl_run_cannot_go_back_to_an_earlier_checkpoint(tmp_path):
    private = run(algorithm="dp-ftrl", seed=5)
    batches = iter(private.loader)
    step(private, next(batches))
    private.save(tmp_path / "ckpt.pt")
    step(private, next(batches))
    after = flat(private.model)
    with pytest.raises(ValueError, match="tree nodes"):
        private.load(tmp_path / "ckpt.pt")
    assert torch.equal(flat(private.model), after) and private.ledger.steps == 2


def test_a_checkpoint_whose_tree_and_ledger_disagree_is_refused():
    private = run(algorithm="dp-ftrl", seed=5)
    step(private, next(iter(private.loader)))
    body = unseal(private.state_dict())
    body["mechanism"] = {**body["mechanism"], "steps_done": 0}
    with pytest.raises(ValueError, match="noise mechanism has advanced 0 steps"):
        run(algorithm="dp-ftrl", seed=5).load_state_dict(
            seal({k: v for k, v in body.items() if k not in ("format", "version")})
        )


def test_a_refused_virtual_batch_size_leaves_the_model_without_hooks():
    net = model()
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        run(net, max_physical_batch_size=0)
    run(net)  # the model can be made private again: nothing was left attached


def test_a_step_that_releases_nothing_passes_the_budget_guard_when_the_budget_is_spent():
    record = SamplingRecord(SamplingKind.TREE_SHUFFLE, 8 / 96, 96, 8)
    ledger = PrivacyLedger(1e-5, relation="zero-out", target_epsilon=1.0)
    ledger.record_event(ftrl_step_events(0.5, 12, 12, 12), label="training")  # far past 1.0
    ledger.check_step(StepRecord(record, 1.0))  # no node: nothing released, nothing to refuse
    with pytest.raises(dpfy.BudgetExhausted):
        ledger.check_step(StepRecord(dataclasses.replace(record, tree_nodes=1), 1.0))


def test_the_runs_noise_source_is_the_optimizers_and_no_checkpoint_saves_its_state():
    # Checkpoints once saved the source's state so a resume continued its stream; now every
    # resume draws fresh noise (a replayed stream would let two continuations cancel it), so the
    # source's state is never saved, whatever it offers.
    private = run()

    class Zero:
        def normal(self, like, std):
            return torch.zeros_like(like)

        def state_dict(self):
            return {"zero": True}

    private.optimizer.noise = Zero()
    assert private.noise is private.optimizer.noise
    assert "noise" not in unseal(private.state_dict())
