"""A training variant is one composed object, registered once: every stage reads it from there.

A new variant — here DP-SGD's resolver under another name, with its own label and words — is
one ``register_variant`` call: make_private trains it, the report words it and the job labels
it, with no other edit. A second registration of a key, or a user-level variant without the
words for what it clips per user, is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.jobs.loop import algorithm_label
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.variants import (
    PlanRequest,
    TrainingVariant,
    make_plan,
    register_variant,
    variant_for,
    variant_keys,
)
from dpfy.plan.variants import registry as registry_module
from dpfy.plan.variants.dp_sgd import DP_SGD_TEXT, resolve_dp_sgd
from dpfy.report.wording import wording_for


def _renamed(request: PlanRequest) -> PrivacyPlan:
    return dataclasses.replace(resolve_dp_sgd(request), algorithm="dp-sgd-renamed")


@pytest.fixture
def renamed_variant():
    variant = TrainingVariant(
        "dp-sgd-renamed",
        "example",
        "Renamed DP-SGD",
        _renamed,
        dataclasses.replace(DP_SGD_TEXT, name="renamed DP-SGD"),
        "sampled",
    )
    register_variant(variant)
    yield variant
    del registry_module._VARIANTS[variant.key]


def test_one_registration_makes_a_variant_every_stage_can_use(renamed_variant) -> None:
    assert ("dp-sgd-renamed", "example") in variant_keys()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    private = dpfy.make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        batch_size=8,
        steps=2,
        noise_multiplier=1.0,
        delta=1e-5,
        max_grad_norm=1.0,
        algorithm="dp-sgd-renamed",
    )
    for x, y in private.loader:
        private.optimizer.zero_grad()
        nn.functional.cross_entropy(private.model(x), y).backward()
        private.optimizer.step()
    assert private.plan.algorithm == "dp-sgd-renamed" and private.ledger.steps == 2
    assert wording_for(private.plan).algorithm.name == "renamed DP-SGD"
    assert algorithm_label(private.plan) == "Renamed DP-SGD"


def test_a_key_is_registered_once_and_a_user_variant_says_what_it_clips() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_variant(variant_for("dp-sgd", "example"))
    user_level = dataclasses.replace(
        variant_for("dp-sgd", "user"), algorithm="no-words", user_text=None
    )
    with pytest.raises(ValueError, match="needs its user_text"):
        register_variant(user_level)


def test_an_unknown_algorithm_names_the_choices() -> None:
    request = PlanRequest(records=100, batch_size=10, delta=1e-5, max_grad_norm=1.0, steps=1,
                          noise_multiplier=1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"algorithm must be one of .*dp-sgd"):
        make_plan(request, "dp-foo")
    with pytest.raises(ValueError, match="dp-ftrl is available at the example level"):
        make_plan(request, "dp-ftrl", "user")
