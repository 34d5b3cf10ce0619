"""The tuner, the searches and the planner, with a fake trial runner (no training: fast)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from dpfy.plan.accounting import (
    ComposedEvent,
    PureDpEvent,
    RepeatAndSelectEvent,
    SelfComposedEvent,
    compute_epsilon,
    dpsgd_event,
)
from dpfy.train.ledger import PrivacyLedger
from dpfy.tune.clip_search import ClipSearch, choose_clip
from dpfy.tune.cost import TuningSpec
from dpfy.tune.planner import RatioAssumptionWarning, plan_at_fixed_ratio
from dpfy.tune.random_search import RandomSearch
from dpfy.tune.sweep import LrClipSweep
from dpfy.tune.trial import TrialConfig, TrialResult, TuningData
from dpfy.tune.tuner import Tuner, planned_event

N_TRAIN, N_VALID = 200, 100
DATA = TuningData(
    TensorDataset(torch.zeros(N_TRAIN, 3), torch.zeros(N_TRAIN, dtype=torch.long)),
    TensorDataset(torch.zeros(N_VALID, 3), torch.zeros(N_VALID, dtype=torch.long)),
    (3,),
    2,
)


def fake_runner(accuracy_of: dict[float, float]) -> tuple[list[TrialConfig], object]:
    """A runner that 'trains' instantly: accuracy by C, the event the plan says it records."""
    calls: list[TrialConfig] = []

    def run(config: TrialConfig, data: TuningData, delta: float) -> TrialResult:
        calls.append(config)
        correct = round(accuracy_of[config.max_grad_norm] * N_VALID)
        event = planned_event(config, N_TRAIN)
        norms = np.full(10, 2.0)
        recorded = None if event is None else ComposedEvent((event,))
        return TrialResult(config, correct, N_VALID, recorded, norms)

    return calls, run


ACCURACY = {0.1: 0.80, 0.3: 0.90, 1.0: 0.91, 3.0: 0.92, 10.0: 0.70}


def clip_search(sigma: float = 1.0) -> ClipSearch:
    return ClipSearch(grid=tuple(ACCURACY), tolerance=0.03, noise_multiplier=sigma, epochs=1)


# -- ClipSearch ---------------------------------------------------------------------------------
def test_choose_clip_takes_the_smallest_c_within_the_tolerance() -> None:
    assert choose_clip(ACCURACY, 0.03) == (0.3, 0.92)  # 0.90 ≥ 0.97 · 0.92 = 0.8924
    assert choose_clip(ACCURACY, 0.01) == (3.0, 0.92)  # 0.91 < 0.99 · 0.92 = 0.9108
    assert choose_clip(ACCURACY, 0.5) == (0.1, 0.92)


@pytest.mark.parametrize("tolerance", [0.0, 1.0, -0.1, 1.5, math.nan])
def test_tolerance_outside_zero_one_is_refused(tolerance: float) -> None:
    with pytest.raises(ValueError, match=r"tolerance must lie in \(0, 1\)"):
        ClipSearch(tolerance=tolerance)


@pytest.mark.parametrize("grid", [(), []])
def test_empty_grid_is_refused(grid: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="grid is empty"):
        ClipSearch(grid=grid)
    with pytest.raises(ValueError, match="grid is empty"):
        LrClipSweep(lrs=grid)
    with pytest.raises(ValueError, match="must be positive"):
        ClipSearch(grid=(0.1, -1.0))


def test_clip_rank_key_prefers_smaller_c_among_near_equal_runs() -> None:
    search = clip_search()
    config = search.candidates()[0]

    def result(c: float, correct: int) -> TrialResult:
        return TrialResult(config.with_(max_grad_norm=c), correct, 1000, None)

    near = [result(3.0, 920), result(0.3, 915), result(10.0, 700)]
    assert max(near, key=search.rank_key).config.max_grad_norm == 0.3
    far = [result(3.0, 920), result(0.3, 800)]
    assert max(far, key=search.rank_key).config.max_grad_norm == 3.0


# -- the tuner ---------------------------------------------------------------------------------
def test_compose_runs_every_candidate_and_records_their_composition() -> None:
    calls, run = fake_runner(ACCURACY)
    outcome = Tuner(clip_search(), "compose", runner=run).run(DATA, 1e-4)
    assert [c.max_grad_norm for c in calls] == sorted(ACCURACY)
    assert outcome.chosen is not None and outcome.chosen.config.max_grad_norm == 0.3
    one = planned_event(calls[0], N_TRAIN)
    assert outcome.event == SelfComposedEvent(one, len(ACCURACY))
    ledger = PrivacyLedger(1e-4)
    outcome.record(ledger)
    eps = ledger.epsilon_by_label()
    assert eps["tuning"] == pytest.approx(compute_epsilon(outcome.event, 1e-4), rel=1e-9)
    assert outcome.facts().data == "private" and outcome.facts().trials == len(ACCURACY)
    assert outcome.to_dict()["trials_covered_by_epsilon"] is True


def test_random_trials_really_draws_the_number_of_runs() -> None:
    counts = []
    for seed in range(8):
        calls, run = fake_runner(ACCURACY)
        spec = TuningSpec(distribution="geometric", mean_trials=4)
        outcome = Tuner(clip_search(), "random-trials", spec, seed=seed, runner=run).run(DATA, 1e-4)
        assert len(calls) == outcome.trials_drawn == len(outcome.results)
        assert all(c.max_grad_norm in ACCURACY for c in calls)
        assert isinstance(outcome.event, RepeatAndSelectEvent)
        assert outcome.event.mean == 4 and outcome.accountant == "rdp"
        summary = outcome.to_dict()
        assert summary["trials_covered_by_epsilon"] is False  # only the best run is accounted
        assert "do not publish" in summary["release_note"]
        counts.append(outcome.trials_drawn)
    assert len(set(counts)) > 1  # K is random ...
    again = [
        Tuner(clip_search(), "random-trials", TuningSpec(distribution="geometric", mean_trials=4),
              seed=seed, runner=fake_runner(ACCURACY)[1]).run(DATA, 1e-4).trials_drawn
        for seed in range(8)
    ]  # fmt: skip
    assert again == counts  # ... and reproducible from the seed


def test_random_trials_with_no_run_still_pays() -> None:
    spec = TuningSpec(distribution="poisson", mean_trials=0.05)
    for seed in range(40):
        calls, run = fake_runner(ACCURACY)
        outcome = Tuner(clip_search(), "random-trials", spec, seed=seed, runner=run).run(DATA, 1e-4)
        if outcome.trials_drawn == 0:
            assert outcome.chosen is None and not calls and outcome.notes
            assert outcome.epsilon > 0
            return
    pytest.fail("a Poisson(0.05) draw should give K = 0 within 40 seeds")


def test_exponential_selects_with_the_mechanism_and_pays_for_it() -> None:
    picks = set()
    for seed in range(30):
        _, run = fake_runner(ACCURACY)
        spec = TuningSpec(selection_epsilon=0.01)  # nearly uniform: the choice is random
        outcome = Tuner(clip_search(), "exponential", spec, seed=seed, runner=run).run(DATA, 1e-4)
        picks.add(outcome.chosen.config.max_grad_norm)
        assert PureDpEvent(0.01) in outcome.event.events
    assert len(picks) > 2
    _, run = fake_runner(ACCURACY)
    sharp = TuningSpec(selection_epsilon=500.0)  # almost surely the best count
    outcome = Tuner(clip_search(), "exponential", sharp, runner=run).run(DATA, 1e-4)
    assert outcome.chosen.config.max_grad_norm == 3.0


def test_tuning_on_private_data_needs_a_method_and_noise() -> None:
    with pytest.raises(ValueError, match=r"compose.*exponential.*random-trials.*public"):
        Tuner(clip_search(), None)
    calls, run = fake_runner(ACCURACY)
    with pytest.raises(ValueError, match="zero-noise trial"):
        Tuner(clip_search(sigma=0.0), "compose", runner=run).run(DATA, 1e-4)
    assert not calls  # refused before any trial ran
    with pytest.raises(ValueError, match="declare it"):
        Tuner(clip_search(sigma=0.0), "public")


def test_public_tuning_records_nothing_and_says_public() -> None:
    _, run = fake_runner(ACCURACY)
    spec = TuningSpec(public_declaration="a public proxy set")
    outcome = Tuner(clip_search(sigma=0.0), "public", spec, runner=run).run(DATA, 1e-4)
    ledger = PrivacyLedger(1e-4)
    outcome.record(ledger)
    assert ledger.epsilon() == 0.0 and outcome.epsilon == 0.0
    assert outcome.facts().data == "public"


def test_random_trials_refuses_candidates_that_are_different_mechanisms() -> None:
    search = RandomSearch(count=3)
    calls, run = fake_runner(ACCURACY)
    mixed = LrClipSweep(lrs=(0.1,), clips=(0.1, 0.3))
    tuner = Tuner(mixed, "random-trials", TuningSpec(mean_trials=2), runner=run)
    tuner.search = _with_batches(mixed)  # type: ignore[assignment]
    with pytest.raises(ValueError, match="same mechanism"):
        tuner.run(DATA, 1e-4)
    assert not calls
    assert (
        len(search.candidates()) == 3 and search.candidates() == RandomSearch(count=3).candidates()
    )


class _with_batches:
    """A search whose two candidates differ in batch size (so in privacy event)."""

    def __init__(self, base: LrClipSweep) -> None:
        self.base, self.name = base, "mixed"

    def candidates(self) -> list[TrialConfig]:
        first, second = self.base.candidates()
        return [first, second.with_(batch_size=50)]

    def choose(self, results):  # type: ignore[no-untyped-def]
        return self.base.choose(results)

    def rank_key(self, result):  # type: ignore[no-untyped-def]
        return self.base.rank_key(result)


# -- the σC/B planner --------------------------------------------------------------------------
def test_planner_keeps_the_ratio_meets_epsilon_and_warns() -> None:
    with pytest.warns(RatioAssumptionWarning, match="needs checking"):
        plan = plan_at_fixed_ratio(
            0.002, 1.0, 60_000, 3.0, 1e-5, epochs=(5, 20), batch_sizes=(256, 1024, 4096)
        )
    assert len(plan.settings) == 6 and plan.feasible
    for setting in plan.settings:
        assert setting.noise_multiplier * 1.0 / setting.batch_size == pytest.approx(0.002)
        assert setting.gradient_evaluations == setting.steps * setting.batch_size
        event = dpsgd_event(setting.batch_size / 60_000, setting.noise_multiplier, setting.steps)
        assert (compute_epsilon(event, 1e-5) <= 3.0) == setting.meets_target
    assert min(s.relative_compute for s in plan.feasible) == 1.0
    assert "needs checking" in plan.caveat
    with warnings.catch_warnings():
        warnings.simplefilter("error", RatioAssumptionWarning)
        with pytest.raises(RatioAssumptionWarning):
            plan_at_fixed_ratio(0.002, 1.0, 60_000, 3.0, 1e-5, epochs=(1,), batch_sizes=(256,))
    with pytest.raises(ValueError, match="epochs grid is empty"):
        plan_at_fixed_ratio(0.002, 1.0, 60_000, 3.0, 1e-5, epochs=())


def test_trials_that_cannot_tell_the_clip_norms_apart_are_flagged() -> None:
    search = clip_search()
    base = search.candidates()[0]
    same = [TrialResult(base.with_(max_grad_norm=c), 50, N_VALID, None) for c in (0.1, 1.0)]
    assert search.summarise(same).indistinct
    apart = [
        TrialResult(base.with_(max_grad_norm=0.1), 50, N_VALID, None),
        TrialResult(base.with_(max_grad_norm=1.0), 90, N_VALID, None),
    ]
    assert not search.summarise(apart).indistinct


def test_trials_near_chance_are_noted() -> None:
    from dpfy.tune.pipeline import _check_informative

    _, run = fake_runner({c: 0.15 for c in ACCURACY})
    outcome = Tuner(clip_search(), "compose", runner=run).run(DATA, 1e-4)
    _check_informative(outcome, num_classes=10)
    assert any("twice chance" in note for note in outcome.notes)
    _, run = fake_runner(ACCURACY)
    outcome = Tuner(clip_search(), "compose", runner=run).run(DATA, 1e-4)
    _check_informative(outcome, num_classes=10)
    assert not outcome.notes


def test_the_default_tuner_draws_k_and_the_selection_from_os_entropy() -> None:
    # K and the exponential mechanism's coin are part of the guarantee only while they are
    # secret: a default (unseeded) Tuner must not draw them from a fixed, public seed.
    spec = TuningSpec(distribution="geometric", mean_trials=4)
    drawn = {
        Tuner(clip_search(), "random-trials", spec, runner=fake_runner(ACCURACY)[1])
        .run(DATA, 1e-4)
        .trials_drawn
        for _ in range(12)
    }
    assert len(drawn) > 1
    loose = TuningSpec(selection_epsilon=0.01)
    picks = {
        Tuner(clip_search(), "exponential", loose, runner=fake_runner(ACCURACY)[1])
        .run(DATA, 1e-4)
        .chosen.config.max_grad_norm
        for _ in range(12)
    }
    assert len(picks) > 1


@pytest.mark.parametrize(
    "spec",
    [
        TuningSpec(distribution="geometric", mean_trials=1),  # a truncated law has mean > 1
        TuningSpec(distribution="truncated-negative-binomial", mean_trials=3),  # no shape η
    ],
)
def test_random_trials_settings_are_refused_before_any_trial_runs(spec: TuningSpec) -> None:
    calls, run = fake_runner(ACCURACY)
    with pytest.raises(ValueError, match="random-trials tuning settings"):
        Tuner(clip_search(), "random-trials", spec, seed=0, runner=run).run(DATA, 1e-4)
    assert not calls  # no private data was touched for a run that cannot be accounted


def test_the_default_tuner_gives_every_run_a_fresh_seed() -> None:
    # A seed a search was given is public: trial noise seeded from it would be known.
    calls, run = fake_runner(ACCURACY)
    Tuner(dataclasses.replace(clip_search(), seed=0), "compose", runner=run).run(DATA, 1e-4)
    seeds = [c.seed for c in calls]
    assert len(set(seeds)) == len(seeds) and 0 not in seeds
    calls, run = fake_runner(ACCURACY)
    seeded = dataclasses.replace(clip_search(), seed=5)
    Tuner(seeded, "compose", seed=3, runner=run).run(DATA, 1e-4)  # an experiment
    assert [c.seed for c in calls] == [c.seed for c in seeded.candidates()] == [5] * len(calls)
