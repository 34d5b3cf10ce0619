"""`dpfy tune --target-epsilon` is the whole budget: the trials and the final run, composed as the
final report composes them, stay within it — and spend nearly all of it — for every accounting
method, whether the trials share the final run's σ or a fixed share of the budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpfy.plan.accounting import dpsgd_event
from dpfy.train.ledger import PrivacyLedger
from dpfy.tune.budget import CALIBRATION_MARGIN, composed_total, plan_budget
from dpfy.tune.cost import TuningSpec, get_method
from dpfy.tune.pipeline import TuneConfig, run_tuning

BUDGET = 3.0
SLACK = 0.01  # the reported total lies in [(1 - SLACK) · budget, budget]
#: tiny digits runs: a few seconds each
FAST = {
    "seed": 0, "limit": 400, "epochs": 1, "trial_epochs": 0.5, "clip_grid": (0.3, 3.0),
    "compare_default": False, "target_epsilon": BUDGET,
}  # fmt: skip
METHODS = [
    ("compose", {}),
    ("exponential", {}),
    ("random-trials", {"trials": 3}),
    ("public", {"public_data": "30% of the digits training split, never trained on privately"}),
]
SPECS = {
    "compose": TuningSpec(),
    "exponential": TuningSpec(selection_epsilon=0.3),
    "random-trials": TuningSpec(mean_trials=4.0, distribution="geometric"),
}


def _tune(tmp_path: Path, **changes: object) -> dict:
    settings = {**FAST, **changes}
    return run_tuning(TuneConfig(out=tmp_path / "tune", **settings)).summary  # type: ignore[arg-type]


def _reported(summary: dict) -> dict:
    """ε as the final run's report states it (report.json, recomputed from its ledger)."""
    report = Path(summary["final"]["report"]).with_suffix(".json")
    return json.loads(report.read_text())["epsilon"]


@pytest.mark.parametrize(("method", "extra"), METHODS, ids=[m for m, _ in METHODS])
def test_the_reported_total_stays_within_the_budget_and_spends_nearly_all_of_it(
    tmp_path: Path, method: str, extra: dict
) -> None:
    summary = _tune(tmp_path, accounting=method, **extra)
    shown = _reported(summary)
    assert (1 - SLACK) * BUDGET <= shown["total"] <= BUDGET
    assert shown["total"] == pytest.approx(summary["final"]["epsilon"]["total"])
    assert summary["budget"]["total_epsilon"] == BUDGET
    assert summary["budget"]["planned_total"] <= BUDGET
    if method == "public":  # tuning spends nothing: the final run gets it all
        assert "tuning" not in shown or not shown["tuning"]
        assert shown["training"] == pytest.approx(shown["total"])
    else:
        assert shown["tuning"] == pytest.approx(summary["tuning"]["tuning_epsilon"], rel=1e-6)
        assert shown["training"] < shown["total"]


def test_a_tuning_share_caps_what_the_trials_spend_and_the_final_run_takes_the_rest(
    tmp_path: Path,
) -> None:
    summary = _tune(tmp_path, accounting="compose", tuning_share=0.3, compare_default=True)
    shown = _reported(summary)
    assert (1 - SLACK) * 0.3 * BUDGET <= shown["tuning"] <= 0.3 * BUDGET
    budgeted = summary["final"]["budgeted_epsilon"]  # training and tuning composed
    assert (1 - SLACK) * BUDGET <= budgeted <= BUDGET
    # the trials ran at their own σ, noisier than the final run's
    assert summary["trial_noise_multiplier"] > summary["noise_multiplier"]
    # the untuned default is what not tuning gives: the whole budget on one run
    default = summary["untuned_default"]["epsilon"]
    assert (1 - SLACK) * BUDGET <= default["total"] <= BUDGET and "tuning" not in default
    # a second model on the same private data: the reported total composes it, past the budget
    assert shown["other"]["untuned-default"] == pytest.approx(default["total"], rel=1e-9)
    assert shown["total"] > max(budgeted, default["total"])
    assert shown["total"] == pytest.approx(summary["final"]["epsilon"]["total"])


@pytest.mark.parametrize("share", [None, 0.3])
@pytest.mark.parametrize("method", list(SPECS))
def test_the_planned_split_holds_the_budget_as_a_ledger_composes_it(
    method: str, share: float | None
) -> None:
    n, batch, steps, trial_steps, trials = 1437, 128, 225, 12, 5
    spec, accountant = SPECS[method], get_method(method).accountant or "pld"
    split = plan_budget(
        BUDGET, 1e-4, accountant, lambda s: dpsgd_event(batch / n, s, steps),
        lambda s: get_method(method).event([dpsgd_event(batch / n, s, trial_steps)] * trials, spec),
        share,
    )  # fmt: skip
    training = dpsgd_event(batch / n, split.final_noise_multiplier, steps)
    ledger = PrivacyLedger(1e-4, accountant=accountant)  # the report's own arithmetic
    ledger.record_event(training, label="final")
    ledger.record_event(split.tuning_event, label="tuning")  # type: ignore[arg-type]
    assert (1 - SLACK) * BUDGET <= ledger.epsilon() <= BUDGET
    assert split.planned_total == pytest.approx(ledger.epsilon(), rel=1e-9)
    if share is None:
        assert split.trial_noise_multiplier == split.final_noise_multiplier
    else:
        aim = share * BUDGET * (1 - CALIBRATION_MARGIN)
        assert (1 - SLACK) * aim <= split.tuning_epsilon <= aim


def test_the_total_is_composed_not_summed() -> None:
    # two equal halves compose to less than their sum: the split is made on the tuning side
    half = dpsgd_event(0.01, 1.0, 1000)
    alone = composed_total(half, None, 1e-5, "pld")
    assert composed_total(half, half, 1e-5, "pld") < 2 * alone


@pytest.mark.filterwarnings("ignore:the best RDP order")
def test_a_share_too_small_for_random_trials_is_refused_with_the_fix() -> None:
    # repeat-and-select costs something however noisy its trials (about 0.005 here, a floor set
    # by the distribution of K), so 0.1% of the budget cannot pay for it
    method = get_method("random-trials")
    with pytest.raises(ValueError, match=r"no noise multiplier makes the trials.*tuning-share"):
        plan_budget(
            BUDGET, 1e-5, "rdp", lambda s: dpsgd_event(0.1, s, 100),
            lambda s: method.event([dpsgd_event(0.1, s, 10)], SPECS["random-trials"]), 0.001,
        )  # fmt: skip
