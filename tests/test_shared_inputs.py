"""Inputs the batch shares and parameters layers share: exact, or refused, never silently wrong.

A layer called on an input of batch size 1 (position ids (1, T)) gets each example's gradient
through that example's row of the broadcast; a parameter held by several layers (tied
embeddings) is clipped by the norm of its summed gradient. Any use the engines cannot attribute
to single examples raises with the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from dpfy.train.grads import make_engine
from test_grads import assert_matches_reference, squared_error


@pytest.fixture(autouse=True)
def _float64_by_default():
    """Compare in float64 here, without changing the default for other test modules."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Positions(nn.Module):
    """Token and position embeddings; the position embeddings' output is used as ``use`` says."""

    def __init__(self, use: str = "add") -> None:
        super().__init__()
        self.tokens = nn.Embedding(10, 4)
        self.positions = nn.Embedding(6, 4)
        self.query = nn.Linear(3, 4)  # a Linear on a shared float input, too
        self.register_buffer("anchor", torch.ones(1, 1, 3))
        self.head = nn.Linear(4, 2)
        self.use = use

    def forward(self, x: Tensor) -> Tensor:
        shared = self.positions(torch.arange(x.shape[1])[None])  # (1, T, 4)
        h = self.tokens(x)
        if self.use == "add":
            h = h + shared.to(h.dtype) * 2.0 + self.query(self.anchor)
        elif self.use == "in place":
            h += shared
        elif self.use == "index":
            h = h + shared[0]
        elif self.use == "cat":
            h = torch.cat([shared, h], 1)
        elif self.use == "sum":
            h = h + shared.sum(0)
        elif self.use == "unsqueeze":
            h = h.unsqueeze(0) + shared.unsqueeze(0)
        return torch.tanh(self.head(h))


@pytest.mark.parametrize("microbatch", [None, 2])
def test_layers_on_a_shared_input_match_reference(microbatch) -> None:
    torch.manual_seed(0)
    x, y = torch.randint(0, 10, (5, 6)), torch.randn(5, 6, 2)
    assert_matches_reference(Positions(), x, y, microbatch=microbatch)
    assert_matches_reference(Positions("in place"), x, y)


@pytest.mark.parametrize("n", [0, 1])
def test_shared_inputs_in_an_empty_or_single_example_batch(n) -> None:
    model = Positions()
    for kind in ("fast", "vmap"):
        engine = make_engine(model, kind)
        model(torch.randint(0, 10, (n, 6))).sum().backward()
        assert engine.clip_and_accumulate(1.0).num_examples == n
        engine.detach()


@pytest.mark.parametrize("use", ["index", "cat", "sum", "unsqueeze"])
@pytest.mark.parametrize("kind", ["fast", "vmap"])
def test_a_shared_output_used_other_than_as_a_broadcast_is_refused(use, kind) -> None:
    model = Positions(use)
    engine = make_engine(model, kind)
    with pytest.raises(RuntimeError, match=r"'positions'.*position_ids\.expand\(batch_size, -1\)"):
        model(torch.randint(0, 10, (3, 6)))
    engine.detach()


def test_linear_layers_sharing_weight_and_bias_run_on_the_fast_engine() -> None:
    torch.manual_seed(1)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight, second.bias = first.weight, first.bias
    model = nn.Sequential(first, nn.Tanh(), second)
    engine = make_engine(model)
    assert engine.kind == "fast"
    engine.detach()
    assert_matches_reference(model, torch.randn(6, 3, 4), torch.randn(6, 3, 4))
    assert_matches_reference(model, torch.randn(6, 4), torch.randn(6, 4), microbatch=3)


class TwoLookups(nn.Module):
    """Two embeddings sharing one table (one with a padding row), multiplied."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Embedding(6, 3, padding_idx=0), nn.Embedding(6, 3)
        self.second.weight = self.first.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.first(x) * self.second(x.flip(1))


def test_embeddings_sharing_a_table_match_reference() -> None:
    torch.manual_seed(2)
    x, y = torch.randint(0, 6, (5, 4)), torch.randn(5, 4, 3)
    assert_matches_reference(TwoLookups(), x, y, kinds=("fast",))
    assert_matches_reference(TwoLookups(), x, y, microbatch=2, reduction="sum")


def test_a_layer_used_twice_is_refused_by_fast_and_exact_on_vmap() -> None:
    torch.manual_seed(3)
    layer = nn.Linear(3, 3)
    model = nn.Sequential(layer, nn.Tanh(), layer)
    with pytest.raises(ValueError, match="a layer used twice"):
        make_engine(model, "fast")
    engine = make_engine(model)
    assert engine.kind == "vmap" and "used twice" in engine.fallback_reason
    engine.detach()
    assert_matches_reference(model, torch.randn(4, 3), torch.randn(4, 3), kinds=("vmap",))


def test_sharing_with_a_layer_whose_rule_cannot_factor_falls_back_to_vmap() -> None:
    torch.manual_seed(4)
    linear, norm = nn.Linear(4, 4), nn.LayerNorm(4)
    norm.bias = linear.bias
    model = nn.Sequential(linear, norm)
    engine = make_engine(model)
    assert engine.kind == "vmap" and "cannot add its gradient" in engine.fallback_reason
    engine.detach()
    assert_matches_reference(model, torch.randn(5, 4), torch.randn(5, 4), kinds=("vmap",))


class Outer(nn.Module):
    """Owns its sublayer's bias too (like BertLMPredictionHead) and also adds it directly."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.bias = self.inner.bias

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x) + self.bias


def test_a_nested_owner_using_the_parameter_itself_is_refused_by_fast() -> None:
    torch.manual_seed(5)
    model, x, y = Outer(), torch.randn(4, 3), torch.randn(4, 3)
    engine = make_engine(model, "fast")
    squared_error(model(x), y).sum().backward()
    with pytest.raises(RuntimeError, match="'bias' received a gradient outside"):
        engine.clip_and_accumulate(1.0)
    engine.detach()
    assert_matches_reference(model, x, y, kinds=("vmap",))


class SliceOrGiven(nn.Module):
    """Adds a lookup of the first example's tokens, or of position ids the caller passes."""

    def __init__(self, slice_first: bool) -> None:
        super().__init__()
        self.tokens, self.other = nn.Embedding(10, 4), nn.Embedding(10, 4)
        self.slice_first = slice_first

    def forward(self, x: Tensor, position_ids: Tensor) -> Tensor:
        shared = x[:1] if self.slice_first else position_ids
        return (self.tokens(x) + self.other(shared)).sum((1, 2))


@pytest.mark.parametrize("kind", ["fast", "vmap"])
def test_one_examples_data_shared_with_the_batch_is_refused(kind) -> None:
    model = SliceOrGiven(slice_first=True)
    engine = make_engine(model, kind)
    with pytest.raises(ValueError, match="slice of the model's input"):
        model(torch.randint(0, 10, (3, 6)), torch.arange(6)[None])
    engine.detach()


@pytest.mark.parametrize("kind", ["fast", "vmap"])
def test_position_ids_passed_by_the_caller_are_shared(kind) -> None:
    model = SliceOrGiven(slice_first=False)
    engine = make_engine(model, kind)
    model(torch.randint(0, 10, (3, 6)), torch.arange(6)[None]).sum().backward()
    assert engine.clip_and_accumulate(1.0).num_examples == 3
    engine.detach()
