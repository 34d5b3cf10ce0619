"""``engine="auto"`` does what the docs say: a layer called twice is never refused under it."""

from __future__ import annotations

import pytest
import torch
from tests.layer_reference import assert_exact
from torch import Tensor, nn

from dpfy.train.grads import make_engine


@pytest.fixture(autouse=True, scope="module")
def _float64_by_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Twice(nn.Module):
    """One Linear applied twice (weight sharing across depth), between ordinary layers."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 3)
        self.shared = nn.Linear(3, 3)
        self.last = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.shared(torch.tanh(self.first(x)))
        return self.last(torch.tanh(self.shared(torch.tanh(h))))


class ConvTwice(nn.Module):
    """A convolution applied twice (its rule reduces calls during backward when called once)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.head = nn.Linear(2 * 5 * 5, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.conv(torch.relu(self.conv(x)))).flatten(1))


def _losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (model(x) - y).square().sum(1)


@pytest.mark.parametrize("microbatch", [None, 2])
def test_auto_clips_a_layer_called_twice_exactly_and_keeps_the_rest_on_fast_rules(microbatch):
    torch.manual_seed(0)
    model = Twice()
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    engine = make_engine(model)  # "auto"
    assert engine.kind == "fast"
    _losses(model, x, y).mean().backward()
    engine.clip_and_accumulate(1.0)
    assert engine.replayed_layers == {"shared"}
    engine.detach()
    kind = assert_exact(
        model,
        lambda i: _losses(model, x[i : i + 1], y[i : i + 1]).sum(),
        lambda: _losses(model, x, y),
        6,
        reduction="mean",
        microbatch=microbatch,
    )
    assert kind == "fast"


def test_auto_clips_a_convolution_called_twice_exactly():
    torch.manual_seed(1)
    model = ConvTwice()
    x, y = torch.randn(5, 2, 5, 5), torch.randn(5, 2)
    assert_exact(
        model,
        lambda i: _losses(model, x[i : i + 1], y[i : i + 1]).sum(),
        lambda: _losses(model, x, y),
        5,
    )


def test_explicit_fast_still_refuses_a_layer_called_twice_before_summing():
    model = Twice()
    engine = make_engine(model, "fast")
    _losses(model, torch.randn(3, 4), torch.randn(3, 2)).sum().backward()
    with pytest.raises(ValueError, match=r"layer 'shared' was called 2 times.*engine='vmap'"):
        engine.clip_and_accumulate(1.0, "sum")
    assert engine.num_examples == 0 and not engine.summing
    engine.detach()
