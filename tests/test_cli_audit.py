"""``dpfy audit RUN_DIR``: the cost stated first, ε̂ beside the claim, the audit in the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpfy.cli.app import app


def dpfy(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("audit") / "run"
    _, _, stderr = dpfy("train", "--model", "logreg", "--epochs", "0.3", "--out", str(out))
    assert (out / "facts.json").is_file(), stderr
    return out


def test_audit_states_its_cost_then_records_epsilon_hat_beside_the_claim(trained):
    code, stdout, stderr = dpfy(
        "audit", str(trained), "--canaries", "20", "--blocks", "10", "--seed", "0"
    )
    assert code == 0, stderr
    cost = stdout.splitlines()[0]
    assert "re-runs the run's private step" in cost and "20 steps, about" in cost
    assert "classical: ε̂ = " in stdout and "≤ the claim" in stdout
    audits = json.loads((trained / "audit.json").read_text())["audits"]
    assert audits[-1]["method"] == "classical" and audits[-1]["threat_model"] == "white-box"
    facts = json.loads((trained / "facts.json").read_text())
    assert facts["audits"][-1] == audits[-1]
    assert "Empirical audit" in (trained / "report.md").read_text()


def test_a_second_audit_is_added_beside_the_first(trained):
    before = len(json.loads((trained / "facts.json").read_text())["audits"])
    code, _, stderr = dpfy(
        "audit", str(trained), "--method", "one-run", "--canaries", "20", "--blocks", "5"
    )
    assert code == 0, stderr
    audits = json.loads((trained / "facts.json").read_text())["audits"]
    assert len(audits) == before + 1 and audits[-1]["method"] == "one-run"


def test_a_directory_without_a_run_is_one_error_line_naming_the_fix(tmp_path):
    code, stdout, stderr = dpfy("audit", str(tmp_path))
    assert code == 2 and stdout == ""
    assert stderr.strip().splitlines() == [
        f"error: {tmp_path} holds no facts.json; pass a run directory of `dpfy train`"
    ]


def test_an_unknown_method_is_refused_before_anything_runs(trained):
    code, _, stderr = dpfy("audit", str(trained), "--method", "guess")
    assert code == 2 and "--method must be one of classical, one-run, both" in stderr


def test_a_run_of_another_access_model_is_refused_naming_what_can_be_audited(tmp_path):
    (tmp_path / "report.json").write_text("{}\n")  # what label/input/prediction runs leave
    code, stdout, stderr = dpfy("audit", str(tmp_path))
    assert code == 2 and stdout == ""
    (line,) = stderr.strip().splitlines()
    assert "nothing to audit" in line and "--access full" in line


def _plots(run_dir: Path) -> dict[str, dict[str, str]]:
    return json.loads((run_dir / "audit.json").read_text())["plots"]


def test_each_audit_writes_its_score_plots_and_roc_named_in_audit_json(trained):
    code, _, stderr = dpfy(
        "audit", str(trained), "--method", "both", "--canaries", "20", "--blocks", "10",
        "--seed", "1",
    )  # fmt: skip
    assert code == 0, stderr
    audits = json.loads((trained / "audit.json").read_text())["audits"]
    plots = _plots(trained)
    for index in (len(audits) - 2, len(audits) - 1):
        named = plots[str(index)]
        assert sorted(named) == ["roc", "scores"]
        for relative in named.values():
            path = trained / relative
            assert path.parent == trained / "audit"
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert audits[-2]["method"] in plots[str(len(audits) - 2)]["scores"]


def test_black_box_audit_states_the_extra_run_then_records_a_black_box_bound(trained):
    code, stdout, stderr = dpfy(
        "audit", str(trained), "--method", "black-box", "--canaries", "100", "--seed", "0"
    )
    assert code == 0, stderr
    assert stdout.startswith("re-trains the run's configuration once")
    assert "one extra training run of" in stdout and "model, accuracy and privacy ledger" in stdout
    audit = json.loads((trained / "audit.json").read_text())["audits"][-1]
    assert audit["method"] == "one-run" and audit["threat_model"] == "black-box"
    assert audit["canaries"] == 100 and audit["epsilon_lower_bound"] <= audit["claimed_epsilon"]
    index = str(len(json.loads((trained / "facts.json").read_text())["audits"]) - 1)
    assert (trained / _plots(trained)[index]["roc"]).is_file()
    assert "black-box" in (trained / "report.md").read_text()


def test_black_box_audit_with_too_many_canaries_is_one_error_line(trained):
    code, stdout, stderr = dpfy(
        "audit", str(trained), "--method", "black-box", "--canaries", "5000"
    )
    assert code == 2 and stdout == ""
    (line,) = stderr.strip().splitlines()
    assert "more than half of the" in line and "use at most" in line


def test_black_box_audit_of_a_user_level_run_is_refused_naming_the_white_box_audit(trained):
    import dataclasses

    from dpfy.jobs.audit import AuditConfig, load_run, plan_cost

    facts = load_run(trained)
    user_level = dataclasses.replace(facts, privacy=dataclasses.replace(facts.privacy, unit="user"))
    with pytest.raises(ValueError, match=r"re-trains example-level DP-SGD runs.*--method one-run"):
        plan_cost(user_level, AuditConfig("black-box"), trained)
