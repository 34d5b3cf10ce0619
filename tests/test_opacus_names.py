"""An Opacus user's first lines get dpfy's spelling back: make_private's Opacus keywords, the
tuple unpacking of its result, and Opacus's attribute names each raise one error that says what
to write in dpfy. And the seed behaviour docs/coming-from-opacus.md states: seed= reproduces a
run; torch.manual_seed does not reach sampling and noise."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpfy


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _private(seed: int | None = None) -> dpfy.PrivateTraining:
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return dpfy.make_private(
        model, optimizer, _data(), batch_size=16, epochs=1, noise_multiplier=1.0,
        delta=1e-5, max_grad_norm=1.0, seed=seed,
    )  # fmt: skip


def _train(private: dpfy.PrivateTraining) -> torch.Tensor:
    criterion = nn.CrossEntropyLoss()
    for x, y in private.loader:
        private.optimizer.zero_grad()
        criterion(private.model(x), y).backward()
        private.optimizer.step()
    return torch.cat([p.detach().flatten() for p in private.model.parameters()])


@pytest.mark.parametrize(
    ("keyword", "spelled"),
    [
        ("module", "the model, the first argument"),
        ("data_loader", "the data, the third argument"),
        ("target_delta", "target_delta= is delta="),
        ("poisson_sampling", "sampler='poisson'"),
    ],
)
def test_opacus_keywords_to_make_private_name_dpfys_spelling(keyword, spelled):
    model = nn.Linear(5, 2)
    with pytest.raises(TypeError, match="Opacus's spelling") as caught:
        dpfy.make_private(**{keyword: None}, optimizer=torch.optim.SGD(model.parameters(), 0.1))
    assert spelled in str(caught.value)


def test_opacus_style_call_in_full_is_answered_with_every_keyword_it_misspelt():
    model = nn.Linear(5, 2)
    loader = DataLoader(_data(), batch_size=16)
    with pytest.raises(TypeError) as caught:
        dpfy.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
            data_loader=loader, target_epsilon=3.0, target_delta=1e-5, epochs=1,
            max_grad_norm=1.0,
        )  # fmt: skip
    message = str(caught.value)
    assert "module=, data_loader=, target_delta=" in message
    assert "missing" not in message  # not Python's binding error


def test_unpacking_the_result_like_opacus_says_it_is_one_object():
    private = _private(seed=1)
    with pytest.raises(TypeError, match=r"one PrivateTraining object, not Opacus's"):
        _model, _optimizer, _loader = private


@pytest.mark.parametrize(
    ("where", "name", "spelled"),
    [
        ("run", "get_epsilon", "private.epsilon(delta)"),
        ("optimizer", "noise_multiplier", "private.noise_multiplier"),
        ("optimizer", "max_grad_norm", "private.plan.max_grad_norm"),
    ],
)
def test_opacus_attribute_names_get_dpfys_spelling(where, name, spelled):
    private = _private(seed=1)
    owner = private if where == "run" else private.optimizer
    with pytest.raises(AttributeError, match="Opacus's name") as caught:
        getattr(owner, name)
    assert spelled in str(caught.value)
    with pytest.raises(AttributeError, match=r"no attribute 'no_such_thing'$"):
        owner.no_such_thing  # noqa: B018  (other names: Python's plain message)
    assert not hasattr(owner, "get_epsilon_of_nothing")


def test_seed_reproduces_a_run_and_torch_manual_seed_does_not():
    """seed= fixes sampling and noise; torch.manual_seed leaves them to OS entropy."""
    assert torch.equal(_train(_private(seed=5)), _train(_private(seed=5)))
    first = _train(_private())  # _private calls torch.manual_seed(0) first, both times
    second = _train(_private())
    assert not torch.equal(first, second)
    assert _private().noise_multiplier == 1.0  # the dpfy spelling works
