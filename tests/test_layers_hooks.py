"""User hooks on layers and parameters: exact against a per-example loop, or refused."""

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


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (model(x) - y).square().sum(1)


def _rescale(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
    return output * 3.0


def _shift_input(module: nn.Module, args: tuple) -> tuple:
    return (args[0] * 0.5 + 1.0,)


class Custom(nn.Module):
    """A layer without a fast rule (runs on the vmap engine)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(5))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x) * self.scale


@pytest.mark.parametrize("kind", ["fast", "vmap"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_forward_hook_rescaling_a_layer_output_matches_the_loop(kind, when):
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    engine = None
    if when == "after":  # the hook is registered while an engine is attached
        engine = make_engine(model, kind)
    handle = model[0].register_forward_hook(_rescale)
    if engine is not None:
        engine.detach()
    assert_exact(
        model,
        lambda i: _losses(model, x[i : i + 1], y[i : i + 1]).sum(),
        lambda: _losses(model, x, y),
        6,
        kind=kind,
    )
    handle.remove()


@pytest.mark.parametrize("kind", ["fast", "vmap"])
def test_forward_pre_hook_changing_a_layer_input_matches_the_loop(kind):
    torch.manual_seed(1)
    model = _mlp()
    model[2].register_forward_pre_hook(_shift_input)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    assert_exact(
        model,
        lambda i: _losses(model, x[i : i + 1], y[i : i + 1]).sum(),
        lambda: _losses(model, x, y),
        5,
        kind=kind,
    )


def test_hooks_on_a_layer_without_a_rule_are_run_once_in_its_replay():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 5), Custom(), nn.Linear(5, 3))
    model[1].register_forward_pre_hook(_shift_input)
    model[1].register_forward_hook(_rescale)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    kind = assert_exact(
        model,
        lambda i: _losses(model, x[i : i + 1], y[i : i + 1]).sum(),
        lambda: _losses(model, x, y),
        5,
        reduction="mean",
    )
    assert kind == "vmap"


@pytest.mark.parametrize("kind", ["fast", "vmap"])
@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_gradient_hook_on_a_parameter_is_refused_before_anything_is_summed(kind, hook):
    model = _mlp()
    getattr(model[2].weight, hook)(lambda g: g * 2 if isinstance(g, Tensor) else None)
    with pytest.raises(ValueError, match=r"parameter '2.weight' has a gradient hook"):
        make_engine(model, kind)
    assert not model[2]._forward_hooks  # nothing attached


@pytest.mark.parametrize("kind", ["fast", "vmap"])
def test_gradient_hook_added_after_the_engine_is_refused_at_the_step(kind):
    model = _mlp()
    engine = make_engine(model, kind)
    model[0].bias.register_hook(lambda g: g * 2)
    _losses(model, torch.randn(3, 4), torch.randn(3, 3)).sum().backward()
    with pytest.raises(ValueError, match=r"parameter '0.bias' has a gradient hook"):
        engine.clip_and_accumulate(1.0, "sum")
    assert engine.num_examples == 0 and not engine.summing
    engine.detach()


def test_spectral_norm_hook_recomputing_the_weight_is_run_in_the_replay():
    # torch.nn.utils.spectral_norm's pre-hook sets `weight` from `weight_orig` on every call.
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.utils.spectral_norm(nn.Linear(4, 5)), Custom(), nn.Linear(5, 3)
    ).eval()  # evaluation mode: no power iteration, so each example sees the same weight
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    for kind in ("auto", "vmap"):
        assert_exact(
            model,
            lambda i: _losses(model, x[i : i + 1], y[i : i + 1]).sum(),
            lambda: _losses(model, x, y),
            5,
            kind=kind,
        )


class OwnsAndCalls(nn.Module):
    """The root owns a parameter next to its children: the vmap engine replays the root."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(5))
        self.layer = nn.Linear(4, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x) + self.offset


def test_a_pre_hook_run_by_a_replay_sees_the_engine_not_capturing():
    model = OwnsAndCalls()
    engine = make_engine(model, "vmap")
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(engine.capturing))
    model(torch.randn(3, 4)).sum().backward()
    engine.clip_and_accumulate(1.0, "sum")
    assert seen[0] is True and len(seen) > 1 and not any(seen[1:])  # the replays: not captured
    with engine.paused():
        assert not engine.capturing
    assert engine.capturing
    engine.detach()
