"""A backward pass outside the training step (a validation loss) followed by zero_grad() is
forgotten: the next step is exactly the step without it; without zero_grad it is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.provenance import BatchRefused


def train(stray: str | None) -> tuple[torch.Tensor, int]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=generator), torch.arange(64) % 3)
    private = dpfy.make_private(
        net, torch.optim.SGD(net.parameters(), lr=0.5), data, batch_size=16, delta=1e-5,
        max_grad_norm=0.5, noise_multiplier=1.0, steps=4, seed=3,
    )  # fmt: skip
    x_val, y_val = torch.randn(5, 4), torch.arange(5) % 3
    for x, y in private.loader:
        if stray != "left":  # "left": a loop that never calls zero_grad
            private.optimizer.zero_grad()
        nn.functional.cross_entropy(private.model(x), y).backward()
        private.optimizer.step()
        if stray is not None:  # a validation loss backpropagated between two steps
            nn.functional.cross_entropy(private.model(x_val), y_val).backward()
            if stray == "zero_grad":
                private.optimizer.zero_grad()
    flat = torch.cat([p.detach().flatten() for p in net.parameters()])
    return flat, private.ledger.steps


def test_a_stray_validation_backward_then_zero_grad_leaves_the_steps_exactly_as_without():
    clean, steps = train(None)
    with_stray, stray_steps = train("zero_grad")
    assert steps == stray_steps == 4
    assert torch.equal(clean, with_stray)


def test_a_stray_backward_no_zero_grad_clears_is_refused_before_it_mixes_into_a_step():
    with pytest.raises(BatchRefused):
        train("left")


def test_a_step_with_no_backward_pass_says_to_call_backward_first():
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    data = TensorDataset(torch.randn(64, 4), torch.arange(64) % 3)
    private = dpfy.make_private(
        net, torch.optim.SGD(net.parameters(), lr=0.5), data, batch_size=16, delta=1e-5,
        max_grad_norm=0.5, noise_multiplier=1.0, steps=4,
    )  # fmt: skip
    x, _ = next(iter(private.loader))
    private.model(x)  # a forward pass, and no backward
    before = net.weight.detach().clone()
    with pytest.raises(BatchRefused, match=r"call loss\.backward\(\)"):
        private.optimizer.step()
    assert private.ledger.steps == 0 and torch.equal(net.weight, before)
