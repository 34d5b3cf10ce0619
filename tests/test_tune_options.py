"""`dpfy tune` takes the options `dpfy train` has (--model, --batch-size, --delta,
--max-grad-norm) and the budget's --tuning-share, refuses bad values as train does, before
anything is written, and uses good ones in the trials and the final run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app
from dpfy.tune.config import TuneConfig, check_tune_config


def _tune(tmp_path: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["tune", "--out", str(tmp_path / "out"), *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "resnet"), r"'resnet' is not one of .*mlp"),
        (("--batch-size", "0"), r"batch_size must be a whole number >= 1"),
        (("--delta", "1.5"), r"delta must lie in \(0, 1\)"),
        (("--delta", "0"), r"delta must lie in \(0, 1\)"),
        (("--max-grad-norm", "0"), r"max_grad_norm must lie in \(0, inf\)"),
        (("--target-epsilon", "-1"), r"target_epsilon must lie in \(0, inf\)"),
        (("--tuning-share", "1"), r"--tuning-share must lie in \(0, 1\)"),
        (("--tuning-share", "0"), r"--tuning-share must lie in \(0, 1\)"),
    ],
)
def test_bad_training_options_are_refused_before_anything_is_written(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    code, output = _tune(tmp_path, "--tuning-accounting", "compose", *args)
    assert code == 2, output
    assert "error:" in output and re.search(message, output), output
    assert "Traceback" not in output
    assert not (tmp_path / "out").exists()


def test_an_exponential_selection_that_leaves_no_room_for_the_trials_is_refused() -> None:
    config = TuneConfig(accounting="exponential", tuning_share=0.1, selection_epsilon=0.5)
    with pytest.raises(ValueError, match=r"mechanism's ε \(0.5\) must be below .*\(0.3\)"):
        check_tune_config(config)
    check_tune_config(TuneConfig(accounting="exponential", tuning_share=0.5))  # 0.3 of 1.5


def test_the_training_options_reach_the_trials_and_the_final_run(tmp_path: Path) -> None:
    code, output = _tune(
        tmp_path, "--tuning-accounting", "compose", "--model", "logreg", "--batch-size", "64",
        "--delta", "1e-4", "--max-grad-norm", "2", "--clip-grid", "0.5,5", "--epochs", "1",
        "--trial-epochs", "0.5", "--seed", "0", "--target-epsilon", "2", "--tuning-share", "0.4",
        "--compare-default",
    )  # fmt: skip
    assert code == 0, output
    summary = json.loads((tmp_path / "out" / "tuning.json").read_text())
    assert summary["config"]["model"] == "logreg" and summary["delta"] == 1e-4
    assert {t["batch_size"] for t in summary["tuning"]["trials"]} == {64}
    assert summary["untuned_default"]["max_grad_norm"] == 2.0
    assert summary["final"]["delta"] == 1e-4
    assert summary["budget"]["tuning_share"] == 0.4
    assert summary["final"]["budgeted_epsilon"] <= 2.0  # training and tuning
    eps = summary["final"]["epsilon"]  # the total composes the untuned default too
    assert eps["total"] > summary["final"]["budgeted_epsilon"] and "untuned-default" in eps
    facts = json.loads((tmp_path / "out" / "final" / "facts.json").read_text())
    assert facts["model"]["name"] == "logreg"
    assert facts["privacy"]["expected_batch_size"] == 64


def test_the_tune_choice_names_are_the_registries_keys():
    from dpfy.plan.accounting.events import TrialDistribution
    from dpfy.tune.config import SEARCHES
    from dpfy.tune.cost import TUNING_METHODS
    from dpfy.tune.datasets import FEATURE_DATASETS
    from dpfy.tune.names import (
        DISTRIBUTION_NAMES,
        FEATURE_DATASET_NAMES,
        SEARCH_NAMES,
        TUNING_METHOD_NAMES,
    )

    assert tuple(SEARCHES) == SEARCH_NAMES
    assert tuple(FEATURE_DATASETS) == FEATURE_DATASET_NAMES
    assert tuple(TUNING_METHODS) == TUNING_METHOD_NAMES
    assert tuple(d.value for d in TrialDistribution) == DISTRIBUTION_NAMES


def test_tune_refuses_an_unknown_dataset_or_search_as_a_choice():
    from typer.testing import CliRunner

    from dpfy.cli.app import app

    for option, value in (("--dataset", "digitz"), ("--search", "grid"), ("--model", "resnet")):
        result = CliRunner().invoke(app, ["tune", option, value])
        assert result.exit_code == 2
        assert option in result.output and value in result.output
