"""Every budget refusal shares one base, so ``except dpfy.BudgetExhausted`` catches them all, and
each is still raised where it was, with its own name and wording, before anything happens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.access import LabelBudgetExhausted, LabelLedger, QueryBudgetExhausted, QueryLedger
from dpfy.access.prediction_aggregator import GNMax
from dpfy.federated import DPFedAvg, FedAvgConfig
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.train.ledger import BudgetExhausted, PrivacyLedger
from dpfy.train.step_record import StepRecord

STEP = StepRecord(SamplingRecord(SamplingKind.POISSON, 0.01, 10_000), 1.0)


def test_one_base_exported_where_the_training_refusal_always_was():
    assert dpfy.BudgetExhausted is BudgetExhausted
    assert issubclass(BudgetExhausted, RuntimeError)
    for refusal in (QueryBudgetExhausted, LabelBudgetExhausted):
        assert issubclass(refusal, dpfy.BudgetExhausted) and refusal is not BudgetExhausted
    from dpfy.access import label_ledger, prediction_ledger

    assert prediction_ledger.QueryBudgetExhausted is QueryBudgetExhausted
    assert label_ledger.LabelBudgetExhausted is LabelBudgetExhausted


def test_a_training_step_past_the_target_raises_the_base_itself():
    ledger = PrivacyLedger(1e-5, accountant="rdp", target_epsilon=1e-3)
    with pytest.raises(dpfy.BudgetExhausted) as refused:
        ledger.check_step(STEP)
    assert type(refused.value) is BudgetExhausted
    assert str(refused.value).startswith("privacy budget exhausted: ε spent so far is 0 at δ=1e-05")
    assert (refused.value.spent, refused.value.target, refused.value.delta) == (0.0, 1e-3, 1e-5)
    assert ledger.steps == 0


def test_a_federated_round_past_the_target_raises_the_base_before_it_is_applied():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    users = [TensorDataset(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(10)]
    ledger = PrivacyLedger(1e-5, target_epsilon=1e-3)
    trainer = DPFedAvg(model, users, FedAvgConfig(5, 0.8, 1.0), ledger, rounds=1, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(dpfy.BudgetExhausted, match="privacy budget exhausted") as refused:
        trainer.round()
    assert type(refused.value) is BudgetExhausted
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert ledger.steps == 0


def test_a_query_past_the_budget_is_a_budget_exhausted_with_its_own_wording():
    ledger = QueryLedger(1.0, 1e-5, GNMax(8.0))
    capacity = ledger.capacity()
    ledger.charge(capacity)
    spent = ledger.epsilon()
    with pytest.raises(dpfy.BudgetExhausted) as refused:
        ledger.charge(1)
    error = refused.value
    assert type(error) is QueryBudgetExhausted
    assert str(error).startswith("query budget exhausted: the budget is ε=1 at δ=1e-05; ")
    assert "0 more fit" in str(error) and "Nothing was answered" in str(error)
    assert (error.requested, error.asked, error.remaining) == (1, capacity, 0)
    assert (error.spent, error.target, error.delta) == (spent, 1.0, 1e-5)
    assert ledger.asked == capacity


def test_a_label_release_past_the_target_is_a_budget_exhausted_with_its_own_wording():
    ledger = LabelLedger(10, target_epsilon=1.0)
    ledger.record(np.arange(5), 1.0, mechanism="rr")
    with pytest.raises(dpfy.BudgetExhausted) as refused:
        ledger.record(np.array([4, 7]), 0.1, mechanism="rr")
    error = refused.value
    assert type(error) is LabelBudgetExhausted
    assert str(error) == (
        "label budget exhausted: randomising these labels at ε = 0.1 would bring a label to "
        "ε = 1.1, past the target ε = 1. Nothing was released. Randomise each label once "
        "(disjoint stages), or lower each release's ε."
    )
    assert (error.spent, error.target, error.delta) == (1.0, 1.0, 0.0)
    assert len(ledger.releases) == 1
