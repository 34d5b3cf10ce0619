"""``dpfy audit RUN_DIR`` without options: the f-DP step audit on a Poisson DP-SGD run, ε̂ well
above 0 and at most the claim; the classical audit where the f-DP one does not apply."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpfy.audit.observe import StepSettings
from dpfy.audit.whitebox import chosen_method
from dpfy.cli.app import app


def dpfy(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("audit-default") / "run"
    _, _, stderr = dpfy("train", "--model", "logreg", "--epochs", "0.3", "--out", str(out))
    assert (out / "facts.json").is_file(), stderr
    return out


def test_the_default_audit_of_a_dp_sgd_run_is_the_f_dp_step_audit_and_comes_close(trained):
    code, stdout, stderr = dpfy("audit", str(trained), "--seed", "4")
    assert code == 0, stderr
    assert "on 10000 canaries: 100 steps" in stdout.splitlines()[0]
    audit = json.loads((trained / "audit.json").read_text())["audits"][-1]
    assert audit["method"] == "f-dp" and audit["confidence"] == 0.99  # a tight audit: stricter
    assert 0.5 * audit["claimed_epsilon"] <= audit["epsilon_lower_bound"]
    assert audit["epsilon_lower_bound"] <= audit["claimed_epsilon"]
    assert "What ε̂ means" in (trained / "report.md").read_text()


@pytest.mark.parametrize(
    ("changes", "method"),
    [
        ({}, "f-dp"),
        ({"algorithm": "dp-ftrl", "relation": "zero-out", "sampler": "fixed-order"}, "classical"),
        ({"sampler": "shuffle"}, "classical"),
    ],
)
def test_auto_chooses_the_f_dp_audit_only_where_its_trials_are_independent(changes, method):
    step = StepSettings(records=100, batch_size=10, noise_multiplier=1.0, max_grad_norm=1.0,
                        delta=1e-5)  # fmt: skip
    assert chosen_method(dataclasses.replace(step, **changes), "auto") == method
