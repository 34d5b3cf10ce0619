"""Layers without a rule taking dicts, lists or keyword tensors: exact against the loop."""

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


class Mixer(nn.Module):
    """A layer reading a dict: per-example features, and a table every example shares."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.gate = nn.Parameter(torch.randn(3))

    def forward(self, inputs: dict[str, Tensor]) -> Tensor:
        h = torch.tanh(inputs["features"] @ self.weight)
        return h * torch.sigmoid(self.gate) + inputs["shared"]


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = Mixer()
        self.shared = torch.randn(3)

    def forward(self, x: Tensor) -> Tensor:
        return self.mixer({"features": x, "shared": self.shared})


class Scaled(nn.Module):
    """A layer called with a list and a keyword tensor (one scale per example)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))

    def forward(self, parts: list[Tensor], *, scale: Tensor) -> Tensor:
        return torch.tanh((parts[0] + parts[1]) @ self.weight) * scale


class KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scaled = Scaled()

    def forward(self, x: Tensor) -> Tensor:
        return self.scaled([x, x.square()], scale=x[:, :1] + 2.0)


def _losses(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).square().sum(1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_dict_input_to_a_layer_without_a_rule_matches_the_loop(reduction):
    torch.manual_seed(0)
    model = DictModel()
    x = torch.randn(5, 4)
    assert_exact(
        model,
        lambda i: _losses(model, x[i : i + 1]).sum(),
        lambda: _losses(model, x),
        5,
        reduction=reduction,
    )


def test_list_and_keyword_inputs_are_replayed_with_each_example_s_own_values():
    torch.manual_seed(1)
    model = KeywordModel()
    x = torch.randn(6, 4)
    assert_exact(model, lambda i: _losses(model, x[i : i + 1]).sum(), lambda: _losses(model, x), 6)


def test_a_dict_input_counts_its_examples():
    model = DictModel()
    engine = make_engine(model)
    _losses(model, torch.randn(7, 4)).sum().backward()
    result = engine.clip_and_accumulate(1.0, "sum")
    assert result.num_examples == 7 and engine.num_examples == 7
    engine.detach()


class KeywordsOnly(nn.Module):
    """A layer called with keyword arguments only (no positional input)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        assert x is not None and scale is not None
        return x * self.weight * scale


class KeywordsOnlyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = KeywordsOnly()

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x=x, scale=x[:, :1])


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_layer_called_with_keywords_only_matches_the_loop(batch_first):
    torch.manual_seed(2)
    model = KeywordsOnlyModel()
    x = torch.randn(5, 4)
    assert_exact(
        model,
        lambda i: _losses(model, x[i : i + 1]).sum(),
        lambda: _losses(model, x),
        5,
        batch_first=batch_first,
    )
