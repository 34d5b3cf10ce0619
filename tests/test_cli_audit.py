"""``dpfy audit RUN_DIR``: the cost stated first, ε̂ beside the claim, the audit in the report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpfy.audit.scope import SCOPES
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
        "audit", str(trained), "--method", "classical", "--canaries", "20", "--blocks", "10",
        "--seed", "0",
    )  # fmt: skip
    assert code == 0, stderr
    cost = stdout.splitlines()[0]
    assert "re-runs the run's private step" in cost and "20 steps, about" in cost
    assert "classical: ε̂ = " in stdout and "≤ the claim" in stdout
    audits = json.loads((trained / "audit.json").read_text())["audits"]
    assert audits[-1]["method"] == "classical" and audits[-1]["threat_model"] == "white-box"
    facts = json.loads((trained / "facts.json").read_text())
    assert facts["audits"][-1] == {key: audits[-1][key] for key in facts["audits"][-1]}
    assert "Empirical audit" in (trained / "report.md").read_text()


def test_a_second_audit_is_added_beside_the_first(trained):
    before = len(json.loads((trained / "facts.json").read_text())["audits"])
    code, _, stderr = dpfy(
        "audit", str(trained), "--method", "one-run", "--canaries", "20", "--blocks", "5"
    )
    assert code == 0, stderr
    audits = json.loads((trained / "facts.json").read_text())["audits"]
    assert len(audits) == before + 1 and audits[-1]["method"] == "one-run"


def test_audit_json_holds_the_estimate_both_claims_and_the_paths(trained):
    code, stdout, stderr = dpfy(
        "audit", str(trained), "--method", "classical", "--canaries", "10", "--blocks", "5",
        "--seed", "1", "--json",
    )  # fmt: skip
    assert code == 0, stderr
    document = json.loads(stdout)  # one JSON object and nothing else on stdout
    audit = document["audits"][0]
    assert audit["method"] == "classical" and audit["epsilon_lower_bound"] >= 0
    run_epsilon = json.loads((trained / "report.json").read_text())["epsilon"]["total"]
    assert document["run_epsilon"] == pytest.approx(run_epsilon)
    assert audit["audit_claimed_epsilon"] != pytest.approx(run_epsilon)  # one step's, not the run's
    assert Path(document["paths"]["audit"]) == trained / "audit.json"
    code, stdout, _ = dpfy(
        "audit", str(trained), "--method", "classical", "--canaries", "10", "--blocks", "5",
        "--quiet",
    )  # fmt: skip
    assert code == 0 and stdout.strip() == str(trained / "audit.json")


def test_the_printed_claim_is_named_as_the_audited_parts_beside_the_runs(trained):
    code, stdout, _ = dpfy(
        "audit", str(trained), "--method", "classical", "--canaries", "10", "--blocks", "5"
    )
    assert code == 0
    line = next(line for line in stdout.splitlines() if line.startswith("classical: ε̂ = "))
    assert "for the part this audit tests; the whole run claims ε = " in line


def test_a_directory_without_a_run_is_one_error_line_naming_the_fix(tmp_path):
    code, stdout, stderr = dpfy("audit", str(tmp_path))
    assert code == 2 and stdout == ""
    assert stderr.strip().splitlines() == [
        f"error: {tmp_path} holds no facts.json; pass a run directory of `dpfy train`"
    ]


def test_an_unknown_method_is_refused_before_anything_runs(trained):
    code, _, stderr = dpfy("audit", str(trained), "--method", "guess")
    from dpfy.jobs.audit import AUDIT_METHODS

    assert code == 2 and "'--method'" in stderr and f"one of {', '.join(AUDIT_METHODS)}" in stderr
    assert len(stderr.strip().splitlines()) == 1 and "'guess'" in stderr


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
    assert "audited: a fresh re-run of the run's configuration" in stdout
    assert "not audited: the run's own trained model" in stdout
    audit = json.loads((trained / "audit.json").read_text())["audits"][-1]
    assert audit["scope"] == "re-trained-run" and "final model" in audit["audited"]
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


# --- what was audited, and the run's behaviour checks from training (issue 29, item 5) ------

CHECKS = {
    "collate": {"status": "passed", "probes": 8, "detail": "each row equals its row alone"},
    "model": {"status": "passed", "probes": 8, "detail": "outputs unchanged"},
    "loss": {"status": "not run", "probes": 0, "detail": "the loss was not probed"},
    # "state" missing on purpose: a check the run did not record is a gap too
}


def _copy_run(trained: Path, tmp_path: Path, checks: dict | None) -> Path:
    """A copy of the trained run (its own audits), with ``checks`` written into its facts.json.

    None stands for a run from before behaviour checks: the record is removed.
    """
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    facts = json.loads((run / "facts.json").read_text())
    facts["behaviour_checks"] = checks
    (run / "facts.json").write_text(json.dumps(facts, indent=2) + "\n")
    return run


def _audit_quickly(run: Path) -> str:
    code, stdout, stderr = dpfy(
        "audit", str(run), "--canaries", "20", "--blocks", "10", "--seed", "0"
    )
    assert code == 0, stderr
    return stdout


def test_the_audit_names_what_it_audited_and_what_it_did_not(trained, tmp_path):
    run = _copy_run(trained, tmp_path, None)
    stdout = _audit_quickly(run)
    assert "audited: the run's privacy plan" in stdout and "to a canary model" in stdout
    assert "not audited: the run's own model, loss and data pipeline" in stdout
    assert "batch statistics" in stdout
    row = json.loads((run / "audit.json").read_text())["audits"][-1]
    assert row["scope"] == "private-step"
    assert "applied by dpfy's private step to a canary model" in row["audited"]
    assert "the run's own model, loss and data pipeline" in row["not_audited"]
    assert "consistent with the claim" in row["statement"] and "canary model" in row["statement"]
    report = (run / "report.md").read_text()
    assert "not audited: the run's own model, loss and data pipeline" in report
    assert f"consistent with the claim for {SCOPES['private-step'].covers}" in report
    for line in report.splitlines():  # never without its scope, whichever audit it is
        if "consistent with the claim" in line:
            assert any(f"the claim for {scope.covers}" in line for scope in SCOPES.values()), line


def test_the_runs_behaviour_checks_show_up_in_the_audit_with_their_gaps(trained, tmp_path):
    run = _copy_run(trained, tmp_path, CHECKS)
    stdout = _audit_quickly(run)
    assert "collate: passed (8 probes)" in stdout and "model: passed (8 probes)" in stdout
    assert "loss: not run" in stdout and "state: not recorded" in stdout
    assert "gaps in what was verified: loss (not run), state (not recorded)" in stdout
    document = json.loads((run / "audit.json").read_text())
    assert document["behaviour_checks"] == CHECKS
    assert document["audits"][-1]["behaviour_checks"] == CHECKS
    assert document["behaviour_check_gaps"] == ["loss", "state"]
    report = (run / "report.md").read_text()
    assert "collate: passed (8 probes)" in report and "gaps in what was verified" in report
    facts = json.loads((run / "facts.json").read_text())
    assert facts["behaviour_checks"] == CHECKS  # the audit keeps the run's own record


def test_a_run_without_behaviour_checks_says_they_were_not_recorded(trained, tmp_path):
    run = _copy_run(trained, tmp_path, None)
    stdout = _audit_quickly(run)
    assert "behaviour checks: not recorded (the run predates behaviour checks)" in stdout
    document = json.loads((run / "audit.json").read_text())
    assert document["behaviour_checks"] is None
    assert "not recorded (the run predates behaviour checks)" in document["behaviour_statement"]
    assert "not recorded (the run predates behaviour checks)" in (run / "report.md").read_text()


def test_a_malformed_behaviour_check_is_one_error_line_naming_it(trained, tmp_path):
    run = _copy_run(trained, tmp_path, {"loss": {"status": "fine", "probes": 1, "detail": ""}})
    code, stdout, stderr = dpfy("audit", str(run), "--canaries", "20", "--blocks", "10")
    assert code == 2 and stdout == ""
    (line,) = stderr.strip().splitlines()
    assert "behaviour_checks.loss.status" in line and "not run" in line


# --- matrix-factorisation noise: the whole run re-run (issue 30, item 2) ------------------------


@pytest.fixture(scope="module")
def trained_bandmf(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("audit-bandmf") / "run"
    _, _, stderr = dpfy(
        "train", "--algorithm", "bandmf", "--model", "logreg", "--epochs", "2", "--out", str(out)
    )
    assert (out / "facts.json").is_file(), stderr
    return out


def test_a_bandmf_run_is_audited_whole_beside_its_claim_and_says_what_it_audited(trained_bandmf):
    from dpfy.jobs.audit import DEFAULT_FACTORISED_BLOCKS, default_blocks, load_run

    facts = load_run(trained_bandmf)
    assert default_blocks(facts) == DEFAULT_FACTORISED_BLOCKS  # whole re-runs, not 200 steps
    code, stdout, stderr = dpfy(
        "audit", str(trained_bandmf), "--method", "both", "--canaries", "300", "--blocks", "5",
        "--seed", "0",
    )  # fmt: skip
    assert code == 0, stderr
    said = " ".join(stdout.split())
    assert "re-runs the run's private step (bandmf per example" in said
    assert "matrix-factorisation noise (BandMF," in said and "re-runs all 22 steps" in said
    assert "330 steps, about" in said  # (5 in + 5 out + 5 one-run) whole runs of 22 steps
    assert "classical: ε̂ = " in said and "one-run: ε̂ = " in said
    assert said.count("≤ the claim, for what was audited") == 2
    assert "audited: the run's privacy plan" in said and "noise mechanism" in said
    claim = facts.accounting.summary.total_epsilon
    for audit in json.loads((trained_bandmf / "audit.json").read_text())["audits"][-2:]:
        assert audit["claimed_epsilon"] == pytest.approx(claim, rel=1e-6)  # the whole run's ε
        assert audit["epsilon_lower_bound"] <= audit["claimed_epsilon"]
        assert audit["scope"] == "private-step" and audit["threat_model"] == "white-box"
        assert any(note.startswith("mechanism: BandMF") for note in audit["notes"])
        assert any("one whole run of T = 22 steps" in note for note in audit["notes"])
    report = (trained_bandmf / "report.md").read_text()
    assert "one trial = one canary in one whole run of T = 22 steps" in report


def test_the_audit_plots_are_titled_with_the_audits_own_estimate_and_claim(
    trained, tmp_path, monkeypatch
):
    import dpfy.jobs.audit as job

    run = Path(shutil.copytree(trained, tmp_path / "run"))
    seen = []
    real = job.write_audit_plots

    def record(*args, **kwargs):
        seen.append(kwargs.get("result"))
        return real(*args, **kwargs)

    monkeypatch.setattr(job, "write_audit_plots", record)
    code, _, stderr = dpfy(
        "audit", str(run), "--method", "classical", "--canaries", "20", "--blocks", "10",
        "--seed", "0",
    )  # fmt: skip
    assert code == 0, stderr
    assert seen and seen[-1] is not None and seen[-1].method == "classical"
