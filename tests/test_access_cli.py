"""`dpfy train --access label|input` end to end on digits, and the access model in every report."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import dpfy
from dpfy.access.feature_bounds import bounds_for
from dpfy.access.label_ledger import LABEL_MECHANISMS
from dpfy.cli.app import app
from dpfy.data.loader import rest_of_run
from dpfy.jobs.access import ACCESS_NAMES, access_job
from dpfy.jobs.config import LABEL_MECHANISM_NAMES, TrainConfig, check_config
from dpfy.report.access_facts import AccessFacts, access_statement
from dpfy.report.access_pitfalls import access_findings
from dpfy.report.card import build_report
from dpfy.report.facts import RunFacts, collect_facts


def run_dpfy(*args: str) -> subprocess.CompletedProcess[str]:
    """``dpfy ARGS`` in this process (no interpreter start or torch import per call)."""
    result = CliRunner().invoke(app, list(args))
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


def dpfy_train(*args: str) -> subprocess.CompletedProcess[str]:
    return run_dpfy("train", "--epochs", "3", *args)


def _report(run_dir: Path) -> tuple[str, dict]:
    document = json.loads((run_dir / "report.json").read_text())
    return (run_dir / "report.md").read_text(), document


def test_label_rr_run_states_label_only_dp_and_warns_on_private_features(tmp_path: Path) -> None:
    out = tmp_path / "label"
    run = dpfy_train("--access", "label", "--target-epsilon", "2", "--out", str(out), "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["epsilon"] == 2.0 and result["delta"] == 0.0
    assert result["test_accuracy"] > 0.5
    md, document = _report(out)
    assert "label-only DP" in md and "only the labels are protected" in md
    assert document["accounting"]["epsilon"] == 2.0
    assert document["accounting"]["max_times_randomised"] == 1
    assert [p["code"] for p in document["pitfalls"]] == ["label-dp-features-private"]
    assert (out / "model.pt").is_file() and (out / "config.json").is_file()
    assert result["released"] == f"{document['train_size']} labels randomised once each"
    assert "facts.json" not in result["paths"]  # a label run writes no DP-SGD facts
    assert all(Path(path).is_file() for path in result["paths"].values())


def test_the_summary_of_a_label_run_names_what_was_released_not_steps(tmp_path: Path) -> None:
    run = dpfy_train("--access", "label", "--features-public", "--out", str(tmp_path / "l"))
    assert run.returncode == 0, run.stderr
    assert "labels randomised once each)" in run.stdout
    assert " steps" not in run.stdout


def test_label_rr_prior_in_stages_composes_in_parallel(tmp_path: Path) -> None:
    out = tmp_path / "prior"
    run = dpfy_train(
        "--access", "label", "--label-mechanism", "rr-prior", "--stages", "2",
        "--features-public", "--target-epsilon", "1", "--out", str(out), "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    md, document = _report(out)
    releases = document["accounting"]["releases"]
    assert [r["mechanism"] for r in releases] == ["rr", "rr-prior"]
    assert sum(r["labels"] for r in releases) == document["train_size"]
    assert document["accounting"]["epsilon"] == 1.0 and document["pitfalls"] == []
    assert "2 disjoint stages" in md


def test_input_run_says_the_data_carries_the_guarantee(tmp_path: Path) -> None:
    out = tmp_path / "input"
    run = dpfy_train("--access", "input", "--target-epsilon", "8", "--out", str(out), "--json")
    assert run.returncode == 0, run.stderr
    md, document = _report(out)
    assert "the data itself, not the model, carries the guarantee" in md
    assert "local DP, per record" in md
    assert document["accounting"]["laplace_scale"] == pytest.approx(64 / 4.0)  # Δ₁ = 64·1, ε_x = 4


def test_stages_with_plain_rr_are_one_clear_error() -> None:
    run = dpfy_train("--access", "label", "--stages", "3")
    assert run.returncode != 0
    assert "--stages applies to --access label --label-mechanism rr-prior only" in run.stderr
    assert "Traceback" not in run.stderr


def test_label_and_input_runs_refuse_user_level_or_ftrl() -> None:
    with pytest.raises(ValueError, match="drop --unit and --algorithm"):
        check_config(TrainConfig(access="label", unit="user", batch_size=10))
    with pytest.raises(ValueError, match="drop --unit and --algorithm"):
        check_config(TrainConfig(access="input", algorithm="dp-ftrl"))


def test_a_dataset_without_public_bounds_is_refused_for_input_level_dp() -> None:
    with pytest.raises(ValueError, match="no public feature bounds"):
        bounds_for("my-tabular-data", 3)


def test_access_names_match_their_registries() -> None:
    assert ACCESS_NAMES[0] == "full" and {"label", "input"} <= set(ACCESS_NAMES)
    assert LABEL_MECHANISM_NAMES == LABEL_MECHANISMS
    for name in ACCESS_NAMES:
        assert callable(access_job(name))
    with pytest.raises(ValueError, match="access must be one of"):
        access_job("everything")


def _full_training_facts() -> RunFacts:
    """A few DP-SGD steps of logistic regression on random data, and their facts."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=generator)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    run = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, (x[:, 0] > 0).long()),
        batch_size=16, steps=3, noise_multiplier=1.0, delta=1e-3, max_grad_norm=1.0, seed=0,
    )  # fmt: skip
    for xb, yb in rest_of_run(run.loader):
        run.optimizer.zero_grad()
        nn.functional.cross_entropy(run.model(xb), yb).backward()
        run.optimizer.step()
    return collect_facts(run, dataset_name="random", model_name="linear")


def test_full_training_reports_state_their_access_model_and_old_facts_still_load() -> None:
    facts = _full_training_facts()
    card = build_report(facts)
    assert card.to_json()["dp_setting"]["access"] == "full"
    assert "Access model: full-training DP (guide §3.2)" in card.to_markdown()
    older = facts.to_dict()
    del older["access"]  # a facts file written before the access model was recorded
    assert RunFacts.from_dict(older).access == AccessFacts()
    assert RunFacts.from_dict(facts.to_dict()) == facts


def test_access_pitfalls_flag_unbounded_input_and_seeded_randomisers() -> None:
    codes = {f.code for f in access_findings(AccessFacts("input", 1.0, seeded=True))}
    assert codes == {"input-dp-unbounded", "seeded-randomness"}
    assert access_findings(AccessFacts("label", 1.0, features_public=True)) == ()
    raw = AccessFacts("input", 1.0, bounds="pixels", labels_protected=False)
    assert "only the features are protected" in access_statement(raw)
    assert dataclasses.replace(raw, labels_protected=True).labels_protected


def test_dpfy_report_on_a_label_run_points_at_its_report_card(tmp_path: Path) -> None:
    out = tmp_path / "label"
    assert dpfy_train("--access", "label", "--features-public", "--out", str(out)).returncode == 0
    shown = run_dpfy("report", str(out))
    assert shown.returncode == 2
    assert f"is a --access label run: its report card is {out / 'report.md'}" in shown.stderr


@pytest.mark.parametrize("access", ["label", "input", "prediction"])
def test_a_one_shot_access_run_refuses_resume_before_claiming_a_directory(tmp_path, access):
    out = tmp_path / "run"
    config = TrainConfig(access=access, out=out)
    with pytest.raises(ValueError, match="no checkpoint to resume"):
        access_job(access)(config, resume=tmp_path / "earlier")
    assert not out.exists()
