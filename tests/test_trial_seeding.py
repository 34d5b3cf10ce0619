"""A tuning trial draws its sampling and noise from OS entropy unless an experiment seeds it.

Two default trials on the same data are two independent private runs: their batches and noise
differ, so their trained weights do. A seed (given to the trial, or to a seeded Tuner) makes a
trial reproducible, for experiments only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy.tune.trial as trial_module
from dpfy.plan.accounting import ComposedEvent
from dpfy.tune.clip_search import ClipSearch
from dpfy.tune.random_search import RandomSearch
from dpfy.tune.sweep import LrClipSweep
from dpfy.tune.trial import TrialConfig, TrialResult, TuningData, run_trial
from dpfy.tune.tuner import Tuner, planned_event


def tiny_data() -> TuningData:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=generator)
    y = (x[:, 0] > 0).long()
    return TuningData(TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:]), (6,), 2)


def trained(config: TrialConfig, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, object]:
    """The trial's trained weights (flattened) and its result."""
    models: list[nn.Module] = []
    original = trial_module.fresh_model

    def keep(config, data):  # the trial's own model, to read its weights after training
        model, optimizer = original(config, data)
        models.append(model)
        return model, optimizer

    monkeypatch.setattr(trial_module, "fresh_model", keep)
    result = run_trial(config, tiny_data(), 1e-5)
    weights = torch.cat([p.detach().flatten() for p in models[-1].parameters()])
    return weights, result


CONFIG = dict(max_grad_norm=1.0, lr=0.1, noise_multiplier=1.0, epochs=1.0, batch_size=16)


def test_two_default_trials_on_the_same_data_train_different_weights(monkeypatch):
    first, a = trained(TrialConfig(**CONFIG, model="logreg"), monkeypatch)
    second, b = trained(TrialConfig(**CONFIG, model="logreg"), monkeypatch)
    assert not torch.equal(first, second)  # different noise (and batches): not a replay
    assert a.norms.shape != b.norms.shape or not (a.norms == b.norms).all()


def test_default_trials_still_start_from_the_public_initialisation(monkeypatch):
    # Only sampling and noise are private randomness: with neither (q = 1, σ = 0) two default
    # trials are the same run, because the initialisation stays public and fixed.
    full = dict(CONFIG, noise_multiplier=0.0, batch_size=64)
    first, _ = trained(TrialConfig(**full, model="logreg"), monkeypatch)
    second, _ = trained(TrialConfig(**full, model="logreg"), monkeypatch)
    assert torch.equal(first, second)


def test_a_seeded_trial_is_reproducible(monkeypatch):
    first, a = trained(TrialConfig(**CONFIG, model="logreg", seed=7), monkeypatch)
    second, b = trained(TrialConfig(**CONFIG, model="logreg", seed=7), monkeypatch)
    assert torch.equal(first, second) and (a.norms == b.norms).all()


@pytest.mark.parametrize(
    "search",
    [ClipSearch(grid=(0.1, 1.0)), LrClipSweep(lrs=(0.1,), clips=(0.1, 1.0)), RandomSearch(count=2)],
)
def test_a_searchs_default_candidates_are_unseeded_trials(search):
    # The candidates of a search run outside a Tuner would otherwise all replay seed 0's noise.
    assert [c.seed for c in search.candidates()] == [None] * len(search.candidates())
    assert search.candidates() == search.candidates()  # the candidate set itself is public


def seeds_of_a_seeded_tuner(seed: int) -> list[int | None]:
    """The seed of every trial a seeded Tuner runs (a runner that only records)."""
    calls: list[TrialConfig] = []

    def run(config: TrialConfig, data: TuningData, delta: float) -> TrialResult:
        calls.append(config)
        event = planned_event(config, len(data.train))
        return TrialResult(config, 10, len(data.validation), ComposedEvent((event,)))

    search = ClipSearch(grid=(0.1, 1.0), noise_multiplier=1.0, epochs=1)
    Tuner(search, "compose", seed=seed, runner=run).run(tiny_data(), 1e-5)
    return [c.seed for c in calls]


def test_a_seeded_tuner_seeds_every_trial_reproducibly():
    # An experiment asks for reproducibility through the Tuner's seed; the search's candidates
    # carry none of their own now, so the Tuner derives each trial's from its own.
    seeds = seeds_of_a_seeded_tuner(3)
    assert None not in seeds and len(set(seeds)) == len(seeds)
    assert seeds_of_a_seeded_tuner(3) == seeds
