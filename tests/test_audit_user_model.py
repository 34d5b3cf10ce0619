"""Auditing the user's own model: a correct model stays below its claim, a model whose forward
pass couples the examples of a batch is caught by the audit itself (behaviour checks off)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpfy.audit.user_model import audit_user_model, input_canary


class BatchCentred(nn.Module):
    """Subtracts the batch mean of the inputs: each output depends on the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x - x.mean(0, keepdim=True))


@pytest.fixture(scope="module")
def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=generator),
                         torch.randint(0, 3, (64,), generator=generator))  # fmt: skip


def audit(model: nn.Module, data: TensorDataset, seed: int):
    torch.manual_seed(seed)
    return audit_user_model(model, data, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5,
                            records=31, steps=60, seed=seed)  # fmt: skip


def test_a_per_example_model_moves_the_sum_by_exactly_c_and_stays_below_its_claim(data):
    torch.manual_seed(0)
    result = audit(nn.Linear(8, 3), data, 1)
    assert "moves the noise-free clipped sum by 1·C" in result.notes[1]
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.scope == "user-model" and result.method == "f-dp"


def test_a_model_that_subtracts_the_batch_mean_is_caught_by_the_audit(data):
    torch.manual_seed(0)
    result = audit(BatchCentred(), data, 2)
    assert result.exceeds_claim, result.notes


def test_the_default_canary_is_a_large_input_of_the_least_likely_class():
    model = nn.Linear(2, 3)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
        model.bias.zero_()
    x, y = input_canary((torch.tensor([1.0, 0.5]), torch.tensor(0)), model)
    assert torch.equal(x, torch.tensor([100.0, 50.0])) and int(y) == 2


def test_too_few_records_for_the_audit_are_refused_naming_the_fix(data):
    with pytest.raises(ValueError, match="pass fewer records"):
        audit_user_model(nn.Linear(8, 3), data, noise_multiplier=1.0, max_grad_norm=1.0,
                         delta=1e-5, records=64)  # fmt: skip
